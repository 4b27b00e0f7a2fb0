"""The train state: what a train step reads and writes, its layout and creation.

:class:`TrainState` is a flax struct (a pytree). :func:`state_specs` gives its
``shard_map`` partition specs: replicated except the per-replica BN statistics
of ``local`` mode and whatever the gradient exchange shards (its optimizer and
comm state, :class:`trjax.exchange.GradientExchange`).
:func:`create_train_state` initialises every replica with its own key, then
broadcasts rank 0's parameters bit for bit.
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trjax import collectives
from trjax.world import DATA_AXIS, World, host_value


@flax.struct.dataclass
class TrainState:
    """Everything a train step reads and writes.

    ``batch_stats`` leaves are ``[C]`` (replicated) in ``sync``/``running``
    BN mode and ``[world_size, C]`` (one row per replica) in ``local`` mode.
    ``skipped_steps`` counts updates skipped for non-finite gradients.
    ``loss_scale`` / ``good_steps``: dynamic loss scaling (fp16; 1.0 and
    unused otherwise). ``opt_state`` / ``comm_state``: the gradient
    exchange's optimizer state and communication state (a compressor's error
    feedback per bucket, one row per replica; ``{}`` without compression).
    """
    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any
    skipped_steps: jax.Array
    loss_scale: jax.Array
    good_steps: jax.Array
    comm_state: Any = None


def state_specs(bn_mode: str, exchange=None) -> TrainState:
    """``shard_map`` partition specs of a :class:`TrainState` (a pytree prefix).

    Args:
      bn_mode: ``local`` keeps one BN statistics row per replica (``P(data)``).
      exchange: the :class:`trjax.exchange.GradientExchange` whose optimizer
        and comm state the specs describe (``None``: replicated optimizer
        state, as for steps that do not touch it).
    """
    opt_specs, comm_specs = (P(), P(DATA_AXIS)) if exchange is None else exchange.specs()
    return TrainState(step=P(), params=P(), opt_state=opt_specs, skipped_steps=P(),
                      loss_scale=P(), good_steps=P(),
                      batch_stats=P(DATA_AXIS) if bn_mode == "local" else P(),
                      comm_state=comm_specs)


def create_train_state(rng: jax.Array, model: nn.Module, exchange, world: World,
                       image_shape: tuple, bn_mode: str, loss_scale: float = 1.0) -> TrainState:
    """Initialises on every replica, then broadcasts rank 0's parameters.

    Each replica runs ``model.init`` with its own key ``fold_in(rng, rank)``
    (as independent DDP processes would);
    :func:`trjax.collectives.broadcast_from_rank0` then gives every replica
    rank 0's bits, and :func:`check_replicas_identical` verifies it.

    Args:
      rng: PRNG key.
      model: the network (its ``axis_name`` is the data axis).
      exchange: the :class:`trjax.exchange.GradientExchange`; its ``init``
        builds the optimizer and comm state.
      world: devices and mesh.
      image_shape: ``(H, W, C)`` of one example.
      bn_mode: ``sync``, ``running`` or ``local``.
      loss_scale: initial loss scale (fp16 dynamic scaling; 1.0 otherwise).

    Returns:
      A :class:`TrainState` laid out as :func:`state_specs` says.

    Raises:
      RuntimeError: a replica's parameters differ from rank 0's after the
        broadcast.
    """
    n = world.world_size
    # rank r initialises with fold_in(rng, r): rank 0's key, hence the broadcast
    # parameters, do not depend on the world size.
    keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(np.arange(n))
    keys = world.put(np.asarray(jax.random.key_data(keys)), world.sharded())

    def init_local(key_data):
        x = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
        variables = model.init(jax.random.wrap_key_data(key_data[0]), x, train=False)
        variables = collectives.broadcast_from_rank0(variables, DATA_AXIS)
        return variables["params"], variables["batch_stats"]

    init = jax.jit(jax.shard_map(init_local, mesh=world.mesh, in_specs=P(DATA_AXIS),
                                 out_specs=(P(), P())))
    params, batch_stats = init(keys)
    if bn_mode == "local":
        batch_stats = jax.tree_util.tree_map(
            lambda x: world.put(np.broadcast_to(host_value(x), (n,) + x.shape), world.sharded()),
            batch_stats)
    opt_state, comm_state = exchange.init(params, world)
    scalar = lambda v, dt: world.put(np.asarray(v, dt))
    state = TrainState(step=scalar(0, np.int32), params=params, batch_stats=batch_stats,
                       opt_state=opt_state, skipped_steps=scalar(0, np.int32),
                       loss_scale=scalar(loss_scale, np.float32), good_steps=scalar(0, np.int32),
                       comm_state=comm_state)
    check_replicas_identical(state.params)
    return state


def check_replicas_identical(tree) -> None:
    """Raises ``RuntimeError`` unless every device's copy of each replicated
    leaf is bitwise equal to device 0's (a host-side check, used at start-up)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        ref = shards[0].tobytes()
        for i, s in enumerate(shards[1:], 1):
            if s.tobytes() != ref:
                raise RuntimeError(f"replica {i} differs from rank 0 at {jax.tree_util.keystr(path)}")
