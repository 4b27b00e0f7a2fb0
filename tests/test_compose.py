"""Axes compose (issue 39, item 1): a mesh of several axes is the tensor-parallel layout, the
pipeline laid over it and FSDP over that (trjax.parallel.mesh.from_config), not a path of its
own.

The oracles. data:2,fsdp:2,model:2 gives each of its 4 batch ranks (data x fsdp) the rows of
data:4's rank of the same index, and the model pairs compute the same sums split over two
devices: one step lands within helpers' one-step reordered-sum bound of data:4's.
data:2,stage:2,model:2 with M micro-batches groups each data rank's rows as data:2 with
grad_accumulation_steps = M does (the pipeline's oracle, tests/test_pipeline_step.py)."""
from collections import Counter

import jax
import numpy as np
import pytest

from helpers import assert_within_bound_except_still, put_like, small_config, to_host
from test_tensor_plan import LINEN_PLAN, linen_sequential
from trjax import comm
from trjax.data import input_pipeline as ip
from trjax.train import config as config_lib
from trjax.train import trainer

GLOBAL = 32


def _config(mesh, **kw):
    devices = str(np.prod([int(a.split(":")[1]) for a in mesh.split(",")]))
    return small_config(devices=devices, mesh=mesh, global_batch_size=GLOBAL,
                        eval_batch_size=GLOBAL, momentum=0.0, weight_decay=0.0,
                        warmup_epochs=0, **kw)


@pytest.fixture(scope="module")
def trainers():
    """``get(mesh, model=None, **config)``: each trainer set up once for the module."""
    made, data = {}, ip.load_digits()

    def get(mesh, model=None, **kw):
        key = (mesh, model, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = trainer.setup(_config(mesh, **kw), data,
                                      model=None if model is None else model())
        return made[key]
    return get


def _one_step(tr):
    data = ip.load_digits()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    start = to_host(tr.state)
    after, m = tr.train_step(put_like(start, tr.state),
                             ip.to_device(batch, tr.world.sharded(), 10))
    return start, to_host(after), to_host(m)


def _assert_step_equal(tr, ref):
    """One step of ``tr`` from the same initial state as ``ref`` lands within the bound
    of ``ref``'s; the metrics and the evaluation of the same state agree."""
    s1, a1, m1 = _one_step(tr)
    s0, a0, m0 = _one_step(ref)
    for a, b in zip(jax.tree_util.tree_leaves(s0), jax.tree_util.tree_leaves(s1)):
        np.testing.assert_array_equal(a, b)
    worst = assert_within_bound_except_still((a1.params, a1.batch_stats),
                                             (a0.params, a0.batch_stats),
                                             (s0.params, s0.batch_stats), GLOBAL)
    assert m1.count == m0.count == GLOBAL and m1.top1 == m0.top1
    np.testing.assert_allclose(m1.loss_sum, m0.loss_sum, rtol=1e-5)
    va = trainer.evaluate_pass(tr, put_like(a0, tr.state))
    vb = trainer.evaluate_pass(ref, put_like(a0, ref.state))
    assert va["count"] == vb["count"]
    np.testing.assert_allclose(va["sums"], vb["sums"], rtol=1e-4)
    return worst


def assert_axis_bytes_are_the_models(tr):
    """Issue 53, kind 3: over ``stage`` and ``model`` the compiled train step's bytes
    (comm.by_axis: each collective's result bytes times its loop's trip count, every
    switch branch once) are the layout's byte models, exactly. ``stage``: the boundary
    permutes and the stage-owned all-to-alls (pipeline.boundary_traffic), plus the BN
    sums where sync mode reduces them over ``stage`` alone (the plan's stat-sums size).
    ``model``: Megatron's g, f and the head's all-gather (pipeline.tensor_traffic or
    tensor.traffic), and what a ring sends for them. The all-reduces of scalars (the
    non-finite flag over the split axes, test_a_non_finite_slice..., and grad_norm's sum
    of squares of each split leaf, taken on the global arrays and merged with the flag by
    XLA: at most one element per parameter leaf and the flag) are no layout's model and
    are left out; where XLA's all-reduce combiner merged those sums into a larger
    all-reduce over the axis (the BN sums over ``stage`` in sync mode), the measured
    bytes may exceed the model by at most one float per parameter leaf, never fall
    short of it. Returns ``{axis: (model, measured)}``."""
    scalars = len(jax.tree_util.tree_leaves(tr.state.params)) + 1
    cols = [c for c in comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
            if not (c["kind"] == "all-reduce" and c["elements"] <= scalars)]
    rows, lay, out = comm.by_axis(cols, tr.world.mesh), tr.layout, {}
    if lay.point_to_point is not None:
        p = lay.point_to_point(4)
        bn = 4 * tr.plan.stat_sums_elements if lay.bn_reduce_axes == "stage" else 0
        out["stage"] = (p["issued_bytes"] + p["exchange_bytes"] + bn, rows["stage"]["bytes"])
        assert 0 <= out["stage"][1] - out["stage"][0] <= 4 * scalars, (p, bn, out["stage"])
    if lay.tensor_traffic is not None:
        t = lay.tensor_traffic(4)
        out["model"] = (t["issued"], rows["model"]["bytes"])
        assert 0 <= out["model"][1] - out["model"][0] <= 4 * scalars, (t, out["model"])
        assert t["total"] == pytest.approx(rows["model"]["sent_bytes"],
                                           abs=8 * scalars, rel=1e-12), t
    print(f"{tr.world.mesh_spec} {tr.config.pipeline_schedule}: model vs HLO bytes {out}")
    return out


@pytest.mark.parametrize("bn_mode,reshard", [("running", False), ("sync", False),
                                             ("running", True)])
def test_fsdp_over_tensor_parallel_equals_data_parallel(bn_mode, reshard, trainers):
    """ResNet-8 on data:2,fsdp:2,model:2: each device holds an fsdp shard of its model
    slice (a split dimension carries ('model', 'fsdp')), gathers it over fsdp, runs the
    split network; one step against data:4 within the bound. With
    ``fsdp_reshard_after_forward`` the backward gathers the slices again (issue 51, item 2):
    twice the all-gathered bytes, the byte model's, and 'model''s collectives unchanged."""
    tr = trainers("data:2,fsdp:2,model:2", bn_mode=bn_mode,
                  **({"fsdp_reshard_after_forward": True} if reshard else {}))
    assert tr.layout.details["fsdp_traffic_bytes"]["gathers"] == (2 if reshard else 1)
    assert tr.layout.kind == "fsdp+tensor" and tr.world.data_size == 4
    specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(tr.state.params)]
    assert sum(("model", "fsdp") in tuple(s) for s in specs) >= 1
    assert sum("model" in tuple(s) for s in specs) >= 2  # the row kernel: model and fsdp apart
    worst = _assert_step_equal(tr, trainers("data:4", bn_mode=bn_mode))
    print(f"data:2,fsdp:2,model:2 {bn_mode} reshard={reshard}: worst leaf / bound {worst:.3g}")
    # issue 53 kind 3: the fsdp byte model of the model slices is what the program sends
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
    model = tr.layout.details["fsdp_traffic_bytes"]
    fsdp = comm.by_axis(cols, tr.world.mesh)["fsdp"]
    assert fsdp["bytes"] == model["all_gather"] + model["reduce_scatter"]
    assert fsdp["sent_bytes"] == pytest.approx(model["ring"], rel=1e-12)
    assert_axis_bytes_are_the_models(tr)  # and tensor parallelism's over model


@pytest.mark.parametrize("schedule,bn_mode", [("gpipe", "running"), ("1f1b", "sync")])
def test_pipeline_over_tensor_parallel_equals_accumulation(schedule, bn_mode, trainers):
    """ResNet-8 on data:2,stage:2,model:2 (M = 4): the stages run the split network; one
    step against data:2 with grad_accumulation_steps = 4 within the bound."""
    tr = trainers("data:2,stage:2,model:2", bn_mode=bn_mode, pipeline_microbatches=4,
                  pipeline_schedule=schedule)
    assert tr.layout.kind == "pipeline+tensor"
    worst = _assert_step_equal(tr, trainers("data:2", bn_mode=bn_mode, grad_accumulation_steps=4))
    print(f"data:2,stage:2,model:2 {schedule} {bn_mode}: worst leaf / bound {worst:.3g}")
    assert_axis_bytes_are_the_models(tr)


def test_your_own_sequential_on_stage_and_model_axes(trainers):
    """A linen nn.Sequential CNN (flax BatchNorm in the split pairs, Dropout before the split
    head) on data:2,stage:2,model:2 with a tensor plan: the pipeline's accumulation oracle,
    dropout keys included."""
    tr = trainers("data:2,stage:2,model:2", linen_sequential, bn_mode="running",
                  pipeline_microbatches=2, tensor_plan=LINEN_PLAN)
    assert tr.layout.network.layer_plan.roles
    ref = trainers("data:2", linen_sequential, bn_mode="running", grad_accumulation_steps=2)
    worst = _assert_step_equal(tr, ref)
    print(f"nn.Sequential on data:2,stage:2,model:2: worst leaf / bound {worst:.3g}")
    # a split pair leads stage 1 (layers_3): its f only where the stage input's cotangent is
    assert_axis_bytes_are_the_models(tr)


def test_the_collectives_of_a_3d_mesh_by_axis_and_trip_count(trainers):
    """data:2,stage:2,model:2 (gpipe, M = 4, so the tick loop runs M + S - 1 = 5 times):
    over 'model' the split block's g and f and the head's f inside the loop, and the logits'
    all-gather; over 'stage' the two all-to-alls of the stage-owned parameters and the
    boundary permutes (one each way) in the loop; over 'data' the two buckets; the BN sums
    over data x stage and the non-finite flag over stage x model, once each."""
    tr = trainers("data:2,stage:2,model:2", bn_mode="running", pipeline_microbatches=4,
                  pipeline_schedule="gpipe")
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
    got = Counter((comm.axis_of(c, tr.world.mesh), c["kind"], c["trip_count"]) for c in cols)
    assert got == Counter({
        ("model", "all-reduce", 5): 3, ("model", "all-gather", 5): 1,
        ("stage", "all-to-all", 1): 2, ("stage", "collective-permute", 5): 2,
        ("data", "all-reduce", 1): 2, (("data", "stage"), "all-reduce", 1): 1,
        (("stage", "model"), "all-reduce", 1): 1,
        # grad_norm's sums of squares of the leaves split over stage (and model), on the
        # global arrays outside shard_map: the partitioner's all-reduces, one element each
        (None, "all-reduce", 1): 6}), got
    data = [c["elements"] for c in cols if comm.axis_of(c, tr.world.mesh) == "data"]
    assert data == [tr.plan.bucket_elements["deep"], tr.plan.bucket_elements["first"]]


@pytest.mark.parametrize("mesh,schedule,bn_mode", [
    ("data:2,fsdp:2,stage:2", "gpipe", "running"),
    ("data:1,fsdp:2,stage:2,model:2", "zb-h1", "sync")])
def test_fsdp_over_the_pipeline_equals_accumulation(mesh, schedule, bn_mode, trainers):
    """FSDP laid over the pipeline (and over tensor parallelism, a 4-D mesh): each device holds
    an fsdp shard of its stage's (model) slices, gathers it over fsdp for the pipeline's step and
    reduce-scatters the gradients; the batch splits over data x fsdp. One step (M = 4) against
    data:D·F with grad_accumulation_steps = 4 within the bound."""
    tr = trainers(mesh, bn_mode=bn_mode, pipeline_microbatches=4, pipeline_schedule=schedule)
    assert tr.layout.kind.startswith("fsdp+pipeline")
    assert tr.layout.split_axes == ("fsdp", "stage") + (("model",) if "model" in mesh else ())
    ranks = tr.world.data_size
    worst = _assert_step_equal(tr, trainers(f"data:{ranks}", bn_mode=bn_mode,
                                            grad_accumulation_steps=4))
    print(f"{mesh} {schedule} {bn_mode}: worst leaf / bound {worst:.3g}")
    # issue 53 kind 3: fsdp's byte model is what the program gathers and scatters (on
    # data:1 the sync-mode BatchNorm sums also go over fsdp, data x fsdp's one axis > 1: they
    # are the data axes' traffic, all-reduces in the tick loop, not fsdp's parameters)
    cols = [c for c in comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
            if c["kind"] in ("all-gather", "reduce-scatter")]
    model = tr.layout.details["fsdp_traffic_bytes"]
    fsdp = comm.by_axis(cols, tr.world.mesh)["fsdp"]
    assert fsdp["bytes"] == model["all_gather"] + model["reduce_scatter"]
    assert fsdp["sent_bytes"] == pytest.approx(model["ring"], rel=1e-12)
    assert_axis_bytes_are_the_models(tr)  # stage (and model) under fsdp


@pytest.mark.parametrize("overrides,needle", [
    (dict(mesh="data:2,fsdp:2,stage:2", bn_mode="local"),
     "config.bn_mode='local' is not supported with a 'stage' axis with an 'fsdp' axis"),
    (dict(mesh="data:2,fsdp:2,model:2", compression="bf16"),
     "config.compression='bf16' is not supported with a 'model' axis with an 'fsdp' axis"),
])
def test_a_combination_that_cannot_work_is_an_error_before_compiling(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        config_lib.validate(small_config(**overrides))


@pytest.mark.job
def test_3d_resume_is_bitwise_and_checkpoints_move_between_meshes(tmp_path):
    """data:2,stage:2,model:2 halted at step 6 and resumed is bitwise the run that never
    stopped; its checkpoint restores onto data:2,fsdp:2,model:2 and data:8 with every leaf
    bitwise, and a data:2,fsdp:2,model:2 checkpoint back onto data:2,stage:2,model:2."""
    from trjax.train import train_and_evaluate
    bits = lambda tree: [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]
    cfg = dict(devices="8", num_epochs=1, checkpoint_every_steps=4, pipeline_microbatches=4)
    three = dict(cfg, mesh="data:2,stage:2,model:2")
    full, s_full = train_and_evaluate(small_config(**three), str(tmp_path / "full"))
    train_and_evaluate(small_config(halt_after_steps=6, **three), str(tmp_path / "cut"))
    resumed, s_res = train_and_evaluate(small_config(**three), str(tmp_path / "cut"))
    assert s_res["steps"] == s_full["steps"] == 12
    for name in ("params", "batch_stats", "opt_state"):
        assert bits(getattr(resumed, name)) == bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"]
    other = dict(devices="8", num_epochs=1, checkpoint_every_steps=4)
    for mesh in ("data:2,fsdp:2,model:2", ""):  # read the 3-D checkpoint at its last step
        moved, s = train_and_evaluate(small_config(mesh=mesh, **other), str(tmp_path / "full"))
        assert s["steps"] == 12
        for name in ("params", "batch_stats", "opt_state"):
            assert bits(getattr(moved, name)) == bits(getattr(full, name)), (mesh, name)
    back, _ = train_and_evaluate(small_config(**three), str(tmp_path / "full"))
    assert bits(back.params) == bits(full.params)


@pytest.mark.parametrize("mesh,axis", [("data:4,model:2", "model"),
                                       ("data:2,fsdp:2,model:2", "fsdp"),
                                       ("data:2,stage:2,model:2", "stage")])
def test_a_non_finite_slice_skips_the_update_on_every_device(mesh, axis, trainers):
    """A gradient NaN in the slices of rank 1 of one axis only (tensor parallelism alone
    too): the flag summed over every axis that holds different slices (the layout's
    split_axes) makes all 8 devices skip the update, every leaf kept bitwise."""
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    from trjax import steps
    from trjax.state import state_specs
    kw = dict(pipeline_microbatches=4, pipeline_schedule="gpipe") if "stage" in mesh else {}
    tr = trainers(mesh, bn_mode="running", **kw)
    lay, opts = tr.layout, trainer.step_options(tr)
    assert lay.split_axes == tuple(a for a in ("fsdp", "stage", "model") if a in mesh)
    # the built train step sums a one-element flag over exactly those axes
    flags = [comm.axis_of(c, tr.world.mesh)
             for c in comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
             if c["kind"] == "all-reduce" and 1 in [o["elements"] for o in c["operands"]]]
    assert (lay.split_axes if len(lay.split_axes) > 1 else lay.split_axes[0]) in flags, flags
    if mesh == "data:4,model:2":  # the others' byte models are pinned above
        assert_axis_bytes_are_the_models(tr)

    def local(state, batch):
        grads, sums, bn_sums, rules = lay.forward_backward(
            state.params, lay.own_stats(state.batch_stats), batch, opts, None,
            jax.random.key(0))
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves[0] = leaves[0] + jnp.where(lax.axis_index(axis) == 1, jnp.nan, 0.0)
        return steps.apply_gradients(state, jax.tree_util.tree_unflatten(treedef, leaves), sums,
                                     bn_sums, rules, tr.plan, tr.exchange, lay, opts)

    specs = state_specs(lay, tr.exchange)
    step = jax.jit(jax.shard_map(local, mesh=tr.world.mesh, in_specs=(specs, lay.batch),
                                 out_specs=(specs, P()), check_vma=False))
    data = ip.load_digits()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    start = to_host(tr.state)
    new, m = step(put_like(start, tr.state), ip.to_device(batch, tr.world.sharded(), 10))
    assert float(to_host(m).finite) == 0.0
    for a, b in zip(jax.tree_util.tree_leaves(to_host((new.params, new.opt_state))),
                    jax.tree_util.tree_leaves((start.params, start.opt_state))):
        np.testing.assert_array_equal(a, b)

