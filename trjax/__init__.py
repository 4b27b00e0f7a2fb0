"""trjax: data-parallel training of ResNet-style CNNs in JAX.

Modules, in the order data flows (each imports only modules above it):

* ``world`` -- devices, mesh, batch split; ``distributed`` -- several processes;
  ``host`` -- the CPU backend (simulated devices, convolution library, memory).
* ``datasets`` (the sources and their one registry: digits, CIFAR, MNIST via
  ``formats``, ImageFolder via ``imagefolder``) -> ``augment`` (per-example
  crops and flips) -> ``input_pipeline`` (batches, masks, worker processes,
  prefetch, ``normalize``, the host->device boundary).
* ``models`` / ``batchnorm`` -- ResNets with sync/running/local BatchNorm.
* ``metrics`` (the per-step sums, ``StepMetrics``), ``regions`` -> ``plan``
  (the MemoryPlan, bucket policies, the ZeRO-1 layout).
* ``collectives`` (buckets, BN statistics, broadcast), ``allreduce`` (ring,
  halving-doubling, tree, hierarchical), ``compression``, ``optim``,
  ``precision``.
* ``exchange`` -- the gradient exchange (one strategy: all-reduce, compressed,
  sharded optimizer state); ``state`` -- the TrainState.
* ``steps`` (the per-device train/eval steps) -> ``aot`` (ahead-of-time
  compiled steps); ``config`` (config files and validation) -> ``train`` (the
  loop), ``checkpoint`` (asynchronous orbax saves), ``compilation``
  (the persistent compilation cache, compiles counted by phase); ``comm`` / ``report`` read the compiled HLO.
"""

import hashlib as _hashlib
import os as _os

__version__ = "0.1.0"


def source_digest_on_disk() -> str:
    """SHA-256 of every ``.py`` file of the trjax package (relative path and bytes), as on disk now."""
    root = _os.path.dirname(_os.path.abspath(__file__))
    h = _hashlib.sha256()
    for dirpath, dirnames, filenames in _os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = _os.path.join(dirpath, f)
                h.update(_os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


SOURCE_DIGEST = source_digest_on_disk()
""":func:`source_digest_on_disk` when this process imported trjax: the code it
runs (:mod:`trjax.executables` keys stored programs by it; a file edited later,
e.g. a branch switched while a run loads its data, changes what is on disk, not
what runs)."""
