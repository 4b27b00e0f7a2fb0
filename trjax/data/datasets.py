"""Data sources: every data set trjax reads, behind one registry.

A source yields examples as they are stored; the pipeline
(:mod:`trjax.data.input_pipeline`) batches, augments, prefetches and ships them.
This module imports nothing from the pipeline.

* ``load_digits()``: scikit-learn's 1,797 real 8x8 digits (shipped, no download).
* ``load_cifar(root, num_classes)``: the python pickles of ``cifar-10-python.tar.gz``
  (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``) or
  ``cifar-100-python.tar.gz`` (``cifar-100-python/train``, ``test``).
* ``load_mnist(root)``: the four IDX files of MNIST or Fashion-MNIST, plain or
  ``.gz`` (:func:`trjax.data.formats.read_idx`).
* ``load_image_folder(root)``: ``root/{train,val}/class_name/*.jpg|png|...``
  (ImageNet layout), decoded on demand (:mod:`trjax.data.imagefolder`).

Pixels stay uint8 on the host and on the way to the device (4x fewer bytes
than float32). A :class:`Dataset` carries the per-channel ``mean`` and ``std``
of its training pixels in the stored units (computed exactly from the pixels
every time an in-memory set is loaded; the ImageNet constants for image
folders); the compiled step standardises, ``(x - mean) / std``
(:func:`trjax.models.normalize`).

Errors: a missing root or file raises ``FileNotFoundError`` naming the path and
what was expected there; a malformed file (unexpected pickle content, bad IDX
magic number, sizes that disagree, a folder with no class directories or no
images) raises ``ValueError`` naming the file and the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from trjax.data import sources
from trjax.data.formats import read_cifar_pickle, read_idx
from trjax.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, ImageFolder
from trjax.data.splits import Dataset, Split, channel_stats, class_ids  # noqa: F401 (re-exported)


def _uint8_dataset(train_x, train_y, val_x, val_y, num_classes, name) -> Dataset:
    mean, std = channel_stats(train_x)
    return Dataset(Split(train_x, train_y.astype(np.int32)), Split(val_x, val_y.astype(np.int32)),
                   num_classes, name, mean=mean, std=std)


DIGITS_FILE = Path(__file__).parent / "digits.npz"  # scikit-learn's digits + split


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes).

    Shipped inside scikit-learn: no download. The held-out split is fixed
    (stratified, ``random_state=seed``). The pixels are integers 0..16, kept
    exactly as uint8 0..16; ``mean`` / ``std`` are the training split's, in
    those units. The default split (0.2, seed 0) is read from a copy in this
    package (``DIGITS_FILE``, written by :func:`digits_from_sklearn`; a test
    checks it against scikit-learn): the main job then starts without
    importing scikit-learn (~0.9 s).

    Returns:
      A :class:`Dataset` with images ``[N, 8, 8, 1] uint8`` (1,437 train, 360 val).
    """
    if (val_fraction, seed) == (0.2, 0) and DIGITS_FILE.exists():
        with np.load(DIGITS_FILE) as z:
            x, y, train, val = z["images"], z["labels"], z["train_index"], z["val_index"]
    else:
        x, y, train, val = digits_from_sklearn(val_fraction, seed)
    x = x[..., None]
    return _uint8_dataset(x[train], y[train], x[val], y[val], 10, "digits")


def digits_from_sklearn(val_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's digits and their stratified split.

    Returns:
      ``(images [1797, 8, 8] uint8, labels [1797] int32, train_index, val_index)``,
      the index arrays in ``train_test_split``'s order.

    Raises:
      ValueError: scikit-learn's pixels are no longer the integers 0..16.
    """
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split
    d = _load()
    x = d.images.astype(np.uint8)  # the values are the integers 0..16
    if not np.array_equal(x, d.images):
        raise ValueError("scikit-learn's digits are no longer integers 0..16")
    y = d.target.astype(np.int32)
    train, val = train_test_split(np.arange(len(y)), test_size=val_fraction,
                                  random_state=seed, stratify=y)
    return x, y, train, val


def _check_labels(labels: np.ndarray, num_classes: int, path: Path) -> np.ndarray:
    return class_ids(labels, str(path), num_classes)


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


def load_cifar(root, num_classes: int = 10) -> Dataset:
    """CIFAR-10 or CIFAR-100 from the python pickles of the official archives.

    Args:
      root: the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``)
        or the folder that contains it.
      num_classes: 10 (``data_batch_1..5`` + ``test_batch``, key ``b"labels"``)
        or 100 (``train`` + ``test``, key ``b"fine_labels"``).

    Returns:
      A :class:`Dataset` named ``cifar10`` / ``cifar100`` with images
      ``[N, 32, 32, 3] uint8`` as stored (50,000 train, 10,000 val for the real
      data), labels ``[N] int32``, and ``mean`` / ``std`` per channel of the
      training pixels in uint8 units (computed here, not hard-coded); the
      compiled step standardises (:func:`trjax.models.normalize`).

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
            x, y = read_cifar_pickle(path, spec["label_key"])
            images.append(x)
            labels.append(_check_labels(y, num_classes, path))
        parts[split] = (np.concatenate(images), np.concatenate(labels))
    return _uint8_dataset(*parts["train"], *parts["val"], num_classes, spec["name"])


# ---------------------------------------------------------------------------
# MNIST / Fashion-MNIST (IDX files).
# ---------------------------------------------------------------------------

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
_MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
                "val_images": "t10k-images-idx3-ubyte", "val_labels": "t10k-labels-idx1-ubyte"}
_MNIST_EXPECTED = ("expected the MNIST / Fashion-MNIST IDX files " +
                   ", ".join(_MNIST_FILES.values()) + " (each optionally .gz)")


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
      A :class:`Dataset` with images ``[N, 28, 28, 1] uint8`` as stored (60,000
      train, 10,000 val for the real data), labels ``[N] int32`` in ``[0, 10)``,
      and the training pixels' ``mean`` / ``std`` in uint8 units (computed here,
      not hard-coded).

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
    return _uint8_dataset(*parts["train"], *parts["val"], 10, name)




# ---------------------------------------------------------------------------
# ImageFolder (ImageNet layout), decoded on demand.
# ---------------------------------------------------------------------------


def load_image_folder(root, image_size: int = 224, *, verify: bool = False,
                      skip_bad_images: bool = False, verify_workers: int = 0) -> Dataset:
    """``root/train`` and ``root/val`` as :class:`ImageFolder` sources.

    Args:
      root: the folder holding ``train/`` and ``val/``, each with one folder per class.
      image_size: the side ``S`` of the square crops the pipeline makes.
      verify: decode every file once now (threads: ``verify_workers``, 0 = the
        cores available); a file that cannot be decoded is an error naming it,
        or, with ``skip_bad_images``, is left out and listed in ``.skipped``.
      skip_bad_images: leave out files that fail to decode (at the verify pass,
        or during training, where the row is masked out), count them instead
        of stopping.

    Returns:
      A :class:`Dataset` with ``shape (S, S, 3)``, uint8 crops, ImageNet
      ``mean`` / ``std`` in uint8 units (``255 * (0.485, 0.456, 0.406)``,
      ``255 * (0.229, 0.224, 0.225)``).

    Raises:
      ValueError: train and val class folders differ (names both folders and
        the classes missing from each), an empty class folder (names it),
        ``verify`` found undecodable files without ``skip_bad_images`` (names
        them); and :class:`ImageFolder`'s errors.
    """
    train = ImageFolder(root, "train", skip_bad_images=skip_bad_images)
    val = ImageFolder(root, "val", skip_bad_images=skip_bad_images)
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise ValueError(f"{train.root} and {val.root} hold different class folders: only in "
                         f"train {only_train}, only in val {only_val}; every class needs a "
                         f"folder in both")
    if verify:
        train, val = train.verified(verify_workers), val.verified(verify_workers)
    return Dataset(train, val, train.num_classes, "imagefolder", (image_size, image_size, 3),
                   tuple(255.0 * m for m in IMAGENET_MEAN), tuple(255.0 * s for s in IMAGENET_STD))


def _needs_dir(load: Callable[..., Dataset], name: str) -> Callable[..., Dataset]:
    def loader(data_dir, **options):
        if not data_dir:
            raise ValueError(f"dataset {name!r} reads files: set --config.data_dir=FOLDER (for a "
                             "tiny CIFAR-10 in the real format: trjax-tiny-cifar DIR)")
        return load(data_dir, **options)
    return loader


# The one registry: name -> loader(data_dir, image_size=, verify=, skip_bad_images=,
# verify_workers=); loaders ignore the options they have no use for.
LOADERS: dict[str, Callable[..., Dataset]] = {
    "digits": lambda data_dir, **_: load_digits(),
    "cifar10": _needs_dir(lambda d, **_: load_cifar(d, 10), "cifar10"),
    "cifar100": _needs_dir(lambda d, **_: load_cifar(d, 100), "cifar100"),
    "mnist": _needs_dir(lambda d, **_: load_mnist(d, "mnist"), "mnist"),
    "fashion_mnist": _needs_dir(lambda d, **_: load_mnist(d, "fashion_mnist"), "fashion_mnist"),
    "imagefolder": _needs_dir(load_image_folder, "imagefolder"),
    # random-access sources (trjax.data.sources): a datasets save_to_disk folder, ArrayRecord files
    "hf": _needs_dir(lambda d, **_: sources.load_hf(d), "hf"),
    "array_record": _needs_dir(lambda d, **_: sources.load_array_record(d), "array_record"),
}
DATASETS = tuple(LOADERS)


def load_dataset(name: str, data_dir: str = "", image_size: int = 224, *, verify: bool = False,
                 skip_bad_images: bool = False, verify_workers: int = 0) -> Dataset:
    """Loads a data set by name (one of ``DATASETS``).

    ``digits`` ships inside scikit-learn; the others read ``data_dir``: CIFAR
    python pickles, MNIST IDX files, an ImageFolder tree
    ``data_dir/{train,val}/class/*.jpg`` (decoded on demand, ``image_size``
    square crops; ``verify``, ``skip_bad_images``, ``verify_workers``: see
    :func:`load_image_folder`).

    Raises:
      ValueError: an unknown name, or ``data_dir`` missing for a data set on
        disk; the loaders' own errors for missing or malformed files.
    """
    if name not in LOADERS:
        raise ValueError(f"dataset {name!r} is unknown; choose one of {list(DATASETS)}")
    return LOADERS[name](data_dir, image_size=image_size, verify=verify,
                         skip_bad_images=skip_bad_images, verify_workers=verify_workers)
