"""Per-step metric sums: what a train or eval step measures, by name.

A step sums, over the real rows of its batch (mask 1), the loss, the top-1 and
top-5 hits and the row count; the train step adds whether its update was
applied (``finite``), the loss scale after it and the global L2 norm of the
mean gradient the optimizer received (``grad_norm``). The four sums travel as
one ``[4]`` float32 vector in the deep bucket's all-reduce (the seed's
R_RESULT region) and leave the step as a :class:`StepMetrics`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

METRICS = ("loss_sum", "top1_correct", "top5_correct", "count")
"""The per-step sums, in the order of the ``[4]`` vector carried in a bucket."""

SUMMED = 5
""":class:`StepMetrics`' first fields, summed by :meth:`StepMetrics.plus` (the four sums
and ``finite``); the ones after (``loss_scale``, ``grad_norm``) are the latest step's.
A checkpoint saves a total as its list of fields (``trjax.train.loop_io.MetricsReader``);
one saved before ``grad_norm`` existed (six values) restores with ``grad_norm`` NaN."""


class StepMetrics(NamedTuple):
    """One step's global sums (float32 scalars, replicated), or a running total.

    Attributes:
      loss_sum: sum of per-example cross-entropy losses over real rows
        (non-finite when any real row's loss is).
      top1, top5: real rows whose true class ranks first / within the top 5
        (ties against the label, NaN rows never; see :func:`batch_metrics`).
      count: real rows (mask 1).
      finite: 1.0 when the update was applied, 0.0 when a non-finite gradient
        skipped it; in a total (:meth:`plus`), the number of applied steps.
      loss_scale: the train state's loss scale after the step (fp16 dynamic
        scaling; 1.0 otherwise), so the host reads the device's value instead
        of recomputing it; in a total, the latest step's.
      grad_norm: the global L2 norm of the mean gradient the optimizer received
        (after the exchange's mean over the data axis, before any clipping;
        unscaled float32 under fp16 loss scaling; on a mesh that splits
        parameters, of the whole leaves: each element counted once); non-finite
        on a skipped step. In a total, the latest step's, as ``loss_scale``:
        a norm is not a sum, and the step log reports the last step's, as
        PyTorch loops that log ``clip_grad_norm_``'s return value and
        Hugging Face's Trainer do. NaN: no step measured it (a total with no
        step yet, a window restored from a checkpoint written before
        ``grad_norm`` existed).
    """
    loss_sum: Any
    top1: Any
    top5: Any
    count: Any
    finite: Any = 1.0
    loss_scale: Any = 1.0
    grad_norm: Any = float("nan")

    @classmethod
    def from_sums(cls, sums, finite=1.0, loss_scale=1.0,
                  grad_norm=float("nan")) -> "StepMetrics":
        """From a ``[4]`` vector ordered as :data:`METRICS`."""
        return cls(sums[0], sums[1], sums[2], sums[3], finite, loss_scale, grad_norm)

    @classmethod
    def zeros(cls) -> "StepMetrics":
        """The total of no step: sums 0, ``loss_scale`` 1, ``grad_norm`` NaN."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 1.0, float("nan"))

    def to_host(self) -> "StepMetrics":
        """Python floats, from replicated (possibly multi-process) arrays: each
        read from this process's first shard, in one batched transfer."""
        local = [v.addressable_shards[0].data if isinstance(v, jax.Array) else v for v in self]
        return StepMetrics(*(float(v) for v in jax.device_get(local)))

    def plus(self, other: "StepMetrics") -> "StepMetrics":
        """Sums of the two (``loss_scale``, ``grad_norm``: ``other``'s, the later step's)."""
        summed = (a + b for a, b in zip(self[:SUMMED], other[:SUMMED]))
        return StepMetrics(*summed, *other[SUMMED:])

    def rates(self) -> dict[str, float]:
        """``{"loss", "top1", "top5"}``: the sums over ``max(count, 1)``.

        A non-finite ``loss_sum`` gives a non-finite ``loss`` (NaN or inf, as
        the sum), which the caller reports as it is (``nan`` in the log line,
        ``NaN`` in metrics.jsonl / summary.json)."""
        count = max(float(self.count), 1.0)
        return {"loss": float(self.loss_sum) / count, "top1": float(self.top1) / count,
                "top5": float(self.top5) / count}


def batch_metrics(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                  losses: jax.Array | None = None) -> jax.Array:
    """Per-batch sums over real rows: ``[loss_sum, top1, top5, count]`` float32.

    Args:
      logits: ``[B, K]`` float32; labels: ``[B]`` int32 in ``[0, K)``;
      mask: ``[B]`` float32, 1 for real rows, 0 for padding.
      losses: ``[B]`` float32 per-example losses to sum instead of the
        softmax cross-entropy on ``labels`` (the train step's label smoothing,
        mixup / cutmix or user ``loss_fn``, :func:`trjax.steps.example_losses`);
        top-1/top-5 are still on ``labels``.

    Top-k rule (k = 1 and k = min(5, K)): a row is correct when fewer than k
    OTHER classes have a logit greater than OR EQUAL to the true class's logit,
    i.e. ties are broken against the label, and a row with any NaN logit is
    never correct. So all-equal logits over 10 classes score top-1 0 and
    top-5 0, and NaN logits score 0 (PyTorch's ``topk`` would instead rank
    tied classes by index, and NaN above every number). ``+inf`` is an
    ordinary value: a true logit of ``+inf`` is correct only if no other
    logit is ``+inf``.

    Padding rows count nowhere: their loss (NaN included) is replaced by 0,
    not multiplied by the mask. A real row whose loss is not finite makes
    ``loss_sum`` non-finite, and the caller reports it as such.
    """
    k = logits.shape[1]
    real = mask > 0
    if losses is None:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    true_logit = jnp.take_along_axis(logits, labels[:, None], axis=1)
    others = jnp.arange(k)[None, :] != labels[:, None]
    rank = jnp.sum((logits >= true_logit) & others, axis=1)
    valid = real & ~jnp.any(jnp.isnan(logits), axis=1)
    k5 = min(5, k)
    zero = jnp.zeros((), jnp.float32)
    return jnp.stack([jnp.sum(jnp.where(real, losses, zero)),
                      jnp.sum(jnp.where(valid & (rank < 1), 1.0, zero)),
                      jnp.sum(jnp.where(valid & (rank < k5), 1.0, zero)),
                      jnp.sum(jnp.where(real, 1.0, zero))]).astype(jnp.float32)
