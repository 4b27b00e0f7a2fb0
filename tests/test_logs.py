"""The logs users expect: the step log (stdout, steps.jsonl, TensorBoard), config.json, a profile."""
import glob
import json
import os

import pytest

from helpers import small_config, tensorboard_scalars
from trjax import config as config_lib
from trjax.metrics_log import read_rows
from trjax.train import train_and_evaluate


def _tensorboard_scalars(folder):
    """{tag: [(step, value)]} from the event files under ``folder``."""
    out = {}
    for tag, step, value in tensorboard_scalars(folder):
        out.setdefault(tag, []).append((step, value))
    return out


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
    # TensorBoard on by default (tensorboardX is installed): epoch rows and step scalars
    scalars = _tensorboard_scalars(str(tmp_path / "tensorboard"))
    assert [st for st, _ in scalars["step/loss"]] == [4, 8, 12]
    assert [v for _, v in scalars["step/loss"]] == pytest.approx([r["loss"] for r in steps],
                                                                 rel=1e-6)
    assert scalars["val_top1"] == [(12, pytest.approx(summary["val_top1"]))]
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
