"""Training throughput of trjax against its per-leaf baseline and PyTorch DDP.

  # CPU (default): resnet18_cifar, 32x32x3 random images, global batch 64,
  # world sizes 1, 2, 4, 8, each in its own process with exactly N simulated CPU
  # devices (--cpu_devices 8: all world sizes in one process of 8 devices)
  python scripts/benchmark.py [--out runs/benchmark] [--world_sizes 1,2,4,8]
  python scripts/benchmark.py --quick          # world sizes 1,2,8, fewer steps (< 10 min, 2 cores)

  # GPU: ResNet-50, 224x224, bf16, all visible GPUs, against torch.compile +
  # AMP bf16 + channels_last DDP (NCCL) on the same GPUs and global batch
  python scripts/benchmark.py --gpu [--peak_tflops 989]
  python scripts/benchmark.py --gpu --dry_run  # the same code path on CPU, tiny sizes

  # CPU profiling: XLA flags, device counts, host input, side by side
  python scripts/benchmark.py --profile [--steps 3 --rounds 3]

Variants, per world size N:
  trjax/two       config.buckets="two" (two contiguous gradient buckets)
  trjax/per_leaf  config.buckets="per_leaf" (one all-reduce per parameter, the
                  Flax ImageNet example's layout); same model and step otherwise
  torch/ddp       scripts/torch_ddp_bench.py: the same ResNet in plain torch, DDP,
                  N processes (gloo on CPU, max(1, cores // N) threads each;
                  NCCL + torch.compile + AMP bf16 + channels_last on GPU). Skipped
                  with a message when torch is not importable.

Method: every variant of a world size is built first (trjax through
``trjax.train.setup(config, data=Dataset of random normal images)``, torch as a
server process that waits for commands), warmed up, then timed in interleaved
rounds (the order rotates every round) so that background load hits all of
them alike. Each timed step is ``state, m = train_step(state, device_batch)``
followed by ``jax.block_until_ready``; two distinct device batches (made once
by ``trjax.input_pipeline.to_device``) are cycled. Throughput is the global
batch over the median step time.

Also reported per trjax variant: compile time of the train step, XLA's cost
analysis (the flops of one device's program; times N for the step, the
model-flops basis of GFLOP/s and MFU), compiled memory statistics with the
state donated and (compiled again via ``trjax.aot.compile_step``) without
donation, and the all-reduces of the compiled HLO (count, payload bytes, ring
traffic per rank) against the ring model 2(N-1)/N*|g|.

Outputs in ``--out``: ``benchmark.json``, ``benchmark.md``, ``benchmark.png``
(``profile.json``/``profile.md`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "configs"))

TORCH_SCRIPT = os.path.join(HERE, "torch_ddp_bench.py")
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense tensor-core peak per GPU
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="  # empty list: convolutions go to Eigen
NO_EIGEN_MT = "--xla_cpu_multi_thread_eigen=false"
YNN_PLUS = "--xla_cpu_experimental_ynn_fusion_type=+eltwise,+reduce"  # also elementwise/reductions
# YNNPACK keeps its default fusions (reductions, dots) but convolutions go to Eigen
YNN_NO_CONV = "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"
YNN_REDUCE_DOT = "--xla_cpu_experimental_ynn_fusion_type=reduce,dot"


# --------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
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
                        "see trjax.host")
    p.add_argument("--reuse_memory", default="auto", choices=("auto", "on", "off"),
                   help="glibc keeps freed host memory (trjax.host.reuse_host_memory, "
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
    a = p.parse_args(argv)
    if a.dry_run and not a.gpu:
        p.error("--dry_run goes with --gpu")
    a.device = "cuda" if a.gpu and not a.dry_run else "cpu"
    if a.gpu:
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


def configure_environment(a: argparse.Namespace) -> None:
    """Everything that must be set before jax is imported."""
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), a.xla_flags) if f).strip()
    # the device count comes from jax_num_cpu_devices; a stale forced count would conflict
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)
    if a.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        # jax and the torch ranks share the GPUs; jax takes 40% and leaves the rest to torch
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")


# --------------------------------------------------------------------------
# data and config
# --------------------------------------------------------------------------

def random_dataset(n: int, image: tuple, num_classes: int, seed: int = 0):
    """An in-memory :class:`trjax.input_pipeline.Dataset` of random normal images."""
    import numpy as np
    from trjax import input_pipeline
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


# --------------------------------------------------------------------------
# variants
# --------------------------------------------------------------------------

class JaxVariant:
    """A trjax train step built by ``trjax.train.setup``; ``run(k)`` times k steps."""

    def __init__(self, name: str, config, data, memory_compare: bool = True,
                 host_input: bool = False):
        import jax
        import numpy as np
        from trjax import aot, comm, input_pipeline, steps, train
        self.name, self.config, self.host_input = name, config, host_input
        t0 = time.perf_counter()
        self.tr = tr = train.setup(config, data)
        setup_s = time.perf_counter() - t0
        self.state = tr.state
        g, nc = config.global_batch_size, data.num_classes
        self.host_batches = [{"image": data.train.images[i * g:(i + 1) * g],
                              "label": data.train.labels[i * g:(i + 1) * g],
                              "mask": np.ones(g, np.float32)} for i in range(2)]
        self._to_device = lambda b: input_pipeline.to_device(b, tr.world.sharded(), nc, tr.dtype)
        self.device_batches = [self._to_device(b) for b in self.host_batches]
        n = tr.world.world_size
        cost = tr.train_step.cost()
        flops_dev = cost.get("flops", 0.0)
        # no HLO text from the backend (as_text() None): no collectives to count
        cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled)) or []
        ars = [c for c in cols if c["kind"] == "all-reduce"]
        payload = sum(c["bytes"] for c in ars)
        g_bytes = tr.plan.gradient_bytes
        self.info = {
            "world_size": n, "buckets": config.buckets, "model": config.model,
            "precision": config.precision, "platform": tr.world.devices[0].platform,
            "setup_s": setup_s, "compile_s": tr.train_step.compile_s,
            "compile_s_all": {c.name: c.compile_s for c in tr.compiled},
            "flops_per_device": flops_dev, "flops_per_step": flops_dev * n,
            "bytes_accessed_per_device": cost.get("bytes accessed", 0.0),
            "memory_donated": tr.train_step.memory(),
            "comm": {"collectives": len(cols), "all_reduces": len(ars),
                     "plan_buckets": len(tr.plan.bucket_elements),
                     "payload_bytes": payload,
                     "ring_traffic_per_rank_bytes": sum(comm.ring_traffic_bytes(c["bytes"], n)
                                                        for c in ars),
                     "gradient_bytes": g_bytes,
                     "ring_model_per_rank_bytes": comm.ring_traffic_bytes(g_bytes, n)},
        }
        if memory_compare:
            # the trainer's own step (its gradient exchange: compression, ZeRO-1, accumulation
            # included) compiled again without donate_argnums, as setup() builds it
            c = config
            fn = steps.make_train_step(tr.model, tr.exchange, tr.plan, tr.world, c.bn_mode,
                                       dynamic_loss_scale=c.precision == "fp16",
                                       growth_interval=c.loss_scale_growth_interval,
                                       grad_accumulation_steps=c.grad_accumulation_steps)
            nodonate = aot.compile_step("train_step_no_donation", fn,
                                        *tr.train_step.signature)
            self.info["memory_not_donated"] = nodonate.memory()
            self.info["compile_s_not_donated"] = nodonate.compile_s
            # same program apart from aliasing: the flops agree
            self.info["not_donated_flops_match"] = nodonate.cost().get("flops") == flops_dev
            del nodonate
        self.skipped = 0
        self._jax = jax

    def run(self, k: int) -> list[float]:
        jax = self._jax
        times, m = [], None
        for i in range(k):
            t0 = time.perf_counter()
            b = self._to_device(self.host_batches[i % 2]) if self.host_input \
                else self.device_batches[i % 2]
            self.state, m = self.tr.train_step(self.state, b)
            jax.block_until_ready((self.state, m))
            times.append(time.perf_counter() - t0)
        if m is not None and m.to_host().finite == 0.0:
            self.skipped += 1  # a skipped (non-finite) update costs the same compute
        return times

    def close(self):
        del self.state, self.tr, self.device_batches


class ServerVariant:
    """A process that answers ``run K`` with ``{"times": [...]}`` (torch, or a
    benchmark.py ``--serve`` child for profiling)."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None, log_path=None,
                 ready_timeout: float = 900.0):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env, cwd=REPO)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready_timeout = ready_timeout
        self.info = None

    def _pump(self):
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def _reply(self, timeout: float) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if msg is None:
            raise RuntimeError(f"{self.name}: no reply (exit code {self.proc.poll()}); "
                               f"log: {self.log_tail()}")
        return msg

    def wait_ready(self) -> dict:
        if self.info is None:
            self.info = self._reply(self.ready_timeout)
        return self.info

    def log_tail(self, n: int = 1500) -> str:
        if not self.log_path:
            return "(no log)"
        try:
            self._log.flush()
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return "(unreadable log)"

    def run(self, k: int) -> list[float]:
        self.wait_ready()
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        return self._reply(max(600.0, 120.0 * k))["times"]

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def torch_server(a, world: int, log_path: str) -> ServerVariant:
    cmd = [sys.executable, TORCH_SCRIPT, "--serve", "--world", str(world), "--model", a.model,
           "--image", ",".join(map(str, a.image)), "--num_classes", str(a.num_classes),
           "--global_batch", str(a.global_batch), "--warmup", str(max(a.warmup, 1)),
           "--device", a.device, "--threads", str(a.torch_threads)]
    if a.gpu:  # the GPU recipe (also in --dry_run, on CPU, with torch.compile's eager backend)
        cmd += ["--channels_last", "--amp_bf16", "--compile",
                "--compile_backend", "eager" if a.dry_run else "inductor"]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("GLIBC_TUNABLES", None)  # torch runs with glibc's defaults, as its users do
    return ServerVariant("torch/ddp", cmd, env=env, log_path=log_path)


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------

def interleave(variants: dict, rounds: int, steps: int, warmup: int, log=print) -> dict:
    """Warm-up, then ``rounds`` rounds of ``steps`` steps per variant, order rotated."""
    times = {name: [] for name in variants}
    for name, v in variants.items():
        if warmup and not isinstance(v, ServerVariant):  # servers warm up themselves
            v.run(warmup)
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t = variants[name].run(steps)
            times[name] += t
            log(f"  round {r + 1}/{rounds} {name:16s} median {statistics.median(t):.3f} s/step")
    return times


def summarize(times: list[float], global_batch: int) -> dict:
    med = statistics.median(times)
    s = sorted(times)
    return {"steps_timed": len(times), "median_step_s": med, "images_per_s": global_batch / med,
            "min_step_s": s[0], "max_step_s": s[-1],
            "p25_step_s": s[len(s) // 4], "p75_step_s": s[(3 * len(s)) // 4], "times": times}


# --------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------

def world_sizes(a) -> list[int]:
    import jax
    n = len(jax.devices())
    if a.world_sizes == "all":
        return [n]
    ws = [int(w) for w in str(a.world_sizes).split(",")]
    too_big = [w for w in ws if w > n]
    if too_big:
        raise SystemExit(f"--world_sizes {too_big} exceed the {n} available devices")
    return ws


def benchmark(a) -> dict:
    import jax
    os.makedirs(a.out, exist_ok=True)
    ndev = len(jax.devices())
    if a.global_batch is None:  # GPU: 128 per device
        a.global_batch = (4 if a.dry_run else 128) * (ndev if a.world_sizes == "all" else
                                                     max(world_sizes(a)))
    sizes = world_sizes(a)
    use_torch = "torch" in a.variants
    torch_msg = None
    if use_torch and not torch_available():
        use_torch = False
        torch_msg = ("torch is not importable: PyTorch DDP baseline skipped "
                     "(pip install torch==2.13.0)")
        print(torch_msg)
    data = random_dataset(2 * a.global_batch, a.image, a.num_classes)
    meta = {
        "mode": "gpu-dry-run" if a.dry_run else ("gpu" if a.gpu else "cpu"),
        "model": a.model, "image": list(a.image), "global_batch": a.global_batch,
        "precision": a.precision, "num_classes": a.num_classes, "world_sizes": sizes,
        "variants": a.variants, "warmup": a.warmup, "steps_per_round": a.steps,
        "rounds": a.rounds, "quick": a.quick, "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind, "devices_available": ndev,
        "cpu_cores": os.cpu_count(), "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "python": platform.python_version(),
        "cpu_convolutions": getattr(a, "host", {}).get("convolutions"), "simulated_devices": ndev,
        "reuse_host_memory": getattr(a, "host", {}).get("reuse_memory"),
        "loadavg_start": os.getloadavg(), "peak_tflops": a.peak_tflops,
        "data": "random normal float32 (not zeros)", "torch_skipped": torch_msg,
    }
    results = []
    t_start = time.perf_counter()
    for n in sizes:
        print(f"world size {n}: building variants", flush=True)
        variants, infos = {}, {}
        torch_v = None
        try:
            if use_torch and a.gpu:  # overlap torch.compile with XLA's compile
                torch_v = torch_server(a, n, os.path.join(a.out, f"torch_w{n}.log"))
            for b in ("two", "per_leaf"):
                if b in a.variants:
                    name = f"trjax/{b}"
                    v = JaxVariant(name, make_config(a, n, b), data,
                                   memory_compare=not a.no_memory_compare and b == "two")
                    variants[name], infos[name] = v, v.info
                    print(f"  {name}: compile {v.info['compile_s']:.1f} s, "
                          f"{v.info['flops_per_step'] / 1e9:.1f} GFLOP/step, "
                          f"{v.info['comm']['all_reduces']} all-reduce(s)", flush=True)
            if use_torch:
                if torch_v is None:
                    torch_v = torch_server(a, n, os.path.join(a.out, f"torch_w{n}.log"))
                try:
                    infos["torch/ddp"] = torch_v.wait_ready()
                    variants["torch/ddp"] = torch_v
                    print(f"  torch/ddp: ready ({infos['torch/ddp'].get('threads')} thread(s) "
                          f"per rank, {infos['torch/ddp'].get('backend')})", flush=True)
                except RuntimeError as e:
                    print(f"  torch/ddp failed to start: {e}", flush=True)
                    meta.setdefault("errors", []).append(f"world {n} torch/ddp: {e}")
            times = interleave(variants, a.rounds, a.steps, a.warmup)
        finally:
            if torch_v is not None:
                torch_v.close()
        flops = next((i["flops_per_step"] for i in infos.values() if "flops_per_step" in i), 0.0)
        for name in variants:
            s = summarize(times[name], a.global_batch)
            row = {"world_size": n, "variant": name, **s, "info": infos[name]}
            row["gflops_per_s"] = flops / s["median_step_s"] / 1e9 if flops else None
            row["mfu"] = (flops / s["median_step_s"] / (a.peak_tflops * 1e12 * n)
                          if flops and a.gpu else None)
            if isinstance(variants[name], JaxVariant):
                row["skipped_updates_seen"] = variants[name].skipped
                row["simulated_devices"] = ndev
                row["cpu_convolutions"] = meta["cpu_convolutions"]
                row["reuse_host_memory"] = meta["reuse_host_memory"]
            results.append(row)
        for v in variants.values():
            if isinstance(v, JaxVariant):
                v.close()
        del variants
        gc.collect()
    meta["wall_s"] = time.perf_counter() - t_start
    meta["loadavg_end"] = os.getloadavg()
    out = {"meta": meta, "results": results, "ratios": ratios(results, a)}
    write_outputs(out, a)
    return out


def _ips(results, n, variant):
    return next((r["images_per_s"] for r in results
                 if r["world_size"] == n and r["variant"] == variant), None)


def ratios(results: list[dict], a) -> dict:
    sizes = sorted({r["world_size"] for r in results})
    out = {}
    big = max(sizes) if sizes else None
    for n in ([8] if 8 in sizes else [big] if big else []):
        two, leaf = _ips(results, n, "trjax/two"), _ips(results, n, "trjax/per_leaf")
        if two and leaf:
            out[f"two-bucket / per-leaf at world {n}"] = two / leaf
    for n in ([2] if 2 in sizes and not a.gpu else sizes[-1:]):
        two, tor = _ips(results, n, "trjax/two"), _ips(results, n, "torch/ddp")
        if two and tor:
            out[f"trjax / torch DDP at world {n}"] = two / tor
    return out


# --------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------

def footprint(m: dict | None):
    """argument + output - alias + temp bytes (None without memory statistics)."""
    if not m:
        return None
    return m["argument"] + m["output"] - m["alias"] + m["temp"]


def _mb(x):
    return f"{x / 2**20:.1f}" if x is not None else "-"


def markdown(out: dict) -> str:
    m, rs = out["meta"], out["results"]
    lines = [f"# Benchmark: {m['model']} {'x'.join(map(str, m['image']))}, global batch "
             f"{m['global_batch']}, {m['precision']} ({m['mode']}, {m['device_kind']})", "",
             f"{m['rounds']} interleaved rounds x {m['steps_per_round']} timed steps per variant "
             f"after {m['warmup']} warm-up step(s); images/s = global batch / median step time. "
             f"Random normal inputs. {m['cpu_cores']} CPU cores, jax {m['jax']}, load average "
             f"{m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end, "
             f"wall {m['wall_s']:.0f} s.", ""]
    if m.get("torch_skipped"):
        lines += [f"*{m['torch_skipped']}*", ""]
    for e in m.get("errors", []):
        lines += [f"*failed: {e[:300]}*", ""]
    mfu = any(r.get("mfu") is not None for r in rs)
    cpu = m["mode"] == "cpu"
    head = "| world | variant |" + (" devices / XLA:CPU convs / memory reuse |" if cpu else "") + \
        " images/s | s/step (median) | [p25, p75] | GFLOP/s |" + \
        (" MFU |" if mfu else "") + " train-step compile s |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rs:
        i = r["info"]
        gf = f"{r['gflops_per_s']:.1f}" if r.get("gflops_per_s") else "-"
        reuse = {True: "reuse", False: "-"}.get(r.get("reuse_host_memory"), "-")
        dev = (f" {r['simulated_devices']} / {r['cpu_convolutions']} / {reuse} |"
               if r.get("simulated_devices") else " - |") if cpu else ""
        lines.append(f"| {r['world_size']} | {r['variant']} |{dev} {r['images_per_s']:.1f} | "
                     f"{r['median_step_s']:.3f} | [{r['p25_step_s']:.3f}, {r['p75_step_s']:.3f}] | "
                     f"{gf} |")
        if mfu:
            lines[-1] += f" {100 * r['mfu']:.3g}% |" if r.get("mfu") is not None else " - |"
        lines[-1] += f" {i['compile_s']:.1f} |" if "compile_s" in i else \
            f" {i.get('warmup_s', 0):.1f} (torch warm-up) |"
    lines += ["", "GFLOP/s (and MFU) use the model flops of XLA's cost analysis of the trjax step "
              "(one device's program x N) for every variant.", ""]
    lines += ["## Communication and memory (trjax, compiled train step, per device)", "",
              "| world | variant | all-reduces (plan buckets) | payload MiB | ring traffic/rank MiB |"
              " model 2(N-1)/N·\\|g\\| MiB | footprint MiB donated | footprint MiB not donated |"
              " alias MiB | temp MiB donated / not |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        i = r["info"]
        if "comm" not in i:
            continue
        c, md, mn = i["comm"], i["memory_donated"], i.get("memory_not_donated")
        lines.append(f"| {r['world_size']} | {r['variant']} | {c['all_reduces']} "
                     f"({c['plan_buckets']}) | {_mb(c['payload_bytes'])} | "
                     f"{_mb(c['ring_traffic_per_rank_bytes'])} | "
                     f"{_mb(c['ring_model_per_rank_bytes'])} | {_mb(footprint(md))} | "
                     f"{_mb(footprint(mn)) if mn else '-'} | {_mb(md.get('alias'))} | "
                     f"{_mb(md.get('temp'))} / {_mb(mn.get('temp')) if mn else '-'} |")
    lines += ["", "Payload: bytes of all all-reduce operands in the compiled HLO (gradients, "
              "metric sums and BN running statistics); |g| = the plan's gradient bytes. "
              "XLA's all-reduce combiner may merge per-leaf all-reduces. Footprint = argument + "
              "output - alias + temp of XLA's memory analysis (on XLA:CPU its own 'peak' field "
              "leaves out temp). Not donated: the same step compiled without donate_argnums.", ""]
    if out["ratios"]:
        lines += ["## Ratios (images/s)", ""]
        lines += [f"- {k}: **{v:.3f}**" for k, v in out["ratios"].items()]
        lines.append("")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m, rs = out["meta"], out["results"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for variant in dict.fromkeys(r["variant"] for r in rs):
        pts = sorted((r["world_size"], r["images_per_s"]) for r in rs if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    sizes = sorted({r["world_size"] for r in rs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes or [1])
    ax.set_xticklabels([str(s) for s in sizes] or ["1"])
    ax.set_xlabel("world size (devices / DDP ranks)")
    ax.set_ylabel("train images/s")
    ax.set_title(f"{m['model']} {'x'.join(map(str, m['image']))}, batch {m['global_batch']}, "
                 f"{m['precision']} ({m['mode']})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: dict, a) -> None:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "benchmark.json"), "w") as f:
        json.dump(out, f, indent=2, default=float)
    md = markdown(out)
    with open(os.path.join(a.out, "benchmark.md"), "w") as f:
        f.write(md)
    plot(out, os.path.join(a.out, "benchmark.png"))
    print(md)
    for r in out["results"]:
        mfu = f", MFU {100 * r['mfu']:.3g}% of {a.peak_tflops:g} TFLOP/s per device" \
            if r.get("mfu") is not None else ""
        print(f"world {r['world_size']} {r['variant']}: {r['images_per_s']:.1f} images/s{mfu}")
    for k, v in out["ratios"].items():
        print(f"{k}: {v:.3f}")
    print(f"wrote {os.path.join(a.out, 'benchmark.json')}, benchmark.md, benchmark.png")


# --------------------------------------------------------------------------
# profiling (CPU): each idea in its own process, timed side by side
# --------------------------------------------------------------------------

PROFILE_GROUPS = {
    # group: (reference variant, [(name, world, simulated devices, extra XLA_FLAGS,
    #                              host_input, buckets, precision)], torch world sizes)
    # Groups run one after another (a world-8 child holds ~1.6 GB); inside a group the
    # variants are timed in interleaved rounds and compared with the group's reference.
    "threads and devices": ("w8", [
        ("w8", 8, 8, "", False, "two", "fp32"),
        ("w8 no multi-thread eigen", 8, 8, NO_EIGEN_MT, False, "two", "fp32"),
        ("w2 of 8 devices", 2, 8, "", False, "two", "fp32"),
        ("w2 of 2 devices", 2, 2, "", False, "two", "fp32"),
        ("w2 no multi-thread eigen", 2, 8, NO_EIGEN_MT, False, "two", "fp32"),
    ], (2,)),
    "kernels (world 1)": ("w1", [
        ("w1", 1, 8, "", False, "two", "fp32"),
        ("w1 YNN off (Eigen conv)", 1, 8, YNN_OFF, False, "two", "fp32"),
        ("w1 YNN +eltwise,+reduce", 1, 8, YNN_PLUS, False, "two", "fp32"),
        ("w1 bf16", 1, 8, "", False, "two", "bf16"),
    ], (1,)),
    "step structure (world 8)": ("w8", [
        ("w8", 8, 8, "", False, "two", "fp32"),
        ("w8 per_leaf", 8, 8, "", False, "per_leaf", "fp32"),
        ("w8 host input in step", 8, 8, "", True, "two", "fp32"),
        ("w8 YNN off (Eigen conv)", 8, 8, YNN_OFF, False, "two", "fp32"),
    ], ()),
    "combinations": ("w2 of 2 devices", [
        ("w2 of 2 devices", 2, 2, "", False, "two", "fp32"),
        ("w2 of 2 devices YNN +eltwise,+reduce", 2, 2, YNN_PLUS, False, "two", "fp32"),
        ("w2 of 2 devices YNN off (Eigen conv)", 2, 2, YNN_OFF, False, "two", "fp32"),
        ("w8 YNN +eltwise,+reduce", 8, 8, YNN_PLUS, False, "two", "fp32"),
    ], (2,)),
    "Eigen convolutions, YNN reductions": ("w2 of 2 devices", [
        ("w2 of 2 devices", 2, 2, "", False, "two", "fp32"),
        ("w2 of 2, YNN without convolutions", 2, 2, YNN_NO_CONV, False, "two", "fp32"),
        ("w2 of 2, YNN reduce,dot only", 2, 2, YNN_REDUCE_DOT, False, "two", "fp32"),
    ], (2,)),
    "Eigen convolutions, YNN reductions (world 8, 1)": ("w8", [
        ("w8", 8, 8, "", False, "two", "fp32"),
        ("w8, YNN without convolutions", 8, 8, YNN_NO_CONV, False, "two", "fp32"),
        ("w1 of 1", 1, 1, "", False, "two", "fp32"),
        ("w1 of 1, YNN without convolutions", 1, 1, YNN_NO_CONV, False, "two", "fp32"),
    ], ()),
    "Eigen convolutions, single-threaded per device": ("w2 of 2, YNN without convolutions", [
        ("w2 of 2, YNN without convolutions", 2, 2, YNN_NO_CONV, False, "two", "fp32"),
        ("w2 of 2, YNN without convolutions, no multi-thread Eigen", 2, 2,
         YNN_NO_CONV + " " + NO_EIGEN_MT, False, "two", "fp32"),
        ("w8, YNN without convolutions", 8, 8, YNN_NO_CONV, False, "two", "fp32"),
        ("w8, YNN without convolutions, no multi-thread Eigen", 8, 8,
         YNN_NO_CONV + " " + NO_EIGEN_MT, False, "two", "fp32"),
        ("w8", 8, 8, "", False, "two", "fp32"),
    ], ()),
    "bucket layouts (world 8)": ("w8 two", [
        ("w8 two", 8, 8, "", False, "two", "fp32"),
        ("w8 per_leaf", 8, 8, "", False, "per_leaf", "fp32"),
        ("w8 one bucket (size:1000)", 8, 8, "", False, "size:1000", "fp32"),
    ], ()),
    "host memory reuse": ("w8 two", [
        ("w8 two", 8, 8, "", False, "two", "fp32"),
        ("w8 two, reuse host memory", 8, 8, "", False, "two", "fp32",
         ["--cpu_convolutions", "ynnpack", "--reuse_memory", "on"]),
        ("w8 per_leaf, reuse host memory", 8, 8, "", False, "per_leaf", "fp32",
         ["--cpu_convolutions", "ynnpack", "--reuse_memory", "on"]),
        ("w2 of 2, Eigen convolutions", 2, 2, "", False, "two", "fp32",
         ["--cpu_convolutions", "eigen", "--reuse_memory", "off"]),
        ("w2 of 2, Eigen convolutions, reuse host memory", 2, 2, "", False, "two", "fp32",
         ["--cpu_convolutions", "eigen", "--reuse_memory", "on"]),
    ], (2,)),
}


def serve(a) -> int:
    """Child of ``--profile``: one trjax variant answering ``run K`` on stdin."""
    spec = json.loads(a.serve)
    data = random_dataset(2 * a.global_batch, a.image, a.num_classes)
    v = JaxVariant(spec["name"], make_config(a, spec["world"], spec["buckets"]), data,
                   memory_compare=False, host_input=spec["host_input"])
    v.run(max(a.warmup, 1))
    info = {k: v.info[k] for k in ("compile_s", "flops_per_step", "world_size")}
    # host overheads: the CompiledStep's argument check, and a host batch -> device
    b = v.device_batches[0]
    t0 = time.perf_counter()
    for _ in range(20):
        v.tr.train_step.check(v.state, b)
    info["check_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    t0 = time.perf_counter()
    for _ in range(5):
        v._jax.block_until_ready(v._to_device(v.host_batches[0]))
    info["to_device_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    print(json.dumps({"ready": True, **info, "xla_flags": os.environ.get("XLA_FLAGS", "")}),
          flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        print(json.dumps({"times": v.run(int(words[1]))}), flush=True)
    return 0


def _profile_group(a, group: str, ref: str, specs, torch_worlds) -> list[dict]:
    variants, infos = {}, {}
    for name, world, ndev, flags, host_input, buckets, precision, *host_args in specs:
        # jaxlib's defaults unless the spec names trjax.host settings of its own
        host_args = host_args[0] if host_args else ["--cpu_convolutions", "ynnpack",
                                                    "--reuse_memory", "off"]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        xla = " ".join(f for f in (a.xla_flags, flags) if f)
        cmd = [sys.executable, os.path.abspath(__file__), "--model", a.model,
               "--image", ",".join(map(str, a.image)), "--global_batch", str(a.global_batch),
               "--num_classes", str(a.num_classes), "--precision", precision,
               "--cpu_devices", str(ndev), "--warmup", str(a.warmup), f"--xla_flags={xla}",
               *host_args, "--serve", json.dumps({"name": name, "world": world, "host_input": host_input,
                                      "buckets": buckets})]
        slug = "".join(ch if ch.isalnum() else "_" for ch in f"{group} {name}")
        v = ServerVariant(name, cmd, env=env, log_path=os.path.join(a.out, f"profile_{slug}.log"))
        try:  # one at a time: compile times stay comparable
            infos[name] = {**v.wait_ready(), "xla_flags_extra": " ".join([flags, *host_args]),
                           "host_input": host_input,
                           "cpu_devices": ndev, "buckets": buckets, "precision": precision}
            variants[name] = v
            print(f"  [{group}] {name}: ready, compile {infos[name]['compile_s']:.1f} s", flush=True)
        except RuntimeError as e:
            print(f"  [{group}] {name}: failed: {e}", flush=True)
            infos[name] = {"error": str(e)}
            v.close()
    if "torch" in a.variants and torch_available():
        for n in torch_worlds:
            name = f"torch DDP w{n}"
            v = torch_server(a, n, os.path.join(a.out, f"profile_torch_w{n}.log"))
            try:
                infos[name] = v.wait_ready()
                variants[name] = v
            except RuntimeError as e:
                infos[name] = {"error": str(e)}
                v.close()
    try:
        times = interleave(variants, a.rounds, a.steps, 0)
    finally:
        for v in variants.values():
            v.close()
    base = statistics.median(times[ref]) if times.get(ref) else None
    rows = []
    for name in infos:
        if name not in variants:
            rows.append({"group": group, "variant": name, "info": infos[name]})
            continue
        s = summarize(times[name], a.global_batch)
        s["speedup_vs_ref"] = base / s["median_step_s"] if base else None
        rows.append({"group": group, "variant": name, "reference": ref, **s, "info": infos[name]})
    return rows


def profile(a) -> dict:
    """Each idea in its own process (XLA_FLAGS are read once, at start), timed
    side by side with its group's reference; writes profile.json / profile.md."""
    os.makedirs(a.out, exist_ok=True)
    rows = []
    pick = [int(g) for g in a.profile_groups.split(",")] if a.profile_groups else None
    for k, (group, (ref, specs, torch_worlds)) in enumerate(PROFILE_GROUPS.items(), start=1):
        if pick and k not in pick:
            continue
        print(f"profile group: {group}", flush=True)
        rows += _profile_group(a, group, ref, specs, torch_worlds)
    out = {"meta": {"model": a.model, "image": list(a.image), "global_batch": a.global_batch,
                    "rounds": a.rounds, "steps_per_round": a.steps, "cpu_cores": os.cpu_count(),
                    "loadavg_end": os.getloadavg()}, "results": rows}
    suffix = "_groups" + a.profile_groups.replace(",", "_") if pick else ""
    with open(os.path.join(a.out, f"profile{suffix}.json"), "w") as f:
        json.dump(out, f, indent=2, default=float)
    lines = [f"# CPU profile: {a.model}, batch {a.global_batch}, {a.rounds} interleaved rounds x "
             f"{a.steps} steps per variant, within each group", "",
             "| group | variant | extra XLA_FLAGS | s/step (median) | [p25, p75] | images/s | "
             "vs group ref | compile s | host check ms | to_device ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        i = r["info"]
        if "error" in i:
            lines.append(f"| {r['group']} | {r['variant']} | failed: {i['error'][:200]} |")
            continue
        lines.append(f"| {r['group']} | {r['variant']} | `{i.get('xla_flags_extra', '') or '-'}` | "
                     f"{r['median_step_s']:.3f} | [{r['p25_step_s']:.3f}, {r['p75_step_s']:.3f}] "
                     f"| {r['images_per_s']:.1f} | {r['speedup_vs_ref'] or nan:.2f}x "
                     f"(ref {r['reference']}) | {i.get('compile_s', i.get('warmup_s', 0)):.1f} | "
                     f"{i.get('check_ms', nan):.2f} | {i.get('to_device_ms', nan):.1f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, f"profile{suffix}.md"), "w") as f:
        f.write(md)
    print(md)
    return out


def per_world_processes(a, argv: list[str], sizes: list[int]) -> dict:
    """CPU, ``--cpu_devices 0``: every world size N is measured by its own child
    process with exactly N simulated devices (the idle devices of a larger
    simulated host cost time; see docs/performance.md), then the results are
    merged into one JSON / table / plot. Variants of one world size stay
    interleaved inside their child."""
    os.makedirs(a.out, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()
    results, metas = [], []
    for n in sizes:
        sub = os.path.join(a.out, f"world{n}")
        cmd = [sys.executable, os.path.abspath(__file__), *argv,
               "--world_sizes", str(n), "--cpu_devices", str(n), "--out", sub]
        print(f"world size {n}: own process with {n} simulated device(s)", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            raise SystemExit(f"world size {n}: the child benchmark failed (exit {rc}): {cmd}")
        with open(os.path.join(sub, "benchmark.json")) as f:
            child = json.load(f)
        results += child["results"]
        metas.append(child["meta"])
    meta = dict(metas[0])
    meta.update(world_sizes=sizes, wall_s=time.perf_counter() - t0, loadavg_start=load0,
                loadavg_end=os.getloadavg(), simulated_devices="= world size (one process each)",
                errors=[e for m in metas for e in m.get("errors", [])])
    out = {"meta": meta, "results": results, "ratios": ratios(results, a)}
    write_outputs(out, a)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if (a.device == "cpu" and not a.gpu and not a.serve and not a.profile
            and a.cpu_devices == 0):
        sizes = [8] if a.world_sizes == "all" else [int(w) for w in str(a.world_sizes).split(",")]
        if len(sizes) > 1:
            per_world_processes(a, argv, sizes)
            return 0
        a.cpu_devices = sizes[0]
    if a.cpu_devices == 0:  # --profile / --serve children name their own counts
        a.cpu_devices = 8
    configure_environment(a)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax
    if a.device == "cpu":
        from trjax import host
        try:
            lib = host.resolve_cpu_convolutions(a.cpu_convolutions, int(a.cpu_devices))
            reuse = a.reuse_memory == "on" or (a.reuse_memory == "auto" and lib == "ynnpack")
            a.host = host.configure_cpu(int(a.cpu_devices), a.cpu_convolutions, reuse)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    elif jax.devices()[0].platform != "gpu":
        raise SystemExit(f"--gpu: no GPU visible to jax (platform {jax.devices()[0].platform}); "
                         "install jax[cuda12] or use --gpu --dry_run")
    if a.serve:
        return serve(a)
    if a.profile:
        if a.global_batch is None:
            a.global_batch = 64
        profile(a)
        return 0
    benchmark(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
