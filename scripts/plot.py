"""Draws a run's loss, top-1 and learning-rate curves to PNG: ``trjax-plot`` from a clone.

  python scripts/plot.py runs/default [--out runs/default/curves.png]

The same as the installed ``trjax-plot`` and ``python -m trjax.tools.plot``
(:mod:`trjax.tools.plot`, where the code and its documentation live).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trjax.tools.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
