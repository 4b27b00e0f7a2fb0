"""trjax: data-parallel training of ResNet-style CNNs in JAX.

Modules, in the order data flows:

* ``world`` -- devices, mesh, batch split; ``distributed`` -- several processes;
  ``host`` -- the CPU backend (simulated devices, convolution library, memory).
* ``datasets`` (the sources and their one registry: digits, CIFAR, MNIST via
  ``formats``, ImageFolder via ``imagefolder``) -> ``augment`` (per-example
  crops and flips) -> ``input_pipeline`` (batches, masks, worker processes,
  prefetch, ``normalize``, the host->device boundary).
* ``models`` / ``batchnorm`` -- ResNets with sync/running/local BatchNorm.
* ``regions`` -> ``plan`` (the MemoryPlan and bucket policies).
* ``collectives`` (buckets, BN statistics, broadcast), ``allreduce`` (ring,
  halving-doubling, tree, hierarchical), ``compression``.
* ``optim``, ``precision`` -> ``steps`` (compiled train/eval steps) -> ``train``
  (the loop), ``checkpoint``; ``comm`` / ``report`` read the compiled HLO.
"""

__version__ = "0.1.0"
