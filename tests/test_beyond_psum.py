"""Bucket policies, all-reduce algorithms and compression inside the train step."""
import jax
import numpy as np
import pytest

from helpers import max_rel, random_batch, setup, to_host
from trjax import comm, compression, steps


def _one_step(policy="two", allreduce="xla", compressor=None, bn_mode="running"):
    world, model, plan, tx, state = setup("all", 32, bn_mode)
    if policy != "two" or compressor is not None:
        plan = steps.build_plan(model, (8, 8, 1), policy)
        state = steps.create_train_state(jax.random.key(0), model, tx, world, (8, 8, 1), bn_mode,
                                         plan=plan, compressor=compressor)
    batch = jax.device_put(random_batch(32, seed=5), world.sharded())
    step = steps.compile_step("train", steps.make_train_step(
        model, tx, plan, world, bn_mode, allreduce=allreduce, compressor=compressor),
        state, batch, donate_argnums=0)
    new, m = step(state, batch)
    return plan, step, to_host(new), np.asarray(m)


@pytest.fixture(scope="module")
def reference():
    return _one_step()


@pytest.mark.parametrize("policy", ["tail_minimal", "size:0.05"])  # per_leaf: test_regions_plan
def test_bucket_policies_give_the_same_step(reference, policy):
    plan, step, new, m = _one_step(policy)
    assert max_rel(new.params, reference[2].params) <= 1e-6
    np.testing.assert_array_equal(m[1:], reference[3][1:])
    cols = comm.collectives_in_hlo(step.hlo_text())
    sizes = {c["elements"] for c in cols}
    if policy != "per_leaf":  # chained buckets stay one all-reduce each, in plan order
        bucket_cols = [c for c in cols if c["elements"] in set(plan.bucket_sizes.values())]
        assert [c["elements"] for c in bucket_cols] == list(plan.bucket_sizes.values())
    assert sizes


@pytest.mark.parametrize("algorithm", ["ring"])  # every algorithm vs psum: test_allreduce
def test_allreduce_algorithms_in_the_step_equal_psum(reference, algorithm):
    plan, step, new, m = _one_step(allreduce=algorithm)
    assert max_rel(new.params, reference[2].params) <= 1e-5
    assert max_rel(new.batch_stats, reference[2].batch_stats) <= 1e-5
    kinds = {c["kind"] for c in comm.collectives_in_hlo(step.hlo_text())}
    assert "collective-permute" in kinds


def test_compression_bf16_halves_requested_bytes_and_stays_close(reference):
    plan, step, new, m = _one_step(compressor=compression.make_compressor("bf16"))
    ref_plan, ref_step, _, _ = reference
    ops = lambda s: [o for c in comm.requested_collectives(s.lowered_text) for o in c["operands"]]
    bucket_elems = set(ref_plan.bucket_sizes.values())
    ref_bytes = sum(o["bytes"] for o in ops(ref_step) if o["elements"] in bucket_elems)
    assert ref_bytes == ref_plan.gradient_bytes + 16  # fp32 buckets (+ 4 metric sums)
    bf16_bytes = sum(o["bytes"] for o in ops(step) if o["dtype"] == "bf16")
    assert bf16_bytes == plan.gradient_elements * 2 == ref_plan.gradient_bytes // 2
    np.testing.assert_array_equal(m, reference[3])  # metrics stay exact
    assert max_rel(new.params, reference[2].params) <= 1e-2


def test_compressor_state_is_carried():
    plan, step, new, m = _one_step(compressor=compression.make_compressor("topk", ratio=0.05))
    err = new.comm_state["deep"]["error"]
    assert err.shape[0] == 8 and np.abs(err).max() > 0  # error feedback, one row per replica
    assert m[3] == 32


def test_accumulation_equals_twice_the_replicas():
    """k=2 micro-batches on 4 devices == one plain step on 8 devices (running BN)."""
    batch = random_batch(32, seed=11)
    out = {}
    for spec, k in (("8", 1), ("4", 2)):
        world, model, plan, tx, state = setup(spec, 32, "running")
        step = steps.compile_step("train", steps.make_train_step(
            model, tx, plan, world, "running", accumulation_steps=k),
            state, jax.device_put(batch, world.sharded()), donate_argnums=0)
        new, m = step(state, jax.device_put(batch, world.sharded()))
        out[k] = (to_host(new), np.asarray(m), comm.collectives_in_hlo(step.hlo_text()))
    assert max_rel(out[2][0].params, out[1][0].params) <= 1e-5
    assert max_rel(out[2][0].batch_stats, out[1][0].batch_stats) <= 1e-5
    np.testing.assert_allclose(out[2][1], out[1][1], rtol=1e-5)
    assert len(out[2][2]) == len(out[1][2]) == 3  # one all-reduce per bucket (+ BN stats)


def test_zero1_equals_replicated_optimizer_and_shards_its_state():
    import optax
    from trjax import optim
    batch = random_batch(32, seed=12)
    world, model, plan, _, state = setup("all", 32, "running")
    lr, wd = 0.1, 1e-3
    results = {}
    for zero1 in (False, True):
        tx = optax.sgd(lr, momentum=0.9) if zero1 else optim.make_optimizer(
            "sgd", lr, plan, weight_decay=wd, momentum=0.9)
        st = steps.create_train_state(jax.random.key(0), model, tx, world, (8, 8, 1), "running",
                                      plan=plan, zero1=zero1)
        step = steps.compile_step("train", steps.make_train_step(
            model, tx, plan, world, "running", zero1=zero1, weight_decay=wd),
            st, jax.device_put(batch, world.sharded()), donate_argnums=0)
        for i in range(3):  # momentum history matters
            st, m = step(st, jax.device_put(random_batch(32, seed=20 + i), world.sharded()))
        results[zero1] = (to_host(st.params), np.asarray(m), step)
    assert max_rel(results[True][0], results[False][0]) <= 1e-5
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-5)
    kinds = [c["kind"] for c in comm.collectives_in_hlo(results[True][2].hlo_text())]
    assert kinds.count("reduce-scatter") == 2 and "all-gather" in kinds
    # the optimizer state per device is ~1/8: argument bytes shrink by ~7/8 of the momentum
    mem = {z: results[z][2].memory()["argument"] for z in (False, True)}
    momentum_bytes = plan.gradient_bytes
    assert mem[False] - mem[True] >= 0.8 * momentum_bytes * 7 / 8
