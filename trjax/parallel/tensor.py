"""Tensor parallelism (Megatron) for any flax CNN: a plan keyed by module path, and its
:class:`~trjax.parallel.layout.Layout` over a ``model`` axis.

A plan names layers by module path, as torchtitan's ``parallelize_module``
names them with ``ColwiseParallel`` / ``RowwiseParallel``::

    {"Conv_1": "column", "Conv_2": "row", "Dense_0": "column"}
    "layers_3=column,layers_6=row,layers_9=column"      # config.tensor_plan

A pattern matches a path component by component (``*`` stands for one
component, ``fnmatch`` syntax inside it: ``"stage3_block*/Conv_0"``). The
layers a plan may name are flax's own ``nn.Conv`` / ``nn.Dense`` (linen) and
``nnx.Conv`` / ``nnx.Linear`` (nnx). :func:`resolve` traces the model once,
abstractly, and reads the call order:

* a ``column`` layer (output channels split over the ``model`` axis) whose next
  convolution or dense layer is a ``row`` one forms a Megatron pair (Shoeybi et
  al., "Megatron-LM", arXiv 1909.08053, section 3): Megatron's ``f`` before the
  column layer, ``g`` (one all-reduce) after the row layer, the row layer's
  bias added once after it; the BatchNorms called between the two normalise
  their local channels (role ``channel``; their statistics are reduced over
  ``data`` only, as every BatchNorm's);
* a ``column`` layer followed by anything else (the classifier) has its output
  all-gathered (role ``head``: torchtitan's ``ColwiseParallel(output_layouts=
  Replicate())``).

Every other layer is replicated. The parameters are the unsplit model's, each
device holding its slice (:func:`specs`: a checkpoint stays the whole tree);
the mappings are :mod:`trjax.parallel.mappings`. Applying the plan is an
interception of flax's own layers, as trjax already intercepts flax's
BatchNorm: a :class:`Plan` is the :class:`trjax.models.Network`'s
``layer_plan`` (:func:`linen_interceptor`, :func:`swap_nnx_layers`). A built-in
ResNet splits by :func:`default_plan` (the last stage's block pairs and the
head, where the weights are and the activations are small).

The optimizer: elementwise ones (SGD, momentum, Adam, weight decay) run on each
device's slices; per-layer norms (LARS) and global-norm clipping need the split
leaves' squares summed over ``model``, which the train step gets by updating the
global arrays (:func:`trjax.steps.make_train_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trjax import comm
from trjax.batchnorm import BatchNorm
from trjax.remat import matches
from trjax.parallel.layout import Layout, check_bn_mode, data_forward_backward
from trjax.parallel.mappings import copy_to_model, gather_from_model, reduce_from_model
from trjax.parallel.shards import local_shapes, path_keys
from trjax.world import MODEL_AXIS

ROLES = ("column", "row")
"""What a plan may say of a layer."""


def parse(text) -> dict[str, str]:
    """``{pattern: role}`` from a dict (returned checked) or ``config.tensor_plan``'s
    ``"pattern=role,pattern=role"`` (``""``: no plan, ``{}``).

    Raises:
      ValueError: an item without ``=``, an empty pattern, or a role other than
        :data:`ROLES`, naming the item and the form.
    """
    items = list(text.items()) if isinstance(text, Mapping) else [
        tuple(p.strip() for p in item.split("=", 1)) if "=" in item else (item.strip(), None)
        for item in str(text).split(",") if item.strip()]
    out = {}
    for pattern, role in items:
        if not pattern or role not in ROLES:
            raise ValueError(f"tensor plan item {pattern!r}: {role!r} is not one of {list(ROLES)}; "
                             "write 'path/to/Conv_0=column,path/to/Conv_1=row' (module paths, "
                             "'*' for one path component)")
        out[str(pattern)] = role
    return out


def _kind(module) -> str | None:
    """``"layer"`` (a layer a plan may split), ``"norm"`` (BatchNorm, which may
    run on split channels), ``"mixes"`` (a norm over channels that may not) or
    ``None``."""
    import sys
    nnx = sys.modules.get("flax.nnx")
    if isinstance(module, (nn.Conv, nn.Dense)) or (
            nnx is not None and isinstance(module, (nnx.Conv, nnx.Linear))):
        return "layer"
    if isinstance(module, (nn.BatchNorm, BatchNorm)) or (
            nnx is not None and isinstance(module, nnx.BatchNorm)):
        return "norm"
    if isinstance(module, (nn.GroupNorm, nn.LayerNorm)) or (
            nnx is not None and isinstance(module, (nnx.GroupNorm, nnx.LayerNorm))):
        return "mixes"
    return None


def _width(module) -> int:
    return int(getattr(module, "features", None) or getattr(module, "out_features"))


# -- applying a resolved plan: flax's own layers intercepted ----------------------------------


def _linen_split_call(mod, role: str, axis: str, size: int, args, kwargs):
    """A linen ``nn.Conv`` / ``nn.Dense`` on this device's parameter slices: a
    clone with the local output width (column) or without its bias (row; the
    bias is added once, after ``g``), applied to the bound layer's own
    parameters (flax checks a parameter's shape against the layer's fields)."""
    own = dict(mod.variables["params"])
    x, rest = args[0], args[1:]
    if role in ("column", "head"):
        local = mod.clone(parent=None, features=mod.features // size)
        y = local.apply({"params": own}, copy_to_model(x, axis), *rest, **kwargs)
        return gather_from_model(y, axis, -1) if role == "head" else y
    bias = own.pop("bias", None)
    y = mod.clone(parent=None, use_bias=False).apply({"params": own}, x, *rest, **kwargs)
    y = reduce_from_model(y, axis)
    return _add_bias(y, bias)


def _add_bias(y, bias):
    """``y + bias`` over the last (channel) dimension, as flax adds it."""
    if bias is None:
        return y
    return y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def linen_interceptor(roles: Mapping[tuple, str], axis: str = MODEL_AXIS,
                      size: int = 1, record: list | None = None, shapes: dict | None = None):
    """A :func:`flax.linen.intercept_methods` interceptor that applies a resolved
    plan (``{module path: role}``, :func:`resolve`) to flax's ``nn.Conv`` /
    ``nn.Dense`` inside ``shard_map`` (``axis`` bound, of ``size`` devices;
    ``channel`` BatchNorms need nothing: their parameters are already local).
    ``record``: a list that gets ``(path, kind, module, input channels)`` of every
    layer and norm call in call order (:func:`resolve`'s trace); ``shapes``: a dict
    that gets ``{path: (input shape, output shape)}`` of every unsplit layer call,
    the leading (batch) dimension dropped (:func:`split_layers`'s trace)."""
    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or mod.is_initializing():
            return next_fun(*args, **kwargs)
        path = tuple(str(p) for p in mod.path)
        if record is not None and _kind(mod) is not None:
            record.append((path, _kind(mod), mod, int(args[0].shape[-1])))
        role = roles.get(path)
        if role in ("column", "head", "row"):
            return _linen_split_call(mod, role, axis, size, args, kwargs)
        out = next_fun(*args, **kwargs)
        if shapes is not None and _kind(mod) == "layer":
            shapes[path] = (tuple(args[0].shape[1:]), tuple(out.shape[1:]))
        return out
    return intercept


def _nnx_split_call(base, self, role: str, axis: str, x, args, kwargs):
    if role in ("column", "head"):
        y = base(self, copy_to_model(x, axis), *args, **kwargs)
        return gather_from_model(y, axis, -1) if role == "head" else y
    bias, use = self.bias, self.use_bias
    self.bias, self.use_bias = None, False
    try:
        y = base(self, x, *args, **kwargs)
    finally:
        self.bias, self.use_bias = bias, use
    y = reduce_from_model(y, axis)
    return _add_bias(y, None if bias is None else bias[...])


def swap_nnx_layers(model, roles: Mapping[tuple, str], axis: str = MODEL_AXIS,
                    record: list | None = None, shapes: dict | None = None) -> None:
    """:func:`linen_interceptor` for an nnx model: every ``nnx.Conv`` /
    ``nnx.Linear`` the plan splits (and, with ``record`` or ``shapes``, every layer
    and norm; both as :func:`linen_interceptor` fills them)
    becomes, on this copy of the model (``nnx.merge`` inside the step), a
    subclass whose ``__call__`` applies its role. nnx layers read their kernel's
    shape from the array itself, so the local slices need no clone."""
    from flax import nnx
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        key, kind = tuple(str(p) for p in path), _kind(node)
        role = roles.get(key) if kind == "layer" else None
        if role not in ("column", "head", "row") and record is None and shapes is None:
            continue
        if kind is None:
            continue
        base = type(node).__call__

        def call(self, x, *args, _base=base, _role=role, _key=key, _kind=kind, **kwargs):
            if record is not None:
                record.append((_key, _kind, self, int(x.shape[-1])))
            if _role is None:
                out = _base(self, x, *args, **kwargs)
                if shapes is not None and _kind == "layer":
                    shapes[_key] = (tuple(x.shape[1:]), tuple(out.shape[1:]))
                return out
            return _nnx_split_call(_base, self, _role, axis, x, args, kwargs)
        node.__class__ = type(type(node).__name__, (type(node),), {"__call__": call})


# -- resolving a plan against a model's call order ---------------------------------------------


def calls(net, image_shape, shapes: dict | None = None) -> list[tuple]:
    """Every convolution / dense layer and norm a :class:`trjax.models.Network`
    calls on one ``image_shape`` example, in call order: ``(path, kind, module,
    input channels)`` (traced abstractly in evaluation mode; nothing runs);
    ``shapes``: a dict that gets each layer's ``(input shape, output shape)``."""
    record: list = []
    x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
    variables = net.abstract_variables(image_shape)

    def run(v, x):
        if net.kind == "nnx":
            model = net.nnx.merge(v["params"], v["batch_stats"], None)
            model.eval()
            swap_nnx_layers(model, {}, record=record, shapes=shapes)
            return model(x, **net._flag(False), **net._rngs(None, False))
        with nn.intercept_methods(linen_interceptor({}, record=record, shapes=shapes)):
            return net.module.apply({"params": v["params"], "batch_stats": v["batch_stats"]},
                                    x, **net._flag(False))
    jax.eval_shape(run, variables, x)
    return record


def _layer_list(layers) -> str:
    names = ["/".join(p) for p in layers]
    return ", ".join(names[:24]) + (f", ... ({len(names)} in all)" if len(names) > 24 else "")


def _check_divides(path, what: str, n: int, size: int, axis: str) -> None:
    if n % size:
        ok = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"tensor plan: {'/'.join(path)} splits its {n} {what} over "
                         f"'{axis}':{size}, which does not divide; the sizes that do are {ok}: "
                         "change the plan or the model axis size")


def resolve(net, plan, image_shape, size: int, axis: str = MODEL_AXIS) -> dict:
    """A plan's ``{module path tuple: role}`` for ``net``, checked, before any compile.

    Args:
      net: a :class:`trjax.models.Network` (linen or nnx).
      plan: ``{pattern: "column" | "row"}`` or its string form (:func:`parse`).
      image_shape: ``(H, W, C)`` of one example.
      size: the ``model`` axis size T.

    Returns:
      ``{path: role}`` with roles ``column`` and ``row`` (a pair), ``channel``
      (a BatchNorm between them) and ``head`` (a column layer whose output is
      all-gathered, as no row layer follows it).

    Raises:
      ValueError: an empty plan; a pattern that names no ``Conv`` / ``Dense``
        layer (listing the model's); a row layer that no column layer precedes;
        a GroupNorm / LayerNorm (or a split layer) between a column and its row
        layer; output channels (column) or input channels (row) that do not
        divide by ``size``, naming the sizes that do.
    """
    plan = parse(plan)
    if not plan:
        raise ValueError("the tensor plan is empty: name the layers to split, e.g. "
                         "'Conv_1=column,Conv_2=row,Dense_0=column'")
    record = calls(net, image_shape)
    layers = list(dict.fromkeys(p for p, kind, _, _ in record if kind == "layer"))
    wanted = {}
    for pattern, role in plan.items():
        hits = [p for p in layers if matches(pattern, p)]
        if not hits:
            raise ValueError(f"tensor plan: {pattern!r} names no Conv/Dense layer of the model; "
                             f"its layers are {_layer_list(layers)}")
        wanted.update({p: role for p in hits})
    return _pair(record, wanted, size, axis)


def _pair(record, wanted: dict, size: int, axis: str) -> dict:
    """Walks the call order: each column layer with the row layer that follows it
    (and the BatchNorms between), or alone (``head``)."""
    out, column, norms = {}, None, []
    for path, kind, mod, channels in record:
        if column is not None:
            if kind == "norm":
                norms.append(path)
                continue
            if kind == "mixes":
                raise ValueError(f"tensor plan: {'/'.join(path)} ({type(mod).__name__}) runs "
                                 f"between the column layer {'/'.join(column)} and a row layer; "
                                 "it normalises over channels, which are split there: only "
                                 "BatchNorm may sit between a column and a row layer")
            if wanted.get(path) == "row":
                _check_divides(path, "input channels", channels, size, axis)
                out.update({column: "column", path: "row", **{n: "channel" for n in norms}})
                column, norms = None, []
                continue
            out[column], column, norms = "head", None, []
        if kind != "layer":
            continue
        if wanted.get(path) == "column":
            _check_divides(path, "output channels", _width(mod), size, axis)
            column, norms = path, []
        elif wanted.get(path) == "row":
            raise ValueError(f"tensor plan: the row layer {'/'.join(path)} follows no column "
                             "layer: a row layer's input channels are the output channels of "
                             "the column layer called just before it")
    if column is not None:
        out[column] = "head"
    return out


def _leaf_spec(role, name: str, ndim: int, axis: str) -> P:
    if role in ("column", "head") and name == "kernel":  # a gathered head splits as a column
        return P(*([None] * (ndim - 1) + [axis]))
    if role == "row" and name == "kernel":
        return P(*([None] * (ndim - 2) + [axis, None]))
    if role in ("channel", "column", "head") and ndim == 1:  # BN scale/bias/mean/var, biases
        return P(axis)
    return P()


def specs(tree, roles: Mapping[tuple, str], axis: str = MODEL_AXIS):
    """The ``PartitionSpec`` tree of ``tree`` (the parameters or the BatchNorm
    statistics, whole shapes) under resolved ``roles``: column (and head) kernels
    split on their last (output) dimension and their biases split, row kernels
    on their input dimension (biases replicated), a ``channel`` BatchNorm's
    vectors split; every other leaf replicated."""
    def spec(path, leaf):
        keys = path_keys(path)
        return _leaf_spec(roles.get(keys[:-1]), keys[-1], len(leaf.shape), axis)
    return jax.tree_util.tree_map_with_path(spec, tree)


def default_plan(module) -> dict[str, str]:
    """A built-in :class:`trjax.models.ResNet`'s split as a plan: the last stage's
    blocks (``Conv_0`` column, ``Conv_1`` row: a ``BasicBlock``'s two 3x3 convs, a
    ``Bottleneck``'s 1x1 and its 3x3, 13F^2 of its 17F^2 weights) and the head
    (column over classes, its logits all-gathered):
    ``{"stage3_block1/Conv_0": "column", "stage3_block1/Conv_1": "row", ...,
    "head": "column"}``."""
    last = len(module.stage_sizes)
    plan = {}
    for j in range(module.stage_sizes[-1]):
        plan[f"stage{last}_block{j + 1}/Conv_0"] = "column"
        plan[f"stage{last}_block{j + 1}/Conv_1"] = "row"
    return {**plan, "head": "column"}


def split_layers(net, image_shape, roles: Mapping[tuple, str]) -> list[tuple]:
    """What each Megatron collective of a resolved plan carries, per example, in call
    order: ``("pair", column path, row output shape, column input shape, before)`` (its
    ``g`` and ``f``) and ``("head", path, output shape, input shape, before)`` (its
    all-gather and ``f``); shapes without the batch dimension, ``before`` the paths of
    the layers and norms called before the column layer (:func:`calls`' abstract trace)."""
    shapes: dict = {}
    record = calls(net, image_shape, shapes)
    out, column, seen = [], None, []
    for path, kind, _, _ in record:
        role = roles.get(path) if kind == "layer" else None
        if role == "column":
            column = (path, tuple(seen))
        elif role == "row" and column is not None:
            out.append(("pair", column[0], shapes[path][1], shapes[column[0]][0], column[1]))
            column = None
        elif role == "head":
            out.append(("head", path, shapes[path][1], shapes[path][0], tuple(seen)))
        seen.append(path)
    return out


def traffic(net, image_shape, roles: Mapping[tuple, str], size: int, local_batch: int,
            itemsize: int = 4, batch: int | None = None, units=None) -> dict:
    """The ``model`` axis' byte model of one step (:func:`trjax.comm.tensor_bytes`
    of the plan's pairs and heads, one forward and backward of ``batch`` rows,
    default ``local_batch``): result bytes ``g``, ``f``, ``gather``, ``issued``, as
    :func:`trjax.comm.by_axis` counts the compiled step's collectives over
    ``model``, and what a ring sends (``total``).

    A backward issues the ``f`` of a split layer only where its input's cotangent
    reaches a parameter or a cotangent the step needs: ``f`` counts the layers that a
    Conv/Dense or norm of ``units`` precedes; ``f_input`` the others (the leading
    split layers, before any parameter: their ``f`` is dead code unless the
    backward needs its input's cotangent, a pipeline stage's input). The images'
    cotangent is never needed, so a whole step issues ``g + f + gather``.

    Args:
      net, image_shape, roles: the network, one example's shape, :func:`resolve`'s roles.
      size: T; local_batch: rows per data rank; itemsize: bytes per activation element.
      batch: rows per pass (a pipeline's micro-batch); units: only the layers under
        these path prefixes (a pipeline stage's units), a pair by its column layer.
    """
    inside = lambda p: units is None or any(p[:len(u)] == tuple(u) for u in units)  # noqa: E731
    layers = [x for x in split_layers(net, image_shape, roles) if inside(x[1])]
    rows = local_batch if batch is None else batch

    def model(leading: bool) -> dict:
        mine = [x for x in layers if leading != any(inside(p) for p in x[4])]
        return comm.tensor_bytes(rows, [(o, i) for kind, _, o, i, _ in mine if kind == "pair"],
                                 size, itemsize,
                                 [(o, i) for kind, _, o, i, _ in mine if kind == "head"])
    out, lead = model(False), model(True)
    out = {**out, "gather": out["gather"] + lead["gather"], "g": out["g"] + lead["g"]}
    out.update(f_input=lead["f"], issued=out["g"] + out["f"] + out["gather"],
               total=comm.tensor_sent(out["g"], out["f"], out["gather"], size))
    for key in ("forward", "backward", "head"):
        out.pop(key)
    return {"formula": "g = sum B|o|, f = sum B|i| (+ heads' B|x|), gather = sum B|y|; "
                       "ring 2(T-1)/T (g + f) + (T-1)/T gather", "T": size, **out}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A resolved plan on a ``model`` axis: the :class:`trjax.models.Network`'s
    ``layer_plan``, which every apply runs flax's own layers through.

    Attributes:
      roles: ``{module path tuple: role}`` (:func:`resolve`).
      axis: the mesh axis (``model``); size: its device count T.
    """
    roles: dict
    axis: str = MODEL_AXIS
    size: int = 1

    def linen(self):
        """The :func:`flax.linen.intercept_methods` interceptor of a linen apply."""
        return linen_interceptor(self.roles, self.axis, self.size)

    def nnx(self, model) -> None:
        """Swaps the split layers of a merged nnx model (:func:`swap_nnx_layers`)."""
        swap_nnx_layers(model, self.roles, self.axis)


def _rename_leaves(tree, rename):
    if isinstance(tree, dict):
        return {rename.get(k, k): _rename_leaves(v, rename) for k, v in tree.items()}
    return tree


def _plan_for(net, image_shape, plan):
    """The plan to resolve: ``plan``, or a built-in ResNet's :func:`default_plan`.

    Raises:
      ValueError: neither (your own model on a ``model`` axis), naming its layers.
    """
    from trjax.models import ResNet  # noqa: PLC0415 (the one built-in model with a default)
    if plan:
        return plan
    if isinstance(net.module, ResNet):
        return default_plan(net.module)
    layers = sorted({"/".join(p) for p, kind, _, _ in calls(net, image_shape) if kind == "layer"})
    cls = type(net.module)
    raise ValueError(f"a 'model' mesh axis splits a model by a tensor plan; your model "
                     f"{cls.__module__}.{cls.__qualname__} has none: set "
                     "config.tensor_plan='<conv>=column,<next conv>=row,<head>=column' "
                     f"from its layers {layers[:24]}, or use a mesh with the data axis only")


def layout(base: Layout, plan=None) -> Layout:
    """``base`` (the data-parallel :class:`Layout` of a world with a ``model`` axis)
    with its network split over ``model`` by a tensor plan: your own model's, or a
    built-in ResNet's :func:`default_plan`.

    The parameters', BN statistics' and optimizer state's specs split over
    ``model`` (:func:`specs`; the optimizer state's come with
    :meth:`Layout.with_exchange`); the gradient buckets and BN sums stay
    reduced over ``data`` only (every model rank holds its own slice's whole
    gradient); traced with ``check_vma=False`` (the buckets mix split and
    replicated leaves; the mappings are explicit). ``model`` joins the axes whose
    devices hold different slices, so a non-finite value in one rank's slice
    skips the step everywhere.

    Args:
      base: :func:`trjax.parallel.layout.data_parallel` of the world
        (``bn_mode`` ``running`` or ``sync``: each device keeps the statistics of
        its own channels).
      plan: ``{pattern: "column" | "row"}`` or ``"pattern=role,..."``
        (:func:`parse`); ``None`` or empty: a ResNet's own split.

    Raises:
      ValueError: a model that is not a trjax ResNet without a plan (naming
        its Conv/Dense layers); ``bn_mode='local'``; a layer whose channels (or
        the head's classes) do not divide by the axis size, or a bad plan
        (:func:`resolve`), before anything is traced.
    """
    check_bn_mode(base.bn_mode, ("running", "sync"), "a 'model' axis (tensor parallel)")
    net, sizes = base.model, dict(base.world.axes)
    T = sizes[MODEL_AXIS]
    roles = resolve(net, _plan_for(net, base.image_shape, plan), base.image_shape, T)
    variables = net.abstract_variables(base.image_shape)
    p_specs = specs(variables["params"], roles)
    s_specs = specs(variables["batch_stats"], roles)
    count = len([r for r in roles.values() if r != "channel"])
    network = dataclasses.replace(base.network, layer_plan=Plan(roles, MODEL_AXIS, T))
    labels = {MODEL_AXIS: {
        "all-reduce": "tensor:Megatron f/g (partial sums of a split pair or the head)",
        "all-gather": "tensor:head logits"}}
    return dataclasses.replace(
        base, network=network,
        forward_backward=functools.partial(data_forward_backward, network, base.bn_mode,
                                           base.data_axis),
        params=p_specs, batch_stats=s_specs,
        folded=_rename_leaves(s_specs, {"mean": "scale", "var": "bias"})
        if network.folds else s_specs,
        check_vma=False, strategies=("tensor",) + base.strategies,
        local_shapes=lambda p, s: (local_shapes(p, p_specs, sizes),
                                   local_shapes(s, s_specs, sizes)),
        split_axes=base.split_axes + (MODEL_AXIS,),
        tensor_traffic=functools.partial(traffic, net, tuple(base.image_shape), roles, T,
                                         base.world.local_batch_size),
        collective_labels={**base.collective_labels, **labels},
        line=f"tensor parallel: {T}-way over '{MODEL_AXIS}' ({count} layers split"
             + (", by config.tensor_plan)" if plan else ")"))
