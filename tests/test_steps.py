"""The compiled train step against a single-device reference on the whole batch.

ResNet-8 cut to one BasicBlock of 8 channels (stem conv + BN, the block's two convs and
BNs, the residual, the head: every layer kind, a fraction of the full model's compile time)
for the steps compared with the reference; the bucket kernel order on the full ResNet-8
(its stages' convolution paths)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import (assert_within_reorder_rounding, max_rel, put_like, random_batch, setup,
                     reference_step_fn, to_host)
from trjax import aot, exchange, models, parallel, steps
from trjax.objective import StepOptions
from trjax.plan import build_plan
from trjax.state import check_replicas_identical


SMALL = dict(stage_sizes=(1,), widths=(8,), stem_width=8)


def _small_setup(world_spec, bn_mode, opt="sgd"):
    """helpers.setup(world_spec, 32, bn_mode, opt=opt) for the SMALL ResNet-8."""
    from trjax import optim
    from trjax.state import create_train_state
    from trjax.world import make_world
    world = make_world(world_spec, 32)
    model = models.create_model("resnet8", num_classes=10, bn_mode=bn_mode, axis_name="data",
                                **SMALL)
    plan = build_plan(model, (8, 8, 1))
    tx = optim.make_optimizer(opt, 0.1, plan, weight_decay=1e-3)
    state = create_train_state(jax.random.key(0),
                               parallel.data_parallel(model, world, (8, 8, 1), bn_mode),
                               exchange.allreduce(tx, plan))
    return world, model, plan, tx, state


_COMPILED = {}


def _compiled(world_spec, bn_mode, opt="sgd", padding=True):
    """``(world, model, plan, tx, host start state, start state, step)`` of _small_setup's
    state and its train step (global batch 32, donating), compiled once for the module: the
    start state is never handed to the step (each run gets a fresh copy, helpers.put_like)."""
    key = (world_spec, bn_mode, opt, padding)
    if key not in _COMPILED:
        world, model, plan, tx, state = _small_setup(world_spec, bn_mode, opt=opt)
        step = aot.compile_step("train", steps.make_train_step(
            parallel.data_parallel(model, world, (8, 8, 1), bn_mode),
            exchange.allreduce(tx, plan), plan, StepOptions(padding=padding)),
            state, jax.device_put(random_batch(32), world.sharded()), donate_argnums=0)
        _COMPILED[key] = (world, model, plan, tx, to_host(state), state, step)
    return _COMPILED[key]


_REFERENCES = {}


def _reference_step(params, batch_stats, opt_state, tx, batch):
    """The one-device reference, compiled as one program, traced once per optimizer and
    batch shape for the module."""
    if id(tx) not in _REFERENCES:
        _REFERENCES[id(tx)] = (tx, reference_step_fn("resnet8", tx, **SMALL))
    return _REFERENCES[id(tx)][1](params, batch_stats, opt_state, batch)


def _run_one_step(world_spec, bn_mode, batch, opt="sgd", padding=True):
    world, _, _, tx, host0, like, step = _compiled(world_spec, bn_mode, opt, padding)
    new_state, metrics = step(put_like(host0, like), jax.device_put(batch, world.sharded()))
    return world, tx, host0, new_state, np.asarray(metrics)


@pytest.mark.parametrize("opt", ["sgd", "lars"])
def test_sync_bn_8_devices_equals_one_device_on_global_batch(opt):
    batch = random_batch(32)
    _, tx, s0, s1, metrics = _run_one_step("all", "sync", batch, opt)
    p_ref, bs_ref, _, loss_ref, _ = _reference_step(s0.params, s0.batch_stats, s0.opt_state,
                                                     tx, batch)
    assert max_rel(to_host(s1.params), p_ref) <= 1e-5
    assert max_rel(to_host(s1.batch_stats), bs_ref) <= 1e-5
    assert metrics[3] == 32 and metrics[4] == 1.0
    assert abs(metrics[0] / metrics[3] - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))


@pytest.mark.parametrize("bn_mode", ["sync", "running"])
def test_step_without_padding_mask_equals_the_reference_and_the_masked_step(bn_mode):
    """padding=False (every row real: BatchNorm traced without the mask) on a full batch:
    in sync mode the one-device reference on the whole batch within 1e-5 (running mode
    normalises with each device's own statistics), and the masked step within
    the rounding of reordered sums (XLA fuses the two programs differently; measured
    not bit for bit), with the same count."""
    batch = random_batch(32, seed=5)
    _, tx, s0, masked, m_masked = _run_one_step("all", bn_mode, batch)
    _, _, _, plain, m_plain = _run_one_step("all", bn_mode, batch, padding=False)
    if bn_mode == "sync":
        p_ref, bs_ref, _, loss_ref, _ = _reference_step(s0.params, s0.batch_stats, s0.opt_state,
                                                     tx, batch)
        assert max_rel(to_host(plain.params), p_ref) <= 1e-5
        assert max_rel(to_host(plain.batch_stats), bs_ref) <= 1e-5
        assert abs(m_plain[0] / m_plain[3] - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
    rows = 32 * 8 * 8  # the longest sums: BN statistics and kernel gradients, rows x positions
    for got, want, start in ((plain.params, masked.params, s0.params),
                             (plain.batch_stats, masked.batch_stats, s0.batch_stats)):
        assert_within_reorder_rounding(to_host(got), to_host(want), start, rows)
    assert m_plain[3] == m_masked[3] == 32 and m_plain[4] == m_masked[4] == 1.0
    assert abs(m_plain[0] - m_masked[0]) <= 32 * 2.0 ** -24 * abs(m_masked[0])


def test_applied_gradient_is_global_mean():
    """With plain SGD (no momentum history yet, no decay) the update is -lr * grad."""
    batch = random_batch(32, seed=3)
    world, model, plan, _, host0, like, _ = _compiled("all", "sync")
    state = put_like(host0, like)
    tx = optax.sgd(1.0)
    state = state.replace(
        opt_state=jax.jit(tx.init, out_shardings=world.replicated())(state.params))
    s0 = to_host(state)
    step = aot.compile_step("train", steps.make_train_step(
        parallel.data_parallel(model, world, (8, 8, 1), "sync"),
        exchange.allreduce(tx, plan), plan),
        state, jax.device_put(batch, world.sharded()), donate_argnums=0)
    s1, _ = step(state, jax.device_put(batch, world.sharded()))
    applied = jax.tree_util.tree_map(lambda a, b: a - b, s0.params, to_host(s1.params))
    *_, grads_ref = _reference_step(s0.params, s0.batch_stats, s0.opt_state, tx, batch)
    ratio = [np.sum(a * g) / np.sum(g * g) for a, g in zip(jax.tree_util.tree_leaves(applied),
                                                          jax.tree_util.tree_leaves(grads_ref))]
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-4)  # not 8x, not 1/8x
    assert max_rel(applied, grads_ref) <= 1e-5


def test_running_mode_replicas_hold_identical_stats():
    batch = random_batch(32, seed=1)
    _, _, s0, s1, _ = _run_one_step("all", "running", batch)
    for leaf in jax.tree_util.tree_leaves(s1.batch_stats):
        shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        assert len(shards) == 8 and len(set(shards)) == 1
    # and they moved away from the initial statistics
    assert max_rel(to_host(s1.batch_stats), s0.batch_stats) > 1e-3


def test_running_mode_stats_are_the_global_batch_statistics():
    """running = every replica's local per-channel (sum x, sum x^2, n) added over replicas,
    then the running update (unbiased n/(n-1) on the global n): NOT the equal-weight mean of
    the replicas' local running-stat updates (that misses the spread of the local means)."""
    batch = random_batch(32, seed=2)
    _, tx, s0, s1, _ = _run_one_step("0-3", "running", batch)
    local = models.create_model("resnet8", num_classes=10, bn_mode="local", axis_name=None,
                                **SMALL)
    forward = jax.jit(lambda x, mask: local.apply(  # one program, not op by op
        {"params": s0.params, "batch_stats": s0.batch_stats}, x, train=True, mask=mask,
        mutable=["batch_stats", "bn_sums"])[1])
    sums = []
    for r in range(4):  # each replica's own forward, its own rows
        v = forward(batch["image"][8 * r:8 * r + 8], batch["mask"][8 * r:8 * r + 8])
        sums.append(to_host(v["bn_sums"]))
    total = jax.tree_util.tree_map(lambda *xs: np.sum(np.stack(xs).astype(np.float64), 0), *sums)

    def want(old, sm):  # numpy, from the summed moments
        c = (sm.size - 1) // 2
        n = sm[-1]
        mean = sm[:c] / n
        var = (sm[c:2 * c] / n - mean ** 2) * n / (n - 1)
        return {"mean": 0.9 * old["mean"] + 0.1 * mean, "var": 0.9 * old["var"] + 0.1 * var}

    def walk(old, sm):
        return want(old, sm["sums"]) if "mean" in old else {k: walk(old[k], sm[k]) for k in old}

    assert max_rel(to_host(s1.batch_stats), walk(s0.batch_stats, total)) <= 1e-5
    equal_weight = jax.tree_util.tree_map(
        lambda *xs: np.mean(np.stack(xs), 0),
        *[_reference_step(s0.params, s0.batch_stats, s0.opt_state, tx,
                          {k: v[8 * r:8 * r + 8] for k, v in batch.items()})[1] for r in range(4)])
    assert max_rel(to_host(s1.batch_stats), equal_weight) > 1e-4  # the seed's rule differs


def test_local_mode_replicas_diverge():
    batch = random_batch(32, seed=4)
    _, _, _, s1, _ = _run_one_step("all", "local", batch)
    leaf = np.asarray(jax.tree_util.tree_leaves(s1.batch_stats)[0])
    assert leaf.shape[0] == 8 and not np.allclose(leaf[0], leaf[1])


def test_replicas_start_identical_and_from_rank0():
    world, model, plan, tx, _, state, _ = _compiled("all", "sync")
    check_replicas_identical(state.params)
    # rank 0's init key is fold_in(key, 0): the broadcast must deliver exactly that init
    init = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8, 8, 1)), train=False))  # one program
    key0 = jax.random.fold_in(jax.random.key(0), 0)
    v = init(key0)
    assert max_rel(to_host(state.params), to_host(v["params"])) == 0.0
    key1 = jax.random.fold_in(jax.random.key(0), 1)
    v1 = init(key1)
    assert max_rel(to_host(state.params), to_host(v1["params"])) > 0.0


def test_compiled_step_rejects_other_shapes():
    batch = random_batch(32)
    world, _, _, _, host0, like, step = _compiled("all", "sync")  # the module's step
    state, calls = put_like(host0, like), step.calls
    small = jax.device_put(random_batch(16), world.sharded())
    with pytest.raises(TypeError, match=r"\['image'\] is \(16, 8, 8, 1\) float32 but the step was compiled for \(32, 8, 8, 1\)"):
        step(state, small)
    bad = dict(jax.device_put(batch, world.sharded()))
    bad["label"] = bad["label"].astype(jnp.float32)
    with pytest.raises(TypeError, match=r"\['label'\] is \(32,\) float32 .* \(32,\) int32"):
        step(state, bad)
    assert step.calls == calls  # refused before running


def test_compiled_step_rejects_other_sharding():
    batch = random_batch(32)
    world, _, _, _, host0, like, step = _compiled("all", "sync")  # the module's step
    state, calls = put_like(host0, like), step.calls
    replicated = jax.device_put(batch, world.replicated())
    with pytest.raises(TypeError, match=r"argument \[1\]\['image'\] has sharding .* but the step "
                                        r"was compiled for"):
        step(state, replicated)
    assert step.calls == calls


def _deep_bucket_producers(hlo: str) -> list[str]:
    """Opcodes of the instructions concatenated into the deep bucket's all-reduce."""
    import re
    defs = dict(re.findall(r"%([\w.\-]+) = \S+ ([\w\-]+)\(", hlo))
    for operand in re.findall(r"= f32\[\d+\]\{0\} all-reduce\(%([\w.\-]+)\)", hlo):
        if defs.get(operand) == "concatenate":
            line = re.search(rf"%{re.escape(operand)} = \S+ concatenate\((.*?)\)", hlo).group(1)
            return [defs.get(o, "?") for o in re.findall(r"%([\w.\-]+)", line)]
    raise AssertionError("no concatenated bucket feeds an all-reduce")


def test_kernel_order_ihwo_equals_hwio_and_packs_without_transposes():
    """The IHWO bucket order changes where each element sits, not its value: the
    step equals the HWIO one (parameters bitwise; the momentum to within 1 ulp,
    where XLA fuses the update differently). On XLA:CPU it turns the transposes
    in front of the bucket's concatenate into bitcasts of the weight-gradient
    convolutions' outputs (all but the last stage, whose 2x2 maps take another
    convolution path at this image size). XLA's convolutions only
    (``conv_lowering="xla"``): an im2col kernel gradient is a matmul's output,
    already in HWIO order."""
    batch = random_batch(32, seed=5)
    world, model, _, tx, state = setup("all", 32, "running", conv_lowering="xla")
    out, producers = {}, {}
    layout = parallel.data_parallel(model, world, (8, 8, 1), "running")
    for order in ("HWIO", "IHWO"):
        plan = build_plan(model, (8, 8, 1), "two", order)
        step = aot.compile_step("train", steps.make_train_step(
            layout, exchange.allreduce(tx, plan), plan),
            state, jax.device_put(batch, world.sharded()))
        out[order] = to_host(step(state, jax.device_put(batch, world.sharded())))
        producers[order] = _deep_bucket_producers(step.hlo_text())
    for a, b in zip(jax.tree_util.tree_leaves(out["HWIO"][0].params),
                    jax.tree_util.tree_leaves(out["IHWO"][0].params)):
        assert a.tobytes() == b.tobytes()
    assert max_rel(out["IHWO"], out["HWIO"]) <= 1e-6
    # stage 1 and 2 kernels: transpose fusions under HWIO, bitcasts under IHWO
    assert producers["HWIO"][:4] == ["fusion"] * 4, producers
    assert producers["IHWO"][:8] == ["bitcast"] * 8, producers
    assert producers["IHWO"].count("fusion") < producers["HWIO"].count("fusion")


def test_loss_scaled_step_applies_the_unscaled_gradient():
    """Issue 17 item 4: with dynamic loss scaling (scale 1024) the applied update equals the
    single-device reference's: the gradient is divided by the scale exactly once (a step
    that forgets it moves the parameters ~1025x too far). The scale then grows after
    ``growth_interval`` good steps."""
    from trjax.state import create_train_state
    batch = random_batch(32, seed=4)
    world, model, plan, tx, _, _, _ = _compiled("all", "sync")
    ex = exchange.allreduce(tx, plan)
    layout = parallel.data_parallel(model, world, (8, 8, 1), "sync")
    state = create_train_state(jax.random.key(0), layout, ex, loss_scale=1024.0)
    s0 = to_host(state)
    step = aot.compile_step("train", steps.make_train_step(
        layout, ex, plan, StepOptions(dynamic_loss_scale=True, growth_interval=1)),
        state, jax.device_put(batch, world.sharded()), donate_argnums=0)
    s1, m = step(state, jax.device_put(batch, world.sharded()))
    p_ref, bs_ref, _, loss_ref, _ = _reference_step(s0.params, s0.batch_stats, s0.opt_state,
                                                     tx, batch)
    assert max_rel(to_host(s1.params), p_ref) <= 1e-5
    assert max_rel(to_host(s1.batch_stats), bs_ref) <= 1e-5
    assert float(s1.loss_scale) == 2048.0 and int(s1.skipped_steps) == 0
    # the reported loss is the unscaled one
    np.testing.assert_allclose(float(m[0]) / 32, float(loss_ref), rtol=1e-5)
