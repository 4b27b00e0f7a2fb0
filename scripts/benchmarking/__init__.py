"""scripts/benchmark.py's modes, one module each (``scripts/benchmark.py`` is the entry point).

* :mod:`.common`: the command line (every mode's flags), the environment set before
  jax starts, the random data set and the config of a throughput variant.
* :mod:`.variants`: what is timed: a trjax train step built by the trainer
  (:class:`~.variants.JaxVariant`), a server process answering ``run K``
  (:class:`~.variants.ServerVariant`: the PyTorch DDP baseline or a ``--serve``
  child), and the interleaved timing rounds.
* :mod:`.throughput`: the CPU throughput benchmark (one process per world size)
  and its JSON / markdown / plot outputs.
* :mod:`.gpu`: the GPU benchmark (``--gpu``, ``--gpu --dry_run``).
* :mod:`.cpu_profile`: ``--profile``, each CPU idea in its own process side by side.
* :mod:`.serve`: the ``--serve`` child of ``--profile``.
* :mod:`.time_to_accuracy`: ``--time_to_accuracy``, the main job start to finish
  (trjax with a cold and a warm compilation cache, and its PyTorch DDP twin).
"""
