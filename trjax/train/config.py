"""Config files and every check on a config, before anything is traced.

* :func:`load_config_file`, :func:`check_overrides` / :func:`check_argv`:
  ``ml_collections``' own messages for ``--config.KEY=VALUE`` do not suggest
  the key you meant; these do, and the scripts call them before flag parsing.
* :func:`validate`: choices, ranges and combinations of the config's values
  (and, given the world size, the batch splits); every message names the key,
  the value and the valid choices.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections

from trjax import compression, models, optim
from trjax.cpu import host, im2col
from trjax.data import input_pipeline
from trjax.batchnorm import BN_MODES
from trjax.exchange import ALLREDUCE_CHOICES
from trjax.plan import BUCKET_POLICIES, KERNEL_ORDERS
from trjax.precision import PRECISIONS
from trjax.world import check_batch_split

CHOICES = {
    "bn_mode": BN_MODES, "precision": tuple(PRECISIONS), "optimizer": optim.OPTIMIZERS,
    "model": tuple(models.MODELS), "dataset": input_pipeline.DATASETS,
    "train_remainder": input_pipeline.REMAINDERS, "allreduce": ALLREDUCE_CHOICES,
    "compression": tuple(compression.COMPRESSORS),
    "bucket_kernel_order": ("auto",) + KERNEL_ORDERS, "cpu_convolutions": host.CPU_CONVOLUTIONS,
    "conv_lowering": im2col.LOWERINGS,
}
"""Config keys with a fixed set of values."""
POSITIVE_INTS = ("num_epochs", "global_batch_size", "eval_batch_size", "metrics_lag",
                 "grad_accumulation_steps", "powersgd_rank", "preemption_check_every_steps",
                 "keep_checkpoints", "loss_scale_growth_interval", "image_size",
                 "distributed.num_processes", "distributed.heartbeat_timeout_s")
NON_NEGATIVE_INTS = ("compression_start_step", "allreduce_local_size", "checkpoint_every_steps",
                     "halt_after_steps", "log_every_steps", "max_consecutive_overflows", "seed",
                     "warmup_epochs", "prefetch")
INT32_MAX = 2 ** 31 - 1
"""The upper bound of every int key: seeds, step counts and intervals meet the
train state's int32 counters on the device (a larger value overflowed there,
or failed with a bare ``OverflowError`` when placed)."""
INF = float("inf")
FLOAT_RANGES = {  # key: (low, low included, high, high included); NaN is out of every range
    "momentum": (0.0, True, 1.0, False), "bn_momentum": (0.0, True, 1.0, False),
    "weight_decay": (0.0, True, INF, False), "trust_coefficient": (0.0, False, INF, False),
    "step_timeout_s": (0.0, True, INF, False),  # 0: no watchdog
    "learning_rate": (0.0, False, INF, False), "topk_ratio": (0.0, False, 1.0, True),
    "compression_min_fraction": (0.0, True, 1.0, True),
}
"""Numeric config keys and their valid ranges; anything else is an error naming the key."""
_RANGE_HINTS = {
    "step_timeout_s": " (seconds; 0 turns the watchdog off)",
}


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
      world_size: when known, also checks that the global, eval and
        micro-batch splits divide (local batch / ``grad_accumulation_steps``)
        and that ``allreduce_local_size`` divides the world.

    Raises:
      ValueError: naming the key, its value and the valid choices or range.
    """
    c = config
    for key, valid in CHOICES.items():
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
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (
            low <= v if low_in else low < v) and (v <= high if high_in else v < high)
        if not ok:
            raise ValueError(f"config.{key}={v!r} must be in {'[' if low_in else '('}{low:g}, "
                             f"{high:g}{']' if high_in else ')'}{_RANGE_HINTS.get(key, '')}")
    if c.data_dir and c.dataset == "digits":
        raise ValueError(f"config.data_dir={c.data_dir!r} is set but dataset='digits' is built "
                         "in and reads no folder; choose the dataset that folder holds "
                         f"(one of {list(input_pipeline.DATASETS)}) or leave data_dir empty")
    from trjax.train.loop_io import parse_profile_steps
    parse_profile_steps(c.profile_steps)
    if c.shard_optimizer_state and (c.optimizer != "sgd" or c.compression != "none"
                                    or c.allreduce != "xla"):
        raise ValueError("config.shard_optimizer_state=True (ZeRO-1) needs optimizer='sgd', "
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
    if world_size is None:
        return
    check_batch_split(c.global_batch_size, world_size, "config.global_batch_size")
    check_batch_split(c.eval_batch_size, world_size, "config.eval_batch_size")
    local, k = c.global_batch_size // world_size, c.grad_accumulation_steps
    if local % k:
        raise ValueError(f"config.grad_accumulation_steps={k!r} must divide the local batch "
                         f"{local} (global {c.global_batch_size} / world size {world_size})")
    if c.allreduce == "hierarchical" and c.allreduce_local_size and \
            world_size % c.allreduce_local_size:
        raise ValueError(f"config.allreduce_local_size={c.allreduce_local_size!r} must divide "
                         f"the world size {world_size} (devices per node; 0: per process)")


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
