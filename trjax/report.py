"""The communication report of a config: what the compiled steps really send."""

from __future__ import annotations

from trjax import allreduce, comm
from trjax.metrics import METRICS
from trjax.regions import Region


def comm_report(tr) -> dict:
    """The collectives of a built trainer's compiled steps, the plan's buckets
    and the traffic model.

    Args:
      tr: a :class:`trjax.train.trainer.Trainer` from :func:`trjax.train.trainer.setup`.

    Returns:
      A JSON-ready dict: ``world_size``, ``bn_mode``, ``buckets``,
      ``train_step`` / ``eval_step`` / ``eval_reduce`` collectives,
      ``gradient_all_reduces`` (count), ``deep_before_first_conv_wgrad`` (the
      compiled schedule's order, XLA's choice), ``deep_waits_for_first_conv_wgrad``
      (a data dependency: False for any model, so XLA may overlap the two),
      ``traffic_per_rank_bytes`` (ring model).
    """
    config, plan = tr.config, tr.plan
    # the gradient all-reduce spans the layout's grad axes (the data axis; the
    # model-parallel layouts reduce their own slices over it)
    n = tr.layout.grad_replicas
    names = {"deep": "bucket:deep (deep convs + metrics)",
             "first": "bucket:first (first conv + BN + FC)"}
    labels = {plan.stat_sums_elements: "bn:running statistics",
              len(METRICS): "metrics:sums"}
    for b, size in plan.bucket_elements.items():
        labels[size] = names.get(b, f"bucket:{b}")
        labels.setdefault(-(-size // n), names.get(b, f"bucket:{b}") + " [1/N chunk]")
        if config.compression != "none" and b == plan.metrics_slot[0]:
            labels.setdefault(size - len(METRICS), names.get(b, f"bucket:{b}") + " [compressed, metrics apart]")
    labels.setdefault(1, "non-finite flag (summed over the axes of split slices)")
    for _, size, shape in plan.stats_slots.values():
        labels.setdefault(2 * shape[0] + 1, "bn:sync batch statistics")
    out = {"world_size": tr.world.world_size, "bn_mode": config.bn_mode, "model": config.model,
           "policy": plan.policy, "allreduce": config.allreduce,
           "compression": config.compression,
           "buckets": {b: {"elements": e, "bytes": plan.bucket_bytes(b),
                           "ring_traffic_per_rank_bytes": comm.ring_traffic_bytes(plan.bucket_bytes(b), n)}
                       for b, e in plan.bucket_elements.items()}}
    for step in tr.compiled:
        out.update(_step_report(tr, step, labels))
    grad_bytes = sum(plan.bucket_bytes(b) for b in plan.bucket_elements)
    n_grad = n
    out["mesh"] = tr.world.mesh_spec
    out["traffic_per_rank_bytes"] = {"gradients": comm.ring_traffic_bytes(grad_bytes, n_grad),
                                     "formula": "2(N-1)/N * |g|", "g_bytes": grad_bytes,
                                     "N": n_grad}
    if "fsdp_traffic_bytes" in tr.layout.details:  # issued result bytes over fsdp
        out["traffic_per_rank_bytes"]["fsdp"] = tr.layout.details["fsdp_traffic_bytes"]
    itemsize = 2 if tr.config.precision in ("bf16", "fp16") else 4
    if tr.layout.point_to_point is not None:
        out["traffic_per_rank_bytes"]["pipeline"] = tr.layout.point_to_point(itemsize)
    if tr.layout.tensor_traffic is not None:  # issued result bytes over model, and a ring's
        out["traffic_per_rank_bytes"]["tensor"] = tr.layout.tensor_traffic(itemsize)
    out["cost_model"] = {
        alg: [{"bucket": b, **allreduce.cost_model(alg, plan.bucket_bytes(b), n)}
              for b in plan.bucket_elements]
        for alg in allreduce.ALGORITHMS}
    out["memory_plan"] = plan.describe()
    return out


def format_report(r: dict) -> str:
    """A human-readable table of :func:`comm_report`'s result."""
    lines = [f"world_size={r['world_size']} mesh={r['mesh']} model={r['model']} bn_mode={r['bn_mode']} "
             f"buckets={r['policy']} allreduce={r['allreduce']} compression={r['compression']}",
             "(#N = position in the compiled schedule; 'requested' = as the program asked, "
             "before XLA's passes)"]
    for b, v in r["buckets"].items():
        lines.append(f"  bucket {b:6s} {v['elements']:>10d} elements {v['bytes']:>11d} B  "
                     f"ring traffic/rank {v['ring_traffic_per_rank_bytes']:.0f} B")
    for name in ("train_step", "fold_bn", "eval_step", "eval_reduce"):
        q = r[name]["requested"]
        dtypes = f", {'/'.join(q['dtypes'])}" if q["dtypes"] else ""
        lines.append(f"{name}: {r[name]['count']} collective(s), {r[name]['compiled_bytes']} B "
                     f"compiled; requested {q['count']} ({q['bytes']} B{dtypes})")
        if r[name]["collectives"] is None:
            lines[-1] = (f"{name}: compiled HLO {r[name]['hlo']}; requested {q['count']} "
                         f"({q['bytes']} B{dtypes})")
            continue
        for c in r[name]["collectives"]:
            where = "" if c["computation"] == "ENTRY" else \
                f" (in {c['computation']}, x{c.get('trip_count')} per step)"
            where += f" (async, done at #{c['done_position']})" if c.get("async") else ""
            lines.append(f"  #{c['position']:<5d} {c['kind']:12s} {c['elements']:>10d} el "
                         f"{c['bytes']:>11d} B  over {c['axis']}  "
                         f"{' + '.join(c['carries'])}{where}")
        for axis, v in r[name]["by_axis"].items():
            lines.append(f"  over {axis}: {v['count']} issued per step, {v['bytes']} B")
    lines.append(f"gradient all-reduces: {r['gradient_all_reduces']}; deep bucket before the "
                 f"first conv's weight gradient: {r['deep_before_first_conv_wgrad']} "
                 f"(wgrad at {r['first_conv_wgrad_positions']}; XLA's order); the deep "
                 f"all-reduce waits for it: {r['deep_waits_for_first_conv_wgrad']}")
    lines.append("alpha-beta cost model per all-reduce algorithm (alpha 5 us, 25 GB/s):")
    for alg, rows in r["cost_model"].items():
        name = "xla (as ring)" if alg == "xla" else alg
        lines.append(f"  {name:17s} " + "; ".join(
            f"{x['bucket']}: {x['steps']} steps, {x['bytes_sent_per_rank']:.0f} B/rank, "
            f"{x['time_s'] * 1e6:.1f} us" for x in rows))
    t = r["traffic_per_rank_bytes"]
    lines.append(f"ring model: {t['formula']} = {t['gradients']:.0f} B per rank per step "
                 f"(|g| = {t['g_bytes']} B, N = {t['N']})")
    if "pipeline" in t:
        p = t["pipeline"]
        lines.append(f"pipeline model: {p['formula']} = {p['useful_bytes']} B per step "
                     f"(M={p['microbatches']}, mu={p['micro_batch']}, boundaries "
                     f"{p['boundary_shapes']}); the loop issues {p['issued_bytes']} B "
                     f"({p['schedule']}, {p['ticks']} ticks), the stage-owned all-to-alls "
                     f"{p['exchange_bytes']} B")
    if "fsdp" in t:
        f = t["fsdp"]
        again = " (again in the backward: fsdp_reshard_after_forward)" if f["gathers"] > 1 else ""
        lines.append(f"fsdp model: all-gather {f['all_gather']} B ({f['gathers']} x the split "
                     f"parameters{again}) + reduce-scatter {f['reduce_scatter']} B issued per "
                     f"step, a ring sends {f['ring']:.0f} B ({f['gathers'] + 1}(F-1)/F |params|)")
    if "tensor" in t:
        m = t["tensor"]
        lines.append(f"tensor model: g {m['g']} + f {m['f']} + all-gather {m['gather']} = "
                     f"{m['issued']} B issued per step, a ring sends {m['total']:.0f} B "
                     f"(T={m['T']})")
    return "\n".join(lines)


def _requested(req) -> dict:
    return {"count": len(req), "bytes": sum(c["bytes"] for c in req),
            "dtypes": sorted({o["dtype"] for c in req for o in c["operands"]})}


def _step_report(tr, step, labels) -> dict:
    """``{step name: its collectives (labelled, with their mesh axis) and byte
    counts}``, and for the train step :func:`_bucket_order`'s keys."""
    text = comm.hlo_text(step.compiled)
    req = comm.requested_collectives(step.lowered_text)
    if text is None:  # a backend without HLO text: report what the program requested
        out = {step.name: {"collectives": None, "count": None, "compiled_bytes": None,
                           "hlo": "unavailable (Compiled.as_text() gave no text)",
                           "requested": _requested(req)}}
        if step.name == "train_step":
            out.update(dict.fromkeys(("gradient_all_reduces", "first_conv_wgrad_positions",
                                      "deep_before_first_conv_wgrad",
                                      "bucket_elements_match_plan",
                                      "deep_waits_for_first_conv_wgrad", "async_collectives")))
        return out
    cols = comm.label_collectives(comm.collectives_in_hlo(text), labels)
    mesh = tr.world.mesh
    for c in cols:
        axis = comm.axis_of(c, mesh)
        c["axis"] = "+".join(axis) if isinstance(axis, tuple) else axis
        if set(c["carries"]) == {"other"} and axis in tr.layout.collective_labels:
            c["carries"] = [tr.layout.collective_labels[axis].get(c["kind"], "other")]
    out = {step.name: {"collectives": cols, "count": len(cols),
                       "by_axis": {("+".join(a) if isinstance(a, tuple) else str(a)):
                                   {"count": v["count"], "bytes": v["bytes"]}
                                   for a, v in comm.by_axis(cols, mesh).items()},
                       "compiled_bytes": sum(c["bytes"] for c in cols),
                       "requested": _requested(req)}}
    if step.name == "train_step":
        out.update(_bucket_order(tr.plan, text, cols, labels))
    return out


def _bucket_order(plan, text: str, cols: list, labels: dict) -> dict:
    """The train step's gradient all-reduces: their count, whether the deep bucket's
    is scheduled before the first conv's weight gradient (XLA's choice) or waits for
    it (a data dependency: never, for any model), and whether their sizes are the plan's."""
    grads = [c for c in cols if any(lab.startswith("bucket:") for lab in c["carries"])]
    regions = [s.region for s in plan.slots]  # a model whose one kernel layer is
    first = plan.slots[regions.index(Region.FIRST_CONV)] \
        if Region.FIRST_CONV in regions else None  # also its classifier has none
    wgrad = comm.conv_positions(text, first.shape) if first is not None and \
        len(first.shape) == 4 else []
    first_bucket = labels[next(iter(plan.bucket_elements.values()))]
    deep = [c["position"] for c in grads if first_bucket in c["carries"]]
    return {"gradient_all_reduces": len(grads),
            "async_collectives": sum(c["async"] for c in cols),
            "first_conv_wgrad_positions": wgrad,
            "deep_before_first_conv_wgrad": bool(deep and wgrad and max(deep) < min(wgrad)),
            "deep_waits_for_first_conv_wgrad": comm.depends_on(text, deep, wgrad)
            if deep and wgrad else None,
            "bucket_elements_match_plan": sorted(c["elements"] for c in grads
                                                 if len(c["operands"]) == 1) ==
            sorted(plan.bucket_elements.values())}
