"""Writes a tiny CIFAR-10-format data set: ``trjax-tiny-cifar`` from a clone.

  python scripts/make_tiny_cifar.py runs/tiny_cifar [--per_batch 300]

The same as the installed ``trjax-tiny-cifar`` and ``python -m
trjax.tools.tiny_cifar`` (:mod:`trjax.tools.tiny_cifar`, where the code and its
documentation live).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trjax.tools.tiny_cifar import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
