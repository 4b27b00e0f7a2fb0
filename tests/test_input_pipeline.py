import numpy as np
import pytest

from trjax import input_pipeline as ip
from trjax.world import make_world


def test_digits_split_is_fixed_and_real():
    d = ip.load_digits()
    assert d.train.images.shape == (1437, 8, 8, 1) and d.val.images.shape == (360, 8, 8, 1)
    assert d.num_classes == 10 and set(np.unique(d.val.labels)) == set(range(10))
    d2 = ip.load_digits()
    np.testing.assert_array_equal(d.val.labels, d2.val.labels)


def test_batches_pad_and_mask_every_example_once():
    split = ip.Split(np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1), np.arange(10, dtype=np.int32))
    batches = list(ip.iterate_batches(split, 4, shuffle=True, seed=1, epoch=3))
    assert len(batches) == 3 and all(b["image"].shape == (4, 1, 1, 1) for b in batches)
    assert batches[-1]["mask"].tolist() == [1, 1, 0, 0]
    seen = np.concatenate([b["label"][b["mask"] > 0] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    again = list(ip.iterate_batches(split, 4, shuffle=True, seed=1, epoch=3))
    assert all((a["label"] == b["label"]).all() for a, b in zip(batches, again))
    assert len(list(ip.iterate_batches(split, 4, shuffle=False, remainder="drop"))) == 2


def test_to_device_checks_and_casts():
    w = make_world("all", 8)
    img = np.random.default_rng(0).normal(size=(8, 2, 2, 1))  # float64: cast by value
    out = ip.to_device({"image": img, "label": np.arange(8, dtype=np.int64), "mask": np.ones(8)},
                       w.sharded(), 10)
    assert out["image"].dtype == np.float32 and out["label"].dtype == np.int32
    np.testing.assert_allclose(np.asarray(out["image"]), img.astype(np.float32))
    with pytest.raises(ValueError, match=r"label 12 at position 3 is outside \[0, 10\)"):
        ip.to_device({"image": img, "label": np.array([0, 1, 2, 12, 0, 0, 0, 0])}, w.sharded(), 10)
    with pytest.raises(ValueError, match=r"label -1 at position 0"):
        ip.to_device({"image": img, "label": np.array([-1, 1, 2, 1, 0, 0, 0, 0])}, w.sharded(), 10)
    with pytest.raises(ValueError, match=r"label 1.5 at position 1 is not an integer"):
        ip.to_device({"image": img, "label": np.array([0, 1.5, 2, 1, 0, 0, 0, 0])}, w.sharded(), 10)
    bad = img.copy()
    bad[5, 1, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"image value inf at position \(5, 1, 0, 0\) is not finite"):
        ip.to_device({"image": bad, "label": np.zeros(8, int)}, w.sharded(), 10)
    # padding rows (mask 0) are not checked: their content never counts
    lab = np.zeros(8, int)
    lab[7] = 99
    ip.to_device({"image": img, "label": lab, "mask": np.r_[np.ones(7), 0]}, w.sharded(), 10)
