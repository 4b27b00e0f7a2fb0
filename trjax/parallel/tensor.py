"""The tensor-parallel (Megatron) :class:`~trjax.parallel.layout.Layout` of a trjax ResNet.

The layers, the mappings (``f``, ``g``, the gather) and which layers split
are :mod:`trjax.tensor`; this module lays a run out over a mesh with a
``model`` axis: the split network on local slices, the parameters', BN
statistics' and optimizer state's specs over ``model``, the gradient buckets
and BN sums reduced over ``data`` only (every model rank holds its own slice's
full gradient), traced with ``check_vma=False`` (the buckets mix split and
replicated leaves; the mappings are explicit).
"""

from __future__ import annotations

import dataclasses
import functools

from trjax import models, tensor
from trjax.parallel.layout import Layout, check_bn_mode, data_forward_backward


def _rename_leaves(tree, rename):
    if isinstance(tree, dict):
        return {rename.get(k, k): _rename_leaves(v, rename) for k, v in tree.items()}
    return tree


def layout(model, world, image_shape, bn_mode: str = "sync") -> Layout:
    """The tensor-parallel :class:`Layout` of a trjax ResNet on a world with a
    ``model`` axis (:data:`trjax.tensor.TENSOR_AXIS`).

    Its optimizer state's specs come with :meth:`Layout.with_exchange` (the
    exchange is built from the bucket plan, which needs these local shapes).

    Args:
      model: the unsplit :class:`trjax.models.Network` (or module) of a
        :class:`trjax.models.ResNet`.
      world: a world whose mesh has a ``model`` axis.
      image_shape: ``(H, W, C)``.
      bn_mode: ``running`` or ``sync`` (each device keeps the statistics of its
        own channels; the sums are reduced over ``data`` only).

    Raises:
      ValueError: not a trjax ResNet; ``bn_mode='local'``; a layer whose
        channels (or the head's classes) do not divide by the axis size
        (:func:`trjax.tensor.check_tensor_split`), before anything is traced.
    """
    net = models.as_network(model)
    if not isinstance(net.module, models.ResNet):
        cls = type(net.module)
        raise ValueError(f"a 'model' mesh axis splits trjax's own ResNets (Megatron, "
                         f"trjax.models.ResNet); your model {cls.__module__}.{cls.__qualname__} "
                         "is not one: use a built-in model or "
                         "a mesh with the data axis only")
    check_bn_mode(bn_mode, ("running", "sync"), "a 'model' axis (tensor parallel)")
    sizes, axis = dict(world.axes), world.axis_name
    split = tensor.split_model(net.module, tensor.TENSOR_AXIS, sizes[tensor.TENSOR_AXIS])
    variables = net.abstract_variables(image_shape)
    p_specs = tensor.param_specs(variables["params"], split)
    s_specs = tensor.stats_specs(variables["batch_stats"], split)
    network = dataclasses.replace(net, module=split)

    def local_shapes(params, batch_stats):
        return (tensor.local_shapes(params, p_specs, sizes),
                tensor.local_shapes(batch_stats, s_specs, sizes))

    return Layout(world=world, model=net, network=network, image_shape=tuple(image_shape),
                  bn_mode=bn_mode,
                  forward_backward=functools.partial(data_forward_backward, network, bn_mode,
                                                     axis),
                  grad_axes=axis, bn_reduce_axes=axis if bn_mode == "running" else None,
                  params=p_specs, batch_stats=s_specs,
                  folded=_rename_leaves(s_specs, {"mean": "scale", "var": "bias"})
                  if network.folds else s_specs,
                  check_vma=False, local_shapes=local_shapes, kind="tensor",
                  collective_labels={tensor.TENSOR_AXIS: {
                      "all-reduce": "tensor:Megatron f/g (partial sums of a split pair or the head)",
                      "all-gather": "tensor:head logits"}},
                  line=f"tensor parallel: {sizes[tensor.TENSOR_AXIS]}-way over "
                       f"'{tensor.TENSOR_AXIS}' ({len(tensor.split_layers(split))} layers split)")
