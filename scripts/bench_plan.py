"""The planner's predictions against measured step times, side by side on this host.

  python scripts/bench_plan.py [--config default] [--hardware cpu]
      [--candidates "data:8;data:8 remat:blocks;data:2,fsdp:4;..."] [--out DIR]

For each candidate (a mesh, then ``schedule:<s>`` and ``remat:<r>`` as
:func:`trjax.train.planner.candidates` names them) the planner's predicted step
time (:func:`trjax.train.planner.plan`'s evaluation, on ``--hardware``) and the
measured median step time (``trjax.train.trainer.setup`` and the steps timed in
interleaved rounds, :func:`benchmarking.variants.interleave`), the rank
correlation between the two columns (Spearman) and how far the predicted
winner's measured time is from the measured best. Writes ``DIR/bench_plan.json``
and prints a markdown table. On simulated CPU devices every device shares the
host's cores: the calibration (:func:`trjax.hardware.calibrate_cpu`) measures
that sharing, so these are the CPU profile's figures, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT = ("data:8;data:8 remat:blocks;data:2,fsdp:4;data:1,fsdp:8;data:4,model:2;"
           "data:4,stage:2 schedule:gpipe;data:2,stage:4 schedule:gpipe;"
           "data:2,stage:4 schedule:zb-h1")


def overrides(name: str) -> dict:
    """``"data:2,stage:4 schedule:zb-h1 remat:blocks"`` -> config keys."""
    mesh, *opts = name.split()
    sizes = dict(x.split(":") for x in mesh.split(","))
    out = {"mesh": "" if set(sizes) == {"data"} else mesh, "remat": "none"}
    keys = {"schedule": "pipeline_schedule", "remat": "remat"}
    for o in opts:
        k, _, v = o.partition(":")
        if k not in keys:
            raise ValueError(f"candidate {name!r}: option {o!r} is not one of {list(keys)}")
        out[keys[k]] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--candidates", default=DEFAULT)
    ap.add_argument("--cpu_devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="bench_plan")
    a = ap.parse_args()
    from trjax.cpu import host
    host.configure_cpu(a.cpu_devices)
    import jax
    from benchmarking.variants import JaxVariant, interleave, summarize
    from trjax import cost, hardware
    from trjax.configs import config_path
    from trjax.data import input_pipeline
    from trjax.train import planner, trainer
    from trjax.train.config import load_config_file
    config = load_config_file(config_path(a.config))
    with config.unlocked():
        config.progress, config.num_epochs = False, 1
    from trjax.train import compilation
    compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
    data = input_pipeline.load_dataset(config.dataset, config.data_dir, config.image_size)
    hw = hardware.resolve(a.hardware, jax.devices()[:a.cpu_devices])
    rows, variants = [], {}
    for name in [x.strip() for x in a.candidates.split(";") if x.strip()]:
        cand = planner.Candidate(name, overrides(name))
        c = planner.with_overrides(config, cand.overrides)
        planner._evaluate(cand, trainer.prepare(c, data), hw, 2 ** 62, None)
        variants[name] = JaxVariant(name, c, data, memory_compare=False)
        rows.append(cand)
        print(f"  {name}: predicted {cand.step_s * 1e3:.1f} ms", flush=True)
    times = interleave(variants, a.rounds, a.steps, a.warmup)
    measured = [summarize(times[c.name], config.global_batch_size)["median_step_s"]
                for c in rows]
    predicted = [c.step_s for c in rows]
    rho = cost.spearman(predicted, measured)
    winner = min(range(len(rows)), key=lambda i: predicted[i])
    gap = measured[winner] / min(measured) - 1
    out = {"hardware": hw.to_json(), "config": a.config, "spearman": rho,
           "predicted_winner": rows[winner].name, "winner_gap": gap,
           "rows": [{"name": c.name, "predicted_s": p, "measured_s": m,
                     "parts": c.predicted, "flops": c.flops, "memory": c.memory}
                    for c, p, m in zip(rows, predicted, measured)]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_plan.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("| candidate | predicted ms/step | measured ms/step |\n|---|---|---|")
    for c, p, m in zip(rows, predicted, measured):
        print(f"| {c.name} | {p * 1e3:.1f} | {m * 1e3:.1f} |")
    print(f"Spearman {rho:.3f}; predicted winner {rows[winner].name}: measured "
          f"{gap * 100:.1f} % above the measured best ({rows[measured.index(min(measured))].name})")


if __name__ == "__main__":
    main()
