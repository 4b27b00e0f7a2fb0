"""trjax's main job in plain PyTorch DDP: the twin ``scripts/benchmark.py --time_to_accuracy`` times.

  python scripts/torch_main_job.py --workdir runs/torch_main_job [--world 2 --epochs 15]

The same job as ``scripts/train.py --config configs/default.py``:

* data: scikit-learn's digits, the same split and per-channel mean/std
  (``trjax.data.datasets.load_digits``, numpy only), images standardised as trjax's
  model does; each epoch a fresh permutation (seeded by the epoch), global
  batch 128 split over the ranks, the last batch of the epoch partial
  (trjax pads it with masked rows: every example once, the same mean), or
  dropped with ``--remainder drop`` (trjax's ``config.train_remainder="drop"``);
* model: ResNet-20 of ``scripts/torch_ddp_bench.py`` (trjax's ``models.py`` in
  torch; BN momentum 0.1 = flax 0.9), BatchNorm statistics per rank (trjax's
  ``running`` mode; DDP broadcasts rank 0's buffers at each forward);
* loss: cross-entropy summed over the rank's examples, divided by the global
  batch's count and multiplied by the world size (DDP averages gradients over
  ranks), so the gradient is the global batch's mean as in trjax;
* optimiser: SGD, momentum 0.9, weight decay 5e-4 on conv and linear kernels
  only, learning rate 0.2 with 1 epoch of linear warm-up from 0 then cosine
  decay to 0 (``optax.warmup_cosine_decay_schedule`` as ``trjax.optim``; update
  ``i`` uses the rate of step ``i``);
* after every epoch: rank 0 evaluates the 360 held-out digits (eval mode,
  running statistics) and saves a checkpoint (model + optimiser) to
  ``WORKDIR/checkpoint.pt``, as trjax does.

DDP over gloo, ``--world`` processes (this one is rank 0), max(1, cores //
world) threads each. Rank 0 writes ``WORKDIR/summary.json``: ``val_top1``,
``first_step_done_at`` (Unix time when the first optimiser step returned),
``wall_s`` (from the start of ``main``), ``train_s``, ``evaluate_s``,
``checkpoint_s``, ``startup_s`` (``main`` to the first step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_ddp_bench


def learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """``optax.warmup_cosine_decay_schedule(0, peak, warmup, total, 0)`` at ``step``."""
    warmup = max(0, min(warmup, total - 1))
    if step < warmup:
        return peak * step / warmup
    decay = max(total, warmup + 1) - warmup
    t = min(step - warmup, decay) / decay
    return peak * 0.5 * (1.0 + math.cos(math.pi * t))


def worker(rank: int, a: dict, port: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    from torch_ddp_bench import build_model
    from trjax.data.datasets import load_digits

    t_main = a["t_main"]
    world = a["world"]
    torch.set_num_threads(a["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    data = load_digits()
    mean = torch.tensor(data.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(data.std, dtype=torch.float32).view(1, -1, 1, 1)

    def images(x):  # [N, H, W, C] uint8 -> standardised [N, C, H, W] float32
        x = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).contiguous().float()
        return (x - mean) / std

    xtr, ytr = images(data.train.images), torch.from_numpy(data.train.labels.astype(np.int64))
    xva, yva = images(data.val.images), torch.from_numpy(data.val.labels.astype(np.int64))
    torch.manual_seed(a["seed"])
    model = build_model(a["model"], data.num_classes, xtr.shape[1])
    kernels = [p for n, p in model.named_parameters() if p.ndim > 1]
    others = [p for n, p in model.named_parameters() if p.ndim <= 1]
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD([{"params": kernels, "weight_decay": a["weight_decay"]},
                           {"params": others, "weight_decay": 0.0}],
                          lr=0.0, momentum=a["momentum"])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    g = a["global_batch"]
    n = len(ytr)
    steps_per_epoch = math.ceil(n / g) if a["remainder"] == "pad" else n // g
    total = steps_per_epoch * a["epochs"]
    first_step_done_at, step = None, 0
    train_s = evaluate_s = checkpoint_s = 0.0
    val_top1 = float("nan")
    for epoch in range(1, a["epochs"] + 1):
        t0 = time.perf_counter()
        ddp.train()
        order = torch.from_numpy(np.random.default_rng((a["seed"], epoch)).permutation(n))
        for b in range(steps_per_epoch):
            idx = order[b * g:(b + 1) * g]
            count = len(idx)
            mine = idx[rank * count // world:(rank + 1) * count // world]
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, a["lr"], steps_per_epoch * a["warmup_epochs"],
                                            total)
            loss = loss_fn(ddp(xtr[mine]), ytr[mine]) * (world / count)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if first_step_done_at is None:
                first_step_done_at = time.time()
        train_s += time.perf_counter() - t0
        if rank == 0:
            t0 = time.perf_counter()
            model.eval()
            with torch.no_grad():
                val_top1 = float((model(xva).argmax(1) == yva).float().mean())
            evaluate_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch + 1}, os.path.join(a["workdir"], "checkpoint.pt.tmp"))
            os.replace(os.path.join(a["workdir"], "checkpoint.pt.tmp"),
                       os.path.join(a["workdir"], "checkpoint.pt"))
            checkpoint_s += time.perf_counter() - t0
            print(f"epoch {epoch:3d}  val top1 {val_top1:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        summary = {"val_top1": val_top1, "first_step_done_at": first_step_done_at,
                   "wall_s": time.time() - t_main, "train_s": train_s, "evaluate_s": evaluate_s,
                   "checkpoint_s": checkpoint_s, "startup_s": first_step_done_at - t_main,
                   "steps": step, "world_size": world, "model": a["model"],
                   "epochs": a["epochs"], "global_batch_size": g, "torch": torch.__version__}
        with open(os.path.join(a["workdir"], "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"val_top1={val_top1:.4f} wall_s={summary['wall_s']:.1f}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    t_main = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--model", default="resnet20")
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--warmup_epochs", type=int, default=1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remainder", choices=("pad", "drop"), default="pad",
                   help="the last partial batch of each epoch: a smaller batch, or dropped")
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: max(1, cores // world)")
    a = vars(p.parse_args(argv))
    if a["global_batch"] % a["world"]:
        p.error(f"--global_batch {a['global_batch']} is not divisible by --world {a['world']}")
    a["threads"] = a["threads"] or max(1, (os.cpu_count() or 1) // a["world"])
    a["t_main"] = t_main
    os.makedirs(a["workdir"], exist_ok=True)
    from torch_ddp_bench import run_ranks
    return run_ranks(worker, worker, a, a["world"])


if __name__ == "__main__":
    sys.exit(main())
