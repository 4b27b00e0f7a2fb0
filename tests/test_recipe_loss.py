"""Issue 30's open recipe, the rest: label_smoothing, the loss_fn= hook, mixup / cutmix,
the transform= hook and zero_init_residual, each against a hand computation (numpy)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import IMAGE_SHAPE, max_rel, random_batch, to_host
from trjax import exchange, models, parallel, steps
from trjax.data import augment, input_pipeline
from trjax.objective import StepOptions
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world

K = 10


class Linear(nn.Module):
    """A tiny model without BatchNorm: flatten + one dense layer."""

    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(K, name="head")(x.reshape((x.shape[0], -1))).astype(jnp.float32)


def _np_log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _fb(model, params, batch, **kw):
    """forward_backward on one device (no shard_map), jitted."""
    fn = lambda p, b: steps.forward_backward(model, p, {}, b, rng=steps.dropout_key(0, 3, 0),
                                             **kw)[:2]
    return jax.jit(fn)(params, batch)


def _linear():
    model = Linear()
    params = model.init(jax.random.key(0), jnp.zeros((1,) + IMAGE_SHAPE))["params"]
    return model, params


def _padded_batch(n=8, real=6, seed=0):
    b = random_batch(n, seed=seed)
    b["mask"][real:] = 0.0
    return b


# -- 1. label smoothing -------------------------------------------------------------------

def test_label_smoothing_loss_sum_equals_numpy_and_top1_stays_hard():
    model, params = _linear()
    batch = _padded_batch()
    eps = 0.1
    _, sums = _fb(model, params, batch, label_smoothing=eps)
    _, plain = _fb(model, params, batch)
    logits = np.asarray(model.apply({"params": params}, batch["image"]))
    target = (1 - eps) * np.eye(K)[batch["label"]] + eps / K
    losses = -(target * _np_log_softmax(logits)).sum(axis=1)
    want = losses[batch["mask"] > 0].sum()
    assert abs(float(sums[0]) - want) <= 1e-5 * abs(want)
    assert float(sums[0]) != float(plain[0])
    np.testing.assert_array_equal(np.asarray(sums[1:]), np.asarray(plain[1:]))  # top1/5, count


# -- 2. loss_fn= --------------------------------------------------------------------------

def _squared_error(logits, labels):
    return jnp.sum((logits - jax.nn.one_hot(labels, logits.shape[-1])) ** 2, axis=-1)


def test_loss_fn_hook_step_equals_one_device_and_a_scalar_is_refused():
    world = make_world("all", 32)
    model = Linear()
    plan = build_plan(model, IMAGE_SHAPE)
    tx = optax.sgd(0.1)
    ex = exchange.allreduce(tx, plan)
    layout = parallel.data_parallel(model, world, IMAGE_SHAPE, "sync")
    state = create_train_state(jax.random.key(0), layout, ex)
    s0 = to_host(state)
    batch = random_batch(32, seed=1)
    batch["mask"][29:] = 0.0  # three padding rows
    step = jax.jit(steps.make_train_step(layout, ex, plan, StepOptions(loss_fn=_squared_error)))
    new, m = step(state, jax.device_put(batch, world.sharded()))
    real = batch["mask"] > 0

    def mean_loss(p):
        logits = model.apply({"params": p}, jnp.asarray(batch["image"]))
        return jnp.sum(jnp.where(real, _squared_error(logits, batch["label"]), 0.0)) / real.sum()
    g = jax.grad(mean_loss)(s0.params)
    want = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, s0.params, g)
    assert max_rel(to_host(new).params, want) <= 1e-5
    logits = np.asarray(model.apply({"params": s0.params}, batch["image"]), np.float64)
    want_sum = ((logits - np.eye(K)[batch["label"]]) ** 2).sum(axis=1)[real].sum()
    assert abs(float(np.asarray(m)[0]) - want_sum) <= 1e-5 * want_sum
    with pytest.raises(ValueError, match=r"shape \(\).*return per-example losses; trjax sums"):
        steps.check_loss_fn(lambda lg, lb: _squared_error(lg, lb).mean(), K)
    with pytest.raises(TypeError, match="not callable"):
        steps.check_loss_fn(3, K)
    steps.check_loss_fn(_squared_error, K)  # the right shape passes


# -- 3. mixup / cutmix --------------------------------------------------------------------

def test_mix_partner_pairs_real_rows_only():
    mask = np.array([1, 1, 0, 1, 1, 0, 0, 1], np.float32)  # a masked row in the middle too
    for seed in range(5):
        perm = np.asarray(steps.mix_partner(jax.random.key(seed), jnp.asarray(mask)))
        real = np.flatnonzero(mask)
        assert sorted(perm[real]) == list(real)  # a permutation of the real rows
        pad = np.flatnonzero(mask == 0)
        np.testing.assert_array_equal(perm[pad], pad)  # padding stays padding


def test_mixing_by_hand_fixed_lambda_and_permutation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5, 6, 2)).astype(np.float32)
    x[3] = np.nan  # the padding row
    mask = np.array([1, 1, 1, 0], np.float32)
    perm = np.array([2, 0, 1, 3], np.int32)
    lam = np.float32(0.3)
    got = np.asarray(steps.mix_images(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(perm), lam))
    want = lam * x + (1 - lam) * x[perm]
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6)
    assert np.isnan(got[3]).all() and np.isfinite(got[:3]).all()
    # cutmix: the box's pixels from the partner, the rest its own; lam = 1 - area
    box, lam_c = steps.cutmix_box(jax.random.key(1), jnp.float32(0.5), 5, 6)
    box = np.asarray(box)
    assert 0 < box.sum() < 30 and abs(float(lam_c) - (1 - box.sum() / 30)) < 1e-7
    got = np.asarray(steps.mix_images(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(perm),
                                      lam_c, jnp.asarray(box)))
    want = np.where(box[None, :, :, None], x[perm], x)
    np.testing.assert_array_equal(got[:3], want[:3])
    # the soft-target loss: lam * smooth(onehot(y)) + (1 - lam) * smooth(onehot(y[perm]))
    logits = rng.normal(size=(4, K)).astype(np.float32)
    labels = np.array([1, 4, 7, 0], np.int32)
    losses = np.asarray(steps.example_losses(jnp.asarray(logits), jnp.asarray(labels), None, 0.1,
                                             (jnp.asarray(perm), lam)))
    t = (1 - 0.1) * np.eye(K)[labels] + 0.1 / K
    t = lam * t + (1 - lam) * t[perm]
    np.testing.assert_allclose(losses, -(t * _np_log_softmax(logits)).sum(1), rtol=1e-5)


def test_mixup_step_with_padding_nan_and_alpha_zero_is_the_plain_step():
    # ResNet-8 cut to one BasicBlock of 8 channels (BatchNorm over the mixed rows included)
    model = models.create_model("resnet8", num_classes=K, bn_mode="sync", axis_name=None,
                                stage_sizes=(1,), widths=(8,), stem_width=8)
    variables = models.as_network(model).init(jax.random.key(0), IMAGE_SHAPE)
    params, bs = variables["params"], variables["batch_stats"]
    batch = _padded_batch(8, 6)
    fn = lambda b, **kw: steps.forward_backward(model, params, bs, b,
                                                rng=steps.dropout_key(0, 3, 0), **kw)
    # (b) mixup_alpha=0 (and cutmix 0, smoothing 0) is the plain program, bit for bit
    lower = lambda **kw: jax.jit(lambda b: fn(b, **kw)[:2]).lower(batch).as_text()
    assert lower(mixup_alpha=0.0, cutmix_alpha=0.0, label_smoothing=0.0) == lower()
    # (a) NaN in the padding images leaks into no real row: the same sums as zeros there
    nan = {k: v.copy() for k, v in batch.items()}
    nan["image"][6:] = np.nan
    run = jax.jit(lambda b: fn(b, mixup_alpha=0.4, cutmix_alpha=0.4)[1])
    got, ref = np.asarray(run(nan)), np.asarray(run(batch))
    assert np.isfinite(got).all() and got[3] == 6.0
    np.testing.assert_array_equal(got, ref)
    # the mix changed the loss (a new target), and its key is a pure function of
    # (seed, step, rank, micro): the same call again is bit for bit the same (resume)
    plain = np.asarray(jax.jit(lambda b: fn(b)[1])(batch))
    assert got[0] != plain[0]
    np.testing.assert_array_equal(np.asarray(run(nan)), got)


# -- 4. transform= ------------------------------------------------------------------------

def flip(image, rng):
    """A module-level (picklable) transform: mirror left-right."""
    return image[:, ::-1]


def test_transform_hook_flips_like_by_hand_and_a_shape_change_is_refused():
    data = input_pipeline.load_digits()
    kw = dict(shuffle=True, seed=0, epoch=1, image_shape=data.image_shape)
    plain = list(input_pipeline.iterate_batches(data.train, 128, **kw))[:3]
    flipped = list(input_pipeline.iterate_batches(data.train, 128, transform=flip, **kw))[:3]
    for a, b in zip(plain, flipped):
        want = np.where((a["mask"] > 0)[:, None, None, None], a["image"][:, :, ::-1], a["image"])
        np.testing.assert_array_equal(b["image"], want)
        np.testing.assert_array_equal(b["label"], a["label"])
    input_pipeline.check_transform(flip, data.train, data.image_shape)
    with pytest.raises(ValueError, match=r"shape \(4, 8, 1\).*shape \(8, 8, 1\).*same shape"):
        input_pipeline.check_transform(lambda im, rng: im[:4], data.train, data.image_shape)
    with pytest.raises(ValueError, match="dtype float32.*dtype uint8"):
        input_pipeline.check_transform(lambda im, rng: im.astype(np.float32), data.train,
                                       data.image_shape)
    # the stream: (seed, epoch, index), apart from the crops' stream
    assert augment.transform_rng(0, 1, 5).random() == augment.transform_rng(0, 1, 5).random()
    assert augment.transform_rng(0, 1, 5).random() != augment.example_rng(0, 1, 5).random()


# -- 5. zero_init_residual ----------------------------------------------------------------

def test_zero_init_residual_zeroes_each_blocks_last_bn_scale_only():
    key = jax.random.key(0)
    init = lambda **kw: to_host(models.as_network(models.create_model(
        "resnet8", num_classes=K, **kw)).init(key, IMAGE_SHAPE))
    today, off, on = init(), init(zero_init_residual=False), init(zero_init_residual=True)
    leaves = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(leaves(today), leaves(off)))
    zeroed = 0
    for (path, a), (_, b) in zip(leaves(on), leaves(today)):
        name = jax.tree_util.keystr(path)
        if "BatchNorm_1" in name and "'scale'" in name and "'params'" in name:
            assert (a == 0).all()
            zeroed += 1
        else:
            assert a.tobytes() == b.tobytes(), name
    assert zeroed == 3  # one per block of ResNet-8
    assert (on["params"]["stage1_block1"]["BatchNorm_0"]["scale"] == 1).all()
    assert (on["params"]["stem_bn"]["scale"] == 1).all()


# -- the plumbing: prepare checks the hooks before compiling ------------------------------

def test_prepare_checks_the_hooks_and_keeps_them_on_the_trainer():
    from helpers import small_config
    from trjax.train import trainer

    cfg = small_config(num_epochs=1)
    tr = trainer.prepare(cfg, loss_fn=_squared_error, transform=flip)
    assert tr.loss_fn is _squared_error and tr.transform is flip and tr.state is None
    with pytest.raises(ValueError, match="return per-example losses"):
        trainer.prepare(cfg, loss_fn=lambda lg, lb: _squared_error(lg, lb).sum())
    with pytest.raises(ValueError, match="label_smoothing=0.1 applies to trjax's"):
        trainer.prepare(small_config(label_smoothing=0.1), loss_fn=_squared_error)
    with pytest.raises(ValueError, match="same shape and dtype"):
        trainer.prepare(cfg, transform=lambda im, rng: im[None])
