"""Augmentation and evaluation crops (trjax.data.augment) against hand-made references."""
import numpy as np
import pytest
from PIL import Image

from trjax.data import augment as aug


def gradient_image(w, h):
    row = np.linspace(0, 255, w).astype(np.uint8)
    return Image.fromarray(np.repeat(np.repeat(row[None, :, None], h, 0), 3, 2))


def test_crop_flip_is_a_padded_crop_or_flip_per_example_stream():
    x = np.random.default_rng(0).integers(1, 256, (16, 8, 8, 2), dtype=np.uint8)
    rngs = lambda e: [aug.example_rng(3, e, i) for i in range(16)]  # noqa: E731
    out = aug.crop_flip(x, rngs(1))
    assert out.shape == x.shape and out.dtype == np.uint8
    np.testing.assert_array_equal(out, aug.crop_flip(x, rngs(1)))
    assert not np.array_equal(out, aug.crop_flip(x, rngs(2)))
    # row i depends on its own stream only: the same in any batch
    np.testing.assert_array_equal(out[5:6], aug.crop_flip(x[5:6], [aug.example_rng(3, 1, 5)]))
    padded = np.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))  # zeros: black, as torchvision pads
    flipped = 0
    for i in range(16):
        r = aug.example_rng(3, 1, i)
        dy, dx = r.integers(0, 9, 2)
        f = r.random() < 0.5
        view = padded[i, dy:dy + 8, dx:dx + 8]
        np.testing.assert_array_equal(out[i], view[:, ::-1] if f else view)
        flipped += f
    assert 0 < flipped < 16
    np.testing.assert_array_equal(aug.crop_flip(x, rngs(0), pad=0, flip=False), x)
    with pytest.raises(ValueError, match=r"\[B, H, W, C\]"):
        aug.crop_flip(x[0], rngs(0))
    with pytest.raises(ValueError, match="one rng per image"):
        aug.crop_flip(x, rngs(0)[:3])


def test_random_resized_crop_params():
    rng = np.random.default_rng(0)
    for _ in range(500):
        top, left, h, w = aug.random_resized_crop_params(300, 400, rng)
        assert 0 <= top and top + h <= 300 and 0 <= left and left + w <= 400
        assert 0.08 * 0.9 <= h * w / 120000 <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    # no box fits a 1000x10 strip: central crop clamped to ratio 3/4
    assert aug.random_resized_crop_params(1000, 10, rng) == ((1000 - 13) // 2, 0, 13, 10)
    assert aug.random_resized_crop_params(10, 1000, rng) == (0, (1000 - 13) // 2, 10, 13)


def test_train_crop_draws_box_then_flip():
    img = gradient_image(64, 48)
    flips = 0
    for i in range(16):
        out = aug.train_crop(img, aug.example_rng(0, 1, i), 12)
        assert out.shape == (12, 12, 3) and out.dtype == np.uint8
        r = aug.example_rng(0, 1, i)
        top, left, h, w = aug.random_resized_crop_params(48, 64, r)
        ref = np.asarray(img.resize((12, 12), Image.BILINEAR, box=(left, top, left + w, top + h)))
        f = r.random() < 0.5
        np.testing.assert_array_equal(out, ref[:, ::-1] if f else ref)
        slope = out[:, -1].astype(int).mean() - out[:, 0].astype(int).mean()
        assert (slope < 0) == f or w < 3
        flips += f
    assert 0 < flips < 16


def test_eval_crop_is_resize_shorter_side_then_center_crop():
    img = gradient_image(64, 48)
    out = aug.eval_crop(img, 16)
    # 64x48 -> shorter side round(16*256/224)=18 -> 24x18 -> center 16x16 at (left 4, top 1);
    # resampled in one step, so within 1 of resize-then-crop
    ref = np.asarray(img.resize((24, 18), Image.BILINEAR).crop((4, 1, 20, 17)), np.int64)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(np.int64) - ref).max() <= 1
    solid = aug.eval_crop(Image.new("RGB", (30, 40), (255, 0, 128)), 16)
    assert (solid == [255, 0, 128]).all()
