"""Draws loss and top-1 curves (train and validation) of a run to PNG.

  python scripts/plot.py runs/default [--out runs/default/curves.png]

Reads ``DIR/metrics.jsonl`` (one JSON line per epoch, written by
scripts/train.py; lines that do not parse, such as one cut off by a crash, are
skipped with a warning) and writes a two-panel matplotlib figure.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trjax.train.metrics_log import read_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", help="a run directory with metrics.jsonl")
    ap.add_argument("--out", default=None, help="PNG path (default WORKDIR/curves.png)")
    args = ap.parse_args()
    path = os.path.join(args.workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path} does not exist: expected the metrics.jsonl that "
                 "scripts/train.py --workdir DIR writes")
    rows = read_rows(path, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))
    rows = [r for r in rows if "epoch" in r and "val_top1" in r]  # epoch rows only
    if not rows:
        sys.exit(f"error: {path} is empty: no epoch has finished yet")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_top1) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for split, style in (("train", "-o"), ("val", "-s")):
        ax_loss.plot(epochs, [r[f"{split}_loss"] for r in rows], style, label=split, ms=3)
        ax_top1.plot(epochs, [r[f"{split}_top1"] for r in rows], style, label=split, ms=3)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss", yscale="log")
    ax_top1.set(xlabel="epoch", ylabel="top-1 accuracy", title="top-1", ylim=(0, 1.01))
    for ax in (ax_loss, ax_top1):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.abspath(args.workdir)))
    out = args.out or os.path.join(args.workdir, "curves.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
