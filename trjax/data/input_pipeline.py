"""The input pipeline: sources -> global batches -> workers -> prefetch -> the device.

Batches are host numpy dicts ``{"image": [B, H, W, C] uint8, "label": [B]
int32, "mask": [B] float32}`` holding the rows ``[lo, hi)`` this process feeds
of each global batch of G examples (all rows in a single-process run). A data
set whose size is not a multiple of G gets a last batch padded to G with
mask-0 rows (``remainder="pad"``: every example counts exactly once, the
compiled shape never changes) or loses its last partial batch
(``remainder="drop"``, train only). Evaluation always pads.

Determinism. The epoch's order is ``default_rng((seed, epoch)).permutation(n)``;
an example's augmentation draws come from ``augment.example_rng(seed, epoch,
index)`` with ``index`` its position in the split. A batch is therefore a
function of (seed, epoch, batch number) only: the same bit for bit for any
split of the global batch over processes and devices, for any number of
worker processes, and when a run resumes at batch ``start`` (the loader's
whole position is ``(seed, epoch, start)``, already in every checkpoint).

Workers. Decoded sources (ImageFolder) are prepared in ``workers`` processes
with grain (``pip install 'trjax[grain]'``; ``MapDataset.range(start, steps)
.map(batch).mp_prefetch(...)``: each worker builds whole batches, delivered
in order through shared memory); ``workers=0`` builds them in this process,
with identical results, and the same errors: an exception raised in a worker
comes back as a value (:mod:`trjax.data.worker_errors`) and is raised here with
its type, message and attributes (a :class:`BadImage` names the file and the
reason), the worker's traceback in a note. In-memory sets are always gathered
in-process (a gather is microseconds; workers would copy the arrays).

uint8 to the device. Images stay uint8 on the host and in the transfer (4x
fewer bytes than float32); the compiled step standardises them with
:func:`trjax.models.normalize` (the steps call it before the model, with the data set's
``mean`` / ``std``).
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import jax
import numpy as np

from trjax.data import augment, worker_errors
from trjax.data.datasets import (DATASETS, LOADERS, Dataset, Split, load_dataset,  # noqa: F401
                            load_digits)  # re-exported: the pipeline's callers need one import
from trjax.data.imagefolder import BadImage, text_key
from trjax.data.prefetch import prefetch  # noqa: F401  (the pipeline's last host stage)
from trjax.data.worker_errors import WorkerError  # noqa: F401  (raised by iterate_batches)

REMAINDERS = ("pad", "drop")


def steps_per_epoch(num_examples: int, global_batch: int, remainder: str) -> int:
    """Batches per pass: ceil for ``pad``, floor for ``drop``."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder {remainder!r} is not one of {REMAINDERS}")
    full, rest = divmod(num_examples, global_batch)
    return full + (1 if rest and remainder == "pad" else 0)


def train_batches_full(split, global_batch: int, remainder: str) -> bool:
    """Whether every training batch of ``split`` holds real rows only (mask 1).

    True when the split's size is a multiple of ``global_batch`` or the last
    partial batch is dropped (``remainder="drop"``), and the source never masks
    out a row it cannot decode (``skip_bad_images``). The trainer then compiles
    the train step without BatchNorm's padding mask
    (:func:`trjax.steps.make_train_step` with ``padding=False``).
    """
    n = len(split.labels)
    whole = steps_per_epoch(n, global_batch, remainder) * global_batch <= n
    return whole and not getattr(split, "skip_bad_images", False)


def epoch_order(num_examples: int, *, shuffle: bool, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The examples of one epoch in order: ``default_rng((seed, epoch)).permutation(n)``
    when ``shuffle``, else ``arange(n)``. ``[n] int64``."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng((seed, epoch)).permutation(num_examples)


class BatchMaker:
    """Builds rows ``[lo, hi)`` of global batch ``b`` of one epoch: ``maker(b) -> batch``.

    A pure function of its fields and ``b`` (picklable: worker processes run it).
    The batch also holds ``"skipped"``: the paths of undecodable files whose
    rows were masked out (sources with ``skip_bad_images``).

    Raises:
      BadImage: an undecodable file, without ``skip_bad_images``.
      Exception: any other error while reading or cropping an on-demand
        example, with a note naming the example (and its file).
    """

    def __init__(self, split, order: np.ndarray, global_batch: int, rows: tuple[int, int], *,
                 seed: int, epoch: int, augment: bool, image_size: int, transform=None):
        self.split, self.order, self.global_batch = split, order, global_batch
        self.lo, self.hi = rows
        self.seed, self.epoch, self.augment, self.image_size = seed, epoch, augment, image_size
        self.transform = transform

    def __call__(self, b: int) -> dict:
        b = int(b)
        idx = self.order[b * self.global_batch:(b + 1) * self.global_batch][self.lo:self.hi]
        size = self.hi - self.lo
        mask = np.zeros(size, np.float32)
        mask[:len(idx)] = 1.0
        labels = np.zeros(size, np.int32)
        labels[:len(idx)] = self.split.labels[idx]
        rngs = [augment.example_rng(self.seed, self.epoch, i) for i in idx] if self.augment else None
        skipped = []
        if isinstance(self.split, Split):
            real = self.split.images[idx]
            if self.augment and len(idx):
                real = augment.crop_flip(real, rngs)
            images = np.zeros((size,) + real.shape[1:], real.dtype)
            images[:len(idx)] = real
        else:
            s = self.image_size
            images = np.zeros((size, s, s, 3), np.uint8)
            for k, i in enumerate(idx):
                try:
                    images[k] = self._example(int(i), rngs[k] if rngs else None)
                except BadImage as e:
                    if not self.split.skip_bad_images:
                        raise
                    mask[k] = 0.0
                    skipped.append(e.path)
        if self.transform is not None:
            for k, i in enumerate(idx):
                if mask[k] > 0:
                    images[k] = augment.apply_transform(
                        self.transform, images[k], augment.transform_rng(self.seed, self.epoch, i))
        index = np.full(size, -1, np.int64)
        index[:len(idx)] = idx
        return {"image": images, "label": labels, "mask": mask, "index": index,
                "skipped": tuple(skipped)}

    def _example(self, i: int, rng) -> np.ndarray:
        """Example ``i`` of an on-demand source, decoded and cropped."""
        try:
            img = self.split.image(i)
            s = self.image_size
            return augment.train_crop(img, rng, s) if self.augment else augment.eval_crop(img, s)
        except BadImage:
            raise
        except Exception as e:
            paths = getattr(self.split, "paths", ())
            e.add_note(f"while reading example {i}" + (f": {paths[i]}" if i < len(paths) else ""))
            raise


def check_transform(transform, split, image_shape: tuple, *, seed: int = 0,
                    workers: int = 0) -> None:
    """Checks a training ``transform`` once, before anything is compiled: run
    on the split's first example (as the pipeline yields it, unaugmented) it
    must return the same shape and dtype; with worker processes
    (:func:`resolve_workers` > 0) it must pickle.

    Raises:
      TypeError: ``transform`` is not callable.
      ValueError: another shape or dtype came back
        (:func:`trjax.data.augment.apply_transform`), or it does not pickle
        with ``workers`` > 0 (names the fix: a module-level function, or
        ``data_workers=0``).
    """
    if not callable(transform):
        raise TypeError(f"transform={transform!r} is not callable: pass "
                        "transform(uint8 image [H, W, C], rng: np.random.Generator) -> image")
    if resolve_workers(workers, split) > 0:
        import pickle
        try:
            pickle.dumps(transform)
        except Exception as e:  # noqa: BLE001 -- any pickling failure
            raise ValueError(f"transform {transform!r} cannot be pickled for the data worker "
                             f"processes ({type(e).__name__}: {e}): make it a module-level "
                             "function (no lambda or closure), or set data_workers=0") from e
    if not len(split.labels):
        return
    maker = BatchMaker(split, np.arange(1), 1, (0, 1), seed=seed, epoch=0, augment=False,
                       image_size=image_shape[0] if image_shape else 224)
    augment.apply_transform(transform, maker(0)["image"][0], augment.transform_rng(seed, 0, 0))


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def resolve_workers(workers: int, split) -> int:
    """Worker processes for a split: ``workers`` (``-1`` = :func:`available_cores`).

    In-memory :class:`Split` arrays: always 0 (gathered in-process); a split
    read on demand (an ImageFolder, :mod:`trjax.data.sources`) may use them. ``-1``
    without grain installed: 0 (the in-process path gives the same batches).

    Raises:
      ValueError: ``workers < -1``, or ``workers > 0`` without grain installed
        (names the fix).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < -1:
        raise ValueError(f"data_workers={workers!r} must be -1 (the cores available), 0 (in this "
                         "process) or a number of worker processes")
    if (isinstance(split, Split) and isinstance(split.images, np.ndarray)) or workers == 0:
        return 0
    try:
        import grain  # noqa: F401 - optional extra
    except ImportError:
        if workers == -1:
            return 0
        raise ValueError(f"data_workers={workers} needs grain: pip install 'trjax[grain]' "
                         "(or set data_workers=0 to decode in this process)") from None
    return available_cores() if workers == -1 else workers


def _grain():
    """grain, with absl flags usable outside an absl app: grain 0.2.x reads its
    own flags when it starts workers, which absl refuses before flags are parsed
    (their defaults are what we want)."""
    import grain
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return grain


def iterate_batches(split, global_batch: int, *, shuffle: bool, seed: int = 0,
                    epoch: int = 0, remainder: str = "pad", rows: tuple | None = None,
                    start: int = 0, augment: bool = False,
                    image_shape: tuple | None = None, workers: int = 0,
                    skipped: set | None = None, transform=None) -> Iterator[dict]:
    """The global batches ``start, start + 1, ...`` of one epoch, padded (mask 0) or dropped.

    Args:
      split: a :class:`Split` or an on-demand source (``ImageFolder``).
      global_batch: G, rows per global batch.
      shuffle, seed, epoch: the order (:func:`epoch_order`).
      remainder: ``"pad"`` or ``"drop"`` for the last partial batch.
      rows: ``(lo, hi)``: yield only these rows of every global batch (the rows
        this process feeds, :meth:`trjax.world.World.process_rows`); only they
        are loaded. Default: all rows.
      start: the first batch (resuming mid-epoch: the batches are exactly the
        ones an uninterrupted pass yields from there).
      augment: in-memory splits: :func:`trjax.data.augment.crop_flip` (4-pixel zero
        padding, flip); on-demand sources: :func:`trjax.data.augment.train_crop`
        (RandomResizedCrop + flip), else :func:`trjax.data.augment.eval_crop`. Each
        example's draws come from ``example_rng(seed, epoch, index)``.
      image_shape: ``(S, S, 3)`` for on-demand sources (default 224).
      workers: worker processes for on-demand sources (:func:`resolve_workers`).
      skipped: a set that receives the paths of undecodable files skipped
        (masked out) by sources with ``skip_bad_images``.
      transform: a per-example augmentation ``transform(image [H, W, C], rng)
        -> image [H, W, C]`` (same shape and dtype,
        :func:`trjax.data.augment.apply_transform`), run on every real row after
        ``augment``'s crops, with ``rng`` =
        :func:`trjax.data.augment.transform_rng` ``(seed, epoch, index)``; in the
        worker processes when there are workers (it must then be picklable: a
        module-level function). The trainer passes it for training only.

    Yields:
      ``{"image": [hi - lo, H, W, C], "label": [hi - lo] int32, "mask": [hi - lo] float32,
      "index": [hi - lo] int64}``; images uint8 (or the in-memory split's own
      dtype); ``index`` is each row's example index in ``split`` (-1 on padding).

    Raises:
      BadImage (a ValueError): an undecodable file, naming it and the reason,
        without ``skip_bad_images``; with worker processes too, as the same type
        and message. Any other error of a worker is raised here as its own type
        too (:mod:`trjax.data.worker_errors`; a :class:`WorkerError` naming the
        type where the type cannot be rebuilt here).
    """
    n = len(split.labels)
    lo, hi = rows if rows is not None else (0, global_batch)
    steps = steps_per_epoch(n, global_batch, remainder)
    order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
    maker = BatchMaker(split, order, global_batch, (lo, hi), seed=seed, epoch=epoch,
                       augment=augment, image_size=image_shape[0] if image_shape else 224,
                       transform=transform)
    num_workers = resolve_workers(workers, split)
    if start >= steps:
        return
    if num_workers == 0:
        source, close = map(maker, range(start, steps)), None
    else:
        grain = _grain()
        ds = grain.MapDataset.range(start, steps).map(worker_errors.Catching(maker))
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        source = iter(ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=min(num_workers, steps - start), per_worker_buffer_size=2)))
        close = getattr(source, "close", None)
    try:
        for batch in source:
            if isinstance(batch, worker_errors.Failure):
                raise batch.rebuild()
            if skipped is not None:
                skipped.update(batch["skipped"])
            yield {k: np.asarray(batch[k]) for k in ("image", "label", "mask", "index")}
    finally:
        if close is not None:
            close()


def skipped_images(data: Dataset, seen: Iterable[str] = ()) -> list[str]:
    """Every file a run skipped: left out by the verify pass (``source.skipped``)
    or masked out while iterating (``seen``, the set given to :func:`iterate_batches`).
    Unique, sorted as text (:func:`trjax.data.imagefolder.text_key`, the same on every
    file system): ``len()`` is the count for ``summary.json``."""
    out = set(seen)
    for split in (data.train, data.val):
        out.update(getattr(split, "skipped", ()))
    return sorted(out, key=lambda p: (text_key(p), p))


# ---------------------------------------------------------------------------
# The host -> device boundary.
# ---------------------------------------------------------------------------


def device_image_dtype(host_dtype, compute_dtype) -> np.dtype:
    """The dtype images travel in: uint8 stays uint8; anything else is cast to ``compute_dtype``."""
    return np.dtype(np.uint8) if np.dtype(host_dtype) == np.uint8 else np.dtype(compute_dtype)


def _where(pos, step, index) -> str:
    """`` at position (..) [of the batch of step S] [(example I of the data set)]``."""
    out = f" at position {pos[0] if len(pos) == 1 else pos}"
    if step is not None:
        out += f" of the batch of step {step}"
    if index is not None and 0 <= int(index[pos[0]]):
        out += f" (example {int(index[pos[0]])} of the data set)"
    return out


def to_device(batch: dict, sharding, num_classes: int, dtype=np.float32, *,
              step: int | None = None) -> dict:
    """The one host->device boundary: checks, casts and shards a host batch.

    ``batch`` holds this process's rows of the global batch (all of them in a
    single-process run); the result is the global batch, sharded.

    Labels must be integers in ``[0, num_classes)`` (checked on real rows);
    they become int32. uint8 images travel as uint8 (the compiled step
    normalises them, :func:`trjax.models.normalize`); other images are cast explicitly to
    ``dtype`` (float64 and integer inputs are converted by value, never
    reinterpreted). Every real row's pixels must be finite both before AND
    after that cast: a value the device dtype cannot hold (uint16 65535 or
    float32 70000 in float16, a float64 1e300 in float32) would become inf on
    the device. The mask becomes float32.

    Args:
      batch: ``{"image": [B, ...], "label": [B], "mask": [B]}`` and optionally
        ``"index": [B]`` (each row's example index in the data set, -1 on
        padding, as :func:`iterate_batches` yields it), used in messages.
      sharding: the batch sharding (the world's data axis).
      num_classes: labels must lie in ``[0, num_classes)``.
      dtype: the compute dtype non-uint8 images are cast to.
      step: the 1-based step this batch feeds, named in messages (or ``None``).

    Raises:
      ValueError: a label out of range or not integral, a non-finite pixel, or
        a pixel the device dtype cannot represent (each names the value, the
        position in the batch, the step and the example index when known, and
        the dtypes), or mismatched leading dimensions.
    """
    images, labels = np.asarray(batch["image"]), np.asarray(batch["label"])
    mask = np.asarray(batch.get("mask", np.ones(len(labels), np.float32)))
    index = batch.get("index")
    index = None if index is None else np.asarray(index)
    if not (len(images) == len(labels) == len(mask)):
        raise ValueError(f"batch fields disagree on the batch size: image {images.shape}, "
                         f"label {labels.shape}, mask {mask.shape}")
    real = mask > 0
    if not np.issubdtype(labels.dtype, np.integer):
        if not np.all(np.equal(np.mod(labels[real], 1), 0)):
            pos = int(np.flatnonzero(real & (np.mod(labels, 1) != 0))[0])
            raise ValueError(f"label {labels[pos].item()!r}{_where((pos,), step, index)} "
                             "is not an integer class id")
    bad = real & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise ValueError(f"label {labels[pos].item()!r}{_where((pos,), step, index)} is outside "
                         f"[0, {num_classes}); fix the data or set num_classes")
    rows = real.reshape((-1,) + (1,) * (images.ndim - 1))
    if np.issubdtype(images.dtype, np.floating):
        nonfinite = rows & ~np.isfinite(images)
        if nonfinite.any():
            pos = tuple(int(i) for i in np.argwhere(nonfinite)[0])
            raise ValueError(f"image value {images[pos].item()!r}{_where(pos, step, index)} "
                             "is not finite")
    target = device_image_dtype(images.dtype, dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below
        cast = images.astype(target, copy=False)
    if np.issubdtype(target, np.floating) and cast is not images and \
            (np.issubdtype(images.dtype, np.integer) or
             np.finfo(images.dtype).max > np.finfo(target).max):
        overflow = rows & ~np.isfinite(cast)
        if overflow.any():
            pos = tuple(int(i) for i in np.argwhere(overflow)[0])
            raise ValueError(
                f"image value {images[pos].item()!r} ({images.dtype}){_where(pos, step, index)} "
                f"does not fit the device dtype {np.dtype(target).name} (largest "
                f"{float(np.finfo(target).max):g}); it would become inf. Scale the images "
                f"into range (e.g. to [0, 1] or uint8) or use a wider precision")
    host = {"image": cast, "label": labels.astype(np.int32, copy=False),
            "mask": mask.astype(np.float32, copy=False)}
    # Rows of this process only (all rows with one process): each process
    # hands over its part of the global batch.
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host.items()}
