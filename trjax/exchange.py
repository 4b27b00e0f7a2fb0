"""The gradient exchange: how bucket gradients become new parameters.

Everything a data-parallel strategy changes lives in one
:class:`GradientExchange`, a NamedTuple of pure functions in the shape of
``optax.GradientTransformation`` (and of :class:`trjax.compression.Compressor`;
PyTorch DDP's comm hooks, ``hook(state, bucket)``, play the same role):

* ``init(params, world) -> (opt_state, comm_state)``: global arrays laid out
  as ``specs()`` says; traceable (``create_train_state`` runs it inside its
  one start-up program);
* ``specs(axis_name) -> (opt_specs, comm_specs)``: their ``shard_map``
  partition specs over the mesh's data axis ``axis_name`` (``world.axis_name``);
* ``update(buffers, params, opt_state, comm_state, step, loss_scale, axis_name)
  -> Update``: called per device inside the train step's ``shard_map`` (over
  the data axis ``axis_name``) with this device's packed bucket buffers (gradient SUMS over its rows, the metric sums
  in the plan's metrics slot); returns the new parameters and states, the
  global metric sums, whether the reduced gradient is finite (the same on
  every replica), and ``last``: the last collective's result, which the step
  chains later collectives after (:func:`trjax.collectives.after`);
* ``check_vma``: whether the step can be typed by ``shard_map``'s
  varying-manual-axes check (``lax.psum`` results only);
* ``checkpoint_keys(world) -> dict``: values a checkpoint of this state must
  match: ``{"world_size": N}`` when the state holds one row or shard per
  replica (error feedback, ZeRO-1 shards), so it restores on the same world
  size only; ``{}`` otherwise.

Constructors: :func:`allreduce` (``lax.psum`` or an algorithm of
:mod:`trjax.allreduce`, hierarchical included), :func:`compressed` (a
:class:`~trjax.compression.Compressor` per bucket, see :func:`exact_below`;
uncompressed before a start step, as optax's ``conditionally_transform`` and
PyTorch's ``start_powerSGD_iter``), :func:`shard_optimizer_state` (ZeRO-1).
:func:`from_config` picks one. The mean is ``sum / global count``, applied
once, before the optimizer update (:func:`_mean`, :func:`_apply`).

The optimizer recipe on top (issue 30): :func:`clip_before` (clipping by the
global norm of the exact mean gradient, ``config.grad_clip_norm``; ZeRO-1 has its
own, :func:`shard_optimizer_state`'s ``clip_norm``), :func:`with_ema` (an
exponential moving average of the parameters, ``config.ema_decay``, read by
:func:`ema_params` / :func:`ema_state`) and ``from_config(..., tx=)``: any optax
transformation in place of the config's optimizer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trjax import allreduce as allreduce_lib
from trjax import collectives, compression, optim
from trjax.metrics import METRICS
from trjax.plan import MemoryPlan, layer_matrices, shard_layout
from trjax.world import World

ALLREDUCE_CHOICES = tuple(allreduce_lib.ALGORITHMS) + ("hierarchical",)
"""``config.allreduce`` values: the algorithms of :mod:`trjax.allreduce` and
``hierarchical`` (:func:`trjax.allreduce.hierarchical_allreduce`)."""
_COUNT = METRICS.index("count")


class Update(NamedTuple):
    """What :attr:`GradientExchange.update` returns (per device)."""
    params: Any
    opt_state: Any
    comm_state: Any
    sums: jax.Array     # [len(METRICS)] float32, global
    finite: jax.Array   # bool scalar, identical on every replica
    last: jax.Array     # the last collective's result (ordering anchor)
    grad_norm: Any = None  # float32 scalar: the global norm of the mean gradient
                           # (grad_norm_of); None: the exchange does not measure it


class Mean(NamedTuple):
    """What :attr:`GradientExchange.mean` returns (per device)."""
    grads: Any          # the global mean gradient (this device's slices of split leaves)
    sums: jax.Array     # [len(METRICS)] float32, global
    finite: jax.Array   # bool scalar: the reduced buckets this device holds are finite
    comm_state: Any
    last: jax.Array     # the last collective's result (ordering anchor)


class GradientExchange(NamedTuple):
    """A data-parallel strategy (see the module docstring).

    ``mean`` and ``apply`` are ``update`` in two halves, for the exchanges whose
    optimizer state is replicated over the data axis (``None`` for ZeRO-1):
    ``mean(buffers, comm_state, step, loss_scale, axis_name) -> Mean`` per device,
    inside ``shard_map``; ``apply(grads, params, opt_state, step) -> (params,
    opt_state)``, traceable on per-device slices or on global arrays (a mesh
    that splits parameters runs it outside ``shard_map``, so a norm over a split
    leaf is the unsplit leaf's: :func:`trjax.steps.make_train_step`)."""
    name: str
    init: Callable[[Any, World], tuple[Any, Any]]
    specs: Callable[[str], tuple[Any, Any]]
    update: Callable[..., Update]
    check_vma: bool
    checkpoint_keys: Callable[[World], dict]
    mean: Callable[..., Mean] | None = None
    apply: Callable[..., tuple] | None = None


def _per_replica(world: World) -> dict:
    """The checkpoint keys of a state with one row or shard per replica."""
    return {"world_size": world.world_size}


def _inverse_count(count: jax.Array, loss_scale) -> jax.Array:
    """``1 / max(count, 1)``, divided by the loss scale when there is one."""
    inv = 1.0 / jnp.maximum(count, 1.0)
    return inv if loss_scale is None else inv / loss_scale


def _mean(plan: MemoryPlan, reduced, loss_scale, comm_state) -> Mean:
    """Unpack the reduced buckets and scale the sums to the mean over the global
    count (loss scale divided out). Every replica sees the same reduced values,
    so ``finite`` agrees over the data axis without another collective."""
    grads, sums = plan.unpack(reduced)
    finite = jnp.isfinite(sum(jnp.sum(b) for b in reduced.values()))
    inv_count = _inverse_count(sums[_COUNT], loss_scale)
    grads = jax.tree_util.tree_map(lambda g: g * inv_count, grads)
    return Mean(grads, sums, finite, comm_state, list(reduced.values())[-1])


def grad_norm_of(grads) -> jax.Array:
    """The global L2 norm of a gradient tree, ``sqrt(sum over leaves of sum(g**2))``
    in float32 (optax's ``global_norm``, the norm ``optax.clip_by_global_norm`` and
    ``torch.nn.utils.clip_grad_norm_`` clip by). Traceable per device (on replicated
    leaves) or on global arrays: on a leaf split over mesh axes XLA's partitioner sums
    each device's squares over the axes that split it, so every element counts once."""
    leaves = jax.tree_util.tree_leaves(grads)
    return jnp.sqrt(sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves),
                        jnp.zeros((), jnp.float32)))


def _apply(tx, grads, params, opt_state, step):
    """``tx``'s update on the mean gradient (``tx`` gets the train step's counter
    as ``step=``: :func:`trjax.optim.scale_by_step_schedule`), applied."""
    updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params,
                                                                  step=step)
    return optax.apply_updates(params, updates), opt_state


def clip_before(tx: optax.GradientTransformation, max_norm: float) -> optax.GradientTransformation:
    """``tx`` after ``optax.clip_by_global_norm(max_norm)`` (Pascanu et al. 2013):
    with ``n = sqrt(sum over every leaf of sum(g**2))``, ``g <- g * max_norm / n``
    when ``n >= max_norm``. ``max_norm == 0``: ``tx`` itself (off).

    In the replicated exchanges (:func:`allreduce`, :func:`compressed`) ``tx``
    sees the exact global mean gradient, the same on every replica, so the
    norm and the clipped gradient are the same everywhere (no collective).
    The clip comes before the optimizer's own terms (``sgd``/``lars``' weight
    decay is added to the clipped gradient). Adds an ``EmptyState`` in front
    of ``tx``'s state (``optax.chain``).

    Raises:
      ValueError: a negative ``max_norm``.
    """
    if max_norm < 0:
        raise ValueError(f"clip norm {max_norm!r} must be >= 0 (0: off)")
    return tx if max_norm == 0 else optax.chain(optax.clip_by_global_norm(max_norm), tx)


def _clip_like_optax(tree, norm, max_norm: float):
    """``optax.clip_by_global_norm``'s formula with the norm given (ZeRO-1: the
    norm of all shards together): ``t`` where ``norm < max_norm``, else
    ``t / norm * max_norm``."""
    return jax.tree_util.tree_map(
        lambda t: lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm), tree)


class EmaState(NamedTuple):
    """The optimizer state of an exchange :func:`with_ema`: the exchange's own
    (``opt``) and the parameters' moving average (``ema``: shaped, typed and
    laid out as the params, replicated). In a checkpoint: ``opt_state/opt/...``
    and ``opt_state/ema/<param path>``."""
    opt: Any
    ema: Any


def with_ema(exchange: GradientExchange, decay: float) -> GradientExchange:
    """``exchange`` that also keeps an exponential moving average of the params.

    After each update ``ema <- decay * ema + (1 - decay) * params`` (the new
    params, per leaf, in float32; Polyak & Juditsky 1992 averaging in its
    exponential form, as TensorFlow's ``ExponentialMovingAverage``); the
    average starts at the initial params. It lives in the optimizer state
    (:class:`EmaState`, replicated, ``P()``), so the train step's skip of a
    non-finite update leaves it as it was, a checkpoint holds it and a resume
    restores it bit for bit (replicated, it adds no world-size condition to a
    checkpoint). Works over every exchange
    (ZeRO-1 included: the average is of the all-gathered params). Only
    ``params`` are averaged: evaluating the average (:func:`ema_state`) uses
    the state's BN running statistics as they are.

    Args:
      exchange: any :class:`GradientExchange`.
      decay: in ``(0, 1)``.

    Raises:
      ValueError: ``decay`` outside ``(0, 1)``.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"EMA decay {decay!r} must be in (0, 1)")
    average = lambda ema, params: jax.tree_util.tree_map(  # noqa: E731
        lambda e, p: decay * e + (1.0 - decay) * p, ema, params)

    def init(params, world):
        opt_state, comm_state = exchange.init(params, world)
        ema = jax.tree_util.tree_map(jnp.copy, params)
        return EmaState(opt_state, ema), comm_state

    def specs(axis_name):
        opt_specs, comm_specs = exchange.specs(axis_name)
        return EmaState(opt_specs, P()), comm_specs

    def update(buffers, params, opt_state, comm_state, step, loss_scale, axis_name):
        up = exchange.update(buffers, params, opt_state.opt, comm_state, step, loss_scale,
                             axis_name)
        return up._replace(opt_state=EmaState(up.opt_state, average(opt_state.ema, up.params)))

    def apply(grads, params, opt_state, step):
        params, opt = exchange.apply(grads, params, opt_state.opt, step)
        return params, EmaState(opt, average(opt_state.ema, params))

    return exchange._replace(name=f"{exchange.name}+ema", init=init, specs=specs, update=update,
                             apply=None if exchange.apply is None else apply)


def ema_params(state):
    """The EMA of the params of a train state (or of its ``opt_state``) built
    by :func:`with_ema`; ``None`` without one."""
    opt_state = getattr(state, "opt_state", state)
    return opt_state.ema if isinstance(opt_state, EmaState) else None


def ema_state(state):
    """``state`` with its ``params`` replaced by their EMA (:func:`ema_params`),
    everything else as it is: the same shapes and shardings, so the compiled
    BN fold and eval step take it as they are (an evaluation of the EMA with
    the state's BN statistics, without another program).

    Raises:
      ValueError: the state has no EMA (``config.ema_decay == 0``).
    """
    ema = ema_params(state)
    if ema is None:
        raise ValueError("this train state has no EMA of its params (config.ema_decay=0)")
    return state.replace(params=ema)


def _replicated(name, tx, plan, reduce, check_vma, init_comm, checkpoint_keys):
    """An exchange with the optimizer state replicated: ``reduce(buffers,
    comm_state, step, axis_name, loss_scale) -> ({bucket: sum}, comm_state)``
    (sums in the buffers' units: loss-scaled with a loss scale), then
    :func:`_mean` and :func:`_apply`."""

    def init(params, world):
        return jax.jit(tx.init, out_shardings=world.replicated())(params), init_comm(world)

    def mean(buffers, comm_state, step, loss_scale, axis_name):
        reduced, comm_state = reduce(buffers, comm_state, step, axis_name, loss_scale)
        return _mean(plan, reduced, loss_scale, comm_state)

    apply = functools.partial(_apply, tx)

    def update(buffers, params, opt_state, comm_state, step, loss_scale, axis_name):
        m = mean(buffers, comm_state, step, loss_scale, axis_name)
        params, opt_state = apply(m.grads, params, opt_state, step)
        return Update(params, opt_state, m.comm_state, m.sums, m.finite, m.last,
                      grad_norm_of(m.grads))

    return GradientExchange(name, init, lambda axis_name: (P(), P(axis_name)), update, check_vma,
                            checkpoint_keys, mean, apply)


def allreduce(tx: optax.GradientTransformation, plan: MemoryPlan, algorithm: str = "xla",
              local_size: int | None = None) -> GradientExchange:
    """One all-reduce per bucket, in plan order, then ``tx`` on the mean.

    Args:
      tx: the optimizer, on the params tree.
      plan: the buckets (``per_leaf`` buckets are not chained, so XLA may
        merge them, as a plain flax step's ``pmean`` would).
      algorithm: one of :data:`ALLREDUCE_CHOICES`: ``xla`` (``lax.psum``,
        NCCL on GPUs; the only VMA-typed one), ``ring``, ``halving_doubling``,
        ``tree`` (:mod:`trjax.allreduce`) or ``hierarchical`` (groups of
        ``local_size`` consecutive ranks; :func:`trjax.allreduce.hierarchical_allreduce`).
      local_size: devices per node for ``hierarchical``.

    Raises:
      ValueError: an unknown algorithm, or ``hierarchical`` without a
        ``local_size`` >= 1.
    """
    if algorithm not in ALLREDUCE_CHOICES:
        raise ValueError(f"allreduce={algorithm!r} is not one of {ALLREDUCE_CHOICES}")
    if algorithm == "hierarchical":
        if not local_size or local_size < 1:
            raise ValueError(f"allreduce='hierarchical' needs local_size >= 1, got {local_size!r}")
        reduce_fn = functools.partial(allreduce_lib.hierarchical_allreduce, local_size=local_size)
    else:
        reduce_fn = None if algorithm == "xla" else allreduce_lib.ALGORITHMS[algorithm]
    chain = plan.policy != "per_leaf"

    def reduce(buffers, comm_state, step, axis_name, loss_scale=None):
        return collectives.allreduce_buckets(buffers, axis_name, chain=chain,
                                             reduce_fn=reduce_fn), comm_state

    return _replicated(f"allreduce:{algorithm}", tx, plan, reduce, algorithm == "xla",
                       lambda world: {}, lambda world: {})


def exact_below(plan: MemoryPlan, make: Callable[[str], compression.Compressor],
                min_fraction: float) -> dict[str, compression.Compressor]:
    """``{bucket: Compressor}``: ``make(bucket)``, except buckets holding less
    than ``min_fraction`` of the gradient bytes, which are all-reduced exactly
    (``compression.none()``): compressing them saves little, and under the
    ``two`` policy the small bucket holds the layers most sensitive to it (BN,
    FC, first conv)."""
    return {b: compression.none() if plan.bucket_bytes(b) < min_fraction * plan.gradient_bytes
            else make(b) for b in plan.bucket_elements}


def compressed(tx: optax.GradientTransformation, plan: MemoryPlan, compressors,
               start_step: int = 0) -> GradientExchange:
    """Each bucket all-reduced through its :class:`~trjax.compression.Compressor`.

    The metric sums leave their bucket and travel in one small exact
    ``lax.psum`` (they must stay exact). Before ``start_step`` the buckets are
    all-reduced uncompressed (``lax.cond``; PyTorch's ``start_powerSGD_iter``),
    the compressor state untouched. The comm state is each compressor's state
    per bucket, one row per replica (error feedback is per device). Not
    VMA-typed: the results are replicated in value but typed per device.

    With a loss scale (fp16) a compressor that keeps state (error feedback,
    PowerSGD's warm-start ``Q``) gets the bucket divided by the scale and its
    sum is multiplied back (both exact for the power-of-two scales of
    :func:`trjax.precision.update_loss_scale`): the state stays in unscaled
    units, so an error carried across a change of the scale is added at its
    true weight. A stateless one (``none``, ``bf16``, ``fp16``) sends the
    scaled bucket, which keeps small gradients inside float16's range.

    Args:
      compressors: one compressor for every bucket, or ``{bucket: compressor}``
        (:func:`exact_below`).
    """
    per_bucket = compressors if isinstance(compressors, dict) else \
        {b: compressors for b in plan.bucket_elements}
    mbucket, moff = plan.metrics_slot
    nm = len(METRICS)

    def init_comm(world):
        n = world.world_size  # traceable: create_train_state builds it inside its program
        rows = lambda x: lax.with_sharding_constraint(jnp.broadcast_to(x, (n,) + x.shape),
                                                      world.sharded())
        return {b: jax.tree_util.tree_map(rows, per_bucket[b].init(jax.ShapeDtypeStruct(
            (size - (nm if b == mbucket else 0),), jnp.float32)))
            for b, size in plan.bucket_elements.items()}

    def reduce(buffers, comm_state, step, axis_name, loss_scale=None):
        reduced, new_comm, previous = {}, {}, None
        for b, x in buffers.items():
            if previous is not None:
                x = collectives.after(x, previous)
            st = jax.tree_util.tree_map(lambda v: v[0], comm_state[b])
            compress = per_bucket[b].allreduce
            if loss_scale is not None and jax.tree_util.tree_leaves(st):  # state: unscaled
                compress = lambda g, st, ax, f=compress: (
                    lambda out: (out[0] * loss_scale, out[1]))(f(g / loss_scale, st, ax))
            if start_step > 0:
                compress = lambda g, st, ax, f=compress: lax.cond(
                    step < start_step, lambda g, st: (lax.psum(g, ax), st),
                    lambda g, st: f(g, st, ax), g, st)
            if b == mbucket:  # metrics leave the bucket: they must stay exact
                m = lax.psum(x[moff:moff + nm], axis_name)
                g, st = compress(jnp.concatenate([x[:moff], x[moff + nm:]]), st, axis_name)
                x = jnp.concatenate([g[:moff], m, g[moff:]])
            else:
                x, st = compress(x, st, axis_name)
            reduced[b] = previous = x
            new_comm[b] = jax.tree_util.tree_map(lambda v: v[None], st)
        return reduced, new_comm

    return _replicated("compressed", tx, plan, reduce, False, init_comm,
                       _per_replica)


def shard_optimizer_state(plan: MemoryPlan, world_size: int,
                          make_tx: Callable[[Any], optax.GradientTransformation],
                          clip_norm: float = 0.0) -> GradientExchange:
    """ZeRO stage 1 (Rajbhandari et al., SC 2020): 1/N of the optimizer state per device.

    Each bucket is reduce-scattered instead of all-reduced (padded to a
    multiple of N, :func:`trjax.plan.shard_layout`); each device updates its
    1/N shard of the parameters with its shard of the optimizer state, and the
    new parameters are all-gathered. The metric sums, a non-finite flag and
    the sum of squares of the mean gradient (its global norm) travel in one
    small all-reduce.

    Args:
      make_tx: ``mask -> optimizer`` on flat ``{bucket: shard}`` trees, e.g.
        ``lambda mask: optim.make_optimizer("sgd", lr, mask=mask)``; ``mask``
        gives the weight-decay flags of a shard (per element: kernels and
        vectors share a bucket), so decay follows the same rule
        (:func:`trjax.optim.add_decayed_weights`) as the replicated optimizer.
        The optimizer must be elementwise: each element's update may depend
        only on that element's gradient, parameter and state (momentum SGD,
        AdamW; not a global norm, LARS's per-layer trust ratio, or anything
        that reads a leaf's shape: here a "leaf" is a device's flat 1/N
        slice of a bucket, and a non-elementwise transformation would
        silently compute per-shard values that differ between replicas).
        The slice's elements that are no gradient (the metric sums' slot
        and the padding to a multiple of N) reach it as gradient 0 on
        parameter 0 with no decay: an elementwise optimizer keeps their
        state at 0 and updates them by 0, and the all-gather drops them.
      clip_norm: > 0: the mean gradient is clipped to this global norm
        before ``make_tx``'s optimizer, with ``optax.clip_by_global_norm``'s
        formula; the norm is of every gradient element of every shard (each
        device's sum of squares over its shards, metric sums and padding left
        out, rides in the metric sums' all-reduce: no collective of its own),
        so it and the clipped gradient agree with the replicated exchanges' up
        to the order of the sum. 0: off. The same norm is the step's
        ``grad_norm`` (:class:`trjax.metrics.StepMetrics`), clip or no clip.
    """
    if clip_norm < 0:
        raise ValueError(f"clip_norm={clip_norm!r} must be >= 0 (0: off)")
    layout = shard_layout(plan, world_size)
    shard = {b: n // world_size for b, (n, _) in layout.items()}
    is_grad = {b: np.zeros(n, np.float32) for b, (n, _) in layout.items()}
    for slot in plan.slots:  # gradient elements: no metric sums, no padding
        is_grad[slot.bucket][slot.offset:slot.offset + slot.size] = 1.0

    def decay_mask(rank):  # the weight-decay flags of rank's shard, per element
        return lambda shards: {b: lax.dynamic_slice_in_dim(jnp.asarray(layout[b][1]),
                                                           rank * shard[b], shard[b])
                               for b in shards}

    init_tx = make_tx(decay_mask(0))  # the state's structure does not depend on the rank
    flat = {b: jax.ShapeDtypeStruct((n,), jnp.float32) for b, (n, _) in layout.items()}
    opt_shapes = jax.eval_shape(init_tx.init, flat)
    opt_specs = lambda axis_name: jax.tree_util.tree_map(
        lambda x: P() if x.ndim == 0 else P(axis_name), opt_shapes)
    mb, mo = plan.metrics_slot

    def init(params, world):
        zeros = {b: jnp.zeros(n, jnp.float32) for b, (n, _) in layout.items()}
        shardings = jax.tree_util.tree_map(lambda sp: NamedSharding(world.mesh, sp),
                                           opt_specs(world.axis_name))
        return jax.jit(init_tx.init, out_shardings=shardings)(zeros), {}

    def update(buffers, params, opt_state, comm_state, step, loss_scale, axis_name):
        rank = lax.axis_index(axis_name)
        tx = make_tx(decay_mask(rank))
        shards, previous = {}, None
        for b, x in buffers.items():  # reduce-scatter, one per bucket, in order
            x = jnp.pad(x, (0, layout[b][0] - x.shape[0]))
            if previous is not None:
                x = collectives.after(x, previous)
            shards[b] = previous = lax.psum_scatter(x, axis_name, tiled=True)
        local_bad = 1.0 - jnp.isfinite(sum(jnp.sum(v) for v in shards.values())).astype(jnp.float32)
        # the optimizer gets gradient elements only: the metric sums and the padding in a
        # shard are not gradients, so they enter it as 0 (their state stays 0, no update)
        mask = {b: lax.dynamic_slice_in_dim(jnp.asarray(is_grad[b]), rank * shard[b],
                                            shard[b]) for b in shards}
        unscale = 1.0 if loss_scale is None else 1.0 / loss_scale
        squares = sum(jnp.sum(jnp.square(jnp.where(mask[b] > 0, g * unscale, 0.0)))
                      for b, g in shards.items())  # this device's, of the unscaled SUMS
        summed = lax.psum(jnp.concatenate([buffers[mb][mo:mo + len(METRICS)], local_bad[None],
                                           squares[None]]), axis_name)
        sums, finite = summed[:len(METRICS)], summed[len(METRICS)] == 0
        inv_count = _inverse_count(sums[_COUNT], loss_scale)
        # the mean gradient's global norm: every shard's gradient elements once
        norm = jnp.sqrt(summed[len(METRICS) + 1]) / jnp.maximum(sums[_COUNT], 1.0)
        pflat = plan.pack(params, jnp.zeros(len(METRICS)))
        mine = {b: lax.dynamic_slice_in_dim(jnp.pad(pflat[b], (0, layout[b][0] - pflat[b].shape[0])),
                                            rank * shard[b], shard[b]) for b in shards}
        grads = {b: jnp.where(mask[b] > 0, g * inv_count, 0.0) for b, g in shards.items()}
        if clip_norm > 0:
            grads = _clip_like_optax(grads, norm, clip_norm)
        updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, mine,
                                                                      step=step)
        new_flat = {b: lax.all_gather(mine[b] + updates[b], axis_name,
                                      tiled=True)[:pflat[b].shape[0]] for b in shards}
        params, _ = plan.unpack(new_flat)
        return Update(params, opt_state, comm_state, sums, finite, previous, norm)

    return GradientExchange("shard_optimizer_state", init,
                            lambda axis_name: (opt_specs(axis_name), P(axis_name)),
                            update, False, _per_replica)


USER_TX = "tx"
"""What a checkpoint of a run with ``from_config(..., tx=...)`` records as its
``optimizer`` (:attr:`GradientExchange.checkpoint_keys`)."""


def _user_tx(tx, plan: MemoryPlan, schedule) -> optax.GradientTransformation:
    built = tx(plan, schedule) if callable(tx) else tx
    if hasattr(built, "gradient_transformation"):  # optax.MultiSteps and its kind
        built = built.gradient_transformation()
    if not isinstance(built, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation or a callable "
                        f"(plan, schedule) -> GradientTransformation, got {type(built).__name__}")
    return built


def from_config(config, plan: MemoryPlan, schedule, world: World,
                tx=None) -> GradientExchange:
    """The exchange ``config`` asks for (``shard_optimizer_state``,
    ``compression``, ``allreduce``, the optimizer keys, ``grad_clip_norm``,
    ``ema_decay``), with the learning-rate ``schedule``. The config is assumed
    valid (:func:`trjax.train.config.validate`).

    Args:
      config: see ``trjax/configs/default.py``.
      plan: the buckets; its regions give the decay and LARS masks.
      schedule: the learning rate, ``step -> float`` (or a float).
      world: devices and mesh.
      tx: ``None``: the config's optimizer (:func:`trjax.optim.make_optimizer`
        with ``optimizer``, ``momentum``, ``nesterov``, ``weight_decay``,
        ``trust_coefficient``, ``adam_b1``/``adam_b2``/``adam_eps``). Else an
        optax ``GradientTransformation`` on the params tree (an
        ``optax.MultiSteps`` by its ``gradient_transformation()``), or a callable
        ``(plan, schedule) -> GradientTransformation`` (to build masks from
        the plan, e.g. :func:`trjax.optim.kernel_mask`, or use the run's
        warmup-cosine ``schedule``), used instead; those config keys are then
        not read. How it composes:

        * it is applied after the gradient exchange, on every replica, to
          the same global mean gradient (the all-reduced sum over the
          global count of real rows, loss scale divided out; under
          compression, the decompressed mean); the params are
          ``optax.apply_updates(params, updates)``; a non-finite gradient
          skips the update (its state too), as for the built-in optimizers;
        * ``grad_clip_norm > 0`` clips before it (:func:`clip_before`),
          ``ema_decay > 0`` averages the params after it (:func:`with_ema`);
        * no trjax masking: it gets every leaf (conv and dense kernels, BN
          scales and biases, the dense bias) and trjax adds no weight-decay
          mask and no LARS exclusion of its own. For trjax's rule (kernels
          only), pass e.g. ``lambda plan, lr: optax.chain(
          optim.add_decayed_weights(wd, optim.kernel_mask(plan)),
          optax.sgd(lr, 0.9))``;
        * ZeRO-1 (``shard_optimizer_state=True``) is refused: there the
          optimizer runs on each device's flat 1/N shard of the buckets and
          must be elementwise (:func:`shard_optimizer_state`), which trjax
          cannot check of an arbitrary transformation (a global-norm clip
          inside it would clip each shard by its own norm, different on
          every replica). Build such an exchange with
          :func:`shard_optimizer_state` directly when the transformation is
          elementwise;
        * the checkpoint records ``optimizer="tx"`` (:data:`USER_TX`), so a
          resume with the config's optimizer (or a tx run resumed without
          one) is refused; trjax cannot compare code: pass the same ``tx``
          on resume (a different state structure is refused as not fitting);
        * the step log's ``lr`` column is the config's ``schedule``, which
          ``tx`` need not use.

    Raises:
      ValueError: ``tx`` with ``config.shard_optimizer_state``.
      TypeError: ``tx`` (or what it returns) is not a ``GradientTransformation``.
    """
    c = config
    if tx is not None and c.shard_optimizer_state:
        raise ValueError("from_config(tx=...) with config.shard_optimizer_state=True (ZeRO-1): "
                         "the optimizer would run on each device's flat 1/N shard, which is "
                         "right only for an elementwise transformation, and trjax cannot tell "
                         "whether yours is; set shard_optimizer_state=False, or build the "
                         "exchange with trjax.exchange.shard_optimizer_state(plan, world_size, "
                         "make_tx) for an elementwise one")
    opt = dict(momentum=c.momentum, weight_decay=c.weight_decay, nesterov=c.nesterov,
               b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps)
    if c.shard_optimizer_state:
        ex = shard_optimizer_state(plan, world.world_size, lambda mask: optim.make_optimizer(
            c.optimizer, schedule, mask=mask, **opt), clip_norm=c.grad_clip_norm)
        return with_ema(ex, c.ema_decay) if c.ema_decay else ex
    if tx is None:
        base = optim.make_optimizer(c.optimizer, schedule, plan,
                                    trust_coefficient=c.trust_coefficient, **opt)
    else:
        base = _user_tx(tx, plan, schedule)
    base = clip_before(base, c.grad_clip_norm)
    if c.compression != "none":
        def make(bucket):
            if c.compression == "powersgd":  # one matrix per layer, vectors exact
                return compression.powersgd(c.powersgd_rank, layer_matrices(plan, bucket))
            options = {"topk": {"ratio": c.topk_ratio}}.get(c.compression, {})
            return compression.make_compressor(c.compression, **options)
        ex = compressed(base, plan, exact_below(plan, make, c.compression_min_fraction),
                        start_step=c.compression_start_step)
    else:
        processes = len({d.process_index for d in world.devices})
        local = c.allreduce_local_size or world.world_size // processes
        ex = allreduce(base, plan, c.allreduce, local_size=local)
    if tx is not None:
        ex = ex._replace(checkpoint_keys=lambda w, keys=ex.checkpoint_keys: {
            **keys(w), "optimizer": USER_TX})
    return with_ema(ex, c.ema_decay) if c.ema_decay else ex
