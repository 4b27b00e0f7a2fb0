"""Optimizers and learning-rate schedules, built from optax pieces.

* ``sgd``: momentum SGD (optionally Nesterov) with decoupled-from-BN weight
  decay: ``g <- g + wd * w`` for conv and dense kernels only.
* ``lars``: optax's LARS (You, Gitman & Ginsburg, "Large Batch Training of
  Convolutional Networks", 2017). For a kernel ``w`` with gradient ``g`` optax
  computes ``g' = g + wd * w``, then the trust ratio
  ``tr = trust_coefficient * ||w|| / ||g'||`` (1 if either norm is 0) and
  applies momentum SGD to ``tr * g'``. You et al. put the trust coefficient in
  the same place (their eta) and use ``||g|| + wd * ||w||`` in the denominator;
  optax uses ``||g + wd*w||``. BN scales/biases and all biases skip both the
  decay and the trust ratio (plain momentum SGD), as in You et al.
* ``adamw``: optax's ``adamw`` (Loshchilov & Hutter, "Decoupled Weight Decay
  Regularization", ICLR 2019): Adam's moments (Kingma & Ba 2015; ``b1``, ``b2``,
  ``eps``), then the decoupled decay ``u <- u + wd * w`` on conv and dense
  kernels only (the same mask as ``sgd``), then ``-lr(t) * u``. Unlike an L2
  term added to the gradient (as ``sgd`` does), the decay is not divided by
  Adam's second-moment estimate; it is scaled by the learning rate (as in optax
  and PyTorch's ``AdamW``).

The schedule is linear warmup from 0 to ``learning_rate`` then cosine decay to
0 (Goyal et al. 2017; Loshchilov & Hutter 2017), in optimizer steps.
"""

from __future__ import annotations

import jax
import optax

from trjax.regions import KERNEL_REGIONS

OPTIMIZERS = ("sgd", "lars", "adamw")


def learning_rate_schedule(learning_rate: float, warmup_steps: int, total_steps: int):
    """Warmup + cosine schedule: step (int) -> learning rate (float32).

    With ``W = min(warmup_steps, total_steps - 1)``, ``T = max(total_steps, W + 1)``
    and peak ``lr``: ``lr * t / W`` for ``t < W`` (linear from 0), then
    ``lr * (1 + cos(pi * (t - W) / (T - W))) / 2`` (cosine to 0 at ``t = T``;
    optax's ``warmup_cosine_decay_schedule``, Goyal et al. 2017 for the warmup,
    Loshchilov & Hutter 2017 for the cosine). Step ``t`` (0-based) is the rate the
    ``t + 1``-th update applies.
    """
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=0.0)


def kernel_mask(plan) -> object:
    """Pytree of bools shaped like the params of ``plan``: True for conv/dense
    kernels (:data:`trjax.regions.KERNEL_REGIONS`)."""
    flags = [s.region in KERNEL_REGIONS for s in plan.slots]
    return jax.tree_util.tree_unflatten(plan.params_treedef, flags)


def add_decayed_weights(weight_decay: float, mask) -> optax.GradientTransformation:
    """``g <- g + weight_decay * w`` where ``mask`` says, the one weight-decay rule.

    Args:
      weight_decay: the coefficient (L2 penalty ``wd/2 * ||w||^2``).
      mask: a pytree of bools, one per leaf (``optax.add_decayed_weights``'
        mask, e.g. :func:`kernel_mask`); or a callable ``params -> pytree of
        float 0/1 arrays shaped like params``, one flag per element (flat
        ZeRO-1 shards, where kernels and vectors share a buffer):
        ``g + (weight_decay * mask) * w``.
    """
    if not callable(mask):
        return optax.add_decayed_weights(weight_decay, mask=mask)

    def update(updates, state, params):
        decay = jax.tree_util.tree_map(lambda g, m, p: g + weight_decay * m * p,
                                       updates, mask(params), params)
        return decay, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(name: str, schedule, plan=None, *, mask=None, momentum: float = 0.9,
                   weight_decay: float = 5e-4, nesterov: bool = False,
                   trust_coefficient: float = 0.001, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> optax.GradientTransformation:
    """Builds the optimizer ``name`` (one of ``OPTIMIZERS``).

    Args:
      name: ``sgd``, ``lars`` or ``adamw``.
      schedule: learning rate, a float or ``step -> float``.
      plan: the :class:`trjax.plan.MemoryPlan` (its regions say which leaves
        are kernels: weight decay and the LARS trust ratio apply to them only).
      mask: instead of ``plan``: the decay mask of :func:`add_decayed_weights`
        (``sgd`` and ``adamw`` only when it is a per-element callable: both
        are elementwise, so they also run on flat ZeRO-1 shards).
      momentum, nesterov: ``sgd`` and ``lars``.
      weight_decay: ``sgd``/``lars``: the L2 coefficient added to the
        gradient; ``adamw``: the decoupled decay (times the learning rate).
      trust_coefficient: ``lars``.
      b1, b2, eps: ``adamw``: Adam's moment decays and denominator epsilon
        (optax's ``scale_by_adam``).

    Raises:
      ValueError: unknown optimizer name, or LARS with a per-element mask.
    """
    mask = kernel_mask(plan) if mask is None else mask
    if name == "sgd":
        return optax.chain(add_decayed_weights(weight_decay, mask),
                           optax.sgd(schedule, momentum=momentum, nesterov=nesterov))
    if name == "lars":
        if callable(mask):
            raise ValueError("optimizer 'lars' needs whole kernels (a per-leaf mask); "
                             "use optimizer='sgd' or 'adamw' with shard_optimizer_state=True")
        return optax.lars(schedule, weight_decay=weight_decay, weight_decay_mask=mask,
                          trust_coefficient=trust_coefficient, trust_ratio_mask=mask,
                          momentum=momentum, nesterov=nesterov)
    if name == "adamw":  # optax.adamw's own chain, with trjax's (per-leaf or per-element) mask
        return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                           add_decayed_weights(weight_decay, mask),
                           optax.scale_by_learning_rate(schedule))
    raise ValueError(f"optimizer {name!r} is unknown; choose one of {OPTIMIZERS}")
