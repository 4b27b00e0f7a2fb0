"""Validation pass time with folded BatchNorm against per-batch folding, side by side.

  python scripts/bench_eval.py --config configs/default.py [--rounds 5]

Both variants run the same compiled shapes on the same state and batches, in
interleaved rounds; prints the median seconds per validation pass and the ratio.
"""

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
flags.DEFINE_integer("repeat", 3, "Validation passes per round and variant.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import numpy as np
    config = flags.FLAGS.config
    jax.config.update("jax_num_cpu_devices", int(config.cpu_devices))
    from trjax import aot, steps
    from trjax.data import input_pipeline
    from trjax.train.trainer import setup
    tr = setup(config)
    w, state = tr.world, tr.state
    unfolded = aot.compile_step("eval_unfolded", steps.make_eval_step(
        tr.layout, folded=False), state.params, state.batch_stats,
        *tr.eval_step.signature[2:])
    batches = [input_pipeline.to_device(b, w.sharded(), tr.data.num_classes) for b in
               input_pipeline.iterate_batches(tr.data.val, config.eval_batch_size, shuffle=False)]

    def run_folded():
        folded = tr.fold_bn(state)
        acc = jax.device_put(np.zeros((w.world_size, 4), np.float32), w.sharded())
        for b in batches:
            acc = tr.eval_step(state.params, folded, b, acc)
        return np.asarray(tr.eval_reduce(acc))

    def run_unfolded():
        acc = jax.device_put(np.zeros((w.world_size, 4), np.float32), w.sharded())
        for b in batches:
            acc = unfolded(state.params, state.batch_stats, b, acc)
        return np.asarray(tr.eval_reduce(acc))

    np.testing.assert_allclose(run_folded(), run_unfolded(), rtol=1e-5)  # warm-up + check
    times = {"folded": [], "unfolded": []}
    for _ in range(flags.FLAGS.rounds):
        for name, fn in (("unfolded", run_unfolded), ("folded", run_folded)):
            t0 = time.perf_counter()
            for _ in range(flags.FLAGS.repeat):
                fn()
            times[name].append((time.perf_counter() - t0) / flags.FLAGS.repeat)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(json.dumps({"model": config.model, "world_size": w.world_size,
                      "val_examples": len(tr.data.val.labels),
                      "s_per_pass_median": med, "rounds": times,
                      "unfolded_over_folded": med["unfolded"] / med["folded"]}, indent=1))


if __name__ == "__main__":
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    app.run(main)
