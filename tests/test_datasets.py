"""Loaders for on-disk data sets, on tiny files written in the real formats.

CIFAR batches are written both as Python 2 / numpy 1.x pickles (byte for byte
the opcodes of the distributed files: protocol 2, str keys read back as bytes,
``numpy.core.multiarray._reconstruct``) and as Python 3 / numpy 2 pickles. MNIST
IDX files are written plain and gzipped; image folders hold PNG and JPEG files.
"""
import gzip
import os
import pickle
import re
import struct
import threading
import time

import numpy as np
import pytest
from PIL import Image

from trjax import datasets as ds
from trjax import input_pipeline as ip

# ---------------------------------------------------------------------------
# Writers for the real formats.
# ---------------------------------------------------------------------------


def _py2_str(b: bytes) -> bytes:  # SHORT_BINSTRING / BINSTRING: a Python 2 str
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<i", len(b)) + b)


def _py2_int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)


def _py2_array(a: np.ndarray) -> bytes:
    """A uint8 array as numpy 1.x under Python 2 pickles it (protocol 2)."""
    out = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _py2_str(b"b") + b"\x87R"
    out += b"(K\x01(" + b"".join(_py2_int(d) for d in a.shape) + b"t"
    out += (b"cnumpy\ndtype\n" + _py2_str(b"u1") + b"K\x00K\x01\x87R(K\x03" + _py2_str(b"|")
            + b"NNN" + _py2_int(-1) + _py2_int(-1) + b"K\x00tb")
    return out + b"\x89" + _py2_str(np.ascontiguousarray(a).tobytes()) + b"tb"


def py2_pickle(d: dict) -> bytes:
    """A dict of str keys -> uint8 array | str | list of ints or strs, as Python 2's cPickle writes it."""
    out = b"\x80\x02}("
    for k, v in d.items():
        out += _py2_str(k.encode())
        if isinstance(v, np.ndarray):
            out += _py2_array(v)
        elif isinstance(v, bytes):
            out += _py2_str(v)
        else:
            out += b"](" + b"".join(_py2_str(x) if isinstance(x, bytes) else _py2_int(int(x))
                                   for x in v) + b"e"
    return out + b"u."


def write_cifar(root, num_classes=10, n_train=3, n_val=4, seed=0, py3_file=None):
    """Writes the extracted archive folder under root; returns (folder, {file: (data, labels)})."""
    rng = np.random.default_rng(seed)
    if num_classes == 10:
        folder, label_key = root / "cifar-10-batches-py", "labels"
        files = {f"data_batch_{i}": n_train for i in range(1, 6)} | {"test_batch": n_val}
    else:
        folder, label_key = root / "cifar-100-python", "fine_labels"
        files = {"train": 5 * n_train, "test": n_val}
    folder.mkdir(parents=True)
    content = {}
    for name, n in files.items():
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, num_classes, n).tolist()
        content[name] = (data, labels)
        record = {"batch_label": b"batch " + name.encode(), label_key: labels, "data": data,
                  "filenames": [b"img%d.png" % i for i in range(n)]}
        if num_classes == 100:
            record["coarse_labels"] = [x // 5 for x in labels]
        if name == py3_file:  # Python 3 / numpy 2: bytes keys, protocol 4
            (folder / name).write_bytes(pickle.dumps({k.encode(): v for k, v in record.items()},
                                                     protocol=4))
        else:
            (folder / name).write_bytes(py2_pickle(record))
    return folder, content


def cifar_pixels(data):
    """[N, 3072] uint8 channel planes -> [N, 32, 32, 3] on [0, 1], written out independently."""
    out = np.empty((len(data), 32, 32, 3))
    for c in range(3):
        for y in range(32):
            out[:, y, :, c] = data[:, c * 1024 + y * 32:c * 1024 + y * 32 + 32] / 255.0
    return out


def idx_bytes(array: np.ndarray, code=0x08) -> bytes:
    return (bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
            + array.astype(array.dtype.newbyteorder(">")).tobytes())


def write_mnist(folder, n_train=6, n_val=5, seed=0, gzip_train=True):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train).astype(np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_val, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_val).astype(np.uint8)}
    for name, a in arrays.items():
        if gzip_train and name.startswith("train"):
            (folder / (name + ".gz")).write_bytes(gzip.compress(idx_bytes(a)))
        else:
            (folder / name).write_bytes(idx_bytes(a))
    return arrays


def gradient_image(w, h):
    """Brightness increasing left to right (so a flip is visible)."""
    row = np.linspace(0, 255, w).astype(np.uint8)
    return Image.fromarray(np.repeat(np.repeat(row[None, :, None], h, 0), 3, 2))


def write_folder(root):
    """root/{train,val}/{cat,dog}/ with PNG and JPEG files of different sizes."""
    for split in ("train", "val"):
        for c, cls in enumerate(("dog", "cat")):
            d = root / split / cls
            d.mkdir(parents=True)
            gradient_image(64, 48).save(d / "a.png")
            Image.new("RGB", (30, 40), (255, 0, 128)).save(d / "b.png")
            Image.fromarray(np.random.default_rng(c).integers(0, 256, (20, 36, 3), dtype=np.uint8)) \
                .save(d / "c.JPEG", quality=90)
            (d / "notes.txt").write_text("not an image")


def esc(path):
    return re.escape(str(path))


# ---------------------------------------------------------------------------
# CIFAR.
# ---------------------------------------------------------------------------


def test_cifar10_layout_labels_and_standardisation(tmp_path):
    folder, content = write_cifar(tmp_path, 10, py3_file="data_batch_2")
    d = ds.load_cifar(tmp_path)  # the parent of cifar-10-batches-py
    assert d.name == "cifar10" and d.num_classes == 10 and d.image_shape == (32, 32, 3)
    assert d.train.images.shape == (15, 32, 32, 3) and d.val.images.shape == (4, 32, 32, 3)
    assert d.train.images.dtype == np.float32 and d.train.labels.dtype == np.int32
    train = np.concatenate([content[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = sum((content[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    np.testing.assert_array_equal(d.train.labels, labels)
    np.testing.assert_array_equal(d.val.labels, content["test_batch"][1])
    raw = cifar_pixels(train)
    mean, std = raw.mean(axis=(0, 1, 2)), raw.std(axis=(0, 1, 2))  # train statistics, per channel
    np.testing.assert_allclose(d.train.images, (raw - mean) / std, atol=1e-5)
    np.testing.assert_allclose(d.val.images, (cifar_pixels(content["test_batch"][0]) - mean) / std,
                               atol=1e-5)
    np.testing.assert_allclose(d.train.images.mean(axis=(0, 1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(d.train.images.std(axis=(0, 1, 2)), 1, atol=1e-5)
    again = ds.DATASET_LOADERS["cifar10"](folder)  # the extracted folder itself
    np.testing.assert_array_equal(again.train.images, d.train.images)
    batch = next(ip.iterate_batches(d.train, 8, shuffle=True))
    assert batch["image"].shape == (8, 32, 32, 3)


def test_cifar100_fine_labels(tmp_path):
    folder, content = write_cifar(tmp_path, 100, n_train=8, py3_file="test")
    d = ds.DATASET_LOADERS["cifar100"](folder)
    assert d.name == "cifar100" and d.num_classes == 100
    assert d.train.images.shape == (40, 32, 32, 3) and d.val.images.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(d.train.labels, content["train"][1])
    np.testing.assert_array_equal(d.val.labels, content["test"][1])
    raw = cifar_pixels(content["train"][0])
    np.testing.assert_allclose(d.train.images, (raw - raw.mean((0, 1, 2))) / raw.std((0, 1, 2)),
                               atol=1e-5)


def test_cifar_missing_paths_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=esc(missing) + ".*data_batch_1..5 and test_batch"):
        ds.load_cifar(missing)
    folder, _ = write_cifar(tmp_path / "c10")
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=esc(folder / "data_batch_3") + ".*cifar-10-batches-py"):
        ds.load_cifar(tmp_path / "c10")
    with pytest.raises(FileNotFoundError, match=esc(tmp_path / "empty" / "train") + ".*train and test"):
        (tmp_path / "empty").mkdir()
        ds.load_cifar(tmp_path / "empty", num_classes=100)
    with pytest.raises(ValueError, match="CIFAR has 10 or 100 classes"):
        ds.load_cifar(tmp_path / "c10", num_classes=20)


@pytest.mark.parametrize("record, message", [
    ({b"data": np.zeros((2, 3072), np.uint8), b"label": [0, 1]}, r"missing key\(s\) \[b'labels'\]"),
    ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, r"uint8 array \[N, 3072\]"),
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, r"uint8 array \[N, 3072\]"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]}, r"2 images but b'labels'"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"label 10 at position 1 is outside \[0, 10\)"),
    ([1, 2, 3], "expected a pickled dict, got list"),
    ({b"data": os.getcwd, b"labels": []}, "getcwd, which a CIFAR batch never does; refusing"),
])
def test_cifar_malformed_batch_names_the_file(tmp_path, record, message):
    folder, _ = write_cifar(tmp_path)
    (folder / "data_batch_4").write_bytes(pickle.dumps(record, protocol=4))
    with pytest.raises(ValueError, match=esc(folder / "data_batch_4") + ".*" + message):
        ds.load_cifar(folder)


def test_cifar_not_a_pickle(tmp_path):
    folder, _ = write_cifar(tmp_path)
    (folder / "test_batch").write_bytes(b"<html>404 not found</html>")
    with pytest.raises(ValueError, match=esc(folder / "test_batch") + " is not a CIFAR python pickle"):
        ds.load_cifar(folder)


# ---------------------------------------------------------------------------
# MNIST / Fashion-MNIST.
# ---------------------------------------------------------------------------


def test_mnist_plain_and_gzipped_idx(tmp_path):
    arrays = write_mnist(tmp_path / "mnist")
    d = ds.load_mnist(tmp_path / "mnist")
    assert d.name == "mnist" and d.num_classes == 10
    assert d.train.images.shape == (6, 28, 28, 1) and d.val.images.shape == (5, 28, 28, 1)
    assert d.train.images.dtype == np.float32 and d.val.labels.dtype == np.int32
    np.testing.assert_array_equal(d.train.labels, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(d.val.labels, arrays["t10k-labels-idx1-ubyte"])
    raw = arrays["train-images-idx3-ubyte"][..., None] / 255.0
    mean, std = raw.mean(), raw.std()
    np.testing.assert_allclose(d.train.images, (raw - mean) / std, atol=1e-5)
    np.testing.assert_allclose(d.val.images, (arrays["t10k-images-idx3-ubyte"][..., None] / 255.0
                                              - mean) / std, atol=1e-5)
    assert abs(d.train.images.mean()) < 1e-5 and abs(d.train.images.std() - 1) < 1e-5
    # torchvision's layout, found from the parent; the name comes from the registry.
    write_mnist(tmp_path / "tv" / "FashionMNIST" / "raw", gzip_train=False, seed=1)
    f = ds.DATASET_LOADERS["fashion_mnist"](tmp_path / "tv")
    assert f.name == "fashion_mnist" and f.train.images.shape == (6, 28, 28, 1)


def test_read_idx_generic_types(tmp_path):
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 5
    (tmp_path / "x.idx").write_bytes(idx_bytes(a, 0x0C))
    out = ds.read_idx(tmp_path / "x.idx")
    assert out.dtype == np.int32 and out.dtype.isnative
    np.testing.assert_array_equal(out, a)
    f = np.linspace(-1, 1, 6).astype(np.float64)
    (tmp_path / "f.idx.gz").write_bytes(gzip.compress(idx_bytes(f, 0x0E)))
    np.testing.assert_array_equal(ds.read_idx(tmp_path / "f.idx.gz"), f)


def test_mnist_errors_name_the_file(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=esc(missing) + ".*t10k-images-idx3-ubyte"):
        ds.load_mnist(missing)
    root = tmp_path / "m"
    arrays = write_mnist(root)
    labels_path = root / "t10k-labels-idx1-ubyte"
    # bad magic: an image file where the labels belong
    labels_path.write_bytes(idx_bytes(np.zeros((5, 28, 28), np.uint8)))
    with pytest.raises(ValueError, match=esc(labels_path) + ": bad IDX magic number 0x00000803, "
                                         "expected 0x00000801"):
        ds.load_mnist(root)
    # not IDX at all
    labels_path.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ValueError, match=esc(labels_path) + ": bad IDX magic number"):
        ds.load_mnist(root)
    # truncated data
    labels_path.write_bytes(idx_bytes(arrays["t10k-labels-idx1-ubyte"])[:-2])
    with pytest.raises(ValueError, match=esc(labels_path) + r": size mismatch.*\(5,\) need 5 bytes "
                                         "of data but the file holds 3"):
        ds.load_mnist(root)
    # image and label counts disagree
    labels_path.write_bytes(idx_bytes(arrays["t10k-labels-idx1-ubyte"][:4]))
    with pytest.raises(ValueError, match=esc(root / "t10k-images-idx3-ubyte") + " holds 5 images but "
                                         + esc(labels_path) + " holds 4 labels"):
        ds.load_mnist(root)
    # labels out of range
    labels_path.write_bytes(idx_bytes(np.array([0, 1, 2, 3, 10], np.uint8)))
    with pytest.raises(ValueError, match=esc(labels_path) + r": label 10 at position 4 is outside"):
        ds.load_mnist(root)
    # a corrupt .gz
    gz = root / "train-images-idx3-ubyte.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=esc(gz) + " is not a valid gzip file"):
        ds.load_mnist(root)
    # a missing file
    gz.unlink()
    with pytest.raises(FileNotFoundError, match=esc(root / "train-images-idx3-ubyte") + r"\[.gz\] not found"):
        ds.load_mnist(root)


# ---------------------------------------------------------------------------
# ImageFolder.
# ---------------------------------------------------------------------------


def test_image_folder_lists_classes_and_labels(tmp_path):
    write_folder(tmp_path)
    train = ds.ImageFolder(tmp_path, "train")
    assert train.classes == ["cat", "dog"] and train.num_classes == 2  # sorted names
    assert len(train) == 6 and train.labels.dtype == np.int32
    assert train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert all(os.path.basename(os.path.dirname(p)) == train.classes[y]
               for p, y in zip(train.paths, train.labels))
    val = ds.ImageFolder(tmp_path, "val", classes=train.classes)
    assert val.labels.tolist() == train.labels.tolist()


def test_image_folder_eval_transform(tmp_path):
    write_folder(tmp_path)
    val = ds.ImageFolder(tmp_path, "val")
    out = val.load(np.arange(len(val)), train=False, image_size=16)
    assert out.shape == (6, 16, 16, 3) and out.dtype == np.float32
    np.testing.assert_array_equal(out, val.load(range(len(val)), train=False, image_size=16))
    solid = val.paths.index(str(tmp_path / "val" / "cat" / "b.png"))
    expected = (np.array([255, 0, 128]) / 255.0 - ds.IMAGENET_MEAN) / ds.IMAGENET_STD
    np.testing.assert_allclose(out[solid], np.broadcast_to(expected, (16, 16, 3)), atol=1e-5)
    grad = val.paths.index(str(tmp_path / "val" / "cat" / "a.png"))
    assert (np.diff(out[grad].mean(axis=(0, 2))) > 0).all()  # never flipped, brighter to the right
    # 64x48 -> shorter side round(16*256/224)=18 -> 24x18 -> center 16x16 at (left 4, top 1)
    ref = gradient_image(64, 48).resize((24, 18), Image.BILINEAR).crop((4, 1, 20, 17))
    ref = (np.asarray(ref, np.float64) / 255.0 - ds.IMAGENET_MEAN) / ds.IMAGENET_STD
    np.testing.assert_allclose(out[grad], ref, atol=1e-5)


def test_image_folder_train_transform_is_deterministic_per_rng(tmp_path):
    write_folder(tmp_path)
    train = ds.ImageFolder(tmp_path, "train")
    grad = train.paths.index(str(tmp_path / "train" / "dog" / "a.png"))
    idx = [grad] * 16 + [0, 5]
    out = train.load(idx, train=True, rng=ds.batch_rng(0, 1, 2), image_size=12)
    assert out.shape == (18, 12, 12, 3) and out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_array_equal(out, train.load(idx, train=True, rng=ds.batch_rng(0, 1, 2),
                                                  image_size=12))
    assert not np.array_equal(out, train.load(idx, train=True, rng=ds.batch_rng(0, 1, 3),
                                              image_size=12))
    # draws per image, in order: crop box, then flip; a flipped gradient gets darker to the right
    rng = ds.batch_rng(0, 1, 2)
    flips = []
    for _ in range(16):
        ds.random_resized_crop_params(48, 64, rng)
        flips.append(rng.random() < 0.5)
    slope = out[:16, :, -1].mean(axis=(1, 2)) - out[:16, :, 0].mean(axis=(1, 2))
    assert 0 < sum(flips) < 16
    np.testing.assert_array_equal(slope < 0, flips)
    with pytest.raises(ValueError, match="needs rng"):
        train.load([0], train=True)
    with pytest.raises(IndexError, match="index 6 is outside"):
        train.load([6], train=False)


def test_random_resized_crop_params():
    rng = np.random.default_rng(0)
    for _ in range(500):
        top, left, h, w = ds.random_resized_crop_params(300, 400, rng)
        assert 0 <= top and top + h <= 300 and 0 <= left and left + w <= 400
        assert 0.08 * 0.9 <= h * w / 120000 <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    # no box fits a 1000x10 strip: central crop clamped to ratio 3/4
    assert ds.random_resized_crop_params(1000, 10, rng) == ((1000 - 13) // 2, 0, 13, 10)
    assert ds.random_resized_crop_params(10, 1000, rng) == (0, (1000 - 13) // 2, 10, 13)


def test_image_folder_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=esc(tmp_path / "nowhere") + r".*root/\{train,val\}"):
        ds.ImageFolder(tmp_path / "nowhere", "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match=esc(tmp_path / "val") + " does not exist"):
        ds.ImageFolder(tmp_path, "val")
    with pytest.raises(ValueError, match=esc(tmp_path / "train") + " has no class directories"):
        ds.ImageFolder(tmp_path, "train")
    (tmp_path / "train" / "cat").mkdir()
    (tmp_path / "train" / "cat" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match=esc(tmp_path / "train") + " holds no images"):
        ds.ImageFolder(tmp_path, "train")
    (tmp_path / "train" / "dog").mkdir()
    (tmp_path / "train" / "dog" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="class directories without images.*" + esc(tmp_path / "train" / "cat")):
        ds.ImageFolder(tmp_path, "train")
    (tmp_path / "train" / "cat" / "broken.jpg").write_bytes(b"not a jpeg either")
    with pytest.raises(ValueError, match=r"class directories \['cat'\] are not among"):
        ds.ImageFolder(tmp_path, "train", classes=["dog"])
    folder = ds.ImageFolder(tmp_path, "train")  # listing is lazy: decoding fails on load
    with pytest.raises(ValueError, match=esc(tmp_path / "train" / "cat" / "broken.jpg") + ": cannot decode"):
        folder.load([0], train=False, image_size=8)


# ---------------------------------------------------------------------------
# Augmentation.
# ---------------------------------------------------------------------------


def test_augment_batch_is_a_padded_crop_or_flip_and_deterministic():
    x = np.random.default_rng(0).normal(size=(16, 8, 8, 2)).astype(np.float32)
    out = ds.augment_batch(x, ds.batch_rng(3, 1, 7))
    assert out.shape == x.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, ds.augment_batch(x, ds.batch_rng(3, 1, 7)))
    for other in [(3, 1, 8), (3, 2, 7), (4, 1, 7)]:
        assert not np.array_equal(out, ds.augment_batch(x, ds.batch_rng(*other)))
    padded = np.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))
    flipped = 0
    for i in range(16):
        views = {(dy, dx, f): (padded[i, dy:dy + 8, dx:dx + 8, :][:, ::-1] if f else
                               padded[i, dy:dy + 8, dx:dx + 8, :])
                 for dy in range(9) for dx in range(9) for f in (0, 1)}
        match = [k for k, v in views.items() if np.array_equal(v, out[i])]
        assert match, f"image {i} is not a padded crop of its input"
        flipped += match[0][2]
    assert 0 < flipped < 16
    np.testing.assert_array_equal(ds.augment_batch(x, ds.batch_rng(0, 0, 0), pad=0, flip=False), x)
    with pytest.raises(ValueError, match=r"\[B, H, W, C\]"):
        ds.augment_batch(x[0], ds.batch_rng(0, 0, 0))


def test_augment_batches_follow_seed_epoch_step():
    rng = np.random.default_rng(1)
    split = ip.Split(rng.normal(size=(10, 6, 6, 1)).astype(np.float32), np.arange(10, dtype=np.int32))
    plain = list(ip.iterate_batches(split, 4, shuffle=True, seed=5, epoch=2))
    aug = list(ds.augment_batches(iter(plain), seed=5, epoch=2, pad=2))
    for step, (p, a) in enumerate(zip(plain, aug)):
        np.testing.assert_array_equal(a["image"], ds.augment_batch(p["image"], ds.batch_rng(5, 2, step), pad=2))
        np.testing.assert_array_equal(a["label"], p["label"])
        np.testing.assert_array_equal(a["mask"], p["mask"])
    assert (aug[-1]["image"][aug[-1]["mask"] == 0] == 0).all()  # padded rows stay zero


# ---------------------------------------------------------------------------
# Prefetch.
# ---------------------------------------------------------------------------


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "trjax-prefetch" and t.is_alive()]


def test_prefetch_keeps_order_and_runs_ahead():
    assert list(ds.prefetch(range(50), depth=3)) == list(range(50))
    produced = []

    def source():
        for i in range(10):
            produced.append(i)
            yield i

    it = ds.prefetch(source(), depth=2)
    assert next(it) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert 3 <= len(produced) <= 4  # one consumed, two queued, at most one waiting for a slot
    assert list(it) == list(range(1, 10))
    assert not _prefetch_threads()
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ds.prefetch(range(3), depth=0)


def test_prefetch_reraises_producer_errors_in_order():
    def source():
        yield 0
        yield 1
        raise RuntimeError("boom in producer")

    seen = []
    with pytest.raises(RuntimeError, match="boom in producer"):
        for item in ds.prefetch(source()):
            seen.append(item)
    assert seen == [0, 1]
    assert not _prefetch_threads()


def test_prefetch_closes_cleanly_when_consumer_stops_early():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    it = ds.prefetch(endless(), depth=1)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.1)  # the producer is now blocked on the full queue
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 2
    assert closed.is_set() and not _prefetch_threads()
    for i in ds.prefetch(endless(), depth=2):  # break in a for loop
        if i == 5:
            break
    assert not _prefetch_threads()
