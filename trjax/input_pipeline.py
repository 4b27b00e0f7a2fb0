"""Input: the embedded digits data set, global batches with masks, the host->device boundary.

Batches are host numpy dicts ``{"image": [G, H, W, C] float32, "label": [G]
int32, "mask": [G] float32}`` with G the global batch size. A data set whose
size is not a multiple of G gets a last batch padded to G with mask-0 rows
(``remainder="pad"``: every example counts exactly once, the compiled shape
never changes) or loses its last partial batch (``remainder="drop"``, train
only). Evaluation always pads: every validation example is counted.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import jax
import numpy as np

REMAINDERS = ("pad", "drop")


class Split(NamedTuple):
    images: np.ndarray  # [N, H, W, C] float32
    labels: np.ndarray  # [N] int32


class Dataset(NamedTuple):
    """A train and a validation split: in-memory :class:`Split` arrays, or
    sources decoded on demand (:class:`trjax.datasets.ImageFolder`), which
    then give ``shape``."""
    train: Any
    val: Any
    num_classes: int
    name: str
    shape: tuple | None = None

    @property
    def image_shape(self) -> tuple:
        return tuple(self.shape) if self.shape else tuple(self.train.images.shape[1:])


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes).

    Shipped inside scikit-learn: no download. The held-out split is fixed
    (stratified, ``random_state=seed``). Pixels 0..16 are scaled to [0, 1] and
    standardised with the training split's mean and std.

    Returns:
      A :class:`Dataset` with images ``[N, 8, 8, 1] float32``.
    """
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split
    d = _load()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    y = d.target.astype(np.int32)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=val_fraction, random_state=seed,
                                          stratify=y)
    mean, std = float(xtr.mean()), float(xtr.std())
    norm = lambda a: ((a - mean) / std).astype(np.float32)
    return Dataset(Split(norm(xtr), ytr), Split(norm(xva), yva), 10, "digits")


DATASETS = ("digits", "cifar10", "cifar100", "mnist", "fashion_mnist", "imagefolder")


def load_dataset(name: str, data_dir: str = "", image_size: int = 224) -> Dataset:
    """Loads a data set by name (one of ``DATASETS``).

    ``digits`` ships inside scikit-learn; the others read ``data_dir``
    (:mod:`trjax.datasets`: CIFAR python pickles, MNIST IDX files, an
    ImageFolder tree ``data_dir/{train,val}/class/*.jpg``, decoded on demand
    at ``image_size``).

    Raises:
      ValueError: an unknown name, or ``data_dir`` missing for a data set on
        disk; the loaders' own errors for missing or malformed files.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset {name!r} is unknown; choose one of {list(DATASETS)}")
    if name == "digits":
        return load_digits()
    if not data_dir:
        raise ValueError(f"dataset {name!r} reads files: set --config.data_dir=FOLDER "
                         "(for a tiny CIFAR-10 in the real format: scripts/make_tiny_cifar.py DIR)")
    from trjax import datasets
    if name == "imagefolder":
        train = datasets.ImageFolder(data_dir, "train")
        val = datasets.ImageFolder(data_dir, "val", classes=train.classes)
        return Dataset(train, val, train.num_classes, name, (image_size, image_size, 3))
    return datasets.DATASET_LOADERS[name](data_dir)


def steps_per_epoch(num_examples: int, global_batch: int, remainder: str) -> int:
    """Batches per pass: ceil for ``pad``, floor for ``drop``."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder {remainder!r} is not one of {REMAINDERS}")
    full, rest = divmod(num_examples, global_batch)
    return full + (1 if rest and remainder == "pad" else 0)


def iterate_batches(split, global_batch: int, *, shuffle: bool, seed: int = 0,
                    epoch: int = 0, remainder: str = "pad", rows: tuple | None = None,
                    start: int = 0, augment: bool = False,
                    image_shape: tuple | None = None) -> Iterator[dict]:
    """Global batches of one epoch, padded (mask 0) or dropped at the end.

    The order is a permutation drawn from ``np.random.default_rng((seed,
    epoch))`` when ``shuffle``: deterministic per seed and epoch, and the same
    whatever the world size.

    Args:
      rows: ``(row_start, row_stop)``: yield only these rows of every global
        batch (the rows this process feeds, :meth:`trjax.world.World.process_rows`);
        only they are gathered. Default: all rows.
      start: skip the first ``start`` batches (resuming mid-epoch).
      augment: training augmentation. In-memory splits: random crop with 4
        pixels of zero padding + horizontal flip, each row drawn from
        ``np.random.default_rng((seed, epoch, batch, row))`` -- the same
        whatever the world size or process count. On-demand sources
        (ImageFolder): RandomResizedCrop + flip with
        ``default_rng((seed, epoch, batch, first_row))``; without ``augment``
        they resize and center-crop.
      image_shape: ``(S, S, 3)`` for on-demand sources.
    """
    n = len(split.labels)
    lo, hi = rows if rows is not None else (0, global_batch)
    order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
    for b in range(start, steps_per_epoch(n, global_batch, remainder)):
        idx = order[b * global_batch:(b + 1) * global_batch][lo:hi]
        real = len(idx)
        images = _gather(split, idx, augment, (seed, epoch, b, lo), image_shape)
        labels = split.labels[idx]
        mask = np.ones(hi - lo, np.float32)
        if real < hi - lo:
            pad = hi - lo - real
            images = np.concatenate([images, np.zeros((pad,) + images.shape[1:], images.dtype)])
            labels = np.concatenate([labels, np.zeros(pad, split.labels.dtype)])
            mask[real:] = 0.0
        yield {"image": images, "label": labels, "mask": mask}


def _gather(split, idx, augment: bool, key: tuple, image_shape) -> np.ndarray:
    """Images ``idx`` of a split, augmented for training when asked."""
    if isinstance(split, Split):
        images = split.images[idx]
        if augment and len(idx):
            from trjax.datasets import augment_batch
            images = np.stack([augment_batch(images[i:i + 1],
                                             np.random.default_rng(key + (i,)))[0]
                               for i in range(len(idx))])
        return images
    size = image_shape[0] if image_shape else 224
    if not len(idx):
        return np.zeros((0, size, size, 3), np.float32)
    return split.load(idx, train=augment, rng=np.random.default_rng(key), image_size=size)


def to_device(batch: dict, sharding, num_classes: int, dtype=np.float32) -> dict:
    """The one host->device boundary: checks, casts and shards a host batch.

    ``batch`` holds this process's rows of the global batch (all of them in a
    single-process run); the result is the global batch, sharded.

    Labels must be integers in ``[0, num_classes)`` (checked on real rows);
    they become int32. Images are cast explicitly to ``dtype`` (float64 and
    integer inputs are converted by value, never reinterpreted); non-finite
    pixels in real rows are an error. The mask becomes float32.

    Raises:
      ValueError: a label out of range or not integral (names the value and
        its position), non-finite pixels (names the first position), or
        mismatched leading dimensions.
    """
    images, labels = np.asarray(batch["image"]), np.asarray(batch["label"])
    mask = np.asarray(batch.get("mask", np.ones(len(labels), np.float32)))
    if not (len(images) == len(labels) == len(mask)):
        raise ValueError(f"batch fields disagree on the batch size: image {images.shape}, "
                         f"label {labels.shape}, mask {mask.shape}")
    real = mask > 0
    if not np.issubdtype(labels.dtype, np.integer):
        if not np.all(np.equal(np.mod(labels[real], 1), 0)):
            pos = int(np.flatnonzero(real & (np.mod(labels, 1) != 0))[0])
            raise ValueError(f"label {labels[pos].item()!r} at position {pos} is not an integer class id")
    bad = real & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise ValueError(f"label {labels[pos].item()!r} at position {pos} is outside [0, {num_classes}); "
                         f"fix the data or set num_classes")
    if np.issubdtype(images.dtype, np.floating):
        nonfinite = real.reshape((-1,) + (1,) * (images.ndim - 1)) & ~np.isfinite(images)
        if nonfinite.any():
            pos = tuple(int(i) for i in np.argwhere(nonfinite)[0])
            raise ValueError(f"image value {images[pos].item()!r} at position {pos} is not finite")
    host = {"image": images.astype(dtype), "label": labels.astype(np.int32),
            "mask": mask.astype(np.float32)}
    # Rows of this process only (all rows with one process): each process
    # hands over its part of the global batch.
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host.items()}
