"""BatchNorm with explicit cross-device statistics: ``sync``, ``running``, ``local``.

One module, three modes (``BN_MODES``):

* ``sync`` -- SyncBatchNorm (Ioffe & Szegedy 2015 with the statistics of the
  global batch, as PyTorch's ``SyncBatchNorm``): each device computes the
  shifted sum, shifted sum of squares and count of its real (mask = 1) rows per
  channel; ONE ``psum`` over the data axis per layer gives the global values,
  so N devices normalise exactly as one device on the concatenated batch.
* ``running`` -- the seed framework's scheme: the forward pass normalises with
  local batch statistics; after the step ONE all-reduce carries every layer's
  per-channel shifted sums and count (see
  :func:`trjax.collectives.allreduce_batch_stats`), and the running mean/var
  are updated from the global batch's statistics, identical on every replica.
* ``local`` -- no synchronisation at all, for comparison: each replica keeps its
  own running statistics, updated from its own rows.

Exactness (every mode): statistics are accumulated in float32 whatever the
compute dtype, from per-channel *shifted* sums over real (mask = 1) rows only
(see "Precision" below). Per-device results are never averaged with equal weight:
the sums are added (across devices in ``sync`` / ``running``, across the
micro-batches of gradient accumulation), so the running statistics are those of
the concatenated real rows, whatever the number of real rows per device. A
device (or micro-batch) with only padding adds zeros; when the whole batch has
no real row the running statistics are left unchanged. Padding rows leave the
layer as zeros (so they stay finite even on a device that holds only padding);
padding is masked by select, never by multiplication, so NaN or inf in a
padding row reaches neither the statistics nor any gradient.

Precision (the shifted-data algorithm; Chan, Golub & LeVeque, "Algorithms for
computing the sample variance: analysis and recommendations", The American
Statistician 37(3), 1983): ``sum x^2 / n - mean^2`` in float32 loses
about ``log2((mean/std)^2)`` bits, and autodiff's backward cancels the same way
(``sum(dy x) - mean sum(dy)``). So the layer never sums raw ``x``: with ``r`` the
running mean it was called with (``stop_gradient``; replicated in ``sync`` /
``running``, this replica's own in ``local`` -- in every mode the same value for
all the rows whose sums are added together) the packed vector of a layer is

    (sum (x - r) [C], sum (x - r)^2 [C], n)        ``[2C + 1]`` float32,

so ``mean = r + S1 / n`` and ``var = S2 / n - (S1 / n)^2`` cancel only as far
as ``r`` is from the batch mean. Each device first sums ``xs = x - s`` around a
local shift ``s`` (the spatial mean of its first real example: a value from
inside the data, Chan et al.'s recommended shift, no collective) and re-centres
the few per-channel totals on ``r`` (``sum (x-r) = S1 + n d``,
``sum (x-r)^2 = S2 + 2 d S1 + n d^2``, ``d = s - r``): the long sums never see
the offset. ``running`` / ``local`` normalise with local statistics, so their
forward and backward use the ``s``-shifted sums directly and are stable from
the first step. ``sync`` needs the same shift on every device before its one
``psum``: it normalises with the ``r``-shifted global sums, as accurate as a
two-pass computation once the running mean has approached the data; at the
first steps (``r = 0`` at initialisation) it is about as precise as the
unshifted formula (without a second collective nothing better is held by every
device), and that error shrinks by ``momentum^2`` per step as ``r`` approaches
the data. In every mode the output is computed from the shifted values,
``y = (xs - (mean - s)) a + bias``, so the backward pass autodiff derives from
it is centred too.

Running update (PyTorch ``BatchNorm`` / ``SyncBatchNorm`` convention): with
the batch's ``n`` real values per channel (rows x spatial positions, global in
``sync`` / ``running``), mean ``m = r + S1 / n`` and biased variance
``v = S2 / n - (S1 / n)^2`` (:func:`moments`),

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


def _centred_moments(sums):
    """``(mean - shift [C], biased var [C], n)`` from shifted packed sums (see :func:`moments`)."""
    c = (sums.shape[0] - 1) // 2
    n = sums[2 * c]
    d = jnp.maximum(n, 1.0)
    offset = sums[:c] / d
    return offset, jnp.maximum(sums[c:2 * c] / d - offset * offset, 0.0), n


def moments(sums, shift):
    """Mean and biased variance from packed per-channel shifted sums.

    The shifted-data algorithm (Chan, Golub & LeVeque 1983): with ``S1, S2``
    the sums of ``x - shift`` and ``(x - shift)^2``, ``mean = shift + S1 / n``
    and ``var = S2 / n - (S1 / n)^2``; the subtraction loses only as many bits
    as ``shift`` is far from the mean (``log2(((mean - shift) / std)^2)``).

    Args:
      sums: ``[2C + 1]`` float32: ``sum (x - shift)`` ``[C]``,
        ``sum (x - shift)^2`` ``[C]``, ``n`` (the count of real values per
        channel), as :class:`BatchNorm` writes to ``bn_sums``.
      shift: ``[C]`` float32, the shift the sums were taken around: the running
        mean the layer was called with.

    Returns:
      ``(mean [C], biased var [C], n scalar)``; with ``n == 0`` mean is
      ``shift`` and var is 0.
    """
    offset, var, n = _centred_moments(sums)
    return shift + offset, var, n


def running_update(mean, var, sums, momentum: float):
    """The running statistics after one batch (the rule in the module docstring).

    Args:
      mean, var: ``[C]`` float32 running statistics, as the layer was called
        with: ``mean`` is also the shift of ``sums`` (see :func:`moments`).
      sums: ``[2C + 1]`` float32 packed ``(sum (x - mean), sum (x - mean)^2,
        n)`` of the batch's real rows (global where the mode is).
      momentum: decay of the running statistics.

    Returns:
      ``(mean, var)`` ``[C]``: unchanged when ``n == 0``; otherwise
      ``momentum * old + (1 - momentum) * batch`` with the batch variance
      made unbiased by ``n / (n - 1)`` (as PyTorch's BatchNorm / SyncBatchNorm).
    """
    b_mean, b_var, n = moments(sums, mean)
    unbiased = b_var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
    has_rows = n > 0
    return (jnp.where(has_rows, momentum * mean + (1 - momentum) * b_mean, mean),
            jnp.where(has_rows, momentum * var + (1 - momentum) * unbiased, var))


def update_running_tree(batch_stats, bn_sums, momentum: float):
    """Applies :func:`running_update` to every BatchNorm of a model.

    Args:
      batch_stats: ``{..module path..: {"mean": [C], "var": [C]}}``: the
        statistics the model was called with (their ``mean`` is the shift of
        the sums).
      bn_sums: the ``bn_sums`` collection the model wrote in training
        (``{..module path..: {"sums": [2C + 1]}}``, same module paths, shifted
        sums as :func:`moments` reads them), summed over devices and
        micro-batches as the mode requires.
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
        is ``x.shape[0]``. Padding rows may hold anything, NaN included: they
        are selected out, and leave the layer as zeros.

    In training, when the ``bn_sums`` collection is mutable, the layer also
    writes this batch's packed ``(sum (x - r), sum (x - r)^2, n)`` there
    (``[2C + 1]`` float32, ``r`` the running mean it was called with; global in
    ``sync`` mode, this device's own otherwise): the train step adds them over
    devices and micro-batches and applies :func:`update_running_tree` to the
    same running statistics. Training statistics follow the module docstring's
    "Precision" (shifted sums, output from the shifted values).
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
        for size in x.shape[1:-1]:
            rows_per_example *= size
        # r: the shift of the packed sums, the same for every row they are added over
        # (replicated in sync / running, this replica's in local; fixed over micro-batches).
        r = lax.stop_gradient(ra_mean.value)
        if mask is None:
            real = None
            count = jnp.asarray(x.shape[0] * rows_per_example, jnp.float32)
            first = xf[0]
        else:
            is_real = mask > 0
            real = is_real.reshape((-1,) + (1,) * (x.ndim - 1))
            count = jnp.sum(is_real.astype(jnp.float32)) * rows_per_example
            first = xf[jnp.argmax(is_real)]  # the first real row (row 0 if none)
        # s: this device's own shift, a value inside its data (the spatial mean of its first
        # real example); r where it has no real row (then nothing is summed around it).
        s = jnp.mean(first, tuple(range(first.ndim - 1))) if first.ndim > 1 else first
        if real is not None:
            s = jnp.where(jnp.any(is_real), s, r)
        s = lax.stop_gradient(s)
        xs = xf - _per_channel(s, x)
        if real is not None:
            # select, not multiply: NaN / inf in padding rows must reach no sum and no gradient
            xs = jnp.where(real, xs, jnp.zeros((), jnp.float32))
        s1 = jnp.sum(xs, axes)
        s2 = jnp.sum(xs * xs, axes)
        # the few totals re-centred on r:
        # sum (x - r) = S1 + n d,  sum (x - r)^2 = S2 + 2 d S1 + n d^2
        d = s - r
        packed = jnp.concatenate([s1 + count * d, s2 + 2.0 * d * s1 + count * d * d,
                                  count[None]])
        stats_packed = lax.stop_gradient(packed)
        if self.mode == "sync" and self.axis_name is not None:
            # One all-reduce forward. The explicit cast back to "varying" puts the
            # backward all-reduce (its transpose) on the packed vector: one
            # collective per layer in backward too, instead of one per statistic.
            stats_packed = lax.psum(stats_packed, self.axis_name)
            packed = lax.pcast(lax.psum(packed, self.axis_name), self.axis_name, to="varying")
            offset, var, _ = _centred_moments(packed)  # mean - r, from the global sums
            centre = offset - d  # mean - s
        else:
            # local statistics: straight from this device's s-shifted sums
            n = jnp.maximum(count, 1.0)
            centre = s1 / n
            var = jnp.maximum(s2 / n - centre * centre, 0.0)

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
        # from the shifted values, so that autodiff's backward is centred too
        y = (xs - _per_channel(centre, x)) * _per_channel(a, x) + _per_channel(bias, x)
        if real is not None:
            # Padding rows leave every BN as exact zeros: they cannot grow without
            # bound through layers normalised by other rows' (or no rows') statistics.
            y = jnp.where(real, y, jnp.zeros((), jnp.float32))
        return y.astype(self.dtype)
