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


def config_keys_help(path: str) -> str:
    """Every key of the config file at ``path`` with its default and its comment,
    grouped under the file's section comments: what ``--help`` adds to the flags.

    Read from the file's own ``c.KEY = VALUE  # comment`` lines (the packaged
    configs keep one line of meaning per key there), so it never disagrees with
    the defaults a run gets. Keys without a comment are listed with their default.
    """
    import re
    line_re = re.compile(r"^\s*c\.([\w.]+)\s*=\s*(.+?)\s*(?:#\s?(.*))?$")
    more_re = re.compile(r"^\s*#\s{4,}(.*)$")  # a comment continued under the previous key
    head_re = re.compile(r"^\s*#\s?(\S.*)$")
    out, last = [], None
    with open(path) as f:
        for raw in f:
            if (m := line_re.match(raw)) is not None:
                key, value, note = m.group(1), m.group(2), (m.group(3) or "").strip()
                if value.startswith("ml_collections.ConfigDict("):
                    value = "{...}"
                out.append([f"  --config.{key}={value}", note])
                last = out[-1]
            elif (m := more_re.match(raw)) is not None and last is not None:
                last[1] = (last[1] + " " + m.group(1).strip()).strip()
            elif (m := head_re.match(raw)) is not None and raw.startswith("    #"):
                out.append([f"{m.group(1)}:", None])
                last = None
    width = max([len(k) for k, n in out if n is not None] + [0])
    lines = [f"Config keys of {path} (--config.KEY=VALUE; defaults as written there):"]
    for key, note in out:
        lines.append(key if note is None else f"{key:<{width}}  {note}".rstrip())
    from trjax.configs import config_path
    base = config_path("default")
    with open(path) as f:
        derived = "default.get_config()" in f.read()
    if derived and os.path.realpath(path) != os.path.realpath(base):
        lines += ["", "Every other key, as the default config sets it:",
                  config_keys_help(base)]
    return "\n".join(lines)


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


def _config_path_of(argv: list[str]) -> str:
    """The config file ``argv`` names (already resolved), else the packaged default."""
    from trjax.configs import config_path
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a[len("--config="):]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return config_path("default")


def run(argv: list[str] | None = None) -> None:
    """The command (``[project.scripts] trjax-train``): resolves ``--config``
    (``--help`` first lists every key of it, :func:`config_keys_help`),
    checks every ``--config.KEY=VALUE`` before flag parsing
    (:func:`trjax.train.config.check_argv`), then runs :func:`main` under absl."""
    sys.argv[:] = resolve_config_argv(sys.argv if argv is None else argv)  # config_flags reads it
    if any(a in ("--help", "-h", "--helpfull", "--helpshort", "-?") for a in sys.argv[1:]):
        print(config_keys_help(_config_path_of(sys.argv)) + "\n", flush=True)
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    main_module = sys.modules.get("__main__")
    if main_module is not None and not main_module.__doc__:  # the console script's: --help text
        main_module.__doc__ = __doc__
    define_flags()
    app.run(main, argv=sys.argv)
