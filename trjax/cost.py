"""A step's cost per device, and its predicted time on a :class:`trjax.hardware.Hardware`.

:func:`jaxpr_flops` counts the convolution and matmul FLOPs of a traced step per
device, loops at their trip counts: XLA's ``cost_analysis()`` counts a while
loop's body once, so a pipeline's tick loop or an accumulation loop would look
M times cheaper than it runs. The count follows the program as written:
recomputation (remat, a pipeline's backward slots) is counted where the
program recomputes, a ``cond`` / ``switch`` costs its largest branch (each
device runs one branch in lock step; the tick takes the slowest), and a
pipeline's bubble ticks count (they compute on masked zeros).

:func:`predict` is the time model: a roofline over the FLOPs and the bytes
XLA's cost analysis accessed (scaled by the same loop factor), plus an
alpha-beta term per collective on the link its mesh axis uses.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend import core as jcore


def _subjaxprs(params: dict):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _eqn_flops(e) -> float:
    name = e.primitive.name
    if name == "conv_general_dilated":
        rhs, out = e.invars[1].aval, e.outvars[0].aval
        spec = e.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        k = rhs.shape[spec[1]] * math.prod(rhs.shape[d] for d in spec[2:])
        return 2.0 * math.prod(out.shape) * k
    if name == "dot_general":
        (contract, _), _ = e.params["dimension_numbers"]
        lhs = e.invars[0].aval
        return 2.0 * math.prod(e.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contract)
    return 0.0


def _flops(jaxpr, scale: float, loops: bool) -> float:
    total = 0.0
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name == "cond":
            total += max(_flops(b.jaxpr, scale, loops) for b in e.params["branches"])
        elif name == "shard_map":  # inside: per-device shapes
            total += sum(_flops(j, 1.0, loops) for j in _subjaxprs(e.params))
        else:
            trips = e.params.get("length", 1) if name == "scan" and loops else 1
            total += scale * _eqn_flops(e) + trips * sum(
                _flops(j, scale, loops) for j in _subjaxprs(e.params))
    return total


def jaxpr_flops(closed_jaxpr, world_size: int) -> dict:
    """Convolution and matmul FLOPs per device of a traced step.

    Args:
      closed_jaxpr: ``jax.make_jaxpr(step)(*abstract_args)``; work outside a
        ``shard_map`` is on global arrays and counts ``1 / world_size`` per device
        (evenly sharded), inside it per device.
      world_size: the number of devices.

    Returns:
      ``{"flops": per device per step, scan loops at their lengths; "flops_once":
      the same with every loop body counted once, as XLA's cost analysis counts;
      "loop_factor": flops / flops_once (1.0 without loops)}``.
    """
    j = closed_jaxpr.jaxpr
    flops = _flops(j, 1.0 / world_size, True)
    once = _flops(j, 1.0 / world_size, False)
    return {"flops": flops, "flops_once": once, "loop_factor": flops / once if once else 1.0}


def axis_link(axis: str, mesh_axes, hw):
    """The link an axis' collectives use: inside a node when one group of the axis
    (its size times the sizes of the axes inside it, row-major device order) fits
    in ``hw.devices_per_node`` devices."""
    names = [n for n, _ in mesh_axes]
    sizes = dict(mesh_axes)
    parts = axis if isinstance(axis, tuple) else (axis,)
    if not all(p in sizes for p in parts):
        return hw.inter_node
    first = min(names.index(p) for p in parts)
    span = math.prod(s for n, s in mesh_axes[first:])
    return hw.intra_node if span <= hw.devices_per_node else hw.inter_node


def predict(hw, precision: str, flops: float, bytes_accessed: float, per_axis: dict,
            mesh_axes) -> dict:
    """A step's predicted seconds on ``hw``.

    Args:
      hw: a :class:`trjax.hardware.Hardware`.
      precision: the config's precision (peak FLOP/s by precision).
      flops: FLOPs per device per step (:func:`jaxpr_flops`).
      bytes_accessed: bytes per device per step (XLA's ``bytes accessed`` times
        the loop factor).
      per_axis: :func:`trjax.comm.by_axis` of the compiled step: per axis the
        collectives issued per step (``count``) and the bytes a ring sends
        (``sent_bytes``), trip counts included.
      mesh_axes: the world's ``((name, size), ...)``.

    Returns:
      ``{"compute_s": flops / peak, "memory_s": bytes / bandwidth, "roofline_s"
      (their max, or sum for ``hw.roofline == "sum"``), "comm_s": {axis: count x
      latency + sent / bandwidth}, "step_s": roofline_s + all comm_s}``: the
      collectives are not assumed to overlap compute (an upper bound on what
      XLA's scheduler hides).
    """
    compute = flops / hw.flops(precision)
    memory = bytes_accessed / hw.memory_bytes_per_s
    roof = compute + memory if hw.roofline == "sum" else max(compute, memory)
    comm = {}
    for axis, row in per_axis.items():
        if axis is None or not row["count"]:
            continue
        link = axis_link(axis, tuple(mesh_axes), hw)
        name = "+".join(axis) if isinstance(axis, tuple) else str(axis)
        comm[name] = row["count"] * link.latency_s + row["sent_bytes"] / link.bytes_per_s
    return {"compute_s": compute, "memory_s": memory, "roofline_s": roof, "comm_s": comm,
            "step_s": roof + sum(comm.values())}


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equally long sequences (ties by average
    rank), e.g. predicted against measured step times."""
    ra, rb = (_ranks(np.asarray(x, float)) for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / den) if den else 0.0


def _ranks(x):
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x), float)
    r[order] = np.arange(len(x))
    for v in np.unique(x):  # ties: the average rank
        r[x == v] = r[x == v].mean()
    return r
