"""metrics.jsonl: cut-off lines are skipped by readers and repaired on resume; rows are whole."""
import json
import os
import subprocess
import sys

import pytest

from trjax.train.metrics_log import MetricsWriter, read_rows, repair

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _row(epoch, step):
    return {"epoch": epoch, "step": step, "train_loss": 1.0 / epoch, "train_top1": 0.5,
            "val_loss": 2.0 / epoch, "val_top1": 0.1 * epoch, "val_top5": 0.9}


def _crashed_file(path):
    with open(path, "w") as f:
        f.write(json.dumps(_row(1, 12)) + "\n" + json.dumps(_row(2, 24)) + "\n")
        f.write(json.dumps(_row(3, 36))[:25])  # the crash cut the third row


def test_reader_skips_a_cut_off_line_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _crashed_file(path)
    warned = []
    rows = read_rows(str(path), warn=warned.append)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert len(warned) == 1 and ":3:" in warned[0]


def test_resume_truncates_the_fragment_and_rows_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _crashed_file(path)
    # resumed from the checkpoint at step 12: epoch 2's row (step 24) is written again
    with MetricsWriter(str(path), resume=True, keep_until_step=12) as w:
        assert w.dropped == 2  # the fragment and the row past step 12
        w.write(_row(2, 24))
        w.write(_row(3, 36))
    lines = path.read_text().splitlines()
    assert [json.loads(l) for l in lines] == [_row(1, 12), _row(2, 24), _row(3, 36)]


def test_fresh_writer_truncates_and_nan_round_trips(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _crashed_file(path)
    with MetricsWriter(str(path)) as w:
        w.write({"epoch": 1, "step": 3, "val_loss": float("nan"), "val_top1": 0.0})
    rows = read_rows(str(path))
    assert len(rows) == 1 and rows[0]["val_loss"] != rows[0]["val_loss"]  # NaN, not a string


def test_repair_of_a_clean_file_changes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = json.dumps(_row(1, 12)) + "\n"
    path.write_text(text)
    mtime = os.stat(path).st_mtime_ns
    assert repair(str(path), keep_until_step=12) == 0
    assert path.read_text() == text and os.stat(path).st_mtime_ns == mtime


@pytest.mark.job
def test_plot_skips_the_cut_off_line(tmp_path):
    _crashed_file(tmp_path / "metrics.jsonl")
    out = subprocess.run([sys.executable, "scripts/plot.py", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "metrics.jsonl:3: skipped" in out.stderr
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_step_log_images_per_s_after_a_resume_counts_this_process_images_only(monkeypatch):
    """A resumed log window holds images trained before the restart (its loss and top-1 stay
    exact); its throughput divides only the images trained since by the time since."""
    from trjax.train import loop_io
    from trjax.metrics import StepMetrics
    clock = iter([100.0, 102.0, 106.0])  # reader made; step 4 logged; step 6 logged
    monkeypatch.setattr(loop_io.time, "perf_counter", lambda: next(clock))
    rows = []
    reader = loop_io.MetricsReader(0, False, False, log_every=2, on_log_row=rows.append,
                                   lr_of_step=lambda t: 0.1, steps_per_epoch=10)
    reader.restore({"log_window_sums": [30.0, 20.0, 25.0, 30.0, 1.0]})  # step 3: 30 images
    reader.push(4, StepMetrics(10.0, 8.0, 9.0, 10.0, 1.0))
    reader.push(5, StepMetrics(10.0, 8.0, 9.0, 10.0, 1.0))
    reader.push(6, StepMetrics(10.0, 8.0, 9.0, 10.0, 1.0))
    assert [r["step"] for r in rows] == [4, 6]
    assert rows[0]["examples"] == 40 and rows[0]["loss"] == 40 / 40  # the whole window's rates
    assert rows[0]["images_per_s"] == 10 / 2.0  # step 4's 10 images in 2 s, not 40
    assert rows[1]["images_per_s"] == 20 / 4.0


def test_step_log_grad_norm_is_the_window_last_step_and_old_windows_restore(monkeypatch):
    """The step row's grad_norm is its window's last step's (not a sum or mean), the epoch
    total's too; a window saved before grad_norm existed (six values) restores with it NaN,
    and a checkpoint's position round-trips it."""
    import math
    from trjax.train import loop_io
    from trjax.metrics import StepMetrics
    rows = []
    reader = loop_io.MetricsReader(0, False, False, log_every=2, on_log_row=rows.append,
                                   lr_of_step=lambda t: 0.1, steps_per_epoch=10)
    reader.restore({"log_window_sums": [30.0, 20.0, 25.0, 30.0, 1.0, 1.0],
                    "train_sums": [30.0, 20.0, 25.0, 30.0, 1.0, 1.0]})
    assert math.isnan(reader.window.grad_norm) and math.isnan(reader.sums.grad_norm)
    for step, norm in ((4, 3.0), (5, 2.0), (6, 0.5)):
        reader.push(step, StepMetrics(10.0, 8.0, 9.0, 10.0, 1.0, 1.0, norm))
    assert [(r["step"], r["grad_norm"]) for r in rows] == [(4, 3.0), (6, 0.5)]
    position = reader.position()
    assert position["train_sums"][-1] == 0.5 and len(position["train_sums"]) == 7
    again = loop_io.MetricsReader(0, False, False)
    again.restore(position)
    assert again.take().grad_norm == 0.5 and again.take().count == 0


def test_tensorboard_rebuild_takes_step_rows_written_before_grad_norm(tmp_path, monkeypatch):
    """On resume TensorBoard is rebuilt from steps.jsonl: a row of an older trjax (no
    grad_norm) still gives its other scalars, a new row also grad_norm/step."""
    import types
    from trjax.train import loop_io
    written = []

    class Board:
        def __init__(self, folder):
            pass

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def add_text(self, *args):
            pass
    monkeypatch.setattr(loop_io, "_tensorboardx_writer_class", lambda: Board)
    monkeypatch.setattr(loop_io, "config_text", lambda config: "")
    old = {"step": 2, "epoch": 1, "loss": 1.0, "top1": 0.5, "images_per_s": 9.0, "lr": 0.1,
           "loss_scale": 1.0, "skipped_steps": 0, "examples": 32}
    with MetricsWriter(str(tmp_path / "steps.jsonl")) as w:
        w.write(old)
        w.write({**old, "step": 4, "grad_norm": 0.25})
    loop_io.open_tensorboard(types.SimpleNamespace(tensorboard=True), str(tmp_path),
                             print, resume=True)
    assert ("grad_norm/step", 0.25, 4) in written
    assert [t for t, _, s in written if s == 2] == [loop_io.step_tag(k) for k in
                                                      loop_io.STEP_SCALARS if k != "grad_norm"]
