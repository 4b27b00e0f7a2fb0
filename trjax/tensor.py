"""Tensor parallelism (Megatron) for trjax's built-in ResNets, inside ``shard_map``.

Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3: a column-parallel
layer (output channels split over the ``model`` axis) followed by a
row-parallel one (input channels split) needs ONE all-reduce forward (``g``,
after the row layer) and ONE backward (``f``, of the column layer's input
cotangent). Here the pair is two convolutions of a residual block; the
classifier is column-parallel over classes and its logits are all-gathered.

What is split (:func:`split_layers`; by default the LAST stage's blocks and the
head, where the weights are and the activations are small:
``docs/parallelism.md``):

* ``BasicBlock``: ``f`` -> ``Conv_0`` (3x3, column) -> ``BatchNorm_0`` on its
  local channels (statistics reduced over the DATA axis only, as every trjax
  BatchNorm; no model-axis collective) -> ReLU -> ``Conv_1`` (3x3, row) ->
  ``g`` -> ``BatchNorm_1`` + shortcut (``proj_conv`` / ``proj_bn`` replicated)
  + ReLU, replicated.
* ``Bottleneck``: ``f`` -> ``Conv_0`` (1x1, column) -> ``BatchNorm_0`` local ->
  ReLU -> ``Conv_1`` (3x3, the widest, row; it carries the stride) -> ``g`` ->
  ``BatchNorm_1``, ``Conv_2``, ``BatchNorm_2`` and the projection replicated:
  13F^2 of a block's 17F^2 weights are split.
* head: ``f`` -> ``Dense`` column-parallel over classes (kernel ``[F, K]``
  split on ``K``, bias split) -> :func:`gather_from_model` -> logits ``[B, K]``.

Everything else is replicated over ``model``. The parameters are the unsplit
model's: initialise the full tree as always (``Network.init``), then store each
leaf as a global array of full shape with the :class:`PartitionSpec` of
:func:`param_specs` (:func:`shard_tree`); inside ``shard_map`` each device sees
its slice, so a split model's initial parameters are the unsplit ones' slices
bitwise (Megatron's ``tests/unit_tests/tensor_parallel/test_initialization.py``).

Why explicit mappings: the train step runs under ``shard_map(check_vma=False)``
(its gradient buckets mix model-split and replicated leaves), and there
autodiff inserts no ``f``: a replicated value entering model-split compute gets
no backward all-reduce, and plain ``lax.psum`` transposes to ``psum`` (measured,
jax 0.10.2: a ``T``-times gradient), not to the identity. So :func:`copy_to_model`,
:func:`reduce_from_model` and :func:`gather_from_model` are ``jax.custom_vjp``
pairs, as in ``megatron/core/tensor_parallel/mappings.py``
(``copy_to_tensor_model_parallel_region``, ``reduce_from_tensor_model_parallel_region``,
``gather_from_tensor_model_parallel_region``). They are typed for
``check_vma=True`` too (``f`` casts to varying, the gather is typed invariant),
so they give the same gradients there (tested on a small chain of matmuls;
the whole ResNet is validated under ``check_vma=False``, the step's mode).

Gradients: on every device a replicated leaf's gradient is the full gradient of
this data rank's rows (equal on every model rank), a split leaf's that of its
slice; the step then all-reduces both over ``data`` only, from local shapes
(:func:`local_shapes`), which are the same on every model rank.

Optimizer caveat: elementwise optimizers (SGD, momentum, Adam, weight decay)
need nothing. Per-layer norms (LARS/LAMB trust ratios) and global-norm clipping
would need the split leaves' squares summed over ``model``; the trainer refuses
them (and a user optimizer) on a ``model`` mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trjax.collectives import as_varying

TENSOR_AXIS = "model"
"""The mesh axis tensor parallelism splits over (:data:`trjax.world.MESH_AXES`)."""

BLOCK_ROLES = {"Conv_0": "column", "BatchNorm_0": "channel", "Conv_1": "row"}
"""The split layers of a ``BasicBlock`` and of a ``Bottleneck`` (same names in
both) and their role; a block class may override them with a ``tensor_roles``
class attribute."""

HEAD_ROLES = {"head": "head"}


# -- Megatron's f, g and gather (megatron/core/tensor_parallel/mappings.py) ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_model(x, axis: str):
    """Megatron's ``f``: the identity forward, ``psum`` over ``axis`` backward.

    Put it on a value replicated over ``axis`` (the same on every model rank)
    where it enters model-split compute (a column-parallel layer): each rank's
    cotangent is then only its slice's part, and their sum is the gradient.

    Args:
      x: any array (any dtype, any shape), replicated over ``axis``.
      axis: a mesh axis name bound by the enclosing ``shard_map``.

    Returns:
      ``x`` itself.

    Source: ``copy_to_tensor_model_parallel_region`` /
    ``_CopyToModelParallelRegion`` in ``megatron/core/tensor_parallel/mappings.py``.
    """
    return as_varying(x, axis)


def _copy_fwd(x, axis):
    return as_varying(x, axis), None


def _copy_bwd(axis, _, ct):
    return (lax.psum(ct, axis),)


copy_to_model.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_model(x, axis: str):
    """Megatron's ``g``: ``psum`` over ``axis`` forward, the identity backward.

    Put it after a row-parallel layer: each rank holds a partial sum of the
    full output; what follows is replicated, so every rank already holds the
    full cotangent (plain ``lax.psum`` under ``check_vma=False`` would sum
    ``T`` copies of it).

    Args:
      x: ``[...]`` float, this rank's partial sum.
      axis: a mesh axis name bound by the enclosing ``shard_map``.

    Returns:
      ``[...]`` the sum over ``axis``, replicated.

    Source: ``reduce_from_tensor_model_parallel_region`` /
    ``_ReduceFromModelParallelRegion`` in ``megatron/core/tensor_parallel/mappings.py``.
    """
    return lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return lax.psum(x, axis), None


def _reduce_bwd(axis, _, ct):
    return (as_varying(ct, axis),)


reduce_from_model.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_from_model(x, axis: str, dim: int = -1):
    """All-gather of model-split slices into the full array (tiled along ``dim``);
    backward: this rank's slice of the (replicated) cotangent, no collective.

    Args:
      x: ``[..., n, ...]``, this rank's slice along ``dim`` (e.g. the logits
        ``[B, K / T]`` of a column-parallel head).
      axis: a mesh axis name of size ``T`` bound by the enclosing ``shard_map``.
      dim: the dimension to concatenate along (rank ``r``'s slice lands at
        ``[r n, (r + 1) n)``, i.e. in ``lax.axis_index(axis)`` order).

    Returns:
      ``[..., T n, ...]``, the same on every rank.

    Source: ``gather_from_tensor_model_parallel_region`` /
    ``_GatherFromModelParallelRegion`` (backward ``_split_along_last_dim``) in
    ``megatron/core/tensor_parallel/mappings.py``.
    """
    return _gather(x, axis, dim)


def _gather(x, axis, dim):
    # typed invariant ("invarying", jax's all_gather_invariant): under check_vma=True a
    # replicated loss downstream then gets no implicit pcast (whose transpose would psum)
    return lax.all_gather(x, axis, axis=dim % x.ndim, tiled=True, to="invarying")


def _gather_fwd(x, axis, dim):
    return _gather(x, axis, dim), None


def _gather_bwd(axis, dim, _, ct):
    d = dim % ct.ndim
    n = ct.shape[d] // lax.axis_size(axis)
    return (lax.dynamic_slice_in_dim(as_varying(ct, axis), lax.axis_index(axis) * n, n, d),)


gather_from_model.defvjp(_gather_fwd, _gather_bwd)


# -- which layers are split -----------------------------------------------------------------


def split_stages(num_stages: int, stages: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The 1-based numbers of the stages whose blocks are split.

    Args:
      num_stages: the model's stage count (``len(stage_sizes)``).
      stages: ``None`` (the last stage, the default) or stage numbers, 1-based
        as in the parameter names ``stage{i}_block{j}``; ``-1`` is the last.

    Raises:
      ValueError: a stage number outside ``1..num_stages`` (or ``-num_stages..-1``).
    """
    if stages is None:
        return (num_stages,)
    out = []
    for s in stages:
        n = num_stages + 1 + int(s) if int(s) < 0 else int(s)
        if not 1 <= n <= num_stages:
            raise ValueError(f"tensor_stages={tuple(stages)!r}: stage {s} is not one of "
                             f"1..{num_stages} (or -1 for the last)")
        out.append(n)
    return tuple(sorted(set(out)))


def _require_resnet(module):
    for field in ("stage_sizes", "widths", "num_classes", "tensor_axis", "tensor_size"):
        if not hasattr(module, field):
            raise TypeError(f"{type(module).__name__} has no {field!r}: tensor parallelism covers "
                            "trjax's built-in ResNets (trjax.models.ResNet, e.g. "
                            "create_model('resnet20'))")


def split_layers(module) -> dict[tuple, str]:
    """The layers tensor parallelism splits and their role.

    Args:
      module: a :class:`trjax.models.ResNet` (its ``stage_sizes``, ``block``,
        ``tensor_stages``, ``tensor_head``; the plan does not depend on
        ``tensor_size``).

    Returns:
      ``{module path tuple: role}``, e.g. ``{("stage3_block1", "Conv_0"):
      "column", ("stage3_block1", "BatchNorm_0"): "channel",
      ("stage3_block1", "Conv_1"): "row", ("head",): "head"}``.

    Raises:
      TypeError: not a trjax ResNet. ValueError: bad ``tensor_stages``.
    """
    _require_resnet(module)
    roles = dict(getattr(module.block, "tensor_roles", BLOCK_ROLES))
    out = {}
    for s in split_stages(len(module.stage_sizes), getattr(module, "tensor_stages", None)):
        for j in range(module.stage_sizes[s - 1]):
            for layer, role in roles.items():
                out[(f"stage{s}_block{j + 1}", layer)] = role
    if getattr(module, "tensor_head", True):
        out.update({(k,): v for k, v in HEAD_ROLES.items()})
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_split(module, size: int) -> None:
    """Checks, before anything is traced, that ``module`` splits ``size`` ways.

    Every split block's stage width (``Conv_0``'s output channels, ``Conv_1``'s
    input channels) and, with ``tensor_head``, ``num_classes`` must divide by
    ``size``.

    Raises:
      TypeError: not a trjax ResNet.
      ValueError: ``size`` not a positive int, or a layer whose channels do not
        divide, naming the layer, its channel count, the sizes that do divide
        every split layer, and the alternatives (``tensor_stages``,
        ``tensor_head=False``, another ``num_classes``).
    """
    _require_resnet(module)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"tensor size {size!r} must be a positive int (the mesh's model axis)")
    counts = {}
    for (block, layer), role in ((k, v) for k, v in split_layers(module).items() if len(k) == 2):
        if role == "column":
            s = int(block[len("stage"):block.index("_")])
            counts[f"{block}/{layer}"] = ("output channels", int(module.widths[s - 1]))
    if getattr(module, "tensor_head", True):
        counts["head"] = ("classes (num_classes)", int(module.num_classes))
    valid = functools.reduce(lambda a, b: [d for d in a if d in b],
                             [_divisors(c) for _, c in counts.values()])
    for layer, (what, c) in counts.items():
        if c % size:
            hint = ("; or keep the head replicated (tensor_head=False), or use a num_classes "
                    f"that is a multiple of {size}" if layer == "head" else
                    "; or split other stages (tensor_stages=...)")
            raise ValueError(f"tensor parallelism over {size} devices splits {layer}, whose {c} "
                             f"{what} do not divide by {size}: the model axis sizes that divide "
                             f"every split layer are {valid}{hint}")


def split_model(module, axis: str = TENSOR_AXIS, size: int = 2, **options):
    """The tensor-parallel version of a trjax ResNet, to apply INSIDE ``shard_map``
    (with ``axis`` bound, of size ``size``) to the local parameter slices.

    Args:
      module: a :class:`trjax.models.ResNet`.
      axis: the model axis name.
      size: the model axis size ``T``.
      **options: ``tensor_stages`` (1-based stage numbers, default the last),
        ``tensor_head`` (default True).

    Returns:
      ``module.clone(tensor_axis=axis, tensor_size=size, **options)``: the same
      parameter tree (paths) as ``module``, with local shapes
      (:func:`local_shapes`), and full logits ``[B, num_classes]`` float32 on
      every rank. ``size == 1`` gives a model bitwise equal to ``module``.

    Raises:
      TypeError, ValueError: from :func:`check_tensor_split`.
    """
    _require_resnet(module)
    out = module.clone(tensor_axis=axis, tensor_size=int(size), **options)
    check_tensor_split(out, int(size))
    return out


# -- partition specs and local shapes --------------------------------------------------------


def _leaf_spec(role: Optional[str], name: str, ndim: int, axis: str) -> P:
    if role == "column" and name == "kernel":
        return P(*([None] * (ndim - 1) + [axis]))
    if role == "row" and name == "kernel":
        return P(*([None] * (ndim - 2) + [axis, None]))
    if role in ("channel", "column", "head") and ndim == 1:  # BN scale/bias/mean/var, biases
        return P(axis)
    if role == "head" and name == "kernel":
        return P(None, axis)
    return P()


def _keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _specs(tree, module, axis):
    roles = split_layers(module)
    seen = set()

    def spec(path, leaf):
        keys = _keys(path)
        role = roles.get(keys[:-1])
        if role is not None:
            seen.add(keys[:-1])
        return _leaf_spec(role, keys[-1], len(leaf.shape), axis)
    out = jax.tree_util.tree_map_with_path(spec, tree)
    return out, seen, roles


def param_specs(params, module, axis: Optional[str] = None):
    """The :class:`PartitionSpec` of every parameter of a tensor-parallel ResNet.

    Args:
      params: the full (unsplit) parameter tree (arrays or ``ShapeDtypeStruct``;
        only paths and ranks are read), as ``Network.init`` gives it.
      module: the :class:`trjax.models.ResNet` (its plan, :func:`split_layers`).
      axis: the model axis name; default ``module.tensor_axis`` or ``"model"``.

    Returns:
      A tree like ``params`` of ``PartitionSpec``: column conv kernels
      ``P(None, None, None, axis)``, row conv kernels ``P(None, None, axis, None)``,
      split BatchNorm ``scale``/``bias`` ``P(axis)``, head kernel ``P(None, axis)``
      and bias ``P(axis)``; every other leaf ``P()`` (replicated).

    Raises:
      ValueError: a split layer of the plan missing from ``params`` (another model's tree).
    """
    axis = axis or module.tensor_axis or TENSOR_AXIS
    out, seen, roles = _specs(params, module, axis)
    missing = sorted("/".join(k) for k in set(roles) - seen)
    if missing:
        raise ValueError(f"params hold no {missing}: they are not this module's "
                         f"({type(module).__name__}) parameters")
    return out


def stats_specs(batch_stats, module, axis: Optional[str] = None):
    """The :class:`PartitionSpec` of every BatchNorm running statistic
    (``{"mean", "var"}`` ``[C]`` leaves, :mod:`trjax.batchnorm`): ``P(axis)``
    for the split (``channel``) BatchNorms, ``P()`` otherwise. Each device keeps
    and updates the running statistics of its own channels; in ``running`` mode
    the step all-reduces the BatchNorm sums over ``data`` only, as now.

    Args, Raises: as :func:`param_specs` (``batch_stats`` for ``params``).
    """
    axis = axis or module.tensor_axis or TENSOR_AXIS
    out, seen, roles = _specs(batch_stats, module, axis)
    missing = sorted("/".join(k) for k, r in roles.items() if r == "channel" and k not in seen)
    if missing:
        raise ValueError(f"batch_stats hold no {missing}: they are not this module's statistics")
    return out


def _local_dim(dim: int, entry, sizes: Mapping[str, int], where: str) -> int:
    if entry is None:
        return dim
    names = entry if isinstance(entry, tuple) else (entry,)
    n = math.prod(int(sizes[a]) for a in names)
    if dim % n:
        raise ValueError(f"{where}: dimension {dim} split over {names} ({n} devices) does not "
                         "divide (check_tensor_split names the layer and the valid sizes)")
    return dim // n


def local_shapes(tree, specs, sizes: Mapping[str, int]):
    """Per-device shapes of a tree of global arrays laid out by ``specs``.

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` of the full (global) shapes.
      specs: a matching tree of ``PartitionSpec`` (:func:`param_specs`).
      sizes: ``{axis name: size}``, e.g. ``dict(mesh.shape)``.

    Returns:
      A tree of ``jax.ShapeDtypeStruct`` (same dtypes): each dimension divided
      by the size of the axes its spec entry names. The train step's bucket
      plan is built from these (the same on every model rank).

    Raises:
      ValueError: a dimension that does not divide, naming the leaf.
    """
    def one(path, leaf, spec):
        shape = tuple(leaf.shape)
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        where = jax.tree_util.keystr(path)
        return jax.ShapeDtypeStruct(
            tuple(_local_dim(d, e, sizes, where) for d, e in zip(shape, entries)), leaf.dtype)
    return jax.tree_util.tree_map_with_path(one, tree, specs,
                                            is_leaf=lambda x: isinstance(x, P))


def shard_tree(tree, specs, mesh):
    """``tree``'s full arrays as global ``jax.Array`` laid out on ``mesh`` by ``specs``
    (``jax.device_put`` with ``NamedSharding(mesh, spec)``): each device holds its
    slice, bitwise the full array's. Pass the result to a ``shard_map`` whose
    ``in_specs`` are ``specs``.

    Args:
      tree: arrays of full shape (host or device).
      specs: a matching tree of ``PartitionSpec`` (:func:`param_specs`, :func:`stats_specs`).
      mesh: a :class:`jax.sharding.Mesh` with the axes the specs name.
    """
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                  tree, specs, is_leaf=lambda x: isinstance(x, P))
