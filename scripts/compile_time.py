"""Compile time of the main job's train step per mesh: trace + lower, then XLA's compile.

  python scripts/compile_time.py [--meshes "data:8;data:2,stage:4;data:2,stage:4/1f1b;data:2,fsdp:4"]

Each mesh's trainer is prepared (no state, nothing run), its train step lowered with
``jax.jit(step).lower`` and compiled with trjax's step options, in one process and in turn;
the persistent compilation cache is not used. A mesh ``.../1f1b`` runs the 1F1B schedule.
Prints seconds per phase and the compiled module's size (lines, fusions).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="data:8;data:2,stage:4;data:2,stage:4/1f1b;data:2,fsdp:4")
    a = p.parse_args(argv)
    import jax
    from trjax.configs import default
    from trjax.cpu.compile_options import STEP_OPTIONS
    from trjax.state import train_state_program
    from trjax.train import trainer
    jax.config.update("jax_enable_compilation_cache", False)
    for spec in a.meshes.split(";"):
        mesh, _, schedule = spec.strip().partition("/")
        c = default.get_config()
        c.mesh = "" if mesh.startswith("data:") and "," not in mesh else mesh
        c.pipeline_schedule = schedule or "gpipe"
        tr = trainer.prepare(c)
        init = train_state_program(c.seed, tr.layout, tr.exchange)
        t0 = time.perf_counter()
        lowered = jax.jit(trainer.make_train_step(tr), donate_argnums=0).lower(
            init.abstract, trainer.example_batch(tr, tr.world.global_batch_size))
        t1 = time.perf_counter()
        hlo = lowered.compile(STEP_OPTIONS).as_text()
        t2 = time.perf_counter()
        print(f"{spec}: trace + lower {t1 - t0:.1f} s, XLA compile {t2 - t1:.1f} s, "
              f"{hlo.count(chr(10))} HLO lines, {hlo.count('fusion(')} fusions", flush=True)


if __name__ == "__main__":
    main()
