"""trjax: data-, pipeline- and tensor-parallel training of convolutional networks in JAX.

The design sits at the top of the package, one module per concept, in the
order data flows (each imports only modules above it):

* ``world`` -- devices, the named mesh and its axes, the global/local batch split.
* ``models``, ``batchnorm`` -- the built-in ResNets and any user flax model
  (linen or nnx, ``models.wrap``), whose BatchNorm layers get sync/running/local
  statistics (masked, count-weighted); ``models.normalize`` standardises the
  uint8 input inside the compiled step.
* ``metrics`` -- the per-step sums (``StepMetrics``); ``regions`` -> ``plan``
  (the MemoryPlan: gradient regions, the two buckets, the ZeRO-1 layout).
* ``collectives`` (bucket all-reduce, BN statistics, broadcast from rank 0),
  ``allreduce`` (ring, halving-doubling, tree, hierarchical), ``compression``,
  ``optim`` (SGD, LARS, the schedule), ``precision`` (bf16/fp16, loss scaling).
* ``exchange`` -- the gradient exchange, an optax-shaped ``(init, update)``
  pair (all-reduce, compressed, sharded optimizer state); ``state`` -- the
  TrainState and its one-program initialisation.
* ``tensor`` -- Megatron's mappings (``f``, ``g``, the gather) and which layers of a
  ResNet split over a ``model`` axis; ``objective`` -- the per-device forward +
  backward, the recipe's losses and mixing (``StepOptions``).
* ``steps`` -- the per-device train/eval steps inside ``shard_map``, built from a
  layout; ``aot`` -- compiled once ahead of time with fixed shapes and donation.
* ``comm`` (the compiled HLO's collectives) -> ``report`` (the comm report).

``trjax.parallel`` is parallelism's home: one ``Layout`` per mesh (``data_parallel``,
``parallel.tensor.layout``, ``parallel.pipeline.layout`` with GPipe and 1F1B;
``from_config`` chooses by ``config.mesh``), the only code that reads axis names.

The machinery lives in sub-packages: ``trjax.data`` (sources, augmentation,
the host input pipeline), ``trjax.cpu`` (the XLA:CPU backend, its compile
options, im2col), ``trjax.train`` (config, trainer, loop, checkpoints, stops,
several processes, the compilation cache, the ``trjax-train`` command in
``main``) and ``trjax.configs`` (the shipped configs). ``data`` and ``cpu`` import
nothing else of trjax; the design never imports ``data`` or ``train``; nothing
outside ``train`` imports it; ``parallel`` imports the design below the step (never
``steps``, ``data`` or ``train``) and only ``train`` imports ``parallel``
(``tests/test_imports.py`` checks the rule). On top of everything sit the commands
beside ``trjax-train``: ``trjax.export`` (``trjax-export``: a run's folded evaluation
through ``jax.export``) and ``trjax.tools`` (``trjax-plot``, ``trjax-tiny-cifar``); they
may import any of trjax and nothing imports them.

The entry point: ``from trjax.train import train_and_evaluate``.
"""

__version__ = "0.2.0"
