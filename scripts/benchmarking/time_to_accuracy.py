"""``--time_to_accuracy``: the main job start to finish, trjax against its PyTorch DDP twin.

Variants (each run a fresh process and a fresh workdir, launched and timed by
this process; rounds interleaved, the order rotating every round):

* ``cold``: ``scripts/train.py --config configs/default.py`` with an empty
  persistent compilation cache (a fresh ``--config.compilation_cache_dir``);
* ``warm``: the same command on a cache a previous run of the same job filled
  (round 1's cold run fills it; without a cold variant an untimed run does);
* ``torch``: ``scripts/torch_main_job.py``, the same job in plain PyTorch DDP
  (gloo, ``--torch_world`` processes): ResNet-20, the same digits split and
  normalisation, global batch 128, the same warm-up + cosine schedule, SGD with
  momentum and weight decay on kernels, 15 epochs, evaluated and checkpointed
  after every epoch.

Reported per run: ``wall_s`` (process start to exit, measured here),
``first_step_s`` (process start to the end of the first training step: the
job's ``summary.json`` ``first_step_done_at``, a Unix time, minus the launch
time), ``val_top1`` (from ``summary.json``), the load average at launch, and
for trjax where the seconds went (``summary.json``: start-up builds and their
compile/load seconds, ``checkpoint_blocking_s``, the epochs' training seconds
from ``metrics.jsonl``, ``compiles_during_training``). Medians per variant and
the ratios to torch's median wall go to ``time_to_accuracy.json`` and a table
(``time_to_accuracy.md``) in ``--out``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchmarking.common import REPO, TORCH_MAIN_JOB, TRAIN_SCRIPT

VARIANTS = ("cold", "warm", "torch")
TARGETS = {"warm / torch wall": 1.0, "cold / torch wall": 1.5, "val_top1": 0.98}


def _child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE"):
        env.pop(k, None)  # the job's own settings decide (a test's forced device count must not)
    return env


def trjax_command(a, workdir: str, cache: str) -> list[str]:
    return [sys.executable, TRAIN_SCRIPT, "--config", os.path.join(REPO, "configs", "default.py"),
            "--workdir", workdir, "--config.progress=False",
            f"--config.compilation_cache_dir={cache}", f"--config.num_epochs={a.epochs}",
            f"--config.model={a.model}", f"--config.global_batch_size={a.global_batch}",
            f"--config.train_remainder={a.remainder}", *a.train_flags.split()]


def torch_command(a, workdir: str) -> list[str]:
    return [sys.executable, TORCH_MAIN_JOB, "--workdir", workdir, "--world", str(a.torch_world),
            "--epochs", str(a.epochs), "--model", a.model, "--global_batch", str(a.global_batch),
            "--remainder", a.remainder]


def _epoch_rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_one(a, variant: str, round_: int, cmd: list[str], workdir: str) -> dict:
    """Launches ``cmd``, waits for its exit; returns the run's figures."""
    os.makedirs(os.path.dirname(workdir), exist_ok=True)
    log_path = workdir + ".log"
    load = os.getloadavg()
    with open(log_path, "w") as log:
        t_launch = time.time()
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), cwd=REPO)
        wall = time.perf_counter() - t0
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{variant} (round {round_}) exited {rc}: {' '.join(cmd)}\n{tail}")
    with open(os.path.join(workdir, "summary.json")) as f:
        s = json.load(f)
    row = {"variant": variant, "round": round_, "wall_s": round(wall, 3),
           "first_step_s": round(s["first_step_done_at"] - t_launch, 3),
           "val_top1": s["val_top1"], "loadavg_at_launch": [round(x, 2) for x in load],
           "workdir": workdir}
    if variant != "torch":  # where trjax's seconds went
        startup = s["compiles_by_phase"].get("startup", {})
        steps = {k: v for k, v in s["compiles_by_phase"].items() if k in s["compiles"]}
        train_s = sum(r["epoch_s"] for r in _epoch_rows(workdir))
        row["profile"] = {
            "before_train_and_evaluate_s": round(wall - s["wall_s"], 3),  # interpreter, imports, exit
            "in_train_and_evaluate_s": round(s["wall_s"], 3),
            "startup_programs": {k: startup.get(k, 0) for k in ("built", "compiled", "cache_hits")},
            "startup_build_s": startup.get("seconds", 0.0),
            "step_programs": {k: v for k, v in steps.items()},
            "step_build_s": round(sum(v["seconds"] for v in steps.values()), 3),
            "compile_s_total": s["compilation_cache"]["compile_s"],
            "cache_load_s_total": s["compilation_cache"]["load_s"],
            "train_s": round(train_s, 3),
            "checkpoint_blocking_s": s["checkpoint_blocking_s"],
            # summary.json "seconds": prepare, setup, train, evaluate, checkpoint (measured
            # inside train_and_evaluate); "other": the rest of it (epoch starts, logs, summary)
            "seconds": {**s["seconds"], "other": round(s["wall_s"] - sum(s["seconds"].values()), 3)},
            "compiles_during_training": s["compiles_during_training"],
            "train_images_per_s": s["train_images_per_s"],
        }
        row["compiles_during_training"] = s["compiles_during_training"]
    else:
        row["profile"] = {k: s[k] for k in ("train_s", "evaluate_s", "checkpoint_s", "startup_s")
                          if k in s}
    return row


def time_to_accuracy(a) -> dict:
    """Runs the rounds (see the module docstring); writes the JSON and the table."""
    out_dir = os.path.abspath(a.out)
    os.makedirs(out_dir, exist_ok=True)
    variants = [v.strip() for v in a.tta_variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise SystemExit(f"--tta_variants {a.tta_variants!r}: choose from {','.join(VARIANTS)}")
    if "torch" in variants:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise SystemExit("--time_to_accuracy: torch is not importable (pip install "
                             "torch==2.13.0), or leave it out with --tta_variants cold,warm")
    runs_dir = os.path.join(out_dir, "tta_runs")
    shutil.rmtree(runs_dir, ignore_errors=True)
    warm_cache = os.path.join(runs_dir, "cache_warm")
    base = [v for v in VARIANTS if v in variants]  # cold before warm: round 1's cold fills it
    t_start, load_start = time.perf_counter(), os.getloadavg()
    rows = []
    if "warm" in variants and "cold" not in variants:
        print("filling the warm cache (untimed run)", flush=True)
        run_one(a, "cold", 0, trjax_command(a, os.path.join(runs_dir, "prime"), warm_cache),
                os.path.join(runs_dir, "prime"))
    for r in range(1, a.rounds + 1):
        k = (r - 1) % len(base)
        for v in base[k:] + base[:k]:
            workdir = os.path.join(runs_dir, f"r{r}_{v}")
            if v == "torch":
                cmd = torch_command(a, workdir)
            else:
                fresh = warm_cache if (v == "warm" or not os.path.exists(warm_cache)) else \
                    os.path.join(runs_dir, f"cache_r{r}")
                cmd = trjax_command(a, workdir, fresh)
            row = run_one(a, v, r, cmd, workdir)
            rows.append(row)
            print(f"round {r} {v:5s}: wall {row['wall_s']:.1f} s, first step "
                  f"{row['first_step_s']:.1f} s, val top-1 {row['val_top1']:.4f} "
                  f"(load {row['loadavg_at_launch'][0]:.1f})", flush=True)
    med = {v: {k: statistics.median(x[k] for x in rows if x["variant"] == v)
               for k in ("wall_s", "first_step_s", "val_top1")} for v in base}
    ratios = {}
    if "torch" in med:
        for v in ("warm", "cold"):
            if v in med:
                ratios[f"{v} / torch wall"] = med[v]["wall_s"] / med["torch"]["wall_s"]
                ratios[f"{v} / torch first step"] = med[v]["first_step_s"] / med["torch"]["first_step_s"]
    meta = {"model": a.model, "epochs": a.epochs, "global_batch": a.global_batch,
            "torch_world": a.torch_world, "remainder": a.remainder, "train_flags": a.train_flags, "rounds": a.rounds,
            "variants": base, "cpu_cores": os.cpu_count(), "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
            "python": sys.version.split()[0], "targets": TARGETS}
    out = {"meta": meta, "runs": rows, "median": med, "ratios": ratios,
           "compiles_during_training": {x["variant"] + f" r{x['round']}": x["compiles_during_training"]
                                        for x in rows if "compiles_during_training" in x}}
    with open(os.path.join(out_dir, "time_to_accuracy.json"), "w") as f:
        json.dump(out, f, indent=2)
    md = markdown(out)
    with open(os.path.join(out_dir, "time_to_accuracy.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {os.path.join(out_dir, 'time_to_accuracy.json')}, time_to_accuracy.md")
    return out


def markdown(out: dict) -> str:
    m = out["meta"]
    names = {"cold": "trjax, cold compilation cache", "warm": "trjax, warm compilation cache",
             "torch": f"PyTorch DDP, gloo, {m['torch_world']} processes"}
    lines = [f"# Time to accuracy: {m['model']}, digits, global batch {m['global_batch']}, "
             f"{m['epochs']} epochs", "",
             f"Each run a fresh process and workdir, {m['rounds']} interleaved round(s); "
             f"{m['cpu_cores']} CPU cores, load average {m['loadavg_start'][0]:.1f} at the start, "
             f"{m['loadavg_end'][0]:.1f} at the end; last partial batch: {m['remainder']}; "
             f"trjax flags: `{m['train_flags'] or '-'}`.", "",
             "| run | round | val top-1 | wall, process start to exit (s) | to first step (s) | "
             "start-up programs compiled / loaded | compiles during training | load at launch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        p = r.get("profile", {}).get("startup_programs")
        progs = f"{p['compiled']} / {p['cache_hits']}" if p else "-"
        lines.append(f"| {names[r['variant']]} | {r['round']} | {r['val_top1']:.4f} | "
                     f"{r['wall_s']:.1f} | {r['first_step_s']:.1f} | {progs} | "
                     f"{r.get('compiles_during_training', '-')} | {r['loadavg_at_launch'][0]:.1f} |")
    lines += ["", "Medians: " + "; ".join(
        f"{v}: wall {x['wall_s']:.1f} s, first step {x['first_step_s']:.1f} s, "
        f"val top-1 {x['val_top1']:.4f}" for v, x in out["median"].items()), ""]
    if out["ratios"]:
        lines += [f"- {k}: **{v:.2f}x**" for k, v in out["ratios"].items()]
        lines.append("")
    prof = [r for r in out["runs"] if r["variant"] != "torch"]
    if prof:
        lines += ["Where trjax's seconds went (summary.json `seconds`; compile / cache load from "
                  "its compile log):", "",
                  "| run | round | interpreter + imports + exit | prepare | setup | of which "
                  "compiled / loaded from cache | train steps | evaluation | saves blocking | "
                  "other |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in prof:
            q, t = r["profile"], r["profile"]["seconds"]
            lines.append(f"| {r['variant']} | {r['round']} | {q['before_train_and_evaluate_s']:.1f} | "
                         f"{t['prepare']:.1f} | {t['setup']:.1f} | "
                         f"{q['compile_s_total']:.1f} / {q['cache_load_s_total']:.1f} | "
                         f"{t['train']:.1f} | {t['evaluate']:.1f} | {t['checkpoint']:.1f} | "
                         f"{t['other']:.1f} |")
        lines.append("")
    return "\n".join(lines)
