"""ResNet family in flax linen: CIFAR-style (3x3 stem) and ImageNet (7x7 stem).

He et al., "Deep Residual Learning for Image Recognition", CVPR 2016:
ResNet-20/32/56 (section 4.2, 16-32-64 widths, 3x3 stem) for small images;
ResNet-18/34 (basic blocks) and ResNet-50 (bottlenecks) for ImageNet (table 1).
Every convolution is followed by :class:`trjax.batchnorm.BatchNorm`; the network
ends in global average pooling and one dense layer. Variants are built from one
class with ``functools.partial``, as in the Flax ImageNet example.

Input: ``x_BxHxWxC``, uint8 or float, standardised by the model itself when
``input_mean`` / ``input_std`` are set (:func:`normalize`,
inside the compiled step); output: logits ``[B, num_classes]`` float32.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from trjax.batchnorm import BatchNorm
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


class BasicBlock(nn.Module):
    features: int
    strides: int
    norm: Any
    conv: Any = functools.partial(nn.Conv, use_bias=False)

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


class Bottleneck(nn.Module):
    features: int
    strides: int
    norm: Any
    conv: Any = functools.partial(nn.Conv, use_bias=False)

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
      input_mean, input_std: per-channel statistics of the input in its own
        units (the data set's ``mean`` / ``std``): the input becomes
        ``(x - mean) / std`` in float32, then ``dtype``. ``None``: only the cast.
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
    input_mean: Optional[Sequence[float]] = None
    input_std: Optional[Sequence[float]] = None
    conv_lowering: str = "auto"

    @nn.compact
    def __call__(self, x, train: bool = True, mask=None):
        norm = functools.partial(BatchNorm, mode=self.bn_mode, axis_name=self.axis_name,
                                 momentum=self.bn_momentum, dtype=self.dtype)
        im2col = resolve_conv_lowering(self.conv_lowering) == "im2col"
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                                 conv_general_dilated_cls=Im2colConv if im2col else None)
        x = normalize(x, self.input_mean, self.input_std, self.dtype)
        if self.stem == "imagenet":
            x = conv(self.stem_width, (7, 7), (2, 2), padding=3, name="stem_conv")(x)
        else:
            x = conv(self.stem_width, (3, 3), padding=1, name="stem_conv")(x)
        x = nn.relu(norm(name="stem_bn")(x, train, mask))
        if self.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        for i, (n_blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
            for j in range(n_blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = self.block(width, strides, norm, conv, name=f"stage{i + 1}_block{j + 1}")(
                    x, train, mask)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
        return x.astype(jnp.float32)


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
