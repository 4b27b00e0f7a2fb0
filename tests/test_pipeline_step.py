"""Issue 31: the pipelined train step as the trainer builds it (config.mesh with a 'stage'
axis), against the data-parallel step with grad_accumulation_steps = M on the same data
devices, and the config checks of model-parallel meshes.

The oracle. trjax.steps.make_train_step with grad_accumulation_steps = M on D devices groups
the rows of each data rank exactly as the pipeline's micro-batches (rows [j mu, (j+1) mu) of
the local batch) and normalises each micro-batch with its own BatchNorm statistics; the
running statistics add every micro-batch's sums once per step in both. Both start from the
same parameters (rank 0's key does not depend on the world). The two programs sum in other
orders, so values agree within helpers.reorder_rounding_bound and counts bitwise."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from helpers import (HALF_ULP, assert_each_step_within_reorder_rounding, digit_like_batches,
                     put_like, skip_train_step_compile, small_config, to_host, trainer_batch,
                     trainer_states)
from trjax.train import config as config_lib
from trjax.train import trainer

GLOBAL = 32
STEPS = 3


def _trainer(bn_mode, mesh=None, schedule="gpipe", **extra):
    kw = dict(global_batch_size=GLOBAL, eval_batch_size=GLOBAL, bn_mode=bn_mode, warmup_epochs=0,
              **extra)
    if mesh:
        size = np.prod([int(a.split(":")[1]) for a in mesh.split(",")])
        cfg = small_config(devices=str(size), mesh=mesh, pipeline_microbatches=4,
                           pipeline_schedule=schedule, **kw)
    else:
        cfg = small_config(devices="2", grad_accumulation_steps=4, **kw)
    return trainer.setup(cfg)


@pytest.fixture(scope="module")
def trainers():
    """``get(bn_mode, mesh=None, schedule="gpipe")``: each trainer set up once for the
    module (the step tests and the collectives test read the same ones; a test runs from a
    copy of a trainer's state, never donating the shared one)."""
    made = {}

    def get(*key):
        if key not in made:
            made[key] = _trainer(*key)
        return made[key]
    return get


@pytest.fixture(scope="module")
def reference_runs(trainers):
    """``get(bn_mode)``: the data-parallel trainer's run over the module's batches from
    its initial state, ``(host states, metrics)``, once per BatchNorm mode."""
    made = {}

    def get(bn_mode):
        if bn_mode not in made:
            dp = trainers(bn_mode)
            fresh = dataclasses.replace(dp, state=put_like(to_host(dp.state), dp.state))
            made[bn_mode] = trainer_states(fresh, digit_like_batches(STEPS, GLOBAL))
        return made[bn_mode]
    return get


@pytest.mark.parametrize("bn_mode,mesh,schedule", [("running", "data:2,stage:2", "gpipe"),
                                                   ("sync", "data:2,stage:3", "1f1b")])
def test_pipelined_step_equals_gradient_accumulation(bn_mode, mesh, schedule, trainers,
                                                     reference_runs):
    """Each of 3 steps from the same state (helpers.assert_each_step_within_reorder_rounding):
    parameters, BN running statistics, optimizer state and the metric sums of
    data:2,stage:S (M = 4; GPipe with remat, or 1F1B) equal the data-parallel step on 2
    devices with grad_accumulation_steps = 4, within the one-step reordered-sum bound;
    counts exact. Three steps: the momentum and running statistics carried in.

    The two cases cover both schedules, both BatchNorm modes and S = 2, 3 through the
    trainer; tests/test_pipeline.py checks each schedule x mode of the pipelined
    forward + backward itself against the same oracle at S = 2 and 3 (GPipe sync S=3: its
    test_gpipe_equals_gradient_accumulation[3-3-sync]; 1F1B running S=3:
    test_1f1b_nan_in_bubbles_is_bitwise_zero_in_bubbles' 0-filled run)."""
    pp, dp = trainers(bn_mode, mesh, schedule), trainers(bn_mode)
    assert pp.layout.kind == "pipeline" and pp.world.data_size == 2 and pp.world.world_size > 2
    assert pp.config.pipeline_schedule == schedule
    start = to_host(dp.state)
    for bits_a, bits_b in zip(jax.tree_util.tree_leaves(to_host(pp.state.params)),
                              jax.tree_util.tree_leaves(start.params)):
        np.testing.assert_array_equal(bits_a, bits_b)  # the same initial parameters
    rows = GLOBAL // 2 * 64  # rows x positions one data rank sums
    batches = digit_like_batches(STEPS, GLOBAL)
    ref, ref_m = reference_runs(bn_mode)
    worst, got_m = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: pp.train_step(s, trainer_batch(pp, b)), pp.state, batches, rows)
    print(f"{bn_mode} {mesh} {schedule} {STEPS} steps: worst leaf / bound {worst:.3g}")
    assert got_m[0].top1 == ref_m[0].top1 and got_m[0].top5 == ref_m[0].top5
    for a, b in zip(got_m, ref_m):  # each step from the same state
        assert a.count == b.count == GLOBAL - 3 and a.finite == b.finite == 1
        np.testing.assert_allclose(a.loss_sum, b.loss_sum, rtol=1e-5)


@pytest.mark.parametrize("overrides,needle", [
    (dict(mesh="data:2,stage:2", bn_mode="local"), "config.bn_mode='local' is not supported "
                                                   "with a 'stage' axis"),
    (dict(mesh="data:2,stage:2", allreduce="hierarchical"), "already crosses nodes"),
    (dict(mesh="data:2,stage:2", compression="bf16"), "config.compression='bf16'"),
    (dict(mesh="data:2,stage:2", shard_optimizer_state=True), "shard_optimizer_state=True"),
    (dict(mesh="data:2,stage:2", grad_accumulation_steps=2),
     "the pipeline's micro-batches are its accumulation"),
    (dict(mesh="data:2,model:2", model="flax.linen:Dense"), "by a tensor plan: set "
                                                            "config.tensor_plan="),
    (dict(tensor_plan="Conv_0=column"), "applies to a mesh with a 'model' axis"),
    (dict(mesh="data:2,model:2", tensor_plan="Conv_0=diagonal"), "'diagonal' is not one of"),
    (dict(mesh="data:1,fsdp:2,stage:2", bn_mode="local"),
     "not supported with a 'stage' axis with an 'fsdp' axis"),
    (dict(pipeline_microbatches=8), "applies to a mesh with a 'stage' axis"),
    (dict(pipeline_stage_starts="stage2_block1"), "applies to a mesh with a 'stage' axis"),
    (dict(pipeline_schedule="1f1b"), "applies to a mesh with a 'stage' axis"),
    (dict(mesh="data:2,stage:2", pipeline_schedule="interleaved"), "is not one of"),
    (dict(pipeline_remat=False), "config.pipeline_remat=False applies to a mesh with a 'stage'"),
    (dict(mesh="data:2,stage:2", pipeline_schedule="1f1b", pipeline_remat=False),
     "1f1b always recomputes"),
    (dict(mesh="data:2,stage:2", pipeline_stage_starts="stage2_block1,,stage3_block1"),
     "has an empty item"),
    (dict(model_kwargs={"axis_name": "x"}), "config.model_kwargs sets ['axis_name']"),
    (dict(mesh="data:2,pipe:2"), "axis 'pipe' is unknown"),
])
def test_model_parallel_config_errors(overrides, needle):
    with pytest.raises(ValueError) as e:
        config_lib.validate(small_config(**overrides))
    assert needle in str(e.value)


@pytest.mark.parametrize("overrides,needle", [
    (dict(mesh="data:2,stage:2", pipeline_microbatches=3),
     "config.pipeline_microbatches=3 does not fit 2 stages and a local batch of 16 rows"),
    (dict(mesh="data:2,stage:2", pipeline_microbatches=1), "must be >= 2"),
    (dict(mesh="data:2,stage:3", devices="6", global_batch_size=4, eval_batch_size=4),
     "config.pipeline_microbatches=0 (the default for 3 stages: 12) does not fit 3 stages"),
    (dict(mesh="data:2,stage:2", pipeline_stage_starts="stage3_block1,stage2_block1"),
     "config.pipeline_stage_starts='stage3_block1,stage2_block1': 2 stages need 1 stage starts"),
    (dict(mesh="data:2,model:2", eval_batch_size=33), "config.eval_batch_size 33 is not "
                                                      "divisible by the data axis size 2"),
    (dict(model_kwargs={"width": 3}), "the built-in ResNets take"),
    (dict(mesh="data:2,stage:4", devices="all"), "cannot split 3 residual blocks into 4 stages"),
    (dict(mesh="data:2,stage:2", pipeline_stage_starts="stage9_block1"),
     "stage starts ['stage9_block1'] are not blocks after the first"),
    (dict(mesh="data:2,stage:3"), "has 2 x 3 = 6 devices but device spec '4' "
                                               "selects 4"),
])
def test_pipeline_errors_before_any_compile(overrides, needle, monkeypatch):
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    cfg = {"devices": "4", "global_batch_size": GLOBAL, "eval_batch_size": GLOBAL, **overrides}
    with pytest.raises(ValueError) as e:
        trainer.prepare(small_config(**cfg))
    assert needle in str(e.value)


@pytest.mark.job
def test_pipelined_resume_mid_epoch_is_bitwise_exact(tmp_path, capsys, monkeypatch):
    """data:2,stage:2: halted at step 6 (checkpoints 4 and 6), resumed to the end of the
    epoch: the parameters, BN statistics, optimizer state and val top-1 are bitwise those
    of the run never stopped; its last checkpoint restores onto data:4 bitwise. The start-up lines and summary.json name the mesh and the
    pipeline."""
    from trjax.train import train_and_evaluate
    bits = lambda tree: [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]
    cfg = dict(devices="4", mesh="data:2,stage:2", num_epochs=1, checkpoint_every_steps=4)
    full, s_full = train_and_evaluate(small_config(**cfg), str(tmp_path / "full"))
    assert s_full["mesh"] == "data:2,stage:2" and s_full["pipeline_microbatches"] == 4
    assert s_full["world_size"] == 4 and s_full["local_batch_size"] == 64
    np.testing.assert_allclose(sum(s_full["pipeline_stage_shares"]), 1.0)
    text = capsys.readouterr().out
    assert "mesh=data:2,stage:2" in text and "pipeline: 2 stages x 4 micro-batches (gpipe; BatchNorm over 16 rows)" in text
    _, s_cut = train_and_evaluate(small_config(halt_after_steps=6, **cfg), str(tmp_path / "cut"))
    assert s_cut["halted"] and s_cut["steps"] == 6
    resumed, s_res = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"))
    assert s_res["steps"] == s_full["steps"] == 12
    for name in ("params", "batch_stats", "opt_state"):
        assert bits(getattr(resumed, name)) == bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"]
    # the stage-owned state (every leaf split over 'stage') restores onto data:4, bitwise;
    # the run resumes at its last step and trains none: its train step is the identity
    # (never called; a call would fail), not a data:4 step compiled for nothing
    skip_train_step_compile(monkeypatch)
    moved, s_moved = train_and_evaluate(small_config(**dict(cfg, mesh="")), str(tmp_path / "full"))
    assert s_moved["steps"] == 12 and s_moved["mesh"] == "data:4"
    for name in ("params", "batch_stats", "opt_state"):
        assert bits(getattr(moved, name)) == bits(getattr(full, name)), name


def test_pipelined_fp16_step_equals_gradient_accumulation():
    """fp16 with its loss scale on data:2,stage:2 against the data-parallel step with
    grad_accumulation_steps = 4, from the same state: at the initial 2^15 both overflow and
    skip (every leaf kept, the scale halved); at 2^8 the step is applied, and each lands
    within the one-step bound of the other (the scaled loss seeds the pipeline's backward,
    the gradient is unscaled once in the update); the metric sums and scales agree. The bound
    counts each run's rounding of its fp16 gradients (helpers.HALF_ULP)."""
    pp = _trainer("running", "data:2,stage:2", precision="fp16")
    dp = _trainer("running", precision="fp16")
    batches = digit_like_batches(1, GLOBAL)
    for scale, finite in ((2.0 ** 15, 0), (2.0 ** 8, 1)):
        start = dataclasses.replace(to_host(dp.state), loss_scale=np.float32(scale))
        ref, ref_m = trainer_states(dataclasses.replace(dp, state=put_like(start, dp.state)),
                                    batches)
        worst, got_m = assert_each_step_within_reorder_rounding(
            ref, lambda s, b: pp.train_step(s, trainer_batch(pp, b)), pp.state, batches,
            GLOBAL // 2 * 64, half=HALF_ULP)
        print(f"fp16 pipeline at scale {scale}: worst leaf / bound {worst:.3g}")
        assert got_m[0].finite == ref_m[0].finite == finite
        assert got_m[0].count == ref_m[0].count
        assert float(got_m[0].loss_scale) == float(ref_m[0].loss_scale)
        np.testing.assert_allclose(got_m[0].loss_sum, ref_m[0].loss_sum, rtol=1e-5)


def test_pipelined_adamw_step_equals_gradient_accumulation():
    """adamw (its mu and nu split over 'stage' like the parameters; adam_eps=1 as in
    tests/test_tensor_step.py, so that the update's rounding is the gradient's) with sync BN
    on data:2,stage:2: one step equals the accumulation oracle within the one-step bound."""
    kw = dict(optimizer="adamw", learning_rate=0.003, adam_eps=1.0)
    pp, dp = _trainer("sync", "data:2,stage:2", **kw), _trainer("sync", **kw)
    start = to_host(dp.state)
    batches = digit_like_batches(1, GLOBAL)
    ref, ref_m = trainer_states(dataclasses.replace(dp, state=put_like(start, dp.state)), batches)
    worst, got_m = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: pp.train_step(s, trainer_batch(pp, b)), pp.state, batches,
        GLOBAL // 2 * 64)
    print(f"adamw pipeline: worst leaf / bound {worst:.3g}")
    specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(pp.state.opt_state) if x.ndim]
    assert specs and all("stage" in sp for sp in specs if sp != ()), specs
    assert got_m[0].count == ref_m[0].count and got_m[0].finite == 1


def test_pipelined_step_collectives_by_axis(trainers):
    """The trainer's pipelined step (running BN, data:2,stage:2; stage-owned parameters):
    over 'stage' one all-to-all that hands each stage its leaves, one collective-permute
    each way in the tick loops (M + S - 1 times per step), one all-to-all that hands the
    gradient slices back (with the whole leaves and metric sums tiled S times), and the
    non-finite flag; over 'data' the deep bucket, then the first, of this device's slices;
    over 'data'+'stage' the BN statistics; nothing else."""
    from trjax import comm
    tr = trainers("running", "data:2,stage:2", "gpipe")  # the step test's
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled))
    mesh, plan = tr.world.mesh, tr.plan
    by = {}
    for c in cols:
        by.setdefault(comm.axis_of(c, mesh), []).append(c)
    assert set(by) == {"data", "stage", ("data", "stage")}, by.keys()
    assert [(c["kind"], c["elements"]) for c in by["data"]] == [
        ("all-reduce", plan.bucket_elements["deep"]), ("all-reduce", plan.bucket_elements["first"])]
    assert [(c["kind"], c["elements"]) for c in by[("data", "stage")]] == [
        ("all-reduce", plan.stat_sums_elements)]
    kinds = sorted(c["kind"] for c in by["stage"])
    assert kinds == ["all-reduce", "all-to-all", "all-to-all"] + ["collective-permute"] * 2, kinds
    assert [c["trip_count"] for c in by["stage"] if c["kind"] == "collective-permute"] == \
        [4 + 2 - 1] * 2
    rows = tr.layout.forward_backward.args[-1]  # the StageRows the layout bound
    a2a = [c["elements"] for c in by["stage"] if c["kind"] == "all-to-all"]
    whole = sum(int(np.prod(rows.shapes[i])) for i, d in enumerate(rows.dims) if d is None)
    assert sorted(a2a) == sorted([2 * rows.width, 2 * (rows.width + whole + 4)]), a2a


class ResNet(nn.Module):
    """A user's own model that happens to share trjax's class name."""
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


@pytest.mark.parametrize("mesh", ["data:2,stage:2", "data:2,model:2"])
def test_a_refused_model_is_named_by_its_module(mesh, monkeypatch):
    """A model-parallel mesh refuses your own model naming its module and class, so a
    class called ResNet is not mistaken for trjax's (issue 40)."""
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError) as e:
        trainer.prepare(small_config(devices="4", mesh=mesh, global_batch_size=GLOBAL,
                                     eval_batch_size=GLOBAL), model=ResNet())
    want = "trjax.models.ResNet" if "stage" in mesh else "config.tensor_plan="
    assert f"{__name__}.ResNet" in str(e.value) and want in str(e.value), str(e.value)


def _lowered(**config):
    """The train step of ResNet-8 on data:2,stage:2 (M = 4), lowered (not compiled)."""
    import re
    from trjax import steps
    cfg = small_config(devices="4", mesh="data:2,stage:2", global_batch_size=GLOBAL,
                       eval_batch_size=GLOBAL, pipeline_microbatches=4, **config)
    tr = trainer.prepare(cfg)
    init = trainer.train_state_program(0, tr.layout, tr.exchange)
    text = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                         trainer.step_options(tr))).lower(
        init.abstract, trainer.example_batch(tr, GLOBAL)).as_text()
    rows = re.findall(r"all_to_all.*?-> tensor<2x(\d+)xf32>", text)
    return tr, text, {int(r) for r in rows}


def test_remat_and_stage_starts_reach_the_built_step():
    """Issue 53, kind 1: options the value oracle cannot see, read off the lowered program.
    GPipe's remat puts each stage call behind jax.checkpoint's optimization barriers;
    pipeline_stage_starts moves which blocks a stage owns, so the all-to-all's row width
    (the largest stage's packed slices, R) is the one of that split, computed here from the
    parameter tree by hand."""
    from trjax.parallel import shards
    _, plain, rows = _lowered()
    _, no_remat, _ = _lowered(pipeline_remat=False)
    assert plain.count("optimization_barrier") > no_remat.count("optimization_barrier")
    tr, _, moved = _lowered(pipeline_stage_starts="stage3_block1")
    params = tr.model.abstract_variables(tr.data.image_shape)["params"]
    dims = shards.shard_dims(params, 2)

    def width(second_stage_blocks):
        fill = [0, 0]
        for (path, x), d in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                jax.tree_util.tree_structure(params).flatten_up_to(dims)):
            if d is not None:
                top = path[0].key
                fill[int(top in second_stage_blocks or top == "head")] += x.size // 2
        return max(fill)
    want = width({"stage3_block1"})  # the gather's rows (the scatter's carry the metrics too)
    assert min(moved) == want, (moved, want)
    assert min(rows) != want  # the default split (by MACs) is another one
