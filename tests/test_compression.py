import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trjax import comm
from trjax import compression as C

N = 4


def mesh_1d(n=N):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def state_specs(state):
    """error is per device (P("data") over [N * n]); everything else replicated."""
    return {k: (P("data") if k == "error" else P()) for k in state} if isinstance(state, dict) else ()


def global_state(state, n_ranks=N):
    if not isinstance(state, dict):
        return state
    return {k: (jnp.tile(v, n_ranks) if k == "error" else v) for k, v in state.items()}


def make_step(comp, n, n_ranks=N):
    """A jitted shard_map step: ([N * n] buffers, state) -> ([N, n] per-device
    results, state); every device's result comes back as a row."""
    state0 = comp.init(jax.ShapeDtypeStruct((n,), jnp.float32))
    specs = state_specs(state0)

    def local(buf, state):
        reduced, new_state = comp.allreduce(buf, state, "data")
        return reduced[None], new_state

    f = jax.jit(jax.shard_map(local, mesh=mesh_1d(n_ranks), in_specs=(P("data"), specs),
                              out_specs=(P("data"), specs)))
    return f, global_state(state0, n_ranks)


def grads(n, seed=0, n_ranks=N, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=(n_ranks, n))).astype(np.float32)


def psum_ref(g):
    f = jax.jit(jax.shard_map(lambda a: lax.psum(a[0], "data")[None], mesh=mesh_1d(g.shape[0]),
                              in_specs=P("data"), out_specs=P("data")))
    return np.asarray(f(g))[0]


def assert_replicated(rows):
    assert all(r.tobytes() == rows[0].tobytes() for r in rows)


# --------------------------------------------------------------------------- casts

@pytest.mark.parametrize("name,wire,rtol", [("bf16", "bf16", 2 ** -7), ("fp16", "f16", 2 ** -9)])
def test_cast_close_to_psum_and_carries_the_low_dtype(name, wire, rtol):
    n = 64
    g = grads(n, seed=1)
    comp = C.make_compressor(name)
    f, state = make_step(comp, n)
    out, new_state = f(g.reshape(-1), state)
    out = np.asarray(out)
    assert out.dtype == np.float32 and new_state == ()
    assert_replicated(out)
    ref = psum_ref(g)
    # each input rounded once (and the sum once more): error within a few ulps of the wire dtype
    np.testing.assert_allclose(out[0], ref, rtol=0, atol=rtol * (np.abs(g).sum(0).max() + 1))
    assert not np.array_equal(out[0], ref)  # it really went through 16 bits

    # the all-reduce the program asks for carries the 16-bit dtype (half the bytes)
    lowered = f.lower(g.reshape(-1), state)
    ars = [l for l in lowered.as_text(dialect="hlo").splitlines() if " all-reduce(" in l]
    assert len(ars) == 1 and re.search(rf"= {wire}\[{n}\]", ars[0]), ars
    compiled = comm.collectives_in_hlo(lowered.compile().as_text())
    assert [c["kind"] for c in compiled] == ["all-reduce"]
    if wire == "f16" or jax.default_backend() != "cpu":
        assert compiled[0]["operands"][0]["dtype"] == wire and compiled[0]["bytes"] == 2 * n
    else:  # XLA:CPU promotes a bf16 all-reduce to f32 (documented caveat)
        assert compiled[0]["operands"][0]["dtype"] in ("bf16", "f32")


def test_fp16_prescale_avoids_overflow():
    g = np.full((N, 8), 30000.0, np.float32)  # sum 120000 > float16 max 65504
    out, _ = make_step(C.fp16(), 8)[0](g.reshape(-1), ())
    np.testing.assert_allclose(np.asarray(out), 120000.0, rtol=1e-3)
    out, _ = make_step(C.fp16(prescale=False), 8)[0](g.reshape(-1), ())
    assert np.isinf(np.asarray(out)).all()


# --------------------------------------------------------------------------- PowerSGD

def test_powersgd_state_shapes():
    st = C.powersgd(rank=2, matrices=[(0, 8, 7)]).init(jnp.zeros(60))
    assert st["error"].shape == (60,) and st["error"].dtype == jnp.float32
    assert [q.shape for q in st["q"]] == [(7, 2)] and st["q"][0].dtype == jnp.float32
    assert not np.any(np.asarray(st["error"]))
    # rank capped per matrix at min(rows, cols)
    assert C.powersgd(rank=9, matrices=[(0, 8, 7)]).init(jnp.zeros(56))["q"][0].shape == (7, 7)
    with pytest.raises(ValueError, match="rank.*0"):
        C.powersgd(rank=0)
    with pytest.raises(ValueError, match=r"\(5, 10\)"):
        C.powersgd(matrices=[(0, 5, 10)]).init(jnp.zeros((5, 10)))


def test_powersgd_full_rank_reproduces_the_sum():
    n = 56
    g = grads(n, seed=2)
    f, state = make_step(C.powersgd(rank=7, matrices=[(0, 8, 7)]), n)  # rank 7 is full rank
    out, st = f(g.reshape(-1), state)
    out = np.asarray(out)
    assert_replicated(out)
    np.testing.assert_allclose(out[0], g.sum(0), rtol=1e-4, atol=1e-4)
    # P^ spans the column space of the SUM (7 of 8 dims), not each device's:
    # the per-device errors are not zero, but they cancel over devices
    err = np.asarray(st["error"]).reshape(N, n)
    assert np.abs(err.sum(0)).max() < 1e-4
    assert st["error"].shape == (N * n,) and st["q"][0].shape == (7, 7)
    # two all-reduces: P ([rows, r]) then Q ([cols, r])
    cols = comm.collectives_in_hlo(f.lower(g.reshape(-1), state).compile().as_text())
    assert [(c["kind"], c["elements"]) for c in cols] == [("all-reduce", 8 * 7), ("all-reduce", 7 * 7)]


def test_powersgd_error_feedback_recovers_the_sum_over_steps():
    n, steps = 56, 40
    g = grads(n, seed=3)  # the same gradient every step
    f, state = make_step(C.powersgd(rank=1, matrices=[(0, 8, 7)]), n)
    true = g.sum(0).astype(np.float64)
    total = np.zeros(n)
    rel = []
    for t in range(steps):
        out, state = f(g.reshape(-1), state)
        out = np.asarray(out)
        assert_replicated(out)
        total += out[0]
        rel.append(np.abs(total / (t + 1) - true).max() / np.abs(true).max())
    # nothing lost, only delayed: outputs + what the devices still hold == every gradient sent
    held = np.asarray(state["error"], np.float64).reshape(N, n).sum(0)
    np.testing.assert_allclose(total + held, steps * true, rtol=0, atol=1e-3)
    # so the running mean of the rank-1 outputs converges to the true sum
    assert rel[0] > 0.5 and rel[-1] < 0.2 and rel[-1] < rel[0] / 4
    assert state["q"][0].shape == (7, 1)


# --------------------------------------------------------------------------- top-k

@pytest.mark.parametrize("method", ["dense", "allgather"])
def test_topk_ratio_one_is_psum(method):
    n = 40
    g = grads(n, seed=4)
    f, state = make_step(C.topk(1.0, method=method), n)
    out, st = f(g.reshape(-1), state)
    out = np.asarray(out)
    assert_replicated(out)
    if method == "dense":
        assert out[0].tobytes() == psum_ref(g).tobytes()
    else:
        np.testing.assert_allclose(out[0], g.sum(0), rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(st["error"]))


@pytest.mark.parametrize("method", ["dense", "allgather"])
def test_topk_error_feedback_keeps_the_residual(method):
    n, ratio, steps = 40, 0.1, 3
    k = C.topk_k(n, ratio)
    assert k == 4
    g = grads(n, seed=5)
    f, state = make_step(C.topk(ratio, method=method), n)
    error = np.zeros((N, n), np.float32)
    total = np.zeros(n)
    for _ in range(steps):
        out, state = f(g.reshape(-1), state)
        out = np.asarray(out)
        assert_replicated(out)
        # numpy reference: each device sends its k largest |g + error|, keeps the rest
        acc = g + error
        sent = np.zeros_like(acc)
        for i in range(N):
            top = np.argsort(-np.abs(acc[i]), kind="stable")[:k]
            sent[i, top] = acc[i, top]
        error = acc - sent
        np.testing.assert_allclose(out[0], sent.sum(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(state["error"]).reshape(N, n), error)
        assert ((np.asarray(state["error"]).reshape(N, n) == 0).sum(1) == k).all()
        total += out[0]
    np.testing.assert_allclose(total + error.sum(0), steps * g.sum(0), rtol=0, atol=1e-4)
    hlo = f.lower(g.reshape(-1), state).compile().as_text()
    kinds = [(c["kind"], c["elements"]) for c in comm.collectives_in_hlo(hlo)]
    if method == "allgather":  # k indices + k values per device, one all-gather
        assert kinds == [("all-gather", N * 2 * k)]
    else:
        assert kinds == [("all-reduce", n)]


def test_bad_options_raise_naming_the_value():
    with pytest.raises(ValueError, match="'zip'"):
        C.make_compressor("zip")
    with pytest.raises(ValueError, match="ratio.*0.0"):
        C.topk(0.0)
    with pytest.raises(ValueError, match="ratio.*1.5"):
        C.topk(1.5)
    with pytest.raises(ValueError, match="'sparse'"):
        C.topk(0.5, method="sparse")
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        C.bf16().init(jnp.zeros((2, 3)))


def test_powersgd_full_rank_is_exact_and_vectors_exact():
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from trjax import compression
    n_dev = 4
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    rng = np.random.default_rng(0)
    # buffer: a 6x3 matrix at offset 2, vectors around it
    n = 2 + 18 + 5
    x = rng.normal(size=(n_dev, n)).astype(np.float32)
    comp = compression.powersgd(rank=3, matrices=[(2, 6, 3)])
    state = comp.init(jax.ShapeDtypeStruct((n,), jnp.float32))

    def f(b):
        out, st = comp.allreduce(b[0], state, "data")
        return out[None], st["error"][None]

    out, err = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                     check_vma=False))(x)
    out, err = np.asarray(out), np.asarray(err)
    np.testing.assert_allclose(out[0], x.sum(0), rtol=1e-4, atol=1e-4)  # full rank: exact sum
    np.testing.assert_array_equal(out[0][:2], out[1][:2])
    np.testing.assert_allclose(err[:, :2], 0.0)  # vectors are sent exactly: no error kept
    np.testing.assert_allclose(err.sum(0), 0.0, atol=1e-4)  # errors cancel at full rank
    with pytest.raises(ValueError, match="overlaps another or leaves the buffer"):
        compression.powersgd(2, [(20, 6, 3)]).init(jax.ShapeDtypeStruct((n,), jnp.float32))


def test_per_layer_powersgd_exchange_carries_its_error_feedback_over_steps():
    """``compression="powersgd"`` as training runs it: exchange.compressed, one matrix per
    layer (layer_matrices), rank 1, the comm state threaded step to step. With SGD lr 1 on
    zero parameters, params_T * -count is everything sent; with the per-device errors still
    held it must equal every gradient summed over steps and devices (nothing lost, only
    delayed). Checked by planting: the comm state not carried (new_comm = old) fails this."""
    from trjax import exchange, models
    from trjax.metrics import METRICS
    from trjax.plan import build_plan, layer_matrices
    from trjax.world import make_world
    import optax

    n_dev, steps = 8, 12
    world = make_world("all", 8 * n_dev)
    model = models.create_model("resnet8", stage_sizes=(1,), widths=(8,), stem_width=8,
                                bn_mode="sync", axis_name=world.axis_name)
    plan = build_plan(model, (8, 8, 1), "two", "HWIO")
    make = lambda b: C.powersgd(1, layer_matrices(plan, b))
    per_bucket = exchange.exact_below(plan, make, 0.05)
    assert any(plan.bucket_bytes(b) >= 0.05 * plan.gradient_bytes for b in per_bucket)
    ex = exchange.compressed(optax.sgd(1.0), plan, per_bucket)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)),
                                               train=False)["params"])
    params = jax.tree_util.tree_map(lambda s: world.put(np.zeros(s.shape, s.dtype)), shapes)
    opt_state, comm_state = ex.init(params, world)
    opt_specs, comm_specs = ex.specs(world.axis_name)

    def local(bufs, params, opt_state, comm_state):
        up = ex.update({b: v[0] for b, v in bufs.items()}, params, opt_state, comm_state,
                       jnp.int32(0), None, world.axis_name)
        return up.params, up.opt_state, up.comm_state

    f = jax.jit(jax.shard_map(local, mesh=world.mesh,
                              in_specs=(P(world.axis_name), P(), opt_specs, comm_specs),
                              out_specs=(P(), opt_specs, comm_specs), check_vma=False))
    mb, mo = plan.metrics_slot
    count = METRICS.index("count")
    rng = np.random.default_rng(0)
    true = {b: np.zeros(n) for b, n in plan.bucket_elements.items()}
    for _ in range(steps):
        bufs = {b: rng.normal(size=(n_dev, n)).astype(np.float32)
                for b, n in plan.bucket_elements.items()}
        bufs[mb][:, mo:mo + len(METRICS)] = 0.0
        bufs[mb][:, mo + count] = 1.0  # global count n_dev: the applied mean is sum / n_dev
        for b in bufs:
            true[b] += bufs[b].astype(np.float64).sum(0)
        params, opt_state, comm_state = f({b: world.put(v, world.sharded()) for b, v in bufs.items()},
                                          params, opt_state, comm_state)
    true[mb][mo:mo + len(METRICS)] = 0.0
    sent = {b: -n_dev * np.asarray(v, np.float64)
            for b, v in plan.pack(jax.tree_util.tree_map(np.asarray, params),
                                  np.zeros(len(METRICS), np.float32)).items()}
    lossy = 0.0
    for b, n in plan.bucket_elements.items():
        held = np.zeros(n)
        if "error" in (comm_state[b] or {}):
            err = np.asarray(comm_state[b]["error"], np.float64).reshape(n_dev, -1).sum(0)
            if b == mb:  # the metrics left the bucket before compression
                err = np.concatenate([err[:mo], np.zeros(len(METRICS)), err[mo:]])
            held = err
        scale = np.abs(true[b]).max()
        lossy = max(lossy, np.abs(sent[b] - true[b]).max() / scale)
        np.testing.assert_allclose(sent[b] + held, true[b], rtol=0, atol=1e-4 * scale)
    assert lossy > 0.1  # rank 1 did drop a lot each step: the errors carry it


# --------------------------------------------------------------------------- loss scale (fp16)

def _exchange_harness(make_per_bucket):
    """exchange.compressed over the small ResNet-8's plan, driven with bucket buffers given
    directly (what the train step packs: gradient SUMS of ``scale * loss``, metric sums) and
    the loss scale the fp16 step passes: ``step(bufs, state, scale) -> state``. SGD lr 1 on
    zero parameters: the params are minus everything applied."""
    import optax
    from trjax import exchange, models
    from trjax.plan import build_plan
    from trjax.world import make_world

    n_dev = 8
    world = make_world("all", 8 * n_dev)
    model = models.create_model("resnet8", stage_sizes=(1,), widths=(8,), stem_width=8,
                                bn_mode="sync", axis_name=world.axis_name)
    plan = build_plan(model, (8, 8, 1), "two", "HWIO")
    ex = exchange.compressed(optax.sgd(1.0), plan, make_per_bucket(plan))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)),
                                               train=False)["params"])
    params = jax.tree_util.tree_map(lambda s: world.put(np.zeros(s.shape, s.dtype)), shapes)
    opt_state, comm_state = ex.init(params, world)
    opt_specs, comm_specs = ex.specs(world.axis_name)

    def local(bufs, params, opt_state, comm_state, scale):
        up = ex.update({b: v[0] for b, v in bufs.items()}, params, opt_state, comm_state,
                       jnp.int32(5), scale, world.axis_name)
        return up.params, up.opt_state, up.comm_state, up.finite

    f = jax.jit(jax.shard_map(local, mesh=world.mesh,
                              in_specs=(P(world.axis_name), P(), opt_specs, comm_specs, P()),
                              out_specs=(P(), opt_specs, comm_specs, P()), check_vma=False))

    def step(bufs, state, scale):
        params, opt_state, comm_state = state
        out = f({b: world.put(v, world.sharded()) for b, v in bufs.items()}, params, opt_state,
                comm_state, jnp.float32(scale))
        assert bool(out[3])
        return out[:3]

    return plan, n_dev, step, (params, opt_state, comm_state)


def _gradients(plan, n_dev, seed):
    """Unscaled per-device bucket buffers (metric sums: count 1 per device, the rest 0)."""
    from trjax.metrics import METRICS
    rng = np.random.default_rng(seed)
    mb, mo = plan.metrics_slot
    bufs = {b: rng.normal(size=(n_dev, n)).astype(np.float32)
            for b, n in plan.bucket_elements.items()}
    bufs[mb][:, mo:mo + len(METRICS)] = 0.0
    bufs[mb][:, mo + METRICS.index("count")] = 1.0
    return bufs


def _scaled(plan, bufs, scale):
    """What an fp16 step packs at loss scale ``scale``: gradients scaled, metric sums not."""
    from trjax.metrics import METRICS
    mb, mo = plan.metrics_slot
    out = {b: v * np.float32(scale) for b, v in bufs.items()}
    out[mb][:, mo:mo + len(METRICS)] = bufs[mb][:, mo:mo + len(METRICS)]
    return out


def _without_metrics(plan, b, x):
    from trjax.metrics import METRICS
    mb, mo = plan.metrics_slot
    return np.concatenate([x[..., :mo], x[..., mo + len(METRICS):]], -1) if b == mb else x


def test_topk_error_feedback_is_carried_in_unscaled_units_across_a_loss_scale_change():
    """The field failure (kind 10): with fp16 the error feedback was kept in loss-scaled
    units, so after the loss scale changed (halved on an overflow, doubled after the growth
    interval) the carried error was added to the next gradient at the old scale. Now it is
    the unscaled residual: step 1 at scale 2^10, step 2 at 2^4, checked against top-k by
    hand on the unscaled gradients (each device: acc = g + error, sent = its k largest
    magnitudes, error <- acc - sent)."""
    ratio = 0.05
    plan, n_dev, step, state = _exchange_harness(lambda plan: C.topk(ratio))
    g = [_gradients(plan, n_dev, seed) for seed in (1, 2)]
    error = {b: np.zeros_like(_without_metrics(plan, b, v)) for b, v in g[0].items()}
    for t, scale in enumerate((2.0 ** 10, 2.0 ** 4)):
        state = step(_scaled(plan, g[t], scale), state, scale)
        for b in error:
            acc = _without_metrics(plan, b, g[t][b]) + error[b]
            k = C.topk_k(acc.shape[1], ratio)
            sent = np.zeros_like(acc)
            for i in range(n_dev):
                top = np.argsort(-np.abs(acc[i]), kind="stable")[:k]
                sent[i, top] = acc[i, top]
            error[b] = acc - sent
            carried = np.asarray(state[2][b]["error"])
            np.testing.assert_allclose(carried, error[b], rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {t + 1}, bucket {b}, scale {scale}")


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_runs_whose_loss_scale_differs_by_powers_of_two_give_the_same_parameters(name):
    """Three steps at scales (1, 1, 1) and at (2^12, 2^5, 2^9): the parameters and the carried
    state agree within rounding (multiplying by a power of two is exact, so in fact they agree
    to the bit here). With the error carried in scaled units the second run's steps 2 and 3
    add a 2^7-times-too-large, then a 2^4-times-too-small error."""
    from trjax.plan import layer_matrices
    make = (lambda plan: C.topk(0.05)) if name == "topk" else \
        (lambda plan: {b: C.powersgd(1, layer_matrices(plan, b)) for b in plan.bucket_elements})
    runs = {}
    for scales in ((1.0, 1.0, 1.0), (2.0 ** 12, 2.0 ** 5, 2.0 ** 9)):
        plan, n_dev, step, state = _exchange_harness(make)
        for t, scale in enumerate(scales):
            state = step(_scaled(plan, _gradients(plan, n_dev, 10 + t), scale), state, scale)
        runs[scales] = jax.tree_util.tree_map(np.asarray, state)
    a, b = runs.values()
    for x, y in zip(jax.tree_util.tree_leaves(a[0]), jax.tree_util.tree_leaves(b[0])):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6 * np.abs(x).max())
    for x, y in zip(jax.tree_util.tree_leaves(a[2]), jax.tree_util.tree_leaves(b[2])):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6 * np.abs(x).max())
