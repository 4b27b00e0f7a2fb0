import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trjax import collectives, comm
from trjax.world import make_world


def test_broadcast_from_rank0_is_bit_exact():
    w = make_world("all", 8)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype(np.float32)
    x[0, :3] = [-0.0, np.nan, np.inf]
    y = rng.integers(0, 100, size=(8, 3)).astype(np.int32)
    f = jax.jit(jax.shard_map(lambda a, b: collectives.broadcast_from_rank0((a[0], b[0]), "data"),
                              mesh=w.mesh, in_specs=P("data"), out_specs=P()))
    a, b = f(x, y)
    for shard in a.addressable_shards:
        assert np.asarray(shard.data).tobytes() == x[0].tobytes()
    np.testing.assert_array_equal(np.asarray(b), y[0])


def test_allreduce_buckets_sum_and_stay_two_in_order():
    w = make_world("all", 8)
    rng = np.random.default_rng(1)
    deep = rng.normal(size=(8, 1000)).astype(np.float32)
    first = rng.normal(size=(8, 10)).astype(np.float32)
    first[3, 2] = np.nan  # a NaN in one bucket must not leak into the other

    def local(d, f):
        out = collectives.allreduce_buckets({"deep": d[0], "first": f[0]}, "data")
        return out["deep"], out["first"]

    fn = jax.jit(jax.shard_map(local, mesh=w.mesh, in_specs=P("data"), out_specs=P()))
    d, f = fn(deep, first)
    np.testing.assert_allclose(np.asarray(d), deep.sum(0), rtol=1e-5, atol=1e-5)
    want = first.sum(0)
    np.testing.assert_allclose(np.asarray(f), want, rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(f)[2]) and np.isfinite(np.asarray(d)).all()
    cols = comm.collectives_in_hlo(fn.lower(deep, first).compile().as_text())
    assert [(c["kind"], c["elements"]) for c in cols] == [("all-reduce", 1000), ("all-reduce", 10)]


def test_after_keeps_every_bit():
    x = jnp.array([1.5, -0.0, 0.0, np.nan, -np.inf, 3e-45], jnp.float32)
    for done in (jnp.array([np.nan]), jnp.array([-2.0]), jnp.array([np.inf]), jnp.array([0.0])):
        y = jax.jit(collectives.after)(x, done)
        assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_batch_stats_sum_is_identical_on_every_replica():
    w = make_world("all", 8)
    x = np.random.default_rng(2).normal(size=(8, 7)).astype(np.float32)
    fn = jax.jit(jax.shard_map(lambda a: collectives.allreduce_batch_stats(a[0], "data"),
                               mesh=w.mesh, in_specs=P("data"), out_specs=P()))
    out = fn(x)
    np.testing.assert_allclose(np.asarray(out), x.sum(0), rtol=1e-6)
    assert len({np.asarray(s.data).tobytes() for s in out.addressable_shards}) == 1


def test_ring_traffic_model():
    assert comm.ring_traffic_bytes(1000, 8) == 2 * 7 / 8 * 1000
    assert comm.ring_traffic_bytes(1000, 1) == 0.0
