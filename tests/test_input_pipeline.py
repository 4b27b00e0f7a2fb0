"""The pipeline (trjax.data.input_pipeline): batches, determinism over splits and workers,
resume, bad files, prefetch, normalisation and the host->device boundary."""
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from trjax.data import augment
from trjax.data import datasets as ds
from trjax.data import input_pipeline as ip
from trjax import models
from trjax.world import make_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jpeg_folder(root, n_per_class=6, classes=("a", "b", "c")):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n_per_class):
                h, w = rng.integers(20, 48, 2)
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                    root / split / c / f"{i}.jpg", quality=85)
    return ds.load_dataset("imagefolder", str(root), image_size=16)


def _epoch(split, g, rows=None, **kw):
    kw = {"shuffle": True, "seed": 3, "epoch": 2, "augment": True, "image_shape": (16, 16, 3), **kw}
    return list(ip.iterate_batches(split, g, rows=rows, **kw))


def _assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype
            np.testing.assert_array_equal(x[k], y[k])


def test_batches_pad_and_mask_every_example_once():
    split = ip.Split(np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1), np.arange(10, dtype=np.int32))
    batches = list(ip.iterate_batches(split, 4, shuffle=True, seed=1, epoch=3))
    assert len(batches) == 3 and all(b["image"].shape == (4, 1, 1, 1) for b in batches)
    assert batches[-1]["mask"].tolist() == [1, 1, 0, 0]
    seen = np.concatenate([b["label"][b["mask"] > 0] for b in batches])
    assert sorted(seen.tolist()) == list(range(10))
    np.testing.assert_array_equal(np.concatenate([b["image"].ravel() for b in batches])[:10],
                                  np.random.default_rng((1, 3)).permutation(10))
    assert len(list(ip.iterate_batches(split, 4, shuffle=False, remainder="drop"))) == 2


def test_train_batches_are_full_only_where_no_batch_can_hold_padding():
    split = ip.Split(np.zeros((10, 1, 1, 1), np.uint8), np.zeros(10, np.int32))
    assert ip.train_batches_full(split, 5, "pad")  # 10 = 2 x 5
    assert not ip.train_batches_full(split, 4, "pad")  # 10 = 2 x 4 + 2: padded
    assert ip.train_batches_full(split, 4, "drop")
    for g, remainder in ((5, "pad"), (4, "drop")):  # what the promise means
        batches = list(ip.iterate_batches(split, g, shuffle=True, remainder=remainder))
        assert batches and all(b["mask"].min() == 1.0 for b in batches)

    class Skipping(NamedTuple):  # a source that masks out files it cannot decode
        labels: np.ndarray
        skip_bad_images: bool = True
    assert not ip.train_batches_full(Skipping(split.labels), 5, "drop")
    assert ip.train_batches_full(Skipping(split.labels, False), 5, "drop")
    with pytest.raises(ValueError, match="'pack' is not one of"):
        ip.train_batches_full(split, 5, "pack")


def test_each_epoch_has_its_own_order_from_the_documented_seed():
    # the documented derivation: numpy's default_rng((seed, epoch)).permutation(n)
    n = 50
    split = ip.Split(np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1), np.arange(n, dtype=np.int32))
    orders = {}
    for seed, epoch in [(1, 0), (1, 1), (1, 2), (2, 0)]:
        batches = list(ip.iterate_batches(split, 8, shuffle=True, seed=seed, epoch=epoch))
        got = np.concatenate([b["label"][b["mask"] > 0] for b in batches])
        np.testing.assert_array_equal(got, np.random.default_rng((seed, epoch)).permutation(n))
        orders[seed, epoch] = tuple(got)
    assert len(set(orders.values())) == 4  # every (seed, epoch) its own order (50! of them)
    assert orders[1, 0] == tuple(ip.epoch_order(n, shuffle=True, seed=1, epoch=0))


@pytest.mark.parametrize("source", ["digits", "imagefolder"])
def test_any_process_by_device_split_gives_the_same_global_batch(tmp_path, source):
    """1x8, 2x4, 4x2 processes x devices: each process loads only its rows (ranks are
    contiguous per process, local batch G / 8); concatenated they are the 1-process batch."""
    data = ds.load_digits() if source == "digits" else _jpeg_folder(tmp_path)
    g = 16
    whole = _epoch(data.train, g)
    assert any((b["image"][0] != b["image"][1]).any() for b in whole)
    for procs, devices in [(1, 8), (2, 4), (4, 2)]:
        local = g // (procs * devices)
        parts = [_epoch(data.train, g, rows=(p * devices * local, (p + 1) * devices * local))
                 for p in range(procs)]
        glued = [{k: np.concatenate([part[b][k] for part in parts]) for k in whole[b]}
                 for b in range(len(whole))]
        _assert_same(glued, whole)


def test_augmentation_follows_seed_epoch_and_example():
    d = ds.load_digits()
    b = _epoch(d.train, 32)[0]
    order = ip.epoch_order(len(d.train.labels), shuffle=True, seed=3, epoch=2)[:32]
    rngs = [augment.example_rng(3, 2, i) for i in order]
    np.testing.assert_array_equal(b["image"], augment.crop_flip(d.train.images[order], rngs))
    other = _epoch(d.train, 32, epoch=3)[0]["image"]
    plain = d.train.images[ip.epoch_order(len(d.train.labels), shuffle=True, seed=3, epoch=3)[:32]]
    assert not np.array_equal(other, plain)  # augmented ...
    assert b["image"].dtype == np.uint8


def test_worker_processes_give_identical_batches_and_resume(tmp_path):
    pytest.importorskip("grain")
    data = _jpeg_folder(tmp_path)
    g = 8
    inproc = _epoch(data.train, g, workers=0)
    assert len(inproc) == 3 and inproc[0]["image"].shape == (8, 16, 16, 3)
    _assert_same(_epoch(data.train, g, workers=1), inproc)
    _assert_same(_epoch(data.train, g, workers=2), inproc)
    # resuming at batch 1 with another worker count: the rest of the same epoch
    _assert_same(_epoch(data.train, g, workers=2, start=1), inproc[1:])
    _assert_same(_epoch(data.train, g, workers=0, start=2), inproc[2:])
    val = list(ip.iterate_batches(data.val, g, shuffle=False, image_shape=(16, 16, 3), workers=2))
    _assert_same(val, list(ip.iterate_batches(data.val, g, shuffle=False, image_shape=(16, 16, 3))))
    assert val[-1]["mask"].tolist() == [1, 1] + [0] * 6


def test_resume_in_process_equals_uninterrupted():
    d = ds.load_digits()
    full = _epoch(d.train, 128)
    for start in (1, 5, len(full) - 1, len(full)):
        _assert_same(_epoch(d.train, 128, start=start), full[start:])


def test_bad_files_skipped_and_counted_or_named(tmp_path):
    data = _jpeg_folder(tmp_path)
    bad = data.train.paths[4]
    with open(bad, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=bad + ": cannot decode image"):
        _epoch(data.train, 6, shuffle=False)
    data = ds.load_dataset("imagefolder", str(tmp_path), 16, skip_bad_images=True)
    skipped = set()
    batches = _epoch(data.train, 6, shuffle=False, skipped=skipped)
    assert skipped == {bad} and ip.skipped_images(data, skipped) == [bad]
    assert batches[0]["mask"].tolist() == [1, 1, 1, 1, 0, 1]
    assert (batches[0]["image"][4] == 0).all()
    assert sum(b["mask"].sum() for b in batches) == len(data.train) - 1
    # the same with worker processes
    try:
        import grain  # noqa: F401
    except ImportError:
        return
    skipped2 = set()
    _assert_same(_epoch(data.train, 6, shuffle=False, workers=2, skipped=skipped2), batches)
    assert skipped2 == {bad}


# ---------------------------------------------------------------------------
# Errors raised in worker processes reach this one as they are raised in-process.
# ---------------------------------------------------------------------------


class OddError(Exception):
    """A source's own error whose ``__init__`` takes other arguments than its message:
    pickle's default rebuilds it as ``OddError(message)`` and fails."""

    def __init__(self, path, code):
        super().__init__(f"{path}: odd failure {code}")
        self.path, self.code = path, code


class OddSource(NamedTuple):
    """An on-demand source whose example 3 raises :class:`OddError`."""
    labels: np.ndarray
    paths: tuple
    skip_bad_images: bool = False

    def image(self, i):
        if i == 3:
            raise OddError(self.paths[i], 7)
        return Image.new("RGB", (20, 20), (i, 0, 0))


def _corrupt_folder(tmp_path):
    data = _jpeg_folder(tmp_path)
    bad = data.train.paths[4]
    with open(bad, "r+b") as f:
        f.truncate(100)
    return data, bad


def _raised(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_a_bad_image_crosses_a_real_process_boundary_with_its_type_file_and_reason(tmp_path):
    """The worker's call (BatchMaker wrapped as iterate_batches wraps it for grain) in a
    spawned process: what comes back is rebuilt as the in-process BadImage, message and
    all. Runs without grain."""
    import concurrent.futures
    import multiprocessing
    from trjax.data import imagefolder, worker_errors
    data, bad = _corrupt_folder(tmp_path)
    maker = ip.BatchMaker(data.train, np.arange(len(data.train)), 6, (0, 6), seed=0, epoch=0,
                          augment=False, image_size=16)
    inproc = _raised(lambda: maker(0))
    assert type(inproc) is imagefolder.BadImage and str(inproc).startswith(bad + ": cannot decode")
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        failure = pool.submit(worker_errors.Catching(maker), 0).result()
    assert isinstance(failure, worker_errors.Failure)
    error = failure.rebuild()
    assert type(error) is imagefolder.BadImage and str(error) == str(inproc)
    assert (error.path, error.reason) == (bad, inproc.reason) and error.reason  # file, reason
    assert "raised in input worker process" in error.__notes__[-1]
    assert "imagefolder.BadImage: " + str(inproc) in error.__notes__[-1]  # its traceback
    # BadImage pickles on its own too
    again = pickle.loads(pickle.dumps(inproc))
    assert type(again) is imagefolder.BadImage and str(again) == str(inproc)
    assert (again.path, again.reason) == (bad, inproc.reason)


def test_every_error_type_survives_the_trip_or_is_named():
    """What a worker's queue does to a result (pickle, unpickle) leaves each error its
    type, message and attributes; a type that cannot travel is a WorkerError naming it."""
    from trjax.data import worker_errors as we

    def trip(error):
        def fail():
            raise error
        failure = we.Catching(fail)()  # in the worker
        return pickle.loads(pickle.dumps(failure)).rebuild()  # the queue, then the parent

    odd = OddError("/data/x.jpg", 7)
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        pickle.loads(pickle.dumps(odd))  # the field failure: pickle's default
    back = trip(odd)
    assert type(back) is OddError and str(back) == "/data/x.jpg: odd failure 7"
    assert (back.path, back.code) == ("/data/x.jpg", 7)
    plain = trip(ValueError("label 12 is outside [0, 10)"))
    assert type(plain) is ValueError and str(plain) == "label 12 is outside [0, 10)"

    class Local(Exception):  # not importable by name: cannot be rebuilt elsewhere
        pass
    named = trip(Local("no way home"))
    assert type(named) is ip.WorkerError and named.type_name.endswith("<locals>.Local")
    assert str(named) == named.type_name + ": no way home" and named.message == "no way home"
    held = ValueError("holds a lock")
    held.lock = threading.Lock()  # an attribute that does not pickle
    assert str(trip(held)) == "builtins.ValueError: holds a lock"
    assert all("raised in input worker process" in e.__notes__[-1] for e in (back, plain, named))
    assert we.Catching(lambda x: x + 1)(1) == 2


def test_worker_processes_raise_what_the_in_process_path_raises(tmp_path):
    """iterate_batches with grain workers: a corrupt file is the in-process BadImage (the
    same type and message: file and reason); a source's own error type arrives too."""
    pytest.importorskip("grain")
    data, bad = _corrupt_folder(tmp_path)
    inproc = _raised(lambda: _epoch(data.train, 6, shuffle=False))
    error = _raised(lambda: _epoch(data.train, 6, shuffle=False, workers=2))
    assert type(error) is type(inproc) and str(error) == str(inproc)
    assert error.path == bad and error.reason == inproc.reason
    source = OddSource(np.zeros(8, np.int32), tuple(f"/data/{i}.jpg" for i in range(8)))
    inproc = _raised(lambda: _epoch(source, 4, shuffle=False))
    error = _raised(lambda: _epoch(source, 4, shuffle=False, workers=1))
    assert type(error) is type(inproc) is OddError
    assert str(error) == str(inproc) == "/data/3.jpg: odd failure 7" and error.code == 7
    assert inproc.__notes__ == ["while reading example 3: /data/3.jpg"]
    assert error.__notes__[0] == inproc.__notes__[0]


def test_resolve_workers():
    d = ds.load_digits()
    assert ip.resolve_workers(-1, d.train) == 0 and ip.resolve_workers(4, d.train) == 0
    folder = object()
    assert ip.resolve_workers(0, folder) == 0
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="data_workers=.* must be -1"):
            ip.resolve_workers(bad, folder)
    try:
        import grain  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"needs grain: pip install 'trjax\[grain\]'"):
            ip.resolve_workers(2, folder)
        assert ip.resolve_workers(-1, folder) == 0
    else:
        assert ip.resolve_workers(-1, folder) == ip.available_cores()
        assert ip.resolve_workers(3, folder) == 3


# ---------------------------------------------------------------------------
# Normalisation in the compiled step; the host->device boundary.
# ---------------------------------------------------------------------------


def test_normalize_matches_numpy_and_the_model_applies_it():
    x = np.random.default_rng(0).integers(0, 256, (4, 6, 6, 3), dtype=np.uint8)
    mean, std = (120.5, 110.0, 99.25), (60.0, 55.5, 57.0)
    ref = (x.astype(np.float64) - np.array(mean)) / np.array(std)
    out = jax.jit(lambda a: models.normalize(a, mean, std, jnp.float32))(x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-6)
    assert models.normalize(x, mean, std, jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(models.normalize(x, None, None), x.astype(np.float32))
    # the evaluation step standardises uint8 before the model: == the model on the floats
    from trjax import parallel, steps
    mf = models.create_model("resnet8", num_classes=10, bn_mode="local")
    net = models.wrap(mf, image_shape=(6, 6, 3), num_classes=10, mean=mean, std=std, check=False)
    variables = jax.jit(lambda k: mf.init(k, jnp.zeros((1, 6, 6, 3)), train=False))(
        jax.random.key(0))  # each program once, not op by op
    w1 = make_world("1", 4)
    acc = jax.jit(steps.make_eval_step(parallel.data_parallel(net, w1, (6, 6, 3), "sync"),
                                       folded=False))(
        variables["params"], variables["batch_stats"],
        {"image": x, "label": np.zeros(4, np.int32), "mask": np.ones(4, np.float32)},
        np.zeros((1, 4), np.float32))
    logits = jax.jit(lambda v, a: mf.apply(v, a, train=False))(variables, ref.astype(np.float32))
    want = -np.sum(jax.nn.log_softmax(np.asarray(logits, np.float64))[:, 0])
    np.testing.assert_allclose(np.asarray(acc)[0, 0], want, rtol=1e-5)


def test_to_device_keeps_uint8_and_checks_and_casts_floats():
    w = make_world("all", 8)
    u8 = np.random.default_rng(1).integers(0, 256, (8, 2, 2, 1), dtype=np.uint8)
    out = ip.to_device({"image": u8, "label": np.arange(8), "mask": np.ones(8)}, w.sharded(), 10,
                       np.float32)
    assert out["image"].dtype == np.uint8 and out["label"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(out["image"]), u8)
    assert ip.device_image_dtype(np.uint8, jnp.bfloat16) == np.uint8
    assert ip.device_image_dtype(np.float64, jnp.bfloat16) == jnp.bfloat16
    img = np.random.default_rng(0).normal(size=(8, 2, 2, 1))  # float64: cast by value
    out = ip.to_device({"image": img, "label": np.arange(8, dtype=np.int64), "mask": np.ones(8)},
                       w.sharded(), 10)
    assert out["image"].dtype == np.float32 and out["label"].dtype == np.int32
    np.testing.assert_allclose(np.asarray(out["image"]), img.astype(np.float32))
    with pytest.raises(ValueError, match=r"label 12 at position 3 is outside \[0, 10\)"):
        ip.to_device({"image": u8, "label": np.array([0, 1, 2, 12, 0, 0, 0, 0])}, w.sharded(), 10)
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


# ---------------------------------------------------------------------------
# Prefetch.
# ---------------------------------------------------------------------------


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "trjax-prefetch" and t.is_alive()]


def test_prefetch_keeps_order_and_runs_ahead():
    assert list(ip.prefetch(range(50), depth=3)) == list(range(50))
    produced = []

    def source():
        for i in range(10):
            produced.append(i)
            yield i

    it = ip.prefetch(source(), depth=2)
    assert next(it) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert 3 <= len(produced) <= 4  # one consumed, two queued, at most one waiting for a slot
    assert list(it) == list(range(1, 10))
    assert not _prefetch_threads()
    with pytest.raises(ValueError, match=r"depth=-1 must be an int >= 0"):
        ip.prefetch(range(3), depth=-1)
    # depth 0: the source itself, no thread
    produced.clear()
    it = ip.prefetch(source(), depth=0)
    assert next(it) == 0 and produced == [0] and not _prefetch_threads()
    assert list(it) == list(range(1, 10))


def test_prefetch_reraises_producer_errors_in_order():
    def source():
        yield 0
        yield 1
        raise RuntimeError("boom in producer")

    seen = []
    with pytest.raises(RuntimeError, match="boom in producer"):
        for item in ip.prefetch(source()):
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

    it = ip.prefetch(endless(), depth=1)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.1)  # the producer is now blocked on the full queue
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 2
    assert closed.is_set() and not _prefetch_threads()
    for i in ip.prefetch(endless(), depth=2):  # break in a for loop
        if i == 5:
            break
    assert not _prefetch_threads()


# ---------------------------------------------------------------------------
# The input benchmark, tiny.
# ---------------------------------------------------------------------------


@pytest.mark.job
def test_bench_input_runs_tiny(tmp_path):
    import json
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_input.py"),
                        "--synthetic", "32", "--workers", "0", "--batch", "4", "--image_size", "32",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    res = report["results"]
    assert [x["workers"] for x in res] == [0] and report["images_in_folder"] == 32
    assert res[0]["images"] == 16 and res[0]["images_per_s"] > 0 and res[0]["cpu_ms_per_image"] > 0
    assert "images/s" in r.stdout  # timed: batches 2..6 of 8 (the middle half), 4 rows each


def test_to_device_checks_the_range_of_the_device_dtype_and_names_step_and_example():
    """Issue 13 item 4: the finiteness check also runs after the cast (uint16 65535 in float16,
    float64 1e300 in float32 would become inf), naming value, position, step, example, dtype."""
    import jax.numpy as jnp
    w = make_world("all", 8)
    u16 = np.zeros((8, 4, 4, 1), np.uint16)
    u16[3, 2, 1, 0] = 65535
    index = np.arange(100, 108)
    with pytest.raises(ValueError, match=r"65535 \(uint16\) at position \(3, 2, 1, 0\) of the batch "
                                         r"of step 7 \(example 103 of the data set\) does not fit "
                                         r"the device dtype float16"):
        ip.to_device({"image": u16, "label": np.zeros(8, int), "index": index}, w.sharded(), 10,
                     jnp.float16, step=7)
    out = ip.to_device({"image": u16, "label": np.zeros(8, int)}, w.sharded(), 10, jnp.float32)
    assert out["image"].dtype == np.float32 and float(out["image"][3, 2, 1, 0]) == 65535.0
    f64 = np.zeros((8, 4, 4, 1), np.float64)
    f64[6, 0, 0, 0] = 1e300
    with pytest.raises(ValueError, match=r"1e\+300 \(float64\) at position \(6, 0, 0, 0\).*float32"):
        ip.to_device({"image": f64, "label": np.zeros(8, int)}, w.sharded(), 10, np.float32)
    f32 = np.zeros((8, 4, 4, 1), np.float32)
    f32[1, 0, 0, 0] = 7e4
    with pytest.raises(ValueError, match=r"70000.0 \(float32\) at position \(1, 0, 0, 0\).*float16"):
        ip.to_device({"image": f32, "label": np.zeros(8, int)}, w.sharded(), 10, jnp.float16)
    # a padding row may hold anything; a NaN in a real row names step and example
    f64[6, 0, 0, 0] = 0.0
    f64[7, 0, 0, 0] = 1e300
    ip.to_device({"image": f64, "label": np.zeros(8, int), "mask": np.r_[np.ones(7), 0]},
                 w.sharded(), 10, np.float32)
    f64[2, 1, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"nan at position \(2, 1, 1, 0\) of the batch of step 3 "
                                         r"\(example 102 of the data set\) is not finite"):
        ip.to_device({"image": f64, "label": np.zeros(8, int), "mask": np.r_[np.ones(7), 0],
                      "index": index}, w.sharded(), 10, np.float32, step=3)


def test_batches_carry_each_rows_example_index():
    split = ip.Split(np.zeros((10, 2, 2, 1), np.uint8), np.arange(10, dtype=np.int32))
    batches = list(ip.iterate_batches(split, 4, shuffle=True, seed=1, epoch=2))
    order = ip.epoch_order(10, shuffle=True, seed=1, epoch=2)
    assert [b["index"].tolist() for b in batches] == [order[:4].tolist(), order[4:8].tolist(),
                                                     order[8:].tolist() + [-1, -1]]
    for b in batches:  # the label of each row is the label of the example it names
        real = b["index"] >= 0
        assert b["label"][real].tolist() == b["index"][real].tolist()
