"""Regions: every parameter leaf classified by its place in the network.

The seed framework groups gradients into contiguous regions by meaning
(G_FIRST_CONV, G_DEEP_CONV, G_BN_WEIGHT, G_BN_BIAS, G_FC_WEIGHT, G_FC_BIAS;
B_*_MEAN / B_*_VAR for BatchNorm statistics). Here the mapping is computed from
any model, by one rule that reads no layer type and no model name: one
abstract forward pass (``jax.make_jaxpr`` of the evaluation-mode apply, nothing
is computed) gives the order in which the network first combines each
parameter with the activations (:func:`parameter_uses`). Then, with *kernels*
the parameters of two or more dimensions and *vectors* the others:

* the **first layer(s)**: every module (a parameter's parent path) with a
  kernel applied to the input itself -- to an activation computed from the
  input through no parameter (a cast, a scaling, a pad) -- or, when there is
  none, the module of the kernel used first. Their kernels: ``FIRST_CONV``.
* the **classifier**: the module of the kernel used last. Its kernels:
  ``FC_WEIGHT``; its vectors: ``FC_BIAS``.
* every other kernel (convolutions, hidden dense layers, anything else):
  ``DEEP_CONV``.
* every other vector (normalisation scales and biases, layer biases, the first
  layer's bias): ``BN_BIAS`` for a leaf named ``bias``, ``BN_SCALE`` otherwise.
* ``batch_stats`` leaves: ``RUNNING_VAR`` for ``var``, ``RUNNING_MEAN`` otherwise.

Inside a region, leaves follow the forward order of their module's first use.
A layer type trjax has never seen is never an error: its parameters fall under
the same rule. On trjax's ResNets the rule gives the seed's regions (stem conv
first, BN scales and biases, the dense head).
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import jax
from jax.extend import core as jax_core

from trjax import models


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
"""Regions holding kernels (parameters of two or more dimensions): weight
decay and LARS apply there, and PowerSGD compresses them (one matrix per layer)."""


def path_str(path) -> str:
    """``('stage1_block1', 'Conv_0', 'kernel')`` -> ``'stage1_block1/Conv_0/kernel'``."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


class Use(NamedTuple):
    """Where the forward pass first combines a leaf with the activations.

    ``order``: the position of that operation in the traced program (jaxpr
    equations in execution order, nested calls inlined); ``on_input``: the
    activation it meets was computed from the input through no parameter."""
    order: int
    on_input: bool


class _Dep(NamedTuple):
    leaves: frozenset  # tracked leaves a parameter-side value is computed from
    act: bool          # computed from the input (an activation)
    touched: bool      # an activation some tracked leaf has already entered


_NONE = _Dep(frozenset(), False, False)


def _sub_jaxpr(eqn):
    """The one inner jaxpr of a call-like equation (pjit, custom_jvp/vjp, remat,
    scan) whose inputs and outputs map one to one onto the equation's, else None."""
    found = []
    for v in eqn.params.values():
        j = getattr(v, "jaxpr", v)
        if hasattr(j, "eqns") and hasattr(j, "invars"):
            found.append(j)
    if len(found) != 1:
        return None
    j = found[0]
    ok = len(j.invars) == len(eqn.invars) and len(j.outvars) == len(eqn.outvars)
    return j if ok else None


def _walk(jaxpr, deps_in, uses: dict, counter: list):
    env = {}

    def read(v):
        return _NONE if isinstance(v, jax_core.Literal) else env.get(v, _NONE)

    for v, d in zip(jaxpr.invars, deps_in):
        env[v] = d
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            outs = _walk(sub, ins, uses, counter)
        else:
            order = counter[0]
            counter[0] += 1
            acts = [d for d in ins if d.act]
            if acts:
                fresh = not any(d.touched for d in acts)
                met = [leaf for d in ins if not d.act for leaf in d.leaves]
                for leaf in met:
                    uses.setdefault(leaf, Use(order, fresh))
                out = _Dep(frozenset(), True, (not fresh) or bool(met))
            else:
                out = _Dep(frozenset().union(*(d.leaves for d in ins)), False, False)
            outs = [out] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def parameter_uses(apply_fn, variables, sample_input) -> dict[str, Use]:
    """The first use of every leaf of ``variables`` in one abstract forward pass.

    Args:
      apply_fn: ``(variables, x) -> logits``, traceable.
      variables: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      sample_input: ``x`` (array or ``jax.ShapeDtypeStruct``).

    Returns:
      ``{leaf path string: Use}`` for every leaf the pass combines with the
      activations (a leaf it never uses is absent).
    """
    closed = jax.make_jaxpr(apply_fn)(variables, sample_input)
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    n_in = len(jax.tree_util.tree_leaves(sample_input))
    deps = [_Dep(frozenset([i]), False, False) for i in range(len(flat))]
    deps += [_Dep(frozenset(), True, False)] * n_in
    uses: dict = {}
    _walk(closed.jaxpr, deps, uses, [0])
    return {path_str(flat[i][0]): use for i, use in uses.items()}


def _module_of(name: str) -> str:
    """``'params/a/b/kernel'`` -> ``'a/b'`` (the leaf's parent path; ``''`` at the root)."""
    inner = name.split("/", 1)[1]
    return inner.rsplit("/", 1)[0] if "/" in inner else ""


def assign_regions(model, variables, sample_input) -> dict[str, Region]:
    """Maps every leaf of ``variables`` (params and batch_stats) to a region,
    by the rule in the module docstring.

    Args:
      model: a :class:`trjax.models.Network`, a flax linen module or an nnx
        module (:func:`trjax.models.as_network`).
      variables: ``{'params': ..., 'batch_stats': ...}`` (arrays or shapes;
        ``batch_stats`` may be absent).
      sample_input: ``x_BxHxWxC`` (array or ``jax.ShapeDtypeStruct``) for the
        abstract forward pass, in evaluation mode.

    Returns:
      ``{'params/<path>' or 'batch_stats/<path>': Region}``, every leaf,
      params first, then by the forward order of the owning module's first
      use (unused modules last).
    """
    net = models.as_network(model)
    tree = {"params": variables.get("params", {}), "batch_stats": variables.get("batch_stats", {})}
    uses = parameter_uses(lambda v, x: net.apply_eval(v["params"], v["batch_stats"], x),
                          tree, sample_input)
    leaves = [("params/" + path_str(p), x) for p, x in
              jax.tree_util.tree_flatten_with_path(tree["params"])[0]]
    stats = ["batch_stats/" + path_str(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(tree["batch_stats"])[0]]
    rank: dict[str, float] = {}
    for name in [n for n, _ in leaves] + stats:
        if name in uses:
            m = _module_of(name)
            rank[m] = min(rank.get(m, math.inf), uses[name].order)
    kernels = [(uses[n].order, n) for n, x in leaves if len(x.shape) >= 2 and n in uses]
    classifier = _module_of(max(kernels)[1]) if kernels else None
    first = {_module_of(n) for _, n in kernels if uses[n].on_input}
    if not first and kernels:
        first = {_module_of(min(kernels)[1])}
    entries = []
    for name, x in leaves:
        mod, leaf = _module_of(name), name.rsplit("/", 1)[1]
        kernel = len(x.shape) >= 2
        if mod == classifier:
            region = Region.FC_WEIGHT if kernel else Region.FC_BIAS
        elif kernel:
            region = Region.FIRST_CONV if mod in first else Region.DEEP_CONV
        else:
            region = Region.BN_BIAS if leaf == "bias" else Region.BN_SCALE
        entries.append(((0, rank.get(mod, math.inf), mod, leaf), name, region))
    for name in stats:
        mod, leaf = _module_of(name), name.rsplit("/", 1)[1]
        region = Region.RUNNING_VAR if leaf == "var" else Region.RUNNING_MEAN
        entries.append(((1, rank.get(mod, math.inf), mod, leaf), name, region))
    return {name: region for _, name, region in sorted(entries)}
