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


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all",
               "ragged-all-to-all", "collective-broadcast")
# synchronous ops, and the dedicated async pairs XLA:GPU schedules (``X-start`` ... ``X-done``)
COLLECTIVE_OPS = COLLECTIVES + tuple(f"{k}-start" for k in COLLECTIVES)
_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
                "s8": 1, "u8": 1, "pred": 1, "s16": 2, "u16": 2}
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
# computations an instruction runs in its own place in the schedule (fusions, async
# wrappers, calls, command buffers); while bodies and conditional branches run elsewhere
_INLINE_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_LOOP_CALLS = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%?([\w.\-]+)"
                         r"|\bbranch_computations=\{([^}]*)\}")


def ring_traffic_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N * nbytes."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def hlo_text(compiled) -> str | None:
    """``compiled.as_text()``, or None where the backend gives no text (some
    PJRT plugins return None or raise): callers report "unavailable" instead
    of failing."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 -- any backend error means: no text
        return None
    return text if isinstance(text, str) and "ENTRY" in text else None


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{name: instruction lines}`` of every computation of an HLO module, in
    (schedule) order; the entry computation is ``"ENTRY"``. A computation
    starts at an unindented line ending in ``{`` (``ENTRY %main ... {``,
    ``%fused_computation.3 (p: f32[8]) -> f32[8] {``; the ``%`` is optional)."""
    out, name = {}, None
    for line in hlo_text.splitlines():
        if name is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{") \
                    and not line.startswith("HloModule"):
                words = line.split()
                name = "ENTRY" if words[0] == "ENTRY" else words[0].lstrip("%")
                out[name] = []
        elif line.startswith("}"):
            name = None
        else:
            out[name].append(line)
    return out


def entry_lines(hlo_text: str) -> list[str]:
    """The instruction lines of the entry computation, in (schedule) order."""
    return computations(hlo_text)["ENTRY"]


def _shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_str)]


def _flatten(comps: dict[str, list[str]], root: str):
    """Yields ``(position, computation, via, match)`` for every instruction of
    ``root`` and, at the position of the instruction that calls them, of the
    computations it runs inline (fusions, async wrappers, calls): ``via`` is
    the called computation's name (None for ``root``'s own instructions)."""
    def walk(name, pos, via, depth):
        for i, line in enumerate(comps.get(name, ())):
            m = _INSTR.match(line)
            if not m:
                continue
            here = i if pos is None else pos
            yield here, name, via, m
            if depth < 8 and m.group(3) not in COLLECTIVE_OPS:  # not a reduction's to_apply
                for callee in _INLINE_CALLS.findall(m.group(4)):
                    if callee in comps:
                        yield from walk(callee, here, callee, depth + 1)
    yield from walk(root, None, None, 0)


def _operands(type_str: str) -> list[dict]:
    return [{"dtype": dt, "shape": list(shape), "elements": math.prod(shape),
             "bytes": math.prod(shape) * _DTYPE_BYTES.get(dt, 4)}
            for dt, shape in _shapes(type_str)]


def collectives_in_hlo(hlo_text: str | None, nested: bool = True) -> list[dict] | None:
    """Every collective of the compiled module, in schedule order.

    Covers the forms XLA prints (HLO text syntax, ``xla/hlo/ir``):

    * synchronous ops: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
      ``collective-permute``, ``all-to-all`` (XLA:CPU);
    * async pairs: ``all-reduce-start`` ... ``all-reduce-done`` (likewise
      ``all-gather``, ``collective-permute``; XLA:GPU), and the generic
      ``async-start(...), calls=%comp`` ... ``async-done`` whose computation
      holds the collective (``reduce-scatter``, ``all-to-all`` on GPU, also
      printed as ``reduce-scatter-start``);
    * collectives inside fusions, calls and command buffers, placed at the
      position of the instruction that runs them.

    Args:
      hlo_text: ``Compiled.as_text()``; None (a backend that gives no text)
        returns None.
      nested: also list collectives in while bodies and conditional branches
        (e.g. a ring all-reduce's ``collective-permute`` steps), with their
        position inside that computation.

    Returns:
      ``[{"name", "kind", "async", "position", "done_position",
      "computation", "via", "operands": [{"dtype", "shape", "elements",
      "bytes"}], "elements", "bytes"}]``. ``kind`` is the collective without
      ``-start``; ``position`` is the instruction index in ``computation``
      (``"ENTRY"`` or a loop body) where it starts, ``done_position`` where
      an async one completes (else equal); ``via`` names the fusion or async
      computation it sits in (None at top level). The operands are the
      collective's result: for an async pair the ``-done``'s type.
    """
    if hlo_text is None:
        return None
    comps = computations(hlo_text)
    wrapped = {callee for lines in comps.values() for line in lines
               if (m := _INSTR.match(line)) and m.group(3) == "async-start"
               for callee in _INLINE_CALLS.findall(m.group(4))}
    out = []

    def scan(root):
        found, dones = [], []
        for pos, comp, via, m in _flatten(comps, root):
            op, name = m.group(3), m.group(1)
            if op in COLLECTIVES and via in wrapped:
                continue  # reported at its async-start
            if op in COLLECTIVE_OPS:
                kind = op[:-len("-start")] if op.endswith("-start") else op
                found.append({"name": name, "kind": kind, "async": op.endswith("-start"),
                              "position": pos, "done_position": pos,
                              "computation": root, "via": via,
                              "operands": _operands(m.group(2))})
            elif op == "async-start":
                inner = _wrapped_collective(comps, m.group(4))
                if inner is not None:
                    found.append({"name": name, "kind": inner[0], "async": True,
                                  "position": pos, "done_position": pos, "computation": root,
                                  "via": via, "operands": _operands(inner[1])})
            elif op.endswith("-done") or op == "async-done":
                dones.append((pos, m))
        for pos, m in dones:  # pair each done with its start (named in its operands)
            for c in found:
                if c["async"] and re.search(r"(?<![\w.\-])" + re.escape(c["name"]) +
                                            r"(?![\w.\-])", m.group(4)):
                    c["done_position"] = pos
                    c["operands"] = _operands(m.group(2)) or c["operands"]
                    break
        for c in found:
            c["elements"] = sum(o["elements"] for o in c["operands"])
            c["bytes"] = sum(o["bytes"] for o in c["operands"])
        out.extend(found)

    scan("ENTRY")
    if nested:
        loops = set()
        for lines in comps.values():
            for line in lines:
                for a, b in _LOOP_CALLS.findall(line):
                    loops.update([a] if a else [x.strip().lstrip("%") for x in b.split(",")])
        for name in comps:
            if name in loops:
                scan(name)
    return out


def _wrapped_collective(comps, args: str):
    """For an ``async-start``'s argument text: ``(kind, result type)`` of the
    collective its ``calls=`` computation wraps, or None."""
    for callee in _INLINE_CALLS.findall(args):
        for line in comps.get(callee, ()):
            m = _INSTR.match(line)
            if m and m.group(3) in COLLECTIVES:
                return m.group(3), m.group(2)
    return None


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


def conv_positions(hlo_text: str | None, kernel_shape) -> list[int] | None:
    """Entry schedule positions of the weight-gradient convolutions of a kernel
    of ``kernel_shape``: convolutions whose result has its dims in any order,
    as XLA:CPU's ``convolution`` or XLA:GPU's cuDNN ``custom-call``
    (``__cudnn$convBackwardFilter``, result ``(kernel, scratch)``), also
    inside fusions (the calling instruction's position). None for no text."""
    if hlo_text is None:
        return None
    want = sorted(kernel_shape)
    pos = []
    for i, _, _, m in _flatten(computations(hlo_text), "ENTRY"):
        op, rest = m.group(3), m.group(4)
        conv = op == "convolution" or (op == "custom-call" and "__cudnn$conv" in rest)
        shapes = _shapes(m.group(2))
        if conv and shapes and sorted(shapes[0][1]) == want and i not in pos:
            pos.append(i)
    return pos


def label_collectives(collectives: list[dict], labels_by_elements: dict[int, str]) -> list[dict]:
    """Adds ``"carries"``: one label per operand, from its element count
    (``"other"`` when no plan buffer has that size)."""
    for c in collectives:
        c["carries"] = [labels_by_elements.get(o["elements"], "other") for o in c["operands"]]
    return collectives
