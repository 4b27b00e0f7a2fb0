"""Fully sharded data parallelism (FSDP, ZeRO-3) over an ``fsdp`` mesh axis.

Sources: ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020); PyTorch FSDP (Zhao et al.,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB
2023); MaxText's ``fsdp`` axis and torchtitan's ``fully_shard``, whose
parameters are global arrays split along a dimension, as here.

The batch splits over ``data x fsdp``: every device is a data replica, as on
``data:D*F``, and draws the same rows and dropout keys as that run's device of
the same rank. Each parameter leaf is split over ``fsdp`` along one dimension
(:func:`trjax.parallel.shards.shard_dims`), and so are its gradient, its optimizer state
and its EMA:
between steps a device holds 1/F of them. A checkpoint stays a tree of the
unsplit leaves, so it restores onto any other mesh. Per step and device:

1. one all-gather over ``fsdp`` per bucket of the MemoryPlan gives the full
   parameters (:func:`trjax.parallel.shards.gather`);
2. data parallelism's forward and backward on them;
3. one reduce-scatter over ``fsdp`` per bucket, in the plan's order (deep
   first, the seed's order): each device receives the sum of its own 1/F
   slice of the bucket's gradients (:func:`reduce_scatter`). The metric sums
   and the few leaves that stay whole (no dimension divides by F) ride in the
   same reduce-scatter, tiled F times, so every device receives their whole sum;
4. the exchange all-reduces these 1/F shards over ``data`` (hybrid sharding,
   HSDP, when D > 1) and updates them; a non-finite flag is summed over
   ``fsdp`` so every device applies or skips the same update.

By default the gathered parameters stay live from the forward into the backward
(torchtitan's ``reshard_after_forward=False``), so a step sends one all-gather
and one reduce-scatter of the parameters over ``fsdp``: 2(F-1)/F |params| per
device, as data parallelism's all-reduce. ``config.fsdp_reshard_after_forward``
(:func:`regathering`) frees the forward's copy and gathers each bucket again in
the backward: ZeRO-3's 3(F-1)/F.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import collectives
from trjax.metrics import METRICS
from trjax.parallel.layout import Layout
from trjax.parallel.shards import (bucket_groups, combined_specs, gather, local_shapes,
                                   shard_dims, to_rows)
from trjax.plan import build_plan
from trjax.world import DATA_AXIS, FSDP_AXIS


def reduce_scatter(grads, sums, dims, groups, metrics_bucket: str, size: int):
    """Gradient sums of this device's shards, inside ``shard_map``: one
    ``psum_scatter`` over ``fsdp`` per bucket, in ``groups``' order, each
    chained after the one before (:func:`trjax.collectives.after`). A leaf that
    stays whole, and ``sums`` (the metric sums ``[4]``, in ``metrics_bucket``),
    enter tiled ``size`` times, so each device receives their whole sum.

    Returns:
      ``(grads, sums)``: this device's shard of each gradient leaf (whole
      leaves whole), summed over ``fsdp``; the metric sums over ``fsdp``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flat_dims = treedef.flatten_up_to(dims)
    out, previous = list(leaves), None
    for bucket, idx in groups:
        parts = [to_rows(leaves[i], flat_dims[i], size) if flat_dims[i] is not None
                 else jnp.broadcast_to(leaves[i].reshape(1, -1), (size, leaves[i].size))
                 for i in idx]
        if bucket == metrics_bucket:
            parts.append(jnp.broadcast_to(sums.reshape(1, -1), (size, sums.size)))
        rows = jnp.concatenate(parts, axis=1)
        if previous is not None:
            rows = collectives.after(rows, previous)
        mine = previous = lax.psum_scatter(rows, FSDP_AXIS, scatter_dimension=0, tiled=False)
        off = 0
        for i, part in zip(idx, parts):
            n = part.shape[1]
            shape = leaves[i].shape if flat_dims[i] is None else \
                tuple(s // size if k == flat_dims[i] else s for k, s in enumerate(leaves[i].shape))
            out[i] = mine[off:off + n].reshape(shape)
            off += n
        if bucket == metrics_bucket:
            sums = mine[off:off + sums.size]
    return jax.tree_util.tree_unflatten(treedef, out), sums


def fsdp_forward_backward(inner, dims, groups, metrics_bucket, size, reshard,
                          params, batch_stats, batch, options, loss_scale, rng):
    """:func:`trjax.parallel.shards.gather`, the inner layout's forward and backward on what
    it holds
    (``inner``: data parallelism's, :func:`trjax.parallel.layout.data_forward_backward`
    over the batch axes, or a tensor-parallel or pipeline layout's), then
    :func:`reduce_scatter`. With ``reshard`` (``config.fsdp_reshard_after_forward``)
    the gather runs inside the differentiated objective instead
    (:func:`regathering`): the forward's copy dies after the forward and the
    backward gathers each bucket again. The layout binds all but the last six
    arguments."""
    if reshard:
        slot = jax.tree_util.tree_map(  # what the gradient is taken against: never read
            lambda x, d: jnp.zeros(x.shape if d is None else x.shape[:d] + (
                x.shape[d] * size,) + x.shape[d + 1:], x.dtype), params, dims)
        wrap = functools.partial(regathering, params, dims, groups, size)
        grads, sums, bn_sums, rules = inner(slot, batch_stats, batch,
                                            options._replace(objective_wrap=wrap), loss_scale,
                                            rng)
    else:
        full = gather(params, dims, groups, size, FSDP_AXIS)
        grads, sums, bn_sums, rules = inner(full, batch_stats, batch, options, loss_scale, rng)
    grads, sums = reduce_scatter(grads, sums, dims, groups, metrics_bucket, size)
    return grads, sums, bn_sums, rules


def _over_fsdp(eqn_params) -> bool:
    axes = eqn_params.get("axis_name", ())
    return FSDP_AXIS in (axes if isinstance(axes, tuple) else (axes,))


def _signature(prim, avals, params) -> tuple:
    """An equation as the policy sees it: primitive, operand shapes and dtypes, and
    its parameters (less the output sharding, which ``shard_map`` may fill in)."""
    return (prim.name, tuple((tuple(a.shape), str(a.dtype)) for a in avals),
            repr(sorted((k, v) for k, v in params.items() if k != "sharding")))


def gather_signatures(shards, dims, groups, size: int) -> frozenset:
    """The :func:`_signature` of every equation of :func:`trjax.parallel.shards.gather`
    on ``shards`` (arrays or ``ShapeDtypeStruct`` of one device's slices): the
    packing, the all-gathers and the unpacking into whole leaves, which
    :func:`reshard_policy` recomputes in the backward."""
    jaxpr = jax.make_jaxpr(lambda p: gather(p, dims, groups, size, FSDP_AXIS),
                           axis_env=[(FSDP_AXIS, size)])(shards)
    return frozenset(_signature(e.primitive, [v.aval for v in e.invars], e.params)
                     for e in jaxpr.jaxpr.eqns)


def derived_signatures(objective, params, *args) -> frozenset:
    """The :func:`_signature` of every equation of ``objective(params, *args)`` whose
    operands all derive from ``params`` alone (a kernel cast to the compute dtype,
    reshaped for a matrix product, ...), nested jaxprs (``jit``, ``custom_jvp``)
    included: saved for the backward, each would keep a copy of the whole
    parameters, so :func:`reshard_policy` recomputes them after the re-gather.
    ``objective`` is traced once more for this (no compile)."""
    jaxpr = jax.make_jaxpr(objective)(params, *args)
    derived = set(jaxpr.jaxpr.invars[:len(jax.tree_util.tree_leaves(params))])
    out: set = set()
    _walk(jaxpr.jaxpr, derived, out)
    return frozenset(out)


def _walk(jaxpr, derived: set, out: set) -> None:
    from jax.extend.core import Literal
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, Literal)]
        if ins and all(v in derived for v in ins):
            derived.update(e.outvars)
            out.add(_signature(e.primitive, [v.aval for v in e.invars], e.params))
        for sub in e.params.values():
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns") and len(inner.invars) == len(e.invars):
                derived.update(w for v, w in zip(e.invars, inner.invars)
                               if not isinstance(v, Literal) and v in derived)
                _walk(inner, derived, out)


def reshard_policy(signatures: frozenset):
    """The ``jax.checkpoint`` policy of :func:`regathering`: every value is saveable
    (kept for the backward, as without a checkpoint) except those of the gather,
    which the backward computes again: the all-gathers over ``fsdp``, the equations
    in ``signatures`` (:func:`gather_signatures`: the slices, reshapes and transposes
    from the gathered rows to the whole leaves; :func:`derived_signatures`: what the
    model computes from the parameters alone; saved, any of them would keep a copy
    of the whole parameters) and the gather's ``custom_vjp`` call when jax presents
    it as one equation. jax applies the outermost checkpoint's policy to every checkpoint
    inside it, so ``config.remat`` is refused with it
    (:func:`trjax.parallel.mesh.check_config`)."""
    def policy(prim, *avals, **params) -> bool:
        if prim.name == "all_gather":
            return not _over_fsdp(params)
        if prim.name.startswith("custom_vjp_call"):
            body = params.get("call_jaxpr", params.get("fun_jaxpr"))
            body = getattr(body, "jaxpr", body)
            return not any(e.primitive.name == "all_gather" and _over_fsdp(e.params)
                           for e in getattr(body, "eqns", ()))
        return _signature(prim, avals, params) not in signatures
    return policy


def regathering(shards, dims, groups, size, objective):
    """``objective`` (``(params, micro, index) -> (loss, aux)`` on the whole
    parameters, :func:`trjax.objective.forward_backward`'s) as a function of a
    stand-in ``slot`` of the whole parameters' shapes whose values are never read:
    inside ``jax.checkpoint`` (:func:`reshard_policy`) the parameters are
    :func:`trjax.parallel.shards.gather` ed from ``shards``, one all-gather per
    bucket, through a ``custom_vjp`` whose backward hands the cotangent of the whole
    parameters to ``slot``. The gradient with respect to ``slot`` is thus the
    gradient with respect to the whole parameters, as without resharding; the
    gathered parameters are not kept for the backward, which gathers them again
    (FSDP2's ``reshard_after_forward=True``, ZeRO-3's re-gather).

    Args:
      shards: this device's slices (the state's parameters inside ``shard_map``).
      dims, groups, size: as for :func:`trjax.parallel.shards.gather`.
      objective: the function to wrap.

    Returns:
      ``(slot, micro, index) -> (loss, aux)``.
    """
    @jax.custom_vjp
    def regather(slot, held):
        return gather(held, dims, groups, size, FSDP_AXIS)

    def forward(slot, held):
        return gather(held, dims, groups, size, FSDP_AXIS), None

    def backward(_, cotangent):
        return cotangent, None

    regather.defvjp(forward, backward)
    held = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shards)

    def wrapped(slot, micro, index):
        policy = reshard_policy(gather_signatures(held, dims, groups, size)
                                | derived_signatures(objective, slot, micro, index))
        body = jax.checkpoint(lambda slot, micro, index, shards: objective(
            regather(slot, shards), micro, index), policy=policy, prevent_cse=True)
        return body(slot, micro, index, shards)
    return wrapped


def traffic(dims, params, size: int, itemsize: int = 4, gathers: int = 1) -> dict:
    """What one step issues over ``fsdp`` per device, as
    :func:`trjax.comm.by_axis` counts it (each collective's result bytes):
    ``all_gather`` = the split leaves' whole bytes, ``gathers`` times (1; with
    ``config.fsdp_reshard_after_forward`` 2: the backward's re-gather);
    ``reduce_scatter`` = their 1/F shards plus the whole leaves and metric sums;
    ``ring`` the bytes a ring sends: (F-1)/F of each all-gather's result and of
    each reduce-scatter's input, (gathers + 1)(F-1)/F |params| in all (2(F-1)/F
    without resharding, 3(F-1)/F with it)."""
    leaves = jax.tree_util.tree_leaves(params)
    flat_dims = jax.tree_util.tree_structure(params).flatten_up_to(dims)
    split = sum(math.prod(x.shape) for x, d in zip(leaves, flat_dims) if d is not None)
    whole = sum(math.prod(x.shape) for x, d in zip(leaves, flat_dims) if d is None)
    scattered = split // size + whole + len(METRICS)
    f = (size - 1) / size
    return {"all_gather": gathers * split * itemsize, "reduce_scatter": scattered * itemsize,
            "ring": f * gathers * split * itemsize + f * size * scattered * itemsize,
            "params_bytes": (split + whole) * itemsize, "whole_leaves": whole,
            "gathers": gathers}


REGATHER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""XLA options of a train step that re-gathers (XLA:CPU; other platforms keep the
barriers anyway): ``jax.checkpoint``'s optimization barriers stay, so CSE does not
merge the backward's all-gathers into the forward's (:mod:`trjax.cpu.host`)."""


def layout(base: Layout, buckets: str = "two", reshard: bool = False) -> Layout:
    """``base`` with what each of its devices holds sharded over ``fsdp`` (FSDP /
    ZeRO-3): the batch splits over ``data x fsdp`` (the world's ``axis_name``),
    each leaf of ``base``'s slice splits along one more dimension
    (:func:`trjax.parallel.shards.combined_specs`), the all-gather over ``fsdp``
    gives it back, ``base``'s step runs on it, and the reduce-scatter hands back
    each shard's gradient.

    Args:
      base: the layout FSDP is laid over on the same world: data parallelism
        over ``data x fsdp`` (any ``bn_mode``), or a tensor-parallel
        (``data:D,fsdp:F,model:T``) or pipeline (``data:D,fsdp:F,stage:S[,model:T]``)
        one built on it.
      buckets: the MemoryPlan's bucket policy (``config.buckets``): one
        all-gather and one reduce-scatter per bucket.
      reshard: ``config.fsdp_reshard_after_forward``: the gathered parameters
        are freed after the forward and the backward gathers each bucket again
        (:func:`regathering`): two all-gathers per bucket and step (one
        micro-batch: :func:`trjax.parallel.mesh.check_config` refuses
        accumulation with it). ``False``: one all-gather per bucket and step,
        kept through the backward.

    Raises:
      ValueError: a model none of whose parameters divide by the axis size
        (nothing would be sharded).
    """
    net, sizes = base.model, dict(base.world.axes)
    size = sizes[FSDP_AXIS]
    params = net.abstract_variables(base.image_shape)["params"]
    own = local_shapes(params, base.params, sizes)  # what a device of base holds
    dims = shard_dims(own, size)
    flat_dims = jax.tree_util.tree_structure(params).flatten_up_to(dims)
    if size > 1 and all(d is None for d in flat_dims):
        raise ValueError(f"fsdp:{size}: no parameter of {type(net.module).__name__} has a "
                         f"dimension divisible by {size}, so nothing would be sharded; use a "
                         "smaller fsdp size or the data axis only")
    specs, stats = combined_specs(dims, base.params, FSDP_AXIS), base.batch_stats
    local = lambda p, s: (local_shapes(p, specs, sizes),  # noqa: E731
                          s if isinstance(stats, P) else local_shapes(s, stats, sizes))
    plan = build_plan(net, base.image_shape, buckets, local=local)
    groups, metrics_bucket = bucket_groups(plan), plan.metrics_slot[0]
    own_gather = functools.partial(gather, dims=dims, groups=groups, size=size,
                                   axis_name=FSDP_AXIS)
    whole = [jax.tree_util.keystr(p) for (p, _), d in
             zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_dims) if d is None]
    gathers = 2 if reshard else 1
    again = ", again in the backward" if reshard else ""
    labels = {FSDP_AXIS: {"all-gather": f"fsdp:parameters (all-gather per bucket{again})",
                          "reduce-scatter": "fsdp:gradients (reduce-scatter per bucket)",
                          "all-reduce": "fsdp:non-finite flag"}}
    line = (f"fsdp: parameters, gradients and optimizer state split {size}-way over "
            f"'{FSDP_AXIS}' ({len(flat_dims) - len(whole)} of {len(flat_dims)} leaves; "
            f"{len(whole)} small leaves whole); batch over data x fsdp"
            + ("; resharded after the forward (the backward gathers again)" if reshard else ""))
    return dataclasses.replace(
        base, forward_backward=functools.partial(fsdp_forward_backward, base.forward_backward,
                                                 dims, groups, metrics_bucket, size,
                                                 bool(reshard)),
        grad_axes=DATA_AXIS if sizes[DATA_AXIS] > 1 else (), params=specs, check_vma=False,
        local_shapes=local, strategies=("fsdp",) + base.strategies,
        gather=lambda p: base.gather(own_gather(p)),
        split_axes=(FSDP_AXIS,) + base.split_axes,
        details={**base.details, "fsdp_size": size, "fsdp_whole_leaves": whole,
                 "fsdp_reshard_after_forward": bool(reshard),
                 "fsdp_traffic_bytes": traffic(dims, own, size, gathers=gathers)},
        compile_options={**base.compile_options, **(REGATHER_OPTIONS if reshard else {})},
        collective_labels={**base.collective_labels, **labels},
        line="; ".join(x for x in (line, base.line) if x))
