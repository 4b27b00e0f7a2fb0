"""``--gpu``: ResNet-50, 224x224, bf16 on all visible GPUs, against torch.compile +
AMP bf16 + channels_last DDP (NCCL) on the same GPUs and global batch; MFU from
XLA's model flops. ``--gpu --xla_ab``: the same step on one GPU with XLA settings
side by side (:func:`xla_ab`). ``--gpu --dry_run`` runs the same code path on CPU with tiny
sizes (resnet18 at 32x32, 2 simulated devices / 2 gloo ranks, torch.compile's
eager backend). The timing itself is :func:`benchmarking.throughput.benchmark`."""

from __future__ import annotations

from benchmarking.throughput import benchmark


def check_platform(platform: str, dry_run: bool) -> None:
    """Raises ``SystemExit`` naming the fix when ``--gpu`` finds no GPU."""
    if not dry_run and platform != "gpu":
        raise SystemExit(f"--gpu: no GPU visible to jax (platform {platform}); "
                         "install jax[cuda12] or use --gpu --dry_run")


def run(a) -> dict:
    import jax
    check_platform(jax.devices()[0].platform, a.dry_run)
    return benchmark(a)


XLA_VARIANTS = (
    ("default", ""),
    ("latency-hiding scheduler", "--xla_gpu_enable_latency_hiding_scheduler=true"),
    ("command buffers off", "--xla_gpu_enable_command_buffer="),
    ("autotune level 0", "--xla_gpu_autotune_level=0"),
)
"""The XLA settings ``--xla_ab`` times against the default: the latency-hiding
scheduler (JAX's GPU performance guide recommends it; one public sweep measured
it at -4 %), command buffers (CUDA graphs) off (a conv-heavy NVIDIA JAX project
turned them off) and no autotuning of the convolution / GEMM algorithms."""


def xla_ab(a) -> dict:
    """``--xla_ab``: the ResNet-50 bf16 step on one device with each of
    :data:`XLA_VARIANTS`, each a ``--serve`` process (XLA reads its flags once,
    at start), started together (their compiles overlap) and timed in
    interleaved rounds, order rotated. Reports per variant images/s, MFU against
    ``--peak_tflops``, compile seconds and XLA's memory statistics, and which
    variant beat the default by more than the run-to-run spread (the larger of
    the two interquartile ranges over the medians). Writes ``xla_ab.json``."""
    import json
    import os
    import sys
    from benchmarking.common import BENCHMARK_SCRIPT
    from benchmarking.variants import ServerVariant, interleave, summarize
    os.makedirs(a.out, exist_ok=True)
    variants, infos = {}, {}
    for name, flags in XLA_VARIANTS:
        # four processes share the GPU; the variant's flags join the caller's XLA_FLAGS
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")
        cmd = [sys.executable, BENCHMARK_SCRIPT, "--gpu", "--model", a.model,
               "--image", ",".join(map(str, a.image)), "--global_batch", str(a.global_batch),
               "--num_classes", str(a.num_classes), "--precision", a.precision,
               "--warmup", str(a.warmup), f"--xla_flags={flags}",
               *(["--dry_run", "--cpu_devices", "1"] if a.dry_run else []),
               "--serve", json.dumps({"name": name, "world": 1, "host_input": False,
                                      "buckets": "two"})]
        slug = "".join(ch if ch.isalnum() else "_" for ch in name)
        variants[name] = ServerVariant(name, cmd, env=env,
                                       log_path=os.path.join(a.out, f"xla_ab_{slug}.log"))
    for name, flags in XLA_VARIANTS:
        try:
            infos[name] = {**variants[name].wait_ready(), "flags": flags}
        except RuntimeError as e:
            infos[name] = {"error": str(e)[-500:], "flags": flags}
            variants.pop(name).close()
    try:
        times = interleave(variants, a.rounds, a.steps, 0)
    finally:
        for v in variants.values():
            v.close()
    rows = {}
    for name, info in infos.items():
        if name not in times:
            rows[name] = {"info": info}
            continue
        s = summarize(times[name], a.global_batch)
        s["mfu"] = info["flops_per_step"] / s["median_step_s"] / (a.peak_tflops * 1e12)
        s["spread"] = (s["p75_step_s"] - s["p25_step_s"]) / s["median_step_s"]
        rows[name] = {**s, "info": info}
    out = {"meta": {"model": a.model, "image": list(a.image), "global_batch": a.global_batch,
                    "precision": a.precision, "rounds": a.rounds, "steps_per_round": a.steps,
                    "peak_tflops": a.peak_tflops, "dry_run": a.dry_run},
           "results": rows, "winner": _winner(rows)}
    with open(os.path.join(a.out, "xla_ab.json"), "w") as f:
        json.dump(out, f, indent=2, default=float)
    for name, r in rows.items():
        if "median_step_s" in r:
            print(f"xla_ab {name:26s} {r['images_per_s']:9.1f} img/s  MFU {100 * r['mfu']:.3g}%  "
                  f"compile {r['info']['compile_s']:.1f} s  spread {100 * r['spread']:.1f}%")
        else:
            print(f"xla_ab {name:26s} failed: {r['info']['error'][-200:]}")
    print(f"xla_ab winner: {out['winner']}", flush=True)
    return out


def _winner(rows: dict) -> dict:
    """The fastest variant and whether it beat the default by more than the spread."""
    timed = {n: r for n, r in rows.items() if "median_step_s" in r}
    if "default" not in timed:
        return {"name": None, "reason": "the default did not run"}
    best = min(timed, key=lambda n: timed[n]["median_step_s"])
    base = timed["default"]
    gain = base["median_step_s"] / timed[best]["median_step_s"] - 1
    spread = max(base["spread"], timed[best]["spread"])
    return {"name": best, "gain_over_default": gain, "spread": spread,
            "beats_default_beyond_spread": best != "default" and gain > spread}
