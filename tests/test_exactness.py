"""Same numbers whatever the device count; non-finite steps skipped; LARS; donation."""
import functools

import jax
import numpy as np
import optax
import pytest

from helpers import (IMAGE_SHAPE, assert_each_step_within_reorder_rounding, max_rel, put_like,
                     random_batch, setup, skip_train_step_compile, small_config, to_host,
                     trainer_batch, trainer_states)
from trjax.data import input_pipeline as ip
from trjax import aot, exchange, optim, parallel, steps
from trjax.precision import update_loss_scale
from trjax.train import evaluate_pass, setup as setup_trainer, train_and_evaluate


def _digits_subset(n_train, n_val):
    d = ip.load_digits()
    return ip.Dataset(ip.Split(d.train.images[:n_train], d.train.labels[:n_train]),
                      ip.Split(d.val.images[:n_val], d.val.labels[:n_val]), 10, "digits-subset",
                      mean=d.mean, std=d.std)


def test_ten_examples_batch_four_exact_for_world_sizes_1_2_4(monkeypatch):
    skip_train_step_compile(monkeypatch)  # evaluation only
    data = _digits_subset(8, 10)
    fractions = {}
    for n in (1, 2, 4):
        tr = setup_trainer(small_config(devices=str(n), global_batch_size=4, eval_batch_size=4),
                           data)
        r = evaluate_pass(tr, tr.state)
        assert r["count"] == 10  # 3 batches, the last padded with 2 masked rows
        # against a host computation over the 10 real examples
        from trjax import models
        m = models.create_model("resnet8", num_classes=10, bn_mode="running", axis_name=None)
        logits = jax.jit(lambda v, x: m.apply(  # one program, not op by op
            v, models.normalize(x, data.mean, data.std), train=False))(
            {"params": to_host(tr.state.params), "batch_stats": to_host(tr.state.batch_stats)},
            data.val.images)
        assert r["top1"] == np.mean(np.argmax(np.asarray(logits), 1) == data.val.labels)
        fractions[n] = r["sums"]
    assert fractions[1][1:] == fractions[2][1:] == fractions[4][1:]
    np.testing.assert_allclose(fractions[2][0], fractions[1][0], rtol=1e-6)
    np.testing.assert_allclose(fractions[4][0], fractions[1][0], rtol=1e-6)


def test_one_epoch_1000_examples_batch_96_same_on_1_and_8_devices():
    """The 11 steps of one epoch (the last batch padded: 40 real rows, 4 of 8 devices
    empty) on 1 and on 8 devices: each step of the 8-device train step, from the 1-device
    run's state before it, lands within the fp32 rounding of sums taken in another order
    (helpers.assert_each_step_within_reorder_rounding: 2·(B-1)·u of each leaf's movement
    plus 2·u of its size, B = 96 rows x 64 positions); the metrics' counts are equal. The batches are
    the loop's (trjax.data.input_pipeline.iterate_batches, epoch 1). A real bug is far
    outside the bound, planted once each (measured with the former 11-step comparison):
    the 8-device run's BN on local statistics (bn_mode running) at 5.1e3 x the bound; the
    mean over the local instead of the global count (gradient x 8 on 8 devices) at 4.2e4 x.
    """
    data = _digits_subset(1000, 40)  # 1000 = 10 x 96 + 40: last batch padded, 4 devices empty
    tr = {}
    for n in ("1", "8"):
        cfg = small_config(devices=n, global_batch_size=96, eval_batch_size=40, num_epochs=1,
                           bn_mode="sync", learning_rate=0.05)
        tr[n] = setup_trainer(cfg, data)
    assert tr["1"].steps_per_epoch == 11
    batches = list(ip.iterate_batches(data.train, 96, shuffle=True, seed=cfg.seed, epoch=1,
                                      remainder=cfg.train_remainder))
    assert len(batches) == 11 and batches[-1]["mask"].sum() == 40
    for a, b in zip(jax.tree_util.tree_leaves(to_host(tr["8"].state)),
                    jax.tree_util.tree_leaves(to_host(tr["1"].state))):
        np.testing.assert_array_equal(a, b)  # the common start: rank 0's initialisation
    ref, ref_m = trainer_states(tr["1"], batches)
    worst, got_m = assert_each_step_within_reorder_rounding(
        ref, lambda s, b: tr["8"].train_step(s, trainer_batch(tr["8"], b)), tr["8"].state,
        batches, 96 * 64, tree=lambda s: (s.params, s.batch_stats))
    for a, b in zip(got_m, ref_m):
        assert np.asarray(a.count).sum() == np.asarray(b.count).sum()
    print(f"worst leaf / bound: {worst:.3g}")


@functools.lru_cache(maxsize=None)
def _running_step():
    """``(world, host start state, start state, step)``: helpers.setup's running-BN state on
    8 devices and its donating train step, compiled once for the module; the start state is
    never handed to the step (each test runs a fresh copy, helpers.put_like)."""
    world, model, plan, tx, state = setup("all", 32, "running")
    step = aot.compile_step("train", steps.make_train_step(
        parallel.data_parallel(model, world, IMAGE_SHAPE, "running"),
        exchange.allreduce(tx, plan), plan),
        state, jax.device_put(random_batch(32), world.sharded()),
        donate_argnums=0)
    return world, to_host(state), state, step


def test_inf_on_one_replica_skips_the_step_everywhere():
    # running mode also checks the all-reduced BN statistics, which the inf makes non-finite
    # too; sync mode has only the gradient check: test_replicas' "sync_bn" case covers it
    world, host0, like, step = _running_step()
    state = put_like(host0, like)
    state, m = step(state, jax.device_put(random_batch(32, seed=1), world.sharded()))
    assert np.asarray(m)[4] == 1.0
    before = to_host(state)
    bad = random_batch(32, seed=2)
    bad["image"][13, 2, 3, 0] = np.inf  # row 13 lives on replica 3 (local batch 4)
    state, m = step(state, jax.device_put(bad, world.sharded()))
    assert np.asarray(m)[4] == 0.0
    after = to_host(state)
    for name in ("params", "batch_stats", "opt_state"):
        for a, b in zip(jax.tree_util.tree_leaves(getattr(before, name)),
                        jax.tree_util.tree_leaves(getattr(after, name))):
            assert a.tobytes() == b.tobytes()
    for leaf in jax.tree_util.tree_leaves(state.params):  # every replica identical
        assert len({np.asarray(s.data).tobytes() for s in leaf.addressable_shards}) == 1
    assert int(after.skipped_steps) == 1 and int(after.step) == 2
    state, m = step(state, jax.device_put(random_batch(32, seed=3), world.sharded()))
    assert np.asarray(m)[4] == 1.0 and max_rel(to_host(state.params), after.params) > 0
    assert int(np.asarray(state.skipped_steps)) == 1


@pytest.mark.job
def test_halt_on_nonfinite_stops_with_a_clear_error(tmp_path):
    cfg = small_config(learning_rate=1e30, warmup_epochs=0, halt_on_nonfinite=True)
    with pytest.raises(FloatingPointError, match=r"step \d+: non-finite gradient"):
        train_and_evaluate(cfg, str(tmp_path))


def test_lars_bn_scale_stays_one_and_kernel_gets_trust_ratio_update():
    world, model, plan, _, state = setup("1", 4, "sync")
    lr, wd, tc = 0.1, 1e-3, 0.001
    tx = optim.make_optimizer("lars", lr, plan, weight_decay=wd, trust_coefficient=tc,
                              momentum=0.9)
    params = to_host(state.params)
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    grads["stem_bn"]["scale"] = np.zeros_like(grads["stem_bn"]["scale"])
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # one program
    new = optax.apply_updates(params, updates)
    assert np.all(np.asarray(new["stem_bn"]["scale"]) == 1.0)
    # BN bias: plain SGD, no decay, no trust ratio
    np.testing.assert_allclose(new["stem_bn"]["bias"], params["stem_bn"]["bias"]
                               - lr * grads["stem_bn"]["bias"], rtol=1e-6)
    w = params["stage2_block1"]["Conv_0"]["kernel"].astype(np.float64)
    g = grads["stage2_block1"]["Conv_0"]["kernel"].astype(np.float64) + wd * w
    trust = tc * np.linalg.norm(w) / np.linalg.norm(g)
    np.testing.assert_allclose(new["stage2_block1"]["Conv_0"]["kernel"], w - lr * trust * g,
                               rtol=1e-5, atol=1e-8)


def test_dynamic_loss_scale():
    s, g = update_loss_scale(np.float32(1024), np.int32(0), np.bool_(False), 3)
    assert (float(s), int(g)) == (512.0, 0)
    s, g = update_loss_scale(np.float32(1024), np.int32(1), np.bool_(True), 3)
    assert (float(s), int(g)) == (1024.0, 2)
    s, g = update_loss_scale(np.float32(1024), np.int32(2), np.bool_(True), 3)
    assert (float(s), int(g)) == (2048.0, 0)
    s, g = update_loss_scale(np.float32(1), np.int32(2), np.bool_(False), 3)
    assert float(s) == 1.0


def test_donation_aliases_and_reuse():
    world, host0, like, step = _running_step()  # the module's donating step
    state = put_like(host0, like)
    batch = jax.device_put(random_batch(32), world.sharded())
    # the same array twice in the donated state: de-aliased, not corrupted
    aliased = state.replace(good_steps=state.skipped_steps)
    new, _ = step(aliased, batch)
    assert int(np.asarray(new.step)) == 1
    assert int(np.asarray(new.good_steps)) == 0 and int(np.asarray(new.skipped_steps)) == 0
    with pytest.raises(RuntimeError, match=r"argument \[0\]\.\w+ was donated to an earlier call"):
        step(aliased, batch)
