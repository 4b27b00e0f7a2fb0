"""The command line of scripts/benchmark.py, the environment set before jax
starts, and the data and config of a throughput variant."""

from __future__ import annotations

import argparse
import os
import sys

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(SCRIPTS)
for _p in (os.path.join(REPO, "configs"), REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

BENCHMARK_SCRIPT = os.path.join(SCRIPTS, "benchmark.py")  # children re-enter here
TORCH_SCRIPT = os.path.join(SCRIPTS, "torch_ddp_bench.py")
TORCH_MAIN_JOB = os.path.join(SCRIPTS, "torch_main_job.py")
TRAIN_SCRIPT = os.path.join(SCRIPTS, "train.py")
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense tensor-core peak per GPU
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="  # empty list: convolutions go to Eigen
NO_EIGEN_MT = "--xla_cpu_multi_thread_eigen=false"
YNN_PLUS = "--xla_cpu_experimental_ynn_fusion_type=+eltwise,+reduce"  # also elementwise/reductions
# YNNPACK keeps its default fusions (reductions, dots) but convolutions go to Eigen
YNN_NO_CONV = "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"
YNN_REDUCE_DOT = "--xla_cpu_experimental_ynn_fusion_type=reduce,dot"


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join("runs", "benchmark"))
    p.add_argument("--model", default=None, help="default resnet18_cifar (GPU: resnet50)")
    p.add_argument("--image", default=None, help="H,W,C; default 32,32,3 (GPU: 224,224,3)")
    p.add_argument("--global_batch", type=int, default=None,
                   help="default 64 (GPU: 128 per GPU)")
    p.add_argument("--world_sizes", default=None,
                   help="comma-separated; default 1,2,4,8 (--quick: 1,2,8; GPU: all GPUs)")
    p.add_argument("--variants", default=None,
                   help="comma-separated of two,per_leaf,torch; default all three (GPU: two,torch)")
    p.add_argument("--precision", default=None, help="fp32 (CPU default) or bf16 (GPU default)")
    p.add_argument("--num_classes", type=int, default=None, help="default 10 (GPU: 1000)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--cpu_devices", type=int, default=0,
                   help="simulated CPU devices; 0 (default): each world size N runs in its own "
                        "process with exactly N devices")
    p.add_argument("--cpu_convolutions", default="auto",
                   help="XLA:CPU convolutions: auto (eigen when devices <= cores), eigen, ynnpack; "
                        "see trjax.cpu.host")
    p.add_argument("--reuse_memory", default="auto", choices=("auto", "on", "off"),
                   help="glibc keeps freed host memory (trjax.cpu.host.reuse_host_memory, "
                        "config.cpu_reuse_memory); auto: on where the convolutions are "
                        "YNNPACK's (more devices than cores)")
    p.add_argument("--torch_threads", type=int, default=0,
                   help="threads per torch rank; 0: max(1, cores // N)")
    p.add_argument("--no_torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--no_memory_compare", action="store_true",
                   help="skip the extra compile without donation")
    p.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS before jax starts")
    p.add_argument("--quick", action="store_true", help="CPU: world sizes 1,2,8, fewer steps")
    p.add_argument("--gpu", action="store_true",
                   help="ResNet-50 224x224 bf16 on all GPUs against torch.compile + AMP")
    p.add_argument("--dry_run", action="store_true",
                   help="with --gpu: the GPU code path on CPU with tiny sizes")
    p.add_argument("--peak_tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help="peak TFLOP/s per device for MFU (default: H100/H200 bf16 dense)")
    p.add_argument("--profile", action="store_true",
                   help="CPU profiling: XLA flags / device counts / host input side by side")
    p.add_argument("--profile_groups", default=None,
                   help="with --profile: comma-separated group numbers (1-based), default all")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # internal (--profile)
    p.add_argument("--xla_ab", action="store_true",
                   help="with --gpu: the step on one GPU with XLA settings side by side "
                        "(benchmarking.gpu.XLA_VARIANTS; default batch 256)")
    p.add_argument("--padded_last_batch", action="store_true",
                   help="--profile children: a data set of two batches and one example, so "
                        "that the trainer keeps BatchNorm's padding mask in the train step "
                        "(the batches timed are full either way)")
    p.add_argument("--parallel", action="store_true",
                   help="data / pipeline / tensor parallel meshes side by side on the same "
                        "devices (default ResNet-50 at 224, global batch 8, 8 CPU devices)")
    p.add_argument("--meshes", default="data:8;data:2,fsdp:4;fsdp:8;data:2,stage:4;data:4,model:2",
                   help="--parallel: ';'-separated config.mesh values, each optionally followed "
                        "by options: 'data:8 remat:blocks', 'data:2,stage:4 schedule:zb-h1 M:8' "
                        "(accum, remat, policy, schedule, M)")
    p.add_argument("--memory_per_device", default="",
                   help="--parallel: a budget per device ('24GiB'): each row gives the largest "
                        "global batch estimated to fit it")
    p.add_argument("--pipeline_microbatches", type=int, default=4,
                   help="--parallel: micro-batches per step on a 'stage' mesh")
    p.add_argument("--time_to_accuracy", action="store_true",
                   help="the main job start to finish in fresh processes: trjax with a cold and "
                        "a warm compilation cache against its PyTorch DDP twin (--rounds N)")
    p.add_argument("--epochs", type=int, default=15, help="--time_to_accuracy: epochs")
    p.add_argument("--torch_world", type=int, default=2,
                   help="--time_to_accuracy: PyTorch DDP processes (gloo)")
    p.add_argument("--tta_variants", default="cold,warm,torch",
                   help="--time_to_accuracy: comma-separated of cold,warm,torch")
    p.add_argument("--remainder", default="pad", choices=("pad", "drop"),
                   help="--time_to_accuracy: the last partial batch of each epoch, in both jobs: "
                        "pad (trjax masks padding rows, torch takes a smaller batch) or drop "
                        "(trjax's step then compiles without the padding mask)")
    p.add_argument("--train_flags", default="",
                   help="--time_to_accuracy: extra scripts/train.py flags for the trjax runs, "
                        "e.g. '--config.cpu_devices=2'")
    a = p.parse_args(argv)
    if a.dry_run and not a.gpu:
        p.error("--dry_run goes with --gpu")
    if a.xla_ab and not a.gpu:
        p.error("--xla_ab goes with --gpu")
    if a.xla_ab and a.global_batch is None:
        a.global_batch = 4 if a.dry_run else 256
    a.device = "cuda" if a.gpu and not a.dry_run else "cpu"
    if a.time_to_accuracy:
        if a.gpu or a.profile:
            p.error("--time_to_accuracy is a mode of its own (not with --gpu / --profile)")
        a.model = a.model or "resnet20"
        a.global_batch = a.global_batch or 128
        a.rounds = a.rounds or 1
        for name in ("epochs", "rounds", "torch_world", "global_batch"):
            if getattr(a, name) < 1:
                p.error(f"--{name} {getattr(a, name)}: must be at least 1")
        return a
    if a.parallel:
        if a.gpu or a.profile:
            p.error("--parallel is a mode of its own (not with --gpu / --profile)")
        defaults = dict(model="resnet50", image="224,224,3", precision="fp32", num_classes=1000,
                        global_batch=8, warmup=1, steps=2, rounds=2, world_sizes="8",
                        variants="two")
    elif a.gpu:
        defaults = dict(model="resnet50", image="224,224,3", precision="bf16", num_classes=1000,
                        variants="two,torch", warmup=3, steps=10, rounds=3, world_sizes="all")
        if a.dry_run:
            defaults.update(model="resnet18", image="32,32,3", num_classes=10, warmup=1, steps=2,
                            rounds=1, world_sizes="all")
            a.cpu_devices = a.cpu_devices or 2
    else:
        defaults = dict(model="resnet18_cifar", image="32,32,3", precision="fp32",
                        num_classes=10, variants="two,per_leaf,torch", global_batch=64,
                        world_sizes="1,2,4,8", warmup=2, steps=5, rounds=3)
        if a.quick:
            defaults.update(world_sizes="1,2,8", warmup=1, steps=4, rounds=3)
    for k, v in defaults.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.image = tuple(int(v) for v in a.image.split(","))
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in ("two", "per_leaf", "torch")]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from two,per_leaf,torch")
    if a.no_torch and "torch" in a.variants:
        a.variants.remove("torch")
    if a.cpu_devices < 0:
        p.error(f"--cpu_devices {a.cpu_devices}: use 0 (one process per world size) or a count")
    return a


def without_forced_device_count(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) less ``--xla_force_host_platform_device_count``:
    trjax's scripts set the simulated device count themselves (``jax_num_cpu_devices``),
    and a stale forced count would conflict; every other flag is kept."""
    return " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)


def configure_environment(a: argparse.Namespace) -> None:
    """Everything that must be set before jax is imported."""
    flags = without_forced_device_count(
        " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), a.xla_flags) if f))
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)
    if a.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        # jax and the torch ranks share the GPUs; jax takes 40% and leaves the rest to torch
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")


def random_dataset(n: int, image: tuple, num_classes: int, seed: int = 0):
    """An in-memory :class:`trjax.data.input_pipeline.Dataset` of random normal images."""
    import numpy as np
    from trjax.data import input_pipeline
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + tuple(image)).astype(np.float32)
    y = rng.integers(0, num_classes, n).astype(np.int32)
    # never time on zeros: XLA and oneDNN/YNN kernels may take shortcuts on them
    assert np.count_nonzero(x) > 0.99 * x.size and 0.9 < float(x.std()) < 1.1
    split = input_pipeline.Split(x, y)
    return input_pipeline.Dataset(split, split, num_classes, "random")


def make_config(a, world: int, buckets: str):
    import default as default_config
    c = default_config.get_config()
    c.model = a.model
    c.global_batch_size = a.global_batch
    c.eval_batch_size = a.global_batch
    c.devices = str(world)
    c.cpu_devices = a.cpu_devices
    c.buckets = buckets
    c.precision = a.precision
    c.progress = False
    c.num_epochs = 1
    return c
