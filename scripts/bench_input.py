"""Input pipeline throughput: images/s and CPU ms per image of the ImageFolder train path.

The train path is the one ``scripts/train.py`` runs: decode (Pillow), RandomResizedCrop
to ``--image_size`` (bilinear) and a flip, uint8 batches of ``--batch`` rows, in
``--workers`` worker processes (grain; 0 = in this process). For each worker count one
shuffled epoch is timed over its middle half, batches steps/4 to 3*steps/4 (worker
start-up, buffers filling and draining excluded); CPU time is that of this process and
its workers over the same window.

    python scripts/bench_input.py --synthetic 512 --workers 1,2 [--json FILE]
    python scripts/bench_input.py --folder DIR_WITH_train/ --workers 0,1,2,4

``--synthetic N`` writes N 256x256 JPEGs (smooth random colour fields with noise,
quality 90: decode costs like a photo's, not like white noise) into a temporary
folder. Output: a table and, with ``--json FILE``,
``{"results": [{"workers": N, "images_per_s": x, "cpu_ms_per_image": y, ...}], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def synthetic_folder(root: str, n: int, size: int = 256, classes: int = 4, seed: int = 0) -> str:
    """``root/train/class_k/i.jpg``: ``n`` JPEGs of ``size x size``; returns ``root``."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for i in range(n):
        d = os.path.join(root, "train", f"class_{i % classes}")
        os.makedirs(d, exist_ok=True)
        coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        smooth = np.asarray(coarse.resize((size, size), Image.BICUBIC), np.float32)
        noisy = np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(os.path.join(d, f"{i}.jpg"), quality=90)
    return root


def _cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds of (this process and its live children, this process)."""
    import psutil
    me = psutil.Process()
    mine = sum(me.cpu_times()[:2])
    total = mine
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total, mine


def measure(folder, workers: int, batch: int, image_size: int, epoch: int = 1) -> dict:
    """One epoch of the train path with ``workers`` worker processes, timed over its
    middle half (batches steps/4 .. 3*steps/4): worker start-up, the first buffers
    filling and the last draining stay outside the window."""
    from trjax.data import input_pipeline as ip
    steps = ip.steps_per_epoch(len(folder), batch, "pad")
    if steps < 4:
        raise ValueError(f"{len(folder)} images at batch {batch} make {steps} batches; need >= 4")
    first, last = steps // 4, (3 * steps) // 4
    it = ip.iterate_batches(folder, batch, shuffle=True, seed=0, epoch=epoch, augment=True,
                            image_shape=(image_size, image_size, 3), workers=workers)
    images = 0
    for k, b in enumerate(it):  # to the end: the workers stop and free their buffers
        assert b["image"].dtype == np.uint8
        if k == first:
            t0, c0 = time.perf_counter(), _cpu_seconds()
        elif first < k <= last:
            images += int(b["mask"].sum())
            if k == last:
                t1, c1 = time.perf_counter(), _cpu_seconds()
    return {"workers": workers, "images": images, "seconds": t1 - t0,
            "images_per_s": images / (t1 - t0), "cpu_ms_per_image": 1e3 * (c1[0] - c0[0]) / images,
            # the serial part when workers run: receiving batches in the training process
            "main_cpu_ms_per_image": 1e3 * (c1[1] - c0[1]) / images}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N", help="write N random 256x256 JPEGs")
    src.add_argument("--folder", help="an image folder with a train/ split")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (0: in-process)")
    p.add_argument("--batch", type=int, default=16, help="rows per batch (default 16)")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=1, help="epochs per worker count; the fastest is kept")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    from trjax.data.imagefolder import ImageFolder
    with tempfile.TemporaryDirectory(prefix="trjax_bench_input_") as tmp:
        root = args.folder
        if args.synthetic is not None:
            if args.synthetic < 8 * args.batch:
                args.batch = max(1, args.synthetic // 8)
            root = synthetic_folder(tmp, args.synthetic)
        folder = ImageFolder(root, "train")
        load = os.getloadavg()
        results = []
        for w in workers:
            runs = [measure(folder, w, args.batch, args.image_size, epoch=e + 1)
                    for e in range(args.repeat)]
            results.append(max(runs, key=lambda r: r["images_per_s"]))
    report = {"results": results, "images_in_folder": len(folder), "batch": args.batch,
              "image_size": args.image_size, "cores": len(os.sched_getaffinity(0)),
              "loadavg_before": load, "loadavg_after": os.getloadavg(),
              "source": f"synthetic {args.synthetic} x 256x256 JPEG" if args.synthetic else root}
    base = results[0]["images_per_s"]
    print(f"{len(folder)} images, batch {args.batch}, {args.image_size}x{args.image_size} uint8, "
          f"RandomResizedCrop + flip; load average before {load[0]:.2f}, after "
          f"{report['loadavg_after'][0]:.2f} ({report['cores']} cores)")
    print(f"{'workers':>7} | {'images/s':>9} | {'CPU ms/image':>12} | {'of which main':>13} | "
          f"{'vs first':>8}")
    for r in results:
        print(f"{r['workers']:>7} | {r['images_per_s']:>9.1f} | {r['cpu_ms_per_image']:>12.3f} | "
              f"{r['main_cpu_ms_per_image']:>13.3f} | {r['images_per_s'] / base:>7.2f}x")
    ms = max(r["cpu_ms_per_image"] for r in results)  # the dearest row: a conservative projection
    report["projected_images_per_s"] = {c: c * 1e3 / ms for c in (16, 64)}
    print(f"projected at {ms:.3f} CPU ms/image (one core per worker): " + ", ".join(
        f"{c} cores ~{c * 1e3 / ms:,.0f} images/s" for c in (16, 64)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
