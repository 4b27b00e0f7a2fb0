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
