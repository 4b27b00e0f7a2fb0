"""Mixed precision: compute dtypes and dynamic loss scaling.

* ``fp32``: everything float32.
* ``bf16``: convolutions/dense layers compute in bfloat16; master weights,
  BatchNorm statistics, the loss and the gradient all-reduce stay float32.
* ``fp16``: compute in float16 with dynamic loss scaling (Micikevicius et al.,
  "Mixed Precision Training", ICLR 2018; the scheme of PyTorch's GradScaler):
  the loss is multiplied by ``scale`` before backward and the gradients divided
  by it after the all-reduce. A non-finite reduced gradient skips the step and
  halves the scale; after ``growth_interval`` finite steps in a row the scale
  doubles. The decision uses all-reduced values, so every replica holds the
  same scale.
"""

from __future__ import annotations

import jax.numpy as jnp

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
INITIAL_LOSS_SCALE = 2.0 ** 15


def compute_dtype(precision: str):
    """``"fp32" | "bf16" | "fp16"`` -> jnp dtype; ``ValueError`` otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def update_loss_scale(scale, good_steps, finite, growth_interval: int = 2000,
                      factor: float = 2.0, min_scale: float = 1.0):
    """One step of dynamic loss scaling (pure; float32 scale, int32 counter).

    Returns ``(new_scale, new_good_steps)``: halve (not below ``min_scale``)
    and reset on a non-finite step; double after ``growth_interval`` finite
    steps in a row.
    """
    grown = good_steps + 1 >= growth_interval
    new_scale = jnp.where(finite, jnp.where(grown, scale * factor, scale),
                          jnp.maximum(scale / factor, min_scale))
    new_good = jnp.where(finite & ~grown, good_steps + 1, 0)
    return new_scale.astype(jnp.float32), new_good.astype(jnp.int32)
