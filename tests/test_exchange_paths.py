"""Every gradient-exchange path in the compiled train step, not only the plain all-reduce:
each all-reduce algorithm (xla, ring, halving_doubling, tree, hierarchical), each compressor
(bf16, fp16, powersgd, topk) and the sharded optimizer state (ZeRO-1). Per path: the
collectives of the compiled program, bucket by bucket; loss-scaled (fp16's dynamic loss
scale) steps against scale 1; an overflow skipping the update. Then compression that starts
at a later step.

One small ResNet-8 (one stage of width 8), local BN (no BN collective: the program's
collectives are the exchange's only), 8 devices, global batch 32, the default "two" buckets.
Each path's step is compiled once for the module, with the dynamic loss scale on (a state
with loss scale 1 runs it as the fp32 step: the loss times 1, the sums divided by 1).

Against the plain ``xla`` all-reduce (one step each from the same state and batch, every
step the module's compiled one): the other all-reduce algorithms and bucket policies land
within rounding, bf16 compression halves the bytes it requests, and top-k carries its
error feedback (these were test_exchange.py's, on the full ResNet-8)."""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_rel, random_batch, to_host
from trjax import aot, comm, compression, exchange, models, optim, parallel, steps
from trjax.metrics import METRICS
from trjax.objective import StepOptions
from trjax.plan import build_plan, layer_matrices, shard_layout
from trjax.state import create_train_state
from trjax.world import make_world

N, LOCAL, RATIO, BN = 8, 4, 0.05, "local"
ALGORITHMS = ("xla", "ring", "halving_doubling", "tree", "hierarchical")
COMPRESSORS = ("bf16", "fp16", "powersgd", "topk")
PATHS = ALGORITHMS + COMPRESSORS + ("shard_optimizer_state",)


@functools.lru_cache(maxsize=None)
def _setup():
    world = make_world("all", 32)
    model = models.create_model("resnet8", num_classes=10, stage_sizes=(1,), widths=(8,),
                                stem_width=8, bn_mode=BN, axis_name=world.axis_name)
    plan = build_plan(model, (8, 8, 1))
    return world, model, plan


def _tx(plan, mask=None):
    return optim.make_optimizer("sgd", 0.1, None if mask is not None else plan, mask=mask,
                                weight_decay=1e-3, momentum=0.9)


@functools.lru_cache(maxsize=None)
def _plan(policy="two"):
    return _setup()[2] if policy == "two" else build_plan(_setup()[1], (8, 8, 1), policy)


def _exchange(path, start_step=0, policy="two"):
    plan = _plan(policy)
    if path in ALGORITHMS:
        return exchange.allreduce(_tx(plan), plan, path, LOCAL)
    if path == "shard_optimizer_state":
        return exchange.shard_optimizer_state(plan, N, lambda mask: _tx(plan, mask))
    comp = {"bf16": compression.bf16, "fp16": compression.fp16,
            "topk": lambda: compression.topk(RATIO),
            "powersgd": lambda: {b: compression.powersgd(1, layer_matrices(plan, b))
                                 for b in plan.bucket_elements}}[path]()
    return exchange.compressed(_tx(plan), plan, comp, start_step=start_step)


@functools.lru_cache(maxsize=None)
def _built(path, start_step=0, policy="two"):
    """``(compiled step, initial state)``; not donated, so a state can be run twice."""
    world, model, _ = _setup()
    plan = _plan(policy)
    ex = _exchange(path, start_step, policy)
    layout = parallel.data_parallel(model, world, (8, 8, 1), BN)
    state = create_train_state(jax.random.key(0), layout, ex)
    step = aot.compile_step("train", steps.make_train_step(
        layout, ex, plan, StepOptions(dynamic_loss_scale=True)), state, _batch(0))
    return step, state


def _batch(i):
    world, _, _ = _setup()
    return jax.device_put(random_batch(32, seed=40 + i), world.sharded())


def _with_scale(state, scale):
    return state.replace(loss_scale=jax.device_put(np.float32(scale), state.loss_scale.sharding))


def _gradient_elements(path):
    """ZeRO-1's optimizer state is flat per bucket (``[n_pad]``), the metric sums' slot and
    the padding included: ``{shape: index of the gradient elements}`` to compare (the slot's
    "momentum" of metric sums divided by the loss scale is never applied to a parameter, so
    it differs between loss scales without an effect); ``{}`` for the other paths."""
    if path != "shard_optimizer_state":
        return {}
    _, _, plan = _setup()
    is_grad = {b: np.zeros(n, bool) for b, (n, _) in shard_layout(plan, N).items()}
    for slot in plan.slots:
        is_grad[slot.bucket][slot.offset:slot.offset + slot.size] = True
    assert len({m.shape for m in is_grad.values()}) == len(is_grad)  # shapes tell the buckets
    return {m.shape: m for m in is_grad.values()}


def _run(path, scales, start_step=0, state=None, first_batch=0):
    step, init = _built(path, start_step)
    state = init if state is None else state
    metrics = []
    for i, s in enumerate(scales, first_batch):
        state, m = step(_with_scale(state, s), _batch(i))
        metrics.append(np.asarray(m))
    return state, metrics


def _assert_close(path, ref_h, out_h, tol):
    """Every leaf of the host states' params, optimizer (ZeRO-1: its gradient elements),
    BN and comm state within ``tol`` of the leaf's largest magnitude."""
    keep = _gradient_elements(path)
    for part in ("params", "opt_state", "batch_stats", "comm_state"):
        for (key, x), y in zip(jax.tree_util.tree_flatten_with_path(getattr(ref_h, part))[0],
                               jax.tree_util.tree_leaves(getattr(out_h, part))):
            if part == "opt_state" and x.shape in keep:
                x, y = x[keep[x.shape]], y[keep[x.shape]]
            scale = max(np.abs(x).max(), 1e-6)
            assert np.abs(y - x).max() <= tol * scale, (path, part, jax.tree_util.keystr(key))


# --------------------------------------------------------------------------- collectives

def expected_transfers(path, plan):
    """What the exchange sends, ``{bucket: [(kind, dtypes, elements)]}`` (one entry per
    collective operand, in program order; ``"*"``: the compressed exchange's and ZeRO-1's
    small exact all-reduce of the metric sums), from the algorithms (trjax.allreduce,
    trjax.compression, trjax.exchange):

    * xla: one all-reduce of the bucket (metric sums inside);
    * ring: 2 collective-permutes of ``ceil(n / N)`` (one per ``fori_loop`` body: N-1
      reduce-scatter steps, N-1 all-gather steps);
    * halving_doubling: ``2 log2 N`` collective-permutes of ``d * ceil(n / N)``, d = N/2 ... 1
      then 1 ... N/2;
    * tree: ``2 ceil(log2 N)`` collective-permutes of the whole bucket;
    * hierarchical: reduce-scatter within a node (``ceil(n / L)``), all-reduce across nodes
      (the same), all-gather within the node (``L ceil(n / L)``);
    * compressed: the metric sums in their own exact f32 all-reduce, then per bucket: bf16 /
      fp16 one all-reduce of the gradient part in the wire dtype (XLA:CPU runs a bf16
      all-reduce in f32); PowerSGD (rank 1) two all-reduces, P (every matrix's rows, plus the
      vectors sent exactly) then Q (every matrix's columns); top-k one all-gather of 2k
      uint32 words per device;
    * shard_optimizer_state: per bucket a reduce-scatter of ``n_pad / N`` and an all-gather
      of ``n_pad``; one all-reduce of the metric sums, the non-finite flag and the sum of
      squares of the gradient (grad_norm; grad_clip_norm's norm: no all-reduce of its own).
    """
    mb, _ = plan.metrics_slot
    nm = len(METRICS)
    f32 = ("f32",)
    out = {}
    if path in COMPRESSORS:
        out["*"] = [("all-reduce", f32, nm)]
    if path == "shard_optimizer_state":
        out["*"] = [("all-reduce", f32, nm + 2)]
        for b, (n_pad, _) in shard_layout(plan, N).items():
            out[b] = [("reduce-scatter", f32, n_pad // N), ("all-gather", f32, n_pad)]
        return out
    for b, n in plan.bucket_elements.items():
        g = n - nm if b == mb else n  # what a compressor gets: the metric sums left out
        c = -(-n // N)
        if path == "xla":
            out[b] = [("all-reduce", f32, n)]
        elif path == "ring":
            out[b] = [("collective-permute", f32, c)] * 2
        elif path == "halving_doubling":
            out[b] = [("collective-permute", f32, d * c) for d in (4, 2, 1, 1, 2, 4)]
        elif path == "tree":
            out[b] = [("collective-permute", f32, n)] * 6
        elif path == "hierarchical":
            p = -(-n // LOCAL)
            out[b] = [("reduce-scatter", f32, p), ("all-reduce", f32, p),
                      ("all-gather", f32, p * LOCAL)]
        elif path in ("bf16", "fp16"):
            out[b] = [("all-reduce", ("bf16", "f32") if path == "bf16" else ("f16",), g)]
        elif path == "powersgd":
            mats = layer_matrices(plan, b)
            rows, cols = sum(r for _, r, _ in mats), sum(k for _, _, k in mats)
            out[b] = [("all-reduce", f32, rows + g - sum(r * k for _, r, k in mats)),
                      ("all-reduce", f32, cols)]
        elif path == "topk":
            out[b] = [("all-gather", ("u32",), N * 2 * compression.topk_k(g, RATIO))]
    return out


def _matches(c, transfer):
    kind, dtypes, elements = transfer
    return c["kind"] == kind and any(o["elements"] == elements and o["dtype"] in dtypes
                                     for o in c["operands"])


@pytest.mark.parametrize("path", PATHS)
def test_collectives_per_bucket_on_every_exchange_path(path):
    """The compiled step holds exactly the collectives the exchange's algorithm sends per
    bucket, no more (a second exchange, a BN or loss-scale collective), in bucket order, and
    none merged across buckets: the buckets are chained (a data dependency), so the only
    merge XLA:CPU's all-reduce combiner makes is of the small exact all-reduce of the metric
    sums with the next independent f32 all-reduce (the bf16 one XLA:CPU promotes, or
    PowerSGD's P)."""
    _, _, plan = _setup()
    step, _ = _built(path)
    cols = comm.collectives_in_hlo(step.hlo_text())
    got = collections.Counter((c["kind"], o["dtype"], o["elements"]) for c in cols
                              for o in c["operands"])
    want = expected_transfers(path, plan)
    for kind, dtypes, elements in (t for ts in want.values() for t in ts):  # each one once
        match = [k for k in got if got[k] and k[0] == kind and k[2] == elements and
                 k[1] in dtypes]
        assert match, (path, kind, dtypes, elements, sorted(got.items()))
        got[match[0]] -= 1
    assert not +got, (path, "unexpected collectives", sorted((+got).items()))
    metrics = want.get("*", [None])[0]
    for c in cols:  # only the metric sums may ride along in another all-reduce
        if len(c["operands"]) > 1:
            assert metrics is not None and c["kind"] == "all-reduce" and \
                len(c["operands"]) == 2 and _matches(c, metrics), (path, c)
    first = [next(i for i, c in enumerate(cols) if _matches(c, want[b][0]))
             for b in plan.bucket_elements]
    assert first == sorted(first), (path, "buckets out of order", first)


# --------------------------------------------------------------------------- loss scale

SCALED = (2.0 ** 12, 2.0 ** 5)  # a loss-scale change between the two steps


@pytest.mark.parametrize("path", PATHS)
def test_loss_scaled_steps_equal_scale_one_and_an_overflow_skips_the_update(path):
    """Two steps at loss scales 2^12 then 2^5 against the same two at scale 1 (the fp32
    step): the parameters, optimizer, comm (error feedback) and BN state agree within
    rounding -- multiplying by a power of two is exact, so only the float16 wire of the fp16
    compressor, which at scale 1 loses gradients below float16's normal range, differs at
    all. fp16's second scaled step therefore starts from the reference's first state (one
    step against a one-step tolerance: two steps would carry the wire's rounding through the
    dynamics); the other paths chain their own states (bitwise by construction). Then a
    step at scale 2^127 overflows: the update is skipped on every path (state unchanged
    bit for bit, skipped_steps + 1, the scale halved, the step's finite flag 0)."""
    ref, m_ref = _run(path, (1.0, 1.0))
    if path == "fp16":
        ref_first = _run(path, (1.0,))[0]
        first, m_first = _run(path, SCALED[:1])
        _assert_close(path, to_host(ref_first), to_host(first), 2e-3)
        out, m_second = _run(path, SCALED[1:], state=ref_first, first_batch=1)
        m_out = m_first + m_second
    else:
        out, m_out = _run(path, SCALED)
    tol = 2e-3 if path == "fp16" else 1e-6  # (measured here: every path bit for bit)
    ref_h, out_h = to_host(ref), to_host(out)
    _assert_close(path, ref_h, out_h, tol)
    np.testing.assert_array_equal(m_out[0][:len(METRICS)], m_ref[0][:len(METRICS)])  # unscaled
    np.testing.assert_allclose(m_out[1][:len(METRICS)], m_ref[1][:len(METRICS)], rtol=tol)
    step, _ = _built(path)
    skipped, m = step(_with_scale(out, 2.0 ** 127), _batch(2))
    skipped_h = to_host(skipped)
    assert float(m.finite) == 0.0, path
    assert int(skipped_h.skipped_steps) == int(out_h.skipped_steps) + 1
    assert float(skipped_h.loss_scale) == 2.0 ** 126
    for part in ("params", "opt_state", "batch_stats", "comm_state"):
        for x, y in zip(jax.tree_util.tree_leaves(getattr(out_h, part)),
                        jax.tree_util.tree_leaves(getattr(skipped_h, part))):
            np.testing.assert_array_equal(y, x, err_msg=f"{path} {part}")


# --------------------------------------------------------------------------- start step

def test_compression_start_step_steps_before_it_are_uncompressed_bit_for_bit():
    """compression_start_step = 2 (top-k): steps 1 and 2 (state.step 0 and 1) are the plain
    all-reduce's, bit for bit, and leave the compressor state (its error feedback) at its
    initial zeros; step 3 (state.step 2) is compressed: the same as the compressed
    exchange's step from that state, and not the plain one's."""
    state = _built("topk", 2)[1]
    plain = _built("xla")[1]
    for i in range(2):
        state, _ = _built("topk", 2)[0](state, _batch(i))
        plain, _ = _built("xla")[0](plain, _batch(i))
        s, p = to_host(state), to_host(plain)
        for part in ("params", "opt_state", "batch_stats"):
            for x, y in zip(jax.tree_util.tree_leaves(getattr(p, part)),
                            jax.tree_util.tree_leaves(getattr(s, part))):
                np.testing.assert_array_equal(y, x, err_msg=f"step {i + 1} {part}")
        for leaf in jax.tree_util.tree_leaves(s.comm_state):
            assert not np.any(leaf), f"step {i + 1}: the compressor state was touched"
        assert int(s.step) == i + 1
    third, _ = _built("topk", 2)[0](state, _batch(2))
    from_start, _ = _built("topk")[0](state, _batch(2))  # compressed from step 0
    plain3, _ = _built("xla")[0](plain, _batch(2))
    third, from_start, plain3 = to_host(third), to_host(from_start), to_host(plain3)
    for x, y in zip(jax.tree_util.tree_leaves((from_start.params, from_start.comm_state)),
                    jax.tree_util.tree_leaves((third.params, third.comm_state))):
        np.testing.assert_array_equal(y, x)
    assert any(np.any(leaf) for leaf in jax.tree_util.tree_leaves(third.comm_state))
    assert any(not np.array_equal(x, y) for x, y in zip(
        jax.tree_util.tree_leaves(third.params), jax.tree_util.tree_leaves(plain3.params)))


# --------------------------------------------------------------------------- against psum

@functools.lru_cache(maxsize=None)
def _first_step(path, policy="two"):
    """``(host state, metrics)`` of one step of ``path`` from the initial state on batch 0."""
    step, init = _built(path, policy=policy)
    state, m = step(init, _batch(0))
    return to_host(state), np.asarray(m)


@pytest.mark.parametrize("policy", ["tail_minimal", "size:0.002"])  # per_leaf: test_regions_plan
def test_bucket_policies_give_the_same_step(policy):
    """Another bucket policy (``size:0.002``: 2 kB buckets, five of them on this model) moves
    elements between buckets, not their values: the step of the default "two" buckets
    within rounding, the counts exact; the chained buckets stay one all-reduce each, in plan
    order."""
    ref, m_ref = _first_step("xla")
    new, m = _first_step("xla", policy)
    plan = _plan(policy)
    assert max_rel(new.params, ref.params) <= 1e-6
    assert max_rel(new.opt_state, ref.opt_state) <= 1e-6
    np.testing.assert_array_equal(new.batch_stats["stem_bn"]["mean"],
                                  ref.batch_stats["stem_bn"]["mean"])
    np.testing.assert_allclose(m, m_ref, rtol=1e-6)  # loss sum: summation order only
    np.testing.assert_array_equal(m[1:], m_ref[1:])  # counts exact
    cols = comm.collectives_in_hlo(_built("xla", policy=policy)[0].hlo_text())
    sizes = set(plan.bucket_elements.values())
    bucket_cols = [c["elements"] for c in cols if c["elements"] in sizes]
    assert bucket_cols == list(plan.bucket_elements.values())
    assert len(plan.bucket_elements) > 2 or policy == "tail_minimal"


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "tree", "hierarchical"])
def test_allreduce_algorithms_in_the_step_equal_psum(algorithm):
    """One step of each ppermute / hierarchical all-reduce against the plain psum
    (``xla``) step from the same state: within the rounding of reordered sums, counts
    exact. (Their collectives, per bucket: test_collectives_per_bucket_on_every_exchange_path.)"""
    ref, m_ref = _first_step("xla")
    new, m = _first_step(algorithm)
    assert max_rel(new.params, ref.params) <= 1e-5
    assert max_rel(new.opt_state, ref.opt_state) <= 1e-5
    assert max_rel(new.batch_stats, ref.batch_stats) <= 1e-5
    np.testing.assert_array_equal(m[1:], m_ref[1:])
    kinds = [c["kind"] for c in comm.collectives_in_hlo(_built(algorithm)[0].hlo_text())]
    if algorithm == "hierarchical":  # per bucket: within nodes, across nodes, within nodes
        assert kinds.count("reduce-scatter") == kinds.count("all-gather") == 2
    else:
        assert "collective-permute" in kinds


def test_compression_bf16_halves_requested_bytes_and_stays_close():
    """The bf16 compressor requests half the fp32 buckets' gradient bytes (XLA:CPU then runs
    it in f32: the compiled collectives are test_collectives_per_bucket's); its metric
    sums stay exact, its grad_norm and its step within bf16's rounding of the psum step's."""
    ref, m_ref = _first_step("xla")
    new, m = _first_step("bf16")
    plan = _plan()
    ops = lambda s: [o for c in comm.requested_collectives(s.lowered_text) for o in c["operands"]]
    bucket_elems = set(plan.bucket_elements.values())
    ref_bytes = sum(o["bytes"] for o in ops(_built("xla")[0]) if o["elements"] in bucket_elems)
    assert ref_bytes == plan.gradient_bytes + 16  # fp32 buckets (+ 4 metric sums)
    bf16_bytes = sum(o["bytes"] for o in ops(_built("bf16")[0]) if o["dtype"] == "bf16")
    assert bf16_bytes == plan.gradient_elements * 2 == plan.gradient_bytes // 2
    # the step's sums stay exact; grad_norm is the norm of the mean gradient the optimizer
    # gets, here the decompressed one: within bf16's rounding of the psum step's
    np.testing.assert_array_equal(m[:-1], m_ref[:-1])
    assert abs(m[-1] - m_ref[-1]) <= 1e-2 * m_ref[-1]
    assert max_rel(new.params, ref.params) <= 1e-2


def test_compressor_state_is_carried():
    """Step 2 sends top-k of (gradient + step 1's error): the state is read back. Two runs
    from the same first state (the module's step is not donated): one with the error as
    step 1 left it, one with it zeroed; the sent update differs."""
    step, init = _built("topk")
    state, m = step(init, _batch(0))
    one, m = to_host(state), np.asarray(m)
    err = one.comm_state["deep"]["error"]
    assert err.shape[0] == N and np.abs(err).max() > 0  # error feedback, one row per replica
    assert m[METRICS.index("count")] == 32
    two = to_host(step(state, _batch(1))[0])
    again, _ = step(init, _batch(0))  # the same first step again: the same error
    np.testing.assert_array_equal(to_host(again.comm_state)["deep"]["error"], err)
    zeroed = state.replace(comm_state=jax.tree_util.tree_map(
        lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), state.comm_state))
    fresh, _ = step(zeroed, _batch(1))
    assert max_rel(to_host(fresh.params), two.params) > 1e-6
    assert not np.array_equal(two.comm_state["deep"]["error"],
                              to_host(fresh.comm_state)["deep"]["error"])


@pytest.mark.parametrize("path,opt", [("xla", "sgd"), ("xla", "adamw"),
                                      ("shard_optimizer_state", "sgd")])
def test_a_skipped_step_advances_the_learning_rate_schedule(path, opt):
    """A step skipped for a non-finite gradient advances the schedule as it advances the
    step counter (and the step log): the next applied update uses the rate of its own
    step, bitwise the update of the same state with the counter at that step, and moves
    the parameters (the rate of step 0, warmup's 0, would not). Both optimizer paths:
    the replicated one and ZeRO-1's shards."""
    world, model, _ = _setup()
    plan = _plan()
    schedule = lambda t: 0.05 * jnp.asarray(t, jnp.float32)  # lr(0) = 0, as warmup's
    make = lambda mask: optim.make_optimizer(opt, schedule, None if mask is not None else plan,
                                             mask=mask, weight_decay=1e-3)
    ex = exchange.shard_optimizer_state(plan, N, make) if path == "shard_optimizer_state" \
        else exchange.allreduce(make(None), plan, path, LOCAL)
    layout = parallel.data_parallel(model, world, (8, 8, 1), BN)
    state = create_train_state(jax.random.key(0), layout, ex)
    step = aot.compile_step("train", steps.make_train_step(layout, ex, plan), state, _batch(0))
    bad = random_batch(32, seed=40)
    bad["image"][3] = np.nan
    skipped, m = step(state, jax.device_put(bad, world.sharded()))
    assert float(m.to_host().finite) == 0.0 and int(skipped.step) == 1
    after, _ = step(skipped, _batch(1))
    at_one = state.replace(step=jax.device_put(np.int32(1), state.step.sharding))
    reference, _ = step(at_one, _batch(1))
    got, want, start = to_host(after), to_host(reference), to_host(state)
    for a, b in zip(jax.tree_util.tree_leaves((got.params, got.opt_state)),
                    jax.tree_util.tree_leaves((want.params, want.opt_state))):
        np.testing.assert_array_equal(a, b)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(start.params)))
    assert moved > 1e-4
