"""Your own model: any flax CNN (linen or nnx) trains through trjax unchanged (issue 30).

The models below are written as flax's documentation writes them, not in trjax's terms.
Each kind -- linen with nn.BatchNorm, with GroupNorm/LayerNorm, without normalisation,
with nn.Dropout, and an nnx CNN with nnx.BatchNorm and nnx.Dropout -- is checked for:
(a) one step on 8 devices against the model's own library on one device on the whole
batch (params and BatchNorm statistics within helpers.reorder_rounding_bound);
(b) flax's BatchNorm on a padded batch over 8 devices gets the count-weighted
statistics of the real rows; (c) train_and_evaluate(model=...) resumed mid-epoch is
bitwise the uninterrupted run, dropout included; (d) the comm report's two bucket
all-reduces, deep first. Then the bucket rule on these models and the errors before
compiling.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import assert_within_bound_except_still, small_config, to_host
from trjax import models, steps
from trjax.data import input_pipeline as ip
from trjax.objective import StepOptions
from trjax.regions import Region, assign_regions
from trjax.state import create_train_state
from trjax.train import prepare, setup, train_and_evaluate


# -- the models, flax's way ------------------------------------------------------------------

class LinenBN(nn.Module):
    """A CNN with flax's BatchNorm (two momentums, flax's default epsilon)."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(features=8, kernel_size=(3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=16, kernel_size=(3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)  # momentum 0.99, flax's default
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))  # flatten
        return nn.Dense(features=self.num_classes)(x)


class LinenGroupNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3))(x)))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.LayerNorm()(nn.Conv(16, (3, 3))(x)))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


class LinenPlain(nn.Module):
    """The CNN of flax's linen quick start: Conv + Dense, no normalisation."""
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=8, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=16, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=32)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


class LinenDropout(nn.Module):
    rate: float = 0.3

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        x = nn.Dropout(rate=self.rate, deterministic=not train)(x.reshape((x.shape[0], -1)))
        return nn.Dense(10)(x)


class NNXCNN(nnx.Module):
    """An nnx CNN as flax's nnx docs write one: layers built with rngs, ``model.train()``
    / ``model.eval()`` switching BatchNorm and Dropout."""

    def __init__(self, dropout: float = 0.2, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.linear = nnx.Linear(16 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = x.reshape((x.shape[0], -1))  # flatten
        return self.linear(self.dropout(x))


KINDS = {"linen_bn": LinenBN, "linen_groupnorm": LinenGroupNorm, "linen_plain": LinenPlain,
         "linen_dropout": LinenDropout, "nnx_bn": lambda: NNXCNN(0.0, rngs=nnx.Rngs(0)),
         # an nnx class as flax's bridge makes it a linen module (config.model by import path)
         "nnx_to_linen": lambda: nnx.bridge.to_linen(NNXCNN, 0.0)}

LR, GLOBAL = 0.1, 32


def _digits():
    return ip.load_digits()


def _config(devices, bn_mode="sync", **kw):
    """Plain SGD at LR (no momentum, decay or warmup): one step is ``p - LR * mean grad``."""
    return small_config(devices=devices, global_batch_size=GLOBAL, eval_batch_size=GLOBAL,
                        bn_mode=bn_mode, momentum=0.0, weight_decay=0.0, warmup_epochs=0,
                        learning_rate=LR, **kw)


def _one_step(model, devices, bn_mode="sync"):
    """``(start, after, trainer, host batch)``: one trjax step on the first GLOBAL digits."""
    data = _digits()
    cfg = _config(devices, bn_mode)
    tr = prepare(cfg, data, model=model)
    state = create_train_state(cfg.seed, tr.layout, tr.exchange)
    start = to_host(state)
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    step = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan))
    after, _ = step(state, ip.to_device(batch, tr.world.sharded(), 10))
    return start, to_host(after), tr, batch


def _linen_reference(module, params, batch_stats, x, labels, keys=None):
    """One SGD step of plain flax on one device on the whole batch: the mean loss, flax's
    own BatchNorm (use_running_average=False) updating batch_stats. ``keys``: per block of
    rows, the dropout key of the rank that held it (the blocks are independent rows)."""
    train = {"train": True} if models.as_network(module).train_flag else {}

    def loss_fn(p):
        if keys is None:
            logits, new = module.apply({"params": p, "batch_stats": batch_stats}, x, **train,
                                       mutable=["batch_stats"])
        else:
            blocks = zip(jnp.split(x, len(keys)), keys)
            logits = jnp.concatenate([module.apply({"params": p}, b, **train,
                                                   rngs={"dropout": k}) for b, k in blocks])
            new = {"batch_stats": batch_stats}
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, new.get("batch_stats", {})

    (_, new_bs), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, g), new_bs


def _nnx_reference(model, x, labels):
    """One SGD step of plain nnx: ``model.train()``, nnx.value_and_grad, nnx's BatchNorm."""
    model.train()

    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), labels).mean()

    grads = nnx.jit(lambda m: nnx.grad(loss_fn)(m))(model)
    p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = jax.tree_util.tree_map(lambda a, g: a - LR * g, p, nnx.to_pure_dict(grads))
    return new, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_eight_devices_equal_the_library_on_one_device(kind):
    """(a) One step on 8 devices (sync BN) against the model's own library on the 32 rows
    at once, within the reordered-sum bound of one step over 32 rows."""
    start, after, tr, batch = _one_step(KINDS[kind](), "8")
    x = models.normalize(batch["image"], tr.data.mean, tr.data.std)
    labels = batch["label"].astype(np.int32)
    if kind.startswith("nnx"):
        ref = NNXCNN(0.0, rngs=nnx.Rngs(0))
        own = nnx.state(ref, nnx.Param)
        if kind == "nnx_bn":  # trjax starts from the instance's own values
            assert all(np.array_equal(a, b) for a, b in zip(
                jax.tree_util.tree_leaves(start.params),
                jax.tree_util.tree_leaves(nnx.to_pure_dict(own))))
        else:  # the class is built by trjax, per replica key: start the reference there
            nnx.replace_by_pure_dict(own, start.params)
            nnx.update(ref, own)
        params, stats = _nnx_reference(ref, x, labels)
    else:
        keys = None
        if kind == "linen_dropout":  # rank r's rows drew dropout_key(seed, step 0, r, micro 0)
            keys = [steps.dropout_key(tr.config.seed, 0, r, 0) for r in range(8)]
        params, stats = _linen_reference(tr.model.module, start.params, start.batch_stats, x,
                                         labels, keys)
    worst = assert_within_bound_except_still(after.params, params, start.params, GLOBAL)
    if jax.tree_util.tree_leaves(start.batch_stats):
        worst = max(worst, assert_within_bound_except_still(after.batch_stats, stats,
                                                            start.batch_stats, GLOBAL))
    else:
        assert start.batch_stats == {} and after.batch_stats == {}
    print(f"{kind}: worst leaf / bound {worst:.3g}")


def test_running_mode_statistics_equal_flax_on_the_whole_batch():
    """``running`` mode normalises with each device's rows but keeps the global batch's
    running statistics: the first BatchNorm's are those of flax's BatchNorm on the 32 rows
    at once (the later layers see inputs normalised per device)."""
    start, after, tr, batch = _one_step(LinenBN(), "8", "running")
    x = models.normalize(batch["image"], tr.data.mean, tr.data.std)
    _, stats = _linen_reference(tr.model.module, start.params, start.batch_stats, x,
                                batch["label"].astype(np.int32))
    first = lambda t: t["BatchNorm_0"]
    assert_within_bound_except_still(first(after.batch_stats), first(stats),
                                     first(start.batch_stats), GLOBAL)


# -- (b) flax's BatchNorm on a padded batch: the count-weighted statistics --------------------

class OneBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x.reshape((x.shape[0], -1)))
        return nn.Dense(10)(x)


@pytest.mark.parametrize("bn_mode,k", [("running", 1), ("sync", 1), ("local", 1),
                                       ("running", 2)])
def test_padded_batch_flax_batchnorm_counts_real_rows(bn_mode, k):
    """8 devices of 4 rows: device 0 real rows [0, 0, 0], device 1 one real row [4], the
    rest padding (NaN). The batch mean is 1.0 and the biased variance 3.0 (flax's running
    rule keeps the biased variance): mean 0.9 * 0 + 0.1 * 1 = 0.1, var 0.9 * 1 + 0.1 * 3
    = 1.2 -- not flax's mean of the devices' means (2.0, var 4.0: 0.2, 1.3). In ``local``
    mode each device keeps its own rows; k = 2 micro-batches add up the same."""
    rows = np.full(32, np.nan, np.float32)
    rows[[0, 1, 2, 4]] = [0, 0, 0, 4]
    mask = (~np.isnan(rows)).astype(np.float32)
    data = ip.Dataset(ip.Split(np.zeros((64, 1, 1, 1), np.float32), np.zeros(64, np.int64)),
                      ip.Split(np.zeros((8, 1, 1, 1), np.float32), np.zeros(8, np.int64)), 10,
                      "rows")
    cfg = _config("8", bn_mode, grad_accumulation_steps=k)
    tr = prepare(cfg, data, model=OneBN())
    state = create_train_state(cfg.seed, tr.layout, tr.exchange)
    step = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                         StepOptions(grad_accumulation_steps=k)))
    batch = {"image": rows.reshape(32, 1, 1, 1), "label": np.zeros(32, np.int32), "mask": mask}
    state, m = step(state, jax.device_put(batch, tr.world.sharded()))
    stats = to_host(state.batch_stats)["BatchNorm_0"]
    assert float(np.asarray(m)[4]) == 1.0  # finite: the NaN padding reached nothing
    assert np.all(np.isfinite(np.concatenate([np.ravel(x) for x in
                                              jax.tree_util.tree_leaves(to_host(state.params))])))
    if bn_mode == "local":
        np.testing.assert_allclose(stats["mean"][:, 0], [0.0, 0.4] + [0.0] * 6, atol=1e-7)
        np.testing.assert_allclose(stats["var"][:, 0], [0.9, 0.9] + [1.0] * 6, rtol=1e-6)
    else:
        np.testing.assert_allclose(stats["mean"], [0.1], rtol=1e-6)
        np.testing.assert_allclose(stats["var"], [1.2], rtol=1e-6)


# -- (c) train_and_evaluate with model=, resumed mid-epoch: bitwise -------------------------

def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]


@pytest.mark.job
@pytest.mark.parametrize("kind", ["linen_dropout", "nnx_dropout_bn"])
def test_train_and_evaluate_resume_is_bitwise(kind, tmp_path):
    make = {"linen_dropout": LinenDropout,
            "nnx_dropout_bn": lambda: NNXCNN(0.3, rngs=nnx.Rngs(0))}[kind]
    d = _digits()
    data = ip.Dataset(ip.Split(d.train.images[:448], d.train.labels[:448]),
                      ip.Split(d.val.images[:64], d.val.labels[:64]), 10, "digits-448",
                      mean=d.mean, std=d.std)
    cfg = dict(devices="4", global_batch_size=64, eval_batch_size=64, num_epochs=2,
               checkpoint_every_steps=4, bn_mode="running", warmup_epochs=0, learning_rate=0.5)
    full, s_full = train_and_evaluate(small_config(**cfg), str(tmp_path / "full"), data,
                                      model=make())
    assert s_full["steps"] == 14 and s_full["val_top1"] > 0.3  # it learns
    _, s_part = train_and_evaluate(small_config(halt_after_steps=9, **cfg), str(tmp_path / "cut"),
                                   data, model=make())
    assert s_part["halted"] and s_part["steps"] == 9
    resumed, s_res = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"), data,
                                        model=make())
    for name in ("params", "batch_stats", "opt_state"):
        assert _bits(getattr(resumed, name)) == _bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"] and s_res["val_loss"] == s_full["val_loss"]


def test_dropout_draws_per_step_and_rank():
    """The dropout key is fold_in(fold_in(fold_in(key(seed), step), rank), micro): other
    steps and other ranks draw other masks; the same arguments the same key."""
    k = lambda *a: np.asarray(jax.random.key_data(steps.dropout_key(*a)))
    assert np.array_equal(k(0, 3, 1, 0), k(0, 3, 1, 0))
    assert len({k(0, s, r, m).tobytes() for s in (0, 1) for r in (0, 1) for m in (0, 1)}) == 8
    assert not np.array_equal(k(0, 3, 1, 0), k(1, 3, 1, 0))


# -- (d) the comm report of a user model ------------------------------------------------------

def test_comm_report_two_bucket_all_reduces_deep_first():
    from trjax.report import comm_report
    r = comm_report(setup(small_config(devices="2", global_batch_size=32, eval_batch_size=32),
                          _digits(), model=LinenBN()))
    assert r["gradient_all_reduces"] == 2 and r["bucket_elements_match_plan"]
    assert r["deep_before_first_conv_wgrad"]
    carries = [c["carries"] for c in r["train_step"]["collectives"]]
    assert carries[:2] == [["bucket:deep (deep convs + metrics)"],
                           ["bucket:first (first conv + BN + FC)"]]
    assert carries[2:] == [["bn:running statistics"]]
    assert r["eval_step"]["count"] == 0 and r["eval_reduce"]["count"] == 1


# -- the bucket rule, names, errors -----------------------------------------------------------

def _regions(model, shape=(8, 8, 1)):
    net = models.as_network(model)
    v = jax.eval_shape(lambda k: net.init(k, shape), jax.random.key(0))
    return assign_regions(net, v, jax.ShapeDtypeStruct((2,) + shape, jnp.float32))


def test_bucket_rule_on_user_models():
    r = _regions(LinenBN())
    assert r["params/Conv_0/kernel"] == Region.FIRST_CONV
    assert r["params/Conv_1/kernel"] == Region.DEEP_CONV
    assert (r["params/Dense_0/kernel"], r["params/Dense_0/bias"]) == (Region.FC_WEIGHT,
                                                                       Region.FC_BIAS)
    assert r["params/Conv_0/bias"] == r["params/BatchNorm_1/bias"] == Region.BN_BIAS
    assert r["params/BatchNorm_0/scale"] == Region.BN_SCALE
    assert r["batch_stats/BatchNorm_1/var"] == Region.RUNNING_VAR
    r = _regions(LinenPlain())  # a hidden dense layer is a deep kernel
    assert [r[f"params/{m}/kernel"] for m in ("Conv_0", "Conv_1", "Dense_0", "Dense_1")] == \
        [Region.FIRST_CONV, Region.DEEP_CONV, Region.DEEP_CONV, Region.FC_WEIGHT]
    r = _regions(NNXCNN(rngs=nnx.Rngs(0)))
    assert r["params/conv1/kernel"] == Region.FIRST_CONV
    assert r["params/conv2/kernel"] == Region.DEEP_CONV
    assert r["params/linear/kernel"] == Region.FC_WEIGHT
    assert r["params/bn2/scale"] == Region.BN_SCALE

    class Odd(nn.Module):  # a layer type trjax never saw; two layers read the input
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (3, 3, 1, 4))
            a = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            b = nn.Conv(4, (1, 1), name="side")(x / 16.0)
            gain = self.param("gain", nn.initializers.ones, (4,))
            return nn.Dense(10, name="out")((a + b).mean((1, 2)) * gain[None])

    r = _regions(Odd())
    assert r["params/w"] == r["params/side/kernel"] == Region.FIRST_CONV
    assert r["params/gain"] == Region.BN_SCALE and r["params/out/kernel"] == Region.FC_WEIGHT


def test_checkpoint_names_are_the_modules_own():
    """The state holds the user's own parameter and collection names: it applies in their
    module as it is (params/BatchNorm_0/{scale,bias}, batch_stats/BatchNorm_0/{mean,var})."""
    data = _digits()
    model = LinenBN()
    tr = prepare(_config("2", "running"), data, model=model)
    state = create_train_state(0, tr.layout, tr.exchange)
    own = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False)
    assert jax.tree_util.tree_structure(to_host(state.params)) == \
        jax.tree_util.tree_structure(own["params"])
    assert set(state.batch_stats["BatchNorm_0"]) == {"mean", "var"}
    assert set(state.params["BatchNorm_0"]) == {"scale", "bias"}
    logits = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                         jnp.zeros((3, 8, 8, 1)), train=False)
    assert logits.shape == (3, 10)


class WrongK(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(7)(nn.Conv(4, (3, 3))(x).mean((1, 2)))


class IntLogits(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.round(nn.Dense(10)(x.reshape((x.shape[0], -1)))).astype(jnp.int32)


class Pair(nn.Module):  # a dict: trjax cannot tell which entry the logits are
    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.Dense(10)(x.reshape((x.shape[0], -1)))
        return {"logits": y, "features": y}


@pytest.mark.parametrize("model,needle", [
    (WrongK(), r"returned shape \(2, 7\); trjax needs logits \[B, num_classes\] = \[2, 10\]"),
    (IntLogits(), r"returned int32 logits; trjax needs a float dtype"),
    (Pair(), r"trjax needs the logits, one array \[B, 10\], alone or first in a tuple"),
    (lambda x: x, r"is neither a flax linen Module nor an nnx Module"),
    (LinenBN, r"model=LinenBN is a class: pass an instance"),
])
def test_bad_models_fail_before_compiling(model, needle, monkeypatch):
    monkeypatch.setattr(steps, "make_train_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises((ValueError, TypeError), match=needle):
        setup(_config("2"), _digits(), model=model)


class OwnStats(nn.Module):  # a layer keeping its own statistic in batch_stats
    @nn.compact
    def __call__(self, x, train: bool):
        seen = self.variable("batch_stats", "seen", lambda: jnp.zeros((), jnp.float32))
        if train and not self.is_initializing():
            seen.value = seen.value + 1.0
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_statistics_of_an_unknown_layer_are_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(steps, "make_train_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=r"batch_stats/seen is not kept by a BatchNorm trjax "
                                         r"adapts"):
        setup(_config("2"), _digits(), model=OwnStats())


class FrozenBN(nn.Module):  # BatchNorm frozen in training (fine-tuning style)
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(x)))
        x = nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_a_frozen_batchnorm_keeps_its_statistics():
    start, after, _, _ = _one_step(FrozenBN(), "2", "running")
    assert _bits(after.batch_stats["BatchNorm_0"]) == _bits(start.batch_stats["BatchNorm_0"])
    assert _bits(after.batch_stats["BatchNorm_1"]) != _bits(start.batch_stats["BatchNorm_1"])


@pytest.mark.parametrize("kw", [{}, {"use_scale": False}, {"use_bias": False, "epsilon": 1e-3},
                                {"axis": 1, "momentum": 0.5}, {"dtype": jnp.bfloat16}])
def test_flax_batchnorm_settings_are_honoured(kw):
    """One device, no padding: trjax's statistics give flax's own BatchNorm output and
    running update (momentum, epsilon, axis, use_scale / use_bias, dtype), to rounding."""
    from trjax.batchnorm import BatchNormContext, update_running_tree
    x = jax.random.normal(jax.random.key(1), (6, 5, 4, 3)) * 3 + 2

    class M(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            return nn.BatchNorm(use_running_average=not train, **kw)(x)

    m, net = M(), models.as_network(M())
    v = jax.tree_util.tree_map(lambda a: a + 0.1, m.init(jax.random.key(0), x, train=False))
    ref, new = jax.jit(lambda v: m.apply(v, x, train=True, mutable=["batch_stats"]))(v)

    def ours(v):
        ctx = BatchNormContext("local")
        y, sums = net.apply_train(v["params"], v["batch_stats"], x, ctx)
        return y, update_running_tree(v["batch_stats"], sums, 0.9, ctx.rules)

    y, stats = jax.jit(ours)(v)
    assert y.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               atol=4e-6 if y.dtype == jnp.float32 else 2e-2)
    for a, b in zip(jax.tree_util.tree_leaves(stats), jax.tree_util.tree_leaves(new)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)


@pytest.mark.job
def test_resume_with_another_model_is_refused_by_name(tmp_path):
    data = _digits()
    train_and_evaluate(_config("2", halt_after_steps=1), str(tmp_path), data, model=LinenPlain())
    with pytest.raises(ValueError, match=r"incompatible with this config: model_layout"):
        train_and_evaluate(_config("2"), str(tmp_path), data, model=LinenGroupNorm())
