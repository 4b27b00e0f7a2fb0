"""The leaf-splitting arithmetic every parallel strategy shares (the ground floor
of :mod:`trjax.parallel`: it imports no strategy, and every strategy imports it).

A parameter leaf is a global array of its whole shape; a ``PartitionSpec``
names, per dimension, the mesh axes it is split over, and inside ``shard_map``
each device sees its slice (:func:`local_shapes`). FSDP and the pipeline's
stage-owned rows split one dimension of each leaf over their axis
(:func:`shard_dims`), on top of what the layout below them split already
(:func:`combined_specs`), and gather it back with one all-gather per bucket
(:func:`gather`), packing slices as rows (:func:`to_rows`, :func:`from_rows`).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def is_spec(x) -> bool:
    return isinstance(x, P)


def spec_tree(specs, tree):
    """``specs`` as a full tree like ``tree``: a single ``PartitionSpec`` (a prefix,
    as the data-parallel layout gives) becomes one per leaf; a tree is returned as is."""
    if isinstance(specs, P):  # None leaves too (shard_dims' whole leaves)
        return jax.tree_util.tree_map(lambda _: specs, tree, is_leaf=lambda x: x is None)
    return specs


def flat_axes(*names) -> tuple:
    """The flat tuple of axis names in ``names`` (names, tuples of names, ``None``),
    each once, in order."""
    out = []
    for n in names:
        if n is not None:
            out.extend(n if isinstance(n, tuple) else (n,))
    return tuple(dict.fromkeys(out))


def path_keys(path) -> tuple:
    """A ``jax.tree_util`` key path as a tuple of strings (``("stage3_block1", "Conv_0",
    "kernel")``)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _local_dim(dim: int, entry, sizes: Mapping[str, int], where: str) -> int:
    if entry is None:
        return dim
    names = entry if isinstance(entry, tuple) else (entry,)
    n = math.prod(int(sizes[a]) for a in names)
    if dim % n:
        raise ValueError(f"{where}: dimension {dim} split over {names} ({n} devices) does not "
                         "divide; choose axis sizes that divide it")
    return dim // n


def local_shapes(tree, specs, sizes: Mapping[str, int]):
    """Per-device shapes of a tree of global arrays laid out by ``specs``.

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` of the whole (global) shapes.
      specs: a matching tree of ``PartitionSpec``, or one spec for every leaf.
      sizes: ``{axis name: size}``, e.g. ``dict(mesh.shape)``.

    Returns:
      A tree of ``jax.ShapeDtypeStruct`` (same dtypes): each dimension divided
      by the product of the sizes of the axes its spec entry names.

    Raises:
      ValueError: a dimension that does not divide, naming the leaf.
    """
    def one(path, leaf, spec):
        shape = tuple(leaf.shape)
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        where = jax.tree_util.keystr(path)
        return jax.ShapeDtypeStruct(
            tuple(_local_dim(d, e, sizes, where) for d, e in zip(shape, entries)), leaf.dtype)
    return jax.tree_util.tree_map_with_path(one, tree, spec_tree(specs, tree), is_leaf=is_spec)


def shard_dims(params, size: int):
    """The dimension each leaf is split along over an axis of ``size`` devices:
    the last one whose length divides by ``size`` (a conv kernel's output
    channels, a dense kernel's inputs when its classes do not divide), or
    ``None``: the leaf stays whole on every device (a bias of 10 classes on 4
    devices). A tree of ``int | None`` like ``params`` (arrays or ``ShapeDtypeStruct``)."""
    def dim(x):
        fits = [d for d, n in enumerate(x.shape) if n % size == 0 and n >= size]
        return fits[-1] if fits else None
    return jax.tree_util.tree_map(dim, params)


def combined_specs(dims, inner, axis: str):
    """``PartitionSpec`` per leaf: ``inner``'s (the layout below's, a tree or one
    spec for all) with ``axis`` added on the leaf's dimension ``dims`` picks
    (:func:`shard_dims` of the ``inner``-local shapes; ``None``: unchanged). On a
    dimension ``inner`` splits already the entry becomes ``(inner's axis, axis)``:
    each ``inner`` slice is split again over ``axis``, so an all-gather over
    ``axis`` gives back the ``inner`` slice."""
    def one(d, spec):
        if d is None:
            return spec
        entries = list(spec) + [None] * (d + 1 - len(spec))
        e = entries[d]
        entries[d] = axis if e is None else (tuple(e) if isinstance(e, tuple) else (e,)) + (axis,)
        return P(*entries)
    return jax.tree_util.tree_map(one, dims, spec_tree(inner, dims),
                                  is_leaf=lambda x: x is None or isinstance(x, P))


def bucket_groups(plan) -> list[tuple[str, list[int]]]:
    """``[(bucket, [leaf index, ...]), ...]`` in the plan's bucket order (the
    order of its collectives), each bucket's leaves in their order in it; the
    index is a leaf's position in the flattened parameter tree. The bucket of
    the metric sums is kept even when it holds no leaf (a small model whose
    leaves all sit in the other bucket): FSDP's reduce-scatter of it is what sums
    the metric sums, the global count included, over ``fsdp``."""
    members: dict = {b: [] for b in plan.bucket_elements}
    for i, slot in sorted(enumerate(plan.slots), key=lambda s: s[1].offset):
        members[slot.bucket].append(i)
    return [(b, m) for b, m in members.items() if m or b == plan.metrics_slot[0]]


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


def gather(params, dims, groups, size: int, axis_name: str):
    """The whole parameters from this device's slices, inside ``shard_map``: one
    ``all_gather`` over ``axis_name`` per bucket (the last bucket of ``groups``,
    which holds the first conv the forward needs first, first); a leaf that
    stays whole (``dims`` ``None``) is used as it is. ``params``: this device's
    tree; returns the tree of whole leaves (the same dtypes)."""
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
