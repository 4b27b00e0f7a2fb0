"""What one device computes before any exchange: the training objective and its
gradients (forward + backward), with the recipe's losses and mixing.

:func:`forward_backward` is the data-parallel (and tensor-parallel) one: a local
batch, optionally in ``grad_accumulation_steps`` micro-batches; the pipeline's
schedule (:mod:`trjax.parallel.pipeline`) computes the same four results over
its stages. A :class:`trjax.parallel.Layout` binds one of them with
``functools.partial`` to the one signature the train step calls
(:attr:`trjax.parallel.Layout.forward_backward`). :class:`StepOptions` is what
a train step is asked to do beyond the layout (loss, mixing, accumulation,
loss scaling).

This module sits below :mod:`trjax.steps` and :mod:`trjax.parallel`; it reads
no mesh axis name of its own (the BatchNorm axis comes in as an argument).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from trjax import models
from trjax.batchnorm import BatchNormContext
from trjax.metrics import batch_metrics


class StepOptions(NamedTuple):
    """What a train step does beyond its layout (:func:`trjax.steps.make_train_step`).

    Attributes:
      dynamic_loss_scale: fp16: the loss is multiplied by ``state.loss_scale``
        before backward and the scale updated by
        :func:`trjax.precision.update_loss_scale`.
      growth_interval: good steps before the loss scale doubles.
      grad_accumulation_steps: micro-batches per optimizer step (see
        :func:`forward_backward`); one exchange per step.
      padding: ``False`` when no batch this step is fed holds a padding row
        (:func:`trjax.data.input_pipeline.train_batches_full`): BatchNorm is
        then traced without the padding mask (see :func:`forward_backward`).
      loss_fn, label_smoothing, mixup_alpha, cutmix_alpha: the training loss
        and mixing (see :func:`forward_backward`). The metrics' ``loss_sum``
        is then that loss; the evaluation step always measures the plain
        cross-entropy.
      objective_wrap: set by a layout, never by the config: ``objective ->
        objective``, applied to the per-micro-batch objective ``(params, micro,
        index) -> (loss, aux)`` before it is differentiated (FSDP's re-gather
        in the backward, :func:`trjax.parallel.fsdp.regathering`); ``None``: none.
    """
    dynamic_loss_scale: bool = False
    growth_interval: int = 2000
    grad_accumulation_steps: int = 1
    padding: bool = True
    loss_fn: Any = None
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    objective_wrap: Any = None


def dropout_key(seed: int, step, rank, micro=None):
    """The randomness of one micro-batch: ``fold_in(fold_in(fold_in(key(seed),
    step), rank), micro)`` (``micro`` ``None``: the key before the last fold).

    A pure function of the seed, the step counter and the data-parallel rank:
    a run resumed at any step draws the same dropout masks as one never
    stopped. ``seed``: ``config.seed``; ``step``, ``rank``, ``micro``: int32
    scalars (traced or not). Returns a typed PRNG key.
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), rank)
    return key if micro is None else jax.random.fold_in(key, micro)


MIX_STREAM = 0x6D6978
"""Folded into a micro-batch's key (:func:`dropout_key` with ``micro``) for its
mixup / cutmix draws, so they never share bits with the dropout masks."""


def check_loss_fn(loss_fn, num_classes: int) -> None:
    """Checks a per-example loss before anything is compiled (abstract shapes only).

    ``loss_fn(logits [B, K] float32, labels [B] int32) -> [B]`` float: it is
    traced once with :func:`jax.eval_shape` on a ``[2, K]`` example.

    Raises:
      TypeError: ``loss_fn`` is not callable.
      ValueError: it returns another shape (a scalar from ``.mean()``, say) or a
        non-float dtype; the message names what came back and the fix.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable: pass "
                        "loss_fn(logits [B, K] float32, labels [B] int32) -> [B] float32")
    out = jax.eval_shape(loss_fn, jax.ShapeDtypeStruct((2, num_classes), jnp.float32),
                         jax.ShapeDtypeStruct((2,), jnp.int32))
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (2,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"loss_fn returned shape {shape} dtype {dtype} for logits [2, "
                         f"{num_classes}] and labels [2]; it must return [2] float (one loss "
                         "per example): return per-example losses; trjax sums them over real "
                         "rows (no .mean() or .sum())")


def mix_partner(key, mask) -> jax.Array:
    """Each row's mixing partner: a random permutation of the REAL rows only.

    Args:
      key: a PRNG key.
      mask: ``[B]`` float32, 1 for real rows (anywhere in the batch).

    Returns:
      ``perm [B] int32``: real row ``i`` is mixed with real row ``perm[i]``
      (possibly itself); a padding row's partner is itself.
    """
    b = mask.shape[0]
    real = mask > 0
    index_order = jnp.argsort(jnp.where(real, 0, 1), stable=True)  # real rows, then padding
    u = jax.random.uniform(key, (b,))
    shuffled = jnp.argsort(jnp.where(real, u, 2.0), stable=True)  # real shuffled, then padding
    return jnp.zeros((b,), jnp.int32).at[index_order].set(shuffled.astype(jnp.int32))


def cutmix_box(key, lam, height: int, width: int):
    """CutMix's box (Yun et al. 2019): side ratio ``sqrt(1 - lam)``, centre uniform,
    clipped to the image. Returns ``(box [H, W] bool, lam corrected to the true
    area: 1 - box area / (H W))``."""
    ky, kx = jax.random.split(key)
    r = jnp.sqrt(1.0 - lam)
    cut_h, cut_w = jnp.floor(height * r).astype(jnp.int32), jnp.floor(width * r).astype(jnp.int32)
    cy = jax.random.randint(ky, (), 0, height)
    cx = jax.random.randint(kx, (), 0, width)
    y1, y2 = jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height)
    x1, x2 = jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width)
    rows, cols = jnp.arange(height), jnp.arange(width)
    box = ((rows >= y1) & (rows < y2))[:, None] & ((cols >= x1) & (cols < x2))[None, :]
    area = ((y2 - y1) * (x2 - x1)).astype(jnp.float32)
    return box, 1.0 - area / (height * width)


def mix_images(x, mask, perm, lam, box=None):
    """The mixed images of a batch (pure; the train step's mixup / cutmix).

    Args:
      x: ``[B, H, W, C]`` float images (standardised).
      mask: ``[B]``, 1 for real rows; padding rows are returned as they came
        (selected, so anything in them, NaN included, stays there).
      perm: ``[B] int32`` partners (:func:`mix_partner`: real rows only).
      lam: scalar float32 weight of each row's own image.
      box: ``None`` (mixup: ``lam x + (1 - lam) x[perm]``) or ``[H, W]`` bool
        (cutmix: the partner's pixels inside the box).

    Returns:
      ``[B, H, W, C]`` of ``x``'s dtype.
    """
    other = x[perm]
    if box is None:
        mixed = (lam * x.astype(jnp.float32) + (1.0 - lam) * other.astype(jnp.float32))
    else:
        mixed = jnp.where(box[None, :, :, None], other, x)
    real = (mask > 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(real, mixed.astype(x.dtype), x)


def example_losses(logits, labels, loss_fn=None, label_smoothing: float = 0.0, mix=None):
    """Per-example training losses ``[B]`` float32 (summed over real rows by
    :func:`trjax.metrics.batch_metrics`).

    Args:
      logits: ``[B, K]`` float32; labels: ``[B]`` int32 (hard).
      loss_fn: a user loss ``(logits, labels) -> [B]``, or ``None``: softmax
        cross-entropy against ``(1 - label_smoothing) onehot + label_smoothing / K``
        (``optax.smooth_labels``; 0: the plain integer-label CE).
      mix: ``None`` or ``(perm [B] int32, lam)``: the soft target ``lam y +
        (1 - lam) y[perm]`` (built-in CE: on the smoothed one-hots; a user loss:
        ``lam loss(labels) + (1 - lam) loss(labels[perm])``, the same for any
        loss linear in its target).
    """
    k = logits.shape[-1]
    if loss_fn is not None:
        losses = loss_fn(logits, labels)
        if mix is not None:
            perm, lam = mix
            losses = lam * losses + (1.0 - lam) * loss_fn(logits, labels[perm])
        return losses.astype(jnp.float32)
    if mix is None and not label_smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    target = jax.nn.one_hot(labels, k, dtype=jnp.float32)
    if label_smoothing:
        target = optax.smooth_labels(target, label_smoothing)
    if mix is not None:
        perm, lam = mix
        target = lam * target + (1.0 - lam) * target[perm]
    return optax.softmax_cross_entropy(logits, target)


def mix_batch(x, mask, key, mixup_alpha: float, cutmix_alpha: float):
    """One micro-batch's mixup / cutmix: ``(mixed x, perm, lam)``.

    Args:
      x: ``[B, H, W, C]`` standardised images; mask: ``[B]`` (1 for real rows).
      key: the micro-batch's mixing key (``fold_in(micro key, MIX_STREAM)``).
      mixup_alpha, cutmix_alpha: > 0 enables each; ``lam ~ Beta(alpha, alpha)``
        (cutmix's corrected to its box's area, :func:`cutmix_box`). Both > 0:
        one of the two with probability 1/2 (timm's ``switch_prob``).

    Returns:
      ``x`` mixed (:func:`mix_images`), ``perm [B] int32`` (:func:`mix_partner`)
      and ``lam`` float32.
    """
    k_perm, k_lam, k_box, k_pick = jax.random.split(key, 4)
    perm = mix_partner(k_perm, mask)
    if mixup_alpha > 0:
        lam_mixup = jax.random.beta(k_lam, mixup_alpha, mixup_alpha).astype(jnp.float32)
        mixed_mixup = mix_images(x, mask, perm, lam_mixup)
    if cutmix_alpha > 0:
        lam_cut = jax.random.beta(jax.random.fold_in(k_lam, 1), cutmix_alpha,
                                  cutmix_alpha).astype(jnp.float32)
        box, lam_cut = cutmix_box(k_box, lam_cut, x.shape[1], x.shape[2])
        mixed_cut = mix_images(x, mask, perm, lam_cut, box)
    if cutmix_alpha <= 0:
        return mixed_mixup, perm, lam_mixup
    if mixup_alpha <= 0:
        return mixed_cut, perm, lam_cut
    use_cut = jax.random.bernoulli(k_pick)
    return (jnp.where(use_cut, mixed_cut, mixed_mixup), perm,
            jnp.where(use_cut, lam_cut, lam_mixup))


def forward_backward(model, params, batch_stats, batch, loss_scale=None,
                     grad_accumulation_steps: int = 1, padding: bool = True,
                     bn_mode: str = "sync", axis_name=None, rng=None, loss_fn=None,
                     label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                     cutmix_alpha: float = 0.0, objective_wrap=None):
    """Per device: gradients of the summed loss, metric sums, BN batch sums.

    Args:
      model: a :class:`trjax.models.Network` (or a module for
        :func:`trjax.models.as_network`).
      params: the parameters (cast to varying: gradients are this device's own).
      batch_stats: this device's BN statistics (``[C]`` leaves; ``{}`` without BN).
      batch: ``{"image": [B, H, W, C], "label": [B] int32, "mask": [B] float32}``;
        the image is standardised here (:func:`trjax.models.normalize`).
      loss_scale: multiplies the loss before backward (fp16), or ``None``.
      grad_accumulation_steps: k micro-batches of ``B / k`` rows; gradients,
        metric sums and BN batch sums are summed locally (``lax.scan``). The
        BN sums being sums, the step's running-statistics update is that of
        all k micro-batches' real rows together, whatever their real counts
        (an all-padding micro-batch adds nothing).
      padding: whether the batch may hold padding rows. ``False`` (every row
        is real, mask 1): BatchNorm runs without the mask (its sums over all
        rows, no zeroing of padding rows), a program ~20% cheaper to compile
        and ~10% faster per step (the main job's ResNet-20 on 8 simulated
        devices, ``docs/performance.md``); the loss and metrics still use the
        mask, so a row of mask 0 would be wrong only in the BN statistics.
      bn_mode, axis_name: how flax's BatchNorm layers compute their statistics
        (:class:`trjax.batchnorm.BatchNormContext`).
      rng: the step's dropout key on this device (:func:`dropout_key` without
        ``micro``); micro-batch ``i`` uses ``fold_in(rng, i)``. ``None``: no
        randomness.
      loss_fn, label_smoothing: the per-example training loss
        (:func:`example_losses`); top-1/top-5 stay on the hard labels.
      mixup_alpha, cutmix_alpha: > 0: per micro-batch, ``lam ~ Beta(alpha,
        alpha)`` from ``fold_in(fold_in(rng, i), MIX_STREAM)``; each real row
        is mixed with a real partner (:func:`mix_partner`, :func:`mix_images`;
        cutmix's ``lam`` corrected to its box's area, :func:`cutmix_box`), the
        loss taken on the soft target; padding rows stay padding (mask 0).
        Both > 0: each micro-batch draws one of the two with probability 1/2
        (timm's ``switch_prob``). Needs ``rng``.
      objective_wrap: ``None``, or a function applied to the per-micro-batch
        objective ``(params, micro, index) -> (loss, (sums, bn_sums))`` before
        differentiation (:attr:`StepOptions.objective_wrap`).

    Returns:
      ``(grads, sums [4] float32, bn_sums, rules)``; gradients of
      ``loss_scale * sum of losses`` (not yet divided by any count); ``bn_sums``
      the model's ``bn_sums`` collection (per BN ``{"sums": [2C + 1]}``, see
      :class:`trjax.batchnorm.BatchNorm`); ``rules`` ``{module path: (momentum,
      unbiased)}`` of every BatchNorm (for
      :func:`trjax.batchnorm.update_running_tree`).

    Raises:
      ValueError (while tracing): a ``batch_stats`` leaf no adapted BatchNorm keeps.
    """
    net = models.as_network(model)
    rules: dict = {}
    mixing = mixup_alpha > 0 or cutmix_alpha > 0
    custom = loss_fn is not None or label_smoothing > 0 or mixing
    if mixing and rng is None:
        raise ValueError("mixup_alpha / cutmix_alpha need the step's key (rng)")

    def objective(p, micro, index):
        ctx = BatchNormContext(bn_mode, axis_name, micro["mask"] if padding else None)
        x = models.normalize(micro["image"], net.mean, net.std, net.dtype)
        key = None if rng is None else jax.random.fold_in(rng, index)
        mixed = None
        if mixing:
            x, perm, lam = mix_batch(x, micro["mask"], jax.random.fold_in(key, MIX_STREAM),
                                     mixup_alpha, cutmix_alpha)
            mixed = (perm, lam)
        logits, micro_sums = net.apply_train(p, batch_stats, x, ctx, key)
        rules.update(ctx.rules)
        losses = example_losses(logits, micro["label"], loss_fn, label_smoothing, mixed) \
            if custom else None
        sums = batch_metrics(logits, micro["label"], micro["mask"], losses)
        loss = sums[0] if loss_scale is None else sums[0] * loss_scale
        return loss, (sums, micro_sums)

    grad_fn = jax.value_and_grad(objective if objective_wrap is None else objective_wrap(objective),
                                 has_aux=True)
    k = grad_accumulation_steps
    if k == 1:
        (_, (sums, bn_sums)), grads = grad_fn(params, batch, 0)
        models.check_batch_stats(batch_stats, rules)
        return grads, sums, bn_sums, rules
    micro = jax.tree_util.tree_map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)

    def body(carry, xs):
        mb, index = xs
        (_, (m, st)), g = grad_fn(params, mb, index)
        return jax.tree_util.tree_map(jnp.add, carry, (g, m, st)), None

    (_, (sums, bn_sums)), grads = grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], micro), 0)
    (grads, sums, bn_sums), _ = lax.scan(
        body, (grads, sums, bn_sums),
        (jax.tree_util.tree_map(lambda x: x[1:], micro), jnp.arange(1, k, dtype=jnp.int32)))
    models.check_batch_stats(batch_stats, rules)
    return grads, sums, bn_sums, rules

