"""Your own model on a 'stage' axis (issue 39, item 2): a flax nn.Sequential CNN, written as
Flax users write one (residual blocks as single layers, flax's nn.BatchNorm and nn.Dropout,
the training flag where a layer takes one), is split into contiguous stages balanced by XLA's
cost of each layer and pipelined.

The oracle is the pipeline's own (tests/test_pipeline_step.py): the data-parallel step with
grad_accumulation_steps = M on the same data devices groups each data rank's rows as the
micro-batches do and gives micro-batch j the key fold_in(rank key, j); a layer's dropout key
folds in its own path, the same in a stage as in the whole model. So one step agrees within
the reordered-sum bound, dropout included."""
import flax.linen as nn
import jax
import numpy as np
import pytest

from helpers import (assert_within_bound_except_still, digit_like_batches, small_config,
                     to_host, trainer_batch)
from trjax import models
from trjax.parallel import pipeline
from trjax.train import trainer

GLOBAL = 32


class Block(nn.Module):
    """A residual block: conv, flax BatchNorm, relu, conv, BatchNorm, + skip."""
    features: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Dropout(0.1, deterministic=not train)(y)  # a random stream in every stage
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
        return nn.relu(x + y)


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dropout(0.3, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(10)(x)


def sequential_cnn():
    return nn.Sequential([nn.Conv(16, (3, 3)), nn.relu, Block(), Block(), Block(), Head()])


def _setup(**kw):
    cfg = small_config(global_batch_size=GLOBAL, eval_batch_size=GLOBAL, bn_mode="running",
                       warmup_epochs=0, momentum=0.0, weight_decay=0.0, **kw)
    return trainer.setup(cfg, model=sequential_cnn())


def test_stages_are_balanced_by_each_layers_cost():
    seq = models.as_network(sequential_cnn()).module
    costs = [c["flops"] for c in seq.layer_costs((8, 8, 1))]
    assert costs[2] == costs[3] == costs[4] > 10 * max(costs[0], costs[5]) > 0
    plan = pipeline.plan_stages(seq, (8, 8, 1), 2)
    # the best MAC balance cuts after layers_2; cutting after layers_3 is within 10 % of it
    # and its largest stage holds fewer parameters (the stage-owned buffers' size)
    assert pipeline.balanced_split(costs, 2) == [(0, 3), (3, 6)]
    assert plan.bounds == ((0, 4), (4, 6)) and plan.first == plan.last == ()
    assert max(plan.macs) <= 1.1 * (costs[3] + costs[4] + costs[5]) / 2
    assert plan.param_shares[1] < 0.5 and abs(sum(plan.param_shares) - 1) < 1e-12
    assert plan.names(0) == ["layers_0", "layers_1", "layers_2", "layers_3"]
    assert abs(sum(plan.shares) - 1) < 1e-12


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_sequential_cnn_pipelined_step_equals_gradient_accumulation(schedule):
    """One step on data:2,stage:2 (M = 4) against data:2 with grad_accumulation_steps = 4:
    parameters and flax BatchNorm's running statistics within the one-step bound, the
    metric counts exact; dropout (in every block and the head: both stages) draws the same
    masks in the forward and in every recompute (GPipe's remat, 1F1B's backward, ZB-H1's B
    and W: a recompute that folded in another micro-batch index would differ)."""
    pp = _setup(devices="4", mesh="data:2,stage:2", pipeline_microbatches=4,
                pipeline_schedule=schedule)
    dp = _setup(devices="2", grad_accumulation_steps=4)
    start = to_host(dp.state)
    for a, b in zip(jax.tree_util.tree_leaves(to_host(pp.state).params),
                    jax.tree_util.tree_leaves(start.params)):
        np.testing.assert_array_equal(a, b)  # the same initial parameters
    batch = digit_like_batches(1, GLOBAL)[0]
    got, gm = pp.train_step(pp.state, trainer_batch(pp, batch))
    want, wm = dp.train_step(dp.state, trainer_batch(dp, batch))
    got, want, gm, wm = to_host(got), to_host(want), to_host(gm), to_host(wm)
    rows = GLOBAL * 8 * 8
    assert_within_bound_except_still(got.params, want.params, start.params, rows)
    assert_within_bound_except_still(got.batch_stats, want.batch_stats, start.batch_stats, rows)
    assert gm.count == wm.count == GLOBAL - 3 and gm.finite == wm.finite == 1
    np.testing.assert_allclose(gm.loss_sum, wm.loss_sum, rtol=1e-5)
    # dropout reached the pipeline: without it the step would differ
    assert not np.isclose(gm.loss_sum, _no_dropout_loss(batch), rtol=1e-6)


def _no_dropout_loss(batch):
    dp = _setup(devices="2", grad_accumulation_steps=4)
    tr = trainer.setup(dp.config, model=nn.Sequential(
        list(sequential_cnn().layers[:-1]) + [HeadNoDropout()]))
    return float(to_host(tr.train_step(tr.state, trainer_batch(tr, batch))[1]).loss_sum)


class HeadNoDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10, name="Dense_0")(x.mean(axis=(1, 2)))


def test_a_model_that_is_not_a_sequence_is_refused_saying_how_to_write_it(monkeypatch):
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=r"write it as nn.Sequential\(\[...\]\)"):
        trainer.prepare(small_config(devices="4", mesh="data:2,stage:2", global_batch_size=GLOBAL,
                                     eval_batch_size=GLOBAL), model=Plain())


class Plain(nn.Module):  # a CNN written as one __call__: no layers to cut between
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(Block()(nn.Conv(16, (3, 3))(x), train).mean(axis=(1, 2)))


def test_an_nnx_sequential_pipelined_step_equals_gradient_accumulation():
    """An nnx.Sequential CNN (nnx.BatchNorm, an nnx.Dropout with its own stream) on
    data:2,stage:4 (M = 4) against data:2 with grad_accumulation_steps = 4: each stage merges
    the model from its own layers, so BatchNorm paths and dropout streams are the whole
    model's; one step within the bound, the evaluation's sums equal. The same model without
    dropout gives another loss (the masks reached the pipeline)."""
    from test_compose import _assert_step_equal, _config, assert_axis_bytes_are_the_models
    from test_tensor_plan import nnx_sequential
    from trjax.data import input_pipeline as ip
    data = ip.load_digits()
    pp = trainer.setup(_config("data:2,stage:4", bn_mode="running", pipeline_microbatches=4),
                       data, model=nnx_sequential())
    plan = pp.layout.describe()["pipeline_stage_shares"]
    assert len(plan) == 4 and pp.layout.line.endswith("layers/0, layers/2, layers/3, layers/6")
    dp = trainer.setup(_config("data:2", bn_mode="running", grad_accumulation_steps=4), data,
                       model=nnx_sequential())
    worst = _assert_step_equal(pp, dp)
    print(f"nnx.Sequential on data:2,stage:4: worst leaf / bound {worst:.3g}")
    assert_axis_bytes_are_the_models(pp)  # S = 4: three boundaries, the all-to-alls
    quiet = nnx_sequential()
    quiet.layers[9].rate = 0.0
    nd = trainer.setup(_config("data:2", bn_mode="running", grad_accumulation_steps=4), data,
                       model=quiet)
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    losses = [float(to_host(t.train_step(t.state, ip.to_device(batch, t.world.sharded(), 10))[1])
                    .loss_sum) for t in (dp, nd)]
    assert not np.isclose(*losses, rtol=1e-6), losses
