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


@pytest.mark.parametrize("policy", ["tail_minimal", "size:0.05", "per_leaf"])
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


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
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


def test_powersgd_state_is_carried():
    plan, step, new, m = _one_step(compressor=compression.make_compressor("powersgd", rank=2))
    err = new.comm_state["deep"]["error"]
    assert err.shape[0] == 8 and np.abs(err).max() > 0  # error feedback, one row per replica
    assert m[3] == 32
