"""ResNet family in flax linen: CIFAR-style (3x3 stem) and ImageNet (7x7 stem).

He et al., "Deep Residual Learning for Image Recognition", CVPR 2016:
ResNet-20/32/56 (section 4.2, 16-32-64 widths, 3x3 stem) for small images;
ResNet-18/34 (basic blocks) and ResNet-50 (bottlenecks) for ImageNet (table 1).
Every convolution is followed by :class:`trjax.batchnorm.BatchNorm`; the network
ends in global average pooling and one dense layer. Variants are built from one
class with ``functools.partial``, as in the Flax ImageNet example.

Input: ``x_BxHxWxC`` float (the compiled steps standardise the uint8 batch with
:func:`normalize` before any model); output: logits ``[B, num_classes]`` float32.

Any other flax CNN trains the same way: :func:`wrap` turns a linen module or an
``nnx.Module`` into a :class:`Network`, trjax's view of a model (initialisation,
the training apply with trjax's BatchNorm statistics and the dropout key, the
evaluation apply). The model contract is flax's ordinary one: ``__call__(x,
train)`` (``train`` optional; nnx modules are also switched with
``.train()`` / ``.eval()``) returning logits ``[B, num_classes]`` of a float
dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import zlib
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from trjax.batchnorm import (BatchNorm, BatchNormContext, fold_batchnorm_tree, linen_interceptor,
                             nnx_context, swap_nnx_batchnorms)
from trjax import remat as remat_lib
from trjax.cpu.im2col import Im2colConv, resolve_conv_lowering


def normalize(images, mean, std, dtype=jnp.float32):
    """``(images - mean) / std`` per channel, in float32, then cast to ``dtype``.

    Pure and jittable: the compiled step calls it on the uint8 batch, so the
    host never makes a float copy.

    Args:
      images: ``[..., C]``, uint8 (or any real dtype).
      mean, std: ``C`` floats in the images' units, or ``None`` (no
        standardisation, only the cast).
      dtype: the result's dtype (the compute dtype).

    Returns:
      ``[..., C]`` of ``dtype``.
    """
    x = jnp.asarray(images).astype(jnp.float32)
    if mean is not None:
        per_channel = (1,) * (x.ndim - 1) + (-1,)  # explicit broadcast (no rank promotion)
        x = ((x - jnp.asarray(mean, jnp.float32).reshape(per_channel))
             / jnp.asarray(std, jnp.float32).reshape(per_channel))
    return x.astype(dtype)


class _Block(nn.Module):
    """A residual block's fields: its width, stride, BatchNorm and convolution."""
    features: int
    strides: int
    norm: Any
    conv: Any = functools.partial(nn.Conv, use_bias=False)


class BasicBlock(_Block):
    """Two 3x3 convolutions and the shortcut (a 1x1 projection when the shape changes)."""

    @nn.compact
    def __call__(self, x, train, mask):
        conv = self.conv
        y = conv(self.features, (3, 3), (self.strides, self.strides), padding=1)(x)
        y = nn.relu(self.norm()(y, train, mask))
        y = conv(self.features, (3, 3), padding=1)(y)
        y = self.norm()(y, train, mask)
        if x.shape[-1] != self.features or self.strides != 1:
            x = conv(self.features, (1, 1), (self.strides, self.strides), name="proj_conv")(x)
            x = self.norm(name="proj_bn")(x, train, mask)
        return nn.relu(x + y)


class Bottleneck(_Block):
    """1x1 -> 3x3 (strided) -> 1x1 (4x wider) convolutions and the shortcut."""

    @nn.compact
    def __call__(self, x, train, mask):
        conv = self.conv
        y = conv(self.features, (1, 1))(x)
        y = nn.relu(self.norm()(y, train, mask))
        y = conv(self.features, (3, 3), (self.strides, self.strides), padding=1)(y)
        y = nn.relu(self.norm()(y, train, mask))
        y = conv(self.features * 4, (1, 1))(y)
        y = self.norm()(y, train, mask)
        if x.shape[-1] != self.features * 4 or self.strides != 1:
            x = conv(self.features * 4, (1, 1), (self.strides, self.strides), name="proj_conv")(x)
            x = self.norm(name="proj_bn")(x, train, mask)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet with BatchNorm in a data-parallel mode.

    Attributes:
      stage_sizes: blocks per stage.
      block: ``BasicBlock`` or ``Bottleneck``.
      widths: feature count of each stage.
      stem: ``"cifar"`` (3x3 conv, stride 1, no pool) or ``"imagenet"``
        (7x7 conv stride 2 + 3x3 max-pool stride 2).
      stem_width: output channels of the first conv.
      num_classes: logits size.
      bn_mode, axis_name, bn_momentum: passed to every BatchNorm.
      dtype: compute dtype (parameters stay float32).
      conv_lowering: ``"xla"``, ``"im2col"`` (strided convolutions and windows
        larger than their input as im2col + matmul, :mod:`trjax.cpu.im2col`) or
        ``"auto"`` (im2col on CPU, :func:`trjax.cpu.im2col.resolve_conv_lowering`).
      zero_init_residual: the last BatchNorm of every residual block (not the
        projection's) starts with scale 0, so each block starts as its shortcut
        (Goyal et al. 2017; the Flax ImageNet example's ``scale_init=zeros``).
        Applied by :meth:`Network.init` (:func:`zero_init_residual_scales`);
        ``False`` leaves the parameters bitwise as without it.
      blocks: ``(lo, hi)``: run only residual blocks ``lo .. hi-1`` (in call
        order), with the stem when ``lo == 0`` and the pooling + head when
        ``hi`` is the last: a pipeline stage (:func:`trjax.parallel.pipeline.stage_modules`),
        reading the same parameter paths; ``None``: the whole model.

    The input is used as it comes (the steps standardise it, :func:`normalize`);
    the convolutions cast it to ``dtype``.
    """

    stage_sizes: Sequence[int]
    block: Any = BasicBlock
    widths: Sequence[int] = (16, 32, 64)
    stem: str = "cifar"
    stem_width: int = 16
    num_classes: int = 10
    bn_mode: str = "sync"
    axis_name: Optional[str] = None
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32
    conv_lowering: str = "auto"
    zero_init_residual: bool = False
    blocks: Optional[tuple] = None

    def blocks_info(self, image_shape: Sequence[int]) -> list[dict]:
        """The residual blocks in call order, with their shapes and
        multiply-accumulates per example: the one owner of the ResNet's topology
        (the pipeline's stage balancer reads it).

        Args:
          image_shape: ``(H, W, C)`` of one input image.

        Returns:
          ``[{"name": "stage1_block1", "stage": i, "index": j, "strides": s,
          "in_shape": (H, W, C), "out_shape": (H', W', C'), "macs": int}]``; the
          stem's MACs are added to the first block (``"stem_macs"`` there), the
          head's to the last (``"head_macs"``). Convolution MACs only (BatchNorm,
          ReLU and pooling are not counted).

        Raises:
          ValueError: an unknown block type, or no residual block.
        """
        module = self
        if module.block not in (BasicBlock, Bottleneck):
            raise ValueError(f"unknown ResNet block {module.block!r}")
        h, w, c = (int(v) for v in image_shape)
        half = lambda v: -(-v // 2)  # 'SAME' / padding 1, stride 2
        if module.stem == "imagenet":
            h, w = half(h), half(w)
            stem = h * w * 49 * c * module.stem_width
            h, w = half(h), half(w)  # max-pool 3x3 stride 2, padding 1
        else:
            stem = h * w * 9 * c * module.stem_width
        c = module.stem_width
        blocks = []
        for i, (n_blocks, width) in enumerate(zip(module.stage_sizes, module.widths)):
            for j in range(n_blocks):
                s = 2 if i > 0 and j == 0 else 1
                ho, wo = (half(h), half(w)) if s == 2 else (h, w)
                if module.block is BasicBlock:
                    out = width
                    macs = ho * wo * 9 * c * width + ho * wo * 9 * width * width
                else:
                    out = 4 * width
                    macs = h * w * c * width + ho * wo * 9 * width * width + ho * wo * width * out
                if c != out or s != 1:
                    macs += ho * wo * c * out
                blocks.append({"name": f"stage{i + 1}_block{j + 1}", "stage": i, "index": j,
                               "strides": s, "in_shape": (h, w, c), "out_shape": (ho, wo, out),
                               "macs": int(macs)})
                h, w, c = ho, wo, out
        if not blocks:
            raise ValueError("the ResNet has no residual block to split into stages")
        blocks[0]["stem_macs"] = int(stem)
        blocks[0]["macs"] += int(stem)
        head = c * module.num_classes
        blocks[-1]["head_macs"] = int(head)
        blocks[-1]["macs"] += int(head)
        return blocks

    @nn.compact
    def __call__(self, x, train: bool = True, mask=None):
        total = sum(self.stage_sizes)
        lo, hi = self.blocks if self.blocks is not None else (0, total)
        norm = functools.partial(BatchNorm, mode=self.bn_mode, axis_name=self.axis_name,
                                 momentum=self.bn_momentum, dtype=self.dtype)
        im2col = resolve_conv_lowering(self.conv_lowering) == "im2col"
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                                 conv_general_dilated_cls=Im2colConv if im2col else None)
        if lo == 0:
            if self.stem == "imagenet":
                x = conv(self.stem_width, (7, 7), (2, 2), padding=3, name="stem_conv")(x)
            else:
                x = conv(self.stem_width, (3, 3), padding=1, name="stem_conv")(x)
            x = nn.relu(norm(name="stem_bn")(x, train, mask))
            if self.stem == "imagenet":
                x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        k = 0
        for i, (n_blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
            for j in range(n_blocks):
                if lo <= k < hi:
                    strides = 2 if i > 0 and j == 0 else 1
                    x = self.block(width, strides, norm, conv,
                                   name=f"stage{i + 1}_block{j + 1}")(x, train, mask)
                k += 1
        if hi < total:
            return x
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
        return x.astype(jnp.float32)


def zero_init_residual_scales(module, params: dict) -> dict:
    """``params`` of a :class:`ResNet` with the scale of each residual block's
    last BatchNorm (``BatchNorm_1`` of a :class:`BasicBlock`, ``BatchNorm_2`` of
    a :class:`Bottleneck`) set to zeros when ``module.zero_init_residual``; as
    it came otherwise (any other module too). BatchNorm's scale initialiser is
    the constant one and draws no randomness, so this equals initialising those
    scales with zeros."""
    if not (isinstance(module, ResNet) and module.zero_init_residual):
        return params
    last = "BatchNorm_2" if module.block is Bottleneck else "BatchNorm_1"
    out = dict(params)
    for name, block in params.items():
        if name.startswith("stage") and last in block:
            block = dict(block)
            block[last] = {**block[last], "scale": jnp.zeros_like(block[last]["scale"])}
            out[name] = block
    return out


_IMAGENET_WIDTHS = (64, 128, 256, 512)

ResNet8 = functools.partial(ResNet, stage_sizes=(1, 1, 1))
ResNet20 = functools.partial(ResNet, stage_sizes=(3, 3, 3))
ResNet18Cifar = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), widths=_IMAGENET_WIDTHS,
                                  stem_width=64)
ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), widths=_IMAGENET_WIDTHS,
                             stem="imagenet", stem_width=64)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block=Bottleneck,
                             widths=_IMAGENET_WIDTHS, stem="imagenet", stem_width=64)

MODELS = {"resnet8": ResNet8, "resnet20": ResNet20, "resnet18_cifar": ResNet18Cifar,
          "resnet18": ResNet18, "resnet50": ResNet50}


def create_model(name: str, **kwargs) -> ResNet:
    """Builds a model by name (one of ``MODELS``); kwargs override attributes.

    Raises:
      ValueError: unknown name, listing the known ones.
    """
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown; choose one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


# -- any flax model: trjax's view of it ------------------------------------------------------


TRAIN_FLAGS = ("train", "training", "is_training", "is_train")
"""``__call__`` parameters that take the training flag as it is (True in training)."""
EVAL_FLAGS = ("deterministic", "inference")
"""``__call__`` parameters that take it inverted (True in evaluation: flax's
``Dropout(deterministic=...)`` convention)."""
_MODE_WORDS = ("train", "eval", "determin", "infer", "test", "mode")


def _call_flag(fn) -> str | None:
    """The name under which ``fn`` takes the training flag: one of
    :data:`TRAIN_FLAGS` or :data:`EVAL_FLAGS`, ``"train"`` for ``**kwargs``, or
    ``None`` when it takes none (an nnx model switched by ``.train()`` /
    ``.eval()``, a model without a mode).

    Raises:
      ValueError: a parameter that looks like a mode switch under another name
        (``is_eval``, ``mode``, ``test``...), which trjax cannot tell apart from
        an ordinary argument: it would run in one mode only, so it is refused,
        naming the parameter and the names trjax recognises.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "train"
    for name in TRAIN_FLAGS + EVAL_FLAGS:
        if name in params:
            return name
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in ("self", "x", "inputs"):
            continue
        looks = isinstance(p.default, bool) or p.annotation in (bool, "bool")
        if looks and any(w in name.lower() for w in _MODE_WORDS):
            raise ValueError(
                f"the model's __call__ takes {name!r}, which looks like a training/evaluation "
                f"switch trjax does not recognise: it would stay {p.default!r} in training and "
                f"in evaluation. Rename it to one of {list(TRAIN_FLAGS)} (True in training) or "
                f"{list(EVAL_FLAGS)} (True in evaluation)")
    return "train" if any(p.kind == p.VAR_KEYWORD for p in params.values()) else None


def _flag_value(name: str | None, train: bool) -> dict:
    """``{name: train}`` (``{name: not train}`` for :data:`EVAL_FLAGS`), ``{}``
    without a flag."""
    if name is None:
        return {}
    return {name: (not train) if name in EVAL_FLAGS else train}


class FlaggedSequential(nn.Module):
    """``flax.linen.Sequential`` that hands every layer the training flag it takes.

    flax's ``Sequential`` passes keyword arguments to its first layer only, so a
    sequence whose layers take ``train`` (a BatchNorm or Dropout block) cannot be
    trained through it. This module calls each layer with the flag its own
    ``__call__`` takes (:func:`_call_flag`: ``train``, ``deterministic``...,
    none for functions such as ``nn.relu``), in order, one array in and out. Its
    parameter tree is ``nn.Sequential``'s (``layers_0``, ``layers_1``, ...), so
    weights move between the two unchanged. :func:`as_network` uses it for any
    ``nn.Sequential``. ``span=(lo, hi)`` calls ``layers[lo:hi]`` only, under
    the whole sequence's names (a pipeline stage:
    :func:`trjax.parallel.pipeline.stage_modules`).
    """
    layers: Sequence[Any]
    span: Optional[tuple] = None

    def __call__(self, x, train: bool = True):
        lo, hi = self.span if self.span is not None else (0, len(self.layers))
        for layer in self.layers[lo:hi]:
            fn = layer.__call__ if isinstance(layer, nn.Module) else layer
            x = layer(x, **_flag_value(_call_flag(fn), train))
        return x

    def layer_costs(self, image_shape: tuple) -> list[dict]:
        """Per layer, in call order: ``{"name", "flops", "out_shape"}`` for one
        example of ``image_shape``, from XLA's cost analysis of the layer alone
        in evaluation mode (nothing is compiled or run). ``name`` is the layer's
        parameter subtree (``layers_i``)."""
        x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
        variables = jax.eval_shape(lambda k, x: self.init(k, x, train=False),
                                   jax.random.key(0), x)
        out = []
        for i, layer in enumerate(self.layers):
            name = f"layers_{i}"
            own = {c: v[name] for c, v in variables.items() if name in v}
            fn = layer.__call__ if isinstance(layer, nn.Module) else layer
            flag = _flag_value(_call_flag(fn), False)
            call = (lambda v, x, layer=layer, flag=flag: layer.apply(v, x, **flag)) \
                if isinstance(layer, nn.Module) else (lambda v, x, layer=layer: layer(x))
            cost = jax.jit(call).lower(own, x).cost_analysis() or {}
            x = jax.eval_shape(call, own, x)
            out.append({"name": name, "flops": float(cost.get("flops", 0.0)),
                        "out_shape": tuple(x.shape[1:])})
        return out


RNG_STREAMS = ("dropout", "drop_path", "droppath", "stochastic_depth")
"""The linen random streams a training apply receives by name (``dropout``:
the step's key itself; the others a key folded from it). Any other name a
model asks for falls back, as flax does, to the ``params`` stream, which the
training apply also receives (a key of its own)."""


def _linen_rngs(rng) -> dict | None:
    """``{stream: key}`` for a linen training apply: :data:`RNG_STREAMS` and
    ``params`` (flax's fallback for other names), each its own key from ``rng``."""
    if rng is None:
        return None
    fold = lambda name: jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return {name: rng if name == "dropout" else fold(name) for name in RNG_STREAMS + ("params",)}


def _call_rngs(fn) -> str | None:
    """``"required"`` / ``"optional"`` when ``fn`` takes ``rngs`` (an nnx model
    that takes its random keys at call time, the NNX tutorials' way), else
    ``None``."""
    try:
        p = inspect.signature(fn).parameters.get("rngs")
    except (TypeError, ValueError):
        return None
    if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
        return None
    return "optional" if p.default is not p.empty else "required"


def logits_of(out):
    """The logits of a model's output: ``out`` itself, or the first element of
    a ``(logits, extras)`` tuple (big_vision's models return their
    intermediate features beside the logits; trjax trains on the logits)."""
    if isinstance(out, (tuple, list)) and len(out) >= 1 and hasattr(out[0], "shape"):
        return out[0]
    return out


def _nest(flat: dict, leaf: str) -> dict:
    """``{(a, b): v}`` -> ``{a: {b: {leaf: v}}}``."""
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path:
            d = d.setdefault(k, {})
        d[leaf] = v
    return out


def _fill_keys(pure, key):
    """A pure rng-state dict with every PRNG key leaf ``fold_in(key, i)`` (its
    leaf index ``i``) and every counter 0."""
    leaves, treedef = jax.tree_util.tree_flatten(pure)
    out = []
    for i, leaf in enumerate(leaves):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            k = jax.random.fold_in(key, i)
            n = math.prod(leaf.shape)
            out.append(k if leaf.shape == () else jax.random.split(k, n).reshape(leaf.shape))
        else:
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True, eq=False)
class _NNXParts:
    """An nnx model split for pure steps: its graph and state templates.

    ``templates``: ``(params, batch_stats, rng state)`` ``nnx.State`` (values
    abstract or concrete, only their structure is used); ``make``: ``key ->
    module`` for a class (a ``ToLinen``'s), or ``None`` with ``values``: the
    instance's own ``(params, batch_stats)`` pure dicts.
    """
    graphdef: Any
    templates: tuple
    make: Optional[Callable] = None
    values: Optional[tuple] = None

    def init(self, key) -> dict:
        if self.make is None:
            params, stats = self.values
        else:
            params, stats, _ = _split_nnx(self.make(key))[1]
        return {"params": params, "batch_stats": stats}

    def merge(self, params, batch_stats, rng):
        """A fresh module (new Variables, made in the current trace) holding these values."""
        from flax import nnx

        def fresh(template, pure):
            state = nnx.State(jax.tree_util.tree_map(lambda v: v, template))
            nnx.replace_by_pure_dict(state, pure)
            return state
        rng_pure = _fill_keys(nnx.to_pure_dict(self.templates[2]),
                              jax.random.key(0) if rng is None else rng)
        return nnx.merge(self.graphdef, fresh(self.templates[0], params),
                         fresh(self.templates[1], batch_stats), fresh(self.templates[2], rng_pure))


def _split_nnx(module):
    """``(graphdef, (params, batch_stats, rng) pure dicts), states``; raises
    ``ValueError`` on state of any other kind (trjax would not train it)."""
    from flax import nnx
    graphdef, params, stats, rng, rest = nnx.split(module, nnx.Param, nnx.BatchStat,
                                                    nnx.RngState, ...)
    other = [(p, type(v).__name__) for p, v in nnx.to_flat_state(rest)]
    if other:
        raise ValueError(f"the nnx model holds state trjax does not train: "
                         f"{['/'.join(map(str, p)) + ' (' + t + ')' for p, t in other[:5]]}; "
                         "trjax trains nnx.Param and keeps nnx.BatchStat statistics (nnx.Rngs "
                         "streams are re-seeded every step): hold other values as constants")
    pure = (nnx.to_pure_dict(params), nnx.to_pure_dict(stats), nnx.to_pure_dict(rng))
    return graphdef, pure, (params, stats, rng)


def _nnx_parts(model) -> tuple[_NNXParts, Callable]:
    """``(_NNXParts, the module's __call__)`` of an nnx instance or a ``ToLinen``."""
    from flax import nnx
    if isinstance(model, nnx.Module):
        graphdef, (params, stats, _), states = _split_nnx(model)
        return _NNXParts(graphdef, states, values=(params, stats)), type(model).__call__
    cls, args, kwargs = model.nnx_class, tuple(model.args), dict(model.kwargs)
    make = (lambda key: cls(*args, **kwargs)) if model.skip_rng else \
        (lambda key: cls(*args, **kwargs, rngs=nnx.Rngs(key)))
    abstract = nnx.eval_shape(lambda: make(jax.random.key(0)))
    graphdef, _, states = _split_nnx(abstract)
    return _NNXParts(graphdef, states, make=make), cls.__call__


@dataclasses.dataclass(frozen=True, eq=False)
class Network:
    """trjax's view of a flax model: what the compiled steps call.

    Build it with :func:`wrap` (the trainer) or :func:`as_network` (a bare
    module, e.g. in tests). Pure methods, traceable inside ``shard_map``.

    Attributes:
      module: the user's model: a linen module, an ``nnx.Module`` instance or a
        ``flax.nnx.bridge.ToLinen`` (an nnx class, built per key).
      kind: ``"linen"`` or ``"nnx"`` (an nnx instance or a ``ToLinen``).
      mean, std: the data set's per-channel statistics (or ``None``), for
        :func:`normalize` in the steps.
      dtype: the compute dtype the steps standardise the input to.
      seed: the dropout stream's seed (``config.seed``).
      folds: evaluation folds BatchNorm ahead of time (``bn_folded``; trjax's
        built-in ResNets); otherwise the model evaluates with its own
        ``batch_stats``.
      train_flag: the name of the ``__call__`` argument that takes the
        training flag (:data:`TRAIN_FLAGS`; :data:`EVAL_FLAGS` take it
        inverted), or ``None``.
      call_rngs: an nnx ``__call__`` that takes ``rngs``: ``"required"`` or
        ``"optional"`` (:func:`_call_rngs`); it gets ``nnx.Rngs`` from the
        step's key in training (and in evaluation when required).
      bn_momentum: every BatchNorm's running momentum (``config.bn_momentum``),
        or ``None``: each layer keeps its own.
      layer_plan: what changes how flax's own layers run in every apply, or
        ``None``: an object with ``linen()`` (a :func:`flax.linen.intercept_methods`
        interceptor) and ``nnx(model)`` (swaps a merged nnx model's layers in
        place); the tensor plan (:class:`trjax.parallel.tensor.Plan`: Megatron's
        split, inside ``shard_map`` on the parameter slices) is one.
      remat: the modules whose activations the training backward recomputes
        (:class:`trjax.remat.Remat`, same two methods), or ``None``.
    """
    module: Any
    kind: str = "linen"
    mean: Optional[tuple] = None
    std: Optional[tuple] = None
    dtype: Any = jnp.float32
    seed: int = 0
    folds: bool = False
    train_flag: Optional[str] = "train"
    nnx: Optional[_NNXParts] = None
    call_rngs: Optional[str] = None
    bn_momentum: Optional[float] = None
    layer_plan: Any = None
    remat: Any = None

    def _plans(self, train: bool) -> list:
        return [p for p in (self.layer_plan, self.remat if train else None) if p is not None]

    def _split(self, train: bool = False):
        """The linen interception of the layer plan (and in training of the remat), a
        null context without either."""
        stack = contextlib.ExitStack()
        for plan in self._plans(train):
            stack.enter_context(nn.intercept_methods(plan.linen()))
        return stack

    def _merge(self, params, batch_stats, rng, ctx: Optional[BatchNormContext] = None):
        """The nnx model for one trace, with the layer plan's layers swapped in; in
        training (``ctx``: its BatchNorms adapted first) the remat's too."""
        model = self.nnx.merge(params, batch_stats, rng)
        if ctx is not None:
            swap_nnx_batchnorms(model, ctx)
        for plan in self._plans(ctx is not None):
            plan.nnx(model)
        return model

    def _flag(self, train: bool) -> dict:
        return _flag_value(self.train_flag, train)

    def init(self, key, image_shape: tuple) -> dict:
        """``{"params", "batch_stats"}`` (``batch_stats`` ``{}`` without BatchNorm)
        from one key, on a zero batch of one ``image_shape`` image in evaluation
        mode. An nnx instance gives its own values (``key`` unused).

        Raises:
          ValueError: a linen model whose ``init`` makes collections other than
            ``params`` and ``batch_stats``.
        """
        if self.kind == "nnx":
            return self.nnx.init(key)
        x = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
        variables = self.module.init(key, x, **self._flag(False))
        other = sorted(set(variables) - {"params", "batch_stats"})
        if other:
            raise ValueError(f"the model's init makes the collection(s) {other}: trjax trains "
                             "'params' and keeps BatchNorm's 'batch_stats'; make other values "
                             "constants (or sow them only when that collection is mutable)")
        return {"params": zero_init_residual_scales(self.module, variables.get("params", {})),
                "batch_stats": variables.get("batch_stats", {})}

    def abstract_variables(self, image_shape: tuple) -> dict:
        """:meth:`init`'s result as ``jax.ShapeDtypeStruct`` leaves (traced, not
        run): the shapes and dtypes of the parameters and statistics."""
        return jax.eval_shape(lambda k: self.init(k, image_shape), jax.random.key(0))

    def apply_train(self, params, batch_stats, x, ctx: BatchNormContext, rng=None):
        """The training forward pass: ``(logits, bn_sums)``.

        Args:
          params, batch_stats: the model's (``batch_stats``: this device's).
          x: ``[B, H, W, C]`` standardised input (:func:`normalize`).
          ctx: the BatchNorm mode, data axis and ``[B]`` padding mask; records
            every BatchNorm's running rule (``ctx.rules``).
          rng: the dropout key (``rngs={"dropout": rng}`` for linen; every nnx
            ``Rngs`` stream re-seeded from it), or ``None``.

        Returns:
          ``logits [B, K]`` and ``bn_sums`` (``{..module path..: {"sums": [2C+1]}}``,
          ``{}`` without BatchNorm), see :mod:`trjax.batchnorm`.
        """
        if self.kind == "nnx":
            model = self._merge(params, batch_stats, rng, ctx)
            model.train()
            with nnx_context(ctx):
                logits = logits_of(model(x, **self._flag(True), **self._rngs(rng, True)))
            sums = _nest(ctx.sums, "sums")
        else:
            with nn.intercept_methods(linen_interceptor(ctx)), self._split(train=True):
                out, new = self.module.apply(
                    {"params": params, "batch_stats": batch_stats}, x, **self._flag(True),
                    rngs=_linen_rngs(rng), mutable=["batch_stats", "bn_sums"])
            logits, sums = logits_of(out), new.get("bn_sums", {})
        if self.bn_momentum is not None:  # config.bn_momentum: every layer's rule
            ctx.rules.update({p: (self.bn_momentum, u) for p, (_, u) in ctx.rules.items()})
        return logits, sums

    def _rngs(self, rng, train: bool) -> dict:
        """``{"rngs": nnx.Rngs}`` for an nnx ``__call__`` that takes them: in
        training from ``rng`` (the ``dropout`` stream is ``rng`` itself, every
        other name falls back to ``default``), in evaluation only when required."""
        if self.call_rngs is None or not (train or self.call_rngs == "required"):
            return {}
        from flax import nnx
        key = jax.random.key(0) if rng is None else rng
        return {"rngs": nnx.Rngs(jax.random.fold_in(key, 1), dropout=key)}

    def apply_eval(self, params, bn, x, folded: bool = False):
        """Evaluation logits ``[B, K]`` (training flag off, no randomness).

        ``bn``: the folded BatchNorm tree (:meth:`fold`) when ``folded`` and
        :attr:`folds`, else the running ``batch_stats``."""
        if self.kind == "nnx":
            model = self._merge(params, bn, None)
            model.eval()
            return logits_of(model(x, **self._flag(False), **self._rngs(None, False)))
        collection = "bn_folded" if folded and self.folds else "batch_stats"
        with self._split():
            return logits_of(self.module.apply({"params": params, collection: bn}, x,
                                               **self._flag(False)))

    def fold(self, params, batch_stats):
        """What the evaluation step reads: the folded BatchNorm tree
        (:func:`trjax.batchnorm.fold_batchnorm_tree`) when :attr:`folds`, else
        ``batch_stats`` itself."""
        return fold_batchnorm_tree(params, batch_stats) if self.folds else batch_stats


def _complete(sub, template):
    """``sub`` (the subtrees of some layers) completed with zeros of ``template``'s
    leaves (shapes and dtypes) for the rest: inputs no computation reads, which XLA
    drops."""
    if isinstance(template, dict):
        sub = sub if isinstance(sub, dict) else {}
        return {k: _complete(sub.get(k), v) for k, v in template.items()}
    return sub if sub is not None else jnp.zeros(template.shape, template.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class NNXSequence:
    """An ``nnx.Sequential`` as a pipeline splits it (torchgpipe's sequence contract):
    layer ``i`` is the unit ``"layers/i"`` (its parameters ``params["layers"][i]``), and
    ``span=(lo, hi)`` runs ``layers[lo:hi]`` only (a pipeline stage).

    A stage merges the model from its own layers' values (the other layers' leaves
    zeros nothing reads), so every BatchNorm's path and every layer's own random
    stream (an ``nnx.Dropout(..., rngs=...)``) are the whole model's: a stage draws
    the masks the unsplit model draws. A call-time ``rngs`` stream (``nnx.Sequential``
    hands it to the layers that take one) starts afresh in each stage.
    """
    net: "Network"
    span: Optional[tuple] = None

    @property
    def layers(self):
        return self.net.module.layers

    def clone(self, span=None) -> "NNXSequence":
        return dataclasses.replace(self, span=span)

    def layer_costs(self, image_shape: tuple) -> list[dict]:
        """As :meth:`FlaggedSequential.layer_costs`: per layer ``{"name": "layers/i",
        "flops", "out_shape"}`` from XLA's cost analysis of the layer alone."""
        x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
        v = self.net.abstract_variables(image_shape)
        out = []
        for i in range(len(self.layers)):
            def call(v, x, i=i):
                model = self.net.nnx.merge(v["params"], v["batch_stats"], None)
                model.eval()
                return model.layers[i](x)
            cost = jax.jit(call).lower(v, x).cost_analysis() or {}
            x = jax.eval_shape(call, v, x)
            out.append({"name": f"layers/{i}", "flops": float(cost.get("flops", 0.0)),
                        "out_shape": tuple(x.shape[1:])})
        return out

    def apply_span(self, params, batch_stats, x, ctx: BatchNormContext, rng=None):
        """Training forward of ``layers[lo:hi]`` on ``x``: ``(y, bn_sums)`` as
        :meth:`Network.apply_train` (``params`` / ``batch_stats``: the span's layers'
        subtrees at least)."""
        from flax import nnx
        lo, hi = self.span if self.span is not None else (0, len(self.layers))
        tp, ts = (nnx.to_pure_dict(t) for t in self.net.nnx.templates[:2])
        model = self.net._merge(_complete(params, tp), _complete(batch_stats, ts), rng, ctx)
        model.train()
        rngs = self.net._rngs(rng, True).get("rngs")
        with nnx_context(ctx):
            for layer in list(model.layers)[lo:hi]:
                takes = rngs is not None and "rngs" in _keyword_args(layer)
                x = layer(x, **({"rngs": rngs} if takes else {}))
        return x, _nest(ctx.sums, "sums")


def _keyword_args(fn) -> set:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def splittable(model):
    """What a pipeline splits of ``model`` (a :class:`Network` or a module): a
    :class:`ResNet`, a :class:`FlaggedSequential` (a linen ``nn.Sequential``), an
    :class:`NNXSequence` (an ``nnx.Sequential``), or the module itself (which the
    pipeline then refuses, naming how to write it as a sequence)."""
    import sys
    nnx = sys.modules.get("flax.nnx")
    if not isinstance(model, Network):
        if nnx is not None and isinstance(model, nnx.Sequential):
            return NNXSequence(as_network(model))
        return model
    if model.kind == "nnx" and nnx is not None and isinstance(model.module, nnx.Sequential):
        return NNXSequence(model)
    return model.module


def as_network(model) -> Network:
    """A :class:`Network` for ``model`` with default input handling (no
    standardisation; the cast to the module's ``dtype``, float32 if it has none).

    Args:
      model: a :class:`Network` (returned as is), a flax linen module, an
        ``nnx.Module`` instance, a ``flax.nnx.bridge.ToLinen``, or a list of
        layers (linen modules and functions: ``nn.Sequential``; with an nnx
        module among them: ``nnx.Sequential``).

    Raises:
      TypeError: anything else, naming its type and what trjax accepts.
    """
    if isinstance(model, Network):
        return model
    import sys
    nnx = sys.modules.get("flax.nnx")
    if isinstance(model, (list, tuple)) and model:  # a list of layers: a sequence
        if nnx is not None and any(isinstance(m, nnx.Module) for m in model):
            model = nnx.Sequential(*model)
        else:
            model = nn.Sequential(list(model))
    if nnx is not None and isinstance(model, (nnx.Module, nnx.bridge.ToLinen)):
        parts, call = _nnx_parts(model)
        # nnx.Sequential hands keyword arguments to its first layer only; nnx's own layers
        # are switched by .train() / .eval(), so it gets no flag
        flag = None if isinstance(model, nnx.Sequential) else _call_flag(call)
        return Network(model, "nnx", dtype=jnp.float32, train_flag=flag, nnx=parts,
                       call_rngs=_call_rngs(call))
    if isinstance(model, nn.Sequential):  # every layer gets the flag it takes
        model = FlaggedSequential(layers=tuple(model.layers))
    if isinstance(model, nn.Module):
        return Network(model, "linen", dtype=getattr(model, "dtype", None) or jnp.float32,
                       folds=isinstance(model, ResNet), train_flag=_call_flag(model.__call__))
    if isinstance(model, type) and (issubclass(model, nn.Module) or (
            nnx is not None and issubclass(model, nnx.Module))):
        raise TypeError(f"model={model.__name__} is a class: pass an instance (linen: "
                        f"{model.__name__}(...); nnx: {model.__name__}(..., rngs=nnx.Rngs(0)))")
    raise TypeError(f"model={model!r} (type {type(model).__name__}) is neither a flax linen "
                    "Module nor an nnx Module: pass e.g. a flax.linen.Module instance or an "
                    "nnx.Module built with rngs=nnx.Rngs(0)")


def check_batch_stats(batch_stats, rules) -> None:
    """Every ``batch_stats`` leaf belongs to a BatchNorm trjax keeps (one with a
    running rule recorded while the model was traced in training:
    :class:`trjax.batchnorm.BatchNormContext`).

    Raises:
      ValueError: naming the first leaf no such layer keeps (another layer's
        statistics would never be reduced over devices nor updated).
    """
    for path, _ in jax.tree_util.tree_flatten_with_path(batch_stats)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
        if keys[:-1] not in rules:
            raise ValueError(
                f"batch_stats/{'/'.join(map(str, keys))} is not kept by a BatchNorm trjax "
                "adapts (flax.linen.BatchNorm, flax.nnx.BatchNorm, trjax.batchnorm.BatchNorm) "
                "called in training: trjax would never update it (statistics must be summed "
                "over devices with padding masked out); use one of those layers")


def check_output(net: Network, image_shape: tuple, num_classes: int, dtype=jnp.float32) -> None:
    """Checks, from abstract shapes (nothing is computed), that ``net`` gives
    logits ``[B, num_classes]`` of a float dtype in evaluation and in training,
    and that trjax keeps every BatchNorm statistic (:func:`check_batch_stats`).

    Raises:
      ValueError: the output is not one array, has another shape or a
        non-float dtype, or a statistic no adapted BatchNorm keeps (naming the
        value and the fix).
    """
    x = jax.ShapeDtypeStruct((2,) + tuple(image_shape), dtype)
    variables = net.abstract_variables(image_shape)
    ctx = BatchNormContext("local")
    outs = {
        "evaluation": jax.eval_shape(
            lambda v, x: net.apply_eval(v["params"], v["batch_stats"], x), variables, x),
        "training": jax.eval_shape(
            lambda v, x, k: net.apply_train(v["params"], v["batch_stats"], x, ctx, k)[0],
            variables, x, jax.random.key(0))}
    check_batch_stats(variables["batch_stats"], ctx.rules)
    for mode, out in outs.items():
        where = f"the model (in {mode}, on a batch of 2 images {tuple(image_shape)})"
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise ValueError(f"{where} returned {jax.tree_util.tree_map(lambda a: a.shape, out)}"
                             f" (a {type(out).__name__}); trjax needs the logits, one array "
                             f"[B, {num_classes}], alone or first in a tuple (logits, extras): "
                             "return the logits, or (logits, extras)")
        if tuple(out.shape) != (2, num_classes):
            raise ValueError(f"{where} returned shape {tuple(out.shape)}; trjax needs logits "
                             f"[B, num_classes] = [2, {num_classes}] (num_classes from the data "
                             f"set): give the last layer {num_classes} outputs, e.g. "
                             f"nn.Dense({num_classes}), and flatten or pool the spatial axes "
                             "(of a tuple output, trjax reads the first element as the logits)")
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise ValueError(f"{where} returned {out.dtype} logits; trjax needs a float dtype "
                             "(the loss is differentiated): return e.g. logits.astype(jnp.float32)")


def bn_momenta(net: Network, image_shape: tuple) -> dict[str, float]:
    """``{layer path: momentum}`` of every BatchNorm ``net`` calls in training
    (the momentum its running statistics follow, after :attr:`Network.bn_momentum`),
    from an abstract trace (nothing is computed); a trjax ResNet's layers, read from its
    statistics' paths, all at the ResNet's momentum."""
    if isinstance(net.module, ResNet):  # its layers reduce over the mesh: not traced here
        m = net.module.bn_momentum if net.bn_momentum is None else net.bn_momentum
        stats = jax.tree_util.tree_flatten_with_path(
            net.abstract_variables(image_shape)["batch_stats"])[0]
        return {"/".join(str(k.key) for k in path[:-1]): m for path, _ in stats
                if path[-1].key == "mean"}
    x = jax.ShapeDtypeStruct((2,) + tuple(image_shape), net.dtype)
    ctx = BatchNormContext("local")
    jax.eval_shape(lambda v, x, k: net.apply_train(v["params"], v["batch_stats"], x, ctx, k)[0],
                   net.abstract_variables(image_shape), x, jax.random.key(0))
    return {"/".join(map(str, p)): m for p, (m, _) in ctx.rules.items()}


def warn_slow_statistics(momenta: dict, total_steps: int) -> None:
    """Warns when a BatchNorm's running statistics would still hold more than
    half their starting value after the run: ``momentum ** total_steps > 0.5``
    (e.g. a published 0.997 over fewer than 231 steps). Evaluation reads those
    statistics, so its accuracy would say little about the weights.

    Warns (``UserWarning``): naming the layers, their momentum and the fix
    (``config.bn_momentum``, which sets every layer's)."""
    slow = {p: m for p, m in momenta.items() if m ** max(total_steps, 0) > 0.5}
    if slow:
        m = max(slow.values())
        import warnings
        warnings.warn(
            f"{len(slow)} BatchNorm layer(s) (e.g. {next(iter(slow))!r}, momentum {m:g}) keep "
            f"{m ** total_steps:.0%} of their starting statistics after this run's "
            f"{total_steps} steps, so evaluation would normalise with statistics the data barely "
            "moved; set config.bn_momentum (every layer's, yours included), e.g. "
            f"--config.bn_momentum={0.5 ** (4 / max(total_steps, 1)):.3g}, or train "
            "longer", UserWarning, stacklevel=2)


def wrap(model, *, image_shape: tuple, num_classes: int, mean=None, std=None,
         dtype=jnp.float32, seed: int = 0, bn_momentum: Optional[float] = None,
         check: bool = True, remat: str = "none",
         remat_policy: str = "nothing_saveable") -> Network:
    """The :class:`Network` the trainer trains: ``model`` with the data set's
    input statistics, the compute dtype and the dropout seed.

    Args:
      model: a flax linen module, an ``nnx.Module`` instance, a
        ``flax.nnx.bridge.ToLinen`` or a :class:`Network`.
      image_shape: ``(H, W, C)`` of one example.
      num_classes: the logits' size.
      mean, std: the data set's per-channel statistics (``None``: no
        standardisation), applied by the steps with :func:`normalize`.
      dtype: the compute dtype of the standardised input.
      seed: the seed of the dropout stream (``config.seed``).
      bn_momentum: every BatchNorm's running momentum, the model's own
        layers' included (``config.bn_momentum``), or ``None`` (each keeps its own).
      check: run :func:`check_output` (abstract shapes only).
      remat, remat_policy: the modules the training backward recomputes and what
        they keep (``config.remat``, ``config.remat_policy``: :mod:`trjax.remat`).

    Raises:
      TypeError: a model that is neither linen nor nnx (:func:`as_network`).
      ValueError: a model with the wrong output (:func:`check_output`) or
        state trjax does not train; a remat pattern that matches no module
        (:func:`trjax.remat.resolve`).
    """
    net = as_network(model)
    net = dataclasses.replace(net, mean=None if mean is None else tuple(mean),
                              std=None if std is None else tuple(std), dtype=dtype, seed=int(seed),
                              bn_momentum=None if bn_momentum is None else float(bn_momentum))
    if check:
        check_output(net, image_shape, num_classes, dtype)
    return dataclasses.replace(net, remat=remat_lib.resolve(net, remat, image_shape,
                                                            remat_policy))
