"""Random-access sources: any ``__len__`` + ``__getitem__`` data set as a split.

grain's ``RandomAccessDataSource`` protocol (``len(source)``, ``source[i]`` ->
one record) covers the data sets users already have: a Hugging Face
``datasets.Dataset`` (``with_format("numpy")``: ``{"image": array, "label":
int}`` per row), ``tfds.data_source(...)``, grain's ``ArrayRecordDataSource``
(one ``bytes`` record per row) or a plain list. :func:`record_split` turns one
into a :class:`trjax.data.datasets.Split` whose images are read on demand
(:class:`RecordImages`), so it trains exactly as arrays in memory do: every
example once per epoch, the order from (seed, epoch), padding masked, resume
mid-epoch bitwise, and, because a batch is the same rows decoded to the same
bits, the same run as on those arrays. Batches can be prepared in worker
processes (``data_workers``; the source and ``decode`` must then pickle).

On disk, :func:`load_hf` reads a folder written by ``datasets``'
``save_to_disk`` and :func:`load_array_record` a folder of ArrayRecord files
in trjax's record format (:func:`encode_record`, flax's msgpack of
``{"image", "label"}``; :func:`write_array_record` writes them). Both are
``config.dataset`` names (``hf``, ``array_record``) reading ``config.data_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trjax.data.splits import Dataset, Split, channel_stats, class_ids


def _example(record, image: str, label: str, decode: Callable | None) -> tuple[np.ndarray, Any]:
    """``(image [H, W, C], label)`` of one record: ``decode(record)`` or the
    record itself, a mapping with keys ``image`` and ``label``. Integer pixels
    (0..255) become uint8, a ``[H, W]`` image ``[H, W, 1]``."""
    rec = decode(record) if decode is not None else record
    try:
        x, y = rec[image], rec[label]
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"a record ({type(rec).__name__}) has no {image!r} and {label!r} "
                         f"({type(e).__name__}: {e}): pass image=/label= with its keys, or "
                         "decode=fn(record) -> {'image': [H, W, C] array, 'label': int}") from None
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:  # e.g. an int64 column
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f"a record's {x.dtype} image holds values in [{x.min()}, {x.max()}]"
                             ": integer pixels must be 0..255 (they travel as uint8); scale "
                             "them in decode=, or store float images")
        x = x.astype(np.uint8)
    return (x[..., None] if x.ndim == 2 else x), np.asarray(y).item()  # checked: class_ids


class RecordImages:
    """A source's images as a lazy ``[N, H, W, C]`` array: indexing with an int,
    a slice or an index array reads and decodes those records only.

    Attributes:
      shape, dtype: ``(N, H, W, C)`` and the images' dtype, from record 0;
        every record must match them.
    """

    def __init__(self, source, image: str = "image", label: str = "label",
                 decode: Callable | None = None):
        self.source, self.image, self.label, self.decode = source, image, label, decode
        first, _ = _example(source[0], image, label, decode)
        self.shape, self.dtype = (len(source),) + first.shape, first.dtype
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, i: int) -> np.ndarray:
        """Image ``i`` ``[H, W, C]``.

        Raises:
          ValueError: another shape or dtype than record 0's (names the index
            and the fix)."""
        x, _ = _example(self.source[int(i)], self.image, self.label, self.decode)
        if x.shape != self.shape[1:] or x.dtype != self.dtype:
            raise ValueError(f"record {int(i)} holds a {x.dtype} image {x.shape}, record 0 a "
                             f"{self.dtype} one {self.shape[1:]}: every image of a record source "
                             "must have one shape and dtype; resize them in decode=, or store "
                             "files in an ImageFolder tree (dataset='imagefolder' crops them)")
        return x

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.read(idx)
        rows = range(*idx.indices(len(self))) if isinstance(idx, slice) else np.asarray(idx)
        out = np.empty((len(rows),) + self.shape[1:], self.dtype)
        for k, i in enumerate(rows):
            out[k] = self.read(i)
        return out

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def _labels(source, image: str, label: str, decode: Callable | None) -> np.ndarray:
    """``[N] int32``: a column store's label column when it has one (an HF
    ``Dataset``: ``source[label]``), else every record read once."""
    what = f"the {type(source).__name__} source's {label!r}"
    if decode is None and label in (getattr(source, "column_names", None) or ()):
        return class_ids(source[label], what)
    return class_ids([_example(source[i], image, label, decode)[1] for i in range(len(source))],
                     what)


def record_split(source, *, image: str = "image", label: str = "label",
                 decode: Callable | None = None) -> Split:
    """A random-access source as a :class:`Split` read on demand.

    Args:
      source: ``len(source)`` and ``source[i]`` -> a record (grain's protocol).
      image, label: the record's keys (a mapping, e.g. an HF row).
      decode: ``record -> {"image": [H, W, C] (or [H, W]) array, "label": int}``
        for records that are not such mappings (ArrayRecord ``bytes``:
        :func:`decode_record`); module-level to pickle for worker processes.

    Returns:
      ``Split(RecordImages, labels [N] int32)``.

    Raises:
      ValueError: an empty source, or records without those keys.
    """
    if len(source) == 0:
        raise ValueError(f"the source {type(source).__name__} is empty: a split needs examples")
    return Split(RecordImages(source, image, label, decode),
                 _labels(source, image, label, decode))


def record_dataset(train, val, *, num_classes: int | None = None, name: str = "records",
                   image: str = "image", label: str = "label", decode: Callable | None = None,
                   mean=None, std=None) -> Dataset:
    """A :class:`Dataset` of two random-access sources (:func:`record_split`).

    Args:
      train, val: the sources.
      num_classes: ``None``: one more than the largest label of either split.
      mean, std: per-channel statistics in the stored units; ``None``: computed
        from the training images (one pass over them), as for arrays.

    Raises:
      ValueError: a label outside ``[0, num_classes)``, and :func:`record_split`'s.
    """
    tr = record_split(train, image=image, label=label, decode=decode)
    va = record_split(val, image=image, label=label, decode=decode)
    k = int(max(tr.labels.max(), va.labels.max())) + 1 if num_classes is None else num_classes
    for split, labels in (("train", tr.labels), ("val", va.labels)):
        class_ids(labels, f"the {split} source", k)
    if mean is None or std is None:
        mean, std = channel_stats(tr.images[:])
    return Dataset(tr, va, k, name, mean=tuple(mean), std=tuple(std))


# -- on disk: Hugging Face save_to_disk folders and ArrayRecord files -------------------------


def encode_record(image: np.ndarray, label: int) -> bytes:
    """trjax's ArrayRecord record: flax's msgpack of ``{"image": [H, W, C]
    array, "label": int}`` (dtype and shape kept)."""
    from flax import serialization
    return serialization.msgpack_serialize({"image": np.asarray(image), "label": int(label)})


def decode_record(record: bytes) -> dict:
    """:func:`encode_record`'s inverse: ``{"image": array, "label": int}``."""
    from flax import serialization
    return serialization.msgpack_restore(record)


def write_array_record(path, images: np.ndarray, labels: np.ndarray) -> str:
    """Writes ``images [N, H, W, C]`` and ``labels [N]`` to one ArrayRecord file
    (:func:`encode_record`, one record per example, ``group_size:1`` for random
    access), e.g. ``DIR/train.array_record``. Needs ``array_record``
    (``pip install 'trjax[sources]'``). Returns the path."""
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(path), "group_size:1")
    try:
        for x, y in zip(images, labels):
            writer.write(encode_record(x, y))
    finally:
        writer.close()
    return str(path)


def _need(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"{what} needs the {module.split('.')[0]!r} package: pip install "
                         "'trjax[sources]'") from None


def load_array_record(data_dir, **_: Any) -> Dataset:
    """``data_dir/train*.array_record`` and ``data_dir/val*.array_record``
    (shards in name order) in trjax's record format, through
    ``ArrayRecordDataSource`` (grain's source for these files).

    Raises:
      ValueError: a split without files (names the folder and the pattern),
        ``array_record`` missing.
    """
    ds = _need("array_record.python.array_record_data_source", "dataset='array_record'")
    sources = {}
    for split in ("train", "val"):
        files = sorted(str(p) for p in Path(data_dir).glob(f"{split}*.array_record"))
        if not files:
            raise ValueError(f"{data_dir} holds no {split}*.array_record file: write them with "
                             "trjax.data.sources.write_array_record(DIR/'"
                             f"{split}.array_record', images, labels)")
        sources[split] = ds.ArrayRecordDataSource(files)
    return record_dataset(sources["train"], sources["val"], name="array_record",
                          decode=decode_record)


HF_VAL_SPLITS = ("validation", "val", "test")


def load_hf(data_dir, **_: Any) -> Dataset:
    """A Hugging Face ``DatasetDict`` saved with ``save_to_disk`` in
    ``data_dir``: its ``train`` split and the first of :data:`HF_VAL_SPLITS`,
    columns ``image`` (an ``Image`` feature or arrays) and ``label``, read
    with ``with_format("numpy")``.

    Raises:
      ValueError: no such folder or splits (names what it holds), ``datasets``
        missing.
    """
    datasets = _need("datasets", "dataset='hf'")
    if not os.path.isdir(data_dir):
        raise ValueError(f"data_dir={str(data_dir)!r} is not a folder: give the folder a "
                         "datasets.DatasetDict was saved to (dd.save_to_disk(DIR))")
    dd = datasets.load_from_disk(str(data_dir))
    names = list(getattr(dd, "keys", lambda: [])())
    val = next((n for n in HF_VAL_SPLITS if n in names), None)
    if "train" not in names or val is None:
        raise ValueError(f"{data_dir} holds the splits {names}: trjax needs 'train' and one of "
                         f"{list(HF_VAL_SPLITS)}")
    k = None
    feature = dd["train"].features.get("label")
    if hasattr(feature, "num_classes"):  # a ClassLabel
        k = feature.num_classes
    return record_dataset(dd["train"].with_format("numpy"), dd[val].with_format("numpy"),
                          num_classes=k, name="hf")
