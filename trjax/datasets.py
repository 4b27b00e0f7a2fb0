"""Real data sets already on disk: CIFAR-10/100, MNIST / Fashion-MNIST, image folders.

Nothing is downloaded. Every loader reads the files as they are distributed and
returns the same :class:`~trjax.input_pipeline.Dataset` as the embedded digits,
so ``iterate_batches`` / ``to_device`` work unchanged:

* ``load_cifar(root, num_classes)``: the python pickles of ``cifar-10-python.tar.gz``
  (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``) or
  ``cifar-100-python.tar.gz`` (``cifar-100-python/train``, ``test``).
* ``load_mnist(root)``: the four IDX files of MNIST or Fashion-MNIST, plain or
  ``.gz``; the IDX header is parsed here (``read_idx``).
* ``ImageFolder(root, split)``: ``root/{train,val}/class_name/*.jpg|png`` (ImageNet
  layout), decoded lazily with PIL, ImageNet-style train and eval transforms.

Small in-memory images are standardised per channel with the *training split's*
mean and std, computed exactly from the uint8 pixels every time a data set is
loaded (no constants are hard-coded, so CIFAR-10, CIFAR-100, MNIST and
Fashion-MNIST each get their own). ``ImageFolder`` uses the usual ImageNet
constants ``IMAGENET_MEAN`` / ``IMAGENET_STD`` on [0, 1] pixels.

Augmentation is a pure function of a numpy Generator: ``augment_batch(images,
batch_rng(seed, epoch, step))`` draws the same crops and flips for a given
seed, epoch and step whatever the world size, because it runs on the host's
global batch before the batch is sharded. ``prefetch`` overlaps host-side
loading with the device step.

Errors: a missing root or file raises ``FileNotFoundError`` naming the path and
what was expected there; a malformed file (unexpected pickle content, bad IDX
magic number, sizes that disagree, undecodable image, a folder with no class
directories or no images) raises ``ValueError`` naming the file and the problem.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import math
import os
import pickle
import queue
import threading
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from trjax.input_pipeline import Dataset, Split

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

# ---------------------------------------------------------------------------
# Standardisation of uint8 images with the training split's statistics.
# ---------------------------------------------------------------------------


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std of uint8 images, on the [0, 1] pixel scale.

    Computed from per-channel histograms of the 256 pixel values (float64, no
    float copy of the images, no accumulated rounding).

    Args:
      images: ``[N, H, W, C] uint8``.

    Returns:
      ``(mean, std)``, each ``[C] float64``.

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
    values = np.arange(256, dtype=np.float64) / 255.0
    n = counts.sum(axis=1).astype(np.float64)
    mean = counts @ values / n
    var = (counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n
    std = np.sqrt(var)
    if np.any(std == 0):
        raise ValueError(f"channel(s) {np.flatnonzero(std == 0).tolist()} of the training images "
                         f"are constant: cannot standardise")
    return mean, std


def standardize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(images / 255 - mean) / std`` as float32, computed in place on one float copy.

    Args:
      images: ``[N, H, W, C] uint8``; ``mean``, ``std``: ``[C]`` on the [0, 1] scale.

    Returns:
      ``[N, H, W, C] float32``.
    """
    out = images.astype(np.float32)
    out /= np.float32(255.0)
    out -= np.asarray(mean, np.float32)
    out /= np.asarray(std, np.float32)
    return out


def _standardized_dataset(train_x, train_y, val_x, val_y, num_classes, name) -> Dataset:
    mean, std = channel_stats(train_x)
    return Dataset(Split(standardize(train_x, mean, std), train_y.astype(np.int32)),
                   Split(standardize(val_x, mean, std), val_y.astype(np.int32)),
                   num_classes, name)


def _check_labels(labels: np.ndarray, num_classes: int, path: Path) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise ValueError(f"{path}: labels must be a 1-D sequence of integers, got shape "
                         f"{labels.shape} dtype {labels.dtype}")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{path}: label {labels[pos].item()} at position {pos} is outside "
                         f"[0, {num_classes})")
    return labels.astype(np.int32)


def _require_dir(root, expected: str) -> Path:
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist: {expected}")
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory: {expected}")
    return root


# ---------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickles).
# ---------------------------------------------------------------------------

_CIFAR = {
    10: dict(folder="cifar-10-batches-py", train=tuple(f"data_batch_{i}" for i in range(1, 6)),
             val=("test_batch",), label_key=b"labels", name="cifar10",
             expected="expected CIFAR-10 python batches data_batch_1..5 and test_batch "
                      "(cifar-10-batches-py, from cifar-10-python.tar.gz)"),
    100: dict(folder="cifar-100-python", train=("train",), val=("test",),
              label_key=b"fine_labels", name="cifar100",
              expected="expected CIFAR-100 python pickles train and test "
                       "(cifar-100-python, from cifar-100-python.tar.gz)"),
}


def _numpy_globals() -> dict:
    # The only globals a CIFAR pickle refers to: numpy's array and dtype
    # reconstruction, under the names numpy 1.x / python 2 (numpy.core) and
    # numpy 2 (numpy._core) write, and the bytes constructor of protocol 2.
    reconstruct = np.ndarray((0,)).__reduce__()[0]
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               ("_codecs", "encode"): codecs.encode}  # bytes in Python 3 protocol-2 pickles
    numeric = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1.x
    frombuffer = getattr(numeric.numeric, "_frombuffer", None)  # protocol 5 arrays
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = reconstruct
        if frombuffer is not None:
            allowed[(f"{mod}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain containers only.

    A pickle can run arbitrary code when loaded; a CIFAR batch never needs
    anything beyond numpy's array reconstruction, so every other global is refused.
    """
    _allowed = _numpy_globals()

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR batch never "
                                         f"does; refusing to load it") from None


def _read_cifar_pickle(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch -> (images [N, 32, 32, 3] uint8, labels [N] int64)."""
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a CIFAR python pickle: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    obj = {k.encode() if isinstance(k, str) else k: v for k, v in obj.items()}
    missing = [k for k in (b"data", label_key) if k not in obj]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}; found {sorted(obj, key=repr)} "
                         f"(expected b'data' and {label_key!r})")
    data = obj[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise ValueError(f"{path}: b'data' must be a uint8 array [N, 3072] (3x32x32, channel "
                         f"planes), got shape {shape} dtype {dtype}")
    labels = np.asarray(obj[label_key])
    if labels.shape != (len(data),):
        raise ValueError(f"{path}: {len(data)} images but {label_key!r} has shape {labels.shape}")
    # Rows are the red, green and blue 32x32 planes, each row-major.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def load_cifar(root, num_classes: int = 10) -> Dataset:
    """CIFAR-10 or CIFAR-100 from the python pickles of the official archives.

    Args:
      root: the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``)
        or the folder that contains it.
      num_classes: 10 (``data_batch_1..5`` + ``test_batch``, key ``b"labels"``)
        or 100 (``train`` + ``test``, key ``b"fine_labels"``).

    Returns:
      A :class:`Dataset` named ``cifar10`` / ``cifar100`` with images
      ``[N, 32, 32, 3] float32`` (50,000 train, 10,000 val for the real data),
      standardised per channel with the mean and std of the training pixels on
      the [0, 1] scale (computed here, not hard-coded), and labels ``[N] int32``.

    Raises:
      FileNotFoundError: ``root`` or one of the expected files does not exist
        (names the path and the expected files).
      ValueError: ``num_classes`` not 10 or 100; a file that is not a CIFAR
        pickle, lacks ``b"data"`` / the label key, has data not ``uint8
        [N, 3072]``, a label count that differs from the image count, or labels
        outside ``[0, num_classes)`` (names the file).
    """
    if num_classes not in _CIFAR:
        raise ValueError(f"num_classes={num_classes!r}: CIFAR has 10 or 100 classes")
    spec = _CIFAR[num_classes]
    root = _require_dir(root, spec["expected"])
    folder = root / spec["folder"] if (root / spec["folder"]).is_dir() else root
    parts = {}
    for split in ("train", "val"):
        images, labels = [], []
        for fname in spec[split]:
            path = folder / fname
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: {spec['expected']} in {root} or "
                                        f"in {root / spec['folder']}")
            x, y = _read_cifar_pickle(path, spec["label_key"])
            images.append(x)
            labels.append(_check_labels(y, num_classes, path))
        parts[split] = (np.concatenate(images), np.concatenate(labels))
    return _standardized_dataset(*parts["train"], *parts["val"], num_classes, spec["name"])


# ---------------------------------------------------------------------------
# MNIST / Fashion-MNIST (IDX files).
# ---------------------------------------------------------------------------

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
                "val_images": "t10k-images-idx3-ubyte", "val_labels": "t10k-labels-idx1-ubyte"}
_MNIST_EXPECTED = ("expected the MNIST / Fashion-MNIST IDX files " +
                   ", ".join(_MNIST_FILES.values()) + " (each optionally .gz)")


def _read_bytes(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is not a valid gzip file: {e}") from e


def read_idx(path, expected_magic: int | None = None) -> np.ndarray:
    """Parses one IDX file (the MNIST format), plain or gzipped (``.gz`` suffix).

    Format: a big-endian 4-byte magic number ``0x00 0x00 TYPE NDIM``, then NDIM
    big-endian uint32 sizes, then the values row-major, big-endian, TYPE one of
    0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64.

    Args:
      path: the file.
      expected_magic: if given, the magic number the file must carry (e.g.
        ``0x803`` = 2051 for uint8 images [N, H, W], ``0x801`` = 2049 for uint8
        labels [N]).

    Returns:
      An array of the header's shape, in native byte order.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a bad magic number, unknown type code, truncated header, or a
        data size that differs from what the header's sizes require (names the
        file, both sizes or both magic numbers).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected an IDX file")
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(f"{path}: bad IDX magic number 0x{magic:08x}, expected "
                         f"0x{expected_magic:08x}")
    zero, code, ndim = raw[0:2], raw[2], raw[3]
    if zero != b"\x00\x00" or code not in _IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number 0x{magic:08x} (expected 0x0000TTNN "
                         f"with type TT in {[hex(c) for c in _IDX_DTYPES]})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header} "
                         f"for {ndim} dimensions)")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    need = math.prod(dims) * dtype.itemsize
    have = len(raw) - header
    if have != need:
        raise ValueError(f"{path}: size mismatch, the header's dims {dims} need {need} bytes of "
                         f"data but the file holds {have}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def load_mnist(root, name: str = "mnist") -> Dataset:
    """MNIST or Fashion-MNIST from the four IDX files (plain or ``.gz``).

    Args:
      root: the folder holding ``train-images-idx3-ubyte``,
        ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
        ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``; the plain file wins
        when both exist). torchvision's layout, ``root/raw`` or
        ``root/{MNIST,FashionMNIST}/raw``, is found too.
      name: the data set's name (``"mnist"`` or ``"fashion_mnist"``).

    Returns:
      A :class:`Dataset` with images ``[N, 28, 28, 1] float32`` (60,000 train,
      10,000 val for the real data) standardised with the training pixels' mean
      and std on the [0, 1] scale (computed here, not hard-coded), labels
      ``[N] int32`` in ``[0, 10)``.

    Raises:
      FileNotFoundError: ``root`` or one of the four files does not exist.
      ValueError: a bad magic number (images must be 0x00000803, labels
        0x00000801), a size mismatch inside a file, images and labels of
        different counts, images not 28x28, or labels outside ``[0, 10)``
        (names the file).
    """
    root = _require_dir(root, _MNIST_EXPECTED)
    candidates = [root, root / "raw", root / "MNIST" / "raw", root / "FashionMNIST" / "raw"]
    folder = next((d for d in candidates if _find_idx(d, _MNIST_FILES["train_images"])), root)
    paths = {}
    for key, stem in _MNIST_FILES.items():
        paths[key] = _find_idx(folder, stem)
        if paths[key] is None:
            raise FileNotFoundError(f"{folder / stem}[.gz] not found: {_MNIST_EXPECTED} in {folder}")
    parts = {}
    for split in ("train", "val"):
        ipath, lpath = paths[f"{split}_images"], paths[f"{split}_labels"]
        images = read_idx(ipath, expected_magic=0x803)
        labels = read_idx(lpath, expected_magic=0x801)
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{ipath}: images are {images.shape[1:]}, expected 28x28")
        if len(images) != len(labels):
            raise ValueError(f"{ipath} holds {len(images)} images but {lpath} holds "
                             f"{len(labels)} labels")
        parts[split] = (images[..., None], _check_labels(labels, 10, lpath))
    return _standardized_dataset(*parts["train"], *parts["val"], 10, name)


DATASET_LOADERS: dict[str, Callable[..., Dataset]] = {
    "cifar10": functools.partial(load_cifar, num_classes=10),
    "cifar100": functools.partial(load_cifar, num_classes=100),
    "mnist": functools.partial(load_mnist, name="mnist"),
    "fashion_mnist": functools.partial(load_mnist, name="fashion_mnist"),
}


# ---------------------------------------------------------------------------
# ImageFolder (ImageNet layout), decoded lazily with PIL.
# ---------------------------------------------------------------------------


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


class ImageFolder:
    """``root/split/class_name/*.{jpg,jpeg,png}``, decoded on demand with PIL.

    Class index = position of the class directory name in sorted order (pass
    ``classes`` to index a split by another split's classes, e.g. val by
    train's). Files are listed once, sorted, at construction; nothing is decoded
    until :meth:`load`.

    Attributes:
      root: the split directory ``root/split``.
      classes: the sorted class names.
      num_classes: ``len(classes)``.
      paths: one path per example.
      labels: ``[N] int32`` class indices.

    Raises:
      FileNotFoundError: ``root/split`` does not exist.
      ValueError: no class directories, a class directory without images, no
        images at all, or a class directory not in ``classes`` (names the path).
    """

    def __init__(self, root, split: str, *, classes: Sequence[str] | None = None):
        expected = "expected an image folder root/{train,val}/class_name/*.jpg|png"
        _require_dir(root, expected)
        self.root = _require_dir(Path(root) / split, expected)
        dirs = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        if not dirs:
            raise ValueError(f"{self.root} has no class directories: {expected}")
        self.classes = list(dirs if classes is None else classes)
        index = {name: i for i, name in enumerate(self.classes)}
        unknown = [d for d in dirs if d not in index]
        if unknown:
            raise ValueError(f"{self.root}: class directories {unknown} are not among the given "
                             f"{len(self.classes)} classes")
        paths, labels, empty = [], [], []
        for d in dirs:
            files = sorted(e.path for e in os.scandir(self.root / d)
                           if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
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

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.paths)

    def _open(self, i: int):
        from PIL import Image, UnidentifiedImageError
        path = self.paths[i]
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as e:
            raise ValueError(f"{path}: cannot decode image: {e}") from e

    def load(self, indices: Iterable[int], *, train: bool, rng: np.random.Generator | None = None,
             image_size: int = 224) -> np.ndarray:
        """Decodes, transforms and standardises the examples ``indices``.

        Train: RandomResizedCrop (``random_resized_crop_params``, scale (0.08, 1),
        ratio (3/4, 4/3)) resized bilinearly to ``image_size`` square, then a
        horizontal flip with probability 1/2; draws come from ``rng`` in index
        order (crop, then flip, per image), so the result is a function of
        ``rng``'s state. Eval: resize the shorter side to
        ``round(image_size * 256 / 224)`` (bilinear), center crop ``image_size``.
        Both then map [0, 1] pixels to ``(x - IMAGENET_MEAN) / IMAGENET_STD``.

        Returns:
          ``[len(indices), image_size, image_size, 3] float32``.

        Raises:
          ValueError: ``train`` without ``rng``, or an undecodable file (names it).
          IndexError: an index outside ``[0, len(self))``.
        """
        from PIL import Image
        indices = [int(i) for i in np.asarray(indices).reshape(-1)]
        if train and rng is None:
            raise ValueError("train=True needs rng (a np.random.Generator) for crops and flips")
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"index {i} is outside [0, {len(self)}) of {self.root}")
        s = int(image_size)
        out = np.empty((len(indices), s, s, 3), np.float32)
        for k, i in enumerate(indices):
            img = self._open(i)
            width, height = img.size
            if train:
                top, left, h, w = random_resized_crop_params(height, width, rng)
                img = img.resize((s, s), Image.BILINEAR, box=(left, top, left + w, top + h))
                if rng.random() < 0.5:
                    img = img.transpose(Image.FLIP_LEFT_RIGHT)
            else:
                short = int(round(s * 256 / 224))
                if width <= height:
                    new_w, new_h = short, int(short * height / width)
                else:
                    new_w, new_h = int(short * width / height), short
                img = img.resize((new_w, new_h), Image.BILINEAR)
                top, left = int(round((new_h - s) / 2.0)), int(round((new_w - s) / 2.0))
                img = img.crop((left, top, left + s, top + s))
            out[k] = np.asarray(img, np.float32)
        out /= np.float32(255.0)
        out -= np.asarray(IMAGENET_MEAN, np.float32)
        out /= np.asarray(IMAGENET_STD, np.float32)
        return out


# ---------------------------------------------------------------------------
# Augmentation of small in-memory images.
# ---------------------------------------------------------------------------


def batch_rng(seed: int, epoch: int, step: int) -> np.random.Generator:
    """``np.random.default_rng((seed, epoch, step))``: one stream per global batch.

    Drawn on the host for the global batch, so augmentation depends on the
    seed, epoch and step only, never on the world size or the rank.
    """
    return np.random.default_rng((seed, epoch, step))


def augment_batch(images: np.ndarray, rng: np.random.Generator, pad: int = 4,
                  flip: bool = True) -> np.ndarray:
    """Random crop with zero padding, then random horizontal flip (CIFAR-style).

    Each image is padded by ``pad`` zeros on every side (zero is the mean pixel
    of standardised images) and cropped back to ``H x W`` at an offset drawn
    uniformly from ``[0, 2 * pad]`` in each direction; with ``flip`` it is
    mirrored left-right with probability 1/2. Draws: offsets ``[B, 2]``, then
    flips ``[B]``, from ``rng``; the same rng state gives the same output.

    Args:
      images: ``[B, H, W, C]``, any dtype (mask-0 padding rows are harmless).
      rng: e.g. ``batch_rng(seed, epoch, step)``.
      pad: padding in pixels, ``>= 0``.
      flip: whether to flip.

    Returns:
      A new ``[B, H, W, C]`` array of the input's dtype.

    Raises:
      ValueError: images not 4-D or ``pad < 0``.
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"images must be [B, H, W, C], got shape {images.shape}")
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    b, h, w, _ = images.shape
    offsets = rng.integers(0, 2 * pad + 1, size=(b, 2))
    flips = rng.random(b) < 0.5 if flip else np.zeros(b, bool)
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows = offsets[:, :1] + np.arange(h)[None, :]                           # [B, H]
    cols = offsets[:, 1:] + np.where(flips[:, None], np.arange(w)[::-1], np.arange(w))  # [B, W]
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def augment_batches(batches: Iterable[dict], *, seed: int, epoch: int, pad: int = 4,
                    flip: bool = True) -> Iterator[dict]:
    """Applies ``augment_batch`` with ``batch_rng(seed, epoch, step)`` to each batch's image.

    For use on ``iterate_batches(..., shuffle=True, seed=seed, epoch=epoch)``;
    labels and masks pass through unchanged.
    """
    for step, batch in enumerate(batches):
        yield {**batch, "image": augment_batch(batch["image"], batch_rng(seed, epoch, step),
                                               pad=pad, flip=flip)}


# ---------------------------------------------------------------------------
# Host prefetching.
# ---------------------------------------------------------------------------

_END = object()


class _Raised:
    """An exception from the producer, distinguishable from any item."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def prefetch(iterator: Iterable, depth: int = 2) -> Iterator:
    """Runs ``iterator`` in a background thread, with up to ``depth`` items queued.

    The producer holds at most one more item while it waits for a free slot.

    Items arrive in order. An exception raised by the producer is re-raised in
    the consumer at the point it occurred (after the items produced before it).
    When the consumer stops early (``close()``, ``break`` in a for loop, or the
    generator being garbage collected), the producer is told to stop, the
    source iterator's ``close()`` (if any) is called in the producer thread and
    the thread is joined: no thread is left behind. A producer blocked inside a
    slow ``next()`` finishes that one item first. The thread starts on the
    first ``next()``.

    Raises:
      ValueError: ``depth < 1``.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    return _prefetch(iter(iterator), depth)


def _prefetch(source: Iterator, depth: int) -> Iterator:
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in source:
                if not put(item):
                    return
            put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(_Raised(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="trjax-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
