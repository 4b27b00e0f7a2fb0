"""The tensor-parallel (Megatron) :class:`~trjax.parallel.layout.Layout` of any flax model.

The mappings (``f``, ``g``, the gather) are :mod:`trjax.tensor`; which layers
split is a tensor plan (:mod:`trjax.tensor_plan`; a built-in ResNet's default
is :func:`trjax.tensor_plan.default_plan`). This module lays a run out over a
mesh with a ``model`` axis: the network with the plan applied to flax's own
layers, on local slices, the parameters', BN
statistics' and optimizer state's specs over ``model``, the gradient buckets
and BN sums reduced over ``data`` only (every model rank holds its own slice's
full gradient), traced with ``check_vma=False`` (the buckets mix split and
replicated leaves; the mappings are explicit).
"""

from __future__ import annotations

import dataclasses
import functools

from trjax import models, tensor, tensor_plan
from trjax.parallel.layout import Layout, check_bn_mode, data_forward_backward


def _rename_leaves(tree, rename):
    if isinstance(tree, dict):
        return {rename.get(k, k): _rename_leaves(v, rename) for k, v in tree.items()}
    return tree


def layout(model, world, image_shape, bn_mode: str = "sync", plan=None) -> Layout:
    """The tensor-parallel :class:`Layout` on a world with a ``model`` axis
    (:data:`trjax.tensor.TENSOR_AXIS`): any flax model split by a tensor plan
    (:mod:`trjax.tensor_plan`), a trjax ResNet by default by its own
    (:func:`trjax.tensor_plan.default_plan`: the last stage's block pairs and the head).

    Its optimizer state's specs come with :meth:`Layout.with_exchange` (the
    exchange is built from the bucket plan, which needs these local shapes).

    Args:
      model: the unsplit :class:`trjax.models.Network` (or module).
      world: a world whose mesh has a ``model`` axis.
      image_shape: ``(H, W, C)``.
      bn_mode: ``running`` or ``sync`` (each device keeps the statistics of its
        own channels; the sums are reduced over ``data`` only).
      plan: ``{pattern: "column" | "row"}`` or ``"pattern=role,..."``
        (:func:`trjax.tensor_plan.parse`); ``None`` or empty: a ResNet's own split.

    Raises:
      ValueError: a model that is not a trjax ResNet without a plan (naming
        its Conv/Dense layers); ``bn_mode='local'``; a layer whose channels (or
        the head's classes) do not divide by the axis size, or a bad plan
        (:func:`trjax.tensor_plan.resolve`), before anything is traced.
    """
    net = models.as_network(model)
    check_bn_mode(bn_mode, ("running", "sync"), "a 'model' axis (tensor parallel)")
    sizes, axis = dict(world.axes), world.axis_name
    T = sizes[tensor.TENSOR_AXIS]
    variables = net.abstract_variables(image_shape)
    resnet = isinstance(net.module, models.ResNet)
    own_plan = bool(plan)
    if resnet and not plan:  # its own split, as a plan (tensor_stages, tensor_head choose it)
        tensor.check_tensor_split(net.module, T)
        plan = tensor_plan.default_plan(net.module)
    if not plan:
        layers = sorted({"/".join(p) for p, kind, _, _ in tensor_plan.calls(net, image_shape)
                         if kind == "layer"})
        cls = type(net.module)
        raise ValueError(f"a 'model' mesh axis splits a model by a tensor plan; your model "
                         f"{cls.__module__}.{cls.__qualname__} has none: set "
                         "config.tensor_plan='<conv>=column,<next conv>=row,<head>=column' "
                         f"from its layers {layers[:24]}, or use a mesh with the data axis only")
    roles = tensor_plan.resolve(net, plan, image_shape, T, tensor.TENSOR_AXIS)
    network = dataclasses.replace(net, tensor_roles=roles, tensor_axis=tensor.TENSOR_AXIS,
                                  tensor_size=T)
    if resnet:  # unsplit blocks: the plan splits them
        network = dataclasses.replace(network, module=net.module.clone(tensor_axis=None,
                                                                       tensor_size=1))
    p_specs = tensor_plan.specs(variables["params"], roles)
    s_specs = tensor_plan.specs(variables["batch_stats"], roles)
    count = len([r for r in roles.values() if r != "channel"])

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
                  line=f"tensor parallel: {T}-way over '{tensor.TENSOR_AXIS}' ({count} layers "
                       "split" + (", by config.tensor_plan)" if own_plan else ")"))
