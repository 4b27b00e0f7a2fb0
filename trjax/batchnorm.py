"""BatchNorm with explicit cross-device statistics: ``sync``, ``running``, ``local``.

One module, three modes (``BN_MODES``):

* ``sync`` -- SyncBatchNorm (Ioffe & Szegedy 2015 with the statistics of the
  global batch, as PyTorch's ``SyncBatchNorm``): each device computes the sum,
  sum of squares and count of its real (mask = 1) rows per channel; ONE
  ``psum`` over the data axis per layer gives the global values, so N devices
  normalise exactly as one device on the concatenated batch.
* ``running`` -- the seed framework's scheme: the forward pass normalises with
  local batch statistics; after the step ONE all-reduce carries every layer's
  per-channel ``(sum x, sum x^2, n)`` (see
  :func:`trjax.collectives.allreduce_batch_stats`), and the running mean/var
  are updated from the global batch's statistics, identical on every replica.
* ``local`` -- no synchronisation at all, for comparison: each replica keeps its
  own running statistics, updated from its own rows.

Exactness (every mode): statistics are accumulated in float32 whatever the
compute dtype, from per-channel sums ``(sum x, sum x^2, n)`` over real
(mask = 1) rows only. Per-device results are never averaged with equal weight:
the sums are added (across devices in ``sync`` / ``running``, across the
micro-batches of gradient accumulation), so the running statistics are those of
the concatenated real rows, whatever the number of real rows per device. A
device (or micro-batch) with only padding adds zeros; when the whole batch has
no real row the running statistics are left unchanged. Padding rows leave the
layer as zeros (so they stay finite even on a device that holds only padding).

Running update (PyTorch ``BatchNorm`` / ``SyncBatchNorm`` convention): with
the batch's ``n`` real values per channel (rows x spatial positions, global in
``sync`` / ``running``), mean ``m = sum x / n`` and biased variance
``v = sum x^2 / n - m^2``,

    running_mean <- momentum * running_mean + (1 - momentum) * m
    running_var  <- momentum * running_var  + (1 - momentum) * v * n / (n - 1)

(``n / (n - 1)`` is taken as 1 when ``n == 1``). The forward pass normalises
with the biased ``v``. Example: device A's real rows [0, 0, 0], device B's
one real row [4] plus padding: m = 1.0, v = 3.0, unbiased 4.0.
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


def moments(sums):
    """Mean and biased variance from packed per-channel sums.

    Args:
      sums: ``[2C + 1]`` float32: ``sum x`` ``[C]``, ``sum x^2`` ``[C]``, ``n``
        (the count of real values per channel).

    Returns:
      ``(mean [C], biased var [C], n scalar)``; with ``n == 0`` mean and var are 0.
    """
    c = (sums.shape[0] - 1) // 2
    n = sums[2 * c]
    d = jnp.maximum(n, 1.0)
    mean = sums[:c] / d
    return mean, jnp.maximum(sums[c:2 * c] / d - mean * mean, 0.0), n


def running_update(mean, var, sums, momentum: float):
    """The running statistics after one batch (the rule in the module docstring).

    Args:
      mean, var: ``[C]`` float32 running statistics.
      sums: ``[2C + 1]`` float32 packed ``(sum x, sum x^2, n)`` of the batch's
        real rows (global where the mode is).
      momentum: decay of the running statistics.

    Returns:
      ``(mean, var)`` ``[C]``: unchanged when ``n == 0``; otherwise
      ``momentum * old + (1 - momentum) * batch`` with the batch variance
      made unbiased by ``n / (n - 1)`` (as PyTorch's BatchNorm / SyncBatchNorm).
    """
    b_mean, b_var, n = moments(sums)
    unbiased = b_var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
    has_rows = n > 0
    return (jnp.where(has_rows, momentum * mean + (1 - momentum) * b_mean, mean),
            jnp.where(has_rows, momentum * var + (1 - momentum) * unbiased, var))


def update_running_tree(batch_stats, bn_sums, momentum: float):
    """Applies :func:`running_update` to every BatchNorm of a model.

    Args:
      batch_stats: ``{..module path..: {"mean": [C], "var": [C]}}``.
      bn_sums: the ``bn_sums`` collection the model wrote in training
        (``{..module path..: {"sums": [2C + 1]}}``, same module paths), summed
        over devices and micro-batches as the mode requires.
      momentum: the BatchNorm momentum.

    Returns:
      The new ``batch_stats`` tree.
    """
    def walk(st, sm):
        if "mean" in st and "var" in st:
            m, v = running_update(st["mean"], st["var"], sm["sums"], momentum)
            return {"mean": m, "var": v}
        return {k: walk(st[k], sm[k]) for k in st}
    return walk(batch_stats, bn_sums)


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

    In training, when the ``bn_sums`` collection is mutable, the layer also
    writes this batch's packed ``(sum x, sum x^2, n)`` there (``[2C + 1]``,
    global in ``sync`` mode, this device's own otherwise): the train step adds
    them over devices and micro-batches and applies :func:`update_running_tree`.
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

        mean, var, _ = moments(packed)
        if self.is_mutable_collection("bn_sums") and not self.is_initializing():
            # This batch's sums (global in sync mode), for the caller to add over
            # devices / micro-batches and apply with update_running_tree.
            self.put_variable("bn_sums", "sums", stats_packed)
        if not self.is_initializing():
            # Running statistics from the (stop-gradient) copy: replicated
            # ("invariant") across the data axis in sync mode.
            ra_mean.value, ra_var.value = running_update(ra_mean.value, ra_var.value,
                                                         stats_packed, self.momentum)

        a = scale * lax.rsqrt(var + self.epsilon)
        b = bias - mean * a
        y = (x * _per_channel(a.astype(self.dtype), x)
             + _per_channel(b.astype(self.dtype), x)).astype(self.dtype)
        if m is not None:
            # Padding rows leave every BN as exact zeros: they cannot grow without
            # bound through layers normalised by other rows' (or no rows') statistics.
            y = jnp.where(m > 0, y, jnp.zeros((), self.dtype))
        return y
