"""Writes a tiny CIFAR-10-format data set (python pickle batches) for trying the loaders.

  trjax-tiny-cifar runs/tiny_cifar [--per_batch 300]
  python -m trjax.tools.tiny_cifar runs/tiny_cifar     (from a clone: scripts/make_tiny_cifar.py)

The images are scikit-learn's real 8x8 digits, upscaled 4x to 32x32 and put
in three colour channels, with their labels (10 classes): a learnable data set
in exactly the on-disk format of the official ``cifar-10-python.tar.gz``
(``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``: dicts with
``b"data"`` uint8 ``[N, 3072]`` channel-major and ``b"labels"``). Train on it
with ``trjax-train --config cifar10_resnet20 --config.data_dir=runs/tiny_cifar ...``.
"""

from __future__ import annotations

import argparse
import os
import pickle

import numpy as np


def make_tiny_cifar(out: str, per_batch: int = 300) -> tuple[str, int, int]:
    """Writes ``out/cifar-10-batches-py`` (created, files overwritten).

    Args:
      out: the folder to create ``cifar-10-batches-py`` in.
      per_batch: examples per ``data_batch_*`` file (five of them); the
        remaining digits of the 1,797 go to ``test_batch``.

    Returns:
      ``(folder, train examples, test examples)``.

    Raises:
      ValueError: ``per_batch`` not in ``1 .. 359`` (``test_batch`` would be empty).
    """
    from sklearn.datasets import load_digits
    d = load_digits()
    if not 1 <= per_batch <= (len(d.target) - 1) // 5:
        raise ValueError(f"--per_batch={per_batch}: must be 1..{(len(d.target) - 1) // 5} "
                         f"(5 train files from {len(d.target)} digits, the rest the test batch)")
    img = np.kron(d.images / 16.0, np.ones((4, 4)))                 # [N, 32, 32]
    rgb = np.stack([img, 0.8 * img, 0.6 * img], axis=1)             # [N, 3, 32, 32]
    data = np.clip(rgb * 255, 0, 255).astype(np.uint8).reshape(len(img), -1)
    labels = d.target.astype(int)
    order = np.random.default_rng(0).permutation(len(labels))
    data, labels = data[order], labels[order]
    folder = os.path.join(out, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    n = per_batch
    files = [(f"data_batch_{i + 1}", slice(i * n, (i + 1) * n)) for i in range(5)]
    files.append(("test_batch", slice(5 * n, len(labels))))
    for name, sl in files:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"data": data[sl],
                         b"labels": labels[sl].tolist()}, f, protocol=2)
    return folder, 5 * n, len(labels) - 5 * n


def main(argv: list[str] | None = None) -> int:
    """The command (``[project.scripts] trjax-tiny-cifar``); returns 0, exits
    with ``error: ...`` on a bad ``--per_batch``."""
    ap = argparse.ArgumentParser(prog="trjax-tiny-cifar", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output folder (cifar-10-batches-py is created inside)")
    ap.add_argument("--per_batch", type=int, default=300, help="examples per train batch file")
    args = ap.parse_args(argv)
    try:
        folder, train, test = make_tiny_cifar(args.out, args.per_batch)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {folder}: {train} train, {test} test examples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
