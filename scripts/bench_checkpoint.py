"""Checkpoint saves of the default job's state, side by side in one process.

  python scripts/bench_checkpoint.py [--saves 6] [--gap_s 0.3]

Variants: orbax handed the replicated device arrays and waited on (trjax before
issue 14), and ``trjax.train.checkpoint.save`` (a host copy of the state dict,
one stored array per leaf, with per-leaf CRC-32 checksums in the meta)
synchronously, and asynchronously (the time until ``save`` returns). For each:
the first save's seconds, the median of the later ones, the process's CPU
seconds per save (every thread: orbax's background writer too; on a small host
they are taken from the training steps), and the programs jax built during the
saves (``trjax.train.compilation.CompileLog``). ``--gap_s`` stands for the
training steps an asynchronous write overlaps with.
"""
import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax, configs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--gap_s", type=float, default=0.3)
    args = p.parse_args()
    from configs import default
    from trjax.cpu import host
    config = default.get_config()
    host.configure_cpu(config.cpu_devices, config.cpu_convolutions)
    import flax
    import numpy as np
    import orbax.checkpoint as ocp
    from trjax.train import checkpoint, compilation, trainer

    state = trainer.setup(config).state

    def device_arrays_sync(m, st):
        m.save(int(st.step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(flax.serialization.to_state_dict(st)),
            meta=ocp.args.JsonSave({})), force=True)
        m.wait_until_finished()

    def checkpoint_sync(m, st):
        checkpoint.save(m, st, {})
        checkpoint.finish(m)

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    variants = {"device arrays, sync (before issue 14)": (False, device_arrays_sync),
                "checkpoint.save, sync": (False, checkpoint_sync),
                "checkpoint.save, async (until save returns)":
                    (True, lambda m, st: checkpoint.save(m, st, {}))}
    import jax
    results = {"state_leaves": len(jax.tree_util.tree_leaves(state)),
               "state_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(state))}
    print(results, flush=True)
    for name, (asynchronous, save) in variants.items():
        mngr = checkpoint.manager(tempfile.mkdtemp(), asynchronous=asynchronous)
        seconds, built, cpu = [], [], 0.0
        for i in range(args.saves):
            st = state.replace(step=state.step + i + 1)
            with compilation.CompileLog() as log:
                t, c = time.perf_counter(), cpu_s()
                save(mngr, st)
                seconds.append(time.perf_counter() - t)
            built.append(log.count())
            time.sleep(args.gap_s)  # idle: the CPU used meanwhile is the background write's
            if i:
                cpu += cpu_s() - c
        checkpoint.finish(mngr)
        results[name] = {"first_s": round(seconds[0], 3),
                         "later_s_median": round(float(np.median(seconds[1:])), 3),
                         "later_cpu_s_per_save": round(cpu / max(1, args.saves - 1), 4),
                         "programs_first_save": built[0], "programs_later": sum(built[1:])}
        print(name, results[name], flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
