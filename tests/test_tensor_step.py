"""Issue 31: the tensor-parallel (Megatron) train step as the trainer builds it
(config.mesh with a 'model' axis), against the data-parallel step on the same data devices,
and its collectives by mesh axis.

The oracle. On data:2,model:2 each data rank holds the same rows as rank r of the
data-parallel step on data:2, and the split layers compute the same sums split over two
devices (Megatron's column/row pairs: the row layer's partial sums are all-reduced), so
parameters, BN statistics and metrics agree within helpers.reorder_rounding_bound. The
initial parameters are the unsplit ones' slices bitwise (trjax.tensor's tests check each
device's shard; here the global arrays are compared)."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import (assert_each_step_within_reorder_rounding, digit_like_batches, put_like,
                     skip_train_step_compile, small_config, to_host, trainer_batch, trainer_states)
from trjax import comm
from trjax.train import trainer

GLOBAL = 32
STEPS = 3


def _trainer(bn_mode, mesh=None, **kw):
    kw = dict(global_batch_size=GLOBAL, eval_batch_size=GLOBAL, bn_mode=bn_mode,
              warmup_epochs=0, **kw)
    if mesh:
        size = np.prod([int(a.split(":")[1]) for a in mesh.split(",")])
        return trainer.setup(small_config(devices=str(size), mesh=mesh, **kw))
    return trainer.setup(small_config(devices="2", **kw))


def _optimizer_kw(optimizer):
    return dict(optimizer=optimizer, learning_rate=0.1 if optimizer == "sgd" else 0.003,
                **({"adam_eps": 1.0} if optimizer == "adamw" else {}))


@pytest.fixture(scope="module")
def trainers():
    """``get(bn_mode, optimizer, mesh=None)``: each trainer set up once for the module (the
    step test and the collectives test read the same one; a test runs from a copy of a
    trainer's state, never donating the shared one)."""
    made = {}

    def get(bn_mode, optimizer, mesh=None):
        key = (bn_mode, optimizer, mesh)
        if key not in made:
            made[key] = _trainer(bn_mode, mesh, **_optimizer_kw(optimizer))
        return made[key]
    return get


@pytest.mark.parametrize("bn_mode,optimizer", [("sync", "sgd"), ("running", "adamw")])
def test_tensor_parallel_step_equals_data_parallel(bn_mode, optimizer, trainers):
    """data:2,model:2 (resnet8: its last stage's block and the head split) == data:2, each
    of 3 steps from the same state (helpers.assert_each_step_within_reorder_rounding):
    parameters, BN running statistics, optimizer state; metric sums; the evaluation.

    adamw runs with adam_eps=1: its state (mu, nu split like the parameters) is what is
    tested. With the usual eps=1e-8 the first update g / (|g| + eps) turns the relative
    rounding error of a gradient element near zero into that of the update (measured: one
    kernel element 1.7x over the bound, which is relative to the leaf's largest movement);
    the gradients themselves are within the bound (the sgd case).

    Running BN with sgd through the trainer: the sync sgd case's optimizer and the running
    adamw case's BatchNorm; tests/test_tensor.py's
    test_tensor_parallel_step_equals_one_device[data:2,model:2-10-running] checks that
    forward + backward's gradients, BN sums and running statistics on every device."""
    tp, dp = trainers(bn_mode, optimizer, "data:2,model:2"), trainers(bn_mode, optimizer)
    assert tp.layout.kind == "tensor" and tp.world.data_size == 2
    assert tp.config.optimizer == dp.config.optimizer == optimizer
    start = to_host(dp.state)
    for a, b in zip(jax.tree_util.tree_leaves(to_host(tp.state)), jax.tree_util.tree_leaves(start)):
        np.testing.assert_array_equal(a, b)  # same initial state, bit for bit
    split = [s for s in jax.tree_util.tree_leaves(tp.state.params)
             if any(e is not None for e in s.sharding.spec)]
    assert len(split) == 6  # stage3_block1's Conv_0, BatchNorm_0 scale/bias, Conv_1; head
    batches = digit_like_batches(STEPS, GLOBAL)
    ref, ref_m = trainer_states(dataclasses.replace(dp, state=put_like(start, dp.state)),
                                batches)
    rows = GLOBAL // 2 * 64
    worst, got_m = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: tp.train_step(s, trainer_batch(tp, b)), tp.state, batches, rows)
    print(f"{bn_mode} {optimizer} {STEPS} steps: worst leaf / bound {worst:.3g}")
    assert got_m[0].top1 == ref_m[0].top1
    for a, b in zip(got_m, ref_m):  # each step from the same state
        assert a.count == b.count == GLOBAL - 3
        np.testing.assert_allclose(a.loss_sum, b.loss_sum, rtol=1e-5)
    # the evaluation of the same state: the same counts, loss sums to the rounding
    va = trainer.evaluate_pass(tp, put_like(ref[-1], tp.state))
    vb = trainer.evaluate_pass(dp, put_like(ref[-1], dp.state))
    assert va["count"] == vb["count"] == len(dp.data.val.labels)
    np.testing.assert_allclose(va["sums"], vb["sums"], rtol=1e-4)


def test_tensor_parallel_collectives_by_axis(trainers):
    """The compiled step (running BN; the adamw step test's trainer: an elementwise
    optimizer adds no collective): over 'model' the f/g all-reduces of the split
    block and the head (forward g, backward f of the block, backward f of the head), the
    non-finite flag (each model rank checked its own slices; with it, merged, grad_norm's
    sum of squares of each leaf split over 'model') and the logits' all-gather; over 'data' the two buckets (deep first) and the BN statistics; no
    collective over both axes."""
    tr = trainers("running", "adamw", "data:2,model:2")
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
    mesh = tr.world.mesh
    kinds = {}
    for c in cols:
        kinds.setdefault(comm.axis_of(c, mesh), []).append(c["kind"])
    assert set(kinds) == {"data", "model"}, kinds
    assert sorted(kinds["model"]) == ["all-gather"] + ["all-reduce"] * 4, kinds["model"]
    # the flag, merged by XLA with grad_norm's sums of squares of the leaves split over
    # 'model' (taken on the global arrays: one partial sum per split leaf)
    specs = jax.tree_util.tree_leaves(tr.layout.params, is_leaf=lambda x: isinstance(x, P))
    split = sum(any(a == "model" or (isinstance(a, tuple) and "model" in a) for a in s)
                for s in specs)
    assert split > 0
    assert sorted(c["elements"] for c in cols if comm.axis_of(c, mesh) == "model" and
                  c["kind"] == "all-reduce")[0] == 1 + split
    data = [c for c in cols if comm.axis_of(c, mesh) == "data"]
    sizes = [c["elements"] for c in data]
    plan = tr.plan
    want = [plan.bucket_elements["deep"], plan.bucket_elements["first"], plan.stat_sums_elements]
    assert sizes == want, (sizes, want)


@pytest.mark.job
def test_tensor_parallel_resume_mid_epoch_is_bitwise_exact(tmp_path):
    """data:2,model:2: the split leaves are saved and restored as sharded global arrays;
    halted at step 6, resumed to the end of the epoch: bitwise the run never stopped."""
    from trjax.train import train_and_evaluate
    bits = lambda tree: [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]
    cfg = dict(devices="4", mesh="data:2,model:2", num_epochs=1, checkpoint_every_steps=4)
    full, s_full = train_and_evaluate(small_config(**cfg), str(tmp_path / "full"))
    _, s_cut = train_and_evaluate(small_config(halt_after_steps=6, **cfg), str(tmp_path / "cut"))
    assert s_cut["halted"] and s_cut["steps"] == 6
    resumed, s_res = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"))
    assert s_res["steps"] == s_full["steps"] == 12 and s_res["mesh"] == "data:2,model:2"
    for name in ("params", "batch_stats", "opt_state"):
        assert bits(getattr(resumed, name)) == bits(getattr(full, name)), name
    assert [x.sharding.spec for x in jax.tree_util.tree_leaves(resumed.params)] == \
        [x.sharding.spec for x in jax.tree_util.tree_leaves(full.params)]
    assert s_res["val_top1"] == s_full["val_top1"]


@pytest.mark.job
def test_a_checkpoint_restores_onto_another_mesh_bitwise(tmp_path, monkeypatch):
    """The state's global arrays have the same shapes on every mesh (a split leaf is the full
    array, sharded), so a data:4 checkpoint restores onto data:2,model:2 and onto
    data:2,stage:2 with every leaf bitwise what was saved, and `mesh` may change on resume."""
    from trjax.train import train_and_evaluate
    bits = lambda tree: [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]
    cfg = dict(devices="4", num_epochs=1, checkpoint_every_steps=4, halt_after_steps=4)
    saved, _ = train_and_evaluate(small_config(**cfg), str(tmp_path))
    # each restore resumes at the halt step and trains none: its train step is the identity
    # (never called; a call would fail), not a model-parallel step compiled for nothing
    skip_train_step_compile(monkeypatch)
    for mesh in ("data:2,model:2", "data:2,stage:2"):
        restored, s = train_and_evaluate(small_config(mesh=mesh, **cfg), str(tmp_path))
        assert s["steps"] == 4 and s["mesh"] == mesh
        for name in ("params", "batch_stats", "opt_state"):
            assert bits(getattr(restored, name)) == bits(getattr(saved, name)), (mesh, name)
