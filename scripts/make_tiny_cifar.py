"""Writes a tiny CIFAR-10-format data set (python pickle batches) for trying the loaders.

  python scripts/make_tiny_cifar.py runs/tiny_cifar [--per_batch 300]

The images are scikit-learn's real 8x8 digits, upscaled 4x to 32x32 and put
in three colour channels, with their labels (10 classes): a learnable data set
in exactly the on-disk format of the official ``cifar-10-python.tar.gz``
(``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``: dicts with
``b"data"`` uint8 ``[N, 3072]`` channel-major and ``b"labels"``).
"""

import argparse
import os
import pickle

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output folder (cifar-10-batches-py is created inside)")
    ap.add_argument("--per_batch", type=int, default=300, help="examples per train batch file")
    args = ap.parse_args()
    from sklearn.datasets import load_digits
    d = load_digits()
    img = np.kron(d.images / 16.0, np.ones((4, 4)))                 # [N, 32, 32]
    rgb = np.stack([img, 0.8 * img, 0.6 * img], axis=1)             # [N, 3, 32, 32]
    data = np.clip(rgb * 255, 0, 255).astype(np.uint8).reshape(len(img), -1)
    labels = d.target.astype(int)
    order = np.random.default_rng(0).permutation(len(labels))
    data, labels = data[order], labels[order]
    folder = os.path.join(args.out, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    n = args.per_batch
    files = [(f"data_batch_{i + 1}", slice(i * n, (i + 1) * n)) for i in range(5)]
    files.append(("test_batch", slice(5 * n, len(labels))))
    for name, sl in files:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"data": data[sl],
                         b"labels": labels[sl].tolist()}, f, protocol=2)
    print(f"wrote {folder}: {5 * n} train, {len(labels[5 * n:])} test examples")


if __name__ == "__main__":
    main()
