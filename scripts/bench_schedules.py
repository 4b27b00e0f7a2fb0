"""The pipeline schedules side by side in one run: GPipe, 1F1B and ZB-H1.

  python scripts/bench_schedules.py [--mesh data:2,stage:4] [--microbatches 4,8]
      [--model resnet20] [--global_batch 128] [--rounds 5] [--out runs/schedules]

Per schedule and M: the tick count of its loop, the slots that compute on masked
(bubble) inputs, XLA's temp memory of the compiled step per device, and the median
step time over interleaved rounds (the order rotates every round, so background load
hits every variant alike). The main job's model and data (digits, 8 x 8).

On simulated CPU devices all devices share the host's cores, so a step's time is the
SUM of every device's work: a masked slot costs its full compute there, an idle slot of
ZB-H1's table (a ``lax.switch`` branch that runs nothing) costs nothing, and no
interconnect is measured. On GPUs the step time is the longest device's instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _schedule_figures(schedule: str, S: int, M: int) -> dict:
    """Ticks of the loop and the fraction of its slots that compute on masked inputs."""
    from trjax.parallel import zero_bubble
    if schedule == "gpipe":  # the forward loop, then autodiff's transposed loop
        return {"ticks": 2 * (M + S - 1), "masked": (S - 1) / (M + S - 1)}
    if schedule == "1f1b":  # one F and one B slot per tick
        return {"ticks": M + 2 * S - 2, "masked": (2 * S - 2) / (M + 2 * S - 2)}
    t = zero_bubble.ticks(S, M)
    return {"ticks": t["ticks"], "masked": 0.0, "idle": t["bubble"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="data:2,stage:4")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--model", default="resnet20")
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="runs/schedules")
    a = p.parse_args(argv)
    sizes = {k: int(v) for k, v in (x.split(":") for x in a.mesh.split(","))}
    n = 1
    for v in sizes.values():
        n *= v
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={n}")
    import jax
    import numpy as np
    from trjax.configs import default
    from trjax.data import input_pipeline as ip
    from trjax.train import trainer

    data = ip.load_digits()
    G = a.global_batch
    batch = {"image": data.train.images[:G], "label": data.train.labels[:G],
             "mask": np.ones(G, np.float32)}
    runs = {}
    for M in (int(m) for m in a.microbatches.split(",")):
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            c = default.get_config()
            c.update(devices=str(n), mesh=a.mesh, model=a.model, global_batch_size=G,
                     eval_batch_size=G, pipeline_microbatches=M, pipeline_schedule=schedule)
            tr = trainer.setup(c, data)
            device_batch = ip.to_device(batch, tr.world.sharded(), data.num_classes)
            state, _ = tr.train_step(tr.state, device_batch)  # warm
            runs[schedule, M] = {"tr": tr, "state": state, "batch": device_batch, "times": [],
                                 "temp": tr.train_step.memory().get("temp", 0)}
    keys = list(runs)
    for r in range(a.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            run = runs[key]
            t0 = time.perf_counter()
            run["state"], m = run["tr"].train_step(run["state"], run["batch"])
            jax.block_until_ready(m)
            run["times"].append(time.perf_counter() - t0)
    S = sizes["stage"]
    rows = []
    for (schedule, M), run in runs.items():
        med = statistics.median(run["times"])
        base = statistics.median(runs["gpipe", M]["times"])
        rows.append({"schedule": schedule, "S": S, "M": M, **_schedule_figures(schedule, S, M),
                     "temp_bytes": run["temp"], "median_step_s": med, "vs_gpipe": med / base})
    os.makedirs(a.out, exist_ok=True)
    out = {"meta": {"mesh": a.mesh, "model": a.model, "global_batch": G, "rounds": a.rounds,
                    "jax": jax.__version__, "cpu_cores": os.cpu_count(),
                    "platform": jax.devices()[0].platform}, "results": rows}
    with open(os.path.join(a.out, "schedules.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| schedule | M | ticks | masked slots | temp / device | median step | vs GPipe |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['M']} | {r['ticks']} | {100 * r['masked']:.0f} % | "
              f"{r['temp_bytes'] / 2**20:.1f} MiB | {r['median_step_s'] * 1e3:.0f} ms | "
              f"{r['vs_gpipe']:.2f} |")
    return out


if __name__ == "__main__":
    main()
