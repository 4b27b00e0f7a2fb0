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
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
"""The default name of the mesh's data axis (:func:`make_world`); code inside
trjax reads the name from ``World.axis_name``."""


@dataclasses.dataclass(frozen=True)
class World:
    """Devices, mesh and batch split of one data-parallel run.

    Attributes:
      devices: the selected devices, in rank order (rank r = ``devices[r]``).
      mesh: a 1-D mesh over ``devices``; its one axis, the data axis, is
        ``axis_name`` (``"data"`` by default).
      global_batch_size: examples per optimizer step over all devices.
      local_batch_size: examples per step on one device
        (``global_batch_size // world_size``).
    """

    devices: tuple
    mesh: Mesh
    global_batch_size: int
    local_batch_size: int

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def axis_name(self) -> str:
        """The mesh's data axis: the global batch, the gradient all-reduce and
        the BN statistics all-reduce run over it."""
        return self.mesh.axis_names[0]

    def process_rows(self, global_batch: int | None = None) -> tuple[int, int]:
        """Rows ``[start, stop)`` of every global batch that this process feeds.

        Rank r holds rows ``[r * local, (r + 1) * local)`` with ``local =
        global_batch // world_size`` (default: the training global batch); a
        process feeds the rows of its own devices, which must be contiguous ranks.

        Raises:
          ValueError: this process's devices are not contiguous in rank order.
        """
        mine = [r for r, d in enumerate(self.devices) if d.process_index == jax.process_index()]
        if not mine:
            return 0, 0
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError(f"process {jax.process_index()} owns ranks {mine}, which are not "
                             "contiguous; list the devices process by process")
        local = (global_batch or self.global_batch_size) // self.world_size
        return mine[0] * local, (mine[-1] + 1) * local

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
                      field: str = "global_batch_size") -> int:
    """Returns the local batch size, ``global_batch_size // world_size``.

    Args:
      global_batch_size: rows of one global batch (train or eval).
      world_size: the number of devices.
      field: the name the user set the value under (e.g.
        ``"config.eval_batch_size"``), used in every message.

    Raises:
      ValueError: if the batch size is not a positive int, is smaller than
        the world size, or is not divisible by it. The message names the
        field, both values and the nearest valid batch sizes.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)):
        raise ValueError(f"{field} {global_batch_size!r} must be an int")
    g, n = int(global_batch_size), int(world_size)
    if g < n:
        raise ValueError(f"{field} {g} is smaller than world_size {n}: every device "
                         f"needs at least one example; use {field} >= {n} "
                         f"(e.g. {n}) or fewer devices")
    if g % n:
        lo, hi = (g // n) * n, (g // n + 1) * n
        lo_text = f"{lo} or " if lo else ""
        raise ValueError(f"{field} {g} is not divisible by world_size {n}; "
                         f"use {lo_text}{hi} (local batch {lo_text and f'{lo // n} or '}{hi // n})")
    return g // n


def make_world(device_spec: str | int = "all", global_batch_size: int = 1,
               devices: Sequence[jax.Device] | None = None,
               axis_name: str = DATA_AXIS) -> World:
    """Selects devices, checks the batch split and builds the data mesh.

    Args:
      device_spec: see :func:`parse_device_spec`.
      global_batch_size: examples per step over all selected devices.
      devices: the pool to select from (default ``jax.devices()``).
      axis_name: the name of the mesh's data axis.

    Returns:
      A :class:`World`.

    Raises:
      ValueError: from :func:`parse_device_spec` or :func:`check_batch_split`.
    """
    pool = list(jax.devices() if devices is None else devices)
    ids = parse_device_spec(device_spec, len(pool))
    local = check_batch_split(global_batch_size, len(ids))
    chosen = tuple(pool[i] for i in ids)
    mesh = Mesh(np.array(chosen, dtype=object), (axis_name,))
    return World(devices=chosen, mesh=mesh, global_batch_size=int(global_batch_size),
                 local_batch_size=local)
