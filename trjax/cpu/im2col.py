"""Convolutions as im2col + one matrix multiply, where XLA:CPU's are slow.

``lax.conv_general_dilated`` has two slow cases on XLA:CPU (jaxlib 0.10.2,
both kernel libraries, Eigen and YNNPACK):

* a kernel window larger than its input (a 3x3 convolution on the 2x2 maps of
  ResNet-20's last stage on 8x8 digits): XLA's algebraic simplifier swaps the
  operands (the input becomes the "kernel"), and the swapped convolution, its
  input gradient and its weight gradient run several times slower than the
  same arithmetic as a matrix multiply;
* strided convolutions: slower than the matrix multiply.

:func:`conv_general_dilated` computes those two cases the way Caffe's
``im2col`` does (Jia et al., "Caffe: Convolutional Architecture for Fast
Feature Embedding", 2014): the input is padded, the ``kh * kw`` shifted (and
strided) views of it are concatenated along the channels into patches
``[B, Ho, Wo, kh * kw * C]``, and one ``dot_general`` with the kernel reshaped
to ``[kh * kw * C, O]`` gives the output. Autodiff turns the views into pads
and the concatenation into slices, so the gradients are matrix multiplies too.
Every other convolution goes to ``lax.conv_general_dilated`` unchanged.
(jax's own ``lax.conv_general_dilated_patches`` extracts the patches with a
convolution against an identity kernel, so it keeps the slow path.) The
sums are the same; only their order, so float rounding (~1e-6 relative in
float32), differs.

The measurements (per convolution, and the main job's train step) are in
``docs/performance.md`` (third round, and the figures moved from this
docstring).

:class:`Im2colConv` plugs this into flax's ``nn.Conv`` through its
``conv_general_dilated_cls`` hook, so parameters, their names and their
initialisation are ``nn.Conv``'s.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

LOWERINGS = ("auto", "xla", "im2col")
"""``config.conv_lowering`` values."""


def resolve_conv_lowering(setting: str, platform: str | None = None) -> str:
    """``"xla"`` or ``"im2col"`` for ``config.conv_lowering``.

    ``"auto"`` is ``"im2col"`` on ``cpu`` and ``"xla"`` elsewhere (cuDNN and
    TPU convolutions have no such slow cases); ``platform`` defaults to
    ``jax.default_backend()``.

    Raises:
      ValueError: ``setting`` is not one of :data:`LOWERINGS`.
    """
    if setting not in LOWERINGS:
        raise ValueError(f"config.conv_lowering={setting!r} is not one of {LOWERINGS}")
    if setting != "auto":
        return setting
    return "im2col" if (platform or jax.default_backend()) == "cpu" else "xla"


def routed(in_spatial: Sequence[int], window: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a convolution goes to im2col: a stride above 1, or a window
    larger than the input in some spatial dimension."""
    return any(s > 1 for s in strides) or any(k > n for k, n in zip(window, in_spatial))


def _nhwc_hwio(dimension_numbers, ndim: int) -> bool:
    if ndim != 4 or dimension_numbers is None:
        return False
    dn = lax.conv_dimension_numbers((1,) * 4, (1,) * 4, dimension_numbers)
    return tuple(dn.lhs_spec) == (0, 3, 1, 2) and tuple(dn.rhs_spec) == (3, 2, 0, 1) \
        and tuple(dn.out_spec) == (0, 3, 1, 2)


def _im2col_pads(lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                 feature_group_count, batch_group_count):
    """The explicit ``((top, bottom), (left, right))`` padding of a convolution that goes
    to im2col, or ``None`` for one that stays XLA's: another layout, a dilation, feature
    or batch groups, neither stride nor window routed, or an empty output (a padded
    input smaller than the window: XLA gives the ``[B, 0, Wo, O]`` array)."""
    if (not _nhwc_hwio(dimension_numbers, lhs.ndim)
            or any(d != 1 for d in (*(lhs_dilation or ()), *(rhs_dilation or ())))
            or feature_group_count != 1 or batch_group_count != 1
            or not routed(lhs.shape[1:3], rhs.shape[:2], strides)):
        return None
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], strides, padding)
    if any(n + lo + hi < k for n, (lo, hi), k in zip(lhs.shape[1:3], padding, rhs.shape[:2])):
        return None
    return tuple(tuple(p) for p in padding)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                         batch_group_count=1, precision=None, preferred_element_type=None):
    """``lax.conv_general_dilated`` with the slow XLA:CPU cases as im2col.

    Same signature and result (up to float rounding) as
    ``lax.conv_general_dilated``. A 2-D convolution in NHWC / HWIO layout
    (``x_BxHxWxC``, ``kernel_KHxKWxCxO``) without dilation or feature groups
    whose stride or window :func:`routed` selects becomes patches
    ``[B, Ho, Wo, KH * KW * C]`` times the kernel ``[KH * KW * C, O]``;
    anything else is passed to ``lax.conv_general_dilated``.
    """
    strides = tuple(window_strides)
    pads = _im2col_pads(lhs, rhs, strides, padding, lhs_dilation, rhs_dilation,
                        dimension_numbers, feature_group_count, batch_group_count)
    if pads is None:
        return lax.conv_general_dilated(
            lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count, batch_group_count=batch_group_count,
            precision=precision, preferred_element_type=preferred_element_type)
    (pt, pb), (pl, pr) = pads
    x = lax.pad(lhs, jnp.zeros((), lhs.dtype), ((0, 0, 0), (pt, pb, 0), (pl, pr, 0), (0, 0, 0)))
    (kh, kw), (sh, sw) = rhs.shape[:2], strides
    ho = (x.shape[1] - kh) // sh + 1
    wo = (x.shape[2] - kw) // sw + 1
    views = [lax.slice(x, (0, i, j, 0), (x.shape[0], i + sh * (ho - 1) + 1,
                                         j + sw * (wo - 1) + 1, x.shape[3]), (1, sh, sw, 1))
             for i in range(kh) for j in range(kw)]
    patches = views[0] if len(views) == 1 else lax.concatenate(views, 3)
    kernel = rhs.reshape(kh * kw * rhs.shape[2], rhs.shape[3])
    return lax.dot_general(patches, kernel, (((3,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)


class Im2colConv:
    """``nn.Conv(..., conv_general_dilated_cls=Im2colConv)``: flax's hook for
    the convolution function; instances are :func:`conv_general_dilated`."""

    def __call__(self, *args, **kwargs):
        return conv_general_dilated(*args, **kwargs)
