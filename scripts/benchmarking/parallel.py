"""``--parallel``: data, FSDP, pipeline and tensor parallelism side by side on the same devices.

Per mesh shape (``--meshes``, default ``data:8;data:2,stage:4;data:4,model:2``; options
may follow a mesh, :data:`OPTIONS`: ``"data:8;data:8 remat:blocks;data:2,stage:4
schedule:zb-h1 M:8;data:2,fsdp:4 reshard:1"``), one trainer is built by
``trjax.train.trainer.setup`` for the same model, image size and
global batch; the train steps are then timed in interleaved rounds
(:func:`benchmarking.variants.interleave`). Reported per mesh:

* images/s (global batch / median step time);
* XLA's memory statistics of the compiled train step per device (temp, argument,
  output bytes; the state donated) and its peak (argument + output - donated + temp),
  and with ``--memory_per_device`` the largest global batch estimated to fit that
  budget (:func:`fitting_batch`);
* the collectives of the compiled step by mesh axis (:func:`trjax.comm.by_axis`:
  issued per step, loop trip counts included), against the byte models
  (:func:`trjax.comm.data_bytes`, :func:`trjax.comm.pipeline_bytes`);
* against its reference, the data-parallel run with the same arithmetic per data
  rank (:func:`_with_references`: ``data:D`` with ``grad_accumulation_steps = M``
  for a pipeline, ``data:D`` for tensor parallelism, ``data:D*F`` for FSDP), the step time and temp-memory
  ratios; for a pipeline also the analytic bubble ``(S-1)/(M+S-1)`` and its time
  factor ``(M+S-1)/M`` (the bubble ticks compute on masked zeros).

On simulated CPU devices every device shares the host's cores, so the step time is
the SUM of every device's work: against its reference a pipeline does ``(M+S-1)/M``
of the work (its bubble ticks compute on masked zeros in the lock-step SPMD loop),
plus its recomputation, and nothing here measures an interconnect. These are compute
and memory figures, not interconnect figures.
"""

from __future__ import annotations

import json
import os
import time


def _flag(value: str) -> bool:
    """``"1"``/``"true"`` -> True, ``"0"``/``"false"`` -> False (``reshard:1``).

    Raises:
      ValueError: anything else, naming the accepted values.
    """
    v = str(value).strip().lower()
    if v not in ("1", "0", "true", "false"):
        raise ValueError(f"option value {value!r} is not one of 1, 0, true, false")
    return v in ("1", "true")


OPTIONS = {"accum": ("grad_accumulation_steps", int), "remat": ("remat", str),
           "policy": ("remat_policy", str), "schedule": ("pipeline_schedule", str),
           "M": ("pipeline_microbatches", int),
           "reshard": ("fsdp_reshard_after_forward", _flag)}
"""The options a ``--meshes`` entry may name after its mesh (``key:value``) and the
config keys they set."""


def _mesh_sizes(mesh: str) -> dict:
    return {k: int(v) for k, v in (p.split(":") for p in mesh.split(","))}


def split_name(name: str) -> tuple[str, dict]:
    """``"data:2,stage:4 schedule:zb-h1 M:8"`` -> ``("data:2,stage:4", {config key: value})``.

    Raises:
      ValueError: an option not in :data:`OPTIONS` or without ``:``, naming it.
    """
    mesh, *opts = name.split()
    out = {}
    for o in opts:
        key, sep, value = o.partition(":")
        if not sep or key not in OPTIONS:
            raise ValueError(f"--meshes entry {name!r}: option {o!r} is not one of "
                             f"{[k + ':<value>' for k in OPTIONS]}")
        out[OPTIONS[key][0]] = OPTIONS[key][1](value)
    return mesh, out


def fitting_batch(memory: dict, local_batch: int, batch_ranks: int, budget: int) -> int:
    """The largest global batch whose train step is estimated to fit ``budget`` bytes per
    device: what does not scale with the batch (arguments and outputs less the donated
    state) stays, temp scales with the rows per device (activations), in multiples of
    the batch ranks. An estimate from one compile, 0 when even one row does not fit."""
    fixed = memory["argument"] + memory["output"] - memory["alias"]
    per_row = memory["temp"] / max(local_batch, 1)
    rows = int((budget - fixed) // per_row) if per_row and budget > fixed else 0
    return max(rows, 0) * batch_ranks


def parallel(a) -> dict:
    import jax
    from benchmarking.common import random_dataset
    from benchmarking.variants import interleave, summarize

    meshes = [m.strip() for m in a.meshes.split(";") if m.strip()]
    data = random_dataset(2 * a.global_batch, a.image, a.num_classes)
    variants, rows = {}, []
    for mesh, reference in _with_references(meshes, a.pipeline_microbatches):
        rows.append(_build(a, mesh, reference, data, variants))
    times = interleave(variants, a.rounds, a.steps, a.warmup)
    by_name = {r["name"]: r for r in rows}
    for row in rows:
        row.update({k: v for k, v in summarize(times[row["name"]], a.global_batch).items()
                    if k != "times"})
    for row in rows:
        ref = by_name.get(row.get("reference"))
        if ref is not None:
            row["vs_reference"] = {"time": row["median_step_s"] / ref["median_step_s"],
                                   "temp": row["memory"].get("temp", 0) /
                                   max(ref["memory"].get("temp", 0), 1),
                                   "peak": row["memory"].get("peak", 0) /
                                   max(ref["memory"].get("peak", 0), 1)}
    for v in variants.values():
        v.close()
    out = {"meta": {"model": a.model, "image": list(a.image), "global_batch": a.global_batch,
                    "precision": a.precision, "num_classes": a.num_classes,
                    "platform": jax.devices()[0].platform, "devices": len(jax.devices()),
                    "cpu_cores": os.cpu_count(), "jax": jax.__version__,
                    "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                    "memory_per_device": a.memory_per_device,
                    "note": "simulated CPU devices share the host's cores: compute and memory "
                            "figures, not interconnect figures"},
           "results": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "parallel.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    text = markdown(out)
    with open(os.path.join(a.out, "parallel.md"), "w") as f:
        f.write(text)
    print(text)
    return out


def _with_references(meshes, microbatches):
    """Each mesh, after the data-parallel run that does the same arithmetic per data
    rank: for ``data:D,stage:S`` the ``data:D`` step with ``grad_accumulation_steps = M``
    (the same rows per micro-batch, on D devices instead of D x S), for ``data:D,model:T``
    the ``data:D`` step (the same rows per data rank), with ``fsdp:F`` the ``data:D·F``
    step (its batch ranks). ``[(name, reference name)]``."""
    out, seen = [], set()
    for name in meshes:
        mesh, opts = split_name(name)
        sizes = _mesh_sizes(mesh)
        ranks = sizes.get("data", 1) * sizes.get("fsdp", 1)  # the batch's ranks
        ref = None
        if opts and mesh in meshes:  # an option: against the same mesh without it
            ref = mesh
        elif "stage" in sizes:
            ref = f"data:{ranks} accum:{microbatches}"
        elif "model" in sizes or "fsdp" in sizes:  # the same rows per batch rank
            ref = f"data:{ranks}"
        if ref is not None and ref not in seen and ref not in meshes:
            out.append((ref, None))
            seen.add(ref)
        if name not in seen:
            out.append((name, ref))
            seen.add(name)
    return out


def _build(a, name, reference, data, variants) -> dict:
    """Builds one variant (``name``: a mesh, or ``data:D accum:M``) and its row."""
    from benchmarking.common import make_config
    from benchmarking.variants import JaxVariant
    from trjax import comm, hardware
    mesh, opts = split_name(name)
    sizes = _mesh_sizes(mesh)
    n = 1
    for v in sizes.values():
        n *= v
    c = make_config(a, n, "two")
    c.mesh = "" if set(sizes) == {"data"} else mesh
    if "stage" in sizes:
        c.pipeline_microbatches = a.pipeline_microbatches
    for key, value in opts.items():
        c[key] = value
    t0 = time.perf_counter()
    v = JaxVariant(name, c, data, memory_compare=False)
    tr = v.tr
    cols = comm.collectives_in_hlo(comm.hlo_text(tr.train_step.compiled)) or []
    per_axis = {("+".join(k) if isinstance(k, tuple) else str(k)):
                {"count": r["count"], "bytes": r["bytes"]}
                for k, r in comm.by_axis(cols, tr.world.mesh).items()}
    n_grad = tr.layout.grad_replicas
    row = {"name": name, "reference": reference, "world_size": n,
           "local_batch": tr.world.local_batch_size,
           "build_s": time.perf_counter() - t0, "compile_s": tr.train_step.compile_s,
           "memory": tr.train_step.memory(), "by_axis": per_axis,
           "layout": tr.layout.describe(),
           "model_bytes": {"data": comm.data_bytes(tr.plan.gradient_bytes, n_grad),
                           "data_N": n_grad}}
    fsdp = tr.layout.details.get("fsdp_traffic_bytes")
    if fsdp is not None:  # issued result bytes over fsdp, as comm.by_axis counts them
        row["model_bytes"].update(fsdp=fsdp["all_gather"] + fsdp["reduce_scatter"],
                                  fsdp_ring=fsdp["ring"])
    if tr.layout.tensor_traffic is not None:  # issued result bytes over model
        row["model_bytes"]["model"] = tr.layout.tensor_traffic(
            2 if c.precision in ("bf16", "fp16") else 4)["issued"]
    if tr.layout.point_to_point is not None:  # a pipeline
        shares, M = tr.layout.details["pipeline_stage_shares"], tr.layout.details[
            "pipeline_microbatches"]
        S = len(shares)
        row["stages"] = {"shares": shares, "imbalance": max(shares) * S,
                         "microbatches": M, "bubble": (S - 1) / (M + S - 1),
                         "bubble_time_factor": (M + S - 1) / M,
                         "remat": bool(c.pipeline_remat)}
        traffic = tr.layout.point_to_point(2 if c.precision in ("bf16", "fp16") else 4)
        row["model_bytes"].update(stage_useful=traffic["useful_bytes"],
                                  stage_issued=traffic["issued_bytes"])
    if a.memory_per_device and row["memory"]:
        row["fits_global_batch"] = fitting_batch(row["memory"], tr.world.local_batch_size,
                                                 tr.world.data_size,
                                                 hardware.parse_bytes(a.memory_per_device))
    print(f"  {name}: built in {row['build_s']:.1f} s; temp "
          f"{row['memory'].get('temp', 0) / 2**20:.1f} MiB/device, peak "
          f"{row['memory'].get('peak', 0) / 2**20:.1f} MiB/device", flush=True)
    variants[name] = v
    return row


def markdown(out: dict) -> str:
    m = out["meta"]
    mib = lambda x: f"{(x or 0) / 2**20:.1f}"
    lines = [f"{m['model']} {tuple(m['image'])} global batch {m['global_batch']} {m['precision']}, "
             f"{m['devices']} {m['platform']} devices ({m['cpu_cores']} cores), jax {m['jax']}; "
             f"{m['rounds']} rounds x {m['steps']} steps. {m['note']}.", "",
             "| run | local batch | images/s | s/step | peak MiB/dev | temp MiB/dev | "
             "argument MiB/dev | output MiB/dev | vs reference: time, temp, peak | "
             "fits global batch | bubble (S-1)/(M+S-1); (M+S-1)/M | "
             "bytes/step by axis (issued) | model |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        mem, st = r["memory"], r.get("stages")
        axes = "; ".join(f"{k}: {v['count']} x, {v['bytes']} B" for k, v in r["by_axis"].items())
        model = f"data 2(N-1)/N\\|g\\| = {r['model_bytes']['data']:.0f} B (N={r['model_bytes']['data_N']})"
        if "fsdp" in r["model_bytes"]:
            model += (f"; fsdp all-gather + reduce-scatter = {r['model_bytes']['fsdp']} B "
                      f"(ring {r['model_bytes']['fsdp_ring']:.0f} B)")
        if "model" in r["model_bytes"]:
            model += f"; model g + f + all-gather = {r['model_bytes']['model']} B"
        if st:
            model += (f"; stage 2 M mu \\|a\\| = {r['model_bytes']['stage_useful']} B useful, "
                      f"{r['model_bytes']['stage_issued']} B issued")
        bubble = (f"{st['bubble']:.3f}; {st['bubble_time_factor']:.2f} (M={st['microbatches']})"
                  if st else "")
        vs = r.get("vs_reference")
        overhead = (f"{vs['time']:.2f}x, {vs['temp']:.2f}x, {vs['peak']:.2f}x "
                    f"({r['reference']})" if vs else "")
        fits = r.get("fits_global_batch", "")
        lines.append(
            f"| {r['name']} | {r['local_batch']} | {r['images_per_s']:.1f} | "
            f"{r['median_step_s']:.3f} | {mib(mem.get('peak'))} | {mib(mem.get('temp'))} | "
            f"{mib(mem.get('argument'))} | {mib(mem.get('output'))} | "
            f"{overhead} | {fits} | {bubble} | {axes} | {model} |")
    return "\n".join(lines) + "\n"
