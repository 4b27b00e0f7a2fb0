"""The training loop: a built :class:`trjax.train.trainer.Trainer` -> epochs of steps, evaluation, checkpoints.

``train_and_evaluate(config, workdir)`` is the whole job (the Flax ImageNet
example's shape). It is the only place with side effects: it prints one log
line per epoch (and a step log line every ``log_every_steps``) and writes
``workdir/config.json``, ``metrics.jsonl`` (one JSON line per epoch, through
:class:`trjax.train.metrics_log.MetricsWriter`), ``steps.jsonl``, ``summary.json``,
TensorBoard events and checkpoints. The host side of the loop (metric reads,
step log, config file, profiler) is :mod:`trjax.train.loop_io`; stops on a signal
and the exit codes are :mod:`trjax.train.stops`.

Its parts, in order: :func:`check_workdir` (resume or start, errors before
compiling), the build (:func:`trjax.train.trainer.setup`), :meth:`Run.restore`
(the newest readable checkpoint and the logs back to its step), the epochs
(:meth:`Run.train_epoch`, :meth:`Run.end_epoch`: evaluation, the epoch's row,
the checkpoint) and :meth:`Run.summary`.

The host never runs ahead of the devices by more than ``config.metrics_lag``
steps: after dispatching step t it reads step t-lag's metrics (already
computed, a few bytes). This keeps the device busy and bounds the queue of
collectives (dispatching many unawaited steps deadlocks XLA's CPU rendezvous).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from trjax.cpu import host
from trjax.data import input_pipeline
from trjax.train import checkpoint, compilation, distributed, loop_io, metrics_log, planner, stops
from trjax.train import init_from as init_from_lib
from trjax.train.trainer import Trainer, checkpoint_keys, evaluate_pass, prepare, setup
from trjax.train.workdir import check_writable, holds_workdir
from trjax.world import host_value


def _progress(total: int, epoch: int, enabled: bool):
    """A tqdm bar on a terminal; a no-op object elsewhere (CI, logs, files)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"epoch {epoch}", unit="step", leave=False,
                disable=not enabled, dynamic_ncols=True)


@contextlib.contextmanager
def _finishing(ckpt, seconds: list):
    """On leaving the loop, waits for the checkpoint save in flight (so the
    last save is complete before the process exits). If the loop raised, a
    failed save is reported and the loop's error propagates; with several
    processes it does not wait then (a save's commit is a barrier across the
    processes, and a failed collective usually means a peer is gone: the wait
    would block until the distributed runtime aborts the process)."""
    try:
        yield
    except BaseException:
        if jax.process_count() == 1:
            try:
                checkpoint.finish(ckpt)
            except Exception as e:
                print(f"checkpoint save failed too: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    t = time.perf_counter()
    checkpoint.finish(ckpt)
    seconds[0] += time.perf_counter() - t


@holds_workdir  # one live run per workdir (process 0 holds WORKDIR/trjax.lock)
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       data: input_pipeline.Dataset | None = None, model=None, tx=None,
                       loss_fn=None, transform=None, init_from=None):
    """Trains and evaluates, checkpointing under ``workdir/checkpoints``.

    Resumes by default from the newest readable checkpoint in ``workdir``
    (``config.resume``), at the exact step and data position it was saved at.

    Args:
      config: see ``configs/default.py``.
      workdir: where ``metrics.jsonl``, ``summary.json`` and checkpoints go.
      data: optional in-memory :class:`trjax.data.Dataset`.
      model: optional flax model (linen or nnx) instead of ``config.model``
        (see :func:`trjax.train.trainer.prepare`).
      tx: optional optax optimizer instead of the config's (see
        :func:`trjax.train.trainer.prepare`); pass the same one on resume.
      loss_fn: optional per-example training loss ``(logits [B, K], labels [B])
        -> [B]`` (see :func:`trjax.train.trainer.prepare`).
      transform: optional per-example training augmentation ``(uint8 image
        [H, W, C], rng) -> uint8 image`` (see :func:`trjax.train.trainer.prepare`).
      init_from: optional weights for a fresh run instead of
        ``config.init_from``: a path or a ``{"params", "batch_stats"}`` tree
        (:mod:`trjax.train.init_from`); ignored when the run resumes.

    Returns:
      ``(state, summary)``: the final :class:`trjax.state.TrainState` and the
      summary dict (also written to ``summary.json`` by process 0).

    Raises:
      ValueError: an invalid config, device spec or batch split (before any
        compilation), an incompatible checkpoint (another config, or other
        training data than the checkpoint's position counts), or
        ``config.resume=False`` into a workdir that holds checkpoints.
      FloatingPointError: a skipped non-finite step when
        ``config.halt_on_nonfinite``, or ``config.max_consecutive_overflows``
        non-finite steps in a row at the minimum loss scale (no checkpoint is
        written at that stop).
      trjax.train.stops.Preempted: SIGTERM/SIGUSR1 arrived; the checkpoint at the
        step every process agreed on is saved and the logs are flushed.
      OSError (or orbax's error): a checkpoint write failed; raised at the
        next save or at the end of the loop (the previous checkpoints stay).
      trjax.train.workdir.WorkdirBusy: another live run writes into ``workdir``.
    """
    t_start = time.perf_counter()
    cache = compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
    config, plan = planner.resolve_auto(  # mesh="auto": the planner's winner
        config, data, model, tx, loss_fn, transform,
        say=print if jax.process_index() == 0 else (lambda *a, **k: None))
    prepared = prepare(config, data, model, tx, loss_fn=loss_fn, transform=transform,
                       init_from=init_from)
    seconds = {"prepare": time.perf_counter() - t_start}  # where the wall time goes
    with compilation.CompileLog("startup") as compiles:  # every executable built, by phase
        expect = checkpoint_keys(prepared)
        resuming = check_workdir(config, workdir, prepared, expect)
        say = print if jax.process_index() == 0 else (lambda *a, **k: None)
        os.makedirs(workdir, exist_ok=True)
        for change in loop_io.save_config(config, workdir, resuming,
                                          write=jax.process_index() == 0):
            say(f"config changed on resume: {change}")
        t = time.perf_counter()
        tr = setup(config, prepared=prepared)
        seconds["setup"] = time.perf_counter() - t
        for c in tr.compiled:  # setup's builds of each step's program, filed under its name
            compiles.refile("startup", compilation.step_program(c), c.name)
        _announce(tr, compiles, say)
        distributed.check_agree({
            "steps_per_epoch": tr.steps_per_epoch, "val_examples": len(tr.data.val.labels),
            "world_size": tr.world.world_size, **expect})
        distributed.check_agree({"initial params checksum": distributed.tree_checksum(
            tr.state.params)})
        run = Run(config, workdir, tr, compiles, expect, say, seconds)
        run.plan = plan
        try:
            run.restore()
            run.train()
            return run.state, run.summary(cache, t_start)
        finally:
            run.close_tensorboard()  # after the summary's hparams, or on any error


def check_workdir(config, workdir: str, tr: Trainer, expect: dict) -> bool:
    """Whether this run resumes; every reason it cannot, as an error before compiling.

    Raises:
      ValueError: ``config.resume=False`` into a workdir with checkpoints; a
        ``config.json`` that differs outside the keys that may change on resume;
        a checkpoint written with other ``expect`` values (config keys, the
        training data's size and fingerprint: :func:`trjax.train.trainer.data_identity`);
        a ``num_epochs`` that ends before the checkpoint's step.
      OSError: the checkpoints folder is not writable.
    """
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_checkpoints = bool(os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir))
    if has_checkpoints and not config.resume:  # step 0 again would overwrite them and the logs
        raise ValueError(f"config.resume=False but {ckpt_dir} holds checkpoints "
                         f"({sorted(os.listdir(ckpt_dir))[:5]}): a new run from step 0 would "
                         "overwrite them and the logs; use a new --workdir, or delete that "
                         "folder to start over")
    if jax.process_index() == 0:
        check_writable(ckpt_dir)  # before compiling, not at the first save
    if not (config.resume and has_checkpoints):
        return False
    loop_io.save_config(config, workdir, True, write=False)  # names every differing key
    mngr = checkpoint.manager(ckpt_dir, config.keep_checkpoints)
    checkpoint.check_compatible(mngr, expect)
    newest, total = max(mngr.all_steps(), default=0), tr.steps_per_epoch * config.num_epochs
    if newest > total:
        raise ValueError(f"config.num_epochs={config.num_epochs} ends at step {total}, but "
                         f"the run in {workdir} is at step {newest} already; resume with "
                         "num_epochs at least its own, or use another workdir")
    return True


def _announce(tr: Trainer, compiles, say) -> None:
    """The start-up lines: the world, the buckets, the compilation cache's use."""
    world, plan, config = tr.world, tr.plan, tr.config
    say(f"world_size={world.world_size} devices={[d.id for d in world.devices]} "
        f"({world.devices[0].platform}, {jax.process_count()} process(es)) mesh={world.mesh_spec} "
        f"global_batch={world.global_batch_size} local_batch={world.local_batch_size} "
        f"bn_mode={config.bn_mode} precision={config.precision} "
        f"train_padding_mask={not tr.full_batches}")
    if tr.layout.line:
        say(tr.layout.line)
    say("buckets: " + ", ".join(f"{b}={n} elements ({plan.bucket_bytes(b)} B)"
                                for b, n in plan.bucket_elements.items()) +
        f"; the four steps built in {sum(c.compile_s for c in tr.compiled):.1f}s "
        f"(train step {tr.train_step.compile_s:.1f}s)")
    say(memory_line(tr))
    say(f"compilation cache: {compilation.cache_dir() or 'off'} (start-up: "
        f"{sum(b.cache == 'hit' for b in compiles.builds)} programs from the cache, "
        f"{sum(b.compiled for b in compiles.builds)} compiled, "
        f"{compiles.cache_summary()['damaged']} damaged entries rewritten)")


def memory_line(tr: Trainer) -> str:
    """The train step's memory per device, XLA's own figures (MiB), and what remat
    recomputes."""
    m, mib = tr.train_step.memory(), lambda n: f"{n / 2 ** 20:.1f}"
    remat = tr.layout.network.remat
    what = "none" if remat is None else (f"{len(remat.paths)} modules ({remat.policy}), "
                                         f"config.remat={tr.config.remat!r}")
    if not m:
        return f"memory per device: not reported by this platform; remat: {what}"
    return (f"memory per device (train step, XLA): peak {mib(m['peak'])} MiB = arguments "
            f"{mib(m['argument'])} + temp {mib(m['temp'])} + outputs {mib(m['output'])} - "
            f"donated {mib(m['alias'])}; remat: {what}")


class Run:
    """One run of the loop over a built trainer: its state, logs and checkpoints.

    Attributes (besides the constructor's): ``state`` (the current
    :class:`~trjax.state.TrainState`), ``reader`` (:class:`trjax.train.loop_io.MetricsReader`),
    ``skipped`` (paths of undecodable files skipped so far, restored from the
    checkpoint), ``halted`` / ``stop_signal`` (why the epochs ended early),
    ``val`` (the last evaluation).
    """

    def __init__(self, config, workdir: str, tr: Trainer, compiles, expect: dict, say, seconds):
        self.config, self.workdir, self.tr, self.compiles = config, workdir, tr, compiles
        self.plan = None  # mesh="auto": the planner's record (trjax.train.planner.resolve_auto)
        self.expect, self.say, self.seconds = expect, say, seconds
        self.lead = jax.process_index() == 0
        self.state = tr.state
        self.total_steps = tr.steps_per_epoch * config.num_epochs
        self.ckpt = checkpoint.manager(os.path.join(workdir, "checkpoints"),
                                       config.keep_checkpoints, asynchronous=config.checkpoint_async)
        self.lr_table = np.asarray(jax.jit(jax.vmap(tr.schedule))(np.arange(self.total_steps + 1)))
        self.checkpoint_s = [0.0]  # the training thread's time in saves (host copy, waits)
        self.train_time, self.train_images = 0.0, 0
        self.seconds["evaluate"] = 0.0
        self.skipped: set = set()
        self.halted, self.stop_signal, self.val = False, None, None
        self.tb = None  # the TensorBoard writer (process 0, config.tensorboard): _open_logs
        self.start_epoch, self.start_batch, self.meta = 1, 0, {}

    # -- resume --------------------------------------------------------------
    def restore(self) -> None:
        """The newest readable checkpoint (when resuming), then the logs and the
        metrics reader put back at its step.

        A checkpoint's meta holds the data position (epoch, batches done), what
        the epoch's metrics row needs (the epoch's train sums so far, the step
        log's window, the skipped steps) and the files skipped so far; ``batch ==
        steps_per_epoch``: the epoch's training is done and its evaluation pending.
        """
        config, say = self.config, self.say
        if config.resume:
            with self.compiles.phase("restore"):
                restored = checkpoint.restore_latest(self.ckpt, self.state, self.expect, log=say)
            if restored is not None:
                self.state, self.meta = restored
                self.start_epoch, self.start_batch = int(self.meta["epoch"]), int(self.meta["batch"])
                self.skipped = set(self.meta.get("skipped_files", ()))
                step = int(host_value(self.state.step))
                say(f"the run is complete (step {step} of {self.total_steps}): evaluating its "
                    "last checkpoint" if self.start_epoch > config.num_epochs else
                    f"resumed from step {step} (epoch {self.start_epoch}, batch "
                    f"{self.start_batch})")
        if not self.meta and self.tr.init_plan is not None:  # a fresh run: its weights
            self.state = init_from_lib.apply(self.state, self.tr.init_plan)
            say(self.tr.init_plan.describe())
        self.restored_step = int(host_value(self.state.step))
        self._open_logs()
        if config.halt_after_steps and self.restored_step >= config.halt_after_steps:
            say(f"already at step {self.restored_step} >= config.halt_after_steps="
                f"{config.halt_after_steps}: no step to run")  # a drill stop already reached
            self.halted, self.start_epoch = True, config.num_epochs + 1

    def _open_logs(self) -> None:
        """metrics.jsonl and steps.jsonl cut back to the restored step (rows past
        it are written again; with the epoch's evaluation pending, its own row
        too), TensorBoard rebuilt from them, the metrics reader at the position."""
        config, step = self.config, self.restored_step
        pending_eval = self.start_batch >= self.tr.steps_per_epoch
        self.writer = metrics_log.MetricsWriter(
            os.path.join(self.workdir, "metrics.jsonl"), resume=step > 0,
            keep_until_step=step - pending_eval) if self.lead else None
        self.step_log = metrics_log.MetricsWriter(
            os.path.join(self.workdir, "steps.jsonl"), resume=step > 0,
            keep_until_step=step) if self.lead and config.log_every_steps else None
        self.tb = loop_io.open_tensorboard(config, self.workdir, self.say, resume=step > 0)
        self.reader = loop_io.MetricsReader(
            config.metrics_lag, config.halt_on_nonfinite, config.precision == "fp16",
            log=self.say, max_overflows=config.max_consecutive_overflows,
            loss_scale=float(host_value(self.state.loss_scale)),
            skipped_steps=int(host_value(self.state.skipped_steps)),
            log_every=config.log_every_steps, on_log_row=self._on_log_row,
            lr_of_step=lambda t: self.lr_table[t - 1], steps_per_epoch=self.tr.steps_per_epoch)
        self.reader.restore(self.meta)

    def _on_log_row(self, row: dict) -> None:
        self.say(f"step {row['step']:6d}  loss {row['loss']:.4f} top1 {row['top1']:.4f}  "
                 f"lr {row['lr']:.4g}  loss_scale {row['loss_scale']:g}  "
                 f"grad_norm {row['grad_norm']:.4g}  skipped {row['skipped_steps']}  "
                 f"{row['images_per_s']:.0f} img/s")
        if self.step_log is not None:
            self.step_log.write(row)
        if self.tb is not None:
            loop_io.tensorboard_step_row(self.tb, row)

    # -- checkpoints and evaluation --------------------------------------------
    def save(self, epoch: int, batch: int, epoch_s: float = 0.0) -> None:
        """A checkpoint of the state at the data position ``(epoch, batch)``."""
        if int(host_value(self.state.step)) == self.restored_step:
            return  # the evaluation of a restored epoch end: its checkpoint is the one restored
        t = time.perf_counter()
        with self.compiles.phase("checkpoint"):
            checkpoint.save(self.ckpt, self.state, {
                **self.expect, "epoch": epoch, "batch": batch,
                "world_size": self.tr.world.world_size, "epoch_s": epoch_s,
                "skipped_files": sorted(self.skipped), **self.reader.position()})
        self.checkpoint_s[0] += time.perf_counter() - t

    def evaluate(self) -> dict:
        t = time.perf_counter()
        with self.compiles.phase("evaluate"):
            result = evaluate_pass(self.tr, self.state, self.skipped)
        self.seconds["evaluate"] += time.perf_counter() - t
        return result

    # -- the epochs ------------------------------------------------------------
    def train(self) -> None:
        """Every epoch from the restored position on, until the end or a stop."""
        config = self.config
        watchdog = distributed.StepWatchdog(config.step_timeout_s, exit_code=stops.EXIT_PEER_LOST)
        self.profiler = loop_io.Profiler(config.profile_steps, self.workdir, log=self.say)
        with self.writer or contextlib.nullcontext(), self.compiles.phase("train"), watchdog, \
                stops.StopSignals(config.preemption_check_every_steps) as signals, \
                _finishing(self.ckpt, self.checkpoint_s):  # the last save completes first
            try:
                for epoch in range(self.start_epoch, config.num_epochs + 1):
                    first = self.start_batch if epoch == self.start_epoch else 0
                    before = float(self.meta.get("epoch_s", 0.0)) \
                        if epoch == self.start_epoch else 0.0  # the epoch's time before a restart
                    t0 = time.perf_counter()
                    step_index, b = self.train_epoch(epoch, first, watchdog, signals, t0, before)
                    if self.halted or self.stop_signal:  # save where it stands (b ==
                        self.reader.drain(0)          # steps_per_epoch: evaluation pending)
                        self.save(epoch, b, before + time.perf_counter() - t0)
                        self.train_time += time.perf_counter() - t0
                        self.say(f"stopped after step {step_index} ("
                                 f"{'config.halt_after_steps' if self.halted else self.stop_signal}"
                                 "); checkpoint saved")
                        break
                    self.end_epoch(epoch, step_index, t0, before, watchdog)
                    self.stop_signal = signals.should_stop(step_index, boundary=True)
                    if self.stop_signal:  # e.g. received during the evaluation
                        self.say(f"stopped after step {step_index} ({self.stop_signal}); "
                                 "checkpoint saved")
                        break
            finally:
                self.profiler.close()
                if self.step_log is not None:  # TensorBoard stays open for the summary's
                    self.step_log.close()         # hparams (close_tensorboard)
        if self.stop_signal:
            raise stops.Preempted(int(host_value(self.state.step)), self.stop_signal.split()[0])

    def train_epoch(self, epoch: int, first: int, watchdog, signals, t0: float,
                    before: float) -> tuple[int, int]:
        """The training steps of ``epoch`` from batch ``first`` on; returns
        ``(the last step dispatched, batches done)``. Sets ``halted`` /
        ``stop_signal`` when a drill stop or a signal ends the epoch early."""
        config, tr, world = self.config, self.tr, self.tr.world
        step_index = (epoch - 1) * tr.steps_per_epoch + first
        b = first
        batches = input_pipeline.prefetch(input_pipeline.iterate_batches(
            tr.data.train, world.global_batch_size, shuffle=True, seed=config.seed, epoch=epoch,
            remainder=config.train_remainder, rows=world.process_rows(), start=first,
            augment=config.augment, image_shape=tr.data.image_shape,
            workers=config.data_workers, skipped=self.skipped, transform=tr.transform),
            depth=config.prefetch)
        show_bar = self.lead and config.progress and sys.stderr.isatty()
        with _progress(tr.steps_per_epoch - first, epoch, show_bar) as bar:
            for b, batch in enumerate(batches, start=first + 1):
                step_index += 1
                self.profiler.before(step_index)
                if tr.full_batches and batch["mask"].min() < 1:
                    raise RuntimeError(f"step {step_index}: a training batch holds padding "
                                       "rows; the train step has no BN mask")
                self.state, m = tr.train_step(self.state, input_pipeline.to_device(
                    batch, world.sharded(), tr.data.num_classes, tr.dtype, step=step_index))
                self.reader.push(step_index, m)
                self.profiler.after(step_index, m)
                watchdog.beat(step_index - config.metrics_lag)
                bar.update(1)
                if bar.n % 10 == 0 and self.reader.sums.count:
                    bar.set_postfix(loss=f"{self.reader.sums.rates()['loss']:.4f}")
                self.halted = bool(config.halt_after_steps and
                                   step_index >= config.halt_after_steps)
                self.stop_signal = signals.should_stop(step_index)
                if self.halted or self.stop_signal:
                    break
                if config.checkpoint_every_steps and b < tr.steps_per_epoch and \
                        step_index % config.checkpoint_every_steps == 0:
                    self.reader.drain(0)
                    self.save(epoch, b, before + time.perf_counter() - t0)
        return step_index, b

    def end_epoch(self, epoch: int, step_index: int, t0: float, before: float, watchdog) -> None:
        """The epoch's evaluation, its metrics row (written before the checkpoint
        that covers it), the checkpoint at the next epoch's start, the log line."""
        sums = self.reader.take()
        epoch_s = before + time.perf_counter() - t0
        self.train_time += time.perf_counter() - t0
        self.train_images += int(sums.count)
        self.val = val = self.evaluate()
        watchdog.beat(step_index)
        row = {"epoch": epoch, "step": step_index,
               **{f"train_{k}": v for k, v in sums.rates().items()},
               **{f"val_{k}": val[k] for k in ("loss", "top1", "top5", "ema_loss", "ema_top1",
                                               "ema_top5") if k in val},
               "images_per_s": sums.count / epoch_s, "epoch_s": epoch_s,
               "lr": float(self.lr_table[step_index - 1]),  # what the epoch's last step used
               "grad_norm": sums.grad_norm}  # the epoch's last step's (StepMetrics.grad_norm)
        if self.writer is not None:
            self.writer.write(row)
        self.save(epoch + 1, 0)
        if self.tb is not None:
            loop_io.tensorboard_epoch_row(self.tb, row)
        self.say(f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} top1 "
                 f"{row['train_top1']:.4f}  | val loss {row['val_loss']:.4f} top1 "
                 f"{row['val_top1']:.4f} top5 {row['val_top5']:.4f}  | "
                 f"{row['images_per_s']:.0f} img/s")

    # -- the end ---------------------------------------------------------------
    def summary(self, cache: dict, t_start: float) -> dict:
        """The run's ``summary.json`` (written by process 0), after a last
        evaluation when the loop ended without one."""
        config, tr, world, state, compiles = self.config, self.tr, self.tr.world, self.state, \
            self.compiles
        if self.val is None or self.halted:  # resumed at the very end, or halted before it
            self.val = self.evaluate()
        val = self.val
        loop_phases = ("train", "evaluate", "checkpoint", compilation.BACKGROUND)
        summary = {
            "val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"],
            **{f"val_{k}": val[k] for k in ("ema_top1", "ema_top5", "ema_loss") if k in val},
            "val_examples": val["count"],
            "world_size": world.world_size, "process_count": jax.process_count(),
            "mesh": world.mesh_spec,
            **tr.layout.describe(),
            "global_batch_size": world.global_batch_size,
            "local_batch_size": world.local_batch_size, "platform": world.devices[0].platform,
            "cpu_convolutions": host.convolution_library(),
            "bn_mode": config.bn_mode, "precision": config.precision, "model": config.model,
            "train_padding_mask": not tr.full_batches,  # BN masks padding rows in the train step
            "dataset": config.dataset, "epochs": config.num_epochs,
            "steps": int(host_value(state.step)), "halted": self.halted,
            "skipped_steps": int(host_value(state.skipped_steps)),
            "skipped_step_numbers": self.reader.skipped,
            "skipped_images": len(input_pipeline.skipped_images(tr.data, self.skipped)),
            "loss_scale": float(host_value(state.loss_scale)),
            "train_images_per_s": self.train_images / self.train_time if self.train_time else None,
            # measured: programs built (compiled by XLA or loaded from the cache)
            "compiles": {c.name: compiles.count(c.name) for c in tr.compiled},
            "compiles_during_training": compiles.count(loop_phases),
            "checkpoint_io_compiles": compiles.count(("checkpoint", "restore")),
            "compiles_by_phase": compiles.by_phase(),
            "compilation_cache": {**compiles.cache_summary(), "source": cache["source"]},
            "compile_s": {c.name: round(c.compile_s, 3) for c in tr.compiled},
            "checkpoint_async": bool(config.checkpoint_async),
            "checkpoint_blocking_s": round(self.checkpoint_s[0], 3),
            "memory_plan": tr.plan.describe(),
            "wall_s": time.perf_counter() - t_start,
            # measured wall seconds: prepare (config, data, model, plan), setup (trace, compile
            # or load, state init), train (the epochs' steps), evaluate, checkpoint (blocking)
            "seconds": {k: round(v, 3) for k, v in {**self.seconds, "train": self.train_time,
                                                    "checkpoint": self.checkpoint_s[0]}.items()},
            "first_step_done_at": self.reader.first_step_done_at,  # Unix time (benchmarks)
        }
        if self.plan is not None:  # mesh="auto": the planner's candidates and choice
            summary["plan"] = self.plan
        if self.lead:
            tmp = os.path.join(self.workdir, "summary.json.tmp")
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(tmp, os.path.join(self.workdir, "summary.json"))
        if self.tb is not None:  # the config as hparams with the final metrics
            loop_io.tensorboard_run_end(self.tb, config, summary)
        return summary

    def close_tensorboard(self) -> None:
        """Closes the TensorBoard writer (its events flushed), if one is open."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
