"""Reading the collectives out of a compiled (post-optimisation) HLO module.

What runs on the devices is what XLA scheduled, not what the Python program
asked for: passes such as the all-reduce combiner merge, split or reorder
collectives. :func:`collectives_in_hlo` lists every collective of the entry
computation in schedule order, with its operands' element counts and bytes;
:func:`label_collectives` names what each operand carries by matching the
MemoryPlan's buffer sizes.

:func:`axis_of` attributes a collective to the mesh axes its device groups
span, :func:`trip_counts` gives how often each loop body runs, and
:func:`by_axis` totals the issued collectives and bytes per axis; the byte
models :func:`pipeline_bytes`, :func:`tensor_bytes` and :func:`data_bytes`
(GPipe's, Huang et al. 2019, arXiv:1811.06965; Megatron's, Shoeybi et al.
2019, arXiv:1909.08053; the ring all-reduce's, below) are there to compare
with (docs/parallelism.md).

The traffic model is the ring all-reduce's: each rank sends (and receives)
``2 (N-1) / N * |g|`` bytes for a buffer of ``|g|`` bytes over N ranks
(reduce-scatter then all-gather; Patarasuk & Yuan 2009, as used by NCCL).
"""

from __future__ import annotations

import math
import re

import numpy as np


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


# -- device groups and loop trip counts ------------------------------------------------------
# HLO text syntax (xla/hlo/ir/hlo_instruction.cc, collective_device_list.cc): an explicit list
# ``replica_groups={{0,2},{1,3}}`` (``{}``: one group of every participant), or the iota form
# IotaReplicaGroupList prints, ``replica_groups=[G,N]<=[d0,d1,...]`` optionally followed by
# ``T(p0,p1,...)``; ``source_target_pairs={{0,1},{2,3}}`` for collective-permute.
_GROUP_LIST = re.compile(r"\breplica_groups=\{((?:\s*\{[\d,\s]*\}\s*,?)*)\}")
_GROUP_IOTA = re.compile(r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUP_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"\bsource_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\}")
_BRACED = re.compile(r"\{([\d,\s]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_WHILE_PARTS = re.compile(r"\b(body|condition)=%?([\w.\-]+)")


def iota_groups(group_dims, reshape_dims, transpose_perm=None) -> list[list[int]]:
    """The groups of XLA's iota replica-group list ``[G,N]<=[reshape_dims]T(perm)``:
    ``iota(prod(reshape_dims)).reshape(reshape_dims).transpose(perm).reshape(G, N)``,
    row g the ids of group g (IotaReplicaGroupList / IotaTileAssignment, XLA
    ``hlo/ir/collective_device_list.h``, ``tile_assignment.h``).

    >>> iota_groups([2, 2], [2, 2], [1, 0])
    [[0, 2], [1, 3]]
    """
    ids = np.arange(math.prod(reshape_dims)).reshape(tuple(reshape_dims))
    if transpose_perm is not None:
        ids = ids.transpose(tuple(transpose_perm))
    return ids.reshape(tuple(group_dims)).tolist()


def mesh_groups(axes, reduced) -> list[list[int]]:
    """The groups of XLA's mesh-axes replica-group form (jaxlib >= 0.12 prints
    ``replica_groups=mesh['data'=2,'model'=2] {'data'}``): over a row-major mesh
    of ``axes`` (``[(name, size)]``, outermost first), each group holds the ids
    that differ only in the ``reduced`` axes' coordinates.

    >>> mesh_groups([("data", 2), ("model", 2)], ["data"])
    [[0, 2], [1, 3]]
    """
    names = [n for n, _ in axes]
    ids = np.arange(math.prod(k for _, k in axes)).reshape(tuple(k for _, k in axes))
    keep = [i for i, n in enumerate(names) if n not in reduced]
    red = [names.index(n) for n in reduced]
    size = math.prod(axes[i][1] for i in red)
    return ids.transpose(keep + red).reshape(-1, size).tolist()


def device_groups(attributes: str) -> dict:
    """The device groups in one collective instruction's attribute text.

    Returns ``{"groups", "pairs", "channel_id", "use_global_device_ids"}``:
    ``groups`` a list of id lists from ``replica_groups`` (explicit or iota
    form; ``[]`` for ``replica_groups={}``, i.e. one group of all
    participants; None where the attribute is absent); ``pairs`` a list of
    ``[source, target]`` from ``source_target_pairs`` (None if absent);
    ``groups`` also from jaxlib 0.12's mesh-axes form (:func:`mesh_groups`);
    ``channel_id`` an int or None.

    What the ids mean (XLA's CollectiveOpGroupMode): with ``channel_id`` and
    ``use_global_device_ids=true`` they are flattened ids ``replica *
    num_partitions + partition``; with ``channel_id`` alone, partition ids;
    with neither, replica ids. A jitted ``shard_map`` program is one replica
    of N partitions, so in every case they are the *logical* ids 0..N-1, the
    positions in the executable's device assignment (= ``mesh.devices.flat``),
    not ``device.id``. XLA:CPU (jax 0.10.2) prints shard_map's psum /
    psum_scatter / all_gather with ``channel_id=1 ... use_global_device_ids=true``
    and explicit lists, all_to_all and ppermute with ``channel_id`` only.
    """
    out = {"groups": None, "pairs": None, "channel_id": None,
           "use_global_device_ids": "use_global_device_ids=true" in attributes}
    if (m := _GROUP_MESH.search(attributes)) is not None:
        axes = [(a.split("=")[0].strip().strip("'\""), int(a.split("=")[1]))
                for a in m.group(1).split(",") if "=" in a]
        reduced = [r.strip().strip("'\"") for r in m.group(2).split(",") if r.strip()]
        out["groups"] = mesh_groups(axes, reduced)
    elif (m := _GROUP_IOTA.search(attributes)) is not None:
        ints = [None if s is None else [int(v) for v in s.split(",")] for s in m.groups()]
        out["groups"] = iota_groups(*ints)
    elif (m := _GROUP_LIST.search(attributes)) is not None:
        out["groups"] = [[int(v) for v in g.replace(" ", "").split(",") if v]
                         for g in _BRACED.findall(m.group(1))]
    if (m := _PAIRS.search(attributes)) is not None:
        out["pairs"] = [[int(v) for v in p.replace(" ", "").split(",")]
                        for p in _BRACED.findall(m.group(1))]
    if (m := _CHANNEL.search(attributes)) is not None:
        out["channel_id"] = int(m.group(1))
    return out


def trip_counts(hlo_or_comps) -> dict[str, int | None]:
    """``{computation: times it runs per execution of the module}``.

    ``"ENTRY"`` runs once; a while body ``n`` times per run of the computation
    holding the ``while`` (its condition ``n + 1``), where ``n`` is XLA's
    ``backend_config={..."known_trip_count":{"n":"4"}...}`` on the ``while``
    (printed by XLA:CPU for ``lax.scan`` / ``fori_loop`` loops; None where the
    loop has no known count); conditional branches and inline callees
    (fusions, calls, async wrappers) once per run of their caller (a branch:
    at most once). Nested loops multiply; a computation called from several
    places sums. Accepts the HLO text or :func:`computations`'s dict.
    """
    comps = computations(hlo_or_comps) if isinstance(hlo_or_comps, str) else hlo_or_comps
    callers: dict[str, list[tuple[str, int | None]]] = {}
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            if m.group(3) == "while":
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else None
                for part, callee in _WHILE_PARTS.findall(m.group(4)):
                    mult = n if (n is None or part == "body") else n + 1
                    callers.setdefault(callee, []).append((name, mult))
                continue
            for a, b in _LOOP_CALLS.findall(m.group(4)):  # conditional branches
                for callee in [a] if a else [x.strip().lstrip("%") for x in b.split(",")]:
                    callers.setdefault(callee, []).append((name, 1))
            for callee in _INLINE_CALLS.findall(m.group(4)):
                callers.setdefault(callee, []).append((name, 1))
    memo: dict[str, int | None] = {"ENTRY": 1}

    def count(name, depth=0):
        if name not in memo:
            memo[name] = None  # cycles (malformed text) and depth: unknown
            if depth < 64:
                total = 0
                for caller, mult in callers.get(name, ()):
                    c = count(caller, depth + 1)
                    if c is None or mult is None:
                        total = None
                        break
                    total += c * mult
                memo[name] = total
        return memo[name]
    return {name: count(name) for name in comps}


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
      "bytes"}], "elements", "bytes", "trip_count", "groups", "pairs",
      "channel_id", "use_global_device_ids"}]``. ``kind`` is the collective without
      ``-start``; ``position`` is the instruction index in ``computation``
      (``"ENTRY"`` or a loop body) where it starts, ``done_position`` where
      an async one completes (else equal); ``via`` names the fusion or async
      computation it sits in (None at top level). The operands are the
      collective's result: for an async pair the ``-done``'s type.
      ``trip_count`` is how many times ``computation`` runs per execution
      (:func:`trip_counts`: 1 for ``"ENTRY"``, the product of the enclosing
      while loops' known trip counts, None where one is unknown); the last
      four are :func:`device_groups`'s.
    """
    if hlo_text is None:
        return None
    comps = computations(hlo_text)
    wrapped = {callee for lines in comps.values() for line in lines
               if (m := _INSTR.match(line)) and m.group(3) == "async-start"
               for callee in _INLINE_CALLS.findall(m.group(4))}
    trips = trip_counts(comps)
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
                              "operands": _operands(m.group(2)),
                              **device_groups(m.group(4))})
            elif op == "async-start":
                inner = _wrapped_collective(comps, m.group(4))
                if inner is not None:
                    found.append({"name": name, "kind": inner[0], "async": True,
                                  "position": pos, "done_position": pos, "computation": root,
                                  "via": via, "operands": _operands(inner[1]),
                                  **device_groups(inner[2])})
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
            c["trip_count"] = trips.get(root)
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
    """For an ``async-start``'s argument text: ``(kind, result type, argument
    text)`` of the collective its ``calls=`` computation wraps, or None."""
    for callee in _INLINE_CALLS.findall(args):
        for line in comps.get(callee, ()):
            m = _INSTR.match(line)
            if m and m.group(3) in COLLECTIVES:
                return m.group(3), m.group(2), m.group(4)
    return None


# -- mesh axes ---------------------------------------------------------------------------------


def _axes_value(names, axes):
    axes = [names[i] for i in sorted(axes)]
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def axis_of(collective: dict, mesh) -> str | tuple[str, ...] | None:
    """The mesh axis (or axes, in mesh order) a compiled collective runs over.

    Logical id ``i`` in the HLO (:func:`device_groups`) is the device at
    ``np.unravel_index(i, mesh.devices.shape)`` (``mesh.devices.flat`` is the
    executable's device assignment). A group over axes A holds the devices that
    differ only in A's coordinates: the groups must be exactly those slabs
    (``psum(x, "data")`` on data:2,stage:2 is ``{{0,2},{1,3}}`` -> ``"data"``;
    ``psum(x, ("data","stage"))`` is ``{{0,1,2,3}}`` -> ``("data","stage")``).
    ``replica_groups={}`` is one group of all devices. For a collective-permute,
    the axes along which some pair's source and target differ.

    Args:
      collective: a dict of :func:`collectives_in_hlo` (``groups``, ``pairs``).
      mesh: the ``jax.sharding.Mesh`` the program was compiled for.

    Returns:
      an axis name, a tuple of names, or None: no groups or pairs, only
      single-device groups (or self-pairs), or groups that are not the slabs
      of any set of axes.

    Raises:
      ValueError: an id outside ``0 .. mesh.size - 1``.
    """
    shape, names = mesh.devices.shape, tuple(mesh.axis_names)
    size = math.prod(shape)
    pairs, groups = collective.get("pairs"), collective.get("groups")
    if pairs is not None:
        ids = [i for p in pairs for i in p]
    elif groups is not None:
        groups = groups or [list(range(size))]
        ids = [i for g in groups for i in g]
    else:
        return None
    if any(i < 0 or i >= size for i in ids):
        raise ValueError(f"collective {collective.get('name')!r}: device id outside 0..{size - 1} "
                         f"of a mesh of shape {dict(zip(names, shape))}")
    coord = lambda i: np.unravel_index(i, shape)  # noqa: E731
    if pairs is not None:
        return _axes_value(names, {a for s, t in pairs for a in range(len(shape))
                                   if coord(s)[a] != coord(t)[a]})
    axes = {a for g in groups for i in g for a in range(len(shape))
            if coord(i)[a] != coord(g[0])[a]}
    # the slabs over `axes`: devices with equal coordinates on every other axis
    slabs: dict[tuple, set] = {}
    for i in range(size):
        slabs.setdefault(tuple(c for a, c in enumerate(coord(i)) if a not in axes), set()).add(i)
    if sorted(map(sorted, slabs.values())) != sorted(map(sorted, groups)):
        return None
    return _axes_value(names, axes)


def sent_bytes(collective: dict, mesh_size: int) -> float:
    """Bytes one device sends for one issue of a compiled collective under the
    bandwidth-optimal (ring) algorithms, from its result bytes ``b``
    (:func:`collectives_in_hlo`'s ``"bytes"``) over groups of ``n`` devices:
    all-reduce ``2 (n-1)/n * b`` (:func:`ring_traffic_bytes`); all-gather and
    all-to-all ``(n-1)/n * b`` (every chunk but its own); reduce-scatter
    ``(n-1) * b`` (its input is ``n * b``); collective-permute ``b`` (what a
    source sends). ``n`` is the first group's size (``replica_groups={}``:
    ``mesh_size``)."""
    b, kind = collective["bytes"], collective["kind"]
    if kind == "collective-permute" or collective.get("groups") is None:
        return float(b)
    n = len(collective["groups"][0]) if collective["groups"] else mesh_size
    if kind == "all-reduce":
        return ring_traffic_bytes(b, n)
    if kind == "reduce-scatter":
        return float((n - 1) * b)
    return (n - 1) / n * b


def by_axis(collectives: list[dict], mesh) -> dict:
    """Collectives grouped by :func:`axis_of`, with what one step issues.

    Returns ``{axis: {"count", "bytes", "sent_bytes", "collectives"}}`` (axis as
    :func:`axis_of` gives it, None for unattributed ones): ``count`` the number
    issued per execution (each collective times its ``trip_count``),
    ``bytes`` the sum of its result bytes (``"bytes"`` of
    :func:`collectives_in_hlo`: the local buffer on one device; an all-gather's
    gathered, a reduce-scatter's scattered result) times ``trip_count``, per
    device program; ``sent_bytes`` the same with each collective's
    :func:`sent_bytes` (what a ring sends) instead of its result bytes;
    ``collectives`` the list in :func:`collectives_in_hlo`'s
    order. A collective with an unknown ``trip_count`` counts once and is
    flagged in ``"unknown_trip_counts"`` (the number of them).

    These are *issued* counts: a GPipe loop's permutes run M+S-1 times per
    direction and boundary, M of them carrying micro-batches
    (:func:`pipeline_bytes` is the useful model), and in a permute with one
    pair per group only the source device sends. Collectives in conditional
    branches count at their caller's rate, every branch: for the pipeline's
    ``lax.switch`` over the stage index that is the sum over all stages'
    branches, while one device runs only its own stage's.
    """
    out: dict = {}
    size = math.prod(mesh.devices.shape)
    for c in collectives:
        row = out.setdefault(axis_of(c, mesh), {"count": 0, "bytes": 0, "sent_bytes": 0.0,
                                                "collectives": [], "unknown_trip_counts": 0})
        trip = c.get("trip_count")
        row["unknown_trip_counts"] += trip is None
        trip = 1 if trip is None else trip
        row["count"] += trip
        row["bytes"] += c["bytes"] * trip
        row["sent_bytes"] += sent_bytes(c, size) * trip
        row["collectives"].append(c)
    return out


# -- byte models (GPipe, Megatron, ring all-reduce) -------------------------------------------------


def pipeline_bytes(num_microbatches: int, micro_batch: int, boundary_shapes, itemsize: int) -> int:
    """Useful point-to-point bytes of one GPipe step, per data replica's pipeline.

    ``sum_b 2 * M * mu * |a_b| * itemsize``: at each stage boundary b each of M
    micro-batches of ``mu`` rows sends its activation forward and its cotangent
    backward, one sender per pair, so no ring factor (GPipe, Huang et al. 2019,
    arXiv:1811.06965).

    Args:
      num_microbatches: M.
      micro_batch: mu, rows per micro-batch.
      boundary_shapes: per boundary, one example's activation shape
        (``(H, W, C)``); S-1 of them.
      itemsize: bytes per element of the boundary dtype.

    Returns:
      bytes (int).
    """
    return sum(2 * num_microbatches * micro_batch * math.prod(s) * itemsize
               for s in boundary_shapes)


def tensor_bytes(batch: int, pairs, num_ranks: int, itemsize: int, heads=()) -> dict:
    """Bytes of one tensor-parallel rank's collectives in one forward and backward
    of ``batch`` rows (Megatron in shard_map, :mod:`trjax.parallel.mappings`).

    Per column->row pair (Shoeybi et al. 2019, ``megatron/core/tensor_parallel/
    mappings.py``): the forward all-reduce ``g`` of the row-parallel output,
    ``B*|o|`` elements, and the backward all-reduce ``f`` of the column-parallel
    input's cotangent, ``B*|i|``. Per head (a column layer no row layer follows,
    e.g. the classifier): the forward all-gather of its output, ``B*|y|``
    elements gathered, and the backward ``f`` of its input's cotangent,
    ``B*|x|``; the gather's backward is this rank's slice of the cotangent, no
    collective (so no reduce-scatter).

    In result bytes (what :func:`by_axis` counts: an all-reduce's buffer, an
    all-gather's gathered result): ``g = sum B|o|``, ``f = sum B|i| + sum B|x|``,
    ``gather = sum B|y|`` (times ``itemsize``). What a ring sends
    (:func:`sent_bytes`): ``2 (T-1)/T * (g + f) + (T-1)/T * gather``.

    Args:
      batch: B, rows per tensor-parallel group and pass (the local batch of a
        data rank; a pipeline's micro-batch).
      pairs: per pair ``(out_shape, in_shape)``, one example's shapes
        ``(H, W, C_b)`` of the row-parallel output and ``(H, W, C_a)`` of the
        column-parallel input.
      num_ranks: T, the model axis size.
      itemsize: bytes per activation element.
      heads: per head ``(out_shape, in_shape)`` of one example (a classifier:
        ``((K,), (C,))``).

    Returns:
      ring bytes ``{"forward": 2(T-1)/T g + (T-1)/T gather, "backward":
      2(T-1)/T f, "head": the heads' part of both, "total"}`` (floats) and result
      bytes ``{"g", "f", "gather", "issued": g + f + gather}`` (ints).
    """
    per = lambda shapes: sum(batch * math.prod(s) * itemsize for s in shapes)  # noqa: E731
    g, f_pairs = per(o for o, _ in pairs), per(i for _, i in pairs)
    gather, f_heads = per(y for y, _ in heads), per(x for _, x in heads)
    fwd = tensor_sent(g, 0, gather, num_ranks)
    bwd = tensor_sent(0, f_pairs + f_heads, 0, num_ranks)
    return {"forward": fwd, "backward": bwd, "head": tensor_sent(0, f_heads, gather, num_ranks),
            "total": fwd + bwd, "g": g, "f": f_pairs + f_heads, "gather": gather,
            "issued": g + f_pairs + f_heads + gather}


def tensor_sent(g: float, f: float, gather: float, num_ranks: int) -> float:
    """What a ring sends for Megatron's collectives of ``g`` + ``f`` all-reduced and
    ``gather`` all-gathered result bytes over T = ``num_ranks``:
    ``2 (T-1)/T (g + f) + (T-1)/T gather`` (:func:`tensor_bytes`)."""
    return ring_traffic_bytes(g + f, num_ranks) + (num_ranks - 1) / num_ranks * gather


def data_bytes(grad_bytes: int, num_ranks: int) -> float:
    """Bytes each data rank sends for the gradient all-reduce: ``2 (N-1)/N * |g|``
    (:func:`ring_traffic_bytes`); N = D for the stage-owned, FSDP and
    tensor-parallel buckets (each device's slices, over ``data`` only)."""
    return ring_traffic_bytes(grad_bytes, num_ranks)


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


_REF = re.compile(r"%([\w.\-]+)")


def depends_on(hlo_text: str | None, later, earlier) -> bool | None:
    """Whether an entry instruction at a position in ``later`` uses, directly
    or through other entry instructions, one at a position in ``earlier``
    (positions as :func:`conv_positions` and :func:`collectives_in_hlo` give
    them). A data dependency is the one order XLA's scheduler must keep; any
    other order is its choice. None for no text."""
    if hlo_text is None:
        return None
    lines = [(m.group(1), m.group(4)) if m else ("", "")
             for m in map(_INSTR.match, entry_lines(hlo_text))]  # positions count every line
    index = {name: i for i, (name, _) in enumerate(lines) if name}
    target, seen = set(earlier), set()
    todo = [i for i in later if i < len(lines)]
    while todo:
        i = todo.pop()
        for ref in _REF.findall(lines[i][1]):
            j = index.get(ref)
            if j is None or j in seen:
                continue
            if j in target:
                return True
            seen.add(j)
            todo.append(j)
    return False


def label_collectives(collectives: list[dict], labels_by_elements: dict[int, str]) -> list[dict]:
    """Adds ``"carries"``: one label per operand, from its element count
    (``"other"`` when no plan buffer has that size)."""
    for c in collectives:
        c["carries"] = [labels_by_elements.get(o["elements"], "other") for o in c["operands"]]
    return collectives
