"""trjax: data-parallel training of ResNet-style CNNs in JAX.

Modules, in the order data flows: ``world`` (devices, mesh, batch split) ->
``models`` / ``batchnorm`` -> ``regions`` -> ``plan`` (MemoryPlan) ->
``collectives`` -> ``steps`` (compiled train/eval steps) -> ``train`` (loop).
"""

__version__ = "0.1.0"
