"""Training throughput (images/s) of trjax against its per-leaf baseline and
PyTorch DDP, side by side; the CPU mode runs each world size in its own process.
Writes ``benchmark.json``, ``benchmark.md`` and ``benchmark.png``."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import time

from benchmarking.common import BENCHMARK_SCRIPT, make_config, random_dataset
from benchmarking.variants import (JaxVariant, interleave, summarize, torch_available,
                                   torch_server)


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
        cmd = [sys.executable, BENCHMARK_SCRIPT, *argv,
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
