"""Trains a ResNet in data parallel from a config file (the ``trjax-train`` command).

  python scripts/train.py --config configs/default.py --workdir runs/default \
      [--config.global_batch_size=256 --config.bn_mode=sync ...]

``--config`` also takes a packaged config's name (``--config default``). This
wrapper runs :func:`trjax.train.main.run` from a clone without an install.

Behaviour and exit codes: :mod:`trjax.train.main`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax, configs

if __name__ == "__main__":
    from trjax.train.main import run
    run()
