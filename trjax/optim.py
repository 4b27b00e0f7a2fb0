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

The schedule is linear warmup from 0 to ``learning_rate`` then cosine decay to
0 (Goyal et al. 2017; Loshchilov & Hutter 2017), in optimizer steps.
"""

from __future__ import annotations

import jax
import optax

from trjax.regions import Region

KERNEL_REGIONS = (Region.FIRST_CONV, Region.DEEP_CONV, Region.FC_WEIGHT)
OPTIMIZERS = ("sgd", "lars")


def learning_rate_schedule(learning_rate: float, warmup_steps: int, total_steps: int):
    """Warmup + cosine schedule: step (int) -> learning rate (float32)."""
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=0.0)


def kernel_mask(plan) -> object:
    """Pytree of bools shaped like the params of ``plan``: True for conv/dense kernels."""
    flags = [s.region in KERNEL_REGIONS for s in plan.slots]
    return jax.tree_util.tree_unflatten(plan.params_treedef, flags)


def make_optimizer(name: str, schedule, plan, *, momentum: float = 0.9,
                   weight_decay: float = 5e-4, nesterov: bool = False,
                   trust_coefficient: float = 0.001) -> optax.GradientTransformation:
    """Builds the optimizer ``name`` (one of ``OPTIMIZERS``) for the params of ``plan``.

    Args:
      name: ``sgd`` or ``lars``.
      schedule: learning rate, a float or ``step -> float``.
      plan: the :class:`trjax.plan.MemoryPlan` (its regions say which leaves
        are kernels: weight decay and the LARS trust ratio apply to them only).

    Raises:
      ValueError: unknown optimizer name.
    """
    mask = kernel_mask(plan)
    if name == "sgd":
        return optax.chain(optax.add_decayed_weights(weight_decay, mask=mask),
                           optax.sgd(schedule, momentum=momentum, nesterov=nesterov))
    if name == "lars":
        return optax.lars(schedule, weight_decay=weight_decay, weight_decay_mask=mask,
                          trust_coefficient=trust_coefficient, trust_ratio_mask=mask,
                          momentum=momentum, nesterov=nesterov)
    raise ValueError(f"optimizer {name!r} is unknown; choose one of {OPTIMIZERS}")
