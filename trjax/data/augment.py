"""Training augmentation and evaluation crops, pure functions of a per-example stream.

Every random draw for an example comes from its own generator,
:func:`example_rng` ``(seed, epoch, index)``, with ``index`` the example's
position in its split. So a batch is the same bit for bit whichever process,
device or worker prepares which rows, and a run resumed mid-epoch draws what
an uninterrupted one would.

* Small in-memory images (CIFAR, MNIST, digits): :func:`crop_flip`, a random
  crop of the image padded by 4 zero pixels on every side, then a horizontal
  flip with probability 1/2 (He et al. 2016, section 4.2; torchvision's
  ``RandomCrop(padding=4)`` + ``RandomHorizontalFlip`` on the stored pixels).
* Decoded images (ImageFolder): :func:`train_crop`, RandomResizedCrop
  (Szegedy et al. 2015, torchvision's definition) to ``S x S`` bilinear, then a
  flip; :func:`eval_crop`, resize the shorter side to ``round(S * 256 / 224)``
  and take the central ``S x S``.

All of them keep the input dtype (uint8 for the data sets trjax loads). This
module imports no jax: the pipeline's worker processes use it.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from PIL import Image


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """``np.random.default_rng((seed, epoch, index))``: the stream of one example in one epoch."""
    return np.random.default_rng((int(seed), int(epoch), int(index)))


def transform_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """``np.random.default_rng((seed, epoch, index, 1))``: the stream a user
    ``transform`` gets for one example in one epoch (apart from
    :func:`example_rng`'s, which the built-in crops and flips draw from)."""
    return np.random.default_rng((int(seed), int(epoch), int(index), 1))


def apply_transform(transform, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``transform(image, rng)``, checked: the same shape and dtype must come back.

    Args:
      transform: ``(uint8 image [H, W, C], numpy Generator) -> uint8 image [H, W, C]``.
      image: one example ``[H, W, C]``.
      rng: its stream (:func:`transform_rng`).

    Raises:
      ValueError: another shape or dtype came back (the message names both
        and the fix).
    """
    out = np.asarray(transform(image, rng))
    if out.shape != image.shape or out.dtype != image.dtype:
        raise ValueError(f"transform returned an image of shape {out.shape} dtype {out.dtype} "
                         f"for one of shape {image.shape} dtype {image.dtype}; a transform "
                         "must return the same shape and dtype (crop or resize back to the "
                         "input size, and cast, e.g. np.clip(x, 0, 255).astype(np.uint8))")
    return out


def crop_flip(images: np.ndarray, rngs: Sequence[np.random.Generator], pad: int = 4,
              flip: bool = True) -> np.ndarray:
    """Random crop with zero padding, then random horizontal flip, one stream per image.

    Image ``i`` is padded by ``pad`` zeros on every side and cropped back to
    ``H x W`` at an offset ``(dy, dx) = rngs[i].integers(0, 2 * pad + 1, 2)``;
    with ``flip`` it is then mirrored left-right when ``rngs[i].random() < 0.5``.

    Args:
      images: ``[B, H, W, C]``, any dtype.
      rngs: ``B`` generators, e.g. ``example_rng(seed, epoch, index)``.
      pad: padding in pixels, ``>= 0``.
      flip: whether to flip.

    Returns:
      A new ``[B, H, W, C]`` array of the input's dtype.

    Raises:
      ValueError: images not 4-D, ``len(rngs) != B`` or ``pad < 0``.
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"images must be [B, H, W, C], got shape {images.shape}")
    if len(rngs) != len(images) or pad < 0:
        raise ValueError(f"need one rng per image and pad >= 0, got {len(rngs)} rngs for "
                         f"{len(images)} images, pad={pad}")
    b, h, w, _ = images.shape
    offsets = np.zeros((b, 2), np.int64)
    flips = np.zeros(b, bool)
    for i, rng in enumerate(rngs):
        offsets[i] = rng.integers(0, 2 * pad + 1, size=2)
        flips[i] = flip and rng.random() < 0.5
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows = offsets[:, :1] + np.arange(h)[None, :]                                       # [B, H]
    cols = offsets[:, 1:] + np.where(flips[:, None], np.arange(w)[::-1], np.arange(w))  # [B, W]
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def random_resized_crop_params(height: int, width: int, rng: np.random.Generator,
                               scale: tuple = (0.08, 1.0),
                               ratio: tuple = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """The crop box of RandomResizedCrop (Szegedy et al. 2015, torchvision's definition).

    Up to 10 tries: an area fraction uniform in ``scale`` and an aspect ratio
    (w/h) log-uniform in ``ratio``; the first box that fits is placed uniformly.
    If none fits, the central crop clamped to the ratio range (the whole image
    when its own ratio is inside it).

    Returns:
      ``(top, left, h, w)`` in pixels, inside the image.
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_crop(img: Image.Image, rng: np.random.Generator, size: int) -> np.ndarray:
    """RandomResizedCrop to ``size x size`` (bilinear), then a flip when ``rng.random() < 0.5``.

    Draws, in order: the crop box (:func:`random_resized_crop_params`), the flip.

    Args:
      img: an ``RGB`` image.

    Returns:
      ``[size, size, 3] uint8``.
    """
    width, height = img.size
    top, left, h, w = random_resized_crop_params(height, width, rng)
    out = np.asarray(img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h)))
    return out[:, ::-1] if rng.random() < 0.5 else out


def eval_crop(img: Image.Image, size: int) -> np.ndarray:
    """Resize the shorter side to ``round(size * 256 / 224)`` (bilinear), central ``size x size``.

    Returns:
      ``[size, size, 3] uint8``.
    """
    width, height = img.size
    short = int(round(size * 256 / 224))
    if width <= height:
        new_w, new_h = short, int(short * height / width)
    else:
        new_w, new_h = int(short * width / height), short
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    # resize and crop in one resampling: the box maps the crop back to the source
    sx, sy = width / new_w, height / new_h
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    return np.asarray(img.resize((size, size), Image.BILINEAR, box=box))
