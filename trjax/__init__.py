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

__version__ = "0.1.0"
