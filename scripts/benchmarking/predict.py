"""A step-time prediction made before any GPU run: XLA's cost analysis of the
compiled train step (FLOPs, bytes accessed) against a GPU's roofline.

``predicted step s = max(FLOPs / peak FLOP/s, bytes / HBM bytes/s)``, taken on the
program's TOTALS (one compiled program's ``cost_analysis()``; XLA:CPU reports no
per-fusion costs through jax, so the max is not taken per fusion, which would
give a larger, tighter bound). The program is compiled for the CPU, so the
bytes are those of XLA:CPU's fusion decisions, an estimate of the GPU's; the
FLOPs are the model's. Where ``jax.experimental.roofline`` traces the step, its
unfused per-primitive bytes are recorded beside it as an upper bound on the
memory traffic. Anchors: H200 SXM, 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e.
"""

from __future__ import annotations

import time

H200 = {"name": "H200 SXM", "peak_tflops": 989.0, "hbm_tbps": 4.8}


def roofline(flops: float, bytes_accessed: float, peak_tflops: float = H200["peak_tflops"],
             hbm_tbps: float = H200["hbm_tbps"]) -> dict:
    """The roofline time of one step from its totals.

    Args:
      flops: floating-point operations per step on one device.
      bytes_accessed: bytes read and written per step on one device.
      peak_tflops: the device's dense peak in TFLOP/s (bf16 tensor cores).
      hbm_tbps: its memory bandwidth in TB/s.

    Returns:
      ``{"compute_s", "memory_s", "predicted_step_s", "bound"}`` (seconds;
      ``bound`` ``"compute"`` or ``"memory"``, whichever term is larger).
    """
    compute = flops / (peak_tflops * 1e12)
    memory = bytes_accessed / (hbm_tbps * 1e12)
    return {"compute_s": compute, "memory_s": memory, "predicted_step_s": max(compute, memory),
            "bound": "compute" if compute >= memory else "memory"}


def predict(model: str, image: tuple, num_classes: int, batch: int, precision: str = "bf16",
            device: dict = H200) -> dict:
    """Compiles one device's train step on the CPU and predicts its time on ``device``.

    Args:
      model: a built-in model name (``resnet50``, ``resnet20``, ...).
      image: ``(H, W, C)``; num_classes: the head's classes.
      batch: rows per device per step.
      precision: ``bf16`` (the GPU benchmark's) or ``fp32``.
      device: ``{"name", "peak_tflops", "hbm_tbps"}``.

    Returns:
      ``{"model", "image", "batch", "precision", "device", "flops", "bytes_accessed",
      "compute_s", "memory_s", "predicted_step_s", "bound", "predicted_images_per_s",
      "compile_s", "unfused_bytes"}`` (``unfused_bytes``: ``jax.experimental.roofline``'s
      per-primitive bytes, or the error it raised).
    """
    from benchmarking.common import random_dataset  # puts configs/ on sys.path
    import default as default_config
    from trjax import aot, steps
    from trjax.state import train_state_program
    from trjax.train import trainer

    c = default_config.get_config()
    c.model, c.precision, c.devices, c.cpu_devices = model, precision, "1", 1
    c.global_batch_size = c.eval_batch_size = batch
    c.num_epochs, c.progress = 1, False
    data = random_dataset(batch, tuple(image), num_classes)
    tr = trainer.prepare(c, data)
    state = train_state_program(c.seed, tr.layout, tr.exchange).abstract
    example = trainer.example_batch(tr, batch)
    t0 = time.perf_counter()
    step = aot.compile_step("train_step", steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                                                trainer.step_options(tr)),
                            state, example, donate_argnums=0)
    compile_s = time.perf_counter() - t0
    cost = step.cost()
    flops, nbytes = cost.get("flops", 0.0), cost.get("bytes accessed", 0.0)
    out = {"model": model, "image": list(image), "batch": batch, "precision": precision,
           "device": device["name"], "peak_tflops": device["peak_tflops"],
           "hbm_tbps": device["hbm_tbps"], "flops": flops, "bytes_accessed": nbytes,
           **roofline(flops, nbytes, device["peak_tflops"], device["hbm_tbps"]),
           "compile_s": compile_s, "basis": "totals of XLA:CPU's compiled cost analysis"}
    out["predicted_images_per_s"] = batch / out["predicted_step_s"] if flops else None
    out["unfused_bytes"] = _unfused_bytes(step, state, example)
    return out


def _unfused_bytes(step, state, example):
    """``jax.experimental.roofline``'s HBM bytes of the step (every primitive reading
    and writing memory, no fusion), or the error it raised on these versions."""
    try:
        from jax.experimental import roofline as jax_roofline
        _, result = jax_roofline.roofline(step.fn)(state, example)
        return float(result.hbm_bytes)
    except Exception as e:  # an experimental API: record what it says, do not fail
        return f"{type(e).__name__}: {str(e)[:200]}"
