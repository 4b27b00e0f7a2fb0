"""Prints every collective of the compiled train and eval steps.

  python scripts/comm_report.py --config configs/default.py [--json] [--config.bn_mode=sync]

For each collective of the compiled (post-optimisation) HLO: its kind, what it
carries (gradient bucket, metrics, BN statistics), element count, bytes and
position in the schedule; then the ring all-reduce traffic model per rank,
2(N-1)/N * |g|, and checks that the two buckets stayed two, with the deep one
scheduled before the first conv's weight-gradient convolution.
"""

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # trjax, configs

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is not news
    config = flags.FLAGS.config
    from trjax.cpu import host
    host.configure_cpu(config.cpu_devices, config.cpu_convolutions, config.cpu_reuse_memory)
    from trjax.train import compilation, trainer
    from trjax.report import comm_report, format_report
    # the cache scripts/train.py uses: the same config loads the steps it compiled
    compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
    report = comm_report(trainer.setup(config))
    print(json.dumps(report, indent=2) if flags.FLAGS.json else format_report(report))


if __name__ == "__main__":
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    app.run(main)
