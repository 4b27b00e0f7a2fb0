"""Draws a run's curves to PNG: loss and top-1 (train and validation) per epoch, the learning rate per step.

  trjax-plot runs/default [--out runs/default/curves.png]
  python -m trjax.tools.plot runs/default            (from a clone: scripts/plot.py)

Reads ``DIR/metrics.jsonl`` (one JSON line per epoch, written by ``trjax-train``;
lines that do not parse, such as one cut off by a crash, are skipped with a
warning) and, for the learning rate, ``DIR/steps.jsonl`` (the step log) when it
has rows, else the epoch rows' ``lr``. Three panels: the loss (log scale), the
top-1 accuracy zoomed to the data (not 0..1, so the last points of a converged
run are told apart) and the learning rate; each curve's final value is written
beside its last point.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from trjax.train.metrics_log import read_rows


def top1_limits(values, margin: float = 0.08) -> tuple[float, float]:
    """The top-1 panel's y-limits: the data's range widened by ``margin`` of it
    on each side (at least 0.005), clipped to ``[0, 1]``.

    Args:
      values: the plotted accuracies (floats in ``[0, 1]``; NaN ignored).

    Returns:
      ``(low, high)``, ``low < high``.

    Raises:
      ValueError: no finite value.
    """
    import math
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        raise ValueError("no finite top-1 value to plot")
    lo, hi = min(finite), max(finite)
    pad = max((hi - lo) * margin, 0.005)
    return max(0.0, lo - pad), min(1.0, hi + pad)


def _annotate(ax, x, y, color, fmt: str = "{:.4f}", dy: float = 0) -> None:
    ax.annotate(fmt.format(y), xy=(x, y), xytext=(5, dy), textcoords="offset points",
                color=color, fontsize=8, va="center", ha="left")


def plot(workdir: str, out: str | None = None,
         warn: Callable[[str], None] | None = None):
    """Draws ``workdir``'s curves and writes them as a PNG.

    Args:
      workdir: a run's workdir (``metrics.jsonl``; ``steps.jsonl`` if any).
      out: the PNG's path (default ``WORKDIR/curves.png``).
      warn: called with one message per skipped line of the JSONL files
        (default: :func:`warnings.warn`, see
        :func:`trjax.train.metrics_log.read_rows`).

    Returns:
      The ``matplotlib.figure.Figure`` (three axes titled ``loss``, ``top-1``,
      ``learning rate``; made without pyplot, so no global backend changes).

    Raises:
      FileNotFoundError: ``WORKDIR/metrics.jsonl`` does not exist.
      ValueError: it holds no epoch row yet.
    """
    from matplotlib.figure import Figure
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: expected the metrics.jsonl that "
                                "trjax-train --workdir DIR writes")
    rows = [r for r in read_rows(path, warn) if "epoch" in r and "val_top1" in r]  # epoch rows
    if not rows:
        raise ValueError(f"{path} is empty: no epoch has finished yet")
    steps_path = os.path.join(workdir, "steps.jsonl")
    lr_rows = [r for r in (read_rows(steps_path, warn) if os.path.isfile(steps_path) else [])
               if "lr" in r and "step" in r]
    lr_source = "steps.jsonl"
    if not lr_rows:
        lr_rows, lr_source = [r for r in rows if "lr" in r and "step" in r], "metrics.jsonl"

    fig = Figure(figsize=(15, 4), layout="constrained")
    ax_loss, ax_top1, ax_lr = fig.subplots(1, 3)
    epochs = [r["epoch"] for r in rows]
    top1_values = []
    for split, style, color, dy in (("train", "-o", "C0", -5), ("val", "-s", "C1", 5)):
        loss = [r[f"{split}_loss"] for r in rows]
        top1 = [r[f"{split}_top1"] for r in rows]
        top1_values += top1
        ax_loss.plot(epochs, loss, style, label=split, ms=3, color=color)
        ax_top1.plot(epochs, top1, style, label=split, ms=3, color=color)
        _annotate(ax_loss, epochs[-1], loss[-1], color, dy=dy)  # val above, train below
        _annotate(ax_top1, epochs[-1], top1[-1], color, dy=dy)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss", yscale="log")
    ax_top1.set(xlabel="epoch", ylabel="top-1 accuracy", title="top-1",
                ylim=top1_limits(top1_values))
    if lr_rows:
        x, lr = [r["step"] for r in lr_rows], [r["lr"] for r in lr_rows]
        ax_lr.plot(x, lr, "-", color="C2", label=f"lr ({lr_source})")
        _annotate(ax_lr, x[-1], lr[-1], "C2", "{:.4g}")
        ax_lr.legend()
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    for ax in (ax_loss, ax_top1):
        ax.legend()
    for ax in (ax_loss, ax_top1, ax_lr):
        ax.grid(alpha=0.3)
        ax.margins(x=0.15)  # room for the final values' labels
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    fig.savefig(out or os.path.join(workdir, "curves.png"), dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    """The command (``[project.scripts] trjax-plot``): returns 0 after writing
    the PNG; a missing or empty ``metrics.jsonl`` exits with ``error: ...``."""
    ap = argparse.ArgumentParser(prog="trjax-plot", description=__doc__.split("\n")[0])
    ap.add_argument("workdir", help="a run directory with metrics.jsonl")
    ap.add_argument("--out", default=None, help="PNG path (default WORKDIR/curves.png)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(args.workdir, "curves.png")
    try:
        plot(args.workdir, out, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
