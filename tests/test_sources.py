"""Random-access sources (issue 41, item 2): grain's protocol, a Hugging Face folder and
ArrayRecord files give the batches of the same examples held in arrays, bit for bit, and a
run on them is the arrays' run, resumed mid-epoch included.

Everything is built here from the digits shipped with trjax; nothing is downloaded."""
import numpy as np
import pytest

from helpers import small_config, to_host
from trjax.data import input_pipeline as ip
from trjax.data import sources

DIGITS = ip.load_digits()


def _records(split):
    return [{"image": x, "label": int(y)} for x, y in zip(split.images, split.labels)]


def _hf_folder(path, image_feature: bool):
    datasets = pytest.importorskip("datasets")
    from PIL import Image
    feats = {"label": datasets.ClassLabel(num_classes=10)}
    dd = {}
    for name, split in (("train", DIGITS.train), ("validation", DIGITS.val)):
        if image_feature:  # PNG-encoded grayscale, as image data sets on the Hub hold them
            col = [Image.fromarray(x[..., 0]) for x in split.images]
            f = datasets.Features({"image": datasets.Image(), **feats})
        else:
            col = list(split.images)
            f = datasets.Features({"image": datasets.Array3D((8, 8, 1), "uint8"), **feats})
        dd[name] = datasets.Dataset.from_dict({"image": col, "label": split.labels.tolist()},
                                              features=f)
    datasets.DatasetDict(dd).save_to_disk(str(path))
    return str(path)


def _array_record_folder(path):
    pytest.importorskip("array_record")
    path.mkdir()
    sources.write_array_record(path / "train.array_record", DIGITS.train.images,
                               DIGITS.train.labels)
    sources.write_array_record(path / "val.array_record", DIGITS.val.images, DIGITS.val.labels)
    return str(path)


def _assert_same_batches(data):
    assert data.num_classes == 10 and data.image_shape == DIGITS.image_shape
    assert data.mean == DIGITS.mean and data.std == DIGITS.std
    np.testing.assert_array_equal(data.train.labels, DIGITS.train.labels)
    for split, ref, kw in ((data.train, DIGITS.train, dict(shuffle=True, augment=True, epoch=3)),
                           (data.val, DIGITS.val, dict(shuffle=False))):
        got = list(ip.iterate_batches(split, 96, seed=5, start=2, **kw))
        want = list(ip.iterate_batches(ref, 96, seed=5, start=2, **kw))
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            for k in b:
                np.testing.assert_array_equal(a[k], b[k])
                assert a[k].dtype == b[k].dtype


def test_a_list_of_records_gives_the_arrays_batches_bitwise():
    data = sources.record_dataset(_records(DIGITS.train), _records(DIGITS.val))
    _assert_same_batches(data)


@pytest.mark.parametrize("image_feature", [False, True])
def test_a_hugging_face_folder_gives_the_arrays_batches_bitwise(tmp_path, image_feature):
    _assert_same_batches(ip.load_dataset("hf", _hf_folder(tmp_path / "hf", image_feature)))


def test_array_record_files_give_the_arrays_batches_bitwise(tmp_path):
    _assert_same_batches(ip.load_dataset("array_record", _array_record_folder(tmp_path / "ar")))


def test_bad_sources_are_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"has no 'image' and 'label'.*decode="):
        sources.record_split([b"raw"])
    with pytest.raises(ValueError, match="is empty"):
        sources.record_split([])
    mixed = _records(DIGITS.train)[:4] + [{"image": np.zeros((9, 9, 1), np.uint8), "label": 0}]
    split = sources.record_split(mixed)
    with pytest.raises(ValueError, match=r"record 4 holds a uint8 image \(9, 9, 1\).*resize"):
        split.images[np.arange(5)]
    first = int(np.flatnonzero(DIGITS.train.labels >= 5)[0])
    with pytest.raises(ValueError, match=rf"the train source: label {DIGITS.train.labels[first]} "
                                         rf"at index {first} is outside \[0, 5\)"):
        sources.record_dataset(_records(DIGITS.train), _records(DIGITS.val), num_classes=5)
    named = _records(DIGITS.val)[:3]
    named[2]["label"] = "cat"
    with pytest.raises(ValueError, match=r"label 'cat' at index 2 is not an integer class id"):
        sources.record_split(named)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no train\*.array_record file"):
        ip.load_dataset("array_record", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is not a folder"):
        ip.load_dataset("hf", str(tmp_path / "missing"))


@pytest.mark.parametrize("split,value", [("train", 10), ("val", -1)])
def test_a_label_out_of_range_in_any_source_is_refused_before_the_first_step(split, value):
    """Every source reaches the trainer as a Dataset; a label equal to num_classes (its
    one-hot all zeros) or negative is named with its split and index in prepare, before
    anything is traced (the batch check would meet it only at its step)."""
    from trjax.data.splits import Dataset, Split
    from trjax.train import trainer
    parts = {"train": DIGITS.train, "val": DIGITS.val}
    labels = parts[split].labels.copy()
    labels[7] = value
    parts[split] = Split(parts[split].images, labels)
    data = Dataset(parts["train"], parts["val"], 10, "digits", mean=DIGITS.mean, std=DIGITS.std)
    with pytest.raises(ValueError, match=rf"the {split} split of digits: label {value} at index "
                                         r"7 is outside \[0, 10\)"):
        trainer.prepare(small_config(devices="2", global_batch_size=32), data)


@pytest.mark.job
@pytest.mark.parametrize("kind", ["hf", "array_record"])
def test_a_run_on_a_source_resumed_mid_epoch_is_the_arrays_run_bitwise(tmp_path, kind):
    """The main job's recipe (2 devices, 1 epoch): on the arrays uninterrupted, and on
    the source stopped after step 5 and resumed: the same parameters and val top-1."""
    from trjax.train import train_and_evaluate
    folder = _hf_folder(tmp_path / "d", False) if kind == "hf" else \
        _array_record_folder(tmp_path / "d")
    cfg = dict(devices="2", global_batch_size=128, eval_batch_size=128, num_epochs=1,
               log_every_steps=0, tensorboard=False, data_workers=0, checkpoint_async=False)
    ref_state, ref = train_and_evaluate(small_config(**cfg), str(tmp_path / "arrays"),
                                        data=DIGITS)
    on = dict(cfg, dataset=kind, data_dir=folder)
    train_and_evaluate(small_config(halt_after_steps=5, **on), str(tmp_path / "src"))
    state, got = train_and_evaluate(small_config(**on), str(tmp_path / "src"))
    assert got["val_top1"] == ref["val_top1"]
    for a, b in zip(*(jax_leaves(to_host(s.params)) for s in (state, ref_state))):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)
