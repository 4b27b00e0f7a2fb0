"""Reading the collectives out of a compiled (post-optimisation) HLO module.

What runs on the devices is what XLA scheduled, not what the Python program
asked for: passes such as the all-reduce combiner merge, split or reorder
collectives. :func:`collectives_in_hlo` lists every collective of the entry
computation in schedule order, with its operands' element counts and bytes;
:func:`label_collectives` names what each operand carries by matching the
MemoryPlan's buffer sizes.

The traffic model is the ring all-reduce's: each rank sends (and receives)
``2 (N-1) / N * |g|`` bytes for a buffer of ``|g|`` bytes over N ranks
(reduce-scatter then all-gather; Patarasuk & Yuan 2009, as used by NCCL).
"""

from __future__ import annotations

import math
import re

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-reduce-start", "reduce-scatter", "all-gather",
                  "all-gather-start", "collective-permute", "collective-permute-start",
                  "all-to-all")
_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
                "s8": 1, "u8": 1, "pred": 1, "s16": 2, "u16": 2}
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def ring_traffic_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N * nbytes."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def entry_lines(hlo_text: str) -> list[str]:
    """The instruction lines of the entry computation, in (schedule) order."""
    lines = hlo_text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    out = []
    for l in lines[start + 1:]:
        if l.startswith("}"):
            break
        out.append(l)
    return out


def _shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_str)]


def collectives_in_hlo(hlo_text: str) -> list[dict]:
    """Every collective of the entry computation, in schedule order.

    Returns:
      ``[{"name", "kind", "position", "operands": [{"dtype", "shape",
      "elements", "bytes"}], "elements", "bytes"}]``; ``position`` is the
      instruction index in the (scheduled) entry computation.
    """
    out = []
    for pos, line in enumerate(entry_lines(hlo_text)):
        m = _INSTR.match(line)
        if not m or m.group(3) not in COLLECTIVE_OPS:
            continue
        ops = [{"dtype": dt, "shape": list(shape), "elements": math.prod(shape),
                "bytes": math.prod(shape) * _DTYPE_BYTES.get(dt, 4)} for dt, shape in _shapes(m.group(2))]
        out.append({"name": m.group(1), "kind": m.group(3).replace("-start", ""), "position": pos,
                    "operands": ops, "elements": sum(o["elements"] for o in ops),
                    "bytes": sum(o["bytes"] for o in ops)})
    return out


def conv_positions(hlo_text: str, kernel_shape) -> list[int]:
    """Schedule positions of convolutions whose output has the dims of
    ``kernel_shape`` in any order: the weight-gradient convs of that kernel."""
    want = sorted(kernel_shape)
    pos = []
    for i, line in enumerate(entry_lines(hlo_text)):
        m = _INSTR.match(line)
        if m and m.group(3) == "convolution":
            shapes = _shapes(m.group(2))
            if len(shapes) == 1 and sorted(shapes[0][1]) == want:
                pos.append(i)
    return pos


def label_collectives(collectives: list[dict], labels_by_elements: dict[int, str]) -> list[dict]:
    """Adds ``"carries"``: one label per operand, from its element count
    (``"other"`` when no plan buffer has that size)."""
    for c in collectives:
        c["carries"] = [labels_by_elements.get(o["elements"], "other") for o in c["operands"]]
    return collectives
