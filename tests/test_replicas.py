"""Every replica's copy of the replicated state stays bitwise identical, on every exchange path.

``shard_map``'s replication check (``check_vma``) types only the ``lax.psum``
path; the ppermute all-reduces, the compressors and ZeRO-1 run with it off, so
a per-device divergence (a missing broadcast, a per-device non-finite
decision, an un-reduced running statistic, an all-reduce whose ranks round
differently) would compile and run there. Tests that read device 0 cannot see
it; this one reads every device's shard.

Three steps per path on 8 devices: a normal step, a step with an inf pixel in
one real row of replica 3 (every replica must skip it), a normal step. The
exchange paths run test_exchange_paths' compiled steps (the module is imported:
one compile per path for both files when they run in one session; its steps
are not donated), local BN and the dynamic loss scale on: local BN keeps
per-device statistics, so a per-device non-finite decision in the exchange is
not rescued by the running-statistics check (which is global), and the loss
scale and its good-step count are replicated state too. The running-statistics
all-reduce is checked on the plain all-reduce, sync BN and accumulation, which
compile their own steps here (running BN, from the config).
Checked by planting, one at a time: the ring's all-gather phase one step short
(params differ), the running-statistics all-reduce removed (batch_stats
differ), the exchange's non-finite decision taken on the local buffers
(replicas disagree on the skip); each fails here.
"""
import jax
import numpy as np
import pytest

from helpers import IMAGE_SHAPE, random_batch, small_config
from trjax import exchange, models, optim, parallel, steps
from trjax.objective import StepOptions
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world

GLOBAL_BATCH = 32  # local batch 4 on 8 devices

# compiled here, from the config: the BatchNorm modes and accumulation
CONFIG_PATHS = {
    "xla": {},
    # sync BN: no running-statistics check, so only the gradient's non-finite check skips
    # the inf step (planted: that check removed -> finite [1, 1, 1], caught here)
    "sync_bn": {"bn_mode": "sync"},
    "accumulation": {"grad_accumulation_steps": 2},
}
# test_exchange_paths' steps (local BN, dynamic loss scale): every other exchange path. Its
# powersgd is the former "powersgd_local_bn" case (local BN); zero1 its shard_optimizer_state
EXCHANGE_PATHS = {"ring": "ring", "halving_doubling": "halving_doubling", "tree": "tree",
                  "hierarchical": "hierarchical", "bf16": "bf16", "fp16": "fp16",
                  "powersgd": "powersgd", "topk": "topk", "zero1": "shard_optimizer_state"}


def _batches():
    out = [random_batch(GLOBAL_BATCH, seed=s) for s in range(3)]
    out[1]["image"][13, 2, 3, 0] = np.inf  # row 13: replica 3 (local batch 4)
    return out


def replica_mismatches(tree) -> list[str]:
    """Paths of fully replicated leaves whose per-device copies are not bitwise equal."""
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not leaf.sharding.is_fully_replicated:
            continue
        copies = {np.asarray(s.data).tobytes() for s in leaf.addressable_shards}
        if len(copies) != 1:
            bad.append(jax.tree_util.keystr(path))
    return bad


def _config_step(path):
    """``(step, state, world, bn_mode, shard_optimizer_state)`` of a CONFIG_PATHS case."""
    overrides = dict(global_batch_size=GLOBAL_BATCH, eval_batch_size=GLOBAL_BATCH,
                     bn_mode="running", warmup_epochs=0, learning_rate=0.1)
    overrides.update(CONFIG_PATHS[path])
    cfg = small_config(**overrides)
    world = make_world("all", GLOBAL_BATCH)
    assert world.world_size == 8
    # one BasicBlock of 8 channels: every layer kind, a fraction of ResNet-8's compile time
    model = models.create_model("resnet8", stage_sizes=(1,), widths=(8,), stem_width=8,
                                bn_mode=cfg.bn_mode, axis_name=world.axis_name)
    plan = build_plan(model, IMAGE_SHAPE, cfg.buckets, "HWIO")
    ex = exchange.from_config(cfg, plan, optim.learning_rate_schedule(0.1, 0, 10), world)
    layout = parallel.data_parallel(model, world, IMAGE_SHAPE, cfg.bn_mode)
    state = create_train_state(jax.random.key(0), layout, ex)
    step = jax.jit(steps.make_train_step(
        layout, ex, plan, StepOptions(grad_accumulation_steps=cfg.grad_accumulation_steps)))
    return step, state, world, cfg.bn_mode, cfg.shard_optimizer_state


def _exchange_path_step(path):
    import test_exchange_paths as paths  # the module pytest collects: its compiled steps
    step, state = paths._built(EXCHANGE_PATHS[path])
    world = paths._setup()[0]
    assert world.world_size == 8 and GLOBAL_BATCH == 32  # its global batch
    return step, state, world, paths.BN, path == "zero1"


@pytest.mark.parametrize("path", list(CONFIG_PATHS) + list(EXCHANGE_PATHS))
def test_replicated_state_is_bitwise_identical_on_every_device(path):
    step, state, world, bn_mode, sharded_opt = (
        _config_step(path) if path in CONFIG_PATHS else _exchange_path_step(path))
    finite = []
    for batch in _batches():
        state, m = step(state, jax.device_put(batch, world.sharded()))  # inf: past to_device's check
        finite.append(float(np.asarray(m.finite)))
    assert finite == [1.0, 0.0, 1.0]
    assert int(np.asarray(state.skipped_steps)) == 1 and int(np.asarray(state.step)) == 3
    # what must be replicated is: params, BN statistics (but local BN), the optimizer state
    # (ZeRO-1: its scalars; the moment shards are per device by design)
    for leaf in jax.tree_util.tree_leaves((state.params, state.step, state.skipped_steps)):
        assert leaf.sharding.is_fully_replicated
    if bn_mode != "local":
        assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(state.batch_stats))
    if not sharded_opt:
        assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(state.opt_state))
    else:  # the all-gathered view of the sharded state: one global array per leaf, finite
        for x in jax.tree_util.tree_leaves(state.opt_state):
            assert np.all(np.isfinite(np.asarray(x)))
    for name in ("params", "batch_stats", "opt_state", "loss_scale", "good_steps"):
        assert replica_mismatches(getattr(state, name)) == [], name
    # and the step did train (not a frozen state that is trivially identical)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(state.params))
