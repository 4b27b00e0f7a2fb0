"""Issue 38, item 2: the FSDP (ZeRO-3) layout, an ``fsdp`` mesh axis.

The oracle. On data:D,fsdp:F the batch splits over data x fsdp in device order, so device
r holds the rows, the dropout key and the BN share of device r of data:D*F; the
parameters are all-gathered whole before the forward, and the reduce-scatter sums the same
per-device gradients as data parallelism's all-reduce (in another order), so each step
lands within helpers.reorder_rounding_bound of the data:D*F step from the same state. The
initial state is the same bits (each leaf is the whole array, sharded)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_each_step_within_reorder_rounding, digit_like_batches, put_like,
                     skip_train_step_compile, small_config, to_host, trainer_batch, trainer_states)
from trjax import comm
from trjax.parallel import fsdp, shards
from trjax.train import trainer

GLOBAL = 32
STEPS = 3


def _config(bn_mode, optimizer, mesh="", **kw):
    kw = {**dict(global_batch_size=GLOBAL, eval_batch_size=GLOBAL, bn_mode=bn_mode,
                 warmup_epochs=0, optimizer=optimizer,
                 learning_rate=0.1 if optimizer == "sgd" else 0.003,
                 **({"adam_eps": 1.0} if optimizer == "adamw" else {})), **kw}
    return small_config(devices="8", mesh=mesh, **kw)


@pytest.fixture(scope="module")
def trainers():
    """``get(bn_mode, optimizer, mesh="", **kw)``: each trainer set up once for the module."""
    made = {}

    def get(bn_mode, optimizer, mesh="", **kw):
        key = (bn_mode, optimizer, mesh, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = trainer.setup(_config(bn_mode, optimizer, mesh, **kw))
        return made[key]
    return get


@pytest.mark.parametrize("bn_mode,optimizer,mesh,precision", [
    ("sync", "sgd", "data:2,fsdp:4", "fp32"),
    ("running", "adamw", "data:2,fsdp:4", "fp32"),
    ("local", "sgd", "fsdp:8", "fp16")])
def test_fsdp_step_equals_data_parallel(bn_mode, optimizer, mesh, precision, trainers):
    """Each of 3 steps of the FSDP step from the data:8 step's state lands within the
    one-step bound of the data:8 step (parameters, BN statistics, optimizer state, all
    whole arrays); the metric sums and the evaluation agree. fp16 runs with its loss scale
    (2^15 at the start: the scaled gradient's reduce-scatter and the unscaling)."""
    fs = trainers(bn_mode, optimizer, mesh, precision=precision)
    dp = trainers(bn_mode, optimizer, precision=precision)
    assert fs.layout.kind == "fsdp" and fs.world.data_size == 8 and fs.world.local_batch_size == 4
    start = to_host(dp.state)
    for a, b in zip(jax.tree_util.tree_leaves(to_host(fs.state)), jax.tree_util.tree_leaves(start)):
        np.testing.assert_array_equal(a, b)  # same initial state, bit for bit
    specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(fs.state.params)]
    assert sum("fsdp" in s for s in specs) == len(specs) - 1  # the head's bias [10] stays whole
    opt = [x for x in jax.tree_util.tree_leaves(fs.state.opt_state) if x.ndim]
    assert all("fsdp" in x.sharding.spec for x in opt if x.shape[-1] != 10 or x.ndim > 1)
    if mesh == "fsdp:8":  # data:1: no all-reduce over a one-device axis
        cols = comm.collectives_in_hlo(comm.hlo_text(fs.train_step.compiled))
        assert set(comm.by_axis(cols, fs.world.mesh)) == {"fsdp"}
    batches = digit_like_batches(STEPS, GLOBAL)
    ref, ref_m = trainer_states(dataclasses.replace(dp, state=put_like(start, dp.state)), batches)
    worst, got_m = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: fs.train_step(s, trainer_batch(fs, b)), fs.state, batches,
        GLOBAL // 8 * 64)
    print(f"{mesh} {bn_mode} {optimizer} {precision}: worst leaf / bound {worst:.3g}")
    for a, b in zip(got_m, ref_m):
        assert a.count == b.count == GLOBAL - 3 and a.top1 == b.top1 and a.finite == b.finite
        np.testing.assert_allclose(a.loss_sum, b.loss_sum, rtol=1e-5)
    va = trainer.evaluate_pass(fs, put_like(ref[-1], fs.state))
    vb = trainer.evaluate_pass(dp, put_like(ref[-1], dp.state))
    assert va["count"] == vb["count"] == len(dp.data.val.labels)
    np.testing.assert_allclose(va["sums"], vb["sums"], rtol=1e-4)


def test_a_non_finite_shard_skips_the_update_on_every_device(trainers):
    """A gradient that is NaN in one fsdp rank's shard only (after the reduce-scatter) is
    seen by every device through the flag summed over fsdp: the whole update is skipped on
    all 8 devices, every leaf kept bitwise. Without the flag's sum the devices of the other
    fsdp ranks would apply their shards' updates (checked by removing it: the test fails)."""
    from jax import lax
    from jax.sharding import PartitionSpec as P
    from trjax import steps
    from trjax.state import state_specs
    fs = trainers("sync", "sgd", "data:2,fsdp:4")
    lay, opts = fs.layout, trainer.step_options(fs)

    def local(state, batch):
        grads, sums, bn_sums, rules = lay.forward_backward(
            state.params, lay.own_stats(state.batch_stats), batch, opts, None, jax.random.key(0))
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves[1] = leaves[1] + jnp.where(lax.axis_index("fsdp") == 1, jnp.nan, 0.0)
        return steps.apply_gradients(state, jax.tree_util.tree_unflatten(treedef, leaves), sums,
                                     bn_sums, rules, fs.plan, fs.exchange, lay, opts)

    specs = state_specs(lay, fs.exchange)
    step = jax.jit(jax.shard_map(local, mesh=fs.world.mesh, in_specs=(specs, lay.batch),
                                 out_specs=(specs, P()), check_vma=False))
    start = to_host(fs.state)
    new, m = step(put_like(start, fs.state), trainer_batch(fs, digit_like_batches(1, GLOBAL)[0]))
    assert float(to_host(m).finite) == 0.0 and int(to_host(new.skipped_steps)) == 1
    for a, b in zip(jax.tree_util.tree_leaves(to_host((new.params, new.opt_state))),
                    jax.tree_util.tree_leaves((start.params, start.opt_state))):
        np.testing.assert_array_equal(a, b)


def test_fsdp_collectives_by_axis(trainers):
    """The compiled step (running BN): over 'fsdp' one all-gather per bucket, one
    reduce-scatter per bucket in the plan's order (deep first) whose scattered sizes are the
    plan's local buckets plus the whole leaves and metric sums, and one all-reduce of the
    non-finite flag (with grad_norm's per-leaf sums of squares); over
    'data' the two bucket all-reduces of the 1/F shards (deep first); the BN statistics over
    data x fsdp. The gathered bytes are the whole parameters (the traffic model's figure)."""
    tr = trainers("running", "adamw", "data:2,fsdp:4")
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
    mesh, plan = tr.world.mesh, tr.plan
    by = {}
    for c in cols:
        by.setdefault(comm.axis_of(c, mesh), []).append(c)
    assert set(by) == {"fsdp", "data", ("data", "fsdp")}, by.keys()
    kinds = lambda a: sorted(c["kind"] for c in by[a])
    assert kinds("fsdp") == ["all-gather"] * 2 + ["all-reduce"] + ["reduce-scatter"] * 2
    deep, first = plan.bucket_elements["deep"], plan.bucket_elements["first"]
    assert [c["elements"] for c in by["fsdp"] if c["kind"] == "reduce-scatter"] == [deep, first]
    assert [c["elements"] for c in by["data"]] == [deep, first]  # metrics ride in 'deep'
    assert [c["elements"] for c in by[("data", "fsdp")]] == [plan.stat_sums_elements]
    model = tr.layout.details["fsdp_traffic_bytes"]
    got = comm.by_axis(cols, mesh)["fsdp"]["bytes"]
    # + the flag, and grad_norm's sum of squares of each split leaf (taken on the global
    # arrays: XLA's partitioner sums each over fsdp; merged with the flag's all-reduce)
    split = len(plan.slots) - len(tr.layout.details["fsdp_whole_leaves"])
    assert got == model["all_gather"] + model["reduce_scatter"] + 4 + 4 * split


def test_reshard_after_forward_gathers_each_bucket_again(trainers):
    """Issue 51, item 2: ``fsdp_reshard_after_forward=True`` on data:2,fsdp:4 at 1 row per
    device, one compiled step for every assertion. Pinned from the built program: the
    layout records the key, the step is compiled with remat's barriers kept, and its HLO
    holds two all-gathers per bucket over fsdp (the backward's are not CSE'd into the
    forward's), one reduce-scatter per bucket; the bytes over fsdp are the byte model's
    (3(F-1)/F |params| sent by a ring: one more all-gather), as the comm report says; XLA's
    temp is at most data:8's plus one bucket's gathered bytes; one step lands within the
    bound of data:8's."""
    fs = trainers("running", "sgd", "data:2,fsdp:4", global_batch_size=8,
                  eval_batch_size=8, fsdp_reshard_after_forward=True)
    dp = trainers("running", "sgd", global_batch_size=8, eval_batch_size=8)
    assert fs.world.local_batch_size == 1 and fs.layout.describe()["fsdp_reshard_after_forward"]
    assert fs.layout.compile_options == fsdp.REGATHER_OPTIONS
    cols = comm.collectives_in_hlo(comm.hlo_text(fs.train_step.compiled))
    over = [c for c in cols if comm.axis_of(c, fs.world.mesh) == "fsdp"]
    buckets = len(shards.bucket_groups(fs.plan))
    kinds = sorted(c["kind"] for c in over)
    assert kinds == ["all-gather"] * 2 * buckets + ["all-reduce"] + ["reduce-scatter"] * buckets
    model = fs.layout.details["fsdp_traffic_bytes"]
    assert model["gathers"] == 2
    got = comm.by_axis([c for c in over if c["kind"] != "all-reduce"], fs.world.mesh)["fsdp"]
    assert got["bytes"] == model["all_gather"] + model["reduce_scatter"]
    assert got["sent_bytes"] == pytest.approx(model["ring"], rel=1e-12)
    split = model["params_bytes"] - 4 * model["whole_leaves"]  # 3(F-1)/F of the split leaves
    assert model["ring"] == pytest.approx(3 * 3 / 4 * split + 3 * 4 * (model["whole_leaves"] + 4),
                                          rel=1e-12)
    from trjax import report  # the comm report shows the extra all-gathers and the model
    text = report.format_report(report.comm_report(fs))
    assert f"fsdp model: all-gather {model['all_gather']} B (2 x" in text, text
    assert "again in the backward" in text and "3(F-1)/F |params|" in text
    one_bucket = 4 * max(fs.plan.bucket_elements.values()) * 4  # gathered: F x the local
    temp, ref_temp = fs.train_step.memory()["temp"], dp.train_step.memory()["temp"]
    print(f"reshard temp {temp} vs data:8 {ref_temp} + one bucket {one_bucket}")
    assert temp <= ref_temp + one_bucket
    batches = digit_like_batches(1, 8, padding=(3,))
    start = to_host(dp.state)
    ref, _ = trainer_states(dataclasses.replace(dp, state=put_like(start, dp.state)), batches)
    worst, _ = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: fs.train_step(s, trainer_batch(fs, b)), fs.state, batches, 1 * 64)
    print(f"reshard: worst leaf / bound {worst:.3g}")


def test_rows_round_trip_and_shard_dims():
    """A leaf split along any dimension into rows and back is the same bits; the split
    dimension is the last that divides (a dense kernel [64, 10] on 4 devices: its inputs)."""
    x = jnp.arange(2 * 8 * 3 * 4, dtype=jnp.float32).reshape(2, 8, 3, 4)
    for d in (1, 3):
        rows = shards.to_rows(x, d, 4)
        local = list(x.shape)
        local[d] //= 4
        np.testing.assert_array_equal(shards.from_rows(rows, d, local), x)
        np.testing.assert_array_equal(rows[1], np.take(x, range(x.shape[d] // 4,
                                                                 2 * x.shape[d] // 4),
                                                       axis=d).reshape(-1))
    tree = {"k": jnp.zeros((3, 3, 16, 32)), "dense": jnp.zeros((64, 10)), "b": jnp.zeros(10)}
    assert shards.shard_dims(tree, 4) == {"k": 3, "dense": 0, "b": None}


@pytest.mark.parametrize("change,words", [
    (dict(mesh="data:2,fsdp:2,stage:2", bn_mode="local"),
     ["config.bn_mode='local'", "a 'stage' axis with an 'fsdp' axis", "'running' or 'sync'"]),
    (dict(shard_optimizer_state=True), ["shard_optimizer_state=True", "already shards"]),
    (dict(mesh="fsdp:4,data:2"), ["order", "data:2,fsdp:4"]),
    (dict(global_batch_size=12), ["data x fsdp", "size 8"]),
    (dict(mesh="data:4,model:2", fsdp_reshard_after_forward=True),
     ["fsdp_reshard_after_forward=True", "an 'fsdp' axis", "set it to False", "data:2,fsdp:4"]),
    (dict(mesh="data:2,fsdp:2,stage:2", fsdp_reshard_after_forward=True),
     ["fsdp_reshard_after_forward=True", "'stage' axis", "set it to False"]),
    (dict(grad_accumulation_steps=2, fsdp_reshard_after_forward=True),
     ["fsdp_reshard_after_forward=True", "grad_accumulation_steps=1", "byte model"]),
    (dict(remat="blocks", fsdp_reshard_after_forward=True),
     ["fsdp_reshard_after_forward=True", "config.remat='blocks'", "remat='none'"]),
    (dict(fsdp_reshard_after_forward="yes"),
     ["fsdp_reshard_after_forward='yes'", "must be True or False"])])
def test_bad_fsdp_configs_are_refused_before_compiling(change, words, monkeypatch):
    """Each message names the key and the fix; nothing is compiled. (A config file may
    hold a string where default.py holds a bool: ml_collections types only overrides.)"""
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    if change.get("fsdp_reshard_after_forward") == "yes":
        c = small_config(devices="8", mesh="data:2,fsdp:4")
        del c["fsdp_reshard_after_forward"]
        c.fsdp_reshard_after_forward = "yes"
        change = {}
    else:
        c = small_config(**{"devices": "8", "mesh": "data:2,fsdp:4", **change})
    with pytest.raises(ValueError) as e:
        trainer.setup(c)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.job
def test_fsdp_resume_and_checkpoints_move_between_meshes(tmp_path, monkeypatch):
    """data:2,fsdp:4 halted at step 6 and resumed to the end of the epoch is bitwise the run
    that never stopped; its checkpoint restores onto data:8 and onto fsdp:8 with every leaf
    bitwise (the state's leaves are whole arrays on every mesh; tests/test_tensor_step.py
    moves a data:4 checkpoint onto the model-parallel meshes the same way)."""
    from trjax.train import train_and_evaluate
    bits = lambda tree: [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]
    cfg = dict(devices="8", mesh="data:2,fsdp:4", num_epochs=1, checkpoint_every_steps=6)
    full, s_full = train_and_evaluate(small_config(**cfg), str(tmp_path / "full"))
    _, s_cut = train_and_evaluate(small_config(halt_after_steps=6, **cfg), str(tmp_path / "cut"))
    assert s_cut["halted"] and s_cut["steps"] == 6
    resumed, s_res = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"))
    assert s_res["steps"] == s_full["steps"] == 12 and s_res["mesh"] == "data:2,fsdp:4"
    for name in ("params", "batch_stats", "opt_state"):
        assert bits(getattr(resumed, name)) == bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"]
    # the moved runs resume at their last step and train none: their train step is the
    # identity (never called; a call would fail), not a step compiled for nothing
    skip_train_step_compile(monkeypatch)
    for mesh in ("", "fsdp:8"):  # data:8 reads the fsdp checkpoint; fsdp:8 reads it back
        moved, s = train_and_evaluate(small_config(**dict(cfg, mesh=mesh)), str(tmp_path / "full"))
        assert s["steps"] == 12
        for name in ("params", "batch_stats", "opt_state"):
            assert bits(getattr(moved, name)) == bits(getattr(full, name)), (mesh, name)


@pytest.mark.parametrize("kind", ["linen_dropout", "nnx_bn", "linen_bn"])
def test_your_own_model_on_fsdp_equals_data_parallel(kind):
    """Your own linen / NNX CNN (tests/test_models_any.py's, written as flax's docs write
    them: flax's BatchNorm and Dropout) on data:2,fsdp:4: one step from the same initial
    state lands within the one-step bound of data:8's (same rows, same dropout keys per
    rank), and its evaluation gives the same sums."""
    from helpers import assert_within_bound_except_still
    from test_models_any import KINDS, _config, _digits
    from trjax.data import input_pipeline as ip
    data = _digits()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    runs = {}
    for mesh in ("", "data:2,fsdp:4"):
        tr = trainer.setup(_config("8", mesh=mesh), data, model=KINDS[kind]())
        start = to_host(tr.state)
        after, m = tr.train_step(tr.state, ip.to_device(batch, tr.world.sharded(), 10))
        runs[mesh] = (tr, start, to_host(after), to_host(m))
    (dp, s0, a0, m0), (fs, s1, a1, m1) = runs[""], runs["data:2,fsdp:4"]
    assert fs.layout.kind == "fsdp"
    for a, b in zip(jax.tree_util.tree_leaves(s0), jax.tree_util.tree_leaves(s1)):
        np.testing.assert_array_equal(a, b)
    worst = assert_within_bound_except_still((a1.params, a1.batch_stats),
                                             (a0.params, a0.batch_stats),
                                             (s0.params, s0.batch_stats), GLOBAL)
    print(f"{kind}: worst leaf / bound {worst:.3g}")
    assert m1.count == m0.count and m1.top1 == m0.top1
    va, vb = trainer.evaluate_pass(fs, put_like(a0, fs.state)), \
        trainer.evaluate_pass(dp, put_like(a0, dp.state))
    np.testing.assert_allclose(va["sums"], vb["sums"], rtol=1e-4)


def test_a_model_whose_leaves_all_share_one_bucket_sums_its_metrics_over_fsdp():
    """A tiny model (conv 1->8, pool, dense 8->10) puts every leaf in the plan's 'first'
    bucket, so the metric sums' 'deep' bucket holds no leaf. Its reduce-scatter over fsdp
    still runs (shards.bucket_groups keeps it): the step counts all 32 rows, not one
    device's 4, and its mean gradient (grad_norm, the update) is data:8's, not 8 times it
    (found by scripts/torch_clip_check.py against torch)."""
    import flax.linen as nn
    from helpers import assert_within_bound_except_still
    from trjax import steps
    from trjax.data import input_pipeline as ip
    data = ip.load_digits()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    runs = {}
    for mesh in ("data:8", "fsdp:8"):
        model = nn.Sequential([nn.Conv(8, (3, 3)), nn.relu, lambda x: x.mean(axis=(1, 2)),
                               nn.Dense(10)])
        tr = trainer.prepare(_config("sync", "sgd", mesh, grad_clip_norm=0.0), data,
                             model=model)
        assert not any(s.bucket == tr.plan.metrics_slot[0] for s in tr.plan.slots)
        state = trainer.train_state_program(0, tr.layout, tr.exchange).finish()
        start = to_host(state.params)
        step = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                             trainer.step_options(tr)))
        after, m = step(state, ip.to_device(batch, tr.world.sharded(), 10))
        runs[mesh] = start, to_host(after.params), to_host(m)
    (s0, a0, m0), (s1, a1, m1) = runs["data:8"], runs["fsdp:8"]
    assert m1.count == m0.count == GLOBAL and m1.top1 == m0.top1
    np.testing.assert_allclose(m1.loss_sum, m0.loss_sum, rtol=1e-5)
    np.testing.assert_allclose(m1.grad_norm, m0.grad_norm, rtol=1e-5)
    assert_within_bound_except_still(a1, a0, s0, GLOBAL)
