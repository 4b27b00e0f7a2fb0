"""The commands of trjax.tools (trjax-plot, trjax-tiny-cifar), in process: the plot's
panels (top-1 zoomed to the data, the learning rate, the final values) and its errors;
the tiny CIFAR files."""
import json
import pickle

import numpy as np
import pytest

from trjax.tools import plot as plot_lib
from trjax.tools import tiny_cifar


def _rows(n_epochs=5, steps_per_epoch=12):
    rows, steps = [], []
    for e in range(1, n_epochs + 1):
        rows.append({"epoch": e, "step": e * steps_per_epoch, "train_loss": 2.0 / e,
                     "train_top1": 0.80 + 0.03 * e, "train_top5": 1.0, "val_loss": 2.2 / e,
                     "val_top1": 0.78 + 0.035 * e, "val_top5": 1.0, "images_per_s": 900.0,
                     "epoch_s": 1.5, "lr": 0.1 * (1 - e / n_epochs)})
    for s in range(2, n_epochs * steps_per_epoch + 1, 2):
        steps.append({"step": s, "loss": 1.0, "top1": 0.9, "lr": 0.1 * s / 60,
                      "images_per_s": 1000.0, "loss_scale": 1.0, "skipped_steps": 0})
    return rows, steps


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("with_steps", [True, False])
def test_plot_writes_the_png_zooms_top1_and_draws_the_lr(tmp_path, with_steps):
    rows, steps = _rows()
    _write(tmp_path / "metrics.jsonl", rows)
    if with_steps:
        _write(tmp_path / "steps.jsonl", steps)
    fig = plot_lib.plot(str(tmp_path))
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {"loss", "top-1", "learning rate"}
    top1 = [r[k] for r in rows for k in ("train_top1", "val_top1")]
    lo, hi = axes["top-1"].get_ylim()
    span = max(top1) - min(top1)
    # every point shown, and the axis no wider than the data plus a small margin (not 0..1)
    assert lo <= min(top1) and hi >= max(top1)
    assert min(top1) - lo <= 0.1 * span and hi - max(top1) <= 0.1 * span
    assert (lo, hi) == pytest.approx(plot_lib.top1_limits(top1))
    # the learning rate: the step log's rows when there is one, else the epoch rows'
    (line,) = axes["learning rate"].get_lines()
    source = steps if with_steps else rows
    assert list(line.get_xdata()) == [r["step"] for r in source]
    assert list(line.get_ydata()) == [r["lr"] for r in source]
    # each curve's final value written beside its last point
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {f"{rows[-1]['train_top1']:.4f}", f"{rows[-1]['val_top1']:.4f}",
            f"{rows[-1]['val_loss']:.4f}", f"{source[-1]['lr']:.4g}"} <= texts


def test_top1_limits_stay_within_zero_and_one_and_widen_a_single_value():
    assert plot_lib.top1_limits([1.0, 1.0]) == (0.995, 1.0)
    assert plot_lib.top1_limits([0.0, 0.5]) == (0.0, 0.54)
    with pytest.raises(ValueError, match="no finite top-1"):
        plot_lib.top1_limits([float("nan")])


def test_plot_command_errors_and_out(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"error: .*metrics.jsonl does not exist: expected "
                                         r"the metrics.jsonl that trjax-train --workdir DIR"):
        plot_lib.main([str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "val_to')  # cut off: no epoch row
    with pytest.raises(SystemExit, match="is empty: no epoch has finished yet"):
        plot_lib.main([str(tmp_path)])
    assert "metrics.jsonl:1: skipped" in capsys.readouterr().err
    _write(tmp_path / "metrics.jsonl", _rows()[0])
    assert plot_lib.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").stat().st_size > 10_000
    assert f"wrote {tmp_path / 'x.png'}" in capsys.readouterr().out


def test_tiny_cifar_writes_the_real_format(tmp_path, capsys):
    assert tiny_cifar.main([str(tmp_path), "--per_batch", "40"]) == 0
    assert "200 train, 1597 test examples" in capsys.readouterr().out
    folder = tmp_path / "cifar-10-batches-py"
    assert sorted(p.name for p in folder.iterdir()) == [f"data_batch_{i}" for i in range(1, 6)] \
        + ["test_batch"]
    batch = pickle.load(open(folder / "data_batch_1", "rb"), encoding="bytes")
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (40, 3072)
    assert len(batch[b"labels"]) == 40 and set(batch[b"labels"]) <= set(range(10))
    with pytest.raises(SystemExit, match=r"error: --per_batch=400: must be 1..359"):
        tiny_cifar.main([str(tmp_path), "--per_batch", "400"])
