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

The gathered parameters stay live from the forward into the backward
(torchtitan's ``reshard_after_forward=False``), so a step sends one all-gather
and one reduce-scatter of the parameters over ``fsdp``: 2(F-1)/F |params| per
device, as data parallelism's all-reduce; ZeRO-3's re-gather in the backward
(3(F-1)/F) would trade one more all-gather for the gathered parameters' memory.
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


def fsdp_forward_backward(inner, dims, groups, metrics_bucket, size,
                          params, batch_stats, batch, options, loss_scale, rng):
    """:func:`trjax.parallel.shards.gather`, the inner layout's forward and backward on what
    it holds
    (``inner``: data parallelism's, :func:`trjax.parallel.layout.data_forward_backward`
    over the batch axes, or a tensor-parallel or pipeline layout's), then
    :func:`reduce_scatter`. The layout binds all but the last six arguments."""
    full = gather(params, dims, groups, size, FSDP_AXIS)
    grads, sums, bn_sums, rules = inner(full, batch_stats, batch, options, loss_scale, rng)
    grads, sums = reduce_scatter(grads, sums, dims, groups, metrics_bucket, size)
    return grads, sums, bn_sums, rules


def traffic(dims, params, size: int, itemsize: int = 4) -> dict:
    """What one step issues over ``fsdp`` per device, as
    :func:`trjax.comm.by_axis` counts it (each collective's result bytes):
    ``all_gather`` = the split leaves' whole bytes; ``reduce_scatter`` = their
    1/F shards plus the whole leaves and metric sums; ``ring`` the bytes a ring
    sends: (F-1)/F of each all-gather's result and of each reduce-scatter's input."""
    leaves = jax.tree_util.tree_leaves(params)
    flat_dims = jax.tree_util.tree_structure(params).flatten_up_to(dims)
    split = sum(math.prod(x.shape) for x, d in zip(leaves, flat_dims) if d is not None)
    whole = sum(math.prod(x.shape) for x, d in zip(leaves, flat_dims) if d is None)
    scattered = split // size + whole + len(METRICS)
    f = (size - 1) / size
    return {"all_gather": split * itemsize, "reduce_scatter": scattered * itemsize,
            "ring": f * split * itemsize + f * size * scattered * itemsize,
            "params_bytes": (split + whole) * itemsize, "whole_leaves": whole}


def layout(base: Layout, buckets: str = "two") -> Layout:
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
    labels = {FSDP_AXIS: {"all-gather": "fsdp:parameters (all-gather per bucket)",
                          "reduce-scatter": "fsdp:gradients (reduce-scatter per bucket)",
                          "all-reduce": "fsdp:non-finite flag"}}
    line = (f"fsdp: parameters, gradients and optimizer state split {size}-way over "
            f"'{FSDP_AXIS}' ({len(flat_dims) - len(whole)} of {len(flat_dims)} leaves; "
            f"{len(whole)} small leaves whole); batch over data x fsdp")
    return dataclasses.replace(
        base, forward_backward=functools.partial(fsdp_forward_backward, base.forward_backward,
                                                 dims, groups, metrics_bucket, size),
        grad_axes=DATA_AXIS if sizes[DATA_AXIS] > 1 else (), params=specs, check_vma=False,
        local_shapes=local, strategies=("fsdp",) + base.strategies,
        gather=lambda p: base.gather(own_gather(p)),
        split_axes=(FSDP_AXIS,) + base.split_axes,
        details={**base.details, "fsdp_size": size, "fsdp_whole_leaves": whole,
                 "fsdp_traffic_bytes": traffic(dims, own, size)},
        collective_labels={**base.collective_labels, **labels},
        line="; ".join(x for x in (line, base.line) if x))
