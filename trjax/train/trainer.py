"""The trainer: config -> world -> data -> model, plan and exchange -> train state -> compiled steps.

:func:`prepare` runs every check and builds what needs no device; :func:`setup`
adds the train state and the four ahead-of-time compiled steps (train step,
BN fold, eval step, eval all-reduce); :func:`evaluate_pass` is one exact
validation pass. The loop that drives them is :mod:`trjax.train`.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from trjax import aot, models, optim, parallel, steps
from trjax.data import input_pipeline
from trjax.data.splits import check_labels
from trjax.train import config as config_lib
from trjax.train import init_from as init_from_lib
from trjax import exchange as exchange_lib
from trjax.cpu.im2col import resolve_conv_lowering
from trjax.metrics import METRICS, StepMetrics
from trjax.plan import build_plan
from trjax.precision import INITIAL_LOSS_SCALE, compute_dtype
from trjax.objective import StepOptions
from trjax.state import train_state_program
from trjax.world import host_value, make_world


@dataclasses.dataclass
class Trainer:
    """Everything built before the first step: the output of :func:`setup`.

    ``state`` and the compiled steps are ``None`` in the output of
    :func:`prepare` (nothing traced or placed on devices yet). ``full_batches``:
    no training batch holds a padding row
    (:func:`trjax.data.input_pipeline.train_batches_full`), so the train step is
    compiled without BatchNorm's padding mask; the loop refuses a batch with one.
    ``layout``: how the run lies over its mesh (:func:`trjax.parallel.from_config`).
    ``loss_fn``, ``transform``: the user's training loss and per-example
    augmentation (:func:`prepare`), or ``None``."""
    config: Any
    world: Any
    data: Any
    model: Any
    plan: Any
    schedule: Any
    exchange: exchange_lib.GradientExchange
    steps_per_epoch: int
    dtype: Any
    layout: parallel.Layout
    full_batches: bool = False
    loss_fn: Any = None
    transform: Any = None
    init_plan: Any = None
    state: Any = None
    train_step: aot.CompiledStep | None = None
    fold_bn: aot.CompiledStep | None = None
    eval_step: aot.CompiledStep | None = None
    eval_reduce: aot.CompiledStep | None = None

    @property
    def compiled(self):
        return (self.train_step, self.fold_bn, self.eval_step, self.eval_reduce)


def prepare(config: ml_collections.ConfigDict,
            data: input_pipeline.Dataset | None = None, model=None, tx=None,
            loss_fn=None, transform=None, init_from=None) -> Trainer:
    """Config -> world -> data -> model, plan, schedule and gradient exchange.

    Every check on the config, the device spec and the batch split runs
    first (:func:`trjax.train.config.validate`); nothing is traced, compiled or
    placed on a device. :func:`setup` finishes the job.

    Args:
      config: see ``configs/default.py``.
      data: a :class:`trjax.data.input_pipeline.Dataset` to use instead of
        ``config.dataset``.
      model: your own flax model instead of ``config.model`` (a built-in name
        or an import path, :func:`trjax.train.config.resolve_model`): a linen
        module or an ``nnx.Module`` (``__call__(x, train)`` -> logits ``[B,
        num_classes]``, float; see :func:`trjax.models.wrap`). trjax
        standardises the input with the data set's statistics, gives flax's
        BatchNorm layers its statistics in ``config.bn_mode`` and dropout its
        key; ``config.bn_momentum``, when set, is every BatchNorm's momentum
        (yours included; ``None`` keeps each layer's own), and
        ``config.conv_lowering`` applies only to trjax's own ResNets.
      tx: an optax ``GradientTransformation`` (or ``(plan, schedule) ->
        GradientTransformation``) instead of the config's optimizer, applied
        after the gradient exchange to the exact global mean gradient
        (:func:`trjax.exchange.from_config` says how it composes with
        ``grad_clip_norm``, ``ema_decay``, compression and ZeRO-1).
      loss_fn: a per-example training loss ``loss_fn(logits [B, K] float32,
        labels [B] int32) -> [B] float32`` instead of the softmax
        cross-entropy; trjax sums it over the real rows (padding rows by
        select). Checked here (:func:`trjax.steps.check_loss_fn`). With
        ``mixup_alpha`` / ``cutmix_alpha`` it is ``lam loss(labels) + (1 - lam)
        loss(partner labels)``; ``label_smoothing`` applies only to the
        built-in loss. The evaluation loss stays the plain cross-entropy.
      transform: a per-example training augmentation ``transform(uint8 image
        [H, W, C], rng: np.random.Generator) -> uint8 image [H, W, C]``, run in
        the input pipeline after ``config.augment``'s crops (in the worker
        processes when there are any: then a picklable, module-level function),
        with ``rng`` keyed by (seed, epoch, example index); never on
        validation. Checked here on one example
        (:func:`trjax.data.input_pipeline.check_transform`).
      init_from: a fresh run's weights instead of ``config.init_from``: a
        path or a ``{"params", "batch_stats"}`` tree, read and matched to the
        model by name here (:mod:`trjax.train.init_from`); the loop places them
        when it does not resume.

    Raises:
      ValueError: an invalid config, device spec or batch split; a label of either
        split outside ``[0, num_classes)`` or not an integer (naming the index and
        the value, :func:`trjax.data.splits.check_labels`); a model whose
        output is not ``[B, num_classes]`` float logits; a ``loss_fn`` that
        does not return ``[B]`` float losses (or combined with
        ``label_smoothing``); a ``transform`` that changes the image's shape
        or dtype, or does not pickle for worker processes.
      TypeError: a ``model`` that is neither a linen nor an nnx module, a
        ``tx`` that is not an optax ``GradientTransformation``, or a
        ``loss_fn`` / ``transform`` that is not callable.
    """
    config_lib.validate(config)
    world = make_world(config.devices, config.global_batch_size, mesh=config.mesh or None)
    config_lib.validate(config, world.data_size)
    if data is None:
        data = input_pipeline.load_dataset(config.dataset, config.data_dir, config.image_size,
                                           verify=config.verify_images,
                                           skip_bad_images=config.skip_bad_images)
    check_labels(data)  # every source: a label outside [0, num_classes) is an error now
    input_pipeline.resolve_workers(config.data_workers, data.train)  # a bad value: error now
    train_steps = input_pipeline.steps_per_epoch(len(data.train.labels), world.global_batch_size,
                                                 config.train_remainder)
    config_lib.validate_steps(config, len(data.train.labels), world.global_batch_size, train_steps)
    dtype = compute_dtype(config.precision)
    model = _network(config, world, data, model, dtype)
    models.warn_slow_statistics(models.bn_momenta(model, data.image_shape),
                                train_steps * config.num_epochs)
    layout = parallel.from_config(config, world, model, data.image_shape)
    plan = build_plan(model, data.image_shape, config.buckets, local=layout.local_shapes)
    schedule = optim.learning_rate_schedule(config.learning_rate,
                                            config.warmup_epochs * train_steps,
                                            train_steps * config.num_epochs)
    exchange = exchange_lib.from_config(config, plan, schedule, world, tx=tx)
    full = input_pipeline.train_batches_full(data.train, world.global_batch_size,
                                             config.train_remainder)
    if loss_fn is not None:
        if config.label_smoothing:
            raise ValueError(f"config.label_smoothing={config.label_smoothing} applies to trjax's "
                             "cross-entropy, not to your loss_fn: smooth inside loss_fn, or "
                             "set label_smoothing=0")
        steps.check_loss_fn(loss_fn, data.num_classes)
    if transform is not None:
        input_pipeline.check_transform(transform, data.train, data.image_shape, seed=config.seed,
                                       workers=config.data_workers)
    source = init_from if init_from is not None else (config.init_from or None)
    init_plan = None if source is None else init_from_lib.plan_load(
        model.abstract_variables(data.image_shape), init_from_lib.read_weights(source))
    return Trainer(config, world, data, model, plan, schedule, exchange, train_steps, dtype,
                   layout.with_exchange(exchange), full, loss_fn=loss_fn, transform=transform,
                   init_plan=init_plan)


def _network(config, world, data, model, dtype) -> models.Network:
    """The run's :class:`trjax.models.Network`: ``model``, or ``config.model`` (a
    built-in name or an import path) built with the config's keys; checked
    (:func:`trjax.models.wrap`) unless it is a built-in ResNet."""
    builtin = model is None and not config_lib.is_import_path(config.model)
    if model is None:  # config.model: a built-in name or an import path
        lowering = resolve_conv_lowering(config.conv_lowering, world.devices[0].platform)
        model = config_lib.resolve_model(config, data.num_classes, bn_mode=config.bn_mode,
                                         axis_name=world.axis_name,
                                         **_momentum(config.bn_momentum, builtin), dtype=dtype,
                                         conv_lowering=lowering,
                                         **({"zero_init_residual": True}
                                            if builtin and config.zero_init_residual else {}))
    return models.wrap(model, image_shape=data.image_shape, num_classes=data.num_classes,
                       mean=data.mean, std=data.std, dtype=dtype, seed=config.seed,
                       bn_momentum=config.bn_momentum, check=not builtin,
                       remat=config.remat, remat_policy=config.remat_policy)


def _momentum(bn_momentum, builtin: bool) -> dict:
    """The ``bn_momentum`` constructor argument: ``config.bn_momentum``, or
    when it is ``None`` 0.9 for a built-in ResNet and nothing for an import
    path (the model's own default)."""
    if bn_momentum is None:
        return {"bn_momentum": 0.9} if builtin else {}
    return {"bn_momentum": bn_momentum}


def data_identity(split) -> dict:
    """What a data position (epoch, batch) means: ``{"train_examples": N,
    "train_fingerprint": hex}``. The fingerprint is a SHA-256 of the split's
    listing: its labels and, for a source read from files, every file's path
    relative to the source's root (the order the epochs shuffle); for in-memory
    arrays, the labels and the images' shape. A checkpoint records it, and a
    resume onto other data (a file added or deleted, a relabelled split) is
    refused instead of continuing at a position that now points at other
    examples."""
    h = hashlib.sha256()
    labels = np.ascontiguousarray(np.asarray(split.labels, np.int64))
    h.update(labels.tobytes())
    paths = getattr(split, "paths", None)
    if paths is not None:
        root = str(getattr(split, "root", ""))
        for p in paths:
            h.update(os.path.relpath(str(p), root).encode("utf-8", "surrogateescape") + b"\0")
    else:
        h.update(repr(tuple(np.shape(split.images))).encode())
    return {"train_examples": int(len(split.labels)), "train_fingerprint": h.hexdigest()[:16]}


IDENTITY_ATTR = "trjax_identity"
"""The attribute a user's ``loss_fn`` / ``transform`` may carry to name itself (a string):
what :func:`code_identity` records instead of its qualified name and source hash."""


def code_identity(fn) -> str | None:
    """A stable identity of a user's callable (``loss_fn=``, ``transform=``) for a
    checkpoint's meta: ``fn.trjax_identity`` when set (a name the user gives, e.g.
    ``"ce-v2"``), else ``module.qualname#<sha256 of its source>`` (12 hex digits; the
    source of a ``functools.partial``'s function plus its bound arguments' ``repr``; a
    callable object's class); the code object's bytes and constants where there is no
    source (e.g. defined in a REPL). ``None`` for ``None``."""
    if fn is None:
        return None
    given = getattr(fn, IDENTITY_ATTR, None)
    if given is not None:
        return str(given)
    extra = ""
    if isinstance(fn, functools.partial):
        extra = repr((fn.args, sorted(fn.keywords.items())))
        fn = fn.func
    target = fn if inspect.isfunction(fn) or inspect.isclass(fn) else type(fn)
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        source = repr((code.co_code, code.co_consts)) if code is not None else repr(target)
    digest = hashlib.sha256((source + extra).encode()).hexdigest()[:12]
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}#{digest}"


def checkpoint_keys(tr: Trainer) -> dict:
    """Everything a checkpoint of this run must match to be resumed: the config
    keys :data:`trjax.train.config.CHECKPOINT_KEYS`, the training data's
    :func:`data_identity`, what the exchange's state depends on
    (``exchange.checkpoint_keys``), in ``local`` BN mode (one statistics row
    per replica) the world size and, for a model other than trjax's ResNets
    (``model=`` or an import path), ``model_layout``: a SHA-256 of its
    parameter and statistics names, shapes and dtypes, so that a resume with
    another model is refused by name before anything is compiled; ``loss_fn``
    and ``transform``: the :func:`code_identity` of the user's training loss and
    augmentation (``None``: the built-in ones), so a resume with another one is
    refused too."""
    keys = {k: tr.config[k] for k in config_lib.CHECKPOINT_KEYS}
    keys.update(loss_fn=code_identity(tr.loss_fn), transform=code_identity(tr.transform))
    keys.update(data_identity(tr.data.train))
    keys.update(tr.exchange.checkpoint_keys(tr.world))
    keys.update(tr.layout.checkpoint_keys())
    if not isinstance(tr.model.module, models.ResNet):
        layout = [(s.name, s.shape, s.dtype) for s in tr.plan.slots] + \
            sorted((name, shape) for name, (_, _, shape) in tr.plan.stats_slots.items())
        keys["model_layout"] = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
    return keys


def setup(config: ml_collections.ConfigDict,
          data: input_pipeline.Dataset | None = None,
          prepared: Trainer | None = None, model=None, tx=None, loss_fn=None,
          transform=None) -> Trainer:
    """:func:`prepare`, then the train state and the compiled steps.

    The four steps are compiled here, once, with the train state donated;
    the plan then carries the train step's memory statistics.

    Args:
      config: see ``configs/default.py``.
      data: a :class:`trjax.data.input_pipeline.Dataset` to use instead of
        ``config.dataset`` (arrays already in memory).
      prepared: the output of :func:`prepare` for this config, if already built.
      model: your own flax model (see :func:`prepare`).
      tx: your own optax optimizer (see :func:`prepare`).
      loss_fn, transform: your own training loss and augmentation (see
        :func:`prepare`); with ``prepared``, its own are used.

    Raises:
      ValueError: an invalid config, device spec or batch split, or a model
        with the wrong output (before anything is compiled).
      TypeError: a ``model`` that is neither a linen nor an nnx module.
    """
    tr = prepared if prepared is not None else prepare(config, data, model, tx, loss_fn,
                                                       transform)
    world, plan = tr.world, tr.plan
    fp16 = config.precision == "fp16"
    init = train_state_program(config.seed, tr.layout, tr.exchange,
                               loss_scale=INITIAL_LOSS_SCALE if fp16 else 1.0)

    example = lambda n: example_batch(tr, n)
    acc_shape = jax.ShapeDtypeStruct((world.data_size, len(METRICS)), np.float32,
                                     sharding=world.sharded())
    # The state initialisation compiles and runs on a thread of its own while this one
    # traces and compiles the steps (XLA releases the GIL; docs/performance.md). Its
    # build is filed under the phase this thread is in (the copied context).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trjax-init") as pool:
        pending_state = pool.submit(contextvars.copy_context().run, init.finish)
        train_step = aot.compile_step("train_step", make_train_step(tr), init.abstract,
                                      example(world.global_batch_size), donate_argnums=0,
                                      options=tr.layout.compile_options)
        fold_bn = aot.compile_step("fold_bn", steps.make_fold_bn(tr.layout), init.abstract)
        folded = fold_bn.compiled.out_info  # ShapeDtypeStructs with shardings
        eval_step = aot.compile_step("eval_step", steps.make_eval_step(tr.layout),
                                     init.abstract.params, folded, example(config.eval_batch_size),
                                     acc_shape, donate_argnums=3)
        eval_reduce = aot.compile_step("eval_reduce", steps.make_eval_reduce(world), acc_shape)
        state = pending_state.result()
    return dataclasses.replace(tr, plan=plan.with_memory(train_step.memory()), state=state,
                               train_step=train_step, fold_bn=fold_bn, eval_step=eval_step,
                               eval_reduce=eval_reduce)


def example_batch(tr: Trainer, rows: int) -> dict:
    """The abstract batch of ``rows`` global rows the steps are compiled for:
    ``{"image": [rows, H, W, C] (the device image dtype), "label": [rows] int32,
    "mask": [rows] float32}`` as ``jax.ShapeDtypeStruct``, sharded over the data axis."""
    sharded = tr.world.sharded()
    image = input_pipeline.device_image_dtype(tr.data.image_dtype, tr.dtype)
    return {"image": jax.ShapeDtypeStruct((rows,) + tr.data.image_shape, image, sharding=sharded),
            "label": jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharded),
            "mask": jax.ShapeDtypeStruct((rows,), np.float32, sharding=sharded)}


def step_options(tr: Trainer) -> StepOptions:
    """What the train step does beyond its layout, from the config and the
    user's ``loss_fn`` (:class:`trjax.objective.StepOptions`)."""
    c = tr.config
    return StepOptions(dynamic_loss_scale=c.precision == "fp16",
                       growth_interval=c.loss_scale_growth_interval,
                       grad_accumulation_steps=c.grad_accumulation_steps,
                       padding=not tr.full_batches, loss_fn=tr.loss_fn,
                       label_smoothing=c.label_smoothing, mixup_alpha=c.mixup_alpha,
                       cutmix_alpha=c.cutmix_alpha)


def make_train_step(tr: Trainer):
    """The train step of ``tr``'s layout, traced lazily
    (:func:`trjax.steps.make_train_step`)."""
    return steps.make_train_step(tr.layout, tr.exchange, tr.plan, step_options(tr))


def evaluate_pass(tr: Trainer, state, skipped: set | None = None, ema: bool = True) -> dict:
    """One validation pass: fold BN once, accumulate per device, ONE all-reduce.

    Returns ``{"loss", "top1", "top5", "count", "sums"}``: global sums over the
    global count of real examples (padding rows are masked out); ``sums`` is
    the raw ``[loss_sum, top1_correct, top5_correct, count]``. With ``ema`` and a
    state that holds an EMA of its parameters (``config.ema_decay > 0``), a second
    pass evaluates the EMA (:func:`trjax.exchange.ema_state`: the EMA parameters
    with the state's BN statistics, on the same compiled programs) and adds
    ``ema_loss``, ``ema_top1``, ``ema_top5`` and ``ema_sums``.
    """
    world = tr.world
    folded = tr.fold_bn(state)
    acc = world.put(np.zeros((world.data_size, len(METRICS)), np.float32), world.sharded())
    rows = world.process_rows(tr.config.eval_batch_size)
    for batch in input_pipeline.prefetch(input_pipeline.iterate_batches(
            tr.data.val, tr.config.eval_batch_size, shuffle=False, rows=rows,
            image_shape=tr.data.image_shape, workers=tr.config.data_workers, skipped=skipped),
            depth=tr.config.prefetch):
        acc = tr.eval_step(state.params, folded, input_pipeline.to_device(
            batch, world.sharded(), tr.data.num_classes, tr.dtype), acc)
    sums = host_value(tr.eval_reduce(acc))
    total = StepMetrics.from_sums(sums)
    result = {**total.rates(), "count": int(total.count), "sums": sums.tolist()}
    if ema and exchange_lib.ema_params(state) is not None:  # config.ema_decay > 0
        of_ema = evaluate_pass(tr, exchange_lib.ema_state(state), skipped, ema=False)
        result.update({f"ema_{k}": of_ema[k] for k in ("loss", "top1", "top5", "sums")})
    return result
