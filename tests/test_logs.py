"""The logs users expect: the step log (stdout, steps.jsonl, TensorBoard), config.json, a profile."""
import glob
import json
import os
import subprocess
import sys

import pytest

from helpers import small_config, tensorboard_scalars, tensorboard_values
from trjax.train import config as config_lib
from trjax.train.metrics_log import read_rows
from trjax.train import train_and_evaluate

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _tensorboard_scalars(folder):
    """{tag: [(step, value)]} from the event files under ``folder``."""
    out = {}
    for tag, step, value in tensorboard_scalars(folder):
        out.setdefault(tag, []).append((step, value))
    return out


@pytest.mark.job
def test_short_run_writes_step_log_tensorboard_config_and_profile(tmp_path, capsys):
    cfg = small_config(num_epochs=1, log_every_steps=4, profile_steps="2:3")
    _, summary = train_and_evaluate(cfg, str(tmp_path))
    out = capsys.readouterr().out
    steps = read_rows(str(tmp_path / "steps.jsonl"))
    assert [r["step"] for r in steps] == [4, 8, 12]
    assert sum(r["examples"] for r in steps) == 1437  # every digit once
    epoch = read_rows(str(tmp_path / "metrics.jsonl"))[0]
    assert sum(r["loss"] * r["examples"] for r in steps) / 1437 == pytest.approx(
        epoch["train_loss"], rel=1e-6)
    for r in steps:  # the stdout line carries the same values
        assert f"step {r['step']:6d}  loss {r['loss']:.4f} top1 {r['top1']:.4f}" in out
        assert r["loss_scale"] == 1.0 and r["skipped_steps"] == 0 and r["images_per_s"] > 0
    # TensorBoard on by default (tensorboardX is installed): epoch rows and step scalars,
    # grouped by quantity (loss/train, loss/val, top1/val, lr, ...)
    scalars = _tensorboard_scalars(str(tmp_path / "tensorboard"))
    assert [st for st, _ in scalars["loss/train_step"]] == [4, 8, 12]
    assert [v for _, v in scalars["loss/train_step"]] == pytest.approx(
        [r["loss"] for r in steps], rel=1e-6)
    assert scalars["top1/val"] == [(12, pytest.approx(summary["val_top1"]))]
    assert scalars["loss/train"] == [(12, pytest.approx(epoch["train_loss"]))]
    assert scalars["lr"] == [(12, pytest.approx(epoch["lr"]))]
    assert {"loss/val", "top1/train", "top5/val", "lr/step", "throughput/images_per_s",
            "time/epoch_s"} <= set(scalars)
    # the resolved config as text; at the end the hparams with the final metrics
    values = tensorboard_values(str(tmp_path / "tensorboard"))
    (text,) = [v for _, tag, _, v in values if tag == "config/text_summary"]
    assert '"model": "resnet8"' in text.tensor.string_val[0].decode()
    hparams = [(os.path.basename(os.path.dirname(f)), tag, step, v) for f, tag, step, v in values
               if tag.startswith(("_hparams_/", "hparam/"))]
    assert {d for d, *_ in hparams} == {"hparams"}  # in tensorboard/hparams
    assert {tag for _, tag, _, _ in hparams} == {
        "_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info",
        "hparam/val_top1", "hparam/val_top5", "hparam/val_loss"}
    top1 = [(step, v.simple_value) for _, tag, step, v in hparams if tag == "hparam/val_top1"]
    assert top1 == [(12, pytest.approx(summary["val_top1"]))]
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
    (start,) = [v for _, tag, _, v in hparams if tag == "_hparams_/session_start_info"]
    given = HParamsPluginData.FromString(start.metadata.plugin_data.content).session_start_info
    assert given.hparams["model"].string_value == "resnet8"
    assert given.hparams["log_every_steps"].number_value == 4
    assert given.hparams["distributed.num_processes"].number_value == 1
    # the resolved config
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["log_every_steps"] == 4 and saved["model"] == "resnet8"
    assert saved["distributed"]["num_processes"] == 1
    # the profiler trace of steps 2..3
    traces = glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert traces and os.path.getsize(traces[0]) > 0
    assert "profile of steps 2..3" in out


@pytest.mark.parametrize("spec", ["3", "0:2", "5:4", "a:b"])
def test_bad_profile_steps_is_named(spec):
    with pytest.raises(ValueError, match=rf"config.profile_steps={spec!r} must be 'A:B'"):
        config_lib.validate(small_config(profile_steps=spec))


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch when it is installed (1-2 s of start-up); the writer is
    opened without it, still writes events, and torch imports normally afterwards."""
    import importlib.util
    has_torch = importlib.util.find_spec("torch") is not None
    code = f"""
import sys, ml_collections
from trjax.train import loop_io
w = loop_io.open_tensorboard(ml_collections.ConfigDict({{"tensorboard": True}}), sys.argv[1], print)
w.add_scalar("x", 2.5, 7); w.close()
assert "torch" not in sys.modules, "torch was imported"
if {has_torch}:
    import torch
    assert torch.ones(2).sum().item() == 2.0
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert [(t, s, v) for t, s, v in tensorboard_scalars(str(tmp_path / "tensorboard"))] == \
        [("x", 7, 2.5)]


def test_a_num_epochs_change_on_resume_says_the_schedule_changes(tmp_path):
    from trjax.train import loop_io
    loop_io.save_config(small_config(num_epochs=2), str(tmp_path), resuming=False)
    changes = loop_io.save_config(small_config(num_epochs=3, log_every_steps=7), str(tmp_path),
                                  resuming=True)
    assert changes == ["log_every_steps: 50 -> 7",
                       "num_epochs: 2 -> 3 (the warmup + cosine learning-rate schedule is "
                       "recomputed over the new total steps: the learning rate changes from "
                       "the restored step on)"]
