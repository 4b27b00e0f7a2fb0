"""Megatron's mappings between replicated and model-split values, inside ``shard_map``.

Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3: a column-parallel
layer (output channels split over the ``model`` axis) followed by a
row-parallel one (input channels split) needs ONE all-reduce forward (``g``,
after the row layer) and ONE backward (``f``, of the column layer's input
cotangent); a column layer with no row partner (a classifier) all-gathers its
output. :mod:`trjax.parallel.tensor` puts them around flax's own layers.

Why explicit mappings: the train step runs under ``shard_map(check_vma=False)``
(its gradient buckets mix model-split and replicated leaves), and there
autodiff inserts no ``f``: a replicated value entering model-split compute gets
no backward all-reduce, and plain ``lax.psum`` transposes to ``psum`` (measured,
jax 0.10.2: a ``T``-times gradient), not to the identity. So these are
``jax.custom_vjp`` pairs, as in ``megatron/core/tensor_parallel/mappings.py``.
They are typed for ``check_vma=True`` too (``f`` casts to varying, the gather
is typed invariant), so they give the same gradients there.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from trjax.collectives import as_varying


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_model(x, axis: str):
    """Megatron's ``f``: the identity forward, ``psum`` over ``axis`` backward.

    Put it on a value replicated over ``axis`` (the same on every model rank)
    where it enters model-split compute (a column-parallel layer): each rank's
    cotangent is then only its slice's part, and their sum is the gradient.

    Args:
      x: any array (any dtype, any shape), replicated over ``axis``.
      axis: a mesh axis name bound by the enclosing ``shard_map``.

    Returns:
      ``x`` itself.

    Source: ``copy_to_tensor_model_parallel_region`` /
    ``_CopyToModelParallelRegion`` in ``megatron/core/tensor_parallel/mappings.py``.
    """
    return as_varying(x, axis)


def _copy_fwd(x, axis):
    return as_varying(x, axis), None


def _copy_bwd(axis, _, ct):
    return (lax.psum(ct, axis),)


copy_to_model.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_model(x, axis: str):
    """Megatron's ``g``: ``psum`` over ``axis`` forward, the identity backward.

    Put it after a row-parallel layer: each rank holds a partial sum of the
    full output; what follows is replicated, so every rank already holds the
    full cotangent (plain ``lax.psum`` under ``check_vma=False`` would sum
    ``T`` copies of it).

    Args:
      x: ``[...]`` float, this rank's partial sum.
      axis: a mesh axis name bound by the enclosing ``shard_map``.

    Returns:
      ``[...]`` the sum over ``axis``, replicated.

    Source: ``reduce_from_tensor_model_parallel_region`` /
    ``_ReduceFromModelParallelRegion`` in ``megatron/core/tensor_parallel/mappings.py``.
    """
    return lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return lax.psum(x, axis), None


def _reduce_bwd(axis, _, ct):
    return (as_varying(ct, axis),)


reduce_from_model.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_from_model(x, axis: str, dim: int = -1):
    """All-gather of model-split slices into the full array (tiled along ``dim``);
    backward: this rank's slice of the (replicated) cotangent, no collective.

    Args:
      x: ``[..., n, ...]``, this rank's slice along ``dim`` (e.g. the logits
        ``[B, K / T]`` of a column-parallel head).
      axis: a mesh axis name of size ``T`` bound by the enclosing ``shard_map``.
      dim: the dimension to concatenate along (rank ``r``'s slice lands at
        ``[r n, (r + 1) n)``, i.e. in ``lax.axis_index(axis)`` order).

    Returns:
      ``[..., T n, ...]``, the same on every rank.

    Source: ``gather_from_tensor_model_parallel_region`` /
    ``_GatherFromModelParallelRegion`` (backward ``_split_along_last_dim``) in
    ``megatron/core/tensor_parallel/mappings.py``.
    """
    return _gather(x, axis, dim)


def _gather(x, axis, dim):
    # typed invariant ("invarying", jax's all_gather_invariant): under check_vma=True a
    # replicated loss downstream then gets no implicit pcast (whose transpose would psum)
    return lax.all_gather(x, axis, axis=dim % x.ndim, tiled=True, to="invarying")


def _gather_fwd(x, axis, dim):
    return _gather(x, axis, dim), None


def _gather_bwd(axis, dim, _, ct):
    d = dim % ct.ndim
    n = ct.shape[d] // lax.axis_size(axis)
    return (lax.dynamic_slice_in_dim(as_varying(ct, axis), lax.axis_index(axis) * n, n, d),)


gather_from_model.defvjp(_gather_fwd, _gather_bwd)
