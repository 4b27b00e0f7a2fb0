"""What updating the optimizer on global arrays costs on a split mesh (issue 50).

  python scripts/bench_recipe_mesh.py [--model resnet8] [--meshes "data:2,fsdp:4;data:4,model:2"]

For each mesh and recipe, the compiled train step's XLA memory analysis (argument, temp,
peak per device) and its collectives per axis (count and bytes per step, from the compiled
HLO: trjax.comm.by_axis), side by side with the update run inside shard_map on each
device's slices, the way trjax ran elementwise optimizers on these meshes before: right
for sgd and adamw, per-shard (wrong) norms for LARS and clipping. Simulated CPU devices: memory and collective
figures, not timings.
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

RECIPES = {"sgd": {}, "lars+clip": {"optimizer": "lars", "grad_clip_norm": 1.0},
           "adamw+clip": {"optimizer": "adamw", "grad_clip_norm": 1.0}}


def measure(mesh: str, model: str, recipe: str, inside: bool) -> dict:
    """One compiled train step: memory and collectives per axis."""
    from trjax import comm, steps
    from trjax.configs import default
    from trjax.train import trainer
    c = default.get_config()
    sizes = [int(a.split(":")[1]) for a in mesh.split(",")]
    c.model, c.mesh, c.devices = model, mesh, str(int(np.prod(sizes)))
    for k, v in RECIPES[recipe].items():
        c[k] = v
    tr = trainer.prepare(c)
    layout = dataclasses.replace(tr.layout, split_axes=()) if inside else tr.layout
    init = trainer.train_state_program(0, tr.layout, tr.exchange)
    fn = steps.make_train_step(layout, tr.exchange, tr.plan, trainer.step_options(tr))
    compiled = jax.jit(fn, donate_argnums=0).lower(
        init.abstract, trainer.example_batch(tr, c.global_batch_size)).compile()
    m = compiled.memory_analysis()
    axes = comm.by_axis(comm.collectives_in_hlo(compiled.as_text()), tr.world.mesh)
    return {"mesh": mesh, "recipe": recipe, "update": "inside shard_map" if inside else "global",
            "argument_MiB": m.argument_size_in_bytes / 2 ** 20,
            "temp_MiB": m.temp_size_in_bytes / 2 ** 20,
            "collectives": {str(a): {"count": v["count"], "bytes": v["bytes"]}
                            for a, v in axes.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet8")
    ap.add_argument("--meshes", default="data:2,fsdp:4;data:4,model:2;data:4,stage:2")
    args = ap.parse_args()
    for mesh in args.meshes.split(";"):
        for recipe in RECIPES:
            for inside in ((False, True) if recipe == "sgd" else (False,)):
                print(json.dumps(measure(mesh, args.model, recipe, inside)), flush=True)


if __name__ == "__main__":
    main()
