"""The explicit collectives of data-parallel training, as pure functions.

Everything here runs inside ``jax.shard_map`` over the data axis; each
``lax.psum`` is one all-reduce, which XLA lowers to NCCL on GPUs (and to its
own in-process or gloo implementation on CPU).

* :func:`allreduce_buckets` -- the gradient sync: ONE all-reduce per bucket,
  ``deep`` first, ``first`` second (the seed's DEEP_COMM / FIRST_COMM).
* :func:`allreduce_batch_stats` -- the seed's STATS_COMM: every layer's BN
  batch sums ``(sum (x - r), sum (x - r)^2, n)`` added over replicas, as one buffer.
* :func:`broadcast_from_rank0` -- every replica takes rank 0's bits.
* :func:`allreduce_sums` -- exact global sums of metric accumulators.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax



def as_varying(x: jax.Array, axes) -> jax.Array:
    """``x`` typed as varying over the mesh axis ``axes`` (a name or a tuple of
    names), casting only over those it is not varying over yet (a no-op when
    none is missing, and under ``check_vma=False`` where nothing is typed).

    Loop carries, ``lax.switch`` branches and a ``custom_vjp``'s cotangents
    must keep one type; a ``ppermute`` result is varying, so an invariant value
    (a replicated constant) is cast up front. Reads the type with
    ``jax.typeof`` (``manual_axis_type.varying`` from jax 0.10, ``vma`` before).
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    have = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
    missing = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


def after(x: jax.Array, done: jax.Array) -> jax.Array:
    """Returns ``x`` unchanged, bit for bit, but data-dependent on ``done``.

    XLA's all-reduce combiner (``cpu-all-reduce-combiner`` on CPU; on GPU the
    combiner steered by ``--xla_gpu_all_reduce_combine_threshold_bytes``)
    merges *independent* all-reduces into one, which would erase the buckets;
    ``lax.optimization_barrier`` does not stop it. A data dependency does: the
    bits of ``x`` get an unsigned integer ``min(bits(done[0]), 0)`` added,
    which is always 0. Integer arithmetic cannot round, flush subnormals or
    propagate NaN, so every bit of ``x`` survives (a float ``x + 0`` would
    flush subnormals on CPU and turn NaN in ``done`` into NaN in ``x``).
    """
    width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    d = lax.bitcast_convert_type(done.reshape(-1)[:1], width[done.dtype.itemsize])
    udtype = width[x.dtype.itemsize]
    zero = jnp.minimum(d[0], 0).astype(udtype)  # a scalar: any shape of x
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, udtype) + zero, x.dtype)


def allreduce_buckets(buffers: Mapping[str, jax.Array], axis_name: str,
                      chain: bool = True, reduce_fn=None) -> dict[str, jax.Array]:
    """Sums each bucket buffer over the data axis with one all-reduce per bucket.

    The buckets are reduced in the order of ``buffers``. With ``chain`` each
    bucket's input is made to depend on the previous bucket's result with
    :func:`after`, so XLA keeps exactly one all-reduce per bucket, in that
    order. The first bucket's all-reduce (``deep`` under the seed's policy)
    depends only on its own gradients and the metrics, so it can run while the
    first layer's backward is still computing. ``chain=False`` leaves XLA free
    to merge them (the per-leaf baseline, as a plain flax step would).

    Args:
      buffers: ``{bucket: [n_bucket] float32}``, per-device partial sums.
      axis_name: the data axis.
      chain: keep the buckets separate and ordered.
      reduce_fn: ``(x, axis_name) -> sum`` to use instead of ``lax.psum``
        (see :mod:`trjax.allreduce`).

    Returns:
      ``{bucket: [n_bucket]}``: the sums over all devices (NOT divided by the
      world size: the caller applies ``1/global_count`` exactly once, fused
      into the optimizer update).
    """
    reduce_fn = reduce_fn or lax.psum
    out: dict[str, jax.Array] = {}
    previous = None
    for name, x in buffers.items():
        if chain and previous is not None:
            x = after(x, previous)
        out[name] = previous = reduce_fn(x, axis_name)
    return out


def allreduce_batch_stats(stats_buffer: jax.Array, axis_name: str, done: jax.Array | None = None):
    """Global BN batch sums, in one all-reduce (the seed's STATS_COMM).

    The buffer holds, per BatchNorm layer, ``(sum (x - r) [C], sum (x - r)^2 [C],
    n)`` of this replica's real rows, ``r`` the layer's running mean (the same
    on every replica in ``running`` mode, so the shifted sums add over replicas
    as plain sums do; see :mod:`trjax.batchnorm`, "Precision"); the SUM over
    replicas is the global batch's sums, so the running statistics computed from it
    (:func:`trjax.batchnorm.update_running_tree`) weight every replica by its
    real row count: a replica holding only padding adds zeros. (The seed
    averaged the replicas' running statistics with equal weight instead.)

    Args:
      stats_buffer: ``[n_stats] float32``, the packed sums (counts included).
      axis_name: the data axis.
      done: optional array the reduction must follow (the last gradient
        bucket), so the combiner cannot fold it into a gradient all-reduce.

    Returns:
      ``[n_stats]``: the sum over replicas, bitwise identical on every replica.
    """
    if done is not None:
        stats_buffer = after(stats_buffer, done)
    return lax.psum(stats_buffer, axis_name)


def broadcast_from_rank0(tree, axis_name: str):
    """Every replica receives rank 0's values, bit for bit.

    Implemented as one all-reduce of the raw bits: rank 0 contributes its
    values reinterpreted as unsigned integers, every other rank zeros, so the
    integer sum is exactly rank 0's bits (NaNs and signed zeros included).
    This is the seed's ``broadcast_from_rank0`` (``ncclBroadcast`` with root
    0) expressed with ``psum``.

    Args:
      tree: pytree of per-device (varying) arrays of 16/32/64-bit dtypes.
      axis_name: the data axis.

    Returns:
      The same pytree, replicated (invariant) and equal to rank 0's input.
    """
    is_root = lax.axis_index(axis_name) == 0
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if {x.dtype.itemsize for x in leaves} - set(uint):
        raise ValueError("broadcast_from_rank0 handles 16/32/64-bit leaves only")
    out = list(leaves)
    for itemsize, udtype in uint.items():  # one all-reduce per element width
        idx = [i for i, x in enumerate(leaves) if x.dtype.itemsize == itemsize]
        if not idx:
            continue
        bits = jnp.concatenate([lax.bitcast_convert_type(leaves[i], udtype).ravel() for i in idx])
        bits = lax.psum(jnp.where(is_root, bits, jnp.zeros_like(bits)), axis_name)
        offset = 0
        for i in idx:
            x = leaves[i]
            out[i] = lax.bitcast_convert_type(bits[offset:offset + x.size].reshape(x.shape), x.dtype)
            offset += x.size
    return jax.tree_util.tree_unflatten(treedef, out)


def allreduce_sums(x: jax.Array, axis_name: str) -> jax.Array:
    """Exact global sums of per-device accumulators (one all-reduce)."""
    return lax.psum(x, axis_name)
