"""A train state packed into one flat host array per dtype, and back.

Checkpoints (:mod:`trjax.train.checkpoint`) store the packed arrays with their
layout: every leaf's path in the state dict, shape, dtype and offset, as
DeepSpeed's ZeRO checkpoints keep flat fp32 groups beside a map of parameter
shapes. Orbax's cost grows with the leaf count (about 0.4 ms of CPU per leaf
and save against about 25 ms per save): the default job's state has 177
leaves, and packed saves cost a third of the CPU (``scripts/bench_checkpoint.py``).
"""

from __future__ import annotations

import zlib

import flax
import flax.serialization
import flax.traverse_util
import jax
import numpy as np


def pack(state_dict: dict) -> tuple[dict, list]:
    """Packs a state dict into one flat host array per dtype, and its layout.

    Args:
      state_dict: nested dicts (``flax.serialization.to_state_dict`` of the
        train state) of arrays: numpy, or jax arrays whose every leaf can be
        read on this host (replicated, or all shards addressable).

    Returns:
      ``(flat, layout)``: ``flat`` maps a dtype name (``"float32"``,
      ``"int32"``, ``"bfloat16"``, ...) to a 1-D numpy array, a new copy
      sharing no memory with the inputs (none for a dtype whose leaves are
      all empty: orbax cannot save a zero-size array); ``layout`` is a JSON-able list of
      ``[path, shape, dtype, offset]`` in leaf order (``path``: the list of
      dict keys; an empty dict or a ``None`` keeps its place with ``shape``
      ``None`` and ``dtype`` ``"{}"`` or ``None``).
    """
    leaves = flax.traverse_util.flatten_dict(state_dict, keep_empty_nodes=True)
    layout, sizes, parts = [], {}, []
    for path, x in leaves.items():
        if x is flax.traverse_util.empty_node or x is None:
            layout.append([list(path), None, None if x is None else "{}", 0])
            continue
        name = np.dtype(x.dtype).name
        offset = sizes.get(name, 0)
        layout.append([list(path), list(np.shape(x)), name, offset])
        sizes[name] = offset + int(np.prod(np.shape(x), dtype=np.int64))
        parts.append((name, offset, x))
    # a dtype whose leaves are all empty gets no array (orbax refuses zero-size arrays)
    flat = {name: np.empty(size, numpy_dtype(name)) for name, size in sizes.items() if size}
    for name, offset, x in parts:  # one copy, straight from the (host) buffers
        x = np.asarray(x).reshape(-1)
        if x.size:
            flat[name][offset:offset + x.size] = x
    return flat, layout


def numpy_dtype(name: str):
    """The numpy dtype of a layout's dtype name (ml_dtypes' too: bfloat16, float8_*)."""
    return jax.numpy.dtype(name)  # knows ml_dtypes' names (bfloat16, float8_*)


class DamagedCheckpoint(ValueError):
    """A packed checkpoint's layout or flat arrays are not what :func:`pack`
    wrote (an edited or damaged checkpoint, not another model or world)."""


def checksums(flat: dict) -> dict:
    """CRC-32 of each flat array's bytes (``{"float32": "crc32:1a2b3c4d", ...}``):
    stored beside the layout, checked by :func:`unpack`, so that damaged bytes
    of a stored array (a flipped bit on disk restores as another value: the
    stored chunks carry no checksum) are an error, not a silent change of the
    state. zlib's CRC-32: about 0.8 ms per 2 MB on one core."""
    return {k: f"crc32:{zlib.crc32(memoryview(np.ascontiguousarray(v)).cast('B')):08x}"
            for k, v in flat.items()}


def check_layout(layout) -> dict:
    """The flat arrays' sizes by dtype name that ``layout`` describes (dtypes
    whose leaves are all empty have none: :func:`pack`), after
    checking it is one :func:`pack` writes: entries ``[path, shape, dtype,
    offset]`` with distinct non-empty paths of strings, shapes of non-negative
    ints, known dtype names, and each dtype's leaves packed back to back from
    offset 0 in layout order (no gap, no overlap: a leaf read at another
    leaf's offset would restore wrong values without an error).

    Raises:
      DamagedCheckpoint: names the first entry that breaks these rules.
    """
    if not isinstance(layout, list):
        raise DamagedCheckpoint(
            f"packed state: the layout is a {type(layout).__name__}, not a list")
    sizes, seen = {}, set()
    for entry in layout:
        ok = isinstance(entry, list) and len(entry) == 4
        path, shape, dtype, offset = entry if ok else (None,) * 4
        ok = ok and isinstance(path, list) and bool(path) and \
            all(isinstance(k, str) for k in path) and tuple(path) not in seen
        if ok and shape is None:
            ok = dtype in ("{}", None) and offset == 0
        elif ok:
            ok = (isinstance(shape, list) and isinstance(dtype, str) and type(offset) is int and
                  all(type(n) is int and n >= 0 for n in shape) and _known(dtype))
            if ok and offset != sizes.get(dtype, 0):
                raise DamagedCheckpoint(
                    f"packed state: {'/'.join(path)} ({dtype}{shape}) is at offset {offset}, "
                    f"where the previous {dtype} leaves end at {sizes.get(dtype, 0)} (leaves "
                    "overlap or leave a gap: the layout was edited or damaged)")
            if ok:
                sizes[dtype] = offset + int(np.prod(shape, dtype=np.int64))
        if not ok:
            raise DamagedCheckpoint(f"packed state: the layout entry {str(entry)[:200]} is not "
                                "[path, shape, dtype, offset] as trjax.packing.pack writes it")
        seen.add(tuple(path))
    return {k: n for k, n in sizes.items() if n}


def _known(name: str) -> bool:
    try:
        numpy_dtype(name)
    except TypeError:
        return False
    return True


def unpack(flat: dict, layout: list, sums: dict | None = None) -> dict:
    """The state dict :func:`pack` packed: numpy arrays (views of ``flat``),
    nested as the paths say.

    Args:
      flat, layout: as :func:`pack` returned them.
      sums: :func:`checksums` of ``flat`` when it was packed; ``None``: not
        checked (checkpoints written before the checksums).

    Raises:
      DamagedCheckpoint (a ``ValueError``): ``layout`` is not one :func:`pack`
        writes (:func:`check_layout`), or ``flat`` does not hold exactly the
        arrays it describes, or their bytes are not those ``sums`` describe
        (a damaged checkpoint).
    """
    sizes = check_layout(layout)
    have = {k: (np.asarray(v).dtype, np.size(v)) for k, v in flat.items()}
    if have != {k: (numpy_dtype(k), n) for k, n in sizes.items()}:
        raise DamagedCheckpoint(f"packed state: the stored arrays {_sizes(flat)} are not the "
                            f"{ {k: f'{k}[{n}]' for k, n in sizes.items()} } its layout "
                            "describes (a damaged checkpoint)")
    if sums is not None and checksums(flat) != sums:
        bad = sorted(k for k, v in checksums(flat).items() if sums.get(k) != v)
        raise DamagedCheckpoint(f"packed state: the stored {', '.join(bad)} array's bytes are not "
                                f"those saved (checksum {checksums(flat)} vs {sums}: a damaged "
                                "checkpoint)")
    leaves = {}
    for path, shape, dtype, offset in layout:
        if shape is None:
            leaves[tuple(path)] = {} if dtype == "{}" else None
            continue
        size = int(np.prod(shape, dtype=np.int64))
        leaves[tuple(path)] = (flat[dtype][offset:offset + size].reshape(shape) if size else
                               np.zeros(shape, numpy_dtype(dtype)))
    return flax.traverse_util.unflatten_dict(leaves)


def _sizes(flat: dict) -> dict:
    return {k: f"{v.dtype}[{v.size}]" for k, v in flat.items()}


def template(layout: list) -> dict:
    """Zero arrays of the flat arrays ``layout`` describes (a restore target for orbax).

    Raises:
      DamagedCheckpoint: see :func:`check_layout`.
    """
    return {k: np.zeros(n, numpy_dtype(k)) for k, n in check_layout(layout).items()}


def place(target, state_dict: dict, path: str):
    """``state_dict`` (host arrays, e.g. from :func:`unpack`) as ``target``'s
    type, each leaf on its devices and sharding (``jax.make_array_from_callback``:
    every process supplies its own shards, so sharded leaves and several
    processes work too); ``target``'s numpy leaves get numpy copies.

    Raises:
      ValueError: a leaf is missing, extra, or of another shape or dtype
        (the message names ``path``, the leaf and both).
    """
    want = flax.traverse_util.flatten_dict(flax.serialization.to_state_dict(target),
                                           keep_empty_nodes=True)
    have = flax.traverse_util.flatten_dict(state_dict, keep_empty_nodes=True)
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ValueError(f"checkpoint {path} does not fit this model/world: leaves missing "
                         f"{['/'.join(k) for k in missing][:5]}, not in this state "
                         f"{['/'.join(k) for k in extra][:5]}")
    placed = {}
    for k, x in want.items():
        v = have[k]
        if _kind(x) != _kind(v):
            raise ValueError(f"checkpoint {path} does not fit this model/world: "
                             f"{'/'.join(k)} is {_kind(v)} in the checkpoint, {_kind(x)} in "
                             "this run")
        if _kind(x) != "an array":
            placed[k] = {} if x is flax.traverse_util.empty_node else None
            continue
        if tuple(v.shape) != tuple(x.shape) or np.dtype(v.dtype) != np.dtype(x.dtype):
            raise ValueError(f"checkpoint {path} does not fit this model/world: "
                             f"{'/'.join(k)} is {v.dtype}{list(v.shape)} in the checkpoint, "
                             f"{np.dtype(x.dtype)}{list(x.shape)} in this run")
        placed[k] = (jax.make_array_from_callback(x.shape, x.sharding, lambda i, v=v: v[i])
                     if isinstance(x, jax.Array) else np.array(v))
    return flax.serialization.from_state_dict(target, flax.traverse_util.unflatten_dict(placed))


def _kind(leaf) -> str:
    if leaf is flax.traverse_util.empty_node:
        return "an empty dict"
    return "None" if leaf is None else "an array"
