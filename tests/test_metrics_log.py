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
