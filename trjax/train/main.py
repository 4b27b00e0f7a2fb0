"""Trains a ResNet in data parallel from a config: the main job's command.

  trjax-train --config default --workdir runs/default \\
      [--config.global_batch_size=256 --config.bn_mode=sync ...]

The same as ``python -m trjax.train ...`` and, from a clone, ``python
scripts/train.py ...``. ``--config`` is a packaged config's name
(``default``, ``cifar10_resnet20``, ``imagenet_resnet50``: ``trjax.configs``)
or the path of a file that defines ``get_config()``; ``--config.KEY=VALUE``
overrides a key (``--config.model=package.module:Name`` trains your own model).

On a host without an accelerator, ``config.cpu_devices`` CPU devices are
simulated so the data-parallel path always runs. Under ``srun``/``mpirun`` (or
with ``JAX_COORDINATOR_ADDRESS``) the processes start as one run
(``trjax.train.distributed.detect_launch``); a workdir another live run writes into
is refused.

Exit codes (``trjax.train.stops``): 0 done; 1 bad input, an incompatible checkpoint or
config, a busy workdir; 3 a peer process died or hangs; 4 non-finite steps
(``halt_on_nonfinite``, ``max_consecutive_overflows``); 143 stopped by SIGTERM or
SIGUSR1 after saving a checkpoint (start again to resume); 130 the same after Ctrl-C.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging


def define_flags(flag_values=flags.FLAGS) -> None:
    """``--config`` (a config file, overridable key by key) and ``--workdir``,
    once; listed by ``--help`` whichever file runs as ``__main__``."""
    if "config" in flag_values:
        return
    from ml_collections import config_flags
    config_flags.DEFINE_config_file("config", None, "A packaged config's name (default, "
                                    "cifar10_resnet20, imagenet_resnet50) or the path of a "
                                    "file that defines get_config().", flag_values=flag_values,
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and summary.json.",
                        flag_values=flag_values)
    flags.mark_flags_as_required(["config", "workdir"], flag_values=flag_values)
    for name in ("config", "workdir"):  # --help lists the main module's flags
        flag_values.register_flag_by_module(sys.argv[0], flag_values[name])


def resolve_config_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--config NAME`` / ``--config=NAME`` turned
    into a file path (:func:`trjax.configs.config_path`); exits with ``error:
    <message>`` (status 1) when it is neither a file nor a packaged name."""
    from trjax.configs import config_path
    out = list(argv)
    for i, a in enumerate(out):
        try:
            if a.startswith("--config="):
                out[i] = "--config=" + config_path(a[len("--config="):])
            elif a == "--config" and i + 1 < len(out):
                out[i + 1] = config_path(out[i + 1])
        except FileNotFoundError as e:
            sys.exit(f"error: {e}")
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is not news
    import jax
    config = flags.FLAGS.config
    # Only the CPU backend reads these; they must be set before any device is used.
    from trjax.cpu import host
    try:
        host.configure_cpu(config.cpu_devices, config.cpu_convolutions, config.cpu_reuse_memory)
    except ValueError as e:
        sys.exit(f"error: {e}")
    from trjax.train import distributed
    d = config.distributed
    try:  # srun / mpirun / JAX_COORDINATOR_ADDRESS start one run of N processes
        distributed.initialize(d.coordinator, d.num_processes, d.process_id, auto=d.auto,
                               heartbeat_timeout_s=d.heartbeat_timeout_s)
    except ValueError as e:
        sys.exit(f"error: {e}")
    from trjax.train import stops
    from trjax.train import workdir as workdir_lib
    from trjax.train import train_and_evaluate
    try:
        _, summary = train_and_evaluate(config, flags.FLAGS.workdir)
    except (ValueError, FileNotFoundError, workdir_lib.WorkdirError) as e:
        sys.exit(f"error: {e}")  # bad input or a busy workdir: the message says what to do
    except stops.Preempted as e:  # checkpoint saved, logs flushed: restart to resume
        print(f"trjax: {e}", file=sys.stderr, flush=True)
        sys.exit(stops.EXIT_INTERRUPTED if e.signal_name == "SIGINT" else stops.EXIT_PREEMPTED)
    except FloatingPointError as e:  # halt_on_nonfinite / max_consecutive_overflows
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(stops.EXIT_NONFINITE)
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        print(f"trjax: a collective failed on process {jax.process_index()}: "
              f"{str(e).splitlines()[0][:300]}", file=sys.stderr, flush=True)
        distributed.exit_peer_lost(stops.EXIT_PEER_LOST)  # waits for the heartbeats, names the lost process
    if jax.process_index() == 0:
        print(f"val_top1={summary['val_top1']:.4f} val_top5={summary['val_top5']:.4f} "
              f"world_size={summary['world_size']} wall_s={summary['wall_s']:.1f} "
              f"-> {os.path.join(flags.FLAGS.workdir, 'summary.json')}")


def run(argv: list[str] | None = None) -> None:
    """The command (``[project.scripts] trjax-train``): resolves ``--config``,
    checks every ``--config.KEY=VALUE`` before flag parsing
    (:func:`trjax.train.config.check_argv`), then runs :func:`main` under absl."""
    sys.argv[:] = resolve_config_argv(sys.argv if argv is None else argv)  # config_flags reads it
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    main_module = sys.modules.get("__main__")
    if main_module is not None and not main_module.__doc__:  # the console script's: --help text
        main_module.__doc__ = __doc__
    define_flags()
    app.run(main, argv=sys.argv)
