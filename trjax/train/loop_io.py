"""The training loop's host side: step metrics, the step log, the run's config file, the profiler.

* :class:`MetricsReader` -- reads each step's metric sums ``lag`` steps
  behind the dispatch; keeps the epoch's and the log window's sums; stops
  the run on a non-finite step (``halt_on_nonfinite``, every precision) or
  after ``max_consecutive_overflows`` non-finite steps in a row at the
  minimum loss scale (every precision: fp32/bf16 have a fixed scale of 1,
  their minimum); every ``log_every_steps`` it emits a step-log row.
* :func:`save_config` -- ``WORKDIR/config.json``: the resolved config; on
  resume the saved one is compared and a difference outside
  :data:`RESUME_MAY_CHANGE` is an error naming every differing key.
* :class:`Profiler` -- ``profile_steps="A:B"``: a ``jax.profiler`` trace of
  steps A..B into ``WORKDIR/profile``.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Callable

import jax

from trjax.metrics import StepMetrics

RESUME_MAY_CHANGE = (
    "num_epochs", "halt_after_steps", "resume", "log_every_steps", "progress", "tensorboard",
    "profile_steps", "checkpoint_every_steps", "keep_checkpoints", "checkpoint_async",
    "step_timeout_s", "halt_on_nonfinite", "max_consecutive_overflows", "metrics_lag",
    "prefetch", "data_workers", "data_dir", "devices", "cpu_devices", "cpu_convolutions",
    "conv_lowering", "cpu_reuse_memory", "compilation_cache", "compilation_cache_dir", "distributed",
    "preemption_check_every_steps", "verify_images")
"""Config keys (top level) that may differ between a run and its resume: where
and how it runs and logs, how long, how often it saves; none changes the
arithmetic of a step or the data order."""

SCHEDULE_NOTE = {"num_epochs": " (the warmup + cosine learning-rate schedule is recomputed over "
                               "the new total steps: the learning rate changes from the "
                               "restored step on)",
                 "conv_lowering": " (bucket_kernel_order='auto' keeps the checkpoint's order "
                                  "where compression or ZeRO-1 state is laid out in it)"}
"""What a change of a key in :data:`RESUME_MAY_CHANGE` does to the steps that follow."""

MIN_LOSS_SCALE = 1.0  # trjax.precision.update_loss_scale's floor


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def save_config(config, workdir: str, resuming: bool, write: bool = True) -> list[str]:
    """Writes ``workdir/config.json`` (the resolved config, atomically).

    With ``resuming`` and a saved ``config.json``, compares first (every
    process compares, so all stop on a difference; only ``write`` ones write).

    Returns:
      ``"key: saved -> now"`` for each allowed difference (for the log).

    Raises:
      ValueError: keys outside :data:`RESUME_MAY_CHANGE` differ; names each
        with both values.
    """
    path = os.path.join(workdir, "config.json")
    now = json.loads(json.dumps(config.to_dict(), default=str))
    changed = []
    if resuming and os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        a, b = _flat(saved), _flat(now)
        diff = {k: (a.get(k, "<absent>"), b.get(k, "<absent>"))
                for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")}
        bad = {k: v for k, v in diff.items() if k.split(".")[0] not in RESUME_MAY_CHANGE}
        if bad:
            raise ValueError(
                f"this config differs from the one the run in {workdir} was started with "
                f"({path}): " + ", ".join(f"{k}: {x!r} -> {y!r}" for k, (x, y) in bad.items()) +
                "; resume with the same values, or use another workdir (keys that may change on "
                f"resume: {', '.join(RESUME_MAY_CHANGE)})")
        changed = [f"{k}: {x!r} -> {y!r}" + SCHEDULE_NOTE.get(k, "") for k, (x, y) in diff.items()]
    if write:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(now, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    return changed


def open_tensorboard(config, workdir: str, say):
    """A tensorboardX writer on WORKDIR/tensorboard when ``config.tensorboard``
    and tensorboardX is importable (process 0 only); else None."""
    if not config.tensorboard or jax.process_index() != 0:
        return None
    try:
        summary_writer = _tensorboardx_writer_class()
    except ImportError:
        say("tensorboard: off (tensorboardX is not installed: pip install 'trjax[tensorboard]')")
        return None
    return summary_writer(os.path.join(workdir, "tensorboard"))


def _tensorboardx_writer_class():
    """``tensorboardX.SummaryWriter``, imported without importing torch.

    tensorboardX imports torch whenever it is installed, only to accept torch
    tensors as values; trjax writes Python floats, and the torch import costs
    1-2 s of every run's start-up. ``sys.modules["torch"] = None`` (Python's
    documented way to make an import fail) blocks it during tensorboardX's own
    import only; a later ``import torch`` works as usual.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsReader:
    """Reads step metrics ``lag`` steps behind the dispatch (host side).

    ``push(step, metrics)`` queues a step's device metrics; once more than
    ``lag`` are queued the oldest is fetched (a few bytes, already computed)
    and added to the epoch sums (``sums``) and the log window's sums.

    A skipped (non-finite) step is logged with its number. It raises
    ``FloatingPointError`` when ``halt`` (``config.halt_on_nonfinite``), in
    every precision (fp16: a step non-finite at the minimum loss scale; above
    it an overflow only halves the scale, loss scaling's normal work), and -- whatever ``halt`` -- once ``max_overflows``
    consecutive steps were non-finite while the loss scale sat at its minimum
    (:data:`MIN_LOSS_SCALE`; the host mirrors the fp16 scale update of
    :func:`trjax.precision.update_loss_scale` exactly, powers of two).

    Args:
      lag: ``config.metrics_lag``.
      halt: ``config.halt_on_nonfinite``.
      fp16: dynamic loss scaling is on.
      log: one-line messages (process 0's print).
      max_overflows: ``config.max_consecutive_overflows`` (0: never stop).
      loss_scale, good_steps: the restored state's fp16 scale and counter.
      growth_interval: ``config.loss_scale_growth_interval``.
      skipped_steps: the restored state's skipped-step count.
      log_every: ``config.log_every_steps`` (0: no step log).
      on_log_row: called with each step-log row (dict).
      lr_of_step: the learning rate step t applied (float).
      steps_per_epoch: to name a step's epoch in the step log.
    """

    def __init__(self, lag: int, halt: bool, fp16: bool, log=print, *, max_overflows: int = 0,
                 loss_scale: float = 1.0, good_steps: int = 0, growth_interval: int = 2000,
                 skipped_steps: int = 0, log_every: int = 0,
                 on_log_row: Callable[[dict], None] | None = None,
                 lr_of_step: Callable[[int], float] | None = None, steps_per_epoch: int = 0):
        self.lag, self.halt, self.fp16, self.log = lag, halt, fp16, log
        self.pending: collections.deque = collections.deque()
        self.sums = StepMetrics.zeros()
        self.window = StepMetrics.zeros()
        self.window_t0 = time.perf_counter()
        self._window_restored = 0.0  # images of the window trained before a restart
        self.skipped: list[int] = []
        self.max_overflows = max_overflows
        self.scale = float(loss_scale) if fp16 else MIN_LOSS_SCALE
        self.good = int(good_steps)
        self.growth_interval = growth_interval
        self.skipped_total = int(skipped_steps)
        self.overflow_run: list[int] = []  # consecutive non-finite steps at the minimum scale
        self.log_every, self.on_log_row = log_every, on_log_row
        self.lr_of_step = lr_of_step or (lambda t: 0.0)
        self.steps_per_epoch = steps_per_epoch
        self.first_step_done_at = None  # time.time() when the first step's metrics came back

    def push(self, step: int, metrics) -> None:
        self.pending.append((step, metrics))
        self.drain(self.lag)

    def _loss_scale_update(self, finite: bool) -> None:
        if not self.fp16:
            return
        if finite:
            self.good += 1
            if self.good >= self.growth_interval:
                self.scale, self.good = self.scale * 2.0, 0
        else:
            self.scale, self.good = max(self.scale / 2.0, MIN_LOSS_SCALE), 0

    def drain(self, limit: int = 0) -> None:
        while len(self.pending) > limit:
            step, m = self.pending.popleft()
            m = m.to_host()
            self.first_step_done_at = self.first_step_done_at or time.time()
            self.sums = self.sums.plus(m)
            self.window = self.window.plus(m)
            finite = m.finite != 0.0
            at_min = self.scale <= MIN_LOSS_SCALE
            self._loss_scale_update(finite)
            if finite:
                self.overflow_run = []
            else:
                self.skipped.append(step)
                self.skipped_total += 1
                msg = f"step {step}: non-finite gradient, update skipped on every replica"
                if self.fp16:
                    msg += f" (fp16: loss scale now {self.scale:g})"
                if self.halt and at_min:  # fp16 above the minimum: the scale halves (normal)
                    raise FloatingPointError(msg + " (config.halt_on_nonfinite=True)")
                self.log(msg)
                self.overflow_run = self.overflow_run + [step] if at_min else []
                if self.max_overflows and len(self.overflow_run) >= self.max_overflows:
                    raise FloatingPointError(
                        f"steps {self.overflow_run[0]}..{step}: {len(self.overflow_run)} consecutive "
                        f"non-finite steps with the loss scale at its minimum "
                        f"{MIN_LOSS_SCALE:g} (config.max_consecutive_overflows="
                        f"{self.max_overflows}); the run diverged or its input/model overflows "
                        f"{'float16' if self.fp16 else 'float32'}. Stopped without saving "
                        "(the checkpoints already in the workdir, if any, are kept). Lower the "
                        "learning rate or check the data" +
                        (", or use precision='bf16' or 'fp32'" if self.fp16 else ""))
            if self.log_every and step % self.log_every == 0:
                self._log_row(step)

    def _log_row(self, step: int) -> None:
        now = time.perf_counter()
        w = self.window
        row = {"step": step,
               "epoch": (step - 1) // self.steps_per_epoch + 1 if self.steps_per_epoch else None,
               "loss": w.rates()["loss"], "top1": w.rates()["top1"],
               # images this process trained in the window (a resumed window's earlier
               # images were trained before the restart, outside the time measured here)
               "images_per_s": (w.count - self._window_restored) / max(now - self.window_t0, 1e-9),
               "lr": float(self.lr_of_step(step)), "loss_scale": self.scale,
               "skipped_steps": self.skipped_total, "examples": w.count}
        self.window, self.window_t0, self._window_restored = StepMetrics.zeros(), now, 0.0
        if self.on_log_row is not None:
            self.on_log_row(row)

    def take(self) -> StepMetrics:
        """Drains every step and returns the epoch's sums, starting the next epoch at 0."""
        self.drain(0)
        sums, self.sums = self.sums, StepMetrics.zeros()
        return sums

    def position(self) -> dict:
        """What a checkpoint carries so a resumed run logs what an uninterrupted
        one would (call after ``drain(0)``)."""
        return {"train_sums": [float(v) for v in self.sums],
                "log_window_sums": [float(v) for v in self.window],
                "skipped_step_numbers": list(self.skipped)}

    def restore(self, meta: dict) -> None:
        """The inverse of :meth:`position` (absent keys: zeros, e.g. old checkpoints)."""
        if meta.get("train_sums"):
            self.sums = StepMetrics(*meta["train_sums"])
        if meta.get("log_window_sums"):
            self.window = StepMetrics(*meta["log_window_sums"])
            self._window_restored = float(self.window.count)
        self.skipped = list(meta.get("skipped_step_numbers", []))


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """``"A:B"`` -> ``(A, B)`` with ``1 <= A <= B``; ``""`` -> None.

    Raises:
      ValueError: naming ``config.profile_steps`` and the expected form.
    """
    if not spec:
        return None
    try:
        a, b = (int(x) for x in str(spec).split(":"))
    except ValueError:
        a, b = 0, -1
    if not 1 <= a <= b:
        raise ValueError(f"config.profile_steps={spec!r} must be 'A:B' with 1 <= A <= B "
                         "(steps A..B traced into WORKDIR/profile), or '' for none")
    return a, b


class Profiler:
    """A ``jax.profiler`` trace of steps ``A..B`` (``config.profile_steps``)
    into ``WORKDIR/profile`` (open it with TensorBoard's profile plugin or
    Perfetto). :meth:`before` is called before dispatching a step,
    :meth:`after` once its metrics were read; :meth:`close` ends a trace the
    loop left early."""

    def __init__(self, spec: str, workdir: str, log=print):
        self.window = parse_profile_steps(spec)
        self.dir = os.path.join(workdir, "profile")  # one folder per process if several
        if jax.process_count() > 1:
            self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")
        self.log, self.active = log, False

    def before(self, step: int) -> None:
        if self.window and step == self.window[0] and not self.active:
            jax.profiler.start_trace(self.dir)
            self.active = True

    def after(self, step: int, block=None) -> None:
        if self.active and step >= self.window[1]:
            if block is not None:
                jax.block_until_ready(block)
            self.close()
            self.log(f"profile of steps {self.window[0]}..{self.window[1]} -> {self.dir}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
