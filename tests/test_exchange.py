"""The gradient exchanges: accumulation and the sharded optimizer state (ZeRO-1) in the train
step, the strategy a config picks (hierarchical included) and top-k's error feedback.

Bucket policies, the all-reduce algorithms against psum, bf16 compression's bytes and the
compressor state carried over steps run on test_exchange_paths' compiled steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_rel, random_batch, small_config, to_host
from trjax import aot, comm, compression, exchange, models, optim, parallel, steps
from trjax import plan as plan_lib
from trjax.metrics import METRICS
from trjax.objective import StepOptions
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world


def _small_setup(world_spec, bn_mode="running"):
    """ResNet-8 cut to one BasicBlock of 8 channels (test_exchange_paths' model: every layer
    kind, the default "two" buckets, a fraction of the full model's compile time) over
    ``world_spec``, global batch 32; SGD at lr 0.1 with decay, as helpers.setup."""
    world = make_world(world_spec, 32)
    model = models.create_model("resnet8", num_classes=10, stage_sizes=(1,), widths=(8,),
                                stem_width=8, bn_mode=bn_mode, axis_name="data")
    plan = build_plan(model, (8, 8, 1))
    tx = optim.make_optimizer("sgd", 0.1, plan, weight_decay=1e-3)
    return world, model, plan, tx


# The bucket policies, the all-reduce algorithms against psum, bf16's requested bytes and the
# compressor state carried over steps: test_exchange_paths (the module's compiled steps).


def test_hierarchical_allreduce_from_config_groups_by_local_size():
    from trjax.train import prepare
    ex = prepare(small_config(allreduce="hierarchical", allreduce_local_size=2)).exchange
    assert ex.name == "allreduce:hierarchical" and not ex.check_vma
    with pytest.raises(ValueError, match="allreduce_local_size=3 must divide the world size 8"):
        prepare(small_config(allreduce="hierarchical", allreduce_local_size=3))


@pytest.mark.parametrize("overrides,name,vma,keys", [
    ({}, "allreduce:xla", True, {}),
    ({"allreduce": "tree"}, "allreduce:tree", False, {}),
    # one row (error feedback) or shard (ZeRO-1) per replica: the same world size only
    ({"compression": "powersgd"}, "compressed", False, {"world_size": 8}),
    ({"shard_optimizer_state": True}, "shard_optimizer_state", False, {"world_size": 8}),
])
def test_from_config_picks_one_strategy(overrides, name, vma, keys):
    """One constructor per strategy; VMA typing and checkpoint keys come with it."""
    from trjax.train import prepare
    tr = prepare(small_config(**overrides))
    ex = tr.exchange
    assert (ex.name, ex.check_vma, ex.checkpoint_keys(tr.world)) == (name, vma, keys)


@pytest.mark.parametrize("method", ["allgather", "dense"])
def test_topk_error_feedback_conserves_the_gradient(method):
    """Per device, what top-k sends plus what it keeps is its gradient plus the error it
    carried (sent + kept = error + new gradient, exactly: a split of one vector), the
    sent part is the k entries largest in magnitude (numpy), and the all-reduce result is
    the sum of every device's sent part."""
    from jax.sharding import PartitionSpec as P
    world = make_world("all", 8)
    n, ratio = 40, 0.1
    k = compression.topk_k(n, ratio)
    topk = compression.make_compressor("topk", ratio=ratio, method=method)
    rng = np.random.default_rng(3)
    g = rng.normal(size=(8, n)).astype(np.float32)
    e = rng.normal(scale=0.5, size=(8, n)).astype(np.float32)

    def local(g, e):
        reduced, st = topk.allreduce(g[0], {"error": e[0]}, world.axis_name)
        return reduced[None], st["error"][None]

    f = jax.jit(jax.shard_map(local, mesh=world.mesh, in_specs=(P(world.axis_name),) * 2,
                              out_specs=(P(world.axis_name),) * 2, check_vma=False))
    reduced, kept = (np.asarray(a) for a in f(jax.device_put(g, world.sharded()),
                                              jax.device_put(e, world.sharded())))
    acc = g + e
    sent = acc - kept
    np.testing.assert_array_equal(sent + kept, acc)  # nothing lost, nothing made up
    for i in range(8):
        top = np.argsort(-np.abs(acc[i]), kind="stable")[:k]
        expect = np.zeros(n, np.float32)
        expect[top] = acc[i, top]
        np.testing.assert_array_equal(sent[i], expect)
        np.testing.assert_array_equal(kept[i][top], 0.0)
    for i in range(8):  # every device holds the same sum of the sent parts
        np.testing.assert_allclose(reduced[i], sent.sum(axis=0), rtol=1e-6, atol=1e-6)


def test_accumulation_equals_twice_the_replicas():
    """k=2 micro-batches on 4 devices == one plain step on 8 devices (running BN)."""
    batch = random_batch(32, seed=11)
    out = {}
    for spec, k in (("8", 1), ("4", 2)):
        world, model, plan, tx = _small_setup(spec)
        layout = parallel.data_parallel(model, world, (8, 8, 1), "running")
        state = create_train_state(jax.random.key(0), layout, exchange.allreduce(tx, plan))
        step = aot.compile_step("train", steps.make_train_step(
            layout, exchange.allreduce(tx, plan), plan,
            StepOptions(grad_accumulation_steps=k)),
            state, jax.device_put(batch, world.sharded()), donate_argnums=0)
        new, m = step(state, jax.device_put(batch, world.sharded()))
        out[k] = (to_host(new), np.asarray(m), comm.collectives_in_hlo(step.hlo_text()))
    assert max_rel(out[2][0].params, out[1][0].params) <= 1e-5
    assert max_rel(out[2][0].batch_stats, out[1][0].batch_stats) <= 1e-5
    np.testing.assert_allclose(out[2][1], out[1][1], rtol=1e-5)
    assert len(out[2][2]) == len(out[1][2]) == 3  # one all-reduce per bucket (+ BN stats)


def test_shard_optimizer_state_equals_replicated_optimizer_and_shards_it():
    """ZeRO-1 (reduce-scatter, the update on each device's shard of the momentum, all-gather)
    lands where the replicated optimizer does, three steps carrying momentum. The learning
    rate is 0 for the first two steps: the parameters stay put, so the momentum sums three
    gradients of the same parameters and the third step's update is within one step's
    rounding (a reordered sum), not amplified by the training dynamics as three moving
    steps would be (issue 36)."""
    batch = random_batch(32, seed=12)
    world, model, plan, _ = _small_setup("all")
    lr, wd = 0.1, 1e-3
    schedule = lambda count: jnp.where(count < 2, 0.0, lr)
    results = {}
    for sharded in (False, True):
        make_tx = lambda mask: optim.make_optimizer("sgd", schedule, plan, mask=mask,
                                                    weight_decay=wd, momentum=0.9)
        ex = exchange.shard_optimizer_state(plan, world.world_size, make_tx) if sharded else \
            exchange.allreduce(make_tx(None), plan)
        layout = parallel.data_parallel(model, world, (8, 8, 1), "running")
        st = create_train_state(jax.random.key(0), layout, ex)
        step = aot.compile_step("train", steps.make_train_step(layout, ex, plan),
                                st, jax.device_put(batch, world.sharded()), donate_argnums=0)
        start = to_host(st.params)
        for i in range(3):  # momentum history matters
            st, m = step(st, jax.device_put(random_batch(32, seed=20 + i), world.sharded()))
        results[sharded] = (to_host(st.params), np.asarray(m), step)
        if sharded:  # issue 40: the optimizer sees gradient elements only; the metric
            # sums' slot and the padding of each bucket keep a momentum of exactly 0
            layout = plan_lib.shard_layout(plan, world.world_size)
            momenta = [(path[-1].key, np.asarray(leaf)) for path, leaf in
                       jax.tree_util.tree_flatten_with_path(st.opt_state)[0]
                       if isinstance(path[-1], jax.tree_util.DictKey)
                       and path[-1].key in layout and np.ndim(leaf) == 1]
            assert sorted(b for b, _ in momenta) == sorted(layout)
            mb, mo = plan.metrics_slot
            for b, mom in momenta:
                not_grad = np.ones(layout[b][0], bool)
                for slot in plan.slots:
                    if slot.bucket == b:
                        not_grad[slot.offset:slot.offset + slot.size] = False
                assert not_grad[plan.bucket_elements[b]:].all()  # the padding
                assert not_grad.sum() == layout[b][0] - plan.bucket_elements[b] + \
                    (len(METRICS) if b == mb else 0)  # and the metric sums
                assert np.all(mom[not_grad] == 0), (b, mom[not_grad])
                assert np.any(mom[~not_grad] != 0)
    assert max_rel(results[True][0], start) > 1e-4  # the third step moved them
    assert max_rel(results[True][0], results[False][0]) <= 1e-5
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-5)
    kinds = [c["kind"] for c in comm.collectives_in_hlo(results[True][2].hlo_text())]
    assert kinds.count("reduce-scatter") == 2 and "all-gather" in kinds
    # the optimizer state per device is ~1/8: argument bytes shrink by ~7/8 of the momentum
    mem = {z: results[z][2].memory()["argument"] for z in (False, True)}
    momentum_bytes = plan.gradient_bytes
    assert mem[False] - mem[True] >= 0.8 * momentum_bytes * 7 / 8
