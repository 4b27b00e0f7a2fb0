"""trjax.train.loop across stops and resumes: the logs show each step once, the data a
checkpoint's position counts must be the data resumed on, the epoch row's learning rate
is the one its last step used (test_stops.py, on its full run), and the loss scale the host
logs is the device's."""
import os

import numpy as np
import pytest

from helpers import small_config
from test_logs import _tensorboard_scalars as _scalars
from trjax.data import input_pipeline
from trjax.train import train_and_evaluate
from trjax.train.metrics_log import read_rows
from trjax.train.trainer import data_identity


@pytest.mark.job
def test_a_crash_and_a_resume_onto_other_data_then_the_same_data(tmp_path, monkeypatch):
    """(test_tensorboard_shows_each_step_once_after_a_crash_and_a_resume and
    test_a_resume_onto_other_training_data_is_refused, merged: one crashed run.)

    A crash at step 8, past the checkpoint at step 4: the events of steps 5..7 were
    written (step 6's row among them). The checkpoint records the train set's size and
    listing fingerprint: one example fewer (a file deleted), or relabelled examples, is an
    error naming both counts and the way out, before anything is compiled. The same data
    resumes, and after it TensorBoard holds every step once, with the values of
    steps.jsonl / metrics.jsonl, as an uninterrupted run's."""
    from trjax import aot
    data = input_pipeline.load_dataset("digits")
    cfg = small_config(num_epochs=1, log_every_steps=2, checkpoint_every_steps=4)
    real = input_pipeline.to_device

    def crash_at_8(batch, *args, step=None, **kwargs):
        if step == 8:
            raise RuntimeError("simulated crash")
        return real(batch, *args, step=step, **kwargs)

    monkeypatch.setattr(input_pipeline, "to_device", crash_at_8)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_evaluate(cfg, str(tmp_path), data=data)
    assert [s for s, _ in _scalars(tmp_path / "tensorboard")["loss/train_step"]] == [2, 4, 6]
    monkeypatch.setattr(input_pipeline, "to_device", real)
    with monkeypatch.context() as m:
        m.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
        fewer = data._replace(train=input_pipeline.Split(data.train.images[:-1],
                                                         data.train.labels[:-1]))
        with pytest.raises(ValueError, match=r"train_examples: checkpoint 1437 vs now 1436.*"
                                             r"the training data changed"):
            train_and_evaluate(cfg, str(tmp_path), data=fewer)
        labels = data.train.labels.copy()
        labels[[0, 1]] = labels[[1, 0]] if labels[0] != labels[1] else (labels[0] + 1) % 10
        relabelled = data._replace(train=input_pipeline.Split(data.train.images, labels))
        with pytest.raises(ValueError, match="train_fingerprint: checkpoint"):
            train_and_evaluate(cfg, str(tmp_path), data=relabelled)
    # the same data resumes
    _, summary = train_and_evaluate(cfg, str(tmp_path), data=data)
    assert summary["steps"] == 12
    scalars = _scalars(tmp_path / "tensorboard")
    steps = read_rows(str(tmp_path / "steps.jsonl"))
    assert [r["step"] for r in steps] == [2, 4, 6, 8, 10, 12]
    assert scalars["loss/train_step"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                    for r in steps]
    assert [s for s, _ in scalars["top1/val"]] == [12]


def test_data_identity_of_a_file_source_is_its_relative_listing(tmp_path):
    """Two copies of one ImageFolder listing in different places have one identity; a file
    less changes it."""
    class Folder:
        def __init__(self, root, names):
            self.root = root
            self.paths = tuple(os.path.join(root, n) for n in names)
            self.labels = np.zeros(len(names), np.int32)

    names = ["a/1.png", "a/2.png", "b/3.png"]
    one, two = data_identity(Folder("/data/x", names)), data_identity(Folder("/mnt/y", names))
    assert one == two and one["train_examples"] == 3
    assert data_identity(Folder("/data/x", names[:2]))["train_fingerprint"] != \
        one["train_fingerprint"]


def test_the_loss_scale_the_host_logs_and_acts_on_is_the_devices(tmp_path):
    """fp16 with a loss scale that doubles every 2 good steps and halves on an overflow:
    over 10 steps the scale grows and falls, and the step log's loss_scale is, step by
    step, the train state's (read back with the metrics, not recomputed on the host)."""
    from trjax.data import input_pipeline as ip
    from trjax.train import setup
    from trjax.train.loop_io import MetricsReader
    from trjax.world import host_value

    tr = setup(small_config(precision="fp16", loss_scale_growth_interval=2,
                            learning_rate=0.05))
    rows, device = [], []
    reader = MetricsReader(0, False, True, log=lambda *a: None, log_every=1,
                           on_log_row=rows.append,
                           loss_scale=float(host_value(tr.state.loss_scale)))
    state, world = tr.state, tr.world
    batches = ip.iterate_batches(tr.data.train, world.global_batch_size, shuffle=True, seed=0,
                                 epoch=1)
    for step, batch in enumerate(batches, start=1):
        if step > 10:
            break
        batch = dict(batch)
        if step in (4, 5):  # huge pixels: the fp16 loss overflows at any scale above 1
            batch["image"] = np.full_like(batch["image"], 255)
        state, m = tr.train_step(state, ip.to_device(batch, world.sharded(),
                                                     tr.data.num_classes, tr.dtype))
        reader.push(step, m)
        device.append(float(host_value(state.loss_scale)))
    reader.drain(0)
    assert [r["loss_scale"] for r in rows] == device
    assert any(b > a for a, b in zip(device, device[1:]))  # grew
    assert any(b < a for a, b in zip(device, device[1:]))  # fell


@pytest.mark.job
def test_files_skipped_before_a_mid_epoch_stop_are_still_counted_after_the_resume(tmp_path):
    """skip_bad_images: the undecodable files found before a mid-epoch checkpoint travel in
    its meta, so the resumed run's summary counts them as the uninterrupted run does."""
    from test_imagefolder import _write_bad_folder
    bad = _write_bad_folder(tmp_path / "data")
    folder = input_pipeline.load_dataset("imagefolder", str(tmp_path / "data"), 16,
                                         skip_bad_images=True)
    first = lambda s: set(input_pipeline.epoch_order(8, shuffle=True, seed=s, epoch=1)[:4])
    bad_rows = {folder.train.paths.index(p) for p in bad}
    seed = next(s for s in range(100) if bad_rows & first(s))  # a bad file in batch 1
    cfg = dict(dataset="imagefolder", data_dir=str(tmp_path / "data"), image_size=16,
               skip_bad_images=True, devices="4", global_batch_size=4, eval_batch_size=4,
               num_epochs=1, seed=seed, log_every_steps=0, tensorboard=False, data_workers=0)
    _, whole = train_and_evaluate(small_config(**cfg), str(tmp_path / "whole"))
    train_and_evaluate(small_config(halt_after_steps=1, **cfg), str(tmp_path / "cut"))
    _, resumed = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"))
    assert whole["skipped_images"] == resumed["skipped_images"] == 2
