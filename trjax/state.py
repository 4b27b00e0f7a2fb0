"""The train state: what a train step reads and writes, its layout and creation.

:class:`TrainState` is a flax struct (a pytree). :func:`state_specs` gives its
``shard_map`` partition specs from a :class:`trjax.parallel.Layout` (the
parameters, the BN statistics with their per-replica rows in ``local`` mode, the
optimizer state where the parameters are split) and the gradient exchange
(its optimizer and comm state, :class:`trjax.exchange.GradientExchange`).
:func:`create_train_state` initialises every replica with its own key, then
broadcasts rank 0's parameters bit for bit, all in one compiled program.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trjax import collectives
from trjax.cpu.compile_options import compile_lowered, init_options


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


def state_specs(layout, exchange=None) -> TrainState:
    """``shard_map`` partition specs of a :class:`TrainState` (a pytree prefix).

    Args:
      layout: a :class:`trjax.parallel.Layout`: the parameters', BN
        statistics' (one row per replica in ``local`` mode) and, where the
        parameters are split, the optimizer state's specs.
      exchange: the :class:`trjax.exchange.GradientExchange` whose optimizer
        and comm state the specs describe (``None``: replicated optimizer
        state, as for steps that do not touch it).
    """
    opt_specs, comm_specs = (P(), P(layout.data_axis)) if exchange is None else \
        exchange.specs(layout.data_axis)
    if layout.opt_state is not None:
        opt_specs = layout.opt_state
    return TrainState(step=P(), params=layout.params, opt_state=opt_specs, skipped_steps=P(),
                      loss_scale=P(), good_steps=P(), batch_stats=layout.batch_stats,
                      comm_state=comm_specs)


class TrainStateProgram(NamedTuple):
    """The state-initialisation program of :func:`train_state_program`, traced,
    not yet compiled or run.

    Attributes:
      abstract: the :class:`TrainState` it returns, as ``jax.ShapeDtypeStruct``
        leaves with shardings (what the steps compile against).
      finish: ``() -> TrainState``: compiles the program, runs it and checks
        the rank-0 broadcast
        (:func:`check_replicas_identical`). Safe to call on another thread
        while the steps compile (XLA's compile releases the GIL).
    """
    abstract: Any
    finish: Callable[[], TrainState]


def create_train_state(rng, layout, exchange, loss_scale: float = 1.0) -> TrainState:
    """The whole train state from one compiled program:
    ``train_state_program(...).finish()`` (same arguments)."""
    return train_state_program(rng, layout, exchange, loss_scale).finish()


def train_state_program(rng, layout, exchange, loss_scale: float = 1.0) -> TrainStateProgram:
    """The program that makes the whole train state, laid out as
    :func:`state_specs` says; :attr:`TrainStateProgram.finish` compiles and runs it.

    One program (a ``jax.jit`` around a ``shard_map``) does all of it: the PRNG
    key from the seed; on each data replica ``model.init`` with its own key
    ``fold_in(key, rank)`` (as independent DDP processes would);
    :func:`trjax.collectives.broadcast_from_rank0` (every replica gets rank 0's
    bits); the per-replica BN rows (``local`` mode); the exchange's optimizer
    and comm state (``exchange.init``, traced into the same program) and the
    scalar counters. The full (unsplit) tree is made as always and then laid out
    as the layout says, so a split parameter's slices are bitwise slices of the
    unsplit one. The persistent compilation cache (:mod:`trjax.train.compilation`)
    stores it as one entry. :func:`check_replicas_identical` then verifies the
    broadcast on the host. Rank 0's key, hence the parameters, do not depend on
    the world size or the layout.

    Args:
      rng: an ``int`` seed (``config.seed``; the key is made inside the
        program, ``jax.random.key(seed)``) or a PRNG key array (its key data
        is read on the host and placed on every device).
      layout: a :class:`trjax.parallel.Layout`: the world, the unsplit
        network (``layout.model``, :meth:`trjax.models.Network.init`; an nnx
        instance gives its own), the image shape and the state's specs.
      exchange: the :class:`trjax.exchange.GradientExchange`; its ``init``
        builds the optimizer and comm state (it must be traceable).
      loss_scale: initial loss scale (fp16 dynamic scaling; 1.0 otherwise).

    Returns:
      A :class:`TrainStateProgram`; its ``finish()`` returns the
      :class:`TrainState`, laid out as :func:`state_specs` says, and raises
      ``RuntimeError`` when a replica's parameters differ from rank 0's after
      the broadcast.
    """
    world, net = layout.world, layout.model
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        seed, make_key, impl = world.put(np.asarray(rng, np.int32)), jax.random.key, None
    else:  # key data through the host: a global array on every process's devices
        seed = world.put(np.asarray(jax.random.key_data(rng)))
        impl = jax.random.key_impl(rng)
        make_key = lambda data: jax.random.wrap_key_data(data, impl=impl)

    def init_local(seed):
        key = jax.random.fold_in(make_key(seed), lax.axis_index(world.axis_name))
        variables = net.init(key, layout.image_shape)  # {"params", "batch_stats"}
        variables = collectives.broadcast_from_rank0(variables, world.axis_name)
        return variables["params"], variables["batch_stats"]

    def create(seed):
        params, batch_stats = jax.shard_map(init_local, mesh=world.mesh, in_specs=P(),
                                            out_specs=(P(), P()))(seed)
        batch_stats = layout.replica_rows(batch_stats)
        opt_state, comm_state = exchange.init(params, world)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(step=zero, params=params, batch_stats=batch_stats, opt_state=opt_state,
                          skipped_steps=zero, loss_scale=jnp.asarray(loss_scale, jnp.float32),
                          good_steps=zero, comm_state=comm_state)

    shardings = jax.tree_util.tree_map(lambda sp: NamedSharding(world.mesh, sp),
                                       state_specs(layout, exchange),
                                       is_leaf=lambda x: isinstance(x, P))
    lowered = jax.jit(create, out_shardings=shardings).lower(seed)

    def finish() -> TrainState:
        state = compile_lowered(lowered, init_options(world.devices[0].platform))(seed)
        check_replicas_identical(state.params)
        return state

    return TrainStateProgram(lowered.out_info, finish)


def check_replicas_identical(tree) -> None:
    """Raises ``RuntimeError`` unless every device's copy of each leaf is bitwise
    equal to the first copy of the same slice (replicated leaves: device 0's;
    a tensor-parallel leaf: per slice). A host-side check, used at start-up."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        first: dict = {}  # per slice of the global array (a split leaf has several)
        for i, s in enumerate(x.addressable_shards):
            key = repr(s.index)
            bits = np.asarray(s.data).tobytes()
            if first.setdefault(key, bits) != bits:
                raise RuntimeError(f"replica {i} differs from rank 0 at {jax.tree_util.keystr(path)}")
