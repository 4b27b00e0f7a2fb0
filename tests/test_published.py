"""Published models' conventions, unchanged (issue 40, kind 5).

- an nnx model that takes its random keys at call time, ``__call__(x, rngs=None)`` (the
  NNX MNIST tutorial's CNN);
- a model that returns ``(logits, extras)`` (every big_vision model);
- random streams other than ``dropout`` (DropPath's ``drop_path``, stochastic depth's
  ``stochastic_depth``, and any other name through flax's fallback to ``params``);
- a BatchNorm momentum close to 1 (0.997): a warning before compiling, and
  ``config.bn_momentum`` sets every layer's, the model's own included.

The right values: flax itself on one device, called as its authors call it, with the keys
trjax documents (``models.RNG_STREAMS``), and numpy for the running statistics.
"""
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import assert_within_bound_except_still, small_config, to_host
from trjax import models, steps
from trjax.batchnorm import BatchNormContext
from trjax.data import input_pipeline as ip
from trjax.state import create_train_state
from trjax.train import prepare

X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8, 8, 1)), jnp.float32)
KEY = jax.random.key(7)


class TutorialCNN(nnx.Module):
    """The NNX MNIST tutorial's CNN (flax docs, 2025), its keys given at call time."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.3)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.3)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = nnx.relu(self.batch_norm2(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def _stream(key, name):
    """The key trjax documents for a linen stream other than ``dropout``."""
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


class DropPathNet(nn.Module):
    """big_vision's contract (``__call__(image, *, train=False)`` -> ``(logits, out)``)
    with a DropPath on the ``drop_path`` stream, stochastic depth on its own stream and
    one more stream under a name trjax does not list."""

    @nn.compact
    def __call__(self, image, *, train=False):
        out = {}
        x = nn.relu(nn.Conv(8, (3, 3))(image))
        if train:
            for name in ("drop_path", "stochastic_depth", "noise"):
                keep = jax.random.bernoulli(self.make_rng(name), 0.7, (x.shape[0], 1, 1, 1))
                x = jnp.where(keep, x / 0.7, 0.0)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        out["pre_logits"] = jnp.mean(x, axis=(1, 2))
        out["logits"] = nn.Dense(10)(out["pre_logits"])
        return out["logits"], out


def test_linen_streams_and_logits_extras_equal_flax_with_the_documented_keys():
    net = models.wrap(DropPathNet(), image_shape=(8, 8, 1), num_classes=10)
    v = net.init(jax.random.key(0), (8, 8, 1))
    got, _ = net.apply_train(v["params"], v["batch_stats"], X, BatchNormContext("local"), KEY)
    rngs = {"dropout": KEY, "drop_path": _stream(KEY, "drop_path"),
            "stochastic_depth": _stream(KEY, "stochastic_depth"),
            "params": _stream(KEY, "params")}  # flax's fallback for "noise"
    want, _ = DropPathNet().apply(v, X, train=True, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # every stream draws its own mask: the same key everywhere would give another result
    same = {k: KEY for k in rngs}
    assert not np.array_equal(np.asarray(DropPathNet().apply(v, X, train=True, rngs=same)[0]),
                              np.asarray(got))
    # evaluation reads the first element, no stream needed
    np.testing.assert_array_equal(np.asarray(net.apply_eval(v["params"], v["batch_stats"], X)),
                                  np.asarray(DropPathNet().apply(v, X)[0]))


def test_nnx_call_time_rngs_equal_nnx_with_the_step_key():
    model = TutorialCNN(rngs=nnx.Rngs(0))
    net = models.wrap(model, image_shape=(8, 8, 1), num_classes=10)
    assert net.call_rngs == "optional" and net.train_flag is None
    v = net.init(None, (8, 8, 1))
    got, sums = net.apply_train(v["params"], v["batch_stats"], X, BatchNormContext("local"), KEY)
    ref = TutorialCNN(rngs=nnx.Rngs(0))
    ref.train()
    want = ref(X, rngs=nnx.Rngs(jax.random.fold_in(KEY, 1), dropout=KEY))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
    assert set(sums) == {"batch_norm1", "batch_norm2"}
    other, _ = net.apply_train(v["params"], v["batch_stats"], X, BatchNormContext("local"),
                               jax.random.key(8))
    assert not np.allclose(np.asarray(got), np.asarray(other))  # the key reaches dropout
    fresh = TutorialCNN(rngs=nnx.Rngs(0))  # ref's statistics moved in training
    fresh.eval()
    np.testing.assert_array_equal(np.asarray(net.apply_eval(v["params"], v["batch_stats"], X)),
                                  np.asarray(fresh(X)))


def test_nnx_call_time_rngs_one_step_on_two_devices_equals_nnx_per_rank():
    """One step on 2 devices (local BN: each rank normalises its own rows) against nnx on
    one device, each rank's rows called with that rank's key, the loss their mean."""
    data, n = ip.load_digits(), 16
    cfg = small_config(devices="2", global_batch_size=n, eval_batch_size=n, bn_mode="local",
                       momentum=0.0, weight_decay=0.0, warmup_epochs=0, learning_rate=0.1)
    tr = prepare(cfg, data, model=TutorialCNN(rngs=nnx.Rngs(0)))
    state = create_train_state(cfg.seed, tr.layout, tr.exchange)
    start = to_host(state)
    batch = {"image": data.train.images[:n], "label": data.train.labels[:n],
             "mask": np.ones(n, np.float32)}
    after, _ = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan))(
        state, ip.to_device(batch, tr.world.sharded(), 10))
    x = models.normalize(batch["image"], tr.data.mean, tr.data.std)
    labels = jnp.asarray(batch["label"], jnp.int32)
    keys = [steps.dropout_key(cfg.seed, 0, r, 0) for r in range(2)]
    ref = TutorialCNN(rngs=nnx.Rngs(0))
    ref.train()

    def loss_fn(m):
        logits = jnp.concatenate([m(b, rngs=nnx.Rngs(jax.random.fold_in(k, 1), dropout=k))
                                  for b, k in zip(jnp.split(x, 2), keys)])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    grads = nnx.to_pure_dict(nnx.grad(loss_fn)(ref))
    want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, start.params, grads)
    assert_within_bound_except_still(to_host(after).params, want, start.params, n * 8 * 8)


class NNXDropPath(nnx.Module):
    """nnx's way to a stream of its own: a Dropout on ``drop_path`` whose Rngs are kept."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.drop_path = nnx.Dropout(0.5, broadcast_dims=(1, 2, 3), rng_collection="drop_path",
                                     rngs=rngs)
        self.fc = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc(jnp.mean(self.drop_path(self.conv(x)), axis=(1, 2)))


def test_nnx_streams_of_their_own_draw_from_the_step_key():
    """Every nnx Rngs stream is re-seeded from the step's key: another key drops other
    examples, the same key the same ones, about half of them at rate 0.5, none in eval."""
    net = models.wrap(NNXDropPath(rngs=nnx.Rngs(0, drop_path=1)), image_shape=(8, 8, 1),
                      num_classes=10)
    v = net.init(None, (8, 8, 1))
    x = jnp.ones((64, 8, 8, 1))
    run = lambda k: np.asarray(net.apply_train(v["params"], v["batch_stats"], x,
                                               BatchNormContext("local"), k)[0])
    clean = np.asarray(net.apply_eval(v["params"], v["batch_stats"], x))
    bias = np.asarray(v["params"]["fc"]["bias"])
    dropped = lambda out: np.all(np.isclose(out, bias), axis=1)  # the whole example zeroed
    a, b = run(KEY), run(jax.random.key(8))
    np.testing.assert_array_equal(a, run(KEY))
    assert 16 <= dropped(a).sum() <= 48 and not np.array_equal(dropped(a), dropped(b))
    assert not dropped(clean).any()


class SlowBN(nn.Module):
    momentum: float = 0.997

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class SlowNNX(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.997, rngs=rngs)
        self.fc = nnx.Linear(4, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc(jnp.mean(self.bn(self.conv(x)), axis=(1, 2)))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_bn_momentum_sets_every_layer_and_the_running_statistics_follow(kind):
    """config.bn_momentum (Network.bn_momentum) replaces the layer's 0.997: the running
    statistics after one update equal numpy's m*r + (1-m)*batch at m = 0.5 (flax's rule:
    biased variance)."""
    model = SlowBN() if kind == "linen" else SlowNNX(rngs=nnx.Rngs(0))
    base = models.wrap(model, image_shape=(8, 8, 1), num_classes=10)
    assert set(models.bn_momenta(base, (8, 8, 1)).values()) == {0.997}
    net = models.wrap(model, image_shape=(8, 8, 1), num_classes=10, bn_momentum=0.5)
    assert set(models.bn_momenta(net, (8, 8, 1)).values()) == {0.5}
    v = net.init(jax.random.key(0), (8, 8, 1))
    ctx = BatchNormContext("local")
    _, sums = net.apply_train(v["params"], v["batch_stats"], X, ctx, None)
    from trjax.batchnorm import update_running_tree
    new = update_running_tree(v["batch_stats"], sums, 0.9, ctx.rules)
    conv = (model.conv if kind == "nnx" else None)
    if kind == "linen":
        h = nn.Conv(4, (3, 3)).apply({"params": v["params"]["Conv_0"]}, X)
        stats = new["BatchNorm_0"]
    else:
        h = conv(X)
        stats = new["bn"]
    h = np.asarray(h, np.float64).reshape(-1, 4)
    np.testing.assert_allclose(np.asarray(stats["mean"]), 0.5 * 0 + 0.5 * h.mean(0), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["var"]), 0.5 * 1 + 0.5 * h.var(0), rtol=1e-5)


def test_a_resnets_momenta_name_every_batchnorm_by_its_module_path():
    """The slow-statistics warning names a layer by its module path, a ResNet's too
    (it printed '*' before)."""
    net = models.as_network(models.create_model("resnet8", num_classes=10, bn_momentum=0.99))
    momenta = models.bn_momenta(net, (8, 8, 1))
    assert momenta == {p: 0.99 for p in (
        "stem_bn", "stage1_block1/BatchNorm_0", "stage1_block1/BatchNorm_1",
        "stage2_block1/BatchNorm_0", "stage2_block1/BatchNorm_1", "stage2_block1/proj_bn",
        "stage3_block1/BatchNorm_0", "stage3_block1/BatchNorm_1", "stage3_block1/proj_bn")}
    with pytest.warns(UserWarning, match=r"e\.g\. 'stage1_block1/BatchNorm_0', momentum 0\.99\)"):
        models.warn_slow_statistics(momenta, 10)


def test_a_momentum_near_one_warns_before_compiling_naming_the_fix(monkeypatch):
    monkeypatch.setattr(steps, "make_train_step", lambda *a, **k: pytest.fail("compiled"))
    cfg = small_config(devices="2", global_batch_size=32, num_epochs=1)  # 45 steps
    with pytest.warns(UserWarning, match=r"momentum 0.997\) keep 87% .* config.bn_momentum"):
        prepare(cfg, ip.load_digits(), model=SlowBN())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(small_config(devices="2", global_batch_size=32, num_epochs=1, bn_momentum=0.9),
                ip.load_digits(), model=SlowBN())


# -- the two-bucket overlap, for any model ---------------------------------------------------

class StdConv(nn.Conv):
    """big_vision's BiT convolution: the kernel standardised per output channel."""

    def param(self, name, *a, **k):
        p = super().param(name, *a, **k)
        if name == "kernel":
            p = p - jnp.mean(p, axis=(0, 1, 2), keepdims=True)
            p = p / (jnp.std(p, axis=(0, 1, 2), keepdims=True) + 1e-10)
        return p


class BiT(nn.Module):  # pre-activation blocks, GroupNorm, (logits, out)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, *, train=False):
        x = StdConv(16, (3, 3), use_bias=False, name="root_conv")(x)
        for _ in range(2):
            y = StdConv(16, (3, 3), use_bias=False)(nn.relu(nn.GroupNorm(4)(x)))
            x = x + StdConv(16, (3, 3), use_bias=False)(nn.relu(nn.GroupNorm(4)(y)))
        x = nn.relu(nn.GroupNorm(4)(x)).mean((1, 2))
        return nn.Dense(self.num_classes, name="head")(x), {"pre_logits": x}


class ConvNeXt(nn.Module):  # patchify stem, depthwise 7x7, LayerNorm, inverted MLP
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.LayerNorm()(nn.Conv(16, (2, 2), strides=2, name="stem")(x))
        for _ in range(2):
            y = nn.LayerNorm()(nn.Conv(16, (7, 7), feature_group_count=16)(x))
            x = x + nn.Dense(16)(nn.gelu(nn.Dense(64)(y)))
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x.mean((1, 2))))


class MobileNetV3(nn.Module):  # hard-swish, depthwise, squeeze-excite, BatchNorm
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        bn = lambda: nn.BatchNorm(use_running_average=not train)
        x = nn.hard_swish(bn()(nn.Conv(16, (3, 3), strides=2, use_bias=False)(x)))
        for _ in range(2):
            y = nn.hard_swish(bn()(nn.Conv(32, (1, 1), use_bias=False)(x)))
            y = nn.hard_swish(bn()(nn.Conv(32, (3, 3), feature_group_count=32,
                                           use_bias=False)(y)))
            s = nn.hard_sigmoid(nn.Dense(32)(nn.relu(nn.Dense(8)(y.mean((1, 2), keepdims=True)))))
            x = x + bn()(nn.Conv(16, (1, 1), use_bias=False)(y * s))
        return nn.Dense(self.num_classes)(x.mean((1, 2)))


@pytest.mark.parametrize("model", [BiT, ConvNeXt, MobileNetV3])
def test_the_deep_all_reduce_never_waits_for_the_first_conv_weight_gradient(model):
    """The promise trjax can keep for any model is a data dependency: the deep bucket's
    all-reduce uses none of the first conv's weight gradient (XLA may then issue it first
    and overlap the two; the order it picks is its own). The first bucket, which carries
    that gradient, does depend on it: the check sees dependencies."""
    from trjax import comm
    from trjax.report import comm_report
    from trjax.train import setup
    tr = setup(small_config(devices="2", global_batch_size=32, eval_batch_size=32),
               ip.load_digits(), model=model())
    r = comm_report(tr)
    assert r["gradient_all_reduces"] == 2 and r["first_conv_wgrad_positions"]
    assert r["deep_waits_for_first_conv_wgrad"] is False
    first = [c["position"] for c in r["train_step"]["collectives"]
             if c["carries"] == ["bucket:first (first conv + BN + FC)"]]
    text = comm.hlo_text(next(s for s in tr.compiled if s.name == "train_step").compiled)
    assert comm.depends_on(text, first, r["first_conv_wgrad_positions"]) is True
