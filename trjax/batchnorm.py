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

import contextlib
import contextvars
import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import canonicalize_dtype
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


def running_update(mean, var, sums, momentum: float, unbiased: bool = True):
    """The running statistics after one batch (the rule in the module docstring).

    Args:
      mean, var: ``[C]`` float32 running statistics, as the layer was called
        with: ``mean`` is also the shift of ``sums`` (see :func:`moments`).
      sums: ``[2C + 1]`` float32 packed ``(sum (x - mean), sum (x - mean)^2,
        n)`` of the batch's real rows (global where the mode is).
      momentum: decay of the running statistics.
      unbiased: the batch variance enters made unbiased by ``n / (n - 1)`` (as
        PyTorch's BatchNorm / SyncBatchNorm and :class:`BatchNorm`); ``False``:
        the biased variance, as flax's ``linen.BatchNorm`` / ``nnx.BatchNorm``
        update theirs.

    Returns:
      ``(mean, var)`` ``[C]``: unchanged when ``n == 0``; otherwise
      ``momentum * old + (1 - momentum) * batch``.
    """
    b_mean, b_var, n = moments(sums, mean)
    if unbiased:
        b_var = b_var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
    has_rows = n > 0
    return (jnp.where(has_rows, momentum * mean + (1 - momentum) * b_mean, mean),
            jnp.where(has_rows, momentum * var + (1 - momentum) * b_var, var))


def update_running_tree(batch_stats, bn_sums, momentum: float = 0.9, rules=None):
    """Applies :func:`running_update` to every BatchNorm of a model.

    Args:
      batch_stats: ``{..module path..: {"mean": [C], "var": [C]}}``: the
        statistics the model was called with (their ``mean`` is the shift of
        the sums).
      bn_sums: the ``bn_sums`` collection the model wrote in training
        (``{..module path..: {"sums": [2C + 1]}}``, same module paths, shifted
        sums as :func:`moments` reads them), summed over devices and
        micro-batches as the mode requires. A layer without sums (not called
        in training) keeps its statistics.
      momentum: the BatchNorm momentum of every layer not in ``rules``
        (unbiased variance).
      rules: ``{module path tuple: (momentum, unbiased)}`` per layer, as
        :class:`BatchNormContext` records them while the model is traced
        (flax's layers: their own momentum, biased variance).

    Returns:
      The new ``batch_stats`` tree (each leaf in its own dtype).
    """
    rules = rules or {}

    def walk(st, sm, path):
        if "mean" in st and "var" in st and not isinstance(st["mean"], dict):
            if sm is None or "sums" not in sm:
                return st
            mom, unbiased = rules.get(path, (momentum, True))
            m, v = running_update(st["mean"].astype(jnp.float32), st["var"].astype(jnp.float32),
                                  sm["sums"], mom, unbiased)
            return {"mean": m.astype(st["mean"].dtype), "var": v.astype(st["var"].dtype)}
        return {k: walk(st[k], None if sm is None else sm.get(k), path + (k,)) for k in st}
    return walk(batch_stats, bn_sums, ())


def train_normalize(x, mask, r, scale, bias, epsilon: float, mode: str, axis_name=None):
    """BatchNorm's training forward pass: normalised output and packed batch sums.

    The computation of :class:`BatchNorm` in training (module docstring,
    "Precision"), shared with the adapters for flax's own BatchNorm layers
    (:func:`linen_interceptor`, :func:`swap_nnx_batchnorms`).

    Args:
      x: ``[B, ..., C]`` activations (any float dtype; computed in float32).
      mask: ``[B]`` float/bool, 1 for real rows, or ``None`` (every row real).
      r: ``[C]`` float32, the running mean (the shift of the packed sums; the
        same for every row the sums are added over), under ``stop_gradient``.
      scale, bias: ``[C]`` float32 or ``None`` (no scale / no bias).
      epsilon: added to the variance.
      mode: one of :data:`BN_MODES`; ``sync`` with an ``axis_name`` normalises
        with the global statistics (one ``psum`` of the packed vector forward,
        one backward), otherwise with this device's own.
      axis_name: the data axis (``sync`` mode), or ``None`` (one device).

    Returns:
      ``(y [B, ..., C] float32, sums [2C + 1] float32)``: ``y`` is zero on
      padding rows; ``sums`` is ``(sum (x - r), sum (x - r)^2, n)`` over real
      rows under ``stop_gradient``, global in ``sync`` mode, as
      :func:`update_running_tree` reads it.
    """
    xf = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    rows_per_example = 1
    for size in x.shape[1:-1]:
        rows_per_example *= size
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
    if mode == "sync" and axis_name is not None:
        # One all-reduce forward. The explicit cast back to "varying" puts the
        # backward all-reduce (its transpose) on the packed vector: one
        # collective per layer in backward too, instead of one per statistic.
        stats_packed = lax.psum(stats_packed, axis_name)
        packed = lax.pcast(lax.psum(packed, axis_name), axis_name, to="varying")
        offset, var, _ = _centred_moments(packed)  # mean - r, from the global sums
        centre = offset - d  # mean - s
    else:
        # local statistics: straight from this device's s-shifted sums
        n = jnp.maximum(count, 1.0)
        centre = s1 / n
        var = jnp.maximum(s2 / n - centre * centre, 0.0)
    a = lax.rsqrt(var + epsilon) if scale is None else scale * lax.rsqrt(var + epsilon)
    # from the shifted values, so that autodiff's backward is centred too
    y = (xs - _per_channel(centre, x)) * _per_channel(a, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    if real is not None:
        # Padding rows leave every BN as exact zeros: they cannot grow without
        # bound through layers normalised by other rows' (or no rows') statistics.
        y = jnp.where(real, y, jnp.zeros((), jnp.float32))
    return y, stats_packed


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

        # r: the shift of the packed sums, the same for every row they are added over
        # (replicated in sync / running, this replica's in local; fixed over micro-batches).
        y, stats_packed = train_normalize(x, mask, lax.stop_gradient(ra_mean.value), scale, bias,
                                          self.epsilon, self.mode, self.axis_name)
        if self.is_mutable_collection("bn_sums") and not self.is_initializing():
            # This batch's sums (global in sync mode), for the caller to add over
            # devices / micro-batches and apply with update_running_tree.
            self.put_variable("bn_sums", "sums", stats_packed)
        if not self.is_initializing():
            # Running statistics from the (stop-gradient) copy: replicated
            # ("invariant") across the data axis in sync mode.
            ra_mean.value, ra_var.value = running_update(ra_mean.value, ra_var.value,
                                                         stats_packed, self.momentum)
        return y.astype(self.dtype)


# -- flax's own BatchNorm layers (linen and nnx) with trjax's statistics ------------------


@dataclasses.dataclass
class BatchNormContext:
    """What the adapters of flax's BatchNorm layers need while a model is traced
    in training, and what they record.

    Attributes:
      mode: one of :data:`BN_MODES` (the train step's).
      axis_name: the data axis (``sync`` mode reduces over it), or ``None``.
      mask: ``[B]`` float32, 1 for real rows, or ``None`` (every row real).
      rules: filled while tracing: ``{module path tuple: (momentum,
        unbiased)}`` of every BatchNorm called in training (for
        :func:`update_running_tree`).
      sums: filled while tracing (nnx layers): ``{module path tuple: [2C + 1]}``.
      nnx_paths: ``{id(layer): module path tuple}`` of the nnx layers adapted
        by :func:`swap_nnx_batchnorms`.
      called: the paths of the layers that took batch statistics in this
        forward pass (:meth:`first_call`).
    """
    mode: str
    axis_name: Optional[str] = None
    mask: Any = None
    rules: dict = dataclasses.field(default_factory=dict)
    sums: dict = dataclasses.field(default_factory=dict)
    nnx_paths: dict = dataclasses.field(default_factory=dict)
    called: set = dataclasses.field(default_factory=set)

    def first_call(self, path: tuple) -> None:
        """Records that the layer at ``path`` takes batch statistics in this forward
        pass. trjax's rule for a normalisation layer applied twice in one pass (a
        block reused with shared weights, one encoder over two views): refused.
        Its sums would be the last call's only, and the running update between the
        calls would move the reference the second call's sums are taken around,
        matching neither flax's sequential result nor pooled statistics.

        Raises:
          ValueError (while tracing, before anything is compiled): the second call,
            naming the layer and the fix.
        """
        if path in self.called:
            layer = "/".join(map(str, path))
            raise ValueError(
                f"{layer}: this BatchNorm is applied twice in one training forward pass (a "
                "block reused with shared weights, or one encoder over two views). trjax takes "
                "one set of batch statistics per layer and step, so it refuses this: give each "
                "use its own BatchNorm (shared convolutions may stay shared), or concatenate "
                "the inputs along the batch axis and call the layer once")
        self.called.add(path)


def _feature_axis(x, axis, layer: str) -> int:
    """The one feature axis of a flax BatchNorm (``axis``), checked."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(axes) != 1:
        raise NotImplementedError(f"{layer}: BatchNorm(axis={axis!r}) normalises over several "
                                  "feature axes; trjax's statistics take one feature axis "
                                  "(the default axis=-1)")
    ax = axes[0] % x.ndim
    if ax == 0:
        raise ValueError(f"{layer}: BatchNorm(axis={axis!r}) makes the batch axis the feature "
                         "axis; trjax masks padding rows along axis 0")
    return ax


def _out_dtype(dtype, *args):
    """A flax normalisation layer's output dtype: ``dtype``, else the promoted
    dtype of its input and (present) variables, as flax computes it."""
    return canonicalize_dtype(*[a for a in args if a is not None], dtype=dtype)


def _adapted_normalize(x, ax: int, ctx: BatchNormContext, mean, scale, bias, epsilon, layer):
    """:func:`train_normalize` of a flax layer's input with feature axis ``ax``:
    ``(y float32 in x's layout, packed sums)``."""
    if ctx.mask is not None and ctx.mask.shape[0] != x.shape[0]:
        raise ValueError(f"{layer}: a BatchNorm input of {x.shape[0]} rows (shape {x.shape}) "
                         f"against a batch of {ctx.mask.shape[0]}: trjax masks padding rows "
                         "along axis 0, so BatchNorm must see the batch's rows on axis 0")
    f32 = lambda v: None if v is None else jnp.asarray(v).astype(jnp.float32)
    xl = jnp.moveaxis(x, ax, -1) if ax != x.ndim - 1 else x
    y, sums = train_normalize(xl, ctx.mask, lax.stop_gradient(f32(mean)), f32(scale), f32(bias),
                              epsilon, ctx.mode, ctx.axis_name)
    return (jnp.moveaxis(y, -1, ax) if ax != x.ndim - 1 else y), sums


def _linen_flax_batchnorm(mod, ctx: BatchNormContext, next_fun, args, kwargs):
    """``flax.linen.BatchNorm.__call__`` in training with trjax's statistics; with
    running averages (or at init) flax's own code."""
    x = args[0]
    ura = args[1] if len(args) > 1 else kwargs.get("use_running_average")
    ura = nn.merge_param("use_running_average", mod.use_running_average, ura)
    if mod.is_initializing():
        return next_fun(*args, **kwargs)
    ctx.rules[tuple(mod.path)] = (mod.momentum, False)
    if ura:  # frozen in training: no sums, its statistics stay as they are
        return next_fun(*args, **kwargs)
    ctx.first_call(tuple(mod.path))
    layer = "/".join(mod.path)
    if kwargs.get("mask") is not None:
        raise NotImplementedError(f"{layer}: BatchNorm(..., mask=...) in training; trjax masks "
                                  "the batch's padding rows itself: leave mask unset")
    ax = _feature_axis(x, mod.axis, layer)
    c = x.shape[ax]
    stat = jnp.float32 if mod.force_float32_reductions else mod.param_dtype
    ra_mean = mod.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stat), (c,))
    ra_var = mod.variable("batch_stats", "var", lambda s: jnp.ones(s, stat), (c,))
    scale = mod.param("scale", mod.scale_init, (c,), mod.param_dtype) if mod.use_scale else None
    bias = mod.param("bias", mod.bias_init, (c,), mod.param_dtype) if mod.use_bias else None
    y, sums = _adapted_normalize(x, ax, ctx, ra_mean.value, scale, bias, mod.epsilon, layer)
    if mod.is_mutable_collection("bn_sums"):
        mod.put_variable("bn_sums", "sums", sums)
    if mod.is_mutable_collection("batch_stats"):
        new = update_running_tree({"mean": ra_mean.value, "var": ra_var.value}, {"sums": sums},
                                  mod.momentum, {(): (mod.momentum, False)})
        ra_mean.value, ra_var.value = new["mean"], new["var"]
    return y.astype(_out_dtype(mod.dtype, x, scale, bias))


def linen_interceptor(ctx: BatchNormContext):
    """A :func:`flax.linen.intercept_methods` interceptor for training.

    ``flax.linen.BatchNorm`` (any ``momentum``, ``epsilon``, ``axis``,
    ``use_scale`` / ``use_bias``, ``dtype``; its ``axis_name`` is ignored: the
    mode decides) computes trjax's statistics (:func:`train_normalize`: masked,
    shifted sums, count-weighted over devices and micro-batches by the step)
    with the layer's own parameters and variables (``params/<path>/{scale,
    bias}``, ``batch_stats/<path>/{mean, var}``), writes its sums to
    ``bn_sums`` and records ``(momentum, unbiased=False)``: the running update
    keeps flax's rule (biased batch variance). With running averages it runs
    flax's own code. A :class:`BatchNorm` (trjax's) called without a mask gets
    ``ctx.mask``; its rule is ``(momentum, unbiased=True)``. Every other method
    runs unchanged.

    Raises (while tracing):
      NotImplementedError: a flax BatchNorm given ``mask=`` or several feature axes.
      ValueError: a BatchNorm input whose axis 0 is not the batch's rows; a
        BatchNorm applied twice in one forward pass (:meth:`BatchNormContext.first_call`).
    """
    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if isinstance(mod, BatchNorm):
            train = args[1] if len(args) > 1 else kwargs.get("train")
            mask = args[2] if len(args) > 2 else kwargs.get("mask")
            if mod.is_initializing():
                return next_fun(*args, **kwargs)
            ctx.rules[tuple(mod.path)] = (mod.momentum, True)
            if train:
                ctx.first_call(tuple(mod.path))
            if train and mask is None:
                return next_fun(args[0], train, mask=ctx.mask)
            return next_fun(*args, **kwargs)
        if isinstance(mod, nn.BatchNorm):
            return _linen_flax_batchnorm(mod, ctx, next_fun, args, kwargs)
        return next_fun(*args, **kwargs)
    return intercept


_NNX_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("trjax_nnx_batchnorm", default=None)
_NNX_CLASSES: dict = {}


def current_nnx_context() -> BatchNormContext | None:
    """The context :func:`nnx_context` holds now, or ``None`` outside one."""
    return _NNX_CONTEXT.get()


@contextlib.contextmanager
def nnx_context(ctx: BatchNormContext):
    """While active, the layers :func:`swap_nnx_batchnorms` adapted use ``ctx``."""
    token = _NNX_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _NNX_CONTEXT.reset(token)


def _nnx_train_call(self, x, use_running_average=None, *, mask=None):
    """``nnx.BatchNorm.__call__`` with trjax's statistics in training (see
    :func:`swap_nnx_batchnorms`); nnx's own code otherwise."""
    from flax import nnx
    ctx = _NNX_CONTEXT.get()
    ura = use_running_average if use_running_average is not None else self.use_running_average
    if ctx is None or ura is None or id(self) not in ctx.nnx_paths:
        return nnx.BatchNorm.__call__(self, x, use_running_average, mask=mask)
    path = ctx.nnx_paths[id(self)]
    ctx.rules[path] = (self.momentum, False)
    if ura:  # frozen in training: no sums, its statistics stay as they are
        return nnx.BatchNorm.__call__(self, x, use_running_average, mask=mask)
    ctx.first_call(path)
    layer = "/".join(map(str, path))
    if mask is not None:
        raise NotImplementedError(f"{layer}: nnx.BatchNorm(..., mask=...) in training; trjax "
                                  "masks the batch's padding rows itself: leave mask unset")
    ax = _feature_axis(x, self.axis, layer)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    y, sums = _adapted_normalize(x, ax, ctx, self.mean[...], scale, bias, self.epsilon, layer)
    ctx.sums[path] = sums
    return y.astype(_out_dtype(self.dtype, x, self.mean[...], scale, bias))


def swap_nnx_batchnorms(module, ctx: BatchNormContext) -> None:
    """Gives every ``nnx.BatchNorm`` of ``module`` trjax's training statistics.

    ``module`` must be a copy made for one trace (``nnx.merge`` inside the
    step): each layer's class becomes a subclass whose ``__call__``, while
    :func:`nnx_context` holds ``ctx`` and the layer is in training
    (``use_running_average`` False), computes :func:`train_normalize` with the
    layer's ``scale``, ``bias``, ``mean``, ``epsilon`` and ``axis``, and
    records its sums in ``ctx.sums`` and ``(momentum, unbiased=False)`` in
    ``ctx.rules`` (flax's running rule, biased variance). The step updates the
    running statistics from the sums; the layer's own variables are not
    written. A subclass that overrides ``__call__`` is left as it is.
    """
    from flax import nnx
    for path, node in nnx.iter_graph(module):
        cls = type(node)
        if isinstance(node, nnx.BatchNorm) and cls.__call__ is nnx.BatchNorm.__call__:
            if cls not in _NNX_CLASSES:
                _NNX_CLASSES[cls] = type(f"Trjax{cls.__name__}", (cls,),
                                         {"__call__": _nnx_train_call,
                                          "__module__": __name__})
            ctx.nnx_paths[id(node)] = tuple(path)
            node.__class__ = _NNX_CLASSES[cls]
