"""``--profile``: CPU ideas (XLA flags, device counts, host input, bucket
layouts, host memory reuse), each variant in its own ``--serve`` process (XLA
flags are read once, at start), timed side by side with its group's reference.
Writes ``profile.json`` / ``profile.md``."""

from __future__ import annotations

import json
import os
import statistics
import sys

from benchmarking.common import (BENCHMARK_SCRIPT, NO_EIGEN_MT, YNN_NO_CONV, YNN_OFF, YNN_PLUS,
                                 YNN_REDUCE_DOT)
from benchmarking.variants import (ServerVariant, interleave, summarize, torch_available,
                                   torch_server)


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
    "BatchNorm padding mask (world 8)": ("w8, full batches", [
        ("w8, full batches", 8, 8, "", False, "two", "fp32"),
        ("w8, step with the padding mask", 8, 8, "", False, "two", "fp32",
         ["--cpu_convolutions", "ynnpack", "--reuse_memory", "off", "--padded_last_batch"]),
    ], ()),
}


def _profile_group(a, group: str, ref: str, specs, torch_worlds) -> list[dict]:
    variants, infos = {}, {}
    for name, world, ndev, flags, host_input, buckets, precision, *host_args in specs:
        # jaxlib's defaults unless the spec names trjax.cpu.host settings of its own
        host_args = host_args[0] if host_args else ["--cpu_convolutions", "ynnpack",
                                                    "--reuse_memory", "off"]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        xla = " ".join(f for f in (a.xla_flags, flags) if f)
        cmd = [sys.executable, BENCHMARK_SCRIPT, "--model", a.model,
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
