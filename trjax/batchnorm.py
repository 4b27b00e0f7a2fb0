"""BatchNorm with explicit cross-device statistics: ``sync``, ``running``, ``local``.

One module, three modes (``BN_MODES``):

* ``sync`` -- SyncBatchNorm (Ioffe & Szegedy 2015 with the statistics of the
  global batch, as PyTorch's ``SyncBatchNorm``): each device computes the sum,
  sum of squares and count of its real (mask = 1) rows per channel; ONE
  ``psum`` over the data axis per layer gives the global values, so N devices
  normalise exactly as one device on the concatenated batch.
* ``running`` -- the seed framework's scheme: the forward pass normalises with
  local batch statistics; after the step the running mean/var are all-reduced
  (see :func:`trjax.collectives.allreduce_batch_stats`) so every replica holds
  identical statistics.
* ``local`` -- no synchronisation at all, for comparison: each replica keeps its
  own running statistics.

Statistics are accumulated in float32 whatever the compute dtype. Rows with
mask 0 (padding) contribute nothing to the statistics, and leave the layer as
zeros (so they stay finite even on a device that holds only padding). The running variance
is the biased (population) variance of the batch, as in flax.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

BN_MODES = ("sync", "running", "local")


def fold_batchnorm(scale, bias, mean, var, epsilon):
    """Folds BatchNorm inference statistics into one per-channel affine.

    Returns ``(a, b)`` with ``a = scale / sqrt(var + epsilon)`` and
    ``b = bias - mean * a``, so ``BN(x) = x * a + b`` (the seed's
    UPDATE_BN_INF_PARAMS). All arguments have shape ``[C]``, float32.
    """
    a = scale * lax.rsqrt(var + epsilon)
    return a, bias - mean * a


def fold_batchnorm_tree(params, batch_stats, epsilon: float = 1e-5):
    """Folds every BatchNorm of a model: the ``bn_folded`` variable collection.

    Args:
      params: the model's params; each BN module holds ``scale``, ``bias``.
      batch_stats: the matching ``mean``, ``var`` per BN module (same paths).
      epsilon: the BatchNorm epsilon.

    Returns:
      A tree with, at every BN module's path, ``{"scale": a, "bias": b}`` from
      :func:`fold_batchnorm`. Pass it as ``{"params": ..., "bn_folded": ...}``
      to ``model.apply(..., train=False)``: each BN then applies only
      ``x * a + b`` (the seed's UPDATE_BN_INF_PARAMS, done once per evaluation).
    """
    def walk(p, s):
        if "mean" in s and "var" in s:
            a, b = fold_batchnorm(p["scale"], p["bias"], s["mean"], s["var"], epsilon)
            return {"scale": a, "bias": b}
        return {k: walk(p[k], v) for k, v in s.items()}
    return walk(params, batch_stats)


def _per_channel(v, x):
    """``[C]`` as ``[1, ..., 1, C]``, to broadcast against ``x [..., C]`` explicitly."""
    return v.reshape((1,) * (x.ndim - 1) + v.shape)


class BatchNorm(nn.Module):
    """BatchNorm over all axes but the last (NHWC), with a data-parallel mode.

    Attributes:
      mode: one of ``BN_MODES``.
      axis_name: the mesh axis to reduce over in ``sync`` mode; ``None``
        (outside ``shard_map``) means a single device.
      momentum: running statistics decay, ``r <- momentum*r + (1-momentum)*batch``.
      epsilon: added to the variance.
      dtype: compute dtype of the output (statistics are always float32).

    Call args:
      x: ``[..., C]`` activations.
      train: use batch statistics and update ``batch_stats``; else use the
        running statistics.
      mask: optional ``[B]`` float/bool, 1 for real rows, 0 for padding; ``B``
        is ``x.shape[0]``.
    """

    mode: str = "sync"
    axis_name: Optional[str] = None
    momentum: float = 0.9
    epsilon: float = 1e-5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool, mask=None):
        if self.mode not in BN_MODES:
            raise ValueError(f"BatchNorm mode {self.mode!r} is not one of {BN_MODES}")
        c = x.shape[-1]
        if not train and self.has_variable("bn_folded", "scale"):
            # Inference with statistics folded ahead of time (fold_batchnorm_tree):
            # one per-channel affine, nothing else.
            a = self.get_variable("bn_folded", "scale").astype(self.dtype)
            b = self.get_variable("bn_folded", "bias").astype(self.dtype)
            return (x * _per_channel(a, x) + _per_channel(b, x)).astype(self.dtype)
        scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32))

        if not train:
            a, b = fold_batchnorm(scale, bias, ra_mean.value, ra_var.value, self.epsilon)
            return (x * _per_channel(a.astype(self.dtype), x)
                    + _per_channel(b.astype(self.dtype), x)).astype(self.dtype)

        xf = x.astype(jnp.float32)
        axes = tuple(range(x.ndim - 1))
        rows_per_example = 1
        for d in x.shape[1:-1]:
            rows_per_example *= d
        if mask is None:
            m = None
            count = jnp.asarray(x.shape[0] * rows_per_example, jnp.float32)
        else:
            m = mask.astype(jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1))
            count = jnp.sum(mask.astype(jnp.float32)) * rows_per_example
        xm = xf if m is None else xf * m
        s1 = jnp.sum(xm, axes)
        s2 = jnp.sum(xm * xf, axes)
        packed = jnp.concatenate([s1, s2, count[None]])
        stats_packed = lax.stop_gradient(packed)
        if self.mode == "sync" and self.axis_name is not None:
            # One all-reduce forward. The explicit cast back to "varying" puts the
            # backward all-reduce (its transpose) on the packed vector: one
            # collective per layer in backward too, instead of one per statistic.
            stats_packed = lax.psum(stats_packed, self.axis_name)
            packed = lax.pcast(lax.psum(packed, self.axis_name), self.axis_name, to="varying")

        def moments(v):
            n = jnp.maximum(v[2 * c], 1.0)
            mean = v[:c] / n
            return mean, jnp.maximum(v[c:2 * c] / n - mean * mean, 0.0), v[2 * c]

        mean, var, _ = moments(packed)
        if not self.is_initializing():
            # Running statistics from the (stop-gradient) replicated copy: they stay
            # replicated ("invariant") across the data axis in sync mode.
            b_mean, b_var, count = moments(stats_packed)
            has_rows = count > 0
            mom = self.momentum
            ra_mean.value = jnp.where(has_rows, mom * ra_mean.value + (1 - mom) * b_mean, ra_mean.value)
            ra_var.value = jnp.where(has_rows, mom * ra_var.value + (1 - mom) * b_var, ra_var.value)

        a = scale * lax.rsqrt(var + self.epsilon)
        b = bias - mean * a
        y = (x * _per_channel(a.astype(self.dtype), x)
             + _per_channel(b.astype(self.dtype), x)).astype(self.dtype)
        if m is not None:
            # Padding rows leave every BN as exact zeros: they cannot grow without
            # bound through layers normalised by other rows' (or no rows') statistics.
            y = jnp.where(m > 0, y, jnp.zeros((), self.dtype))
        return y
