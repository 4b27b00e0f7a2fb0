"""The configs that ship with the package; ``trjax-train --config NAME`` takes one by name.

* ``default`` -- every key with its default: ResNet-20 on scikit-learn's digits;
* ``cifar10_resnet20``, ``imagenet_resnet50`` -- start from it (the paper set-ups).

Each module's ``get_config()`` returns an ``ml_collections.ConfigDict``. The
repository's ``configs/*.py`` re-export these (``configs/default.py`` is
``from trjax.configs.default import get_config``), so a path to either works.
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The packaged configs' names (``["cifar10_resnet20", "default", ...]``)."""
    return sorted(f[:-3] for f in os.listdir(DIR) if f.endswith(".py") and not f.startswith("_"))


def config_path(spec: str) -> str:
    """A ``--config`` value -> the config file to load.

    An existing file is taken as it is; otherwise a packaged config's name
    (``"default"``, or ``"default.py"``) gives that file of this package. A
    ``:ARG`` tail (``ml_collections``' argument to ``get_config``) is kept.

    Raises:
      FileNotFoundError: neither; names the packaged configs.
    """
    if os.path.isfile(spec):
        return spec
    head, colon, tail = spec.partition(":")
    if colon and os.path.isfile(head):
        return spec
    name = head[:-3] if head.endswith(".py") else head
    if name in names():
        return os.path.join(DIR, name + ".py") + colon + tail
    raise FileNotFoundError(f"--config {spec!r}: no such file and no packaged config of that "
                            f"name; give a path to a file that defines get_config(), or one of "
                            f"{names()}")
