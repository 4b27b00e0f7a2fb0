"""Fully sharded data parallelism (FSDP, ZeRO-3) over an ``fsdp`` mesh axis.

Sources: ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020); PyTorch FSDP (Zhao et al.,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB
2023); MaxText's ``fsdp`` axis and torchtitan's ``fully_shard``, whose
parameters are global arrays split along a dimension, as here.

The batch splits over ``data x fsdp``: every device is a data replica, as on
``data:D*F``, and draws the same rows and dropout keys as that run's device of
the same rank. Each parameter leaf is split over ``fsdp`` along one dimension
(:func:`shard_dims`), and so are its gradient, its optimizer state and its EMA:
between steps a device holds 1/F of them. A checkpoint stays a tree of the
unsplit leaves, so it restores onto any other mesh. Per step and device:

1. one all-gather over ``fsdp`` per bucket of the MemoryPlan gives the full
   parameters (:func:`gather`);
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

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import collectives, models, tensor
from trjax.metrics import METRICS
from trjax.parallel.layout import Layout, check_bn_mode, data_forward_backward
from trjax.plan import build_plan

FSDP_AXIS = "fsdp"


def shard_dims(params, size: int):
    """The dimension each leaf is split along over ``fsdp``: the last one whose
    length divides by ``size`` (a conv kernel's output channels, a dense
    kernel's inputs when its classes do not divide), or ``None``: the leaf stays
    whole on every device (a bias of 10 classes on 4 devices). A tree of
    ``int | None`` like ``params`` (arrays or ``ShapeDtypeStruct``)."""
    def dim(x):
        fits = [d for d, n in enumerate(x.shape) if n % size == 0 and n >= size]
        return fits[-1] if fits else None
    return jax.tree_util.tree_map(dim, params)


def param_specs(dims, axis: str = FSDP_AXIS):
    """``PartitionSpec`` per leaf of ``dims`` (:func:`shard_dims`): ``axis`` on its
    dimension, ``P()`` for a whole leaf."""
    return jax.tree_util.tree_map(lambda d: P() if d is None else P(*([None] * d + [axis])),
                                  dims, is_leaf=lambda x: x is None)


def bucket_groups(plan) -> list[tuple[str, list[int]]]:
    """``[(bucket, [leaf index, ...]), ...]`` in the plan's bucket order (the
    order of its collectives), each bucket's leaves in their order in it; the
    index is a leaf's position in the flattened parameter tree."""
    members: dict = {b: [] for b in plan.bucket_elements}
    for i, slot in sorted(enumerate(plan.slots), key=lambda s: s[1].offset):
        members[slot.bucket].append(i)
    return [(b, m) for b, m in members.items() if m]


def to_rows(g, d, size):
    """``[size, n/size]``: row k is device k's slice of ``g`` along ``d`` (flat)."""
    shape = g.shape[:d] + (size, g.shape[d] // size) + g.shape[d + 1:]
    return jnp.moveaxis(g.reshape(shape), d, 0).reshape(size, -1)


def from_rows(rows, d, local_shape):
    """Inverse of :func:`to_rows`: ``[size, n/size]`` -> the whole leaf."""
    size = rows.shape[0]
    x = jnp.moveaxis(rows.reshape((size,) + tuple(local_shape)), 0, d)
    shape = tuple(local_shape[:d]) + (size * local_shape[d],) + tuple(local_shape[d + 1:])
    return x.reshape(shape)


def gather(params, dims, groups, size: int, axis_name: str = FSDP_AXIS):
    """The whole parameters from this device's shards, inside ``shard_map``:
    one ``all_gather`` over ``axis_name`` (``fsdp``) per bucket (the last bucket of ``groups``,
    which holds the first conv the forward needs first, first); a leaf that
    stays whole is used as it is. ``params``: this device's tree; returns the
    tree of whole leaves (the same dtypes)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    flat_dims = treedef.flatten_up_to(dims)
    out = list(leaves)
    for _, idx in reversed(groups):
        split = [i for i in idx if flat_dims[i] is not None]
        if not split:
            continue
        rows = lax.all_gather(jnp.concatenate([leaves[i].reshape(-1) for i in split]),
                              axis_name, axis=0, tiled=False)  # [size, sum of local sizes]
        off = 0
        for i in split:
            n = leaves[i].size
            out[i] = from_rows(rows[:, off:off + n], flat_dims[i], leaves[i].shape)
            off += n
    return jax.tree_util.tree_unflatten(treedef, out)


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
    """:func:`gather`, the inner layout's forward and backward on what it holds
    (``inner``: data parallelism's, :func:`trjax.parallel.layout.data_forward_backward`
    over the batch axes, or a tensor-parallel or pipeline layout's), then
    :func:`reduce_scatter`. The layout binds all but the last six arguments."""
    full = gather(params, dims, groups, size)
    grads, sums, bn_sums, rules = inner(full, batch_stats, batch, options, loss_scale, rng)
    grads, sums = reduce_scatter(grads, sums, dims, groups, metrics_bucket, size)
    return grads, sums, bn_sums, rules


def _axes(*names) -> tuple:
    """The flat tuple of axis names in ``names`` (names, tuples of names, ``None``)."""
    out = []
    for n in names:
        if n is not None:
            out.extend(n if isinstance(n, tuple) else (n,))
    return tuple(dict.fromkeys(out))


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


def combined_specs(dims, inner, axis: str):
    """``PartitionSpec`` per leaf: ``inner``'s (e.g. the tensor plan's over ``model``)
    with ``axis`` added on the leaf's dimension ``dims`` picks (:func:`shard_dims` of
    the ``inner``-local shapes). On a dimension ``inner`` splits already the entry
    becomes ``(inner's axis, axis)``: each ``inner`` slice is split again over
    ``axis``, so an all-gather over ``axis`` gives back the ``inner`` slice."""
    def one(d, spec):
        if d is None:
            return spec
        entries = list(spec) + [None] * (d + 1 - len(spec))
        e = entries[d]
        entries[d] = axis if e is None else (tuple(e) if isinstance(e, tuple) else (e,)) + (axis,)
        return P(*entries)
    return jax.tree_util.tree_map(one, dims, inner, is_leaf=lambda x: x is None or isinstance(x, P))


def layout(model, world, image_shape, bn_mode: str = "sync", buckets: str = "two",
           base: Layout | None = None) -> Layout:
    """The FSDP :class:`Layout` on a world with an ``fsdp`` axis (its batch axes
    ``world.axis_name == ("data", "fsdp")``), alone or over a tensor-parallel one.

    Args:
      model: a :class:`trjax.models.Network` or flax module (any model).
      world: a world whose mesh has an ``fsdp`` axis.
      image_shape: ``(H, W, C)``.
      bn_mode: ``running``, ``sync`` or ``local`` (as data parallelism over
        ``data x fsdp``).
      buckets: the MemoryPlan's bucket policy (``config.buckets``): one
        all-gather and one reduce-scatter per bucket.
      base: the layout FSDP is laid over on the same world, or ``None`` (data
        parallelism): a tensor-parallel one (:func:`trjax.parallel.tensor.layout`;
        ``data:D,fsdp:F,model:T``) or a pipeline (:func:`trjax.parallel.pipeline.layout`;
        ``data:D,fsdp:F,stage:S[,model:T]``). FSDP then shards what each device of
        ``base`` holds (its specs combined with ``fsdp``, :func:`combined_specs`): the
        all-gather over ``fsdp`` gives it back, ``base``'s step runs on it, and the
        reduce-scatter hands back each shard's gradient.

    Raises:
      ValueError: an unknown ``bn_mode``; a model none of whose parameters
        divide by the axis size (nothing would be sharded).
    """
    check_bn_mode(bn_mode, what="an 'fsdp' axis")
    net, axes = models.as_network(model), world.axis_name
    sizes = dict(world.axes)
    size = sizes[FSDP_AXIS]
    params = net.abstract_variables(image_shape)["params"]
    inner = jax.tree_util.tree_map(lambda _: P(), params) if base is None else base.params
    own = tensor.local_shapes(params, inner, sizes)  # a model slice (the whole leaf alone)
    dims = shard_dims(own, size)
    flat_dims = jax.tree_util.tree_structure(params).flatten_up_to(dims)
    if size > 1 and all(d is None for d in flat_dims):
        raise ValueError(f"fsdp:{size}: no parameter of {type(net.module).__name__} has a "
                         f"dimension divisible by {size}, so nothing would be sharded; use a "
                         "smaller fsdp size or the data axis only")
    specs = combined_specs(dims, inner, FSDP_AXIS)
    stats = (P(axes) if bn_mode == "local" else P()) if base is None else base.batch_stats
    local = lambda p, s: (tensor.local_shapes(p, specs, sizes),  # noqa: E731
                          s if isinstance(stats, P) else tensor.local_shapes(s, stats, sizes))
    network = net if base is None else base.network
    inner_step = functools.partial(data_forward_backward, net, bn_mode, axes) if base is None \
        else base.forward_backward
    plan = build_plan(net, image_shape, buckets, local=local)
    groups, metrics_bucket = bucket_groups(plan), plan.metrics_slot[0]
    own_gather = functools.partial(gather, dims=dims, groups=groups, size=size)
    per_replica = bn_mode == "local"
    t = traffic(dims, own, size)
    whole = [jax.tree_util.keystr(p) for (p, _), d in
             zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_dims) if d is None]
    labels = {FSDP_AXIS: {"all-gather": "fsdp:parameters (all-gather per bucket)",
                          "reduce-scatter": "fsdp:gradients (reduce-scatter per bucket)",
                          "all-reduce": "fsdp:non-finite flag"}}
    line = (f"fsdp: parameters, gradients and optimizer state split {size}-way over "
            f"'{FSDP_AXIS}' ({len(flat_dims) - len(whole)} of {len(flat_dims)} leaves; "
            f"{len(whole)} small leaves whole); batch over data x fsdp")
    return Layout(
        world=world, model=net, network=network, image_shape=tuple(image_shape), bn_mode=bn_mode,
        forward_backward=functools.partial(fsdp_forward_backward, inner_step, dims, groups,
                                           metrics_bucket, size),
        grad_axes="data" if sizes["data"] > 1 else (),
        bn_reduce_axes=(axes if bn_mode == "running" else None) if base is None else
        base.bn_reduce_axes,
        per_replica_stats=per_replica, params=specs, batch_stats=stats,
        folded=(P(axes) if per_replica else P()) if base is None else base.folded,
        check_vma=False, local_shapes=local,
        kind="fsdp" if base is None else f"fsdp+{base.kind}",
        gather=own_gather if base is None or base.gather is None else
        (lambda p: base.gather(own_gather(p))),
        # a model rank holds its own slices too: every device skips or applies together
        finite_axes=_axes(FSDP_AXIS, None if base is None else base.finite_axes,
                          tensor.TENSOR_AXIS if tensor.TENSOR_AXIS in sizes else None),
        point_to_point=None if base is None else base.point_to_point,
        details={**({} if base is None else base.details), "fsdp_size": size,
                 "fsdp_whole_leaves": whole, "fsdp_traffic_bytes": t},
        collective_labels=labels if base is None else {**base.collective_labels, **labels},
        line=line if base is None else f"{line}; {base.line}")
