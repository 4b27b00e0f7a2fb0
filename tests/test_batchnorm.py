"""BatchNorm statistics with padded and uneven rows: count-weighted in every mode.

Values are pinned against numpy on the concatenated REAL rows (issue 13 item 1,
issue 17 item 1): 2 devices, one channel, device A real rows [0, 0, 0], device B
one real row [4] plus padding -> batch mean 1.0, biased var 3.0, unbiased 4.0.

Precision at a large mean/std (issue 32): output, input gradient and running update
against float64 numpy, within 4x of a float32 two-pass computation; NaN padding never
leaks. Inference (eval mode, the folded collection, make_fold_bn and the eval step)
against the numpy formula, running variances near epsilon included.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import IMAGE_SHAPE, max_rel, random_batch, reference_step_fn, setup, to_host
from trjax import aot, compression, exchange, models, optim, parallel, steps
from trjax.batchnorm import BatchNorm, fold_batchnorm, fold_batchnorm_tree
from trjax.objective import StepOptions
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world

MOM = 0.9


def _bn_one_step(mode, x, mask):
    """2 devices, x ``[2 * B, 1]``: the forward output and the new running stats."""
    world = make_world("2", x.shape[0])
    bn = BatchNorm(mode=mode, axis_name="data", momentum=MOM)
    variables = BatchNorm(mode=mode, momentum=MOM).init(jax.random.key(0), x[:2], train=True)
    bs = variables["batch_stats"]
    spec_bs = P("data") if mode == "local" else P()
    if mode == "local":
        bs = jax.tree_util.tree_map(lambda v: jnp.stack([v, v]), bs)

    def local(params, bs, x, mask):
        own = jax.tree_util.tree_map(lambda v: v[0], bs) if mode == "local" else bs
        y, new = bn.apply({"params": params, "batch_stats": own}, x, train=True, mask=mask,
                          mutable=["batch_stats", "bn_sums"])
        stats, _ = steps.sync_batch_stats(own, new["bn_sums"],
                                          "data" if mode == "running" else None, MOM,
                                          jnp.zeros((1,), jnp.float32), jnp.array(True))
        if mode == "local":
            stats = jax.tree_util.tree_map(lambda x: x[None], stats)
        return y, stats

    fn = jax.jit(jax.shard_map(local, mesh=world.mesh,
                               in_specs=(P(), spec_bs, P("data"), P("data")),
                               out_specs=(P("data"), spec_bs)))
    y, stats = fn(variables["params"], bs, x, mask)
    return np.asarray(y), to_host(stats)


def _np_running(real):
    real = np.asarray(real, np.float64)
    n = real.size
    m, v = real.mean(), real.var()
    unbiased = v * n / (n - 1) if n > 1 else v
    return MOM * 0.0 + (1 - MOM) * m, MOM * 1.0 + (1 - MOM) * unbiased


CASES = {  # device A rows, device B rows (nan = padding, mask 0)
    "uneven": ([0, 0, 0, np.nan], [4, np.nan, np.nan, np.nan]),
    "all_padding_device": ([0, 2, 4, np.nan], [np.nan] * 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["running", "sync"])
def test_running_stats_are_those_of_the_concatenated_real_rows(mode, case):
    rows = np.array(CASES[case][0] + CASES[case][1], np.float32)
    mask = (~np.isnan(rows)).astype(np.float32)
    x = np.where(mask > 0, rows, 1e3).astype(np.float32)[:, None]  # padding holds garbage
    y, stats = _bn_one_step(mode, x, mask)
    real = rows[mask > 0]
    want_mean, want_var = _np_running(real)
    np.testing.assert_allclose(stats["mean"], [want_mean], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats["var"], [want_var], rtol=1e-6)
    assert np.all(y[mask == 0] == 0)
    if mode == "sync":  # the forward pass normalises with the biased global statistics
        ref = (real - real.mean()) / np.sqrt(real.var() + 1e-5)
        np.testing.assert_allclose(y[mask > 0, 0], ref, rtol=1e-5, atol=1e-6)


def test_pinned_values_of_the_issue():
    rows = np.array([0, 0, 0, 0, 4, 0, 0, 0], np.float32)[:, None]
    mask = np.array([1, 1, 1, 0, 1, 0, 0, 0], np.float32)
    _, stats = _bn_one_step("running", rows, mask)
    # batch mean 1.0, biased var 3.0, unbiased 4.0 (n/(n-1), n = 4 real values)
    np.testing.assert_allclose(stats["mean"], [0.1], rtol=1e-6)
    np.testing.assert_allclose(stats["var"], [0.9 + 0.1 * 4.0], rtol=1e-6)


def test_local_mode_each_replica_its_own_real_rows():
    rows = np.array([0, 2, 4, 9, 4, 9, 9, 9], np.float32)[:, None]
    mask = np.array([1, 1, 1, 0, 1, 0, 0, 0], np.float32)
    _, stats = _bn_one_step("local", rows, mask)
    for d, real in enumerate(([0, 2, 4], [4])):
        m, v = _np_running(real)
        np.testing.assert_allclose(stats["mean"][d], [m], rtol=1e-6)
        np.testing.assert_allclose(stats["var"][d], [v], rtol=1e-6)
    # a replica with no real row keeps its statistics
    _, stats = _bn_one_step("local", rows, np.array([1, 1, 1, 0, 0, 0, 0, 0], np.float32))
    np.testing.assert_array_equal(stats["mean"][1], [0.0])
    np.testing.assert_array_equal(stats["var"][1], [1.0])


# -- the whole train step: uneven masks on 2 devices against one device on the real rows ----

MASK = np.array([1, 1, 1, 0, 1, 0, 0, 0], np.float32)  # device 0: 3 real rows, device 1: 1


# ResNet-8 cut to one BasicBlock of 8 channels: the stem BN, the block's two BNs and the
# residual, at a fraction of the full model's compile time (six train steps are compiled here)
SMALL = dict(stage_sizes=(1,), widths=(8,), stem_width=8)


def _small_setup(bn_mode):
    """helpers.setup("2", 8, bn_mode) for the SMALL ResNet-8."""
    world = make_world("2", 8)
    model = models.create_model("resnet8", num_classes=10, bn_mode=bn_mode, axis_name="data",
                                **SMALL)
    plan = build_plan(model, (8, 8, 1))
    tx = optim.make_optimizer("sgd", 0.1, plan, weight_decay=1e-3)
    return world, model, plan, tx


def _uneven_step(bn_mode, k=1, kind="allreduce"):
    batch = random_batch(8, seed=7)
    batch["mask"] = MASK.copy()
    batch["image"][MASK == 0] = 50.0  # padding rows hold garbage that must count nowhere
    world, model, plan, tx = _small_setup(bn_mode)
    if kind == "zero1":
        ex = exchange.shard_optimizer_state(
            plan, 2, lambda mask: optim.make_optimizer("sgd", 0.1, plan, mask=mask,
                                                       weight_decay=1e-3))
    elif kind == "compressed":
        ex = exchange.compressed(tx, plan, compression.none())
    else:
        ex = exchange.allreduce(tx, plan)
    layout = parallel.data_parallel(model, world, (8, 8, 1), bn_mode)
    state = create_train_state(jax.random.key(0), layout, ex)
    s0 = to_host(state)
    sharded = jax.device_put(batch, world.sharded())
    step = aot.compile_step("train", steps.make_train_step(
        layout, ex, plan, StepOptions(grad_accumulation_steps=k)), state, sharded,
        donate_argnums=0)
    s1, m = step(state, sharded)
    return to_host(s1), np.asarray(m), _reference(s0, tx, batch), batch


_REFERENCES = {}


def _reference(s0, tx, batch):
    """The reference step on the real rows, compiled as one program and computed once
    per start state (every case here starts from the same initialisation and optimizer)."""
    key = b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(
        (s0.params, s0.batch_stats, batch)))
    if key not in _REFERENCES:
        real = {k: v[MASK > 0] for k, v in batch.items()}
        step = reference_step_fn("resnet8", tx, **SMALL)
        _REFERENCES[key] = to_host(step(s0.params, s0.batch_stats, tx.init(s0.params), real))
    return _REFERENCES[key]


@pytest.mark.parametrize("kind", ["allreduce", "zero1", "compressed"])
def test_sync_step_on_padded_uneven_batch_equals_one_device_on_real_rows(kind):
    """Params, BN statistics and metric sums (issue 17 item 1: a mask ignored by the BN
    statistics moves this by ~1 relative)."""
    s1, m, (p_ref, bs_ref, _, loss_ref, _), _ = _uneven_step("sync", kind=kind)
    assert max_rel(s1.params, p_ref) <= 1e-5
    assert max_rel(s1.batch_stats, bs_ref) <= 1e-5
    assert m[3] == 4.0 and m[4] == 1.0
    np.testing.assert_allclose(m[0] / 4.0, float(loss_ref), rtol=1e-5)


@pytest.mark.parametrize("bn_mode,k", [("running", 1), ("running", 2), ("sync", 2)])
def test_first_bn_running_stats_weight_real_rows(bn_mode, k):
    """The stem BN sees the same conv output in every mode and micro-batch split: its
    running statistics must be the real rows' (device 1's second micro-batch is all
    padding and must not pull them)."""
    s1, m, (_, bs_ref, _, _, _), _ = _uneven_step(bn_mode, k)
    assert max_rel(s1.batch_stats["stem_bn"], bs_ref["stem_bn"]) <= 1e-5
    assert m[3] == 4.0


# -- precision when the mean is large (issue 32) ---------------------------------------------
#
# Each layer's (float32) output and input gradient against a float64 numpy reference, and
# against the same float32 error of a two-pass computation (mean first, then the mean of
# (x - mean)^2: the stable textbook algorithm). E[x^2] - mean^2 loses about
# log2((mean/std)^2) bits; the shifted sums must not.

EPS = 1e-5
U = 2.0 ** -24  # float32 unit roundoff
PREC_B, PREC_K = 64, 2  # 8 devices x 8 rows, 2 micro-batches of 4 rows each
PREC_SHAPE = (PREC_B, 4, 4, 8)
# real rows per device (of 8): device 1 has an all-padding second micro-batch, device 7
# holds only padding, device 2 has padding in both micro-batches
PREC_MASK = np.array([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 1, 1, 1], [1] * 8,
                      [1] * 8, [1, 1, 1, 1, 1, 1, 1, 0], [1] * 8, [0] * 8],
                     np.float32).reshape(-1)
_PREC_FNS = {}


def _prec_fn(mode):
    """8 devices, k micro-batches each: per micro-batch the layer's output, the input gradient
    (VJP of a cotangent ``g``) and its bn_sums; the bn_sums added over micro-batches give the
    new running statistics through ``steps.sync_batch_stats`` (momentum 0: they ARE the
    batch's mean and unbiased variance), as the train step does."""
    if mode not in _PREC_FNS:
        world = make_world("all", PREC_B)
        axis = world.axis_name
        bn = BatchNorm(mode=mode, axis_name=axis, momentum=MOM)
        spec_bs = P(axis) if mode == "local" else P()

        def local(params, bs, x, mask, g):
            own = jax.tree_util.tree_map(lambda v: v[0], bs) if mode == "local" else bs
            split = lambda a: a.reshape((PREC_K, -1) + a.shape[1:])
            xs, ms, gs = split(x), split(mask), split(g)
            ys, dxs, total = [], [], None
            for j in range(PREC_K):
                def f(xj):
                    y, new = bn.apply({"params": params, "batch_stats": own}, xj, train=True,
                                      mask=ms[j], mutable=["batch_stats", "bn_sums"])
                    return y, new["bn_sums"]
                y, vjp, sums = jax.vjp(f, xs[j], has_aux=True)
                ys.append(y)
                dxs.append(vjp(gs[j])[0])
                total = sums if total is None else jax.tree_util.tree_map(jnp.add, total, sums)
            stats, _ = steps.sync_batch_stats(own, total, axis if mode == "running" else None,
                                              0.0, jnp.zeros((1,), jnp.float32),
                                              jnp.array(True))
            if mode == "local":
                stats = jax.tree_util.tree_map(lambda x: x[None], stats)
            return jnp.concatenate(ys), jnp.concatenate(dxs), stats

        fn = jax.jit(jax.shard_map(local, mesh=world.mesh,
                                   in_specs=(P(), spec_bs, P(axis), P(axis), P(axis)),
                                   out_specs=(P(axis), P(axis), spec_bs)))
        params = BatchNorm(mode=mode).init(jax.random.key(0), jnp.zeros((2,) + PREC_SHAPE[1:]),
                                           train=True)["params"]
        _PREC_FNS[mode] = (fn, params)
    return _PREC_FNS[mode]


def _run_prec(mode, x, mask, g, running_mean):
    fn, params = _prec_fn(mode)
    c = x.shape[-1]
    bs = {"mean": running_mean.astype(np.float32), "var": np.ones(c, np.float32)}
    if mode == "local":
        bs = {k: np.stack([v] * 8) for k, v in bs.items()}
    y, dx, stats = fn(params, bs, x, mask, g)
    return np.asarray(y), np.asarray(dx), to_host(stats)


def _prec_data(ratio, seed=0, padding=1e3):
    """x with per-channel mean = ratio * std (signs mixed, std 0.5..3), padding rows holding
    ``padding``; a cotangent; a second batch's per-channel mean (a running mean that has
    converged to the data: what the running statistics hold after warm-up)."""
    rng = np.random.default_rng(seed)
    c = PREC_SHAPE[-1]
    std = rng.uniform(0.5, 3.0, c)
    mu = ratio * std * rng.choice([-1.0, 1.0], c)
    x = (mu + std * rng.normal(size=PREC_SHAPE)).astype(np.float32)
    x[PREC_MASK == 0] = padding
    g = rng.normal(size=PREC_SHAPE).astype(np.float32)
    other = (mu + std * rng.normal(size=PREC_SHAPE)).astype(np.float32)
    warm = other.astype(np.float64).mean((0, 1, 2)).astype(np.float32)
    return x, g, warm


def _forward_groups(mode):
    """Row indices normalised together in the forward pass: per micro-batch j, over every
    device (sync) or per device and micro-batch (running, local)."""
    rows = np.arange(PREC_B).reshape(8, PREC_K, -1)  # [device, micro-batch, row]
    if mode == "sync":
        return [rows[:, j].ravel() for j in range(PREC_K)]
    return [rows[d, j] for d in range(8) for j in range(PREC_K)]


def _stats_groups(mode):
    """Row indices the running statistics are taken over."""
    rows = np.arange(PREC_B).reshape(8, -1)
    return [rows[d] for d in range(8)] if mode == "local" else [rows.ravel()]


def _ref64(x, g):
    """Float64 BatchNorm (scale 1, bias 0, biased variance) on ``x [L, H, W, C]``: output
    and input gradient of ``sum(y * g)``, by the hand formula
    dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps)."""
    x, g = x.astype(np.float64), g.astype(np.float64)
    ax = (0, 1, 2)
    mean, var = x.mean(ax), x.var(ax)
    inv = 1.0 / np.sqrt(var + EPS)
    xhat = (x - mean) * inv
    return xhat, inv * (g - g.mean(ax) - xhat * (g * xhat).mean(ax))


@jax.jit
def _two_pass32(x, g):
    """Float32 two-pass BatchNorm: output and input gradient (autodiff)."""
    def f(x):
        mean = jnp.mean(x, (0, 1, 2), keepdims=True)
        var = jnp.mean(jnp.square(x - mean), (0, 1, 2), keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + EPS)
    y, vjp = jax.vjp(f, x)
    return y, vjp(g)[0]


@jax.jit
def _two_pass_stats32(x):
    mean = jnp.mean(x, (0, 1, 2))
    n = x.shape[0] * x.shape[1] * x.shape[2]
    return mean, jnp.mean(jnp.square(x - mean.reshape(1, 1, 1, -1)), (0, 1, 2)) * n / (n - 1)


def _errors(mode, x, g, y, dx, stats):
    """Max errors against float64 over the real rows: output and input gradient relative to
    the reference's largest magnitude, running mean in units of std, running var relative;
    for trjax's results and for the float32 two-pass computation."""
    real = PREC_MASK > 0
    got, two = np.zeros(4), np.zeros(4)
    ref_max = np.zeros(2)
    for rows in _forward_groups(mode):
        rows = rows[real[rows]]
        if rows.size == 0:
            continue
        y64, dx64 = _ref64(x[rows], g[rows])
        y2, dx2 = (np.asarray(a, np.float64) for a in _two_pass32(x[rows], g[rows]))
        ref_max = np.maximum(ref_max, [np.abs(y64).max(), np.abs(dx64).max()])
        got[:2] = np.maximum(got[:2], [np.abs(y[rows] - y64).max(), np.abs(dx[rows] - dx64).max()])
        two[:2] = np.maximum(two[:2], [np.abs(y2 - y64).max(), np.abs(dx2 - dx64).max()])
    got[:2] /= ref_max
    two[:2] /= ref_max
    for d, rows in enumerate(_stats_groups(mode)):
        rows = rows[real[rows]]
        if rows.size == 0:
            continue
        x64 = x[rows].astype(np.float64)
        m64, v64 = x64.mean((0, 1, 2)), x64.var((0, 1, 2), ddof=1)
        m2, v2 = (np.asarray(a, np.float64) for a in _two_pass_stats32(x[rows]))
        m, v = (stats[k][d] if mode == "local" else stats[k] for k in ("mean", "var"))
        got[2:] = np.maximum(got[2:], [np.max(np.abs(m - m64) / np.sqrt(v64)),
                                       np.max(np.abs(v - v64) / v64)])
        two[2:] = np.maximum(two[2:], [np.max(np.abs(m2 - m64) / np.sqrt(v64)),
                                       np.max(np.abs(v2 - v64) / v64)])
    return got, two


PREC_CASES = [(m, r, s) for m in ("sync", "running", "local") for r in (20, 100)
              for s in ("warm", "first") if (m, s) != ("sync", "first")]


@pytest.mark.parametrize("mode,ratio,start", PREC_CASES)
def test_large_mean_matches_float64_within_4x_of_two_pass(mode, ratio, start):
    """Output, input gradient and the running update (micro-batches, uneven padding, a
    device of padding only) at mean/std = ``ratio``: within 4x of the two-pass float32
    error (floor: a few roundings, 4u), against float64.

    ``warm``: the running mean (the shift every replica holds) has converged to the data.
    ``first``: the first step, running mean 0: running/local normalise with local
    statistics, shifted by a local sample, so the forward and backward are as accurate as at
    any later step; the running update is too (the sums are re-centred on the running mean
    only after the local shifted sums are taken). sync mode's first steps cannot be, without
    another collective: its shift must be the same on every device before the one psum, and
    the running mean is the best such value; its error then shrinks as the running mean
    approaches the data (momentum^t of the first step's)."""
    x, g, warm = _prec_data(ratio)
    r = warm if start == "warm" else np.zeros_like(warm)
    y, dx, stats = _run_prec(mode, x, PREC_MASK, g, r)
    got, two = _errors(mode, x, g, y, dx, stats)
    names = ("output", "input grad", "running mean", "running var")
    print(mode, ratio, start,
          {n: f"{a:.2e} (two-pass {b:.2e})" for n, a, b in zip(names, got, two)})
    for name, a, b in zip(names, got, two):
        if start == "first" and name.startswith("running"):
            # the first step's running update: re-centring the float32 sums on the running
            # mean 0 rounds at (mean/std)^2 u, a handful of times (the floor of any one
            # float32 sum with a shift common to all devices; measured 3-5.3x)
            assert a <= 16 * ratio ** 2 * U, (name, a)
            continue
        assert a <= 4 * max(b, 4 * U), (name, a, b)


@pytest.mark.parametrize("mode", ["sync", "running", "local"])
def test_nan_in_padding_rows_does_not_leak(mode):
    """Padding is masked by select: NaN padding rows give bit for bit the outputs, input
    gradients and running statistics of finite garbage padding, zeros in the padding rows."""
    x, g, warm = _prec_data(20)
    xn, _, _ = _prec_data(20, padding=np.nan)
    y, dx, stats = _run_prec(mode, x, PREC_MASK, g, warm)
    yn, dxn, statsn = _run_prec(mode, xn, PREC_MASK, g, warm)
    for a, b in ((y, yn), (dx, dxn), (stats["mean"], statsn["mean"]),
                 (stats["var"], statsn["var"])):
        assert np.all(np.isfinite(b))
        assert a.tobytes() == b.tobytes()
    assert np.all(yn[PREC_MASK == 0] == 0) and np.all(dxn[PREC_MASK == 0] == 0)


# -- inference: eval mode and folded BatchNorm against numpy ---------------------------------

# running variances at and below epsilon (0, 1e-8 ... 2e-5), means large against their std
EVAL_VAR = np.array([0.0, 1e-8, 1e-6, 1e-5, 2e-5, 1e-3, 1.0, 9.0], np.float32)
EVAL_MEAN = np.array([0.5, -3.0, 2.0, 0.01, -0.2, 7.0, -1.0, 30.0], np.float32)
EVAL_SCALE = np.array([1.0, -0.5, 2.0, 1.5, 0.3, 1.0, 0.8, 1.2], np.float32)
EVAL_BIAS = np.array([0.0, 0.1, -0.3, 2.0, 0.5, -1.0, 0.2, 0.0], np.float32)


def _np_fold(scale, bias, mean, var):
    """numpy float64: BN(x) = scale (x - mean) / sqrt(var + eps) + bias = x a + b."""
    scale, bias, mean, var = (np.asarray(v, np.float64) for v in (scale, bias, mean, var))
    a = scale / np.sqrt(var + EPS)
    return a, bias - mean * a


def _assert_fold_close(a, b, scale, bias, mean, var):
    """Within 4 float32 roundings of float64 (relative to the terms that make them up)."""
    a64, b64 = _np_fold(scale, bias, mean, var)
    assert np.all(np.abs(np.asarray(a, np.float64) - a64) <= 4 * U * np.abs(a64))
    assert np.all(np.abs(np.asarray(b, np.float64) - b64)
                  <= 4 * U * (np.abs(np.asarray(bias, np.float64)) + np.abs(mean * a64)))


def test_eval_and_folded_batchnorm_against_numpy():
    """Eval mode (running statistics folded per call) and the folded collection
    (fold_batchnorm_tree once, then ``x * a + b``) against the numpy formula
    ``scale (x - mean) / sqrt(var + eps) + bias``, variances at and below epsilon
    included: each within 8 float32 roundings of its terms ``|x a|, |mean a|, |bias|``
    (x close to the mean: the result is much smaller than the terms it cancels)."""
    rng = np.random.default_rng(3)
    x = (EVAL_MEAN + 2 * np.sqrt(EVAL_VAR + EPS) * rng.normal(size=(16, 3, 3, 8))
         ).astype(np.float32)
    params = {"scale": EVAL_SCALE, "bias": EVAL_BIAS}
    stats = {"mean": EVAL_MEAN, "var": EVAL_VAR}
    a64, b64 = _np_fold(EVAL_SCALE, EVAL_BIAS, EVAL_MEAN, EVAL_VAR)
    x64 = x.astype(np.float64)
    want = EVAL_SCALE * (x64 - EVAL_MEAN) / np.sqrt(EVAL_VAR.astype(np.float64) + EPS) \
        + EVAL_BIAS
    bound = 8 * U * (np.abs(x64 * a64) + np.abs(EVAL_MEAN * a64) + np.abs(EVAL_BIAS))

    # fold_batchnorm_tree: nested modules, other params ignored, one leaf per BN
    tree_p = {"block": {"bn": params, "Conv_0": {"kernel": np.ones((3, 3, 8, 8), np.float32)}}}
    tree_s = {"block": {"bn": stats}}
    folded = to_host(jax.jit(fold_batchnorm_tree)(tree_p, tree_s))
    assert jax.tree_util.tree_structure(folded) == jax.tree_util.tree_structure(
        {"block": {"bn": {"bias": 0, "scale": 0}}})
    _assert_fold_close(folded["block"]["bn"]["scale"], folded["block"]["bn"]["bias"],
                       EVAL_SCALE, EVAL_BIAS, EVAL_MEAN, EVAL_VAR)

    for mode in ("sync", "running", "local"):
        bn = BatchNorm(mode=mode)
        eval_y = jax.jit(lambda v, x: bn.apply(v, x, train=False))
        for variables in ({"params": params, "batch_stats": stats},
                          {"bn_folded": folded["block"]["bn"]}):
            y = eval_y(variables, x)
            assert y.dtype == jnp.float32
            err = np.abs(np.asarray(y, np.float64) - want)
            print(mode, sorted(variables), f"worst error / bound {np.max(err / bound):.3g}")
            assert np.all(err <= bound), (mode, sorted(variables), np.max(err / bound))
    # the bound is not vacuous: epsilon off by 0.1% is out of it
    off = jax.jit(lambda v, x: BatchNorm(epsilon=1.001e-5).apply(v, x, train=False))(
        {"params": params, "batch_stats": stats}, x)
    assert np.any(np.abs(np.asarray(off, np.float64) - want) > bound)
    # fold_batchnorm itself
    _assert_fold_close(*jax.jit(fold_batchnorm, static_argnums=4)(
        EVAL_SCALE, EVAL_BIAS, EVAL_MEAN, EVAL_VAR, EPS), EVAL_SCALE, EVAL_BIAS, EVAL_MEAN,
        EVAL_VAR)


@pytest.mark.parametrize("bn_mode", ["sync", "local"])
def test_fold_bn_and_eval_step_against_numpy(bn_mode):
    """steps.make_fold_bn (every BN of ResNet-8, one row per replica in local mode) against
    the numpy fold, running variances near epsilon; the eval step on the folded collection
    gives the metrics of the eval step folding the raw statistics on every batch."""
    world, model, _, _, state = setup("2", 8, bn_mode)
    rng = np.random.default_rng(5)

    def crafted(leaf_path, v):
        shape = v.shape
        c = shape[-1]
        if leaf_path[-1].key == "var":
            return rng.choice(np.concatenate([EVAL_VAR, [0.5, 2.0]]), size=shape
                              ).astype(np.float32)
        return rng.normal(0, 3, size=shape).astype(np.float32) + np.arange(c, dtype=np.float32)

    bs = jax.tree_util.tree_map_with_path(crafted, to_host(state.batch_stats))
    state = state.replace(batch_stats=jax.device_put(
        bs, jax.tree_util.tree_map(lambda a: a.sharding, state.batch_stats)))
    layout = parallel.data_parallel(model, world, IMAGE_SHAPE, bn_mode)
    folded = to_host(jax.jit(steps.make_fold_bn(layout))(state))
    params = to_host(state.params)

    def walk(p, s, f):
        if "mean" in s:
            rows = range(2) if bn_mode == "local" else [None]
            for r in rows:
                pick = (lambda v: v[r]) if r is not None else (lambda v: v)
                _assert_fold_close(pick(f["scale"]), pick(f["bias"]), p["scale"], p["bias"],
                                   pick(s["mean"]), pick(s["var"]))
            return 1
        return sum(walk(p[k], s[k], f[k]) for k in s)
    assert walk(params, bs, folded) >= 7  # every BN of ResNet-8

    batch = jax.device_put(random_batch(8, seed=9), world.sharded())
    acc0 = jax.device_put(np.zeros((2, 4), np.float32), world.sharded())
    fold_acc = np.asarray(jax.jit(steps.make_eval_step(layout, folded=True))(
        state.params, folded, batch, acc0))
    raw_acc = np.asarray(jax.jit(steps.make_eval_step(layout, folded=False))(
        state.params, state.batch_stats, batch, acc0))
    assert np.all(np.isfinite(fold_acc))
    np.testing.assert_array_equal(fold_acc[:, 1:], raw_acc[:, 1:])
    np.testing.assert_allclose(fold_acc[:, 0], raw_acc[:, 0], rtol=1e-5)
