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
* :func:`open_tensorboard`, :func:`tensorboard_step_row`, :func:`tensorboard_epoch_row`,
  :func:`tensorboard_run_end` -- ``WORKDIR/tensorboard``: scalars grouped by
  quantity (``loss/train``, ``loss/val``, ``top1/val``, ``lr``, ...), the config as
  text, at the end the hparams with the final metrics.
* :class:`Profiler` -- ``profile_steps="A:B"``: a ``jax.profiler`` trace of
  steps A..B into ``WORKDIR/profile``.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import time
from typing import Callable

import jax

from trjax.configs import default as default_config
from trjax.metrics import StepMetrics
from trjax.train.config import RESUME_MAY_CHANGE, parse_profile_steps
from trjax.train.metrics_log import read_rows

SCHEDULE_NOTE = {"num_epochs": " (the warmup + cosine learning-rate schedule is recomputed over "
                               "the new total steps: the learning rate changes from the "
                               "restored step on)"}
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
        # a key the saved config lacks (added to trjax since) counts as its default
        defaults = _flat(json.loads(json.dumps(default_config.get_config().to_dict(),
                                               default=str)))
        a, b = {**{k: v for k, v in defaults.items() if k in _flat(now)}, **_flat(saved)}, \
            _flat(now)
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


STEP_SCALARS = ("loss", "top1", "images_per_s", "lr", "loss_scale", "skipped_steps", "grad_norm")
"""The step-log row's values written to TensorBoard (under :func:`step_tag`)."""

STEP_SCALARS_OPTIONAL = ("grad_norm",)
"""Step-log values that rows written before they existed lack: a resumed run rebuilds
such rows' other scalars into TensorBoard (:func:`open_tensorboard`), not these."""

STEP_TAGS = {"loss": "loss/train_step", "top1": "top1/train_step", "lr": "lr/step",
             "images_per_s": "throughput/images_per_s_step", "loss_scale": "loss_scale/step",
             "skipped_steps": "skipped_steps/step", "grad_norm": "grad_norm/step"}
"""TensorBoard tag of each step-log value: grouped by quantity (the part before ``/``),
beside the epoch rows' (:func:`epoch_tag`)."""

EPOCH_TAGS = {"lr": "lr", "images_per_s": "throughput/images_per_s", "epoch_s": "time/epoch_s"}
"""TensorBoard tags of the epoch row's values that are not a split's metric."""


def epoch_tag(key: str) -> str:
    """The TensorBoard tag of an epoch row's (``metrics.jsonl``) value: a split's
    metric is grouped by the metric, ``train_loss`` -> ``loss/train``, ``val_top1``
    -> ``top1/val``, ``val_ema_top5`` -> ``top5/val_ema``; ``lr`` -> ``lr``,
    ``images_per_s`` -> ``throughput/images_per_s``, ``epoch_s`` -> ``time/epoch_s``;
    any other key is its own tag."""
    if key in EPOCH_TAGS:
        return EPOCH_TAGS[key]
    for split in ("val_ema", "train", "val"):
        if key.startswith(split + "_") and len(key) > len(split) + 1:
            return f"{key[len(split) + 1:]}/{split}"
    return key


def step_tag(key: str) -> str:
    """The TensorBoard tag of a step-log value (:data:`STEP_TAGS`; e.g. ``loss`` ->
    ``loss/train_step``, ``lr`` -> ``lr/step``)."""
    return STEP_TAGS.get(key, f"{key}/step")


def tensorboard_step_row(tb, row: dict) -> None:
    """A step-log row (``steps.jsonl``) as TensorBoard scalars (:func:`step_tag`); a
    value of :data:`STEP_SCALARS_OPTIONAL` the row lacks (an older trjax's) is left out."""
    for k in STEP_SCALARS:
        if k in row or k not in STEP_SCALARS_OPTIONAL:
            tb.add_scalar(step_tag(k), row[k], row["step"])


def tensorboard_epoch_row(tb, row: dict) -> None:
    """An epoch row (``metrics.jsonl``) as TensorBoard scalars (:func:`epoch_tag`), then a flush."""
    for k, v in row.items():
        if k not in ("epoch", "step"):
            tb.add_scalar(epoch_tag(k), v, row["step"])
    tb.flush()


HPARAMS_RUN = "hparams"
"""The folder under ``WORKDIR/tensorboard`` that :func:`tensorboard_run_end`'s hparams go to."""

HPARAM_METRICS = ("val_top1", "val_top5", "val_loss", "val_ema_top1", "val_ema_top5",
                  "val_ema_loss")
"""The summary's values the hparams carry as metrics (as ``hparam/<name>``; those present)."""


def config_text(config) -> str:
    """The resolved config as TensorBoard text: its ``config.json`` (sorted JSON),
    indented 4 spaces (a Markdown code block)."""
    text = json.dumps(json.loads(json.dumps(config.to_dict(), default=str)), indent=2,
                      sort_keys=True)
    return "\n".join("    " + line for line in text.splitlines())


def hparams_of(config) -> dict:
    """The config as TensorBoard hparams: every key, flattened with dots
    (``distributed.num_processes``); bools, ints, floats and strings as they are,
    ``None`` left out, anything else (lists, tuples) as its JSON text."""
    flat = _flat(json.loads(json.dumps(config.to_dict(), default=str)))
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
            for k, v in sorted(flat.items()) if v is not None}


def tensorboard_run_end(tb, config, summary: dict) -> None:
    """At the end of a run: the config as hparams with the final metrics
    (tensorboardX ``add_hparams``: ``hparam/val_top1``, ``hparam/val_top5``,
    ``hparam/val_loss``, and the EMA's when evaluated) at the run's last step,
    into ``WORKDIR/tensorboard/hparams``, for TensorBoard's HParams dashboard."""
    metrics = {f"hparam/{k}": float(summary[k]) for k in HPARAM_METRICS
               if summary.get(k) is not None}
    tb.add_hparams(hparams_of(config), metrics, name=HPARAMS_RUN,
                   global_step=int(summary["steps"]))
    tb.flush()


def open_tensorboard(config, workdir: str, say, resume: bool = False):
    """A tensorboardX writer on WORKDIR/tensorboard when ``config.tensorboard``
    and tensorboardX is importable (process 0 only); else None.

    Event files cannot drop the events a crash left past the restored step, so
    on ``resume`` the folder's event files are replaced by one rebuilt from
    ``metrics.jsonl`` and ``steps.jsonl`` (already cut back to the restored
    step: :class:`trjax.train.metrics_log.MetricsWriter`): every log shows each
    step once, as an uninterrupted run's would (and a former end's hparams are
    removed). The resolved config is written as text (tag ``config``, step 0);
    scalars are grouped by quantity (:func:`epoch_tag`, :func:`step_tag`); the
    hparams come at the run's end (:func:`tensorboard_run_end`). Call it after
    those files are opened for the resumed run."""
    if not config.tensorboard or jax.process_index() != 0:
        return None
    try:
        summary_writer = _tensorboardx_writer_class()
    except ImportError:
        say("tensorboard: off (tensorboardX is not installed: pip install 'trjax[tensorboard]')")
        return None
    folder = os.path.join(workdir, "tensorboard")
    if resume and os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("events.out.tfevents"):
                os.remove(os.path.join(folder, name))
        # a former end's hparams (a halted run's): the resumed run writes its own at its end
        shutil.rmtree(os.path.join(folder, HPARAMS_RUN), ignore_errors=True)
    tb = summary_writer(folder)
    tb.add_text("config", config_text(config), 0)
    for name, write in (("steps.jsonl", tensorboard_step_row),
                        ("metrics.jsonl", tensorboard_epoch_row)):
        path = os.path.join(workdir, name)
        if resume and os.path.isfile(path):
            for row in read_rows(path):
                if "step" in row and (write is tensorboard_epoch_row or
                                      all(k in row for k in STEP_SCALARS
                                          if k not in STEP_SCALARS_OPTIONAL)):
                    write(tb, row)
    return tb


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
    (:data:`MIN_LOSS_SCALE`). The loss scale is the device's, read back with
    each step's metrics (``StepMetrics.loss_scale``), never recomputed here.

    Args:
      lag: ``config.metrics_lag``.
      halt: ``config.halt_on_nonfinite``.
      fp16: dynamic loss scaling is on.
      log: one-line messages (process 0's print).
      max_overflows: ``config.max_consecutive_overflows`` (0: never stop).
      loss_scale: the restored state's loss scale (the scale before the first
        step this reader sees).
      skipped_steps: the restored state's skipped-step count.
      log_every: ``config.log_every_steps`` (0: no step log).
      on_log_row: called with each step-log row (dict).
      lr_of_step: the learning rate step t applied (float).
      steps_per_epoch: to name a step's epoch in the step log.
    """

    def __init__(self, lag: int, halt: bool, fp16: bool, log=print, *, max_overflows: int = 0,
                 loss_scale: float = 1.0, skipped_steps: int = 0, log_every: int = 0,
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
        self.skipped_total = int(skipped_steps)
        self.overflow_run: list[int] = []  # consecutive non-finite steps at the minimum scale
        self.log_every, self.on_log_row = log_every, on_log_row
        self.lr_of_step = lr_of_step or (lambda t: 0.0)
        self.steps_per_epoch = steps_per_epoch
        self.first_step_done_at = None  # time.time() when the first step's metrics came back

    def push(self, step: int, metrics) -> None:
        self.pending.append((step, metrics))
        self.drain(self.lag)

    def drain(self, limit: int = 0) -> None:
        while len(self.pending) > limit:
            step, m = self.pending.popleft()
            m = m.to_host()
            self.first_step_done_at = self.first_step_done_at or time.time()
            self.sums = self.sums.plus(m)
            self.window = self.window.plus(m)
            finite = m.finite != 0.0
            at_min = self.scale <= MIN_LOSS_SCALE  # the scale this step ran with
            if self.fp16:
                self.scale = m.loss_scale  # the device's, after the step
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
               "skipped_steps": self.skipped_total, "examples": w.count,
               # the window's last step's (StepMetrics.grad_norm), as loss_scale
               "grad_norm": w.grad_norm}
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
