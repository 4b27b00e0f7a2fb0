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


# ---------------------------------------------------------------------------
# Validation is never augmented, also when training augments.
# ---------------------------------------------------------------------------


def _augmented(split, batch) -> bool:
    """Whether a batch of an in-memory split holds other pixels than its examples' own."""
    real = batch["index"] >= 0
    return not np.array_equal(batch["image"][real], split.images[batch["index"][real]])


@pytest.mark.job
def test_validation_is_never_augmented_when_training_augments(tmp_path, monkeypatch):
    """A run with config.augment=True: the training batches the loop asks for are
    augmented, every validation batch holds its examples' stored pixels; and the check
    sees an augmented validation batch for what it is (the last lines)."""
    from helpers import small_config
    from trjax.data import input_pipeline as ip
    from trjax.train import train_and_evaluate
    data, seen, real = ip.load_digits(), [], ip.iterate_batches

    def spy(split, global_batch, **kw):
        for batch in real(split, global_batch, **kw):
            seen.append((split, kw.get("augment", False), batch))
            yield batch
    monkeypatch.setattr(ip, "iterate_batches", spy)
    train_and_evaluate(small_config(augment=True, num_epochs=1), str(tmp_path), data=data)
    train = [(a, b) for s, a, b in seen if s is data.train]
    val = [(a, b) for s, a, b in seen if s is data.val]
    assert len(train) == 12 and len(val) == 3 and len(seen) == 15  # 1437 / 128, 360 / 128
    assert all(a for a, _ in train) and all(_augmented(data.train, b) for _, b in train)
    assert not any(a for a, _ in val) and not any(_augmented(data.val, b) for _, b in val)
    assert sum(b["mask"].sum() for _, b in val) == 360  # every val example, once
    augmented_val = real(data.val, 128, shuffle=False, augment=True)
    assert all(_augmented(data.val, b) for b in augmented_val)


def test_image_folder_validation_rows_are_the_eval_crop(tmp_path):
    """An on-demand source's unaugmented rows are eval_crop of each decoded file (never
    train_crop's random box or flip), with workers=0 as the loop's evaluation asks."""
    from trjax.data import imagefolder as imf
    from trjax.data import input_pipeline as ip
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(3):
                gradient_image(30 + 7 * i, 20 + 5 * i).save(tmp_path / split / c / f"{i}.png")
    val = imf.ImageFolder(tmp_path, "val")
    batches = list(ip.iterate_batches(val, 4, shuffle=False, image_shape=(16, 16, 3)))
    want = np.stack([aug.eval_crop(imf.decode(p), 16) for p in val.paths])
    got = np.concatenate([b["image"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(got, want)
    trained = list(ip.iterate_batches(val, 4, shuffle=False, image_shape=(16, 16, 3),
                                      augment=True))
    assert not np.array_equal(np.concatenate([b["image"][b["mask"] > 0] for b in trained]), want)


def test_the_albumentations_example_in_docs_runs_per_example_and_deterministically():
    """docs/data.md's albumentations block, executed as it stands: its draws follow
    trjax's per-example keys (the same batch twice is bitwise equal, other keys draw
    otherwise), shape and dtype kept, accepted by the start-up check."""
    pytest.importorskip("albumentations")
    import pathlib
    import re
    from trjax.data import input_pipeline as ip
    text = (pathlib.Path(__file__).parents[1] / "docs" / "data.md").read_text()
    block = re.search(r"```python\nimport albumentations as A\n(.*?)```", text, re.S)
    scope: dict = {}
    exec("import albumentations as A\n" + block.group(1), scope)
    fn = scope["albumentations_transform"]
    data = ip.load_digits()
    ip.check_transform(fn, data.train, data.image_shape, seed=0)
    batch = lambda epoch: next(ip.iterate_batches(data.train, 64, shuffle=True, seed=1,
                                                  epoch=epoch, transform=fn))
    a, b = batch(0), batch(0)
    plain = next(ip.iterate_batches(data.train, 64, shuffle=True, seed=1, epoch=0))
    np.testing.assert_array_equal(a["image"], b["image"])
    assert a["image"].shape == plain["image"].shape and a["image"].dtype == np.uint8
    changed = (a["image"] != plain["image"]).reshape(64, -1).any(axis=1)
    assert 0.3 < changed.mean() < 1.0  # p=0.8 / 0.5: most examples change, some do not
    img = data.train.images[0]  # another key, other draws
    draws = {fn(img, np.random.default_rng(k)).tobytes() for k in range(8)}
    assert len(draws) > 2 and fn(img, np.random.default_rng(3)).tobytes() in draws
