"""BatchNorm statistics with padded and uneven rows: count-weighted in every mode.

Values are pinned against numpy on the concatenated REAL rows (issue 13 item 1,
issue 17 item 1): 2 devices, one channel, device A real rows [0, 0, 0], device B
one real row [4] plus padding -> batch mean 1.0, biased var 3.0, unbiased 4.0.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import max_rel, random_batch, reference_step, setup, to_host
from trjax import aot, compression, exchange, optim, steps
from trjax.batchnorm import BatchNorm
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
        stats, _ = steps.sync_batch_stats(own, new["bn_sums"], mode, MOM,
                                          jnp.zeros((1,), jnp.float32), jnp.array(True))
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


def _uneven_step(bn_mode, k=1, kind="allreduce"):
    batch = random_batch(8, seed=7)
    batch["mask"] = MASK.copy()
    batch["image"][MASK == 0] = 50.0  # padding rows hold garbage that must count nowhere
    world, model, plan, tx, state = setup("2", 8, bn_mode)
    if kind == "zero1":
        ex = exchange.shard_optimizer_state(
            plan, 2, lambda mask: optim.make_optimizer("sgd", 0.1, plan, mask=mask,
                                                       weight_decay=1e-3))
    elif kind == "compressed":
        ex = exchange.compressed(tx, plan, compression.none())
    else:
        ex = exchange.allreduce(tx, plan)
    state = create_train_state(jax.random.key(0), model, ex, world, (8, 8, 1), bn_mode)
    s0 = to_host(state)
    sharded = jax.device_put(batch, world.sharded())
    step = aot.compile_step("train", steps.make_train_step(
        model, ex, plan, world, bn_mode, grad_accumulation_steps=k), state, sharded,
        donate_argnums=0)
    s1, m = step(state, sharded)
    return to_host(s1), np.asarray(m), _reference(s0, tx, batch), batch


_REFERENCES = {}


def _reference(s0, tx, batch):
    """helpers.reference_step on the real rows, compiled as one program and computed once
    per start state (every case here starts from the same initialisation and optimizer)."""
    key = b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(
        (s0.params, s0.batch_stats, batch)))
    if key not in _REFERENCES:
        real = {k: v[MASK > 0] for k, v in batch.items()}
        step = jax.jit(lambda p, bs, o, b: reference_step("resnet8", p, bs, o, tx, b))
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
