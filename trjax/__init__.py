"""trjax: data-parallel training of ResNet-style CNNs in JAX.

Modules, in the order data flows:

* ``world`` -- devices, mesh, batch split; ``distributed`` -- several processes;
  ``host`` -- the CPU backend (simulated devices, convolution library, memory).
* ``input_pipeline`` (digits, batches, masks, the host->device boundary),
  ``datasets`` (CIFAR, MNIST, ImageFolder, augmentation, prefetch).
* ``models`` / ``batchnorm`` -- ResNets with sync/running/local BatchNorm.
* ``regions`` -> ``plan`` (the MemoryPlan and bucket policies).
* ``collectives`` (buckets, BN statistics, broadcast), ``allreduce`` (ring,
  halving-doubling, tree, hierarchical), ``compression``.
* ``optim``, ``precision`` -> ``steps`` (compiled train/eval steps) -> ``train``
  (the loop), ``checkpoint`` (asynchronous orbax saves), ``compilation`` (the
  persistent compilation cache, compiles counted by phase); ``comm`` / ``report``
  read the compiled HLO.
"""

__version__ = "0.1.0"
