"""Config files and every check on a config, before anything is traced.

* :func:`load_config_file`, :func:`check_overrides` / :func:`check_argv`:
  ``ml_collections``' own messages for ``--config.KEY=VALUE`` do not suggest
  the key you meant; these do, and the scripts call them before flag parsing.
* :func:`validate`: choices, ranges and combinations of the config's values
  (and, given the world size, the batch splits); every message names the key,
  the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
from typing import Any

import ml_collections

from trjax import compression, models, optim, parallel
from trjax import remat as remat_lib
from trjax.cpu import host, im2col
from trjax.data import input_pipeline
from trjax.batchnorm import BN_MODES
from trjax.exchange import ALLREDUCE_CHOICES
from trjax.hardware import parse_bytes
from trjax.plan import BUCKET_POLICIES
from trjax.precision import PRECISIONS
from trjax.world import MESH_AXES, check_batch_split

@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: the values it takes and where it acts.

    Attributes:
      kind: ``"choice"``, ``"int"``, ``"float"``, ``"bool"``, ``"str"`` or
        ``"dict"`` (a ``ConfigDict`` of free keys).
      valid: ``choice``: the allowed values; ``int``: the lowest value (the
        highest is :data:`INT32_MAX`), ``None`` when the module that uses it
        checks it; ``float``: ``(low, low included, high, high included)``.
      program: the value enters a compiled program (the steps or the state
        initialisation); ``False``: it steers only the loop, its I/O or where
        data and caches live.
      resume: the value may differ between a run and its resume
        (``WORKDIR/config.json``); ``False``: a resume with another value is an
        error naming the key.
      checkpoint: the value must equal the one in the checkpoint's meta.
      hint: appended to a range error (units, what 0 means).
      optional: ``None`` is a valid value too (its meaning is in ``hint``).
    """
    kind: str
    valid: Any = None
    program: bool = True
    resume: bool = False
    checkpoint: bool = False
    hint: str = ""
    optional: bool = False


INT32_MAX = 2 ** 31 - 1
"""The upper bound of every int key: seeds, step counts and intervals meet the
train state's int32 counters on the device (a larger value overflowed there,
or failed with a bare ``OverflowError`` when placed)."""
INF = float("inf")
_LOOP = dict(program=False, resume=True)  # the loop's own knobs: no program, free on resume
_WHERE = dict(resume=True)                # where and how it runs: may change on resume
_MATCH = dict(checkpoint=True)            # the state's meaning or the step's arithmetic:
                                          # must match the checkpoint

KEYS = {
    # data
    "dataset": Key("choice", input_pipeline.DATASETS, **_MATCH),
    "data_dir": Key("str", program=False, resume=True),
    "image_size": Key("int", 1, **_MATCH),
    "augment": Key("bool", **_MATCH),
    "prefetch": Key("int", 0, **_LOOP),
    "data_workers": Key("int", None, **_LOOP),  # trjax.data.input_pipeline.resolve_workers
    "verify_images": Key("bool", **_LOOP),
    "skip_bad_images": Key("bool", program=False),
    "train_remainder": Key("choice", input_pipeline.REMAINDERS, **_MATCH),
    # world
    "devices": Key("str", **_WHERE),
    "cpu_devices": Key("int", None, **_WHERE),  # trjax.cpu.host.resolve_cpu_convolutions
    "cpu_convolutions": Key("choice", host.CPU_CONVOLUTIONS, **_WHERE),
    "conv_lowering": Key("choice", im2col.LOWERINGS, **_WHERE),
    "cpu_reuse_memory": Key("bool", **_WHERE),
    "mesh": Key("str", **_WHERE),  # checked by trjax.world.parse_mesh and trjax.parallel.check_config
    "memory_per_device": Key("str", **_WHERE),  # mesh="auto": trjax.hardware.parse_bytes
    "plan_hardware": Key("str", **_WHERE),  # mesh="auto": trjax.hardware.resolve
    "plan_axes": Key("str", **_WHERE),  # mesh="auto": a subset of trjax.world.MESH_AXES
    # where it runs, like mesh and devices (which set the rows per BN group too): may
    # change on resume; the start-up line prints the M in use
    "pipeline_microbatches": Key("int", 0, **_WHERE, hint=" (0: up to 4 x stages, BatchNorm groups of >= 16 rows)"),
    "pipeline_stage_starts": Key("str"),  # checked by trjax.parallel.pipeline.plan_stages
    "pipeline_schedule": Key("choice", ("gpipe", "1f1b", "zb-h1")),  # pipeline.SCHEDULES
    "pipeline_remat": Key("bool"),
    # memory: what the backward recomputes (trjax.remat); values within one step's rounding
    "remat": Key("str", **_WHERE),  # checked by trjax.remat.parse / resolve
    "remat_policy": Key("choice", tuple(remat_lib.POLICIES), **_WHERE),
    # FSDP: the backward gathers the parameters again (checked by parallel.mesh.check_config)
    "fsdp_reshard_after_forward": Key("bool", **_WHERE),
    "tensor_plan": Key("str", **_WHERE),  # checked by trjax.parallel.tensor.parse / resolve
    "global_batch_size": Key("int", 1, **_MATCH),
    "eval_batch_size": Key("int", 1),
    # model
    "model": Key("choice", tuple(models.MODELS), **_MATCH),  # or "module:attr" (check_model)
    "init_from": Key("str", program=False, resume=True),  # trjax.train.init_from; a fresh run only
    "model_kwargs": Key("dict"),  # resume: config.json compares it (JSON; no checkpoint meta)
    "bn_mode": Key("choice", BN_MODES, **_MATCH),
    "bn_momentum": Key("float", (0.0, True, 1.0, False), optional=True, **_MATCH,
                       hint=" (None: each BatchNorm keeps its own; trjax's ResNets 0.9)"),
    "zero_init_residual": Key("bool"),  # built-in ResNets: each block's last BN scale = 0
    # communication
    "buckets": Key("str", **_MATCH),  # checked in validate: BUCKET_POLICIES or size:<MB>
    "allreduce": Key("choice", ALLREDUCE_CHOICES),
    "allreduce_local_size": Key("int", 0),
    "compression": Key("choice", tuple(compression.COMPRESSORS), **_MATCH),
    "powersgd_rank": Key("int", 1, **_MATCH),
    "compression_start_step": Key("int", 0, **_MATCH),
    "compression_min_fraction": Key("float", (0.0, True, 1.0, True), **_MATCH),
    "topk_ratio": Key("float", (0.0, False, 1.0, True), **_MATCH),
    "grad_accumulation_steps": Key("int", 1, **_MATCH),
    "shard_optimizer_state": Key("bool", **_MATCH),
    "precision": Key("choice", tuple(PRECISIONS), **_MATCH),
    "loss_scale_growth_interval": Key("int", 1, **_MATCH),
    # optimisation
    "optimizer": Key("choice", optim.OPTIMIZERS, **_MATCH),
    "learning_rate": Key("float", (0.0, False, INF, False), **_MATCH),
    "warmup_epochs": Key("int", 0, **_MATCH),
    "momentum": Key("float", (0.0, True, 1.0, False), **_MATCH),
    "nesterov": Key("bool", **_MATCH),
    "weight_decay": Key("float", (0.0, True, INF, False), **_MATCH),
    "trust_coefficient": Key("float", (0.0, False, INF, False), **_MATCH),
    "adam_b1": Key("float", (0.0, True, 1.0, False), **_MATCH),   # adamw only
    "adam_b2": Key("float", (0.0, True, 1.0, False), **_MATCH),   # adamw only
    "adam_eps": Key("float", (0.0, False, INF, False), **_MATCH),  # adamw only
    "grad_clip_norm": Key("float", (0.0, True, INF, False), **_MATCH, hint=" (0: off)"),
    "ema_decay": Key("float", (0.0, True, 1.0, False), **_MATCH,  # the state holds the EMA
                     hint=" (0: off)"),
    "label_smoothing": Key("float", (0.0, True, 1.0, False), **_MATCH, hint=" (0: off)"),
    "mixup_alpha": Key("float", (0.0, True, INF, False), **_MATCH, hint=" (0: off)"),
    "cutmix_alpha": Key("float", (0.0, True, INF, False), **_MATCH, hint=" (0: off)"),
    "num_epochs": Key("int", 1, **_WHERE),  # the schedule's length: recomputed on resume
    # run
    "seed": Key("int", 0, **_MATCH),
    "halt_on_nonfinite": Key("bool", **_LOOP),
    "max_consecutive_overflows": Key("int", 0, **_LOOP),
    "metrics_lag": Key("int", 1, **_LOOP),
    "progress": Key("bool", **_LOOP),
    "tensorboard": Key("bool", **_LOOP),
    "log_every_steps": Key("int", 0, **_LOOP),
    "profile_steps": Key("str", **_LOOP),  # checked by parse_profile_steps
    "preemption_check_every_steps": Key("int", 1, **_LOOP),
    "checkpoint_every_steps": Key("int", 0, **_LOOP),
    "keep_checkpoints": Key("int", 1, **_LOOP),
    "resume": Key("bool", **_LOOP),
    "halt_after_steps": Key("int", 0, **_LOOP),
    "checkpoint_async": Key("bool", **_LOOP),
    "compilation_cache": Key("bool", **_LOOP),
    "compilation_cache_dir": Key("str", **_LOOP),
    "distributed.coordinator": Key("str", **_LOOP),
    "distributed.num_processes": Key("int", 1, **_LOOP),
    "distributed.process_id": Key("int", None, **_LOOP),  # checked against num_processes
    "distributed.auto": Key("bool", **_LOOP),
    "distributed.heartbeat_timeout_s": Key("int", 1, **_LOOP),
    "step_timeout_s": Key("float", (0.0, True, INF, False), **_LOOP,
                          hint=" (seconds; 0 turns the watchdog off)"),
}
"""Every config key (``configs/default.py``), with its kind, range and where it
acts; :func:`validate`, the ``config.json`` comparison on resume
(:func:`trjax.train.loop_io.save_config`) and the checkpoint's compatibility
check all read it (``tests/test_config.py`` checks it covers the default config)."""

CHOICES = {k: key.valid for k, key in KEYS.items() if key.kind == "choice"}
"""Config keys with a fixed set of values."""
POSITIVE_INTS = tuple(k for k, key in KEYS.items() if key.kind == "int" and key.valid == 1)
NON_NEGATIVE_INTS = tuple(k for k, key in KEYS.items() if key.kind == "int" and key.valid == 0)
FLOAT_RANGES = {k: key.valid for k, key in KEYS.items() if key.kind == "float"}
"""Numeric config keys and their valid ranges; anything else is an error naming the key."""
RESUME_MAY_CHANGE = tuple(dict.fromkeys(k.split(".")[0] for k, key in KEYS.items() if key.resume))
"""Top-level keys that may differ between a run and its resume: where and how
it runs and logs, how long, how often it saves; none changes the arithmetic of
a step or the data order."""
CHECKPOINT_KEYS = tuple(k for k, key in KEYS.items() if key.checkpoint)
"""Keys whose values a checkpoint records and a resume must match: what the state
means (model, data set, optimizer, EMA, ...) and every key that changes a step's
arithmetic (the recipe: learning rate and schedule, optimizer parameters, weight
decay, clipping, label smoothing, mixing, BatchNorm momentum, accumulation, loss
scaling, compression parameters; the data: image size, augmentation, remainder), so
that a workdir without its ``config.json`` still refuses a changed recipe by name
(issue 40). Not here: keys that change only the order of fp32 sums (``allreduce``,
the pipeline's schedule, stage starts and remat), the evaluation batch, the initial
parameters only (``zero_init_residual``: a resume restores them), ``model_kwargs``
(a dict: ``config.json`` compares it) and :data:`RESUME_MAY_CHANGE`."""
OUTSIDE_PROGRAMS = tuple(k for k, key in KEYS.items() if not key.program)
"""Keys that enter no compiled program (``tests/test_config.py`` changes them all
and compares the lowered train step)."""


def _get(c, key: str):
    for part in key.split("."):
        c = c[part]
    return c


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(config: ml_collections.ConfigDict, world_size: int | None = None) -> None:
    """Checks choices, ranges and combinations before anything is traced.

    Args:
      config: see ``configs/default.py``.
      world_size: when known (the data axis size on a model-parallel mesh: the
        batches split over ``data`` only), also checks that the global, eval and
        micro-batch splits divide (local batch / ``grad_accumulation_steps``)
        and that ``allreduce_local_size`` divides the world.

    Raises:
      ValueError: naming the key, its value and the valid choices or range.
    """
    c = config
    for key, valid in CHOICES.items():
        if key == "model":
            check_model(c.model, c.get("model_kwargs"))
            continue
        if c[key] not in valid:
            raise ValueError(f"config.{key}={c[key]!r} is not one of {sorted(valid)}")
    policy = str(c.buckets)
    size_ok = False
    if policy.startswith("size:"):
        try:
            size_ok = float(policy[len("size:"):]) > 0
        except ValueError:
            pass
    if policy not in BUCKET_POLICIES and not size_ok:
        raise ValueError(f"config.buckets={c.buckets!r} is not one of "
                         "'two', 'tail_minimal', 'size:<MB>' (a positive number, e.g. 'size:25'), "
                         "'per_leaf'")
    for keys, low in ((POSITIVE_INTS, 1), (NON_NEGATIVE_INTS, 0)):
        for key in keys:
            v = _get(c, key)
            if not _is_int(v) or not low <= v <= INT32_MAX:
                raise ValueError(f"config.{key}={v!r} must be an int in [{low}, {INT32_MAX}] "
                                 "(int32, as the step counters on the device)")
    for key, (low, low_in, high, high_in) in FLOAT_RANGES.items():
        v = c[key]
        if v is None and KEYS[key].optional:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (
            low <= v if low_in else low < v) and (v <= high if high_in else v < high)
        if not ok:
            raise ValueError(f"config.{key}={v!r} must be in {'[' if low_in else '('}{low:g}, "
                             f"{high:g}{']' if high_in else ')'}{KEYS[key].hint}")
    if c.data_dir and c.dataset == "digits":
        raise ValueError(f"config.data_dir={c.data_dir!r} is set but dataset='digits' is built "
                         "in and reads no folder; choose the dataset that folder holds "
                         f"(one of {list(input_pipeline.DATASETS)}) or leave data_dir empty")
    parse_profile_steps(c.profile_steps)
    remat_lib.parse(c.remat)
    if c.shard_optimizer_state and (c.optimizer not in ("sgd", "adamw") or c.compression != "none"
                                    or c.allreduce != "xla"):  # elementwise optimizers only
        raise ValueError("config.shard_optimizer_state=True (ZeRO-1) needs optimizer='sgd' "
                         "or 'adamw', "
                         "compression='none' and allreduce='xla' (got "
                         f"{c.optimizer!r}, {c.compression!r}, {c.allreduce!r})")
    # a key that the chosen mode would ignore is an error, not a silent no-op
    if c.compression != "none" and c.allreduce != "xla":
        raise ValueError(f"config.allreduce={c.allreduce!r} has no compressed form: compressed "
                         f"buckets (config.compression={c.compression!r}) are all-reduced by "
                         "XLA's psum; set allreduce='xla' or compression='none'")
    if c.allreduce_local_size and c.allreduce != "hierarchical":
        raise ValueError(f"config.allreduce_local_size={c.allreduce_local_size!r} applies to "
                         f"allreduce='hierarchical' only (got allreduce={c.allreduce!r}); "
                         "set it to 0 or choose the hierarchical all-reduce")
    if c.compression_start_step and c.compression == "none":
        raise ValueError(f"config.compression_start_step={c.compression_start_step!r} needs a "
                         "compression (config.compression='none'); set it to 0 or choose one "
                         f"of {list(compression.COMPRESSORS)}")
    if str(c.memory_per_device).strip():
        try:
            parse_bytes(c.memory_per_device)
        except ValueError as e:
            raise ValueError(f"config.memory_per_device: {e}") from None
    axes = [a.strip() for a in str(c.plan_axes).split(",") if a.strip()]
    if any(a not in MESH_AXES for a in axes):
        raise ValueError(f"config.plan_axes={c.plan_axes!r}: the axes are {list(MESH_AXES)}, "
                         "comma separated (e.g. 'data,fsdp'; '': all)")
    if str(c.mesh).strip() == "auto":  # trjax.train.planner.resolve_auto picks the mesh
        return
    parallel.check_config(c, is_import_path(c.model), models.MODELS)
    if world_size is None:
        return
    size_name = "the data axis size" if len(parallel.mesh_sizes(c)) > 1 else "world_size"
    check_batch_split(c.global_batch_size, world_size, "config.global_batch_size", size_name)
    check_batch_split(c.eval_batch_size, world_size, "config.eval_batch_size", size_name)
    local, k = c.global_batch_size // world_size, c.grad_accumulation_steps
    if local % k:
        raise ValueError(f"config.grad_accumulation_steps={k!r} must divide the local batch "
                         f"{local} (global {c.global_batch_size} / world size {world_size})")
    if c.allreduce == "hierarchical" and c.allreduce_local_size and \
            world_size % c.allreduce_local_size:
        raise ValueError(f"config.allreduce_local_size={c.allreduce_local_size!r} must divide "
                         f"the world size {world_size} (devices per node; 0: per process)")


MODEL_ARGS = ("num_classes", "bn_mode", "axis_name", "bn_momentum", "dtype", "conv_lowering")
"""The keyword arguments the trainer gives a model from the config, the world
and the data (:func:`resolve_model`); ``config.model_kwargs`` may not name them."""
IMPORT_PATH_FORM = ("an import path 'package.module:Name' of a flax Module class (linen or "
                    "nnx) or a factory, importable from sys.path or the current directory")


def is_import_path(model: str) -> bool:
    """``config.model`` names a model by import path (it holds a ``:``)."""
    return isinstance(model, str) and ":" in model


def import_model(path: str):
    """``"package.module:Name"`` -> the object ``Name`` of that module (``Name``
    may be dotted: ``module:Outer.Inner``). The current directory is searched
    after ``sys.path`` (as ``python -m`` would), so a console command finds a
    module beside the run.

    Raises:
      ValueError: not of that form, the module does not import (naming the
        exception: ``ModuleNotFoundError``, an error inside the module), it
        has no such attribute (``AttributeError``, with close names), or the
        attribute is not callable.
    """
    import importlib
    import sys
    module_name, _, attr = path.partition(":")
    ok = all(p.isidentifier() for p in module_name.split(".")) and \
        all(p.isidentifier() for p in attr.split("."))
    if not ok:
        raise ValueError(f"config.model={path!r} is not of the form 'package.module:Name' "
                         f"({IMPORT_PATH_FORM}); built-in names: {sorted(models.MODELS)}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- any failure inside the user's module is theirs
        raise ValueError(f"config.model={path!r}: module {module_name!r} does not import: "
                         f"{type(e).__name__}: {e} (expected {IMPORT_PATH_FORM})") from e
    owner = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")],
                                              n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"config.model={path!r}: AttributeError: {owner!r} has no attribute "
                             f"{part!r}{hint} (expected {IMPORT_PATH_FORM})")
        obj = getattr(obj, part)
        owner = f"{owner}.{part}" if ":" in owner else f"{owner}:{part}"
    if not callable(obj):
        raise ValueError(f"config.model={path!r} is an object of type {type(obj).__name__!r}, "
                         f"not a Module class or a factory (expected {IMPORT_PATH_FORM})")
    return obj


def check_model(model: str, model_kwargs=None) -> None:
    """``config.model`` is a built-in name or an import path that imports
    (:func:`import_model`); ``model_kwargs`` is a mapping of keyword arguments
    that leaves :data:`MODEL_ARGS` to the trainer.

    Raises:
      ValueError: naming the value, the reason and the expected form.
    """
    if is_import_path(model):
        import_model(model)
    elif model not in models.MODELS:
        dotted = isinstance(model, str) and "." in model and \
            all(p.isidentifier() for p in model.split("."))
        hint = (f"; did you mean {model.rsplit('.', 1)[0] + ':' + model.rsplit('.', 1)[1]!r}?"
                if dotted else "")
        raise ValueError(f"config.model={model!r} is not one of {sorted(models.MODELS)} nor "
                         f"{IMPORT_PATH_FORM}{hint}")
    if model_kwargs is None:
        return
    if not hasattr(model_kwargs, "items"):
        raise ValueError(f"config.model_kwargs={model_kwargs!r} must be a dict of keyword "
                         "arguments (--config.model_kwargs=\"{'width': 32}\")")
    taken = sorted(set(model_kwargs.keys()) & set(MODEL_ARGS))
    if taken:
        raise ValueError(f"config.model_kwargs sets {taken}: the trainer passes "
                         f"{list(MODEL_ARGS)} from the config, the world and the data set "
                         "(set config.bn_mode, config.precision, config.mesh, ... instead)")


CLASS_COUNT_NAMES = ("num_classes", "n_classes", "num_labels", "num_outputs", "classes")
"""The names a published model's constructor takes its class count under, in the
order :func:`resolve_model` looks for them (``num_classes``: flax's examples,
torchvision; ``n_classes``, ``num_labels``: HF; ``num_outputs``; ``classes``: Keras)."""


def _class_count(named: set, params, num_classes: int, kwargs) -> dict:
    """``{name: num_classes}`` for the first of :data:`CLASS_COUNT_NAMES` the
    constructor takes (``num_classes`` when it takes ``**kwargs``); ``{}`` when it
    takes none (its head is fixed: :func:`trjax.models.wrap` checks the logits'
    width) or ``model_kwargs`` sets it itself."""
    if any(n in kwargs for n in CLASS_COUNT_NAMES):
        return {}
    for n in CLASS_COUNT_NAMES:
        if n in named:
            return {n: num_classes}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values()) or not params
    return {"num_classes": num_classes} if takes_any else {}


def resolve_model(config: ml_collections.ConfigDict, num_classes: int, **trainer_args):
    """Builds ``config.model``: a built-in name or an import path.

    A built-in name is :func:`trjax.models.create_model` with ``num_classes``,
    ``trainer_args`` and ``config.model_kwargs``. An import path's object
    (:func:`import_model`) is called with the class count under the first name of
    :data:`CLASS_COUNT_NAMES` it takes (none when it takes none, or when
    ``model_kwargs`` names one), those of ``trainer_args`` (e.g. ``bn_mode``, ``axis_name``, ``dtype``:
    :data:`MODEL_ARGS`) that it takes as named parameters, and
    ``config.model_kwargs``. An ``nnx.Module`` class becomes
    ``flax.nnx.bridge.to_linen(cls, ...)`` (built with ``rngs`` per key).

    Returns:
      The model: a flax linen Module, a ``ToLinen`` of an nnx class, or the
      ``nnx.Module`` instance a factory returned.

    Raises:
      ValueError: a bad ``config.model`` / ``model_kwargs`` (:func:`check_model`),
        the constructor refused the arguments, or it returned no flax Module.
    """
    import inspect
    import sys
    kwargs = config.get("model_kwargs") or {}
    check_model(config.model, kwargs)
    kwargs = kwargs.to_dict() if isinstance(kwargs, ml_collections.ConfigDict) else dict(kwargs)
    if not is_import_path(config.model):
        try:
            return models.create_model(config.model, num_classes=num_classes, **trainer_args,
                                       **kwargs)
        except TypeError as e:
            import dataclasses as dc
            fields = sorted(f.name for f in dc.fields(models.ResNet)
                            if f.name not in ("parent", "name") + MODEL_ARGS)
            raise ValueError(f"config.model_kwargs={kwargs!r} for {config.model!r}: {e}; the "
                             f"built-in ResNets take {fields}") from e
    target = import_model(config.model)
    nnx = sys.modules.get("flax.nnx")
    is_nnx = nnx is not None and isinstance(target, type) and issubclass(target, nnx.Module)
    try:  # an nnx class's metaclass hides __init__'s parameters behind (*args, **kwargs)
        params = inspect.signature(target.__init__ if is_nnx else target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing more
        params = {}
    named = {n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    args = {**_class_count(named, params, num_classes, kwargs),
            **{k: v for k, v in trainer_args.items() if k in named}, **kwargs}
    shown = f"{config.model}({', '.join(f'{k}=...' for k in args)})"
    try:
        model = nnx.bridge.to_linen(target, **args) if is_nnx else target(**args)
    except Exception as e:  # noqa: BLE001 -- the user's constructor: name what it was given
        raise ValueError(f"config.model={config.model!r}: {shown} failed: {type(e).__name__}: "
                         f"{e} (num_classes comes from the data set, the rest from "
                         "config.model_kwargs)") from e
    nnx = sys.modules.get("flax.nnx")  # the module may have imported it
    linen = sys.modules["flax.linen"]
    if not isinstance(model, linen.Module) and not (nnx is not None and
                                                    isinstance(model, nnx.Module)):
        raise ValueError(f"config.model={config.model!r}: {shown} returned a "
                         f"{type(model).__name__}, not a flax Module (a linen Module or an nnx "
                         "Module, or an nnx Module class: trjax builds it with rngs)")
    return model


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


def validate_steps(config: ml_collections.ConfigDict, train_examples: int, global_batch: int,
                   steps_per_epoch: int) -> None:
    """The checks that need the data set's size: the run has steps, and a
    compression starts before its last one.

    Raises:
      ValueError: naming the key, the numbers and the fix.
    """
    c = config
    if steps_per_epoch == 0:  # remainder="drop" and fewer examples than one global batch
        raise ValueError(f"config.train_remainder='drop' leaves no step: {train_examples} "
                         f"training examples < global batch {global_batch}; use "
                         "train_remainder='pad' or a global_batch_size of at most "
                         f"{train_examples}")
    last = steps_per_epoch * c.num_epochs
    if last > INT32_MAX:
        raise ValueError(f"config.num_epochs={c.num_epochs} makes {last} steps "
                         f"({steps_per_epoch} per epoch), past the int32 step counter "
                         f"({INT32_MAX}); lower num_epochs")
    if c.compression != "none" and c.compression_start_step >= last:
        raise ValueError(f"config.compression_start_step={c.compression_start_step} is past "
                         f"the run's last step ({last}): compression={c.compression!r} would "
                         "never be used; lower it or set compression='none'")


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports ``path`` and returns its ``get_config()``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file defines no ``get_config``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (e.g. configs/default.py)")
    spec = importlib.util.spec_from_file_location("trjax_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} defines no get_config()")
    return module.get_config()


def _keys(cfg, prefix=""):
    for k, v in cfg.items():
        yield prefix + k
        if isinstance(v, ml_collections.ConfigDict):
            yield from _keys(v, prefix + k + ".")


def check_overrides(config: ml_collections.ConfigDict, argv: list[str]) -> None:
    """Checks every ``--config.KEY=VALUE`` in ``argv`` against ``config``.

    Raises:
      ValueError: an unknown key (with the closest known keys), or a value
        that does not parse as the field's type (names both).
    """
    known = list(_keys(config))
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key, eq, value = arg[len("--config."):].partition("=")
        if key not in known and key.startswith("model_kwargs.") and "model_kwargs" in known:
            name = key[len("model_kwargs."):]
            raise ValueError(f"--config.{key}: config.model_kwargs has no key {name!r} to "
                             "override; give the whole dict: "
                             f"--config.model_kwargs=\"{{'{name}': {value or '...'}}}\"")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"--config.{key}: no such config field{hint} "
                             f"(fields: {', '.join(k for k in known if '.' not in k)})")
        if not eq:
            continue
        current = config
        for part in key.split("."):
            current = current[part]
        if isinstance(current, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--config.{key}={value!r}: expected a bool (True/False)")
            continue
        for kind, parse, word in ((int, int, "an int"), (float, float, "a number")):
            if isinstance(current, kind):
                try:
                    parse(value)
                except ValueError:
                    raise ValueError(f"--config.{key}={value!r}: expected {word} "
                                     f"(default {current!r})") from None
                break


def check_argv(argv: list[str]) -> None:
    """For scripts: finds ``--config PATH`` in ``argv`` and checks the
    overrides; on a bad one, exits with ``error: <message>`` (status 1)."""
    import sys
    path = next((a.split("=", 1)[1] if "=" in a else argv[i + 1]
                 for i, a in enumerate(argv) if a.split("=")[0] == "--config" and
                 ("=" in a or i + 1 < len(argv))), None)
    if path:
        try:
            check_overrides(load_config_file(path), argv)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"error: {e}")
