"""Seed details: metrics in the deep bucket, folded BN eval, fused 1/N, one eval reduction."""
import functools
import re

import jax
import numpy as np
import optax

from helpers import IMAGE_SHAPE, put_like, random_batch, setup, to_host
from trjax import aot, comm, exchange, models, parallel, steps


@functools.lru_cache(maxsize=None)
def _compiled(bn_mode, world_spec="all", n=32):
    """helpers.setup's state and its donating train step, compiled once for the module (the
    start state is never handed to the step: each test runs a fresh copy)."""
    world, model, plan, tx, state = setup(world_spec, n, bn_mode)
    batch = random_batch(n, seed=7)
    step = aot.compile_step("train", steps.make_train_step(
        parallel.data_parallel(model, world, IMAGE_SHAPE, bn_mode),
        exchange.allreduce(tx, plan), plan),
        state, jax.device_put(batch, world.sharded()), donate_argnums=0)
    return world, model, plan, to_host(state), state, batch, step


def _compiled_train(bn_mode="sync", world_spec="all", n=32):
    world, model, plan, host0, like, batch, step = _compiled(bn_mode, world_spec, n)
    return world, model, plan, put_like(host0, like), batch, step


def test_packed_metrics_equal_host_metrics():
    world, model, plan, state, batch, step = _compiled_train("sync")
    s0 = to_host(state)
    _, m = step(state, jax.device_put(batch, world.sharded()))
    ref = models.create_model("resnet8", num_classes=10, bn_mode="local", axis_name=None)
    logits, _ = jax.jit(lambda v, x: ref.apply(v, x, train=True, mutable=["batch_stats"]))(
        {"params": s0.params, "batch_stats": s0.batch_stats}, batch["image"])  # one program
    logits = np.asarray(logits, np.float64)
    y = batch["label"]
    losses = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    order = np.argsort(-logits, axis=1)
    top1 = np.sum(order[:, 0] == y)
    top5 = np.sum([y[i] in order[i, :5] for i in range(len(y))])
    m = np.asarray(m)
    np.testing.assert_allclose(m[0], losses.sum(), rtol=1e-5)
    assert (m[1], m[2], m[3]) == (top1, top5, 32)


def test_no_standalone_bucket_scale_after_the_all_reduce():
    world, model, plan, state, batch, step = _compiled_train("running")
    text = step.hlo_text()
    cols = comm.collectives_in_hlo(text)
    entry = comm.entry_lines(text)
    for bucket, size in plan.bucket_elements.items():
        ar = [c for c in cols if c["elements"] == size]
        assert len(ar) == 1, bucket
        # every instruction after the all-reduce that produces a whole bucket-sized
        # array would be a separate pass over the bucket (e.g. the x 1/N scale)
        after = [l for l in entry[ar[0]["position"] + 1:] if re.search(rf"= f32\[{size}\]", l)]
        assert after == [], (bucket, after[:2])


def test_folded_bn_eval_equals_unfolded():
    world, model, plan, state, batch, step = _compiled_train("running")
    for seed in range(3):  # move the running statistics away from (0, 1)
        state, _ = step(state, jax.device_put(random_batch(32, seed=seed), world.sharded()))
    acc0 = np.zeros((8, 4), np.float32)
    layout = parallel.data_parallel(model, world, IMAGE_SHAPE, "running")
    folded = jax.jit(steps.make_fold_bn(layout))(state)
    ev_f = jax.jit(steps.make_eval_step(layout, folded=True))
    ev_u = jax.jit(steps.make_eval_step(layout, folded=False))
    b = jax.device_put(random_batch(64, seed=9), world.sharded())
    a_f = np.asarray(ev_f(state.params, folded, b, jax.device_put(acc0, world.sharded())))
    a_u = np.asarray(ev_u(state.params, state.batch_stats, b, jax.device_put(acc0, world.sharded())))
    np.testing.assert_allclose(a_f[:, 0], a_u[:, 0], rtol=1e-5)
    np.testing.assert_array_equal(a_f[:, 3], a_u[:, 3])
    assert abs(a_f[:, 1].sum() - a_u[:, 1].sum()) <= 1  # an exact tie could flip one prediction
    # and the folded eval's compiled HLO has no rsqrt (nothing left to fold per batch)
    txt = ev_f.lower(state.params, folded, b, jax.device_put(acc0, world.sharded())).compile().as_text()
    assert "rsqrt" not in txt
    assert "rsqrt" in ev_u.lower(state.params, state.batch_stats, b,
                                 jax.device_put(acc0, world.sharded())).compile().as_text()


def test_eval_pass_has_one_all_reduce():
    from trjax.world import make_world
    w = make_world("all", 8)
    red = aot.compile_step("eval_reduce", steps.make_eval_reduce(w),
                             jax.ShapeDtypeStruct((8, 4), np.float32, sharding=w.sharded()))
    cols = comm.collectives_in_hlo(red.hlo_text())
    assert [(c["kind"], c["elements"]) for c in cols] == [("all-reduce", 4)]
