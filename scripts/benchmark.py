"""Benchmarks of trjax against its per-leaf baseline and PyTorch DDP: throughput, GPU,
CPU profile, time to accuracy.

  # CPU (default): resnet18_cifar, 32x32x3 random images, global batch 64,
  # world sizes 1, 2, 4, 8, each in its own process with exactly N simulated CPU
  # devices (--cpu_devices 8: all world sizes in one process of 8 devices)
  python scripts/benchmark.py [--out runs/benchmark] [--world_sizes 1,2,4,8]
  python scripts/benchmark.py --quick          # world sizes 1,2,8, fewer steps (< 10 min, 2 cores)

  # GPU: ResNet-50, 224x224, bf16, all visible GPUs, against torch.compile +
  # AMP bf16 + channels_last DDP (NCCL) on the same GPUs and global batch
  python scripts/benchmark.py --gpu [--peak_tflops 989]
  python scripts/benchmark.py --gpu --dry_run  # the same code path on CPU, tiny sizes
  python scripts/benchmark.py --gpu --xla_ab [--dry_run]  # XLA settings side by side

  # CPU profiling: XLA flags, device counts, host input, side by side
  python scripts/benchmark.py --profile [--steps 3 --rounds 3]

  # the main job start to finish (ResNet-20, digits, batch 128, 15 epochs), fresh
  # processes: trjax cold cache, trjax warm cache, the PyTorch DDP twin (gloo, 2 ranks)
  python scripts/benchmark.py --time_to_accuracy [--rounds 2]

  # data, FSDP, pipeline and tensor parallelism on the same 8 devices (ResNet-50 at 224,
  # global batch 8): images/s, per-device memory, bubble, bytes per mesh axis
  python scripts/benchmark.py --parallel [--meshes "data:8;data:2,fsdp:4;fsdp:8;data:2,stage:4;data:4,model:2"]

Variants of the throughput modes, per world size N:
  trjax/two       config.buckets="two" (two contiguous gradient buckets)
  trjax/per_leaf  config.buckets="per_leaf" (one all-reduce per parameter, the
                  Flax ImageNet example's layout); same model and step otherwise
  torch/ddp       scripts/torch_ddp_bench.py: the same ResNet in plain torch, DDP,
                  N processes (gloo on CPU, max(1, cores // N) threads each;
                  NCCL + torch.compile + AMP bf16 + channels_last on GPU). Skipped
                  with a message when torch is not importable.

Method: every variant of a world size is built first (trjax through
``trjax.train.trainer.setup(config, data=Dataset of random normal images)``, torch as a
server process that waits for commands), warmed up, then timed in interleaved
rounds (the order rotates every round) so that background load hits all of
them alike. Each timed step is ``state, m = train_step(state, device_batch)``
followed by ``jax.block_until_ready``; two distinct device batches (made once
by ``trjax.data.input_pipeline.to_device``) are cycled. Throughput is the global
batch over the median step time.

Also reported per trjax variant: compile time of the train step, XLA's cost
analysis (the flops of one device's program; times N for the step, the
model-flops basis of GFLOP/s and MFU), compiled memory statistics with the
state donated and without (the trainer's own step function,
``tr.train_step.fn``, compiled again by ``trjax.aot.compile_step``), and the
all-reduces of the compiled HLO (count, payload bytes, ring traffic per rank)
against the ring model 2(N-1)/N*|g|.

Outputs in ``--out``: ``benchmark.json``, ``benchmark.md``, ``benchmark.png``
(``profile.json``/``profile.md`` with ``--profile``; ``time_to_accuracy.json`` /
``.md`` with ``--time_to_accuracy``). Each mode is a module of
``scripts/benchmarking/``; this file parses the flags and dispatches.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarking package

from benchmarking.common import configure_environment, parse_args  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv, description=__doc__)
    if a.time_to_accuracy:  # launches its own processes; jax is not started here
        from benchmarking.time_to_accuracy import time_to_accuracy
        time_to_accuracy(a)
        return 0
    if (a.device == "cpu" and not a.gpu and not a.serve and not a.profile
            and a.cpu_devices == 0):
        sizes = [8] if a.world_sizes == "all" else [int(w) for w in str(a.world_sizes).split(",")]
        if len(sizes) > 1:
            from benchmarking.throughput import per_world_processes
            per_world_processes(a, argv, sizes)
            return 0
        a.cpu_devices = sizes[0]
    if a.cpu_devices == 0:  # --profile / --serve children name their own counts
        a.cpu_devices = 8
    configure_environment(a)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    if a.device == "cpu":
        from trjax.cpu import host
        try:
            lib = host.resolve_cpu_convolutions(a.cpu_convolutions, int(a.cpu_devices))
            reuse = a.reuse_memory == "on" or (a.reuse_memory == "auto" and lib == "ynnpack")
            a.host = host.configure_cpu(int(a.cpu_devices), a.cpu_convolutions, reuse)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    if a.serve:
        from benchmarking.serve import serve
        return serve(a)
    if a.profile:
        from benchmarking.cpu_profile import profile
        if a.global_batch is None:
            a.global_batch = 64
        profile(a)
        return 0
    if a.parallel:
        from benchmarking.parallel import parallel
        parallel(a)
        return 0
    if a.gpu and a.xla_ab:
        from benchmarking import gpu
        gpu.xla_ab(a)
        return 0
    if a.gpu:
        from benchmarking import gpu
        gpu.run(a)
        return 0
    from benchmarking.throughput import benchmark
    benchmark(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
