"""ImageFolder: ``root/split/class_name/*.jpg|png|...`` decoded on demand to RGB uint8.

What people's real folders contain must not stop a run hours in:

* Listed: files whose name ends in an image extension (``IMAGE_EXTENSIONS``,
  any case) and does not start with ``.``; so macOS metadata (``._x.jpg``,
  ``.DS_Store``), ``Thumbs.db``, ``desktop.ini`` and text files are never
  examples. Hidden folders are not classes.
* Every Pillow mode becomes RGB on the 8-bit scale (:func:`to_rgb`): 16-bit
  (``I;16*``) and 32-bit integer (``I``) pixels are divided by 257 (65535 ->
  255), so a 16-bit grayscale PNG equals its 8-bit copy; float (``F``) pixels
  are read on [0, 1]; palette, grayscale with or without alpha, RGBA, CMYK and
  1-bit images go through Pillow's own conversion (alpha dropped). The EXIF
  orientation is applied.
* A file that cannot be decoded (truncated, corrupt, not an image) raises
  :class:`BadImage` naming it; :meth:`ImageFolder.verified` decodes every file
  once before training, and ``skip_bad_images`` turns bad files into skipped,
  counted examples instead of errors.
* A class folder without images, or no class folders, is an error naming the
  folder.

This module imports no jax: the pipeline's worker processes use it.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # on [0, 1]; the dataset carries them x255
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
                    ".ppm", ".pgm", ".pbm", ".pnm")
_EXPECTED = "expected an image folder root/{train,val}/class_name/*.jpg|png"
_DECODE_ERRORS = (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
                  ValueError, EOFError)


class BadImage(ValueError):
    """A file that cannot be decoded; ``path`` names it."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: cannot decode image: {reason}")
        self.path = path


def is_image_name(name: str) -> bool:
    """Whether a file name is listed: an image extension, not hidden (``.``-prefixed)."""
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> ``RGB``, 8 bits per channel, on the right scale.

    ``I;16``, ``I;16L``, ``I;16B``, ``I;16N`` and ``I``: ``round(v * 255 / 65535)``
    (``I`` clipped to 0..65535 first: Pillow opens 16-bit PNG and TIFF files as
    ``I`` or ``I;16``). ``F``: ``round(clip(v, 0, 1) * 255)``. ``P`` with
    transparency goes through ``RGBA``. Everything else (``1``, ``L``, ``LA``,
    ``La``, ``P``, ``PA``, ``RGBA``, ``RGBa``, ``CMYK``, ``YCbCr``, ``LAB``,
    ``HSV``): Pillow's ``convert("RGB")`` (alpha dropped).
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I"):
        v = np.asarray(img).astype(np.int64)
        v = (np.clip(v, 0, 65535) * 255 + 32767) // 65535
        return Image.fromarray(np.repeat(v.astype(np.uint8)[..., None], 3, axis=-1), "RGB")
    if mode == "F":
        v = np.rint(np.clip(np.asarray(img, np.float64), 0.0, 1.0) * 255.0)
        return Image.fromarray(np.repeat(v.astype(np.uint8)[..., None], 3, axis=-1), "RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return img.convert("RGB")


def decode(path: str) -> Image.Image:
    """Opens, fully decodes and orients one file: an ``RGB`` image.

    Raises:
      BadImage: the file cannot be read or decoded (names it and the reason).
    """
    try:
        with Image.open(path) as img:
            img.load()
            if img.getexif().get(0x0112, 1) != 1:  # EXIF orientation
                img = ImageOps.exif_transpose(img)
            return to_rgb(img)
    except _DECODE_ERRORS as e:
        raise BadImage(str(path), f"{type(e).__name__}: {e}") from None


def _check(path: str) -> tuple[str, str] | None:
    try:
        decode(path)
    except BadImage as e:
        return path, str(e)
    return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ImageFolder:
    """``root/split/class_name/*`` images, listed once, decoded on demand.

    Class index = position of the class folder's name in sorted order (pass
    ``classes`` to index a split by another split's classes). Files are listed
    once, sorted, at construction (see the module docstring for what is
    listed); nothing is decoded until :meth:`image`.

    Attributes:
      root: the split directory ``root/split``.
      classes: the sorted class names.
      paths: one path per example; ``labels``: ``[N] int32`` class indices.
      skip_bad_images: whether the pipeline skips undecodable files (mask-0
        rows, counted) instead of stopping.
      skipped: paths left out by :meth:`verified`.

    Raises:
      FileNotFoundError: ``root/split`` does not exist.
      ValueError: no class folders, class folders without images (names
        them), or a class folder not in ``classes``.
    """

    def __init__(self, root, split: str, *, classes: Sequence[str] | None = None,
                 skip_bad_images: bool = False):
        for d in (Path(root), Path(root) / split):
            if not d.is_dir():
                raise FileNotFoundError(f"{d} {'is not a directory' if d.exists() else 'does not exist'}: "
                                        f"{_EXPECTED}")
        self.root = Path(root) / split
        dirs = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        if not dirs:
            raise ValueError(f"{self.root} has no class directories: {_EXPECTED}")
        self.classes = list(dirs if classes is None else classes)
        index = {name: i for i, name in enumerate(self.classes)}
        unknown = [d for d in dirs if d not in index]
        if unknown:
            raise ValueError(f"{self.root}: class directories {unknown} are not among the given "
                             f"{len(self.classes)} classes")
        paths, labels, empty = [], [], []
        for d in dirs:
            files = sorted(e.path for e in os.scandir(self.root / d)
                           if is_image_name(e.name) and e.is_file())
            if not files:
                empty.append(str(self.root / d))
            paths += files
            labels += [index[d]] * len(files)
        if not paths:
            raise ValueError(f"{self.root} holds no images ({'/'.join(IMAGE_EXTENSIONS)}) in its "
                             f"class directories {dirs}")
        if empty:
            raise ValueError(f"class directories without images ({'/'.join(IMAGE_EXTENSIONS)}): "
                             f"{empty}")
        self.paths = tuple(paths)
        self.labels = np.asarray(labels, np.int32)
        self.skip_bad_images = bool(skip_bad_images)
        self.skipped: tuple[str, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.paths)

    def image(self, i: int) -> Image.Image:
        """Example ``i`` decoded: an ``RGB`` PIL image (:func:`decode`).

        Raises:
          IndexError: ``i`` outside ``[0, len(self))``.
          BadImage: the file cannot be decoded (names it).
        """
        if not 0 <= i < len(self.paths):
            raise IndexError(f"index {i} is outside [0, {len(self.paths)}) of {self.root}")
        return decode(self.paths[i])

    def find_bad(self, workers: int = 0) -> list[tuple[str, str]]:
        """Decodes every file once (``workers`` threads, 0 = the cores available;
        Pillow decodes without the GIL). Returns ``(path, message)`` per bad file."""
        with concurrent.futures.ThreadPoolExecutor(workers or _cores()) as pool:
            return [m for m in pool.map(_check, self.paths, chunksize=64) if m is not None]

    def verified(self, workers: int = 0) -> "ImageFolder":
        """This folder after a decode pass over every file (:meth:`find_bad`).

        Returns:
          ``self`` when every file decodes; with ``skip_bad_images``, a copy
          without the bad files, which lists them in ``skipped``.

        Raises:
          ValueError: bad files without ``skip_bad_images``: names each (up to
            20) and the two ways out.
        """
        bad = self.find_bad(workers)
        if not bad:
            return self
        if not self.skip_bad_images:
            shown = "\n  ".join(m for _, m in bad[:20]) + (f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else "")
            raise ValueError(f"{len(bad)} file(s) in {self.root} cannot be decoded:\n  {shown}\n"
                             "remove them, or set config.skip_bad_images=True to skip and count them")
        bad_paths = {p for p, _ in bad}
        keep = [i for i, p in enumerate(self.paths) if p not in bad_paths]
        out = object.__new__(ImageFolder)
        out.__dict__.update(self.__dict__)
        out.paths = tuple(self.paths[i] for i in keep)
        out.labels = self.labels[keep]
        out.skipped = tuple(sorted(bad_paths))
        return out
