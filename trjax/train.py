"""The training loop: config -> world -> data -> model and plan -> compiled steps -> epochs.

``train_and_evaluate(config, workdir)`` is the whole job (the Flax ImageNet
example's shape). It is the only place with side effects: it prints one log
line per epoch and writes ``workdir/metrics.jsonl`` (one JSON line per epoch)
and ``workdir/summary.json``.

The host never runs ahead of the devices by more than ``config.metrics_lag``
steps: after dispatching step t it reads step t-lag's metrics (already
computed, a few bytes). This keeps the device busy and bounds the queue of
collectives (dispatching ~50 unawaited steps deadlocks XLA's CPU rendezvous).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from trjax import (allreduce, checkpoint, compilation, compression, datasets, distributed,
                   host, input_pipeline, models, optim, steps)
from trjax.batchnorm import BN_MODES
from trjax.plan import KERNEL_ORDERS, resolve_kernel_order
from trjax.precision import INITIAL_LOSS_SCALE, PRECISIONS, compute_dtype
from trjax.world import check_batch_split, host_value, make_world

def validate_config(config: ml_collections.ConfigDict) -> None:
    """Checks choices and ranges before anything is traced.

    Raises:
      ValueError: naming the field, its value and the valid choices.
    """
    choices = {"bn_mode": BN_MODES, "precision": tuple(PRECISIONS), "optimizer": optim.OPTIMIZERS, "model": tuple(models.MODELS),
               "dataset": input_pipeline.DATASETS,
               "train_remainder": input_pipeline.REMAINDERS,
               "allreduce": tuple(allreduce.ALGORITHMS),
               "compression": tuple(compression.COMPRESSORS),
               "bucket_kernel_order": ("auto",) + KERNEL_ORDERS,
               "cpu_convolutions": host.CPU_CONVOLUTIONS}
    for field, valid in choices.items():
        if config[field] not in valid:
            raise ValueError(f"config.{field}={config[field]!r} is not one of {sorted(valid)}")
    if not (config.buckets in ("two", "tail_minimal", "per_leaf") or
            str(config.buckets).startswith("size:")):
        raise ValueError(f"config.buckets={config.buckets!r} is not one of "
                         "'two', 'tail_minimal', 'size:<MB>' (e.g. 'size:25'), 'per_leaf'")
    for field in ("num_epochs", "global_batch_size", "eval_batch_size", "metrics_lag"):
        v = config[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.{field}={v!r} must be a positive int")
    if not config.learning_rate > 0:
        raise ValueError(f"config.learning_rate={config.learning_rate!r} must be > 0")


def _rates(sums: np.ndarray) -> dict:
    loss, top1, top5, count = (float(v) for v in sums[:4])
    count = max(count, 1.0)
    return {"loss": loss / count, "top1": top1 / count, "top5": top5 / count}


@dataclasses.dataclass
class Trainer:
    """Everything built before the first step: the output of :func:`setup`."""
    config: Any
    world: Any
    data: Any
    model: Any
    plan: Any
    schedule: Any
    state: Any
    train_step: steps.CompiledStep
    fold_bn: steps.CompiledStep
    eval_step: steps.CompiledStep
    eval_reduce: steps.CompiledStep
    steps_per_epoch: int
    dtype: Any

    @property
    def compiled(self):
        return (self.train_step, self.fold_bn, self.eval_step, self.eval_reduce)


def setup(config: ml_collections.ConfigDict,
          data: input_pipeline.Dataset | None = None) -> Trainer:
    """Config -> world -> data -> model and plan -> state -> compiled steps.

    Every check on the config, the device spec and the batch split runs before
    anything is traced. The three steps are compiled here, once, with the
    train state donated; the plan then carries the train step's memory
    statistics.

    Args:
      config: see ``configs/default.py``.
      data: a :class:`trjax.input_pipeline.Dataset` to use instead of
        ``config.dataset`` (arrays already in memory).

    Raises:
      ValueError: an invalid config, device spec or batch split.
    """
    validate_config(config)
    world = make_world(config.devices, config.global_batch_size)
    check_batch_split(config.eval_batch_size, world.world_size)
    k = config.accumulation_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or world.local_batch_size % k:
        raise ValueError(f"config.accumulation_steps={k!r} must be a positive int dividing the "
                         f"local batch {world.local_batch_size} (global {world.global_batch_size}"
                         f" / world size {world.world_size})")
    if data is None:
        data = input_pipeline.load_dataset(config.dataset, config.data_dir, config.image_size)

    dtype = compute_dtype(config.precision)
    fp16 = config.precision == "fp16"
    model = models.create_model(config.model, num_classes=data.num_classes, bn_mode=config.bn_mode,
                                axis_name=world.axis_name, bn_momentum=config.bn_momentum,
                                dtype=dtype)
    plan = steps.build_plan(model, data.image_shape, config.buckets,
                            resolve_kernel_order(config.bucket_kernel_order,
                                                       world.devices[0].platform))
    compressor = None
    if config.compression != "none":
        # Buckets below compression_min_fraction of the gradient bytes are all-reduced
        # exactly: compressing them saves little, and under the `two` policy the small
        # bucket holds the layers most sensitive to it (BN, FC, first conv).
        def bucket_compressor(b):
            if plan.bucket_bytes(b) < config.compression_min_fraction * plan.gradient_bytes:
                return compression.none()
            if config.compression == "powersgd":  # one matrix per layer, vectors exact
                return compression.powersgd_layers(config.powersgd_rank,
                                                   steps.layer_matrices(plan, b))
            options = {"topk": {"ratio": config.topk_ratio}}.get(config.compression, {})
            return compression.make_compressor(config.compression, **options)
        compressor = {b: bucket_compressor(b) for b in plan.bucket_sizes}
    train_steps = input_pipeline.steps_per_epoch(len(data.train.labels), world.global_batch_size,
                                                 config.train_remainder)
    total_steps = train_steps * config.num_epochs
    schedule = optim.learning_rate_schedule(config.learning_rate,
                                            config.warmup_epochs * train_steps, total_steps)
    zero1 = bool(config.shard_optimizer_state)
    if zero1:
        if config.optimizer != "sgd" or config.compression != "none" or config.allreduce != "xla":
            raise ValueError("config.shard_optimizer_state=True (ZeRO-1) needs optimizer='sgd', "
                             "compression='none' and allreduce='xla' (got "
                             f"{config.optimizer!r}, {config.compression!r}, {config.allreduce!r})")
        import optax  # elementwise momentum SGD on flat shards; decay applied by the step
        tx = optax.sgd(schedule, momentum=config.momentum, nesterov=config.nesterov)
    else:
        tx = optim.make_optimizer(config.optimizer, schedule, plan, momentum=config.momentum,
                                  weight_decay=config.weight_decay, nesterov=config.nesterov,
                                  trust_coefficient=config.trust_coefficient)
    state = steps.create_train_state(jax.random.key(config.seed), model, tx, world,
                                     data.image_shape, config.bn_mode,
                                     loss_scale=INITIAL_LOSS_SCALE if fp16 else 1.0,
                                     plan=plan, compressor=compressor, zero1=zero1)

    def example(n):
        return {"image": jax.ShapeDtypeStruct((n,) + data.image_shape, dtype,
                                              sharding=world.sharded()),
                "label": jax.ShapeDtypeStruct((n,), np.int32, sharding=world.sharded()),
                "mask": jax.ShapeDtypeStruct((n,), np.float32, sharding=world.sharded())}
    acc_shape = jax.ShapeDtypeStruct((world.world_size, 4), np.float32, sharding=world.sharded())
    train_step = steps.compile_step(
        "train_step", steps.make_train_step(model, tx, plan, world, config.bn_mode,
                                            dynamic_loss_scale=fp16,
                                            growth_interval=config.loss_scale_growth_interval,
                                            allreduce=config.allreduce, compressor=compressor,
                                            accumulation_steps=config.accumulation_steps,
                                            zero1=zero1, weight_decay=config.weight_decay,
                                            compression_start_step=config.compression_start_step),
        state, example(world.global_batch_size), donate_argnums=0)
    fold_bn = steps.compile_step("fold_bn", steps.make_fold_bn(world, config.bn_mode), state)
    folded = fold_bn.compiled.out_info  # ShapeDtypeStructs with shardings
    eval_step = steps.compile_step("eval_step", steps.make_eval_step(model, world, config.bn_mode),
                                   state.params, folded, example(config.eval_batch_size),
                                   acc_shape, donate_argnums=3)
    eval_reduce = steps.compile_step("eval_reduce", steps.make_eval_reduce(world), acc_shape)
    plan = plan.with_memory(train_step.memory())
    return Trainer(config, world, data, model, plan, schedule, state, train_step, fold_bn,
                   eval_step, eval_reduce, train_steps, dtype)


def evaluate_pass(tr: Trainer, state) -> dict:
    """One validation pass: fold BN once, accumulate per device, ONE all-reduce.

    Returns ``{"loss", "top1", "top5", "count", "sums"}``: global sums over the
    global count of real examples (padding rows are masked out); ``sums`` is
    the raw ``[loss_sum, top1_correct, top5_correct, count]``.
    """
    world = tr.world
    folded = tr.fold_bn(state)
    acc = world.put(np.zeros((world.world_size, 4), np.float32), world.sharded())
    rows = world.process_rows(tr.config.eval_batch_size)
    for batch in datasets.prefetch(input_pipeline.iterate_batches(
            tr.data.val, tr.config.eval_batch_size, shuffle=False, rows=rows,
            image_shape=tr.data.image_shape), depth=tr.config.prefetch):
        acc = tr.eval_step(state.params, folded, input_pipeline.to_device(
            batch, world.sharded(), tr.data.num_classes, tr.dtype), acc)
    sums = host_value(tr.eval_reduce(acc))
    return {**_rates(sums), "count": int(sums[3]), "sums": sums.tolist()}


class MetricsReader:
    """Reads step metrics ``lag`` steps behind the dispatch (host side).

    ``push(step, metrics)`` queues a step's device metrics; once more than
    ``lag`` are queued the oldest is fetched (a few bytes, already computed),
    added to the epoch sums, and a skipped (non-finite) step is logged with
    its number, or raises when ``halt`` is set.
    """

    def __init__(self, lag: int, halt: bool, fp16: bool, log=print):
        self.lag, self.halt, self.fp16, self.log = lag, halt, fp16, log
        self.pending: collections.deque = collections.deque()
        self.sums = np.zeros(4)
        self.skipped: list[int] = []

    def push(self, step: int, metrics) -> None:
        self.pending.append((step, metrics))
        self.drain(self.lag)

    def drain(self, limit: int = 0) -> None:
        while len(self.pending) > limit:
            step, m = self.pending.popleft()
            m = host_value(m)
            self.sums += m[:4]
            if m[4] == 0.0:
                self.skipped.append(step)
                msg = f"step {step}: non-finite gradient, update skipped on every replica"
                if self.fp16:
                    msg += " (fp16: loss scale halved)"
                elif self.halt:
                    raise FloatingPointError(msg + " (config.halt_on_nonfinite=True)")
                self.log(msg)

    def take(self) -> np.ndarray:
        self.drain(0)
        sums, self.sums = self.sums, np.zeros(4)
        return sums


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       data: input_pipeline.Dataset | None = None):
    """Trains and evaluates, checkpointing under ``workdir/checkpoints``.

    Resumes by default from the newest readable checkpoint in ``workdir``
    (``config.resume``), at the exact step and data position it was saved at.

    Args:
      config: see ``configs/default.py``.
      workdir: where ``metrics.jsonl``, ``summary.json`` and checkpoints go.
      data: optional in-memory :class:`trjax.input_pipeline.Dataset`.

    Returns:
      ``(state, summary)``: the final :class:`trjax.steps.TrainState` and the
      summary dict (also written to ``summary.json`` by process 0).

    Raises:
      ValueError: an invalid config, device spec or batch split (before any
        compilation), or an incompatible checkpoint.
      FloatingPointError: a skipped non-finite step when
        ``config.halt_on_nonfinite``.
      OSError (or orbax's error): a checkpoint write failed; raised at the
        next save or at the end of the loop (the previous checkpoints stay).
    """
    t_start = time.perf_counter()
    validate_config(config)
    cache = compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
    with compilation.CompileLog("startup") as compiles:  # every executable built, by phase
        return _train_and_evaluate(config, workdir, data, compiles, cache, t_start)


def _train_and_evaluate(config, workdir, data, compiles, cache, t_start):
    ckpt_dir = os.path.join(workdir, "checkpoints")
    expect = {k: config[k] for k in checkpoint.COMPATIBLE_FIELDS}
    if config.compression != "none" or config.shard_optimizer_state:
        # error feedback / sharded optimizer state are stored in bucket layout
        expect["bucket_kernel_order"] = resolve_kernel_order(
            config.bucket_kernel_order, jax.devices()[0].platform)
    if config.resume and os.path.isdir(ckpt_dir):  # incompatible: an error before compiling
        checkpoint.check_compatible(checkpoint.manager(ckpt_dir, config.keep_checkpoints), expect)
    tr = setup(config, data)
    for c in tr.compiled:  # setup's builds of each step's program, filed under its name
        compiles.refile("startup", compilation.step_program(c), c.name)
    ckpt = checkpoint.manager(ckpt_dir, config.keep_checkpoints,  # only once the setup is valid
                              asynchronous=config.checkpoint_async)
    world, data, plan, schedule, state = tr.world, tr.data, tr.plan, tr.schedule, tr.state
    train_step = tr.train_step
    steps_per_epoch = tr.steps_per_epoch
    total_steps = steps_per_epoch * config.num_epochs
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    os.makedirs(workdir, exist_ok=True)
    say(f"world_size={world.world_size} devices={[d.id for d in world.devices]} "
        f"({world.devices[0].platform}, {jax.process_count()} process(es)) "
        f"global_batch={world.global_batch_size} local_batch={world.local_batch_size} "
        f"bn_mode={config.bn_mode} precision={config.precision}")
    say("buckets: " + ", ".join(f"{b}={n} elements ({plan.bucket_bytes(b)} B)"
                                for b, n in plan.bucket_sizes.items()) +
        f"; compile {sum(c.compile_s for c in tr.compiled):.1f}s")
    say(f"compilation cache: {compilation.cache_dir() or 'off'} (start-up: "
        f"{sum(not b.compiled for b in compiles.builds)} programs loaded, "
        f"{sum(b.compiled for b in compiles.builds)} compiled)")

    # -- every process must run the same job from the same parameters ---------
    distributed.check_agree({
        "steps_per_epoch": steps_per_epoch, "train_examples": len(data.train.labels),
        "val_examples": len(data.val.labels), "world_size": world.world_size,
        **{k: config[k] for k in checkpoint.COMPATIBLE_FIELDS}})
    distributed.check_agree({"initial params checksum": distributed.tree_checksum(state.params)})

    # -- checkpoints and resume ---------------------------------------------
    start_epoch, start_batch = 1, 0
    if config.resume:
        with compiles.phase("restore"):
            restored = checkpoint.restore_latest(ckpt, state, expect, log=say)
        if restored is not None:
            state, meta = restored
            start_epoch, start_batch = int(meta["epoch"]), int(meta["batch"])
            say(f"resumed from step {int(host_value(state.step))} "
                f"(epoch {start_epoch}, batch {start_batch})")

    checkpoint_s = [0.0]  # the training thread's time in saves (host copy, waits)

    def save(epoch: int, batch: int) -> None:
        t = time.perf_counter()
        with compiles.phase("checkpoint"):
            checkpoint.save(ckpt, state, {**expect, "epoch": epoch, "batch": batch,
                                          "world_size": world.world_size})
        checkpoint_s[0] += time.perf_counter() - t

    rows = world.process_rows()
    lr_table = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(total_steps + 1)))
    history, train_time, train_images = [], 0.0, 0
    reader = MetricsReader(config.metrics_lag, config.halt_on_nonfinite,
                           config.precision == "fp16", log=say)
    show_bar = lead and config.progress and sys.stderr.isatty()
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    halted = False
    val = None
    watchdog = distributed.StepWatchdog(config.step_timeout_s)
    tb = None
    if config.tensorboard and lead:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("config.tensorboard=True needs tensorboardX: "
                             "pip install 'trjax[tensorboard]'") from None
        tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    with open(metrics_path, "a" if start_epoch > 1 or start_batch else "w") if lead \
            else contextlib.nullcontext() as log, compiles.phase("train"), watchdog, \
            _finishing(ckpt, checkpoint_s):  # the last save is complete before the loop ends
        for epoch in range(start_epoch, config.num_epochs + 1):
            t0 = time.perf_counter()
            first = start_batch if epoch == start_epoch else 0
            step_index = (epoch - 1) * steps_per_epoch + first
            batches = datasets.prefetch(input_pipeline.iterate_batches(
                data.train, world.global_batch_size, shuffle=True, seed=config.seed, epoch=epoch,
                remainder=config.train_remainder, rows=rows, start=first,
                augment=config.augment, image_shape=data.image_shape), depth=config.prefetch)
            with _progress(steps_per_epoch - first, epoch, show_bar) as bar:
                for b, batch in enumerate(batches, start=first + 1):
                    step_index += 1
                    state, m = train_step(state, input_pipeline.to_device(
                        batch, world.sharded(), data.num_classes, tr.dtype))
                    reader.push(step_index, m)
                    watchdog.beat(step_index - config.metrics_lag)
                    bar.update(1)
                    if bar.n % 10 == 0 and reader.sums[3]:
                        bar.set_postfix(loss=f"{reader.sums[0] / reader.sums[3]:.4f}",
                                        img_s=f"{reader.sums[3] / (time.perf_counter() - t0):.0f}")
                    if config.checkpoint_every_steps and step_index % config.checkpoint_every_steps == 0 \
                            and b < steps_per_epoch:
                        reader.drain(0)
                        save(epoch, b)
                    if config.halt_after_steps and step_index >= config.halt_after_steps:
                        halted = True
                        break
            sums = reader.take()
            epoch_s = time.perf_counter() - t0
            train_time += epoch_s
            train_images += int(sums[3])
            if halted:
                save(epoch, b) if b < steps_per_epoch else save(epoch + 1, 0)
                say(f"halted after step {step_index} (config.halt_after_steps); checkpoint saved")
                break
            with compiles.phase("evaluate"):
                val = evaluate_pass(tr, state)
            save(epoch + 1, 0)
            watchdog.beat(step_index)
            row = {"epoch": epoch, "step": step_index,
                   **{f"train_{k}": v for k, v in _rates(sums).items()},
                   **{f"val_{k}": val[k] for k in ("loss", "top1", "top5")},
                   "images_per_s": sums[3] / epoch_s, "epoch_s": epoch_s,
                   "lr": float(lr_table[step_index])}
            history.append(row)
            if lead:
                log.write(json.dumps(row) + "\n")
                log.flush()
            if tb is not None:
                for k, v in row.items():
                    if k not in ("epoch", "step"):
                        tb.add_scalar(k, v, step_index)
                tb.flush()
            say(f"epoch {epoch:3d}  train loss {row['train_loss']:.4f} top1 {row['train_top1']:.4f}"
                f"  | val loss {row['val_loss']:.4f} top1 {row['val_top1']:.4f} "
                f"top5 {row['val_top5']:.4f}  | {row['images_per_s']:.0f} img/s")

    if tb is not None:
        tb.close()
    if val is None:  # resumed at the very end, or halted before any evaluation
        with compiles.phase("evaluate"):
            val = evaluate_pass(tr, state)
    loop_phases = ("train", "evaluate", "checkpoint", compilation.BACKGROUND)
    summary = {
        "val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"],
        "val_examples": val["count"],
        "world_size": world.world_size, "process_count": jax.process_count(),
        "global_batch_size": world.global_batch_size,
        "local_batch_size": world.local_batch_size, "platform": world.devices[0].platform,
        "cpu_convolutions": host.convolution_library(),
        "bn_mode": config.bn_mode, "precision": config.precision, "model": config.model,
        "dataset": config.dataset, "epochs": config.num_epochs,
        "steps": int(host_value(state.step)), "halted": halted,
        "skipped_steps": int(host_value(state.skipped_steps)),
        "skipped_step_numbers": reader.skipped,
        "loss_scale": float(host_value(state.loss_scale)),
        "train_images_per_s": train_images / train_time if train_time else 0.0,
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
    }
    if lead:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return state, summary
