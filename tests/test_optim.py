"""trjax.optim: the learning-rate schedule against its documented formula."""
import math

import numpy as np
import pytest

from trjax.optim import learning_rate_schedule


def formula(t, lr, warmup, total):
    if t < warmup:
        return lr * t / warmup
    return lr * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2


@pytest.mark.parametrize("lr,warmup,total", [(0.2, 12, 180), (0.1, 0, 50), (1.0, 5, 6)])
def test_schedule_matches_its_formula_at_first_warmup_end_middle_and_last_step(lr, warmup, total):
    schedule = learning_rate_schedule(lr, warmup, total)
    middle = warmup + (total - warmup) // 2
    for t in sorted({0, max(warmup - 1, 0), warmup, middle, total - 1, total}):
        assert float(schedule(t)) == pytest.approx(formula(t, lr, warmup, total), rel=1e-5,
                                                   abs=1e-7 * lr), t  # float32
    assert float(schedule(warmup)) == pytest.approx(lr)  # the peak at the warmup's end
    assert float(schedule(total)) == pytest.approx(0.0, abs=1e-9)
    ts = np.arange(warmup, total + 1)
    assert np.all(np.diff([float(schedule(int(t))) for t in ts]) <= 1e-9)  # then decays


def test_warmup_longer_than_the_run_is_cut_to_leave_one_decay_step():
    schedule = learning_rate_schedule(0.5, 100, 10)  # W = 9, T = 10
    assert float(schedule(9)) == pytest.approx(0.5)
    assert float(schedule(4)) == pytest.approx(0.5 * 4 / 9, rel=1e-6)
    assert float(schedule(10)) == pytest.approx(0.0, abs=1e-9)


def test_adamw_is_optax_adamw_with_the_mask_per_leaf_or_per_element():
    """make_optimizer('adamw') is optax.adamw (Loshchilov & Hutter 2019) with decay on the
    masked leaves, bit for bit; the per-element mask form (ZeRO-1's flat shards) gives the
    same numbers on the flattened tree."""
    import jax
    import optax
    from trjax.optim import make_optimizer

    rng = np.random.default_rng(0)
    params = {"kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
              "bias": rng.normal(size=(4,)).astype(np.float32)}
    grads = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    mask = {"kernel": True, "bias": False}
    kw = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
    ref = optax.adamw(0.01, mask=mask, **kw)
    ours = make_optimizer("adamw", 0.01, mask=mask, **kw)
    want = jax.jit(ref.update)(grads, ref.init(params), params)[0]
    got = jax.jit(ours.update)(grads, ours.init(params), params)[0]
    for k in params:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k
    flat = lambda t: {"b": np.concatenate([np.ravel(t["kernel"]), t["bias"]])}
    per_element = lambda p: {"b": np.concatenate([np.ones(72, np.float32),
                                                  np.zeros(4, np.float32)])}
    shard = make_optimizer("adamw", 0.01, mask=per_element, **kw)
    got = jax.jit(shard.update)(flat(grads), shard.init(flat(params)), flat(params))[0]
    np.testing.assert_allclose(got["b"], flat(jax.tree_util.tree_map(np.asarray, want))["b"],
                               rtol=1e-6, atol=1e-9)
