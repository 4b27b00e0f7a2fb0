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


def collectives_in_hlo(hlo_text: str, nested: bool = True) -> list[dict]:
    """Every collective of the compiled module: the entry computation in
    schedule order, then (``nested``) those inside called computations such
    as while-loop bodies (a ring all-reduce's ``collective-permute`` steps).

    Returns:
      ``[{"name", "kind", "position", "computation", "operands": [{"dtype",
      "shape", "elements", "bytes"}], "elements", "bytes"}]``; ``position`` is
      the instruction index in its (scheduled) computation.
    """
    out = []

    def scan(lines, computation):
        for pos, line in enumerate(lines):
            m = _INSTR.match(line)
            if not m or m.group(3) not in COLLECTIVE_OPS:
                continue
            ops = [{"dtype": dt, "shape": list(shape), "elements": math.prod(shape),
                    "bytes": math.prod(shape) * _DTYPE_BYTES.get(dt, 4)}
                   for dt, shape in _shapes(m.group(2))]
            out.append({"name": m.group(1), "kind": m.group(3).replace("-start", ""),
                        "position": pos, "computation": computation, "operands": ops,
                        "elements": sum(o["elements"] for o in ops),
                        "bytes": sum(o["bytes"] for o in ops)})

    scan(entry_lines(hlo_text), "ENTRY")
    if nested:
        name, body = None, []
        for line in hlo_text.splitlines():
            if line.startswith("%") and line.rstrip().endswith("{"):
                name, body = line.split()[0].lstrip("%"), []
            elif line.startswith("}") and name is not None:
                if not name.startswith("fused_computation"):
                    scan(body, name)
                name = None
            elif name is not None:
                body.append(line)
    return out


_MLIR_DTYPES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "ui32": 4, "i64": 8, "ui64": 8,
                "i8": 1, "ui8": 1, "i1": 1, "i16": 2, "ui16": 2}
_MLIR_OP = re.compile(r'"?stablehlo\.(all_reduce|reduce_scatter|all_gather|collective_permute|all_to_all)"?')
_TENSOR = re.compile(r"tensor<([\dx]*?)x?([a-z]+\d*)>")


def requested_collectives(lowered_text: str) -> list[dict]:
    """Collectives as the program asked for them (StableHLO, before XLA's passes).

    XLA may change a collective's dtype when compiling (XLA:CPU runs a bf16
    all-reduce in float32), so the bytes a program *requests* can differ from
    :func:`collectives_in_hlo`'s compiled bytes. Returns ``[{"kind",
    "operands": [{"dtype", "elements", "bytes"}], "bytes"}]`` in program order.
    """
    out = []
    for m in _MLIR_OP.finditer(lowered_text):
        end = lowered_text.find(") -> ", m.end())
        seg = lowered_text[m.end():end]
        types = seg[seg.rfind(": (") + 3:] if ": (" in seg else seg
        ops = []
        for dims, dt in _TENSOR.findall(types):
            n = math.prod(int(d) for d in dims.split("x") if d) if dims else 1
            ops.append({"dtype": dt, "elements": n, "bytes": n * _MLIR_DTYPES.get(dt, 4)})
        out.append({"kind": m.group(1).replace("_", "-"), "operands": ops,
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
