"""Your own model on a 'model' axis by a tensor plan (issue 39, item 3): flax's own nn.Conv /
nn.Dense (and nnx.Conv / nnx.Linear) named by module path are split column / row, Megatron's
pairs, the BatchNorms between them on their local channels, a column layer alone (the
classifier) all-gathered.

The oracle: data:4,model:2 holds on each data rank the rows data:4 gives that rank (and the
same dropout key), and the split layers compute the same sums split over two devices, so one
step lands within helpers' one-step reordered-sum bound of data:4's. A built-in ResNet given
its own split as a plan takes the plan's path and must agree with its built-in split."""
import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

from helpers import assert_within_bound_except_still, put_like, small_config, to_host
from trjax import comm, models
from trjax.parallel import tensor as tensor_plan
from trjax.data import input_pipeline as ip
from trjax.train import trainer

GLOBAL = 32


class Block(nn.Module):
    """A residual block as Flax users write one: conv, flax BatchNorm, relu, conv, BatchNorm."""
    features: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3))(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Conv(self.features, (3, 3))(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
        return nn.relu(x + y)


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dropout(0.3, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(10)(x)


def linen_sequential():
    return nn.Sequential([nn.Conv(16, (3, 3)), nn.relu, Block(), Block(), Head()])


LINEN_PLAN = "layers_*/Conv_0=column,layers_*/Conv_1=row,layers_4/Dense_0=column"


class Pool(nnx.Module):
    def __call__(self, x):
        return x.mean(axis=(1, 2))


def nnx_sequential():
    r = nnx.Rngs(0)
    return nnx.Sequential(
        nnx.Conv(1, 16, (3, 3), rngs=r), nnx.relu,
        nnx.Conv(16, 32, (3, 3), rngs=r), nnx.BatchNorm(32, rngs=r), nnx.relu,
        nnx.Conv(32, 16, (3, 3), rngs=r), nnx.BatchNorm(16, rngs=r), nnx.relu,
        Pool(), nnx.Dropout(0.3, rngs=r), nnx.Linear(16, 10, rngs=r))


NNX_PLAN = "layers/2=column,layers/5=row,layers/10=column"


def _config(devices, mesh="", **kw):
    return small_config(devices=devices, mesh=mesh, global_batch_size=GLOBAL,
                        eval_batch_size=GLOBAL, bn_mode="running", momentum=0.0,
                        weight_decay=0.0, warmup_epochs=0, learning_rate=0.1, **kw)


def test_a_plan_resolves_pairs_channels_and_the_head_by_call_order():
    net = models.as_network(linen_sequential())
    roles = tensor_plan.resolve(net, LINEN_PLAN, (8, 8, 1), 2)
    for b in ("layers_2", "layers_3"):
        assert roles[(b, "Conv_0")] == "column" and roles[(b, "Conv_1")] == "row"
        assert roles[(b, "BatchNorm_0")] == "channel" and (b, "BatchNorm_1") not in roles
    assert roles[("layers_4", "Dense_0")] == "head" and len(roles) == 7
    specs = tensor_plan.specs(net.abstract_variables((8, 8, 1))["params"], roles)
    assert specs["layers_2"]["Conv_0"]["kernel"] == jax.sharding.PartitionSpec(
        None, None, None, "model")
    assert specs["layers_2"]["Conv_1"]["kernel"] == jax.sharding.PartitionSpec(
        None, None, "model", None)
    assert specs["layers_2"]["Conv_1"]["bias"] == jax.sharding.PartitionSpec()
    n = models.as_network(nnx_sequential())
    assert tensor_plan.resolve(n, NNX_PLAN, (8, 8, 1), 2) == {
        ("layers", "2"): "column", ("layers", "3"): "channel", ("layers", "5"): "row",
        ("layers", "10"): "head"}


def test_a_list_of_layers_is_a_sequence():
    """A list of linen layers is an nn.Sequential (each layer with the flag it takes), one
    holding an nnx module an nnx.Sequential; the pipeline splits the former."""
    from trjax.parallel import pipeline
    net = models.as_network([nn.Conv(16, (3, 3)), nn.relu, Block(), Block(), Head()])
    assert isinstance(net.module, models.FlaggedSequential) and len(net.module.layers) == 5
    ref = models.as_network(linen_sequential())
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 1)).astype(np.float32)
    v = ref.init(jax.random.key(0), (8, 8, 1))
    np.testing.assert_array_equal(net.apply_eval(v["params"], v["batch_stats"], x),
                                  ref.apply_eval(v["params"], v["batch_stats"], x))
    assert pipeline.plan_stages(net.module, (8, 8, 1), 2).bounds == ((0, 3), (3, 5))
    layers = list(nnx_sequential().layers)
    n = models.as_network(layers)
    assert n.kind == "nnx" and isinstance(n.module, nnx.Sequential) and n.train_flag is None


@pytest.mark.parametrize("plan,size,match", [
    ("layers_9/Conv_0=column", 2, "names no Conv/Dense layer of the model; its layers are "
                                  "layers_0, layers_2/Conv_0"),
    ("layers_2/Conv_1=row", 2, "follows no column layer"),
    ("layers_2/Conv_0=column,layers_2/Conv_1=row", 3, r"splits its 16 output channels over "
                                                      r"'model':3.*\[1, 2, 4, 8, 16\]"),
    ("layers_4/Dense_0=column", 4, r"splits its 10 output channels over 'model':4"),
    ("layers_2/Conv_0=sideways", 2, "'sideways' is not one of"),
    ("", 2, "the tensor plan is empty"),
])
def test_a_bad_plan_is_an_error_naming_the_layer_and_the_fix(plan, size, match):
    net = models.as_network(linen_sequential())
    with pytest.raises(ValueError, match=match):
        tensor_plan.resolve(net, plan, (8, 8, 1), size)


def test_a_group_norm_between_a_column_and_a_row_layer_is_refused():
    class GN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.GroupNorm(4)(nn.Conv(8, (3, 3))(x))
            return nn.Dense(10)(nn.Conv(8, (3, 3))(x).mean((1, 2)))
    with pytest.raises(ValueError, match="GroupNorm.*only BatchNorm may sit between"):
        tensor_plan.resolve(models.as_network(GN()), "Conv_0=column,Conv_1=row", (8, 8, 1), 2)


def test_your_own_model_on_a_model_axis_needs_a_plan_before_compiling():
    with pytest.raises(ValueError, match="config.tensor_plan=.*layers_2/Conv_0"):
        trainer.setup(_config("4", "data:2,model:2"), ip.load_digits(), model=linen_sequential())
    with pytest.raises(ValueError, match="applies to a mesh with a 'model' axis"):
        trainer.setup(_config("4", tensor_plan=LINEN_PLAN), ip.load_digits(),
                      model=linen_sequential())


def _one_step(make, mesh, plan=""):
    data = ip.load_digits()
    devices = str(np.prod([int(a.split(":")[1]) for a in mesh.split(",")]))
    tr = trainer.setup(_config(devices, mesh, tensor_plan=plan), data, model=make())
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    start = to_host(tr.state)
    after, m = tr.train_step(tr.state, ip.to_device(batch, tr.world.sharded(), 10))
    return tr, start, to_host(after), to_host(m)


@pytest.mark.parametrize("make,plan", [(linen_sequential, LINEN_PLAN),
                                       (nnx_sequential, NNX_PLAN)], ids=["linen", "nnx"])
def test_your_own_model_with_a_plan_equals_data_parallel(make, plan):
    """One step on data:4,model:2 (flax BatchNorm on split channels, Dropout on the head's
    replicated input) from the same initial state lands within the one-step bound of
    data:4's (same rows and dropout keys per data rank); the evaluation gives the same sums;
    the compiled step's collectives over 'model' are the pairs' f/g, the head's gather and
    the non-finite flag."""
    tp, s1, a1, m1 = _one_step(make, "data:4,model:2", plan)
    dp, s0, a0, m0 = _one_step(make, "data:4")
    assert tp.layout.kind == "tensor" and dp.world.data_size == tp.world.data_size == 4
    for a, b in zip(jax.tree_util.tree_leaves(s0), jax.tree_util.tree_leaves(s1)):
        np.testing.assert_array_equal(a, b)
    worst = assert_within_bound_except_still((a1.params, a1.batch_stats),
                                             (a0.params, a0.batch_stats),
                                             (s0.params, s0.batch_stats), GLOBAL)
    print(f"{make.__name__}: worst leaf / bound {worst:.3g}")
    assert m1.count == m0.count and m1.top1 == m0.top1
    va = trainer.evaluate_pass(tp, put_like(a0, tp.state))
    vb = trainer.evaluate_pass(dp, put_like(a0, dp.state))
    np.testing.assert_allclose(va["sums"], vb["sums"], rtol=1e-4)
    cols = comm.collectives_in_hlo(comm.hlo_text(tp.train_step.compiled))
    over = sorted(c["kind"] for c in cols if comm.axis_of(c, tp.world.mesh) == "model")
    pairs = sum(r == "row" for r in tp.layout.network.layer_plan.roles.values())
    # per pair: g forward and f backward; the head: its gather forward and f backward; the
    # non-finite flag (each model rank checked its own slices)
    assert over == ["all-gather"] + ["all-reduce"] * (2 * pairs + 2), over


def test_a_resnets_default_split_is_its_default_plan():
    """ResNet-8 on data:2,model:2 without a plan splits by tensor.default_plan (the
    last stage's block pair and the head) through flax's intercepted layers: the same roles
    and specs as that plan given explicitly, and bitwise the same step."""
    data = ip.load_digits()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    plan = ",".join(f"{k}={v}" for k, v in tensor_plan.default_plan(
        models.create_model("resnet8", num_classes=10)).items())
    assert plan == "stage3_block1/Conv_0=column,stage3_block1/Conv_1=row,head=column"
    runs = []
    for p in ("", plan):
        tr = trainer.setup(_config("4", "data:2,model:2", tensor_plan=p), data)
        after, m = tr.train_step(tr.state, ip.to_device(batch, tr.world.sharded(), 10))
        runs.append((tr, to_host(after), to_host(m)))
    (b, a0, m0), (g, a1, m1) = runs
    assert b.layout.network.layer_plan.roles == g.layout.network.layer_plan.roles == {
        ("stage3_block1", "Conv_0"): "column", ("stage3_block1", "BatchNorm_0"): "channel",
        ("stage3_block1", "Conv_1"): "row", ("head",): "head"}
    assert b.layout.network.folds  # a ResNet still folds BatchNorm for its evaluation
    assert [x.sharding.spec for x in jax.tree_util.tree_leaves(b.state.params)] == \
        [x.sharding.spec for x in jax.tree_util.tree_leaves(g.state.params)]
    for x, y in zip(jax.tree_util.tree_leaves((a0, m0)), jax.tree_util.tree_leaves((a1, m1))):
        np.testing.assert_array_equal(x, y)
