"""The in-memory shapes of a data set: :class:`Split`, :class:`Dataset` and
their per-channel statistics (numpy only; every source module builds them)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Split(NamedTuple):
    """In-memory examples: ``images [N, H, W, C]`` (uint8, or float for a
    caller's own arrays) and ``labels [N] int32``."""
    images: np.ndarray
    labels: np.ndarray


class Dataset(NamedTuple):
    """A train and a validation split.

    Attributes:
      train, val: in-memory :class:`Split` arrays, or sources decoded on demand
        (:class:`trjax.data.imagefolder.ImageFolder`), which then give ``shape``.
      num_classes: labels are in ``[0, num_classes)``.
      name: the data set's name.
      shape: ``(S, S, 3)`` of an example from an on-demand source.
      mean, std: per channel, in the stored pixel units (uint8 0..255; 0..16
        for digits): the compiled step computes ``(x - mean) / std``. ``None``:
        the images are used as they are (a caller's float arrays).
    """
    train: Any
    val: Any
    num_classes: int
    name: str
    shape: tuple | None = None
    mean: tuple | None = None
    std: tuple | None = None

    @property
    def image_shape(self) -> tuple:
        return tuple(self.shape) if self.shape else tuple(self.train.images.shape[1:])

    @property
    def image_dtype(self) -> np.dtype:
        """The host dtype of a batch's images: uint8 for decoded sources."""
        return np.dtype(np.uint8) if self.shape else self.train.images.dtype


def channel_stats(images: np.ndarray) -> tuple[tuple, tuple]:
    """Exact per-channel mean and std of uint8 images, in uint8 units.

    Computed from per-channel histograms of the 256 pixel values (float64, no
    float copy of the images, no accumulated rounding).

    Args:
      images: ``[N, H, W, C] uint8``.

    Returns:
      ``(mean, std)``, each a tuple of ``C`` floats.

    Raises:
      ValueError: not uint8 / not 4-D, no images, or a constant channel (std 0).
    """
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"expected [N, H, W, C] uint8 images, got {images.shape} {images.dtype}")
    if images.shape[0] == 0:
        raise ValueError("cannot compute statistics of an empty image set")
    channels = images.shape[-1]
    flat = images.reshape(-1, channels)
    counts = np.zeros((channels, 256), np.int64)
    chunk = 1 << 22  # bincount widens its input to intp: bound the temporary
    for start in range(0, len(flat), chunk):
        part = flat[start:start + chunk]
        for c in range(channels):
            counts[c] += np.bincount(part[:, c], minlength=256)
    values = np.arange(256, dtype=np.float64)
    n = counts.sum(axis=1).astype(np.float64)
    mean = counts @ values / n
    std = np.sqrt((counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n)
    if np.any(std == 0):
        raise ValueError(f"channel(s) {np.flatnonzero(std == 0).tolist()} of the training images "
                         f"are constant: cannot standardise")
    return tuple(mean.tolist()), tuple(std.tolist())


def class_ids(labels, where: str, num_classes: int | None = None) -> np.ndarray:
    """``labels`` as ``[N] int32`` class ids, checked: integers (or integral
    floats), and with ``num_classes`` inside ``[0, num_classes)``.

    Args:
      labels: a 1-D sequence (a list, a numpy array, a column of an HF dataset).
      where: what they are, for the message (``"the val split of records"``).
      num_classes: the class count, or ``None``: only the type is checked.

    Raises:
      ValueError: not 1-D, a label that is not an integer (a string: map the
        class names to ids), or one outside ``[0, num_classes)``; naming the
        index and the value.
    """
    arr = np.asarray(labels)
    if arr.dtype.kind in "USO" and arr.ndim == 1:  # names or mixed objects: the first non-id
        raw = list(labels)
        i = next((i for i, v in enumerate(raw) if isinstance(v, (bool, np.bool_)) or
                  not isinstance(v, (int, np.integer))), None)
        if i is not None:
            raise ValueError(f"{where}: label {raw[i]!r} at index {i} is not an integer class "
                             "id; map class names to ids 0..K-1 (decode=, or an HF ClassLabel "
                             "feature)")
        arr = np.asarray([int(v) for v in raw], np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{where}: labels must be a 1-D sequence of class ids, got shape "
                         f"{arr.shape}")
    bad = None  # integers pass; integral floats pass; anything else (bools) is refused
    if arr.dtype.kind == "f":
        bad = np.mod(arr, 1) != 0
    elif arr.dtype.kind not in "iu":
        bad = np.ones(arr.shape, bool)
    if bad is not None and bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: label {arr[i].item()!r} at index {i} is not an integer "
                         "class id; map class names to ids 0..K-1 (decode=, or an HF "
                         "ClassLabel feature)")
    if num_classes is not None and arr.size:
        bad = (arr < 0) | (arr >= num_classes)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{where}: label {arr[i].item()!r} at index {i} is outside "
                             f"[0, {num_classes}) (num_classes); fix the data or num_classes")
    return arr.astype(np.int32)


def check_labels(data: "Dataset") -> None:
    """Every label of both splits of ``data`` is a class id in ``[0, num_classes)``
    (:func:`class_ids`), checked once before anything is traced: every source
    (arrays, ImageFolder, CIFAR/MNIST files, records, HF, ArrayRecord) reaches
    the trainer as a :class:`Dataset` whose splits hold their labels.

    Raises:
      ValueError: naming the split, the index and the value.
    """
    for split, part in (("train", data.train), ("val", data.val)):
        class_ids(part.labels, f"the {split} split of {data.name}", data.num_classes)
