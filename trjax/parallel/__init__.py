"""Parallelism's home: one :class:`Layout` per mesh, the only code that reads
axis names.

A layout says what a mesh means for the train state and the step: the
per-device network, the state's and the batch's ``PartitionSpec`` trees, the
axes the gradient buckets and the BN sums are reduced over, and ONE
``forward_backward`` with one signature, which :func:`trjax.steps.make_train_step`
calls whatever the mesh. Constructors:

* :func:`data_parallel` (``data``): the bottom of every composition;
* :func:`trjax.parallel.tensor.layout` (``model``: Megatron tensor parallelism of
  any flax model by a tensor plan keyed by module path);
* :func:`trjax.parallel.pipeline.layout` (``stage``: GPipe / 1F1B / ZB-H1, with
  stage-owned parameters, :mod:`~trjax.parallel.stage_owned`, and the zero-bubble
  schedule, :mod:`~trjax.parallel.zero_bubble`);
* :func:`trjax.parallel.fsdp.layout` (``fsdp``: FSDP / ZeRO-3, the parameters,
  gradients and optimizer state sharded over ``fsdp``);

each ``layout(base, ...)`` adding its axis to ``base``, and :func:`from_config`
composing them by ``config.mesh``. The ground floor every strategy imports:
:mod:`~trjax.parallel.layout`, :mod:`~trjax.parallel.shards` (the leaf-splitting
arithmetic) and :mod:`~trjax.parallel.mappings` (Megatron's ``f``, ``g`` and
gather); no strategy imports another, only :mod:`~trjax.parallel.mesh` composes
them. Import rule (tested):
this package imports the modules below the step (models, objective,
batchnorm, collectives, comm, world), never :mod:`trjax.steps`,
:mod:`trjax.train` or :mod:`trjax.data`; those read a layout's fields and
never import this package, except the trainer (:mod:`trjax.train`), which
builds the layout.
"""

from trjax.parallel import fsdp, pipeline, tensor  # noqa: F401
from trjax.parallel.layout import Layout, data_parallel, like_params  # noqa: F401
from trjax.parallel.mesh import (check_config, from_config, mesh_sizes,  # noqa: F401
                                 pipeline_microbatches)
