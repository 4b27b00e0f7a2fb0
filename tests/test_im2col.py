"""trjax.cpu.im2col: the routed convolutions equal XLA's (values and gradients), the
others are XLA's own, and the model keeps nn.Conv's parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from trjax.cpu import im2col
from trjax import models

NHWC = ("NHWC", "HWIO", "NHWC")


def _both(x, w, strides, padding, dn=NHWC):
    def loss(conv):
        def f(x, w):
            y = conv(x, w, strides, padding, dimension_numbers=dn)
            return jnp.sum(y * jnp.cos(y)), y  # a non-trivial cotangent
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    (_, y_ref), g_ref = loss(lax.conv_general_dilated)(x, w)
    (_, y), g = loss(im2col.conv_general_dilated)(x, w)
    return (y, y_ref), (g, g_ref)


@pytest.mark.parametrize("shape,kernel,strides,padding", [
    ((4, 2, 2, 8), (3, 3, 8, 6), (1, 1), ((1, 1), (1, 1))),    # window > input
    ((4, 2, 3, 8), (3, 3, 8, 6), (1, 1), "SAME"),              # one dimension only
    ((4, 8, 8, 4), (3, 3, 4, 6), (2, 2), ((1, 1), (1, 1))),    # strided
    ((4, 7, 9, 4), (3, 3, 4, 5), (2, 2), "SAME"),              # odd sizes, uneven SAME pads
    ((4, 8, 8, 4), (1, 1, 4, 6), (2, 2), "SAME"),              # 1x1 projection, stride 2
    ((2, 12, 12, 3), (7, 7, 3, 4), (2, 2), ((3, 3), (3, 3))),  # ImageNet stem
    ((4, 9, 9, 4), (3, 3, 4, 5), (2, 1), "VALID"),             # stride in one dimension
    ((1, 1, 1, 3), (7, 7, 3, 4), (2, 2), ((3, 3), (3, 3))),    # stem on a 1x1 image, batch 1
    ((2, 1, 8, 3), (3, 3, 3, 4), (1, 1), ((1, 1), (1, 1))),    # height 1: window > input in H
    ((2, 5, 5, 3), (3, 3, 3, 4), (2, 2), ((-1, 0), (2, 0))),   # negative and uneven pads
])
def test_routed_convolutions_equal_xla(shape, kernel, strides, padding):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=kernel) / np.sqrt(np.prod(kernel[:3])), jnp.float32)
    assert im2col.routed(shape[1:3], kernel[:2], strides)
    (y, y_ref), (g, g_ref) = _both(x, w, strides, padding)
    assert y.shape == y_ref.shape
    # the same sums in another order: float32 rounding of sums of <= 147 terms of O(1)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_other_convolutions_are_xlas_own():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 4, 4)), jnp.float32)
    assert not im2col.routed((8, 8), (3, 3), (1, 1))
    (y, y_ref), (g, g_ref) = _both(x, w, (1, 1), "SAME")
    np.testing.assert_array_equal(y, y_ref)
    for a, b in zip(g, g_ref):
        np.testing.assert_array_equal(a, b)
    # a layout or a dilation it does not handle: XLA's, even when strided
    nchw = ("NCHW", "OIHW", "NCHW")
    xc, wc = jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(w, (3, 2, 0, 1))
    (y, y_ref), _ = _both(xc, wc, (2, 2), "SAME", dn=nchw)
    np.testing.assert_array_equal(y, y_ref)
    dilated = im2col.conv_general_dilated(x, w, (2, 2), "SAME", rhs_dilation=(2, 2),
                                          dimension_numbers=NHWC)
    np.testing.assert_array_equal(dilated, lax.conv_general_dilated(
        x, w, (2, 2), "SAME", rhs_dilation=(2, 2), dimension_numbers=NHWC))


def test_bf16_keeps_the_dtype():
    x = jnp.ones((2, 2, 2, 8), jnp.bfloat16)
    w = jnp.ones((3, 3, 8, 4), jnp.bfloat16)
    y = im2col.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
    ref = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
    assert y.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_resolve_conv_lowering():
    assert im2col.resolve_conv_lowering("auto", "cpu") == "im2col"
    assert im2col.resolve_conv_lowering("auto", "gpu") == "xla"
    assert im2col.resolve_conv_lowering("xla", "cpu") == "xla"
    assert im2col.resolve_conv_lowering("im2col", "gpu") == "im2col"
    with pytest.raises(ValueError, match=r"config.conv_lowering='gemm' is not one of"):
        im2col.resolve_conv_lowering("gemm", "cpu")


def test_model_on_2x2_maps_has_no_swapped_convolution():
    """The slow case: XLA swaps the operands of a 3x3 convolution on a 2x2 map (as on
    the last stage of ResNet-20 on 8x8 digits; its HLO then reverses the "kernel",
    ``rhs_reversal``). With im2col no convolution of the forward and backward pass is
    swapped; with XLA's, some are; the parameters and their initial values are the
    same, the logits equal to rounding. (One block of 8 channels on 2x2 inputs: the
    same convolutions, a fraction of ResNet-20's compile time.)"""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 2, 2, 1)), jnp.float32)
    out, hlo = {}, {}
    for lowering in ("xla", "im2col"):
        model = models.create_model("resnet8", stage_sizes=(1,), widths=(8,), stem_width=8,
                                    num_classes=10, bn_mode="local", conv_lowering=lowering)
        variables = model.init(jax.random.PRNGKey(0), x, train=False)

        def loss(params, model=model, variables=variables):
            y, _ = model.apply({**variables, "params": params}, x, train=True,
                               mutable=["batch_stats"])
            return jnp.sum(y ** 2)
        step = jax.jit(jax.value_and_grad(loss))
        hlo[lowering] = step.lower(variables["params"]).compile().as_text()
        out[lowering] = (variables, model.apply(variables, x, train=False))
    assert "rhs_reversal" in hlo["xla"] and "rhs_reversal" not in hlo["im2col"]
    (v_xla, y_xla), (v_im, y_im) = out["xla"], out["im2col"]
    assert jax.tree_util.tree_structure(v_xla) == jax.tree_util.tree_structure(v_im)
    for a, b in zip(jax.tree_util.tree_leaves(v_xla), jax.tree_util.tree_leaves(v_im)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(y_im, y_xla, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,kernel,strides", [
    ((2, 1, 8, 3), (3, 3, 3, 4), (1, 1)),  # padded height 1 < window 3: Ho would be -1
    ((2, 2, 2, 3), (3, 3, 3, 4), (2, 2)),  # Ho = Wo = 0
    ((2, 1, 1, 3), (7, 7, 3, 4), (2, 2)),
])
def test_window_larger_than_padded_input_gives_xlas_empty_output(shape, kernel, strides):
    """VALID padding with a window larger than the input: XLA's output has a zero-size
    spatial dimension; so must this one (no negative slice limits)."""
    x, w = jnp.ones(shape, jnp.float32), jnp.ones(kernel, jnp.float32)
    y = im2col.conv_general_dilated(x, w, strides, "VALID", dimension_numbers=NHWC)
    ref = lax.conv_general_dilated(x, w, strides, "VALID", dimension_numbers=NHWC)
    assert y.shape == ref.shape and 0 in ref.shape and y.dtype == ref.dtype
