"""Activation checkpointing (remat) for any flax model, chosen by module path.

``config.remat`` names the modules whose activations the backward recomputes
instead of keeping: ``"blocks"`` (a built-in ResNet's residual blocks
``stage*_block*``; a linen ``nn.Sequential``'s layers ``layers_*``; an
``nnx.Sequential``'s ``layers/*``) or module-path patterns in the tensor plan's
syntax (``"layers_*"``, ``"encoder/*Block_*"``: ``*`` for one path component,
``fnmatch`` inside it). Each matched module's call runs under
``jax.checkpoint`` (Chen et al., "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174; timm's ``--grad-checkpointing``, PyTorch's
``checkpoint_sequential``): the forward keeps the block's inputs, the backward
runs the block again. What else it keeps is the policy (:data:`POLICIES`,
MaxText's remat policies by another name).

It is applied as the tensor plan is, by intercepting the model's own modules:
linen through :func:`flax.linen.intercept_methods` and flax's lifted
``nn.checkpoint`` (the module's variables, its random streams and trjax's
BatchNorm sums cross the boundary as flax lifts them), nnx through
``nnx.remat`` on the matched modules of the step's merged copy. A module keeps
its path and its random keys inside the recompute, so dropout and drop-path
draw the masks the run without remat draws: gradients are the same function,
equal within one step's rounding (bitwise where XLA keeps the arithmetic). The
pipeline's stage runner applies it inside each stage; the ``fsdp``, ``model``
and ``data`` axes see the same network.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import flax.linen as nn
import jax
from jax import lax

from trjax.batchnorm import current_nnx_context


def _saves_convolutions(prim, *_, **__) -> bool:
    return prim in (lax.conv_general_dilated_p, lax.dot_general_p)


POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "convs_saveable": _saves_convolutions,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
"""What a rematerialised block keeps for its backward besides its inputs:
``nothing_saveable`` (the default: every activation is recomputed),
``convs_saveable`` (the outputs of convolutions and matrix products are kept,
only the cheap elementwise ops, BatchNorm and activations, run again),
``dots_saveable`` (``jax.checkpoint_policies.dots_saveable``: matrix products
only), ``everything_saveable`` (keeps all: no memory saved, for comparison)."""

BLOCKS = {"ResNet": ("stage*_block*",), "FlaggedSequential": ("layers_*",),
          "Sequential": ("layers/*",)}
"""What ``remat="blocks"`` names, by model class: a built-in ResNet's residual
blocks, a linen ``nn.Sequential``'s layers, an ``nnx.Sequential``'s layers."""


def parse(text) -> tuple[str, ...]:
    """``config.remat`` as patterns: ``()`` for ``"none"`` or ``""``, ``("blocks",)``,
    or the comma-separated module-path patterns.

    Raises:
      ValueError: a pattern with an empty path component, naming it and the form.
    """
    items = tuple(p.strip() for p in str(text or "").split(",") if p.strip())
    if items in ((), ("none",)):
        return ()
    for p in items:
        if p != "blocks" and any(not c for c in p.strip("/").split("/")):
            raise ValueError(f"config.remat pattern {p!r} has an empty path component: write "
                             "'none', 'blocks' or module paths such as 'layers_*' or "
                             "'stage*_block*' ('*' for one path component)")
    return items


def matches(pattern: str, path: tuple) -> bool:
    """A pattern (``"a/b*/c"``) matches a module path component by component."""
    parts = pattern.strip("/").split("/")
    return len(parts) == len(path) and all(
        fnmatch.fnmatchcase(str(p), q) for p, q in zip(path, parts))


def module_paths(net, image_shape) -> list[tuple]:
    """Every module path a :class:`trjax.models.Network` calls on one example, in
    call order (linen: traced abstractly in evaluation mode; nnx: the module graph)."""
    import jax.numpy as jnp
    if net.kind == "nnx":
        from flax import nnx
        found: list = []

        def walk(v):
            model = net.nnx.merge(v["params"], v["batch_stats"], None)
            found.extend(tuple(str(p) for p in path) for path, node in nnx.iter_graph(model)
                         if isinstance(node, nnx.Module) and path)
        jax.eval_shape(walk, net.abstract_variables(image_shape))
        return found
    seen: dict = {}

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and context.module.path:
            seen.setdefault(tuple(str(p) for p in context.module.path), None)
        return next_fun(*args, **kwargs)
    x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)

    def run(v, x):
        with nn.intercept_methods(record):
            return net.module.apply(v, x, **net._flag(False))
    jax.eval_shape(run, net.abstract_variables(image_shape), x)
    return list(seen)


@dataclasses.dataclass(frozen=True)
class Remat:
    """The resolved remat of a network: the module paths rematerialised and the
    policy (a :data:`POLICIES` name). :meth:`linen` and :meth:`nnx` apply it."""
    paths: frozenset
    policy: str = "nothing_saveable"

    def linen(self):
        """A :func:`flax.linen.intercept_methods` interceptor: each matched module's
        ``__call__`` runs under flax's lifted ``nn.checkpoint``; its array arguments
        cross the boundary, every other argument (the training flag) stays static."""
        active: set = set()
        policy = POLICIES[self.policy]

        def intercept(next_fun, args, kwargs, context):
            mod = context.module
            if context.method_name != "__call__" or mod.is_initializing():
                return next_fun(*args, **kwargs)
            path = tuple(str(p) for p in mod.path)
            if path not in self.paths or path in active:
                return next_fun(*args, **kwargs)
            leaves, tree, dyn = _split_args(args, kwargs)

            def body(m, *xs):
                a, k = _join_args(leaves, tree, dyn, xs)
                active.add(path)
                try:
                    return m(*a, **k)
                finally:
                    active.discard(path)
            return nn.checkpoint(body, policy=policy)(mod, *[leaves[i] for i in dyn])
        return intercept

    def nnx(self, model) -> None:
        """Makes each matched module of ``model`` (a merged nnx copy for one trace) run
        its ``__call__`` under ``nnx.remat``. trjax's BatchNorm adapters key their
        layers by identity, so the copies ``nnx.remat`` makes are registered under the
        same paths, and their sums are carried out of the recompute."""
        from flax import nnx
        from flax.nnx import graph as nnx_graph
        policy = POLICIES[self.policy]
        for path, node in nnx.iter_graph(model):
            if not isinstance(node, nnx.Module) or tuple(str(p) for p in path) not in self.paths:
                continue
            base = type(node).__call__

            def call(self_, *args, _base=base, _prefix=tuple(path), **kwargs):
                leaves, tree, dyn = _split_args(args, kwargs, nnx_graph.is_graph_node)
                ctx = current_nnx_context()

                def body(m, *xs):
                    a, k = _join_args(leaves, tree, dyn, xs)
                    before = set(ctx.sums) if ctx is not None else set()
                    if ctx is not None:
                        for sub, n in nnx.iter_graph(m):
                            if isinstance(n, nnx.BatchNorm):
                                ctx.nnx_paths[id(n)] = _prefix + tuple(sub)
                    y = _base(m, *a, **k)
                    new = {} if ctx is None else {
                        p: ctx.sums.pop(p) for p in list(ctx.sums) if p not in before}
                    return y, new
                y, new = nnx.remat(body, policy=policy)(self_, *[leaves[i] for i in dyn])
                if ctx is not None:
                    ctx.sums.update(new)
                return y
            node.__class__ = type(type(node).__name__, (type(node),), {"__call__": call})


def _split_args(args, kwargs, is_node=None):
    """``(leaves, treedef, dynamic leaf indices)``: arrays (and nnx graph nodes) cross
    a remat boundary; Python values stay static (closed over)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    dyn = [i for i, x in enumerate(leaves)
           if isinstance(x, jax.Array) or (is_node is not None and is_node(x))]
    return leaves, tree, dyn


def _join_args(leaves, tree, dyn, xs):
    out = list(leaves)
    for i, x in zip(dyn, xs):
        out[i] = x
    return jax.tree_util.tree_unflatten(tree, out)


def resolve(net, remat, image_shape, policy: str = "nothing_saveable") -> Remat | None:
    """``config.remat`` against a :class:`trjax.models.Network`, before any compile.

    Args:
      net: the network (linen or nnx).
      remat: ``"none"``, ``"blocks"`` or module-path patterns (:func:`parse`).
      image_shape: ``(H, W, C)`` of one example.
      policy: a :data:`POLICIES` name.

    Returns:
      ``None`` for ``"none"``; else the :class:`Remat` of every module path a
      pattern matches.

    Raises:
      ValueError: an unknown policy; ``"blocks"`` on a model trjax knows no blocks
        of; a pattern that matches no module (each naming the model's modules).
    """
    if policy not in POLICIES:
        raise ValueError(f"config.remat_policy={policy!r} is not one of {list(POLICIES)}")
    patterns = parse(remat)
    if not patterns:
        return None
    paths = module_paths(net, image_shape)
    cls = type(net.module).__name__
    shown = ", ".join("/".join(p) for p in paths[:24]) + (
        f", ... ({len(paths)} in all)" if len(paths) > 24 else "")
    if "blocks" in patterns and cls not in BLOCKS:
        raise ValueError(f"config.remat='blocks' names a built-in ResNet's residual blocks or "
                         f"a Sequential's layers; your model {cls} is neither: give module-path "
                         f"patterns instead, from its modules [{shown}]")
    wanted = [q for p in patterns for q in (BLOCKS[cls] if p == "blocks" else (p,))]
    chosen = set()
    for pattern in wanted:
        hit = {p for p in paths if matches(pattern, p)}
        if not hit:
            raise ValueError(f"config.remat pattern {pattern!r} matches no module of {cls}: "
                             f"its modules are [{shown}] ('*' stands for one path component)")
        chosen |= hit
    return Remat(frozenset(chosen), policy)
