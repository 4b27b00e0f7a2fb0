"""Trains a ResNet in data parallel from a config file.

  python scripts/train.py --config configs/default.py --workdir runs/default \
      [--config.global_batch_size=256 --config.bn_mode=sync ...]

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

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax, configs

config_flags.DEFINE_config_file("config", None, "Path to a config file (get_config()).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl and summary.json.")
flags.mark_flags_as_required(["config", "workdir"])


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
              f"{str(e).splitlines()[0][:300]}\ntrjax: a peer process has probably died; "
              f"exiting with code {stops.EXIT_PEER_LOST}. The distributed runtime names the lost "
              "process ('Task N heartbeat timeout') once its heartbeat times out "
              f"({d.heartbeat_timeout_s} s).", file=sys.stderr, flush=True)
        distributed.exit_peer_lost(stops.EXIT_PEER_LOST)
    if jax.process_index() == 0:
        print(f"val_top1={summary['val_top1']:.4f} val_top5={summary['val_top5']:.4f} "
              f"world_size={summary['world_size']} wall_s={summary['wall_s']:.1f} "
              f"-> {os.path.join(flags.FLAGS.workdir, 'summary.json')}")


if __name__ == "__main__":
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    app.run(main)
