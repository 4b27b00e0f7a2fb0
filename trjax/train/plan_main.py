"""``trjax-plan`` (``python -m trjax.train.plan_main``): the planner's command.

  trjax-plan --config default --memory_per_device 24GiB [--hardware cpu|h100|h200|FILE]
      [--out DIR] [--axes data,fsdp] [--max_candidates N] [--patience N] [--exhaustive]
      [--verify]
      [--shape 224,224,3 --num_classes 1000] [--config.KEY=VALUE ...]

prints the ranked candidates (:func:`trjax.train.planner.table`) and writes
``DIR/plan.json`` and ``DIR/plan.md``; bad input exits with ``error: <message>``
(status 1) before anything is compiled.
"""

from __future__ import annotations

import numpy as np

from trjax.train.planner import plan, table, verify, why, with_overrides, write


def _synthetic(shape: str, num_classes: int, rows: int):
    """An in-memory data set of ``rows`` zero images of ``shape`` ("224,224,3") for
    planning without the data (only shapes are read)."""
    from trjax.data.splits import Dataset, Split
    dims = tuple(int(x) for x in shape.split(","))
    split = Split(np.zeros((rows,) + dims, np.uint8),
                  np.arange(rows, dtype=np.int32) % num_classes)
    return Dataset(split, split, num_classes, "synthetic", mean=(0.0,) * dims[-1],
                   std=(1.0,) * dims[-1])


def main(argv) -> None:
    """The command's body under absl (see the module docstring)."""
    import sys
    from absl import flags
    del argv
    f = flags.FLAGS
    config = f.config
    from trjax.cpu import host
    from trjax.train import compilation
    try:
        host.configure_cpu(config.cpu_devices, config.cpu_convolutions, config.cpu_reuse_memory)
        from trjax.train import config as config_lib
        config_lib.validate(with_overrides(config, {}))
        data = None
        if f.shape:
            data = _synthetic(f.shape, f.num_classes, config.global_batch_size)
        compilation.configure_cache(config.compilation_cache, config.compilation_cache_dir)
        p = plan(config, data, memory_per_device=f.memory_per_device,
                 hardware_spec=f.hardware,
                 axes=[a.strip() for a in f.axes.split(",")] if f.axes else None,
                 max_candidates=f.max_candidates, patience=f.patience,
                 exhaustive=f.exhaustive)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    path = write(p, f.out)
    print(table(p))
    print(f"plan: {why(p)} -> {path} ({p.seconds:.1f} s)")
    if f.verify:
        v = verify(config, p.chosen.overrides, data)
        print(f"verify: one step of {p.chosen.name} against {v['oracle']}: worst leaf "
              f"{v['worst_leaf']} at {v['worst_ratio']:.3g} x the one-step bound: "
              f"{'ok' if v['ok'] else 'OUTSIDE THE BOUND'}")
        if not v["ok"]:
            sys.exit(2)


def run(argv=None) -> None:
    """The console command ``trjax-plan``: resolves ``--config``, checks its
    overrides, defines the flags and runs :func:`main`."""
    import sys
    from absl import app, flags
    from ml_collections import config_flags
    from trjax.train.main import resolve_config_argv
    sys.argv[:] = resolve_config_argv(sys.argv if argv is None else argv)
    from trjax.train.config import check_argv
    check_argv(sys.argv)
    f = flags.FLAGS
    if "memory_per_device" not in f:
        config_flags.DEFINE_config_file("config", None, "A packaged config's name or a file "
                                        "that defines get_config().", lock_config=True)
        flags.mark_flag_as_required("config")
        flags.DEFINE_string("memory_per_device", None, "Budget per device, e.g. 24GiB.")
        flags.DEFINE_string("hardware", "", "h100, h200, cpu (calibrated) or a JSON file; "
                            "'': the devices' own.")
        flags.DEFINE_string("out", ".", "Folder for plan.json and plan.md.")
        flags.DEFINE_string("axes", "", "Mesh axes to use, e.g. 'data,fsdp' ('': all).")
        flags.DEFINE_integer("max_candidates", 64, "Compile at most this many.")
        flags.DEFINE_integer("patience", 8, "Stop after this many compiled candidates in a "
                             "row that did not beat the best fitting one.")
        flags.DEFINE_bool("exhaustive", False, "Compile every candidate whose state fits.")
        flags.DEFINE_bool("verify", False, "Run one step of the winner against its "
                          "data-parallel oracle (trjax.train.planner.verify).")
        flags.DEFINE_string("shape", "", "Plan for images of this shape ('224,224,3') "
                            "without loading the data set.")
        flags.DEFINE_integer("num_classes", 1000, "Classes with --shape.")
        flags.mark_flag_as_required("memory_per_device")
        for name in ("config", "memory_per_device", "hardware", "out", "axes",
                     "max_candidates", "patience", "exhaustive", "verify", "shape",
                     "num_classes"):  # --help lists them under the command
            f.register_flag_by_module(sys.argv[0], f[name])
    app.run(main, argv=sys.argv)


if __name__ == "__main__":
    run()
