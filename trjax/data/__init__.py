"""Data: sources, formats, per-example augmentation and the host input pipeline.

The pipeline's face: :func:`load_dataset` gives a :class:`Dataset` (uint8
images and int32 labels of a train and a val :class:`Split`);
:func:`iterate_batches` cuts an epoch into fixed-shape global batches with a
padding mask; :func:`prefetch` overlaps them with the devices' work;
:func:`to_device` is the one host->device boundary.

Modules: ``datasets`` (the sources and their registry: digits, CIFAR, MNIST,
ImageFolder), ``formats`` (CIFAR pickles, IDX files), ``imagefolder``,
``augment`` (crops and flips, keyed per example), ``input_pipeline`` (batches,
masks, worker processes, the host->device boundary), ``worker_errors`` (a
worker's exception raised in the parent as itself), ``prefetch``.

This package imports nothing else of trjax: models and steps never depend on it.
"""

from trjax.data.datasets import DATASETS, Dataset, Split, load_dataset  # noqa: F401
from trjax.data.input_pipeline import iterate_batches, steps_per_epoch, to_device  # noqa: F401
from trjax.data.prefetch import prefetch  # noqa: F401
