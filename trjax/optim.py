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
0 (Goyal et al. 2017; Loshchilov & Hutter 2017), in TRAIN steps: the learning
rate of an update is the schedule at the train step's counter
(:func:`scale_by_step_schedule`, ``tx.update(..., step=state.step)``), so a step
skipped for a non-finite gradient (fp16 overflow) advances the schedule as it
advances the step log, as PyTorch's ``GradScaler`` with a per-iteration
``scheduler.step()`` does; Adam's bias-correction count stays that of the
applied updates (as ``torch.optim.Adam``'s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from trjax.regions import KERNEL_REGIONS

OPTIMIZERS = ("sgd", "lars", "adamw")


def learning_rate_schedule(learning_rate: float, warmup_steps: int, total_steps: int):
    """Warmup + cosine schedule: step (int) -> learning rate (float32).

    With ``W = min(warmup_steps, total_steps - 1)``, ``T = max(total_steps, W + 1)``
    and peak ``lr``: ``lr * t / W`` for ``t < W`` (linear from 0), then
    ``lr * (1 + cos(pi * (t - W) / (T - W))) / 2`` (cosine to 0 at ``t = T``;
    optax's ``warmup_cosine_decay_schedule``, Goyal et al. 2017 for the warmup,
    Loshchilov & Hutter 2017 for the cosine). Step ``t`` (0-based) is the rate of
    the update of train step ``t`` (:func:`scale_by_step_schedule`), applied or
    skipped.
    """
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=0.0)


def scale_by_step_schedule(schedule) -> optax.GradientTransformationExtraArgs:
    """``g <- -schedule(step) * g`` with ``step`` the train step's counter, passed
    as ``tx.update(updates, state, params, step=state.step)`` (trjax's exchanges
    always pass it; without it, e.g. the optimizer used alone, the count of
    applied updates, optax's own rule).

    Replaces ``optax.scale_by_learning_rate(schedule)``, which reads its own
    count of APPLIED updates: after k skipped steps every later update would use
    the rate of a step k behind the step log (and the first applied one, in
    warmup, rate 0). Its state is optax's ``ScaleByScheduleState`` (the applied
    updates' count, kept so checkpoints keep their structure); with no skipped
    step the two are bitwise the same.

    Args:
      schedule: ``step (int32 scalar) -> learning rate``, or a float.
    """
    fn = schedule if callable(schedule) else (lambda _: schedule)

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, step=None, **extra):
        del params, extra
        rate = -fn(state.count if step is None else step)
        updates = jax.tree_util.tree_map(lambda g: jnp.array(rate, dtype=g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


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
    rate = scale_by_step_schedule(schedule)
    if name == "sgd":  # optax.sgd's chain: trace, then the rate
        return optax.chain(add_decayed_weights(weight_decay, mask),
                           optax.chain(optax.trace(decay=momentum, nesterov=nesterov), rate))
    if name == "lars":  # optax.lars's chain (trust coefficient, eps 0), the rate by step
        if callable(mask):
            raise ValueError("optimizer 'lars' needs whole kernels (a per-leaf mask); "
                             "use optimizer='sgd' or 'adamw' with shard_optimizer_state=True")
        return optax.chain(
            optax.add_decayed_weights(weight_decay, mask=mask),
            optax.masked(optax.scale_by_trust_ratio(trust_coefficient=trust_coefficient,
                                                    eps=0.0), mask=mask),
            rate, optax.trace(decay=momentum, nesterov=nesterov))
    if name == "adamw":  # optax.adamw's own chain, with trjax's (per-leaf or per-element) mask
        return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                           add_decayed_weights(weight_decay, mask), rate)
    raise ValueError(f"optimizer {name!r} is unknown; choose one of {OPTIMIZERS}")
