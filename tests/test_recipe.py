"""Issue 30's optimizer recipe: grad_clip_norm, adamw, ema_decay and the tx= hook, each
pinned against an independent reference; and issue 32's table, by parameter name, of
which ResNet-8 leaves get weight decay, the LARS trust ratio and compression.

Most checks run the gradient exchange alone (``exchange.update`` in a ``shard_map``
over random per-device bucket sums: a small program, no model), against optax on one
device applied to the global mean gradient computed here in float64. One test runs the
whole train step (the tx= hook against helpers.reference_step on the whole batch; the
EMA against numpy, through a skipped step and a checkpoint resume).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import IMAGE_SHAPE, max_rel, random_batch, reference_step, small_config, to_host
from trjax import aot, compression, exchange, models, optim, parallel, steps
from trjax.metrics import METRICS
from trjax.plan import build_plan, layer_matrices, shard_layout
from trjax.state import create_train_state
from trjax.train import checkpoint, config as config_lib
from trjax.world import make_world

COUNT = METRICS.index("count")

# ---------------------------------------------------------------------------------------
# Issue 32: the table, written by hand from the ResNet-8 definition (trjax/models.py), not
# from trjax's regions. Path: (weight decay, LARS trust ratio, compressed). The rule it
# writes out: every conv and dense kernel gets decay and the trust ratio; BN scales and
# biases and the dense bias get neither. Under the default "two" buckets with
# compression_min_fraction 0.05, the deep convs' bucket is compressed; the stem conv,
# BN and dense leaves share the small bucket (1466 of 77758 elements), sent exactly.
RESNET8 = {
    "stem_conv/kernel": (True, True, False),
    "stem_bn/scale": (False, False, False),
    "stem_bn/bias": (False, False, False),
    **{f"{block}/{leaf}": flags
       for block, has_proj in (("stage1_block1", False), ("stage2_block1", True),
                               ("stage3_block1", True))
       for leaf, flags in (("Conv_0/kernel", (True, True, True)),
                           ("Conv_1/kernel", (True, True, True)),
                           ("BatchNorm_0/scale", (False, False, False)),
                           ("BatchNorm_0/bias", (False, False, False)),
                           ("BatchNorm_1/scale", (False, False, False)),
                           ("BatchNorm_1/bias", (False, False, False)),
                           *((("proj_conv/kernel", (True, True, True)),
                              ("proj_bn/scale", (False, False, False)),
                              ("proj_bn/bias", (False, False, False))) if has_proj else ()))},
    "head/kernel": (True, True, False),
    "head/bias": (False, False, False),
}
DECAY, TRUST, COMPRESSED = 0, 1, 2


def _by_path(tree) -> dict:
    return {"/".join(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _resnet8(world_axis="data", policy="two"):
    model = models.create_model("resnet8", num_classes=10, bn_mode="sync", axis_name=world_axis)
    return model, build_plan(model, IMAGE_SHAPE, policy)


@pytest.mark.parametrize("policy", ["two", "tail_minimal", "per_leaf"])
def test_the_table_by_name_matches_decay_lars_and_zero1_masks(policy):
    model, plan = _resnet8(policy=policy)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1,) + IMAGE_SHAPE),
                                               train=False))["params"]
    assert set(_by_path(shapes)) == set(RESNET8)  # the table names every leaf, no other
    want = lambda col: {k: v[col] for k, v in RESNET8.items()}
    assert _by_path(optim.kernel_mask(plan)) == want(DECAY)
    ones = jax.tree_util.tree_map(lambda s: np.ones(s.shape, np.float32), shapes)
    zeros = jax.tree_util.tree_map(np.zeros_like, ones)

    def update(tx, grads, params):
        return _by_path(jax.jit(tx.update)(grads, tx.init(params), params)[0])

    # decay: zero gradients, so only the decay term moves a leaf
    for name in ("sgd", "adamw"):
        tx = optim.make_optimizer(name, 1.0, plan, momentum=0.0, weight_decay=1.0)
        got = {k: bool(np.any(u != 0)) for k, u in update(tx, zeros, ones).items()}
        assert got == want(DECAY), name
    lars = lambda wd, tc: optim.make_optimizer("lars", 1.0, plan, momentum=0.0,
                                               weight_decay=wd, trust_coefficient=tc)
    got = {k: bool(np.any(u != 0)) for k, u in update(lars(1.0, 1.0), zeros, ones).items()}
    assert got == want(DECAY)
    # the trust ratio: g = 1, w = 2, no decay: 0.25 * ||w|| / ||g|| = 0.5 on kernels, 1 elsewhere
    twos = jax.tree_util.tree_map(lambda x: 2 * x, ones)
    got = {k: float(np.unique(np.asarray(u)).item()) for k, u in
           update(lars(0.0, 0.25), ones, twos).items()}
    assert got == {k: -0.5 if t else -1.0 for k, t in want(TRUST).items()}
    # ZeRO-1's per-element decay flags, read back by leaf
    layout = shard_layout(plan, 8)
    for slot in plan.slots:
        flags = layout[slot.bucket][1][slot.offset:slot.offset + slot.size]
        assert set(flags.tolist()) == {float(RESNET8[slot.name.removeprefix("params/")][DECAY])}


def test_the_table_by_name_matches_what_compression_compresses():
    c = small_config()  # the default buckets and compression_min_fraction
    model, plan = _resnet8(policy=c.buckets)
    marker = compression.none()._replace(init=lambda buffer: "compressed")
    per_bucket = exchange.exact_below(plan, lambda b: marker, c.compression_min_fraction)
    got = {s.name.removeprefix("params/"): per_bucket[s.bucket] is marker for s in plan.slots}
    assert got == {k: v[COMPRESSED] for k, v in RESNET8.items()}
    # PowerSGD's matrices in the compressed buckets: one per compressed kernel, nothing else
    mb, mo = plan.metrics_slot
    matrices = {(b, off) for b in per_bucket if per_bucket[b] is marker
                for off, _, _ in layer_matrices(plan, b)}
    named = {(s.bucket, s.offset - (len(METRICS) if s.bucket == mb and s.offset > mo else 0))
             for s in plan.slots if RESNET8[s.name.removeprefix("params/")][COMPRESSED]}
    assert matrices == named


# ---------------------------------------------------------------------------------------
# The exchange alone: random per-device bucket sums in, new params and state out.

@pytest.fixture(scope="module")
def bed():
    world = make_world("all", 32)
    model, plan = _resnet8(world.axis_name)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1,) + IMAGE_SHAPE),
                                               train=False))["params"]
    rng = np.random.default_rng(0)
    params0 = jax.tree_util.tree_map(
        lambda s: (0.1 * rng.normal(size=s.shape)).astype(np.float32), shapes)
    n = world.world_size
    mb, mo = plan.metrics_slot
    bufs = []
    for _ in range(3):
        step = {b: rng.normal(size=(n, size)).astype(np.float32)
                for b, size in plan.bucket_elements.items()}
        step[mb][:, mo:mo + len(METRICS)] = 0.0
        step[mb][:, mo + COUNT] = 4.0  # 4 real rows per device: the mean is sum / 32
        bufs.append(step)
    return world, plan, params0, bufs


def _mean_gradient(plan, bufs):
    """The global mean gradient: the per-device sums added in float64, over the count."""
    mb, mo = plan.metrics_slot
    count = bufs[mb][:, mo + COUNT].sum()
    grads, _ = plan.unpack({b: (v.astype(np.float64).sum(0) / count).astype(np.float32)
                            for b, v in bufs.items()})
    return to_host(grads)


def _run_exchange(ex, world, params0, bufs_seq, norms=None):
    """``len(bufs_seq)`` updates of ``ex`` on every device; the params after each and the
    final optimizer state, on the host (``norms``: a list that gets each update's
    ``grad_norm``)."""
    axis = world.axis_name
    params = jax.tree_util.tree_map(world.put, params0)
    opt_state, comm_state = ex.init(params, world)
    opt_specs, comm_specs = ex.specs(axis)

    def local(bufs, params, opt_state, comm_state, step):  # step: the train step's counter
        up = ex.update({b: v[0] for b, v in bufs.items()}, params, opt_state, comm_state,
                       step, None, axis)
        return up.params, up.opt_state, up.comm_state, up.finite, up.grad_norm

    f = jax.jit(jax.shard_map(local, mesh=world.mesh,
                              in_specs=(P(axis), P(), opt_specs, comm_specs, P()),
                              out_specs=(P(), opt_specs, comm_specs, P(), P()),
                              check_vma=ex.check_vma))
    history = []
    for t, bufs in enumerate(bufs_seq):
        params, opt_state, comm_state, finite, norm = f(
            {b: world.put(v, world.sharded()) for b, v in bufs.items()},
            params, opt_state, comm_state, jnp.int32(t))
        assert bool(finite)
        history.append(to_host(params))
        if norms is not None:
            norms.append(float(norm))
    return history, to_host(opt_state)


def _run_one_device(tx, params0, grads_seq):
    """optax on one device: ``tx`` on the given mean gradients, params after each update."""
    update = jax.jit(tx.update)
    params, state, history = params0, tx.init(params0), []
    for g in grads_seq:
        updates, state = update(g, state, params)
        params = to_host(optax.apply_updates(params, updates))
        history.append(params)
    return history


def _name_mask(tree):
    """The decay mask of the table, as a pytree shaped like ``tree``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: RESNET8["/".join(k.key for k in path)][DECAY], tree)


@pytest.mark.parametrize("zero1", [False, True], ids=["replicated", "zero1"])
def test_grad_clip_norm_clips_the_global_mean_gradient(bed, zero1):
    """One momentum-SGD step with decay: ``p - lr * (clip(g) + wd * mask * p)``, the clip
    being optax.clip_by_global_norm on one device of the global mean gradient; ZeRO-1's
    norm comes from every shard (a psum of the shards' squared norms). The update's
    grad_norm (the step's metric) is that norm before the clip, as numpy computes it in
    float64 from the per-device sums on data:8."""
    world, plan, params0, bufs = bed
    g = _mean_gradient(plan, bufs[0])
    norm = float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2)
                             for x in jax.tree_util.tree_leaves(g))))
    max_norm, lr, wd = 0.5 * norm, 0.1, 1e-2  # the clip is active: it halves the gradient
    cfg = small_config(grad_clip_norm=max_norm, weight_decay=wd, shard_optimizer_state=zero1)
    config_lib.validate(cfg, world.world_size)
    ex = exchange.from_config(cfg, plan, lr, world)
    norms = []
    (got,), _ = _run_exchange(ex, world, params0, bufs[:1], norms)
    assert world.world_size == 8
    # float32 squares summed over 77,758 elements (<= n u_32 relative), then a square root
    np.testing.assert_allclose(norms, [norm], rtol=plan.gradient_bytes / 4 * 2.0 ** -24)
    clipped, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
    for k, p0 in _by_path(params0).items():  # the hand computation, by name
        want = p0 - lr * (_by_path(to_host(clipped))[k] + wd * RESNET8[k][DECAY] * p0)
        np.testing.assert_allclose(_by_path(got)[k], want, rtol=1e-5, atol=1e-7, err_msg=k)
    scale = max_norm / norm
    np.testing.assert_allclose(_by_path(to_host(clipped))["head/bias"],
                               _by_path(g)["head/bias"] * scale, rtol=1e-5)


@pytest.mark.parametrize("zero1", [False, True], ids=["replicated", "zero1"])
def test_adamw_three_steps_equal_optax_adamw_on_one_device(bed, zero1):
    """config.optimizer='adamw' (its own b1, b2, eps keys; decay on kernels only, by the
    table) equals optax.adamw on the global mean gradients, step for step."""
    world, plan, params0, bufs = bed
    lr, wd, b1, b2, eps = 1e-3, 0.05, 0.8, 0.99, 1e-6
    cfg = small_config(optimizer="adamw", learning_rate=lr, weight_decay=wd, adam_b1=b1,
                       adam_b2=b2, adam_eps=eps, shard_optimizer_state=zero1)
    config_lib.validate(cfg, world.world_size)
    schedule = optim.learning_rate_schedule(lr, 0, 4)  # a moving (cosine) learning rate
    got, _ = _run_exchange(exchange.from_config(cfg, plan, schedule, world), world, params0,
                           bufs)
    ref = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd,
                      mask=_name_mask(params0))
    want = _run_one_device(ref, params0, [_mean_gradient(plan, b) for b in bufs])
    for t, (a, b) in enumerate(zip(got, want)):
        moved = jax.tree_util.tree_map(lambda x, y: x - y, b, params0)
        assert max_rel(jax.tree_util.tree_map(lambda x, y: x - y, a, params0), moved) <= 1e-4, t
        assert max_rel(a, b) <= 1e-6, t


def test_zero1_with_clip_adamw_and_ema_equals_one_device(bed):
    """Everything at once under ZeRO-1: the clip (global norm over shards), AdamW on
    1/N shards and the EMA of the all-gathered params, against optax and numpy."""
    world, plan, params0, bufs = bed
    grads = [_mean_gradient(plan, b) for b in bufs]
    norm = float(optax.tree.norm(grads[0]))
    lr, wd, d = 1e-3, 0.05, 0.75
    cfg = small_config(optimizer="adamw", weight_decay=wd, shard_optimizer_state=True,
                       grad_clip_norm=0.5 * norm, ema_decay=d)
    ex = exchange.from_config(cfg, plan, lr, world)
    assert ex.name == "shard_optimizer_state+ema"
    got, opt_state = _run_exchange(ex, world, params0, bufs)
    ref = optax.chain(optax.clip_by_global_norm(0.5 * norm),
                      optax.adamw(lr, weight_decay=wd, mask=_name_mask(params0)))
    want = _run_one_device(ref, params0, grads)
    assert max_rel(got[-1], want[-1]) <= 1e-6
    ema = params0
    for p in got:
        ema = jax.tree_util.tree_map(lambda e, q: d * e + (1.0 - d) * q, ema, p)
    assert max_rel(exchange.ema_params(opt_state), ema) <= 1e-6


def test_compressed_exchange_clips_and_averages_the_decompressed_mean(bed):
    """Under bf16 compression the clip and the EMA act on the decompressed mean, the same
    on every replica: the one-device reference up to bf16's rounding of the sums."""
    world, plan, params0, bufs = bed
    grads = [_mean_gradient(plan, b) for b in bufs[:2]]
    norm, lr, d = float(optax.tree.norm(grads[0])), 0.1, 0.5
    cfg = small_config(compression="bf16", compression_min_fraction=0.0, weight_decay=0.0,
                       grad_clip_norm=0.5 * norm, ema_decay=d)
    got, opt_state = _run_exchange(exchange.from_config(cfg, plan, lr, world), world, params0,
                                   bufs[:2])
    ref = optax.chain(optax.clip_by_global_norm(0.5 * norm), optax.sgd(lr, momentum=0.9))
    want = _run_one_device(ref, params0, grads)
    moved = lambda t: jax.tree_util.tree_map(lambda x, y: x - y, t, params0)
    assert max_rel(moved(got[-1]), moved(want[-1])) <= 2 ** -7  # bf16: 8 significant bits
    ema = jax.tree_util.tree_map(lambda p0, p1, p2: d * (d * p0 + (1 - d) * p1) + (1 - d) * p2,
                                 params0, *got)
    assert max_rel(exchange.ema_params(opt_state), ema) <= 1e-6


def test_a_user_tx_is_refused_with_zero1_and_must_be_a_transformation(bed):
    world, plan, _, _ = bed
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True \(ZeRO-1\).*elementwise"):
        exchange.from_config(small_config(shard_optimizer_state=True), plan, 0.1, world,
                             tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        exchange.from_config(small_config(), plan, 0.1, world, tx="sgd")
    seen = []
    ex = exchange.from_config(small_config(), plan, 0.1, world,
                              tx=lambda p, lr: seen.append((p, lr)) or optax.sgd(lr))
    assert seen == [(plan, 0.1)]
    assert ex.checkpoint_keys(world) == {"optimizer": exchange.USER_TX}
    assert exchange.from_config(small_config(), plan, 0.1, world).checkpoint_keys(world) == {}


def test_validate_the_recipe_keys():
    config_lib.validate(small_config(shard_optimizer_state=True, optimizer="adamw"))
    with pytest.raises(ValueError, match="needs optimizer='sgd' or 'adamw'"):
        config_lib.validate(small_config(shard_optimizer_state=True, optimizer="lars"))
    for key, bad in (("ema_decay", 1.0), ("grad_clip_norm", -1.0), ("adam_b2", 1.0),
                     ("adam_eps", 0.0)):
        with pytest.raises(ValueError, match=f"config.{key}="):
            config_lib.validate(small_config(**{key: bad}))
    assert "ema_decay" in config_lib.CHECKPOINT_KEYS  # the state's structure depends on it


# ---------------------------------------------------------------------------------------
# The whole train step: the tx= hook and the EMA.

def test_tx_hook_step_equals_one_device_and_ema_follows_numpy_through_skip_and_resume(
        tmp_path):
    """A user tx (a clip, decay on EVERY leaf, SGD) through the train step on 8 devices
    equals the same tx on one device on the whole batch (sync BN); ema_decay=0.9 keeps the
    EMA of the params after each of 3 applied updates (numpy), a non-finite step leaves
    params and EMA as they were, and a resume from a checkpoint taken after it continues
    bit for bit."""
    world = make_world("all", 32)
    model, plan = _resnet8(world.axis_name)
    d = 0.9
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-2),
                     optax.sgd(0.1))
    ex = exchange.from_config(small_config(ema_decay=d), plan, 0.1, world, tx=tx)
    layout = parallel.data_parallel(model, world, IMAGE_SHAPE, "sync")
    state = create_train_state(jax.random.key(0), layout, ex)
    s0 = to_host(state)
    assert max_rel(exchange.ema_params(s0), s0.params) == 0.0  # starts at the params
    bad = random_batch(32, seed=2)
    bad["image"][13, 2, 3, 0] = np.inf
    batches = [random_batch(32, seed=1), bad, random_batch(32, seed=3),
               random_batch(32, seed=4)]
    put = lambda b: jax.device_put(b, world.sharded())
    step = aot.compile_step("train", steps.make_train_step(layout, ex, plan),
                            state, put(batches[0]), donate_argnums=0)
    mngr = checkpoint.manager(str(tmp_path / "checkpoints"))
    hosts, ema = [], s0.params
    for i, batch in enumerate(batches):
        state, m = step(state, put(batch))
        hosts.append(to_host(state))
        if i == 1:
            checkpoint.save(mngr, state, {"epoch": 1, "batch": 2})
            checkpoint.finish(mngr)
        else:
            ema = jax.tree_util.tree_map(lambda e, p: d * e + (1.0 - d) * p, ema,
                                         hosts[-1].params)
        assert float(np.asarray(m)[4]) == (0.0 if i == 1 else 1.0)
    # step 1 against the one-device reference: no trjax mask, the clip active
    p_ref, _, _, _, grads = reference_step("resnet8", s0.params, s0.batch_stats,
                                           tx.init(s0.params), tx, batches[0])
    assert float(optax.tree.norm(grads)) > 1.0
    assert max_rel(hosts[0].params, p_ref) <= 1e-5
    # the skipped step left params and EMA bit for bit
    for a, b in ((hosts[1].params, hosts[0].params),
                 (exchange.ema_params(hosts[1]), exchange.ema_params(hosts[0]))):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(jax.tree_util.tree_leaves(a),
                                                               jax.tree_util.tree_leaves(b)))
    final = hosts[-1]
    assert max_rel(exchange.ema_params(final), ema) <= 1e-6
    assert max_rel(exchange.ema_params(final), final.params) > 1e-3  # it does lag behind
    # resume at step 2 from the checkpoint: steps 3 and 4 again, bit for bit
    restored, meta = checkpoint.restore_latest(mngr, aot.abstract(state), {})
    assert int(np.asarray(restored.step)) == 2 and meta["batch"] == 2
    for batch in batches[2:]:
        restored, _ = step(restored, put(batch))
    want, got = jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(to_host(restored))
    assert len(want) == len(got) and all(x.tobytes() == y.tobytes() for x, y in zip(want, got))
    # the EMA evaluates on the same compiled programs: the same shapes and shardings
    view = exchange.ema_state(state)
    assert aot.abstract(view) == aot.abstract(state) and view.params is state.opt_state.ema
    with pytest.raises(ValueError, match="no EMA"):
        exchange.ema_state(s0.replace(opt_state=s0.opt_state.opt))
