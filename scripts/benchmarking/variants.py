"""What the benchmark times: a trjax train step built by the trainer, a server
process answering ``run K`` (PyTorch DDP, or a ``--serve`` child), and the
interleaved rounds that time them side by side."""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

from benchmarking.common import REPO, TORCH_SCRIPT


class JaxVariant:
    """A trjax train step built by ``trjax.train.trainer.setup``; ``run(k)`` times k steps."""

    def __init__(self, name: str, config, data, memory_compare: bool = True,
                 host_input: bool = False):
        import jax
        import numpy as np
        from trjax import aot, comm
        from trjax.data import input_pipeline
        from trjax.train import trainer
        self.name, self.config, self.host_input = name, config, host_input
        t0 = time.perf_counter()
        self.tr = tr = trainer.setup(config, data)
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
            # the function the trainer compiled (its gradient exchange: compression, ZeRO-1,
            # accumulation included), compiled again for the same arguments without donation
            nodonate = aot.compile_step("train_step_no_donation", tr.train_step.fn,
                                        *tr.train_step.signature,
                                        options=tr.layout.compile_options)
            self.info["memory_not_donated"] = nodonate.memory()
            self.info["compile_s_not_donated"] = nodonate.compile_s
            # the same program apart from aliasing: the flops agree, to the few scalar ops
            # that copy insertion may recompute instead of copying (region analysis on CPU,
            # trjax.aot.CPU_COMPILER_OPTIONS: 16 of 72 million flops for ResNet-8, world 1)
            flops_nd = nodonate.cost().get("flops", 0.0)
            self.info["flops_per_device_not_donated"] = flops_nd
            self.info["not_donated_flops_match"] = bool(
                flops_dev > 0 and abs(flops_nd - flops_dev) <= 1e-6 * flops_dev)
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
