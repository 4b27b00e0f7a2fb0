"""PyTorch DistributedDataParallel baseline for ``scripts/benchmark.py``.

The same ResNets as :mod:`trjax.models`, written in plain torch (conv ->
BatchNorm -> ReLU, same stems, blocks, widths, projection shortcuts, global
average pool, one linear head), trained with SGD (momentum 0.9, weight decay
5e-4) under DDP on random (not all-zero) inputs.

  # standalone: world 2 on CPU (gloo, 2 processes x 1 thread), 10 timed steps
  python scripts/torch_ddp_bench.py --world 2 --steps 10

  # server mode (used by benchmark.py to interleave rounds with JAX):
  python scripts/torch_ddp_bench.py --world 2 --serve
  #   stdin "run K" -> stdout one JSON line {"times": [K step seconds]}
  #   stdin "quit"  -> exits

The launching process is rank 0 (it owns stdin/stdout); ranks 1..N-1 are
spawned processes. Rank 0 broadcasts each command over a gloo group. Rank 0
times each step from the start of forward to the end of ``optimizer.step()``;
DDP's gradient all-reduce completes inside backward, so the time includes it.

``--device cuda``: one GPU per rank, NCCL, ``channels_last``, autocast
bfloat16 and ``torch.compile`` (``--compile_backend``), fused SGD.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np

MODELS = {
    # name: (block, stage_sizes, widths, stem, stem_width)
    "resnet8": ("basic", (1, 1, 1), (16, 32, 64), "cifar", 16),
    "resnet20": ("basic", (3, 3, 3), (16, 32, 64), "cifar", 16),
    "resnet18_cifar": ("basic", (2, 2, 2, 2), (64, 128, 256, 512), "cifar", 64),
    "resnet18": ("basic", (2, 2, 2, 2), (64, 128, 256, 512), "imagenet", 64),
    "resnet50": ("bottleneck", (3, 4, 6, 3), (64, 128, 256, 512), "imagenet", 64),
}


def build_model(name: str, num_classes: int = 10, in_channels: int = 3):
    """The trjax model ``name`` in plain torch (BN momentum 0.1 == flax 0.9, eps 1e-5)."""
    import torch
    from torch import nn

    def bn(c):
        return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, cin, f, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, f, 3, stride, 1, bias=False)
            self.b1 = bn(f)
            self.c2 = nn.Conv2d(f, f, 3, 1, 1, bias=False)
            self.b2 = bn(f)
            self.proj = None
            if cin != f or stride != 1:
                self.proj = nn.Sequential(nn.Conv2d(cin, f, 1, stride, 0, bias=False), bn(f))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu((x if self.proj is None else self.proj(x)) + y)

    class Bottle(nn.Module):
        expansion = 4

        def __init__(self, cin, f, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, f, 1, 1, 0, bias=False)
            self.b1 = bn(f)
            self.c2 = nn.Conv2d(f, f, 3, stride, 1, bias=False)
            self.b2 = bn(f)
            self.c3 = nn.Conv2d(f, 4 * f, 1, 1, 0, bias=False)
            self.b3 = bn(4 * f)
            self.proj = None
            if cin != 4 * f or stride != 1:
                self.proj = nn.Sequential(nn.Conv2d(cin, 4 * f, 1, stride, 0, bias=False),
                                          bn(4 * f))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = torch.relu(self.b2(self.c2(y)))
            y = self.b3(self.c3(y))
            return torch.relu((x if self.proj is None else self.proj(x)) + y)

    block, stages, widths, stem, stem_width = MODELS[name]
    Block = Basic if block == "basic" else Bottle
    layers = []
    if stem == "imagenet":
        layers += [nn.Conv2d(in_channels, stem_width, 7, 2, 3, bias=False), bn(stem_width),
                   nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    else:
        layers += [nn.Conv2d(in_channels, stem_width, 3, 1, 1, bias=False), bn(stem_width),
                   nn.ReLU()]
    cin = stem_width
    for i, (n, w) in enumerate(zip(stages, widths)):
        for j in range(n):
            layers.append(Block(cin, w, 2 if i > 0 and j == 0 else 1))
            cin = w * Block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(rank0, spawned, args: dict, world: int) -> int:
    """Runs ``rank0(0, args, port)`` here and ``spawned(r, args, port)`` for ranks
    1..world-1 in spawned processes (one free localhost port for the rendezvous);
    joins them (60 s, then terminates) and returns 1 if any rank failed, else 0."""
    import multiprocessing as mp
    port = free_port()
    procs = [mp.get_context("spawn").Process(target=spawned, args=(r, args, port), daemon=True)
             for r in range(1, world)]
    for pr in procs:
        pr.start()
    try:
        rank0(0, args, port)
    finally:
        for pr in procs:
            pr.join(timeout=60)
            if pr.is_alive():
                pr.terminate()
    return 1 if any(pr.exitcode not in (0, None) for pr in procs) else 0


def worker(rank: int, args: dict, port: int) -> None:
    """One DDP rank. Rank 0 reads commands from stdin and answers on stdout."""
    import torch
    import torch.distributed as dist
    from torch import nn

    world = args["world"]
    cuda = args["device"] == "cuda"
    torch.set_num_threads(args["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    h, w, c = args["image"]
    model = build_model(args["model"], args["num_classes"], c)
    fmt = torch.channels_last if args["channels_last"] else torch.contiguous_format
    model = model.to(device, memory_format=fmt)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                              bucket_cap_mb=args["bucket_cap_mb"])
    step_model = torch.compile(ddp, backend=args["compile_backend"]) if args["compile"] else ddp
    opt_kwargs = {"fused": True} if cuda else {}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          **opt_kwargs)
    loss_fn = nn.CrossEntropyLoss()
    local = args["global_batch"] // world
    rng = np.random.default_rng(1000 + rank)
    batches = []
    for _ in range(2):  # two distinct device batches, cycled (no host work in the loop)
        x = torch.from_numpy(rng.normal(size=(local, c, h, w)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, args["num_classes"], local).astype(np.int64))
        batches.append((x.to(device).contiguous(memory_format=fmt), y.to(device)))
    amp = args["amp_bf16"]

    def step(i):
        x, y = batches[i % 2]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(step_model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def run(k):
        times = []
        for i in range(k):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(i)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if not torch.isfinite(loss.detach().float()).item():
            raise FloatingPointError("torch baseline: non-finite loss")
        return times

    t0 = time.perf_counter()
    warm = run(args["warmup"])
    setup_s = time.perf_counter() - t0
    cmd = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print(json.dumps({"ready": True, "warmup_times": warm, "warmup_s": setup_s,
                          "params": nparams, "threads": args["threads"], "backend": backend,
                          "torch": torch.__version__}), flush=True)
    while True:
        if rank == 0:
            line = sys.stdin.readline().split() if args["serve"] else (
                ["run", str(args["steps"])] if cmd.item() >= 0 else ["quit"])
            if not line or line[0] == "quit":
                cmd.fill_(-1)
            else:
                cmd.fill_(int(line[1]))
        dist.broadcast(cmd, 0, group=control)
        k = int(cmd.item())
        if k < 0:
            break
        times = run(k)
        if rank == 0:
            print(json.dumps({"times": times}), flush=True)
            if not args["serve"]:
                cmd.fill_(-1)  # standalone: one round, then quit
    dist.barrier(group=control)
    dist.destroy_process_group()


def _spawned(rank, args, port):
    # children must not write protocol lines: stdout -> stderr
    sys.stdout = sys.stderr
    worker(rank, args, port)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="resnet18_cifar", choices=sorted(MODELS))
    p.add_argument("--image", default="32,32,3", help="H,W,C")
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--global_batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per rank; 0: max(1, cpu cores // world)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--channels_last", action="store_true")
    p.add_argument("--amp_bf16", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    p.add_argument("--compile_backend", default="inductor")
    p.add_argument("--bucket_cap_mb", type=float, default=25.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--serve", action="store_true", help="answer 'run K' / 'quit' on stdin")
    a = p.parse_args(argv)
    args = vars(a)
    args["image"] = tuple(int(v) for v in a.image.split(","))
    if args["global_batch"] % a.world:
        p.error(f"--global_batch {a.global_batch} is not divisible by --world {a.world}")
    if not args["threads"]:
        args["threads"] = max(1, (os.cpu_count() or 1) // a.world)
    return run_ranks(worker, _spawned, args, a.world)


if __name__ == "__main__":
    sys.exit(main())
