import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trjax import allreduce as ar
from trjax import comm

SIZES = (2, 3, 4, 8)
ALGOS = ("ring", "halving_doubling", "tree")
N_ELEMS = 37  # not a multiple of any world size > 1: exercises the padding


def mesh_1d(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def per_device(fn, n, x, check_vma=True):
    """Runs ``fn(local_x)`` on the first n devices; returns every device's
    result as row i of an [n, ...] array (out_specs=P("data"), so nothing is
    taken from device 0 alone)."""
    f = jax.jit(jax.shard_map(lambda a: fn(a[0])[None], mesh=mesh_1d(n),
                              in_specs=P("data"), out_specs=P("data"), check_vma=check_vma))
    return np.asarray(f(x)), f


def inputs(n, seed=0, m=N_ELEMS):
    return np.random.default_rng(seed).normal(size=(n, m)).astype(np.float32)


# numpy references with each algorithm's own summation order (float32 throughout)

def ring_order(x):
    n_ranks, m = x.shape
    c = -(-m // n_ranks)
    xp = np.zeros((n_ranks, c * n_ranks), np.float32)
    xp[:, :m] = x
    out = np.zeros(c * n_ranks, np.float32)
    for k in range(n_ranks):
        sl = slice(k * c, (k + 1) * c)
        acc = xp[k, sl].copy()
        for j in range(1, n_ranks):
            acc = acc + xp[(k + j) % n_ranks, sl]
        out[sl] = acc
    return out[:m]


def halving_doubling_order(x):
    n_ranks = x.shape[0]
    p = 1 << (n_ranks.bit_length() - 1)
    rem = n_ranks - p
    y = [x[2 * i] + x[2 * i + 1] for i in range(rem)] + [x[i] for i in range(2 * rem, n_ranks)]
    y = np.stack(y)
    while len(y) > 1:
        h = len(y) // 2
        y = y[:h] + y[h:]
    return y[0]


def tree_order(x):
    n_ranks = x.shape[0]
    y = [row.copy() for row in x]
    d = 1
    while d < n_ranks:
        for r in range(0, n_ranks, 2 * d):
            if r + d < n_ranks:
                y[r] = y[r] + y[r + d]
        d *= 2
    return y[0]


ORDER = {"ring": ring_order, "halving_doubling": halving_doubling_order, "tree": tree_order}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algo", ALGOS)
def test_algorithm_equals_psum_on_every_device(algo, n):
    x = inputs(n, seed=n)
    got, _ = per_device(lambda a: ar.ALGORITHMS[algo](a, "data"), n, x)
    ref, _ = per_device(lambda a: lax.psum(a, "data"), n, x)
    assert got.shape == (n, N_ELEMS) and got.dtype == np.float32
    for i in range(n):  # every device, bitwise identical to the others
        assert got[i].tobytes() == got[0].tobytes()
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-6, atol=1e-6)
    # bitwise equal to a numpy float32 sum in the algorithm's documented order
    assert got[0].tobytes() == ORDER[algo](x).tobytes()
    if n == 2:  # a single addition: the order cannot matter
        assert got[0].tobytes() == ref[0].tobytes()


@pytest.mark.parametrize("n", (5, 6, 7))
def test_halving_doubling_folds_non_powers_of_two(n):
    x = inputs(n, seed=10 + n)
    got, _ = per_device(lambda a: ar.halving_doubling_allreduce(a, "data"), n, x)
    assert all(got[i].tobytes() == halving_doubling_order(x).tobytes() for i in range(n))


@pytest.mark.parametrize("algo", ("xla",) + ALGOS)
def test_shapes_dtypes_world_size_one_and_replicated_input(algo):
    # a 2-D int32 buffer: shape and dtype kept, exact integer sum
    xi = np.arange(4 * 3 * 5, dtype=np.int32).reshape(4, 3, 5)
    got, _ = per_device(lambda a: ar.ALGORITHMS[algo](a, "data"), 4, xi)
    np.testing.assert_array_equal(got, np.broadcast_to(xi.sum(0), got.shape))
    # N == 1: the input itself
    x1 = inputs(1)
    got1, _ = per_device(lambda a: ar.ALGORITHMS[algo](a, "data"), 1, x1)
    assert got1.tobytes() == x1.tobytes()
    # an input invariant over the axis (a replicated constant): N * x
    c = np.linspace(-1, 1, 9).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda _: ar.ALGORITHMS[algo](jnp.asarray(c), "data")[None],
                              mesh=mesh_1d(4), in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(np.asarray(f(np.zeros((4, 1), np.float32))), np.tile(4 * c, (4, 1)),
                               rtol=1e-6)


@pytest.mark.parametrize("local_size", [1, 2, 4, 8])
def test_hierarchical_matches_psum(local_size):
    x = inputs(8, seed=3, m=50)
    # axis_index_groups: not VMA-typed (the exchange runs it with check_vma=False too)
    got, f = per_device(lambda a: ar.hierarchical_allreduce(a, "data", local_size), 8, x, False)
    ref, _ = per_device(lambda a: lax.psum(a, "data"), 8, x)
    for i in range(8):
        assert got[i].tobytes() == got[0].tobytes()
        np.testing.assert_allclose(got[i], ref[i], rtol=1e-6, atol=1e-6)
    # summation order: within each node first, then across nodes (float32 throughout)
    nodes = [x[s:s + local_size].sum(0, dtype=np.float32) for s in range(0, 8, local_size)]
    np.testing.assert_allclose(got[0], np.sum(nodes, 0, dtype=np.float32), rtol=1e-6)
    kinds = [c["kind"] for c in comm.collectives_in_hlo(f.lower(x).compile().as_text())]
    if local_size in (2, 4):  # two levels: reduce-scatter, all-reduce, all-gather
        assert kinds == ["reduce-scatter", "all-reduce", "all-gather"], kinds
    else:  # one node or one device per node: a plain all-reduce
        assert kinds == ["all-reduce"], kinds


def test_ring_compiles_to_collective_permutes_only():
    _, f = per_device(lambda a: ar.ring_allreduce(a, "data"), 8, inputs(8))
    hlo = f.lower(inputs(8)).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-reduce" not in hlo


@pytest.mark.parametrize("algo,n", [("halving_doubling", 8), ("halving_doubling", 6), ("tree", 8),
                                    ("tree", 5)])
def test_unrolled_steps_match_cost_model(algo, n):
    """One collective-permute per step in the compiled HLO, as many as the cost
    model counts; halving-doubling sends halves of shrinking, then growing size."""
    x = inputs(n)
    _, f = per_device(lambda a: ar.ALGORITHMS[algo](a, "data"), n, x)
    hlo = f.lower(x).compile().as_text()
    cols = comm.collectives_in_hlo(hlo)
    assert {c["kind"] for c in cols} == {"collective-permute"} and "all-reduce" not in hlo
    assert len(cols) == ar.cost_model(algo, 4 * N_ELEMS, n)["steps"]
    if (algo, n) == ("halving_doubling", 8):  # chunk of ceil(37 / 8) = 5 elements
        assert [c["elements"] for c in cols] == [20, 10, 5, 5, 10, 20]
    if algo == "tree":
        assert all(c["elements"] == N_ELEMS for c in cols)


def test_cost_model_by_hand():
    a, b = 1e-6, 1e-9
    ring = ar.cost_model("ring", 1000, 4, alpha_s=a, beta_s_per_byte=b)
    assert ring["steps"] == 6 and ring["bytes_sent_per_rank"] == 1500.0
    assert ring["time_s"] == pytest.approx(6e-6 + 1.5e-6)
    assert ring["bytes_sent_per_rank"] == comm.ring_traffic_bytes(1000, 4)
    hd = ar.cost_model("halving_doubling", 1000, 8, alpha_s=a, beta_s_per_byte=b)
    assert hd["steps"] == 6 and hd["bytes_sent_per_rank"] == 1750.0
    assert hd["time_s"] == pytest.approx(6e-6 + 1.75e-6)
    hd6 = ar.cost_model("halving_doubling", 1000, 6, alpha_s=a, beta_s_per_byte=b)
    assert hd6["steps"] == 6 and hd6["bytes_sent_per_rank"] == 2500.0
    assert hd6["critical_path_bytes"] == 3500.0
    tree = ar.cost_model("tree", 1000, 5, alpha_s=a, beta_s_per_byte=b)  # ceil(log2 5) = 3
    assert tree["steps"] == 6 and tree["bytes_sent_per_rank"] == 3000.0
    assert tree["time_s"] == pytest.approx(6 * (1e-6 + 1e-6))
    assert ar.cost_model("xla", 1000, 4, alpha_s=a, beta_s_per_byte=b) == ring
    assert ar.cost_model("tree", 1000, 1)["time_s"] == 0.0


def test_bad_names_and_sizes_raise_naming_the_value():
    with pytest.raises(ValueError, match="local_size=3 must be an int >= 1 dividing the world size 4"):
        per_device(lambda a: ar.hierarchical_allreduce(a, "data", 3), 4, inputs(4), False)
    with pytest.raises(ValueError, match="'fast'"):
        ar.cost_model("fast", 100, 4)
    with pytest.raises(ValueError, match="world_size.*0"):
        ar.cost_model("ring", 100, 0)
    with pytest.raises(ValueError, match="world_size.*2.5"):
        ar.cost_model("ring", 100, 2.5)
    with pytest.raises(ValueError, match="nbytes.*-1"):
        ar.cost_model("ring", -1, 4)
