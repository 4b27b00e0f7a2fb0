"""Sources (trjax.data.datasets): loaders for on-disk data sets, on tiny files written in the real formats.

CIFAR batches are written both as Python 2 / numpy 1.x pickles (byte for byte
the opcodes of the distributed files: protocol 2, str keys read back as bytes,
``numpy.core.multiarray._reconstruct``) and as Python 3 / numpy 2 pickles. MNIST
IDX files are written plain and gzipped. Pixels stay uint8; the data set
carries the training pixels' mean and std, checked against numpy.
"""
import gzip
import os
import pickle
import re
import struct

import numpy as np
import pytest

from trjax.data import datasets as ds
from trjax.data import input_pipeline as ip

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
    """[N, 3072] uint8 channel planes -> [N, 32, 32, 3] uint8, written out independently."""
    out = np.empty((len(data), 32, 32, 3), np.uint8)
    for c in range(3):
        for y in range(32):
            out[:, y, :, c] = data[:, c * 1024 + y * 32:c * 1024 + y * 32 + 32]
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
    assert d.train.images.dtype == np.uint8 and d.train.labels.dtype == np.int32
    train = np.concatenate([content[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = sum((content[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    np.testing.assert_array_equal(d.train.labels, labels)
    np.testing.assert_array_equal(d.val.labels, content["test_batch"][1])
    raw = cifar_pixels(train)
    np.testing.assert_array_equal(d.train.images, raw)  # stored pixels, exactly
    np.testing.assert_array_equal(d.val.images, cifar_pixels(content["test_batch"][0]))
    # train statistics per channel, in uint8 units (numpy in float64 as the reference)
    np.testing.assert_allclose(d.mean, raw.astype(np.float64).mean(axis=(0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(d.std, raw.astype(np.float64).std(axis=(0, 1, 2)), rtol=1e-12)
    assert d.image_dtype == np.uint8
    again = ds.load_dataset("cifar10", folder)  # the extracted folder itself
    np.testing.assert_array_equal(again.train.images, d.train.images)
    batch = next(ip.iterate_batches(d.train, 8, shuffle=True))
    assert batch["image"].shape == (8, 32, 32, 3)


def test_cifar100_fine_labels(tmp_path):
    folder, content = write_cifar(tmp_path, 100, n_train=8, py3_file="test")
    d = ds.load_dataset("cifar100", folder)
    assert d.name == "cifar100" and d.num_classes == 100
    assert d.train.images.shape == (40, 32, 32, 3) and d.val.images.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(d.train.labels, content["train"][1])
    np.testing.assert_array_equal(d.val.labels, content["test"][1])
    raw = cifar_pixels(content["train"][0]).astype(np.float64)
    np.testing.assert_allclose(d.mean, raw.mean((0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(d.std, raw.std((0, 1, 2)), rtol=1e-12)


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
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"label 10 at index 1 is outside \[0, 10\)"),
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
    assert d.train.images.dtype == np.uint8 and d.val.labels.dtype == np.int32
    np.testing.assert_array_equal(d.train.labels, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(d.val.labels, arrays["t10k-labels-idx1-ubyte"])
    np.testing.assert_array_equal(d.train.images[..., 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(d.val.images[..., 0], arrays["t10k-images-idx3-ubyte"])
    raw = arrays["train-images-idx3-ubyte"].astype(np.float64)
    np.testing.assert_allclose(d.mean, [raw.mean()], rtol=1e-12)
    np.testing.assert_allclose(d.std, [raw.std()], rtol=1e-12)
    # torchvision's layout, found from the parent; the name comes from the registry.
    write_mnist(tmp_path / "tv" / "FashionMNIST" / "raw", gzip_train=False, seed=1)
    f = ds.load_dataset("fashion_mnist", tmp_path / "tv")
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
    with pytest.raises(ValueError, match=esc(labels_path) + r": label 10 at index 4 is outside"):
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
# digits and the registry.
# ---------------------------------------------------------------------------


def test_digits_are_the_integers_0_to_16_as_uint8():
    from sklearn.datasets import load_digits
    d = ds.load_digits()
    assert d.train.images.shape == (1437, 8, 8, 1) and d.val.images.shape == (360, 8, 8, 1)
    assert d.train.images.dtype == np.uint8 and d.train.images.max() == 16
    assert d.num_classes == 10 and set(np.unique(d.val.labels)) == set(range(10))
    # lossless: every stored image is one of scikit-learn's, value for value
    raw = {img.astype(np.uint8).tobytes() for img in load_digits().images}
    assert all(img[..., 0].tobytes() in raw for img in d.val.images)
    x = d.train.images.astype(np.float64)
    np.testing.assert_allclose(d.mean, [x.mean()], rtol=1e-12)
    np.testing.assert_allclose(d.std, [x.std()], rtol=1e-12)
    np.testing.assert_array_equal(d.val.labels, ds.load_digits().val.labels)  # fixed split


def test_the_packaged_digits_are_scikit_learns_split_bit_for_bit():
    """The copy in trjax/data equals scikit-learn's digits and train_test_split's stratified
    split, in its order; another split is computed by scikit-learn."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    raw = load_digits()
    x, y = raw.images.astype(np.uint8)[..., None], raw.target.astype(np.int32)
    for fraction, seed in ((0.2, 0), (0.3, 1)):
        xtr, xva, ytr, yva = train_test_split(x, y, test_size=fraction, random_state=seed,
                                              stratify=y)
        d = ds.load_digits(fraction, seed)
        for got, want in ((d.train.images, xtr), (d.train.labels, ytr), (d.val.images, xva),
                          (d.val.labels, yva)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    assert ds.DIGITS_FILE.exists()


def test_one_registry_names_every_loader(tmp_path):
    assert ds.DATASETS == tuple(ds.LOADERS) == ip.DATASETS
    assert set(ds.DATASETS) == {"digits", "cifar10", "cifar100", "mnist", "fashion_mnist",
                                "imagefolder", "hf", "array_record"}
    with pytest.raises(ValueError, match=r"dataset 'svhn' is unknown; choose one of \['digits'"):
        ds.load_dataset("svhn")
    with pytest.raises(ValueError, match="dataset 'mnist' reads files: set --config.data_dir"):
        ds.load_dataset("mnist", "")


def test_sources_never_import_the_pipeline():
    """Data flows one way: the sources and augment import no pipeline and no jax."""
    import ast
    import pathlib
    root = pathlib.Path(ds.__file__).parent
    for name in ("datasets", "formats", "imagefolder", "augment", "sources", "splits"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.startswith(("jax", "trjax.data.input_pipeline",
                                                         "trjax.train", "trjax.models"))}, name
