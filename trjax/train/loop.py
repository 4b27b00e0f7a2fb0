"""The training loop: a built :class:`trjax.train.trainer.Trainer` -> epochs of steps, evaluation, checkpoints.

``train_and_evaluate(config, workdir)`` is the whole job (the Flax ImageNet
example's shape). It is the only place with side effects: it prints one log
line per epoch (and a step log line every ``log_every_steps``) and writes
``workdir/config.json``, ``metrics.jsonl`` (one JSON line per epoch, through
:class:`trjax.train.metrics_log.MetricsWriter`), ``steps.jsonl``, ``summary.json``,
TensorBoard events and checkpoints. The host side of the loop (metric reads,
step log, config file, profiler) is :mod:`trjax.train.loop_io`; stops on a signal
and the exit codes are :mod:`trjax.train.stops`.

The host never runs ahead of the devices by more than ``config.metrics_lag``
steps: after dispatching step t it reads step t-lag's metrics (already
computed, a few bytes). This keeps the device busy and bounds the queue of
collectives (dispatching ~50 unawaited steps deadlocks XLA's CPU rendezvous).
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

from trjax.train import checkpoint, compilation, distributed, loop_io, metrics_log, stops
from trjax.cpu import host
from trjax.data import input_pipeline
from trjax.train.loop_io import MetricsReader  # noqa: F401  (its home before loop_io)
# the trainer's pieces, also reached as trjax.train.<name> (the loop calls evaluate_pass
# through this module, so a test may wrap it here)
from trjax.train.trainer import Trainer, evaluate_pass, prepare, setup  # noqa: F401
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
                       data: input_pipeline.Dataset | None = None):
    """Trains and evaluates, checkpointing under ``workdir/checkpoints``.

    Resumes by default from the newest readable checkpoint in ``workdir``
    (``config.resume``), at the exact step and data position it was saved at.

    Args:
      config: see ``configs/default.py``.
      workdir: where ``metrics.jsonl``, ``summary.json`` and checkpoints go.
      data: optional in-memory :class:`trjax.data.input_pipeline.Dataset`.

    Returns:
      ``(state, summary)``: the final :class:`trjax.state.TrainState` and the
      summary dict (also written to ``summary.json`` by process 0).

    Raises:
      ValueError: an invalid config, device spec or batch split (before any
        compilation), an incompatible checkpoint, or ``config.resume=False``
        into a workdir that holds checkpoints.
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
    prepared = prepare(config, data, _saved_kernel_order(config, workdir))
    seconds = {"prepare": time.perf_counter() - t_start}  # where the wall time goes
    cache = compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
    with compilation.CompileLog("startup") as compiles:  # every executable built, by phase
        return _train_and_evaluate(config, workdir, prepared, compiles, cache, t_start, seconds)


def _saved_kernel_order(config, workdir: str) -> str | None:
    """The bucket kernel order the state of the checkpoint a resume reads is laid
    out in (compression error feedback, ZeRO-1 shards; the exchange's
    ``checkpoint_keys`` put it in the meta), or None: no resume, no checkpoint,
    or a state that does not depend on it."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not (config.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir)):
        return None
    newest = checkpoint.newest_meta(checkpoint.manager(ckpt_dir, config.keep_checkpoints))
    return None if newest is None else newest[1].get("bucket_kernel_order")


def _train_and_evaluate(config, workdir, prepared, compiles, cache, t_start, seconds):
    ckpt_dir = os.path.join(workdir, "checkpoints")
    # the exchange names what its state's layout depends on (e.g. the kernel order)
    expect = {**{k: config[k] for k in checkpoint.COMPATIBLE_FIELDS},
              **prepared.exchange.checkpoint_keys}
    if config.bn_mode == "local" or config.compression != "none" or \
            config.shard_optimizer_state:  # per-device rows: BN statistics, error feedback,
        expect["world_size"] = prepared.world.world_size  # ZeRO-1 shards
    has_checkpoints = bool(os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir))
    if has_checkpoints and not config.resume:  # step 0 again would overwrite them and the logs
        raise ValueError(f"config.resume=False but {ckpt_dir} holds checkpoints "
                         f"({sorted(os.listdir(ckpt_dir))[:5]}): a new run from step 0 would "
                         "overwrite them and the logs; use a new --workdir, or delete that "
                         "folder to start over")
    resuming = bool(config.resume and has_checkpoints)
    if jax.process_index() == 0:
        check_writable(ckpt_dir)  # before compiling, not at the first save
    if resuming:  # incompatible: an error before compiling, naming every key config.json differs in
        loop_io.save_config(config, workdir, resuming, write=False)
        mngr = checkpoint.manager(ckpt_dir, config.keep_checkpoints)
        checkpoint.check_compatible(mngr, expect)
        newest, total = max(mngr.all_steps(), default=0), prepared.steps_per_epoch * config.num_epochs
        if newest > total:
            raise ValueError(f"config.num_epochs={config.num_epochs} ends at step {total}, but "
                             f"the run in {workdir} is at step {newest} already; resume with "
                             "num_epochs at least its own, or use another workdir")
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    os.makedirs(workdir, exist_ok=True)
    # WORKDIR/config.json; a resume may change only loop_io.RESUME_MAY_CHANGE
    for change in loop_io.save_config(config, workdir, resuming, write=lead):
        say(f"config changed on resume: {change}")
    loop_io.parse_profile_steps(config.profile_steps)  # a bad value: error before compiling
    t = time.perf_counter()
    tr = setup(config, prepared=prepared)
    seconds["setup"] = time.perf_counter() - t
    for c in tr.compiled:  # setup's builds of each step's program, filed under its name
        compiles.refile("startup", compilation.step_program(c), c.name)
    ckpt = checkpoint.manager(ckpt_dir, config.keep_checkpoints,  # only once the setup is valid
                              asynchronous=config.checkpoint_async)
    world, data, plan, schedule, state = tr.world, tr.data, tr.plan, tr.schedule, tr.state
    train_step = tr.train_step
    steps_per_epoch = tr.steps_per_epoch
    total_steps = steps_per_epoch * config.num_epochs
    say(f"world_size={world.world_size} devices={[d.id for d in world.devices]} "
        f"({world.devices[0].platform}, {jax.process_count()} process(es)) "
        f"global_batch={world.global_batch_size} local_batch={world.local_batch_size} "
        f"bn_mode={config.bn_mode} precision={config.precision} "
        f"train_padding_mask={not tr.full_batches}")
    say("buckets: " + ", ".join(f"{b}={n} elements ({plan.bucket_bytes(b)} B)"
                                for b, n in plan.bucket_elements.items()) +
        f"; the four steps built in {sum(c.compile_s for c in tr.compiled):.1f}s")
    say(f"compilation cache: {compilation.cache_dir() or 'off'} (start-up: "
        f"{sum(b.cache == 'hit' for b in compiles.builds)} programs from the cache, "
        f"{sum(b.compiled for b in compiles.builds)} compiled)")

    # -- every process must run the same job from the same parameters ---------
    distributed.check_agree({
        "steps_per_epoch": steps_per_epoch, "train_examples": len(data.train.labels),
        "val_examples": len(data.val.labels), "world_size": world.world_size,
        **{k: config[k] for k in checkpoint.COMPATIBLE_FIELDS}})
    distributed.check_agree({"initial params checksum": distributed.tree_checksum(state.params)})

    # -- checkpoints and resume ---------------------------------------------
    # A checkpoint's meta holds the data position (epoch, batches done) and what
    # the epoch's metrics row needs (the epoch's train sums so far, the step
    # log's window, the skipped steps); batch == steps_per_epoch: the epoch's
    # training is done and its evaluation pending.
    start_epoch, start_batch, meta = 1, 0, {}
    if config.resume:
        with compiles.phase("restore"):
            restored = checkpoint.restore_latest(ckpt, state, expect, log=say)
        if restored is not None:
            state, meta = restored
            start_epoch, start_batch = int(meta["epoch"]), int(meta["batch"])
            if start_epoch > config.num_epochs:
                say(f"the run is complete (step {int(host_value(state.step))} of "
                    f"{total_steps}): evaluating its last checkpoint")
            else:
                say(f"resumed from step {int(host_value(state.step))} "
                    f"(epoch {start_epoch}, batch {start_batch})")
    restored_step = int(host_value(state.step))

    checkpoint_s = [0.0]  # the training thread's time in saves (host copy, waits)
    lr_table = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(total_steps + 1)))
    tb = loop_io.open_tensorboard(config, workdir, say)
    step_log = None
    if lead and config.log_every_steps:  # rows past the restored step are written again
        step_log = metrics_log.MetricsWriter(os.path.join(workdir, "steps.jsonl"),
                                             resume=restored_step > 0,
                                             keep_until_step=restored_step)

    def on_log_row(row):
        say(f"step {row['step']:6d}  loss {row['loss']:.4f} top1 {row['top1']:.4f}  "
            f"lr {row['lr']:.4g}  loss_scale {row['loss_scale']:g}  "
            f"skipped {row['skipped_steps']}  {row['images_per_s']:.0f} img/s")
        if step_log is not None:
            step_log.write(row)
        if tb is not None:
            for k in ("loss", "top1", "images_per_s", "lr", "loss_scale", "skipped_steps"):
                tb.add_scalar(f"step/{k}", row[k], row["step"])

    reader = loop_io.MetricsReader(
        config.metrics_lag, config.halt_on_nonfinite, config.precision == "fp16", log=say,
        max_overflows=config.max_consecutive_overflows,
        loss_scale=float(host_value(state.loss_scale)), good_steps=int(host_value(state.good_steps)),
        growth_interval=config.loss_scale_growth_interval,
        skipped_steps=int(host_value(state.skipped_steps)), log_every=config.log_every_steps,
        on_log_row=on_log_row, lr_of_step=lambda t: lr_table[t - 1],
        steps_per_epoch=steps_per_epoch)
    reader.restore(meta)
    epoch_s_before = float(meta.get("epoch_s", 0.0))  # the epoch's time before the restart

    def save(epoch: int, batch: int, epoch_s: float = 0.0) -> None:
        if int(host_value(state.step)) == restored_step:
            return  # the evaluation of a restored epoch end: its checkpoint is the one restored
        t = time.perf_counter()
        with compiles.phase("checkpoint"):
            checkpoint.save(ckpt, state, {**expect, "epoch": epoch, "batch": batch,
                                          "world_size": world.world_size, "epoch_s": epoch_s,
                                          **reader.position()})
        checkpoint_s[0] += time.perf_counter() - t

    rows = world.process_rows()
    skipped: set = set()  # undecodable files skipped (config.skip_bad_images)
    seconds["evaluate"] = 0.0

    def evaluate(state) -> dict:
        t = time.perf_counter()
        with compiles.phase("evaluate"):
            result = evaluate_pass(tr, state, skipped)
        seconds["evaluate"] += time.perf_counter() - t
        return result
    train_time, train_images = 0.0, 0
    show_bar = lead and config.progress and sys.stderr.isatty()
    # a drill stop already reached (the same halt_after_steps again): nothing to train
    halted = bool(config.halt_after_steps and restored_step >= config.halt_after_steps)
    if halted:
        say(f"already at step {restored_step} >= config.halt_after_steps="
            f"{config.halt_after_steps}: no step to run")
        start_epoch = config.num_epochs + 1
    stop_signal, val = None, None
    watchdog = distributed.StepWatchdog(config.step_timeout_s, exit_code=stops.EXIT_PEER_LOST)
    profiler = loop_io.Profiler(config.profile_steps, workdir, log=say)
    # an epoch's row is written BEFORE the checkpoint that covers it; on resume
    # the rows past the restored position are dropped (they are written again):
    # with the epoch's evaluation pending, its own row too.
    pending_eval = start_batch >= steps_per_epoch
    writer = metrics_log.MetricsWriter(
        os.path.join(workdir, "metrics.jsonl"), resume=restored_step > 0,
        keep_until_step=restored_step - pending_eval) if lead else contextlib.nullcontext()
    with writer, compiles.phase("train"), watchdog, stops.StopSignals(
            config.preemption_check_every_steps) as signals, \
            _finishing(ckpt, checkpoint_s):  # the last save is complete before the loop ends
        try:
            for epoch in range(start_epoch, config.num_epochs + 1):
                t0 = time.perf_counter()
                first = start_batch if epoch == start_epoch else 0
                before = epoch_s_before if epoch == start_epoch else 0.0
                step_index = (epoch - 1) * steps_per_epoch + first
                b = first
                batches = input_pipeline.prefetch(input_pipeline.iterate_batches(
                    data.train, world.global_batch_size, shuffle=True, seed=config.seed,
                    epoch=epoch, remainder=config.train_remainder, rows=rows, start=first,
                    augment=config.augment, image_shape=data.image_shape,
                    workers=config.data_workers, skipped=skipped), depth=config.prefetch)
                with _progress(steps_per_epoch - first, epoch, show_bar) as bar:
                    for b, batch in enumerate(batches, start=first + 1):
                        step_index += 1
                        profiler.before(step_index)
                        if tr.full_batches and batch["mask"].min() < 1:
                            raise RuntimeError(f"step {step_index}: a training batch holds "
                                               "padding rows; the train step has no BN mask")
                        state, m = train_step(state, input_pipeline.to_device(
                            batch, world.sharded(), data.num_classes, tr.dtype, step=step_index))
                        reader.push(step_index, m)
                        profiler.after(step_index, m)
                        watchdog.beat(step_index - config.metrics_lag)
                        bar.update(1)
                        if bar.n % 10 == 0 and reader.sums.count:
                            bar.set_postfix(loss=f"{reader.sums.rates()['loss']:.4f}")
                        halted = bool(config.halt_after_steps and
                                      step_index >= config.halt_after_steps)
                        stop_signal = signals.should_stop(step_index)
                        if halted or stop_signal:
                            break
                        if config.checkpoint_every_steps and \
                                step_index % config.checkpoint_every_steps == 0 \
                                and b < steps_per_epoch:
                            reader.drain(0)
                            save(epoch, b, before + time.perf_counter() - t0)
                if halted or stop_signal:  # save where it stands (b == steps_per_epoch:
                    reader.drain(0)        # the evaluation is pending)
                    save(epoch, b, before + time.perf_counter() - t0)
                    train_time += time.perf_counter() - t0
                    say(f"stopped after step {step_index} ("
                        f"{'config.halt_after_steps' if halted else stop_signal}); "
                        "checkpoint saved")
                    break
                sums = reader.take()
                epoch_s = before + time.perf_counter() - t0
                train_time += time.perf_counter() - t0
                train_images += int(sums.count)
                val = evaluate(state)
                watchdog.beat(step_index)
                row = {"epoch": epoch, "step": step_index,
                       **{f"train_{k}": v for k, v in sums.rates().items()},
                       **{f"val_{k}": val[k] for k in ("loss", "top1", "top5")},
                       "images_per_s": sums.count / epoch_s, "epoch_s": epoch_s,
                       "lr": float(lr_table[step_index])}
                if lead:
                    writer.write(row)  # before the checkpoint that covers it
                save(epoch + 1, 0)
                if tb is not None:
                    for k, v in row.items():
                        if k not in ("epoch", "step"):
                            tb.add_scalar(k, v, step_index)
                    tb.flush()
                say(f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} top1 "
                    f"{row['train_top1']:.4f}  | val loss {row['val_loss']:.4f} top1 "
                    f"{row['val_top1']:.4f} top5 {row['val_top5']:.4f}  | "
                    f"{row['images_per_s']:.0f} img/s")
                stop_signal = signals.should_stop(step_index, boundary=True)
                if stop_signal:  # e.g. received during the evaluation
                    say(f"stopped after step {step_index} ({stop_signal}); checkpoint saved")
                    break
        finally:
            profiler.close()
            if step_log is not None:
                step_log.close()
            if tb is not None:
                tb.close()

    if stop_signal:
        raise stops.Preempted(int(host_value(state.step)), stop_signal.split()[0])
    if val is None or halted:  # resumed at the very end, or halted before this evaluation
        val = evaluate(state)
    loop_phases = ("train", "evaluate", "checkpoint", compilation.BACKGROUND)
    summary = {
        "val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"],
        "val_examples": val["count"],
        "world_size": world.world_size, "process_count": jax.process_count(),
        "global_batch_size": world.global_batch_size,
        "local_batch_size": world.local_batch_size, "platform": world.devices[0].platform,
        "cpu_convolutions": host.convolution_library(),
        "bn_mode": config.bn_mode, "precision": config.precision, "model": config.model,
        "train_padding_mask": not tr.full_batches,  # BN masks padding rows in the train step
        "dataset": config.dataset, "epochs": config.num_epochs,
        "steps": int(host_value(state.step)), "halted": halted,
        "skipped_steps": int(host_value(state.skipped_steps)),
        "skipped_step_numbers": reader.skipped,
        "skipped_images": len(input_pipeline.skipped_images(data, skipped)),
        "loss_scale": float(host_value(state.loss_scale)),
        "train_images_per_s": train_images / train_time if train_time else None,  # None: no step
        # measured: executables built (compiled by XLA or loaded from the cache)
        "compiles": {c.name: compiles.count(c.name) for c in tr.compiled},
        "compiles_during_training": compiles.count(loop_phases),
        "checkpoint_io_compiles": compiles.count(("checkpoint", "restore")),
        "compiles_by_phase": compiles.by_phase(),
        "compilation_cache": {**compiles.cache_summary(), "source": cache["source"]},
        "compile_s": {c.name: round(c.compile_s, 3) for c in tr.compiled},
        "checkpoint_async": bool(config.checkpoint_async),
        "checkpoint_blocking_s": round(checkpoint_s[0], 3),
        "memory_plan": plan.describe(),
        "wall_s": time.perf_counter() - t_start,
        # measured wall seconds: prepare (config, data, model, plan), setup (trace, compile
        # or load, state init), train (the epochs' steps), evaluate, checkpoint (blocking)
        "seconds": {k: round(v, 3) for k, v in {**seconds, "train": train_time,
                                                "checkpoint": checkpoint_s[0]}.items()},
        "first_step_done_at": reader.first_step_done_at,  # Unix time (benchmark --time_to_accuracy)
    }
    if lead:
        tmp = os.path.join(workdir, "summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, os.path.join(workdir, "summary.json"))
    return state, summary
