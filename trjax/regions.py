"""Regions: every parameter leaf classified by its meaning in the network.

The seed framework groups gradients into contiguous regions by meaning
(G_FIRST_CONV, G_DEEP_CONV, G_BN_WEIGHT, G_BN_BIAS, G_FC_WEIGHT, G_FC_BIAS;
B_*_MEAN / B_*_VAR for BatchNorm statistics). Here the mapping is computed from
the model itself: one abstract forward pass (``jax.eval_shape``, nothing is
computed) records, with :func:`flax.linen.intercept_methods`, which module
types are called and in what order. The first convolution called on the input
is the *first conv*; every other convolution is a *deep conv*; BatchNorm
``scale``/``bias`` and Dense ``kernel``/``bias`` go to their regions. No model
names are hard-coded.
"""

from __future__ import annotations

import enum

import flax.linen as nn
import jax

from trjax.batchnorm import BatchNorm


class Region(str, enum.Enum):
    FIRST_CONV = "first_conv"
    DEEP_CONV = "deep_conv"
    BN_SCALE = "bn_scale"
    BN_BIAS = "bn_bias"
    FC_WEIGHT = "fc_weight"
    FC_BIAS = "fc_bias"
    METRICS = "metrics"  # per-step metric sums (the seed's R_RESULT), packed after the deep convs
    RUNNING_MEAN = "running_mean"
    RUNNING_VAR = "running_var"


KERNEL_REGIONS = (Region.FIRST_CONV, Region.DEEP_CONV, Region.FC_WEIGHT)
"""Regions holding conv/dense kernels: weight decay and LARS apply there, and
PowerSGD compresses them (one matrix per layer)."""


def path_str(path) -> str:
    """``('stage1_block1', 'Conv_0', 'kernel')`` -> ``'stage1_block1/Conv_0/kernel'``."""
    return "/".join(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def module_call_order(model: nn.Module, variables, *inputs, **kwargs) -> list[tuple[str, type]]:
    """Module paths and types in forward call order, from one abstract pass.

    Args:
      model: a flax linen module.
      variables: its variables (arrays or ``jax.ShapeDtypeStruct``).
      inputs, kwargs: passed to ``model.apply``.

    Returns:
      ``[(path, module_type), ...]`` for every Conv, Dense and BatchNorm
      ``__call__``, first call first, each module once.
    """
    order: list[tuple[str, type]] = []

    def record(next_fun, args, kw, context):
        mod = context.module
        if context.method_name == "__call__" and isinstance(mod, (nn.Conv, nn.Dense, BatchNorm)):
            path = "/".join(mod.path)
            if path not in {p for p, _ in order}:
                order.append((path, type(mod)))
        return next_fun(*args, **kw)

    def run(v, *xs):
        with nn.intercept_methods(record):
            return model.apply(v, *xs, **kwargs, mutable=["batch_stats"])

    jax.eval_shape(run, variables, *inputs)
    return order


def assign_regions(model: nn.Module, variables, sample_input) -> dict[str, Region]:
    """Maps every leaf of ``variables`` (params and batch_stats) to a region.

    Args:
      model: the network.
      variables: ``{'params': ..., 'batch_stats': ...}`` (arrays or shapes).
      sample_input: ``x_BxHxWxC`` (array or ``jax.ShapeDtypeStruct``) for the
        abstract forward pass, in training mode.

    Returns:
      ``{'params/<path>' or 'batch_stats/<path>': Region}``, every leaf,
      ordered params first, then by forward call order of the owning module.

    Raises:
      ValueError: a leaf that belongs to no known layer type, or a model with
        no convolution.
    """
    order = module_call_order(model, variables, sample_input, train=False)
    convs = [p for p, t in order if issubclass(t, nn.Conv)]
    if not convs:
        raise ValueError("the model has no convolution: trjax trains CNNs (the first conv region "
                         "would be empty)")
    kinds = {p: t for p, t in order}
    rank = {p: i for i, (p, _) in enumerate(order)}
    entries = []
    for coll in ("params", "batch_stats"):
        for path, _ in jax.tree_util.tree_flatten_with_path(variables.get(coll, {}))[0]:
            full = path_str(path)
            mod_path, leaf = full.rsplit("/", 1)
            kind = kinds.get(mod_path)
            region = None
            if kind is not None and issubclass(kind, nn.Conv):
                region = Region.FIRST_CONV if mod_path == convs[0] else Region.DEEP_CONV
            elif kind is not None and issubclass(kind, nn.Dense):
                region = Region.FC_WEIGHT if leaf == "kernel" else Region.FC_BIAS
            elif kind is not None and issubclass(kind, BatchNorm):
                region = {"scale": Region.BN_SCALE, "bias": Region.BN_BIAS,
                          "mean": Region.RUNNING_MEAN, "var": Region.RUNNING_VAR}.get(leaf)
            if region is None:
                raise ValueError(f"{coll}/{full} belongs to no region (module type {kind}); "
                                 "trjax knows Conv, Dense and trjax BatchNorm layers")
            entries.append(((coll, rank[mod_path], leaf), f"{coll}/{full}", region))
    return {name: region for _, name, region in sorted(entries)}
