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
* ``objective`` -- the per-device forward + backward, the recipe's losses and
  mixing (``StepOptions``).
* ``steps`` -- the per-device train/eval steps inside ``shard_map``, built from a
  layout; ``aot`` -- compiled once ahead of time with fixed shapes and donation.
* ``comm`` (the compiled HLO's collectives) -> ``report`` (the comm report).

``trjax.parallel`` is parallelism's home, the only code that decides what a mesh
axis means: one ``Layout`` per mesh, composed by ``parallel.from_config``
(``parallel/mesh.py``) from ``data_parallel`` (``parallel/layout.py``) upwards, each
strategy's ``layout(base, ...)`` adding its axis: ``parallel/tensor.py`` (``model``:
Megatron's split of any flax model by a plan keyed by module path),
``parallel/pipeline.py`` (``stage``: the stage runner and the layout, with
``stages.py``, ``schedules.py`` (GPipe, 1F1B), ``zero_bubble.py`` (ZB-H1) and
``stage_owned.py``), ``parallel/fsdp.py`` (``fsdp``: ZeRO-3). Their ground floor:
``parallel/shards.py`` (the leaf-splitting arithmetic) and ``parallel/mappings.py``
(Megatron's ``f``, ``g``, gather). The axis names are one table in ``world``.

The machinery lives in sub-packages: ``trjax.data`` (data sets, ``sources`` --
records, HF and ArrayRecord --, augmentation, the host input pipeline), ``trjax.cpu`` (the XLA:CPU backend, its compile
options, im2col), ``trjax.train`` (config, trainer, loop, checkpoints, stops,
several processes, the compilation cache, ``init_from`` (published weights), the
``trjax-train`` command in ``main``) and ``trjax.configs`` (the shipped configs). ``data`` and ``cpu`` import
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
