"""Shared test helpers: a small model, a world, a random batch, a short config."""
import os
import sys

import jax
import numpy as np
import optax

from trjax import exchange, models, optim
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
import default as default_config  # noqa: E402

IMAGE_SHAPE = (8, 8, 1)


def small_config(**overrides):
    """The default config with ResNet-8 and 2 epochs, then ``overrides``."""
    c = default_config.get_config()
    c.model = "resnet8"
    c.num_epochs = 2
    for k, v in overrides.items():
        c[k] = v
    return c


def setup(world_spec="all", global_batch=32, bn_mode="sync", lr=0.1, opt="sgd", model_name="resnet8"):
    world = make_world(world_spec, global_batch)
    model = models.create_model(model_name, num_classes=10, bn_mode=bn_mode, axis_name="data")
    plan = build_plan(model, IMAGE_SHAPE)
    tx = optim.make_optimizer(opt, lr, plan, weight_decay=1e-3)
    state = create_train_state(jax.random.key(0), model, exchange.allreduce(tx, plan), world,
                               IMAGE_SHAPE, bn_mode)
    return world, model, plan, tx, state


def random_batch(n, seed=0, num_classes=10):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n,) + IMAGE_SHAPE).astype(np.float32),
            "label": rng.integers(0, num_classes, n).astype(np.int32),
            "mask": np.ones(n, np.float32)}


def to_host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def max_rel(a, b):
    """Max over leaves of max|a-b| / max(max|b|, 1e-6)."""
    out = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-6)))
    return out


def reference_step(model_name, params, batch_stats, opt_state, tx, batch, bn_momentum=0.9):
    """One plain single-device step on the whole batch (no shard_map, no buckets)."""
    model = models.create_model(model_name, num_classes=10, bn_mode="local", axis_name=None,
                                bn_momentum=bn_momentum)

    def loss_fn(p):
        logits, new_vars = model.apply({"params": p, "batch_stats": batch_stats}, batch["image"],
                                       train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, new_vars["batch_stats"]

    (loss, new_bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_bs, opt_state, loss, grads
