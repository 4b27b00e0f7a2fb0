"""``--serve``: the child of ``--profile``, one trjax variant answering ``run K``
on stdin with ``{"times": [...]}`` on stdout."""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarking.common import make_config, random_dataset
from benchmarking.variants import JaxVariant


def serve(a) -> int:
    """Child of ``--profile``: one trjax variant answering ``run K`` on stdin."""
    spec = json.loads(a.serve)
    # two full batches (the ones timed); one more example pads a third, which keeps the
    # padding mask in the train step (trjax.data.input_pipeline.train_batches_full)
    data = random_dataset(2 * a.global_batch + int(a.padded_last_batch), a.image, a.num_classes)
    v = JaxVariant(spec["name"], make_config(a, spec["world"], spec["buckets"]), data,
                   memory_compare=False, host_input=spec["host_input"])
    v.run(max(a.warmup, 1))
    info = {k: v.info[k] for k in ("compile_s", "flops_per_step", "world_size",
                                   "bytes_accessed_per_device")}
    info["memory"] = v.info["memory_donated"]  # XLA's memory statistics of the train step
    # host overheads: the CompiledStep's argument check, and a host batch -> device
    b = v.device_batches[0]
    t0 = time.perf_counter()
    for _ in range(20):
        v.tr.train_step.check(v.state, b)
    info["check_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    t0 = time.perf_counter()
    for _ in range(5):
        v._jax.block_until_ready(v._to_device(v.host_batches[0]))
    info["to_device_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    print(json.dumps({"ready": True, **info, "xla_flags": os.environ.get("XLA_FLAGS", "")}),
          flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        print(json.dumps({"times": v.run(int(words[1]))}), flush=True)
    return 0
