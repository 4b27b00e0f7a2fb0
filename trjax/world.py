"""The world: which devices take part, the mesh over them, and the batch split.

The seed framework configures data parallelism with two calls,
``use_gpu("0-3")`` (world size) and ``global_batch_size(128)`` (local batch =
global / world size, an error when it does not divide). :func:`make_world` is
the JAX equivalent: it parses a device spec, checks the batch split and builds
a one-axis :class:`jax.sharding.Mesh` named ``"data"``. Every check runs on
plain Python values, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
"""The default name of the mesh's data axis (:func:`make_world`); code inside
trjax reads the name from ``World.axis_name``."""

FSDP_AXIS = "fsdp"
STAGE_AXIS = "stage"
MODEL_AXIS = "model"

MESH_AXES = (DATA_AXIS, FSDP_AXIS, STAGE_AXIS, MODEL_AXIS)
"""The table of mesh axis names, the one place they are spelled (every module
imports them from here). A multi-axis mesh (:func:`parse_mesh`) uses them in
the order they must appear: ``data`` (outermost: the batch split and the gradient
all-reduce), ``fsdp`` (the batch split too, and the parameters, gradients and
optimizer state sharded over it: :mod:`trjax.parallel.fsdp`), ``stage``
(pipeline stages, :mod:`trjax.parallel.pipeline`), ``model`` (tensor
parallelism, :mod:`trjax.parallel.tensor`). Devices are laid out row-major,
so the last axis lands on adjacent devices (Megatron's order)."""

BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
"""The axes the global batch splits over (every device along them is a data
replica with rows of its own)."""


@dataclasses.dataclass(frozen=True)
class World:
    """Devices, mesh and batch split of one data-parallel run.

    Attributes:
      devices: the selected devices, in rank order (rank r = ``devices[r]``).
      mesh: a 1-D mesh over ``devices``; its one axis, the data axis, is
        ``axis_name`` (``"data"`` by default). A multi-axis world
        (``make_world(mesh="data:2,stage:4")``) has ``data`` first (outermost)
        and the devices laid out row-major over ``axes``.
      global_batch_size: examples per optimizer step over all devices.
      local_batch_size: examples per step on one device
        (``global_batch_size // data_size``; ``data_size == world_size`` on a
        1-D world).
    """

    devices: tuple
    mesh: Mesh
    global_batch_size: int
    local_batch_size: int

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The mesh's axes as ``((name, size), ...)``, outermost first
        (``(("data", N),)`` for a 1-D world)."""
        return tuple((n, int(self.mesh.shape[n])) for n in self.mesh.axis_names)

    @property
    def mesh_spec(self) -> str:
        """The mesh as ``config.mesh`` writes it: ``"data:2,stage:4"`` (a 1-D
        world: ``"data:N"``)."""
        return ",".join(f"{n}:{k}" for n, k in self.axes)

    @property
    def data_size(self) -> int:
        """The number of batch shards (``global_batch_size // local_batch_size``):
        the product of the sizes of :attr:`axis_name`'s axes; ``world_size`` on a
        1-D world."""
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        return math.prod(int(self.mesh.shape[n]) for n in names)

    @property
    def axis_name(self) -> str | tuple[str, str]:
        """The mesh's data axis: the global batch, the gradient all-reduce and
        the BN statistics all-reduce run over it. With an ``fsdp`` axis, the
        tuple ``("data", "fsdp")`` (:data:`BATCH_AXES`): the batch splits over
        both (``lax.psum``, ``lax.axis_index`` and ``PartitionSpec`` take it as
        one axis, data-major)."""
        names = self.mesh.axis_names
        return BATCH_AXES if BATCH_AXES[1] in names else names[0]

    def process_rows(self, global_batch: int | None = None) -> tuple[int, int]:
        """Rows ``[start, stop)`` of every global batch that this process feeds.

        Rank r holds rows ``[r * local, (r + 1) * local)`` with ``local =
        global_batch // world_size`` (default: the training global batch); a
        process feeds the rows of its own devices, which must be contiguous ranks.
        On a multi-axis world the rows follow the data rank (device ``r`` is data
        rank ``r // (world_size // data_size)``; ``local = global_batch // data_size``).

        Raises:
          ValueError: this process's devices are not contiguous in rank order.
        """
        mine = [r for r, d in enumerate(self.devices) if d.process_index == jax.process_index()]
        if not mine:
            return 0, 0
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError(f"process {jax.process_index()} owns ranks {mine}, which are not "
                             "contiguous; list the devices process by process")
        per_rank = self.world_size // self.data_size  # devices per data rank (1 on a 1-D world)
        local = (global_batch or self.global_batch_size) // self.data_size
        return mine[0] // per_rank * local, (mine[-1] // per_rank + 1) * local

    def put(self, x, sharding: NamedSharding | None = None) -> jax.Array:
        """A host array, identical on every process, as a global array.

        Works with one or many processes (``jax.device_put`` cannot target
        devices of other processes). Default sharding: replicated.
        """
        x = np.asarray(x)
        sharding = sharding or self.replicated()
        # explicit copies, shard by shard (allowed under jax_transfer_guard="disallow")
        shards = [jax.device_put(x[idx], d)
                  for d, idx in sharding.addressable_devices_indices_map(x.shape).items()]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

    def replicated(self) -> NamedSharding:
        """Sharding of a value held whole and identical on every device."""
        return NamedSharding(self.mesh, P())

    def sharded(self) -> NamedSharding:
        """Sharding of a value split over devices along its leading axis."""
        return NamedSharding(self.mesh, P(self.axis_name))


def host_value(x) -> np.ndarray:
    """A replicated global array as numpy, read from this process's first shard
    (valid with many processes, where ``np.asarray`` of a global array is not)."""
    return np.asarray(jax.device_get(x.addressable_shards[0].data)) if isinstance(x, jax.Array) \
        else np.asarray(x)


def parse_device_spec(spec: str | int, num_available: int) -> list[int]:
    """Turns a device spec into a list of device ids.

    Args:
      spec: ``"all"``; a count ``"4"`` (or int 4: the first four devices); a
        range ``"0-3"`` (inclusive); or a list ``"0,2,5"``.
      num_available: number of devices present (ids ``0 .. num_available-1``).

    Returns:
      Device ids in rank order.

    Raises:
      ValueError: malformed spec, a count of zero or more than available,
        an id out of range, a reversed range, or a duplicated id. The message
        names the spec and gives a valid alternative.
    """
    valid = f'valid specs here: "all", "{num_available}", "0-{num_available - 1}", "0,1"'
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        spec = str(int(spec))
    if not isinstance(spec, str):
        raise ValueError(f"device spec {spec!r} must be a string or an int; {valid}")
    s = spec.strip().lower()
    if s == "all":
        return list(range(num_available))
    if re.fullmatch(r"\d+", s):
        count = int(s)
        if not 1 <= count <= num_available:
            raise ValueError(
                f"device spec {spec!r} asks for {count} devices but {num_available} "
                f"are available; use a count in 1..{num_available}, or \"all\"")
        return list(range(count))
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", s)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise ValueError(f"device spec {spec!r} is a reversed range; write \"{hi}-{lo}\"")
        ids = list(range(lo, hi + 1))
    elif re.fullmatch(r"\d+(\s*,\s*\d+)+", s):
        ids = [int(t) for t in s.split(",")]
    else:
        raise ValueError(f"device spec {spec!r} is not understood; {valid}")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        uniq = ",".join(str(i) for i in dict.fromkeys(ids))
        raise ValueError(f"device spec {spec!r} lists device id(s) {dup} more than once; "
                         f"did you mean \"{uniq}\"?")
    missing = [i for i in ids if i >= num_available]
    if missing:
        raise ValueError(f"device spec {spec!r} names device id(s) {missing} but only ids "
                         f"0..{num_available - 1} exist; {valid}")
    return ids


def check_batch_split(global_batch_size: int, world_size: int,
                      field: str = "global_batch_size", size_name: str = "world_size") -> int:
    """Returns the local batch size, ``global_batch_size // world_size``.

    Args:
      global_batch_size: rows of one global batch (train or eval).
      world_size: the number of devices.
      field: the name the user set the value under (e.g.
        ``"config.eval_batch_size"``), used in every message.
      size_name: what ``world_size`` counts, in the messages (``"the data
        axis size"`` on a mesh whose batch splits over ``data`` only).

    Raises:
      ValueError: if the batch size is not a positive int, is smaller than
        the world size, or is not divisible by it. The message names the
        field, both values and the nearest valid batch sizes.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)):
        raise ValueError(f"{field} {global_batch_size!r} must be an int")
    g, n = int(global_batch_size), int(world_size)
    if g < n:
        raise ValueError(f"{field} {g} is smaller than {size_name} {n}: every device "
                         f"needs at least one example; use {field} >= {n} "
                         f"(e.g. {n}) or fewer devices")
    if g % n:
        lo, hi = (g // n) * n, (g // n + 1) * n
        lo_text = f"{lo} or " if lo else ""
        raise ValueError(f"{field} {g} is not divisible by {size_name} {n}; "
                         f"use {lo_text}{hi} (local batch {lo_text and f'{lo // n} or '}{hi // n})")
    return g // n


def parse_mesh(spec) -> tuple[tuple[str, int], ...]:
    """Parses a mesh spec ``"data:2,stage:4"`` into ``(("data", 2), ("stage", 4))``.

    Args:
      spec: a string of comma-separated ``name:size`` items, or an already
        parsed sequence of ``(name, size)`` pairs (checked the same way).

    Returns:
      ``((name, size), ...)`` in the given order (outermost axis first).

    Raises:
      ValueError: a malformed item, a size that is not a positive int, a name
        not in :data:`MESH_AXES`, a repeated name, no ``data`` axis or ``data``
        not first (a mesh that starts with ``fsdp`` gets ``data:1`` in front), or
        axes out of the order ``data, fsdp, stage, model``. The message
        names the spec and gives a valid example.
    """
    example = 'e.g. "data:2,stage:4"'
    if isinstance(spec, str) and spec.strip() == "auto":
        raise ValueError("mesh 'auto' is chosen by the planner before a world is built: "
                         "trjax.train.train_and_evaluate does it, or call "
                         "trjax.train.planner.resolve_auto(config, ...) first")
    if isinstance(spec, str):
        items = []
        for item in spec.split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*:\s*(\d+)\s*", item)
            if not m:
                raise ValueError(f"mesh {spec!r}: item {item.strip()!r} is not 'name:size'; "
                                 f"write {example}")
            items.append((m.group(1), int(m.group(2))))
    else:
        try:
            items = [(n, s) for n, s in spec]
        except (TypeError, ValueError):
            raise ValueError(f"mesh {spec!r} must be a string like \"data:2,stage:4\" or "
                             "pairs (name, size)") from None
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"mesh {spec!r}: axis {name!r} is unknown; the axes are "
                             f"{', '.join(MESH_AXES)} ({example})")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh {spec!r}: axis {name!r} has size {size!r}; sizes are "
                             f"positive ints ({example})")
    names = [n for n, _ in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"mesh {spec!r} names axis {dup} more than once ({example})")
    if names and names[0] == BATCH_AXES[1] and DATA_AXIS not in names:  # "fsdp:8"
        items, names = [(DATA_AXIS, 1)] + items, [DATA_AXIS] + names
    if not names or (names[0] != DATA_AXIS and DATA_AXIS not in names):
        raise ValueError(f"mesh {spec!r}: the first (outermost) axis must be 'data' "
                         f"(write 'data:1' for none), {example}")
    if names != sorted(names, key=MESH_AXES.index):
        want = ",".join(f"{n}:{s}" for n, s in sorted(items, key=lambda i: MESH_AXES.index(i[0])))
        raise ValueError(f"mesh {spec!r}: axes must come in the order {', '.join(MESH_AXES)}; "
                         f"write {want!r}")
    return tuple((n, int(s)) for n, s in items)


def make_world(device_spec: str | int = "all", global_batch_size: int = 1,
               devices: Sequence[jax.Device] | None = None,
               axis_name: str = DATA_AXIS, mesh=None) -> World:
    """Selects devices, checks the batch split and builds the mesh.

    Args:
      device_spec: see :func:`parse_device_spec`.
      global_batch_size: examples per step over all selected devices.
      devices: the pool to select from (default ``jax.devices()``).
      axis_name: the name of the mesh's data axis (1-D worlds only).
      mesh: ``None`` (a 1-D mesh, the data axis over every selected device) or
        a spec for :func:`parse_mesh`, e.g. ``"data:2,stage:4"``: the selected
        devices, in rank order, reshaped row-major to the axis sizes (``data``
        outermost) as a plain :class:`jax.sharding.Mesh` (Auto axis types,
        not ``jax.make_mesh``, whose Explicit default turns ``shard_map``'s
        in_specs into assertions). The global batch splits over ``data``
        (and ``fsdp``: :data:`BATCH_AXES`): ``local_batch_size =
        global_batch_size // data_size``; the other axes hold replicas of that
        local batch.

    Returns:
      A :class:`World`.

    Raises:
      ValueError: from :func:`parse_device_spec`, :func:`check_batch_split`
        (over the data axis) or :func:`parse_mesh`; a mesh whose size product
        differs from the number of selected devices; ``mesh`` with a custom
        ``axis_name``. Every check runs before anything is traced.
    """
    pool = list(jax.devices() if devices is None else devices)
    ids = parse_device_spec(device_spec, len(pool))
    chosen = tuple(pool[i] for i in ids)
    if mesh is not None:
        axes = parse_mesh(mesh)
        if axis_name != DATA_AXIS:
            raise ValueError(f"mesh {mesh!r} names its data axis 'data'; axis_name "
                             f"{axis_name!r} applies to 1-D worlds only")
        sizes = [s for _, s in axes]
        total = int(np.prod(sizes))
        if total != len(ids):
            raise ValueError(f"mesh {mesh!r} has {' x '.join(map(str, sizes))} = {total} devices "
                             f"but device spec {device_spec!r} selects {len(ids)}; make the "
                             "product of the axis sizes equal the number of devices")
        batch = math.prod(s for n, s in axes if n in BATCH_AXES)
        try:
            local = check_batch_split(global_batch_size, batch)
        except ValueError as e:
            over = " x ".join(n for n, _ in axes if n in BATCH_AXES)
            over = "the data axis only" if over == DATA_AXIS else over
            raise ValueError(f"mesh {mesh!r}: the global batch splits over {over} "
                             f"(size {batch}): {e}") from None
        world_mesh = Mesh(np.array(chosen, dtype=object).reshape(sizes), tuple(n for n, _ in axes))
        return World(devices=chosen, mesh=world_mesh, global_batch_size=int(global_batch_size),
                     local_batch_size=local)
    local = check_batch_split(global_batch_size, len(ids))
    mesh = Mesh(np.array(chosen, dtype=object), (axis_name,))
    return World(devices=chosen, mesh=mesh, global_batch_size=int(global_batch_size),
                 local_batch_size=local)
