"""Trains a ResNet in data parallel from a config file (the ``trjax-train`` command).

  python scripts/train.py --config configs/default.py --workdir runs/default \
      [--config.global_batch_size=256 --config.bn_mode=sync ...]

``--config`` also takes a packaged config's name (``--config default``). This
wrapper runs :func:`trjax.train.main.run` from a clone without an install.

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax, configs

if __name__ == "__main__":
    from trjax.train.main import run
    run()
