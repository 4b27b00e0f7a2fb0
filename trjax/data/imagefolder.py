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
* Names are text, whatever Unicode form the file system gives them: a class
  folder's or file's name is compared and sorted by its NFC form
  (:func:`text_key`), so the NFD names macOS may hand out and the NFC names
  Linux keeps as typed give the same classes, the same label indices and the
  same example order on every machine. Two names in one folder that are the
  same text in two forms are an error naming both.

This module imports no jax: the pipeline's worker processes use it.
"""

from __future__ import annotations

import concurrent.futures
import os
import unicodedata
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
    """A file that cannot be decoded; ``path`` names it, ``reason`` says why.

    Pickles with both (worker processes send it to the parent): pickle's default
    for exceptions would call ``BadImage(message)`` and fail.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: cannot decode image: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return type(self), (self.path, self.reason), self.__dict__


def text_key(name: str) -> str:
    """A file or folder name as text: its NFC form (Unicode canonical composition).

    Class folders and files are compared and sorted by it (code point order of
    the NFC form; no locale): ``"e\\u0301"`` (NFD, as macOS file systems may
    give it) and ``"\\u00e9"`` are the same name ``"\\u00e9"``.
    """
    return unicodedata.normalize("NFC", name)


def _form(name: str) -> str:
    for form in ("NFC", "NFD"):
        if unicodedata.is_normalized(form, name):
            return form
    return "mixed form"


def by_text(names: Sequence[str], folder, what: str) -> dict[str, str]:
    """``{text_key(name): name}`` sorted by ``text_key``: each name as text -> as on disk.

    Raises:
      ValueError: two ``names`` (entries of ``folder``, ``what`` they are) that
        are the same text in two Unicode forms: names both, as given and as
        code points.
    """
    out: dict[str, str] = {}
    for name in sorted(names):
        key = text_key(name)
        if key in out:
            a, b = out[key], name
            raise ValueError(
                f"{what} {Path(folder) / a} and {Path(folder) / b} are the same name {key!r} "
                f"in two Unicode forms ({_form(a)} {a!a}, {_form(b)} {b!a}); their order "
                f"would depend on the file system: merge them or rename one")
        out[key] = name
    return dict(sorted(out.items()))


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


def _given_classes(classes: Sequence[str]) -> list[str]:
    out = [text_key(c) for c in classes]
    twice = sorted({c for c in out if out.count(c) > 1})
    if twice:
        raise ValueError(f"classes {twice} are given more than once (as text, NFC)")
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _class_dirs(root: Path) -> dict[str, str]:
    """``root``'s class folders, ``{name as text: name on disk}`` (:func:`by_text`)."""
    names = [e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
    return by_text(names, root, "class folders")


def _image_files(folder: Path) -> list[str]:
    """The listed files of one class folder (:func:`is_image_name`), in text order."""
    names = [e.name for e in os.scandir(folder) if is_image_name(e.name) and e.is_file()]
    return [str(folder / name) for name in by_text(names, folder, "files").values()]


class ImageFolder:
    """``root/split/class_name/*`` images, listed once, decoded on demand.

    Class index = position of the class folder's name in sorted order, names
    compared as text (:func:`text_key`: NFC, code point order), so it is the
    same on every machine and file system; pass ``classes`` to index a split by
    another split's classes. Files are listed once, in the same text order
    within each class, at construction (see the module docstring for what is
    listed); nothing is decoded until :meth:`image`.

    Attributes:
      root: the split directory ``root/split``.
      classes: the class names, NFC, sorted (the folders on disk may hold
        another form).
      paths: one path per example, as on disk; ``labels``: ``[N] int32`` class indices.
      skip_bad_images: whether the pipeline skips undecodable files (mask-0
        rows, counted) instead of stopping.
      skipped: paths left out by :meth:`verified`.

    Raises:
      FileNotFoundError: ``root/split`` does not exist.
      ValueError: no class folders, class folders without images (names
        them), a class folder not in ``classes``, ``classes`` naming one class
        twice, or two class folders (or two files of one class) that are the
        same name in two Unicode forms (names both).
    """

    def __init__(self, root, split: str, *, classes: Sequence[str] | None = None,
                 skip_bad_images: bool = False):
        for d in (Path(root), Path(root) / split):
            if not d.is_dir():
                raise FileNotFoundError(f"{d} {'is not a directory' if d.exists() else 'does not exist'}: "
                                        f"{_EXPECTED}")
        self.root = Path(root) / split
        dirs = _class_dirs(self.root)
        if not dirs:
            raise ValueError(f"{self.root} has no class directories: {_EXPECTED}")
        self.classes = list(dirs) if classes is None else _given_classes(classes)
        index = {name: i for i, name in enumerate(self.classes)}
        unknown = [d for d in dirs if d not in index]
        if unknown:
            raise ValueError(f"{self.root}: class directories {unknown} are not among the given "
                             f"{len(self.classes)} classes")
        paths, labels, empty = [], [], []
        for name, on_disk in dirs.items():
            files = _image_files(self.root / on_disk)
            if not files:
                empty.append(str(self.root / on_disk))
            paths += files
            labels += [index[name]] * len(files)
        if not paths:
            raise ValueError(f"{self.root} holds no images ({'/'.join(IMAGE_EXTENSIONS)}) in its "
                             f"class directories {list(dirs)}")
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
        out.skipped = tuple(p for p in self.paths if p in bad_paths)  # listing order
        return out
