"""The train state: what a train step reads and writes, its layout and creation.

:class:`TrainState` is a flax struct (a pytree). :func:`state_specs` gives its
``shard_map`` partition specs: replicated except the per-replica BN statistics
of ``local`` mode and whatever the gradient exchange shards (its optimizer and
comm state, :class:`trjax.exchange.GradientExchange`).
:func:`create_train_state` initialises every replica with its own key, then
broadcasts rank 0's parameters bit for bit, all in one compiled program.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trjax import collectives, models, tensor
from trjax.cpu.compile_options import compile_lowered, init_options
from trjax.world import World


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


class TensorLayout(NamedTuple):
    """How a tensor-parallel (Megatron) state lies over the ``model`` axis
    (:func:`tensor_layout`).

    Attributes:
      network: the split :class:`trjax.models.Network` the steps apply inside
        ``shard_map`` to the local slices (its module
        :func:`trjax.tensor.split_model`); the trainer's own network stays
        unsplit (initialisation, the plan's regions, checks).
      params, batch_stats, opt_state, folded: ``PartitionSpec`` trees of the
        parameters, the BN running statistics, the optimizer state (a
        parameter-shaped subtree gets the parameters' specs, every other leaf
        ``P()``; ``None`` until :func:`with_optimizer`) and the folded
        BatchNorm tree of the evaluation.
      sizes: the mesh's ``{axis: size}``.
    """
    network: Any
    params: Any
    batch_stats: Any
    opt_state: Any
    folded: Any
    sizes: dict

    def local_shapes(self, params, batch_stats):
        """One device's shapes of (abstract) ``params`` and ``batch_stats``
        (:func:`trjax.tensor.local_shapes`): what the bucket plan packs."""
        return (tensor.local_shapes(params, self.params, self.sizes),
                tensor.local_shapes(batch_stats, self.batch_stats, self.sizes))


def _like_params(tree, param_specs):
    """Specs for ``tree`` (an optimizer state): each subtree with the structure of
    the parameters gets ``param_specs`` (optax's ``trace``, Adam's ``mu``/``nu``,
    trjax's EMA), every other leaf ``P()`` (step counts, empty states).
    ``optax.tree_map_params`` does this for a bare optax transformation; the
    exchange's state also holds :func:`trjax.exchange.with_ema`'s average."""
    target = jax.tree_util.tree_structure(param_specs, is_leaf=lambda x: isinstance(x, P))

    def walk(t):
        if jax.tree_util.tree_structure(t) == target:
            return param_specs
        if isinstance(t, (tuple, list)) and not hasattr(t, "_fields"):
            return type(t)(walk(x) for x in t)
        if hasattr(t, "_fields"):  # NamedTuple optax states
            return type(t)(*(walk(x) for x in t))
        if isinstance(t, dict):
            return {k: walk(v) for k, v in t.items()}
        return jax.tree_util.tree_map(lambda _: P(), t)
    return walk(tree)


def tensor_layout(network, world: World, image_shape: tuple) -> TensorLayout:
    """The :class:`TensorLayout` of a trjax ResNet on a world with a ``model``
    axis, without the optimizer state's specs (:func:`with_optimizer`: the
    exchange is built from the bucket plan, which needs these local shapes).

    Args:
      network: the unsplit :class:`trjax.models.Network` of a
        :class:`trjax.models.ResNet`.
      world: a world whose mesh has a ``model`` axis.
      image_shape: ``(H, W, C)``.

    Raises:
      ValueError: not a trjax ResNet; a layer whose channels (or the head's
        classes) do not divide by the axis size
        (:func:`trjax.tensor.check_tensor_split`), before anything is traced.
    """
    import dataclasses  # noqa: PLC0415
    if not isinstance(network.module, models.ResNet):
        raise ValueError(f"a 'model' mesh axis splits trjax's own ResNets (Megatron); "
                         f"{type(network.module).__name__} is not one: use a built-in model or "
                         "a mesh with the data axis only")
    sizes = dict(world.axes)
    split = tensor.split_model(network.module, tensor.TENSOR_AXIS, sizes[tensor.TENSOR_AXIS])
    variables = jax.eval_shape(lambda k: network.init(k, image_shape), jax.random.key(0))
    s_specs = tensor.stats_specs(variables["batch_stats"], split)
    return TensorLayout(dataclasses.replace(network, module=split),
                        tensor.param_specs(variables["params"], split), s_specs, None,
                        _rename_leaves(s_specs, {"mean": "scale", "var": "bias"}), sizes)


def with_optimizer(layout: TensorLayout, network, exchange, world: World,
                   image_shape: tuple) -> TensorLayout:
    """``layout`` with the specs of ``exchange``'s optimizer state (its ``init``
    traced abstractly on the full parameters of the unsplit ``network``)."""
    variables = jax.eval_shape(lambda k: network.init(k, image_shape), jax.random.key(0))
    opt = jax.eval_shape(lambda p: exchange.init(p, world)[0], variables["params"])
    return layout._replace(opt_state=_like_params(opt, layout.params))


def _rename_leaves(tree, rename):
    if isinstance(tree, dict):
        return {rename.get(k, k): _rename_leaves(v, rename) for k, v in tree.items()}
    return tree


def state_specs(bn_mode: str, axis_name: str, exchange=None,
                layout: TensorLayout | None = None) -> TrainState:
    """``shard_map`` partition specs of a :class:`TrainState` (a pytree prefix).

    Args:
      bn_mode: ``local`` keeps one BN statistics row per replica (``P(axis_name)``).
      axis_name: the mesh's data axis (``world.axis_name``).
      exchange: the :class:`trjax.exchange.GradientExchange` whose optimizer
        and comm state the specs describe (``None``: replicated optimizer
        state, as for steps that do not touch it).
      layout: a tensor-parallel layout (:func:`tensor_layout`): the parameters,
        statistics and optimizer state split over ``model`` as it says.
    """
    opt_specs, comm_specs = (P(), P(axis_name)) if exchange is None else \
        exchange.specs(axis_name)
    if layout is not None:
        return TrainState(step=P(), params=layout.params, opt_state=layout.opt_state,
                          skipped_steps=P(), loss_scale=P(), good_steps=P(),
                          batch_stats=layout.batch_stats, comm_state=comm_specs)
    return TrainState(step=P(), params=P(), opt_state=opt_specs, skipped_steps=P(),
                      loss_scale=P(), good_steps=P(),
                      batch_stats=P(axis_name) if bn_mode == "local" else P(),
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


def create_train_state(rng, model: nn.Module, exchange, world: World,
                       image_shape: tuple, bn_mode: str, loss_scale: float = 1.0) -> TrainState:
    """The whole train state from one compiled program:
    ``train_state_program(...).finish()`` (same arguments)."""
    return train_state_program(rng, model, exchange, world, image_shape, bn_mode,
                               loss_scale).finish()


def train_state_program(rng, model: nn.Module, exchange, world: World,
                        image_shape: tuple, bn_mode: str,
                        loss_scale: float = 1.0,
                        layout: TensorLayout | None = None) -> TrainStateProgram:
    """The program that makes the whole train state, laid out as
    :func:`state_specs` says; :attr:`TrainStateProgram.finish` compiles and runs it.

    One program (a ``jax.jit`` around a ``shard_map``) does all of it: the PRNG
    key from the seed; on each replica ``model.init`` with its own key
    ``fold_in(key, rank)`` (as independent DDP processes would);
    :func:`trjax.collectives.broadcast_from_rank0` (every replica gets rank 0's
    bits); the ``local``-mode BN rows; the exchange's optimizer and comm state
    (``exchange.init``, traced into the same program) and the scalar counters.
    The persistent compilation cache (:mod:`trjax.train.compilation`) stores it as one
    entry. :func:`check_replicas_identical` then verifies the broadcast on the
    host. Rank 0's key, hence the parameters, do not depend on the world size.

    Args:
      rng: an ``int`` seed (``config.seed``; the key is made inside the
        program, ``jax.random.key(seed)``) or a PRNG key array (its key data
        is read on the host and placed on every device).
      model: a :class:`trjax.models.Network` or a flax module
        (:func:`trjax.models.as_network`; a ResNet's ``axis_name`` is the data
        axis); :meth:`trjax.models.Network.init` makes its variables (an nnx
        instance gives its own).
      exchange: the :class:`trjax.exchange.GradientExchange`; its ``init``
        builds the optimizer and comm state (it must be traceable).
      world: devices and mesh.
      image_shape: ``(H, W, C)`` of one example.
      bn_mode: ``sync``, ``running`` or ``local``.
      loss_scale: initial loss scale (fp16 dynamic scaling; 1.0 otherwise).
      layout: a tensor-parallel layout (:func:`tensor_layout`): the full tree is
        made as always (rank 0's key), then laid out split over ``model``, so
        each device's slices are bitwise slices of the unsplit parameters.
    Returns:
      A :class:`TrainStateProgram`; its ``finish()`` returns the
      :class:`TrainState`, laid out as :func:`state_specs` says, and raises
      ``RuntimeError`` when a replica's parameters differ from rank 0's after
      the broadcast.
    """
    n, net = world.world_size, models.as_network(model)
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        seed, make_key, impl = world.put(np.asarray(rng, np.int32)), jax.random.key, None
    else:  # key data through the host: a global array on every process's devices
        seed = world.put(np.asarray(jax.random.key_data(rng)))
        impl = jax.random.key_impl(rng)
        make_key = lambda data: jax.random.wrap_key_data(data, impl=impl)

    def init_local(seed):
        key = jax.random.fold_in(make_key(seed), lax.axis_index(world.axis_name))
        variables = net.init(key, image_shape)  # {"params", "batch_stats"} ({} without BN)
        variables = collectives.broadcast_from_rank0(variables, world.axis_name)
        return variables["params"], variables["batch_stats"]

    def create(seed):
        params, batch_stats = jax.shard_map(init_local, mesh=world.mesh, in_specs=P(),
                                            out_specs=(P(), P()))(seed)
        if bn_mode == "local":  # one row per replica, all equal to rank 0's statistics
            batch_stats = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape),
                                                 batch_stats)
        opt_state, comm_state = exchange.init(params, world)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(step=zero, params=params, batch_stats=batch_stats, opt_state=opt_state,
                          skipped_steps=zero, loss_scale=jnp.asarray(loss_scale, jnp.float32),
                          good_steps=zero, comm_state=comm_state)

    shardings = jax.tree_util.tree_map(lambda sp: NamedSharding(world.mesh, sp),
                                       state_specs(bn_mode, world.axis_name, exchange, layout),
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
