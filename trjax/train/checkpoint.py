"""Checkpoints with orbax: the whole train state plus where the data stream stands.

A checkpoint at step s is an orbax checkpoint of two items. ``state`` is the
:class:`trjax.state.TrainState` as a plain pytree,
``flax.serialization.to_state_dict`` of it (``params``, ``batch_stats``,
``opt_state``, ``step``, ``skipped_steps``, ``loss_scale``, ``good_steps``,
``comm_state``), one stored array per leaf: orbax alone restores it by name,
``ocp.CheckpointManager(d).restore(s, args=ocp.args.Composite(state=
ocp.args.StandardRestore(abstract_state_dict)))``. ``meta`` is JSON: epoch,
batch index inside the epoch, seed and the config fields that must not change
across a resume; the CRC-32 of every leaf's bytes, keyed by the leaf's
'/'-joined path (:data:`CHECKSUMS_KEY`); and the shape and dtype of every
zero-size leaf (:data:`EMPTY_KEY`: orbax refuses to store an empty array, so the
state item holds ``None`` in its place). The data order is a pure function of
``(seed, epoch)``, so ``(seed, epoch, batch)`` is the whole data/RNG position.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a run killed during a save, or a save that fails, leaves the
previous checkpoints readable (older ones are deleted only after a newer one
is complete).

Saves are asynchronous by default (:func:`save`): the training thread copies
the state to host memory (numpy: the train step donates the state's device
buffers to the next step, so the writer must not read them) and hands the copy
to orbax, whose background thread writes it while training goes on; in a
single process orbax's ``save`` call itself runs on the manager's own thread.
Handing orbax host arrays also spares it the replica-parallel slicing of
replicated device arrays, which compiles a small program per leaf on the first
save. A state with leaves sharded across several processes has no host copy:
its device arrays are saved and the save completes before :func:`save` returns;
its checksums are of each whole leaf (every process gathers the sharded ones,
:func:`checksums`), the same as a single process's save of that state.
:func:`finish` waits for the save in flight (before exit, before reading the
checkpoints back). Arrays are stored as
global (replicated) arrays: the checkpoint does not depend on the device
count, and one written on 8 devices restores on 4 or 1, each leaf placed with
the sharding of the run's own state (per-device state, one row per replica --
``local`` BN statistics, compression error feedback, ZeRO-1 shards -- is the
exception: it restores on the same world size only).

Integrity: orbax's stored chunks carry no checksum of their own, so a damaged
byte on disk would restore as another value. A restore compares every leaf
with its CRC-32 in the meta: a mismatch (or a leaf without its checksum) makes
the checkpoint unreadable (:class:`DamagedCheckpoint`).

Resume policy: :func:`restore_latest` tries the newest checkpoint first; one
that cannot be read (truncated, corrupt, a checksum that does not match) is
reported and the next older one is tried; once one restores, the unreadable
newer ones are renamed ``<step>.unreadable`` (kept for inspection). A readable
checkpoint whose config does not match, or whose leaves do not fit the run's
state, is an error (no silent fallback: resuming it would be wrong); so is one
in trjax's former packed format (one flat array per dtype, its layout in the
meta under ``"state_layout"``), which this trjax does not read.
:func:`read` returns a checkpoint's state dict by name without a train state.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import math
import os
import zlib

import flax
import flax.serialization
import flax.traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from trjax import aot
from trjax.world import host_value

CHECKSUMS_KEY = "state_crc32"
"""The ``meta`` key of the leaves' checksums: ``{"params/conv/kernel": zlib.crc32, ...}``."""
EMPTY_KEY = "state_empty_leaves"
"""The ``meta`` key of the zero-size leaves: ``{path: [shape, dtype name]}``."""
PACKED_FORMAT_KEY = "state_layout"
"""The ``meta`` key that marks a checkpoint in trjax's former packed format."""


class DamagedCheckpoint(ValueError):
    """A checkpoint's stored leaves are not those saved (their CRC-32 in the
    meta does not match, or a leaf and its checksum do not pair up)."""


class DoesNotFit(ValueError):
    """A readable checkpoint whose leaves are not those of the run's state
    (another model or world): missing or extra leaves, other shapes or dtypes."""


class Manager(ocp.CheckpointManager):
    """orbax's ``CheckpointManager``, and where :func:`save` hands its saves to.

    With asynchronous saves in a single process, :func:`save` calls orbax's
    ``save`` on a thread of its own (``handoff``), so that the training thread
    returns as soon as the host copy is taken (the call itself creates
    directories and metadata and starts orbax's threads and event loop).
    Several processes call it on the training thread, in step order: a save's
    commit is a barrier across them."""

    def __init__(self, directory: str, options: ocp.CheckpointManagerOptions, handoff: bool):
        super().__init__(directory, options=options)
        self.handoff = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trjax-save")
                        if handoff else None)
        self.pending: concurrent.futures.Future | None = None  # the handed-off save call

    def close(self):
        try:
            wait_handed_off(self)  # its error, if any, after orbax's own close below
        finally:
            if self.handoff is not None:
                self.handoff.shutdown()
            super().close()


def manager(directory: str, max_to_keep: int = 3, asynchronous: bool = True) -> Manager:
    """An orbax manager on ``directory`` (created if needed).

    Args:
      directory: the checkpoints folder (``WORKDIR/checkpoints``).
      max_to_keep: newest checkpoints kept; older ones are deleted once a
        newer one is complete.
      asynchronous: ``config.checkpoint_async``; saves write on a background
        thread (see :func:`save`, :func:`finish`).
    """
    os.makedirs(directory, exist_ok=True)
    return Manager(os.path.abspath(directory),
                   ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                enable_async_checkpointing=asynchronous),
                   handoff=asynchronous and jax.process_count() == 1)


def wait_handed_off(mngr) -> None:
    """Waits until the orbax ``save`` call :func:`save` handed off (if any)
    has returned; its error, if it raised, is raised here (once). A wait cut
    short (``KeyboardInterrupt``: a second Ctrl-C) leaves the call pending,
    so that the next wait (e.g. :func:`finish` on the way out) still waits
    for it."""
    pending = getattr(mngr, "pending", None)
    if pending is None:
        return
    try:
        pending.result()
    finally:
        if pending.done():
            mngr.pending = None


def host_copy(state) -> dict:
    """The state as a state dict of numpy arrays that share no memory with a
    device buffer (``np.array(leaf, copy=True)``).

    jax reads a replicated leaf from one local shard (every replica holds the
    same bits) and assembles a sharded one (ZeRO-1 optimizer state, ``local``
    BN statistics) on the host from its shards: no program is compiled. All
    device-to-host transfers are started before the first is waited on. The
    copies block until the step that produced the state has finished.

    Raises:
      RuntimeError: (jax) a sharded leaf spans devices of other processes.
    """
    _start_copies_to_host(state)
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True),
                                  flax.serialization.to_state_dict(state))


def _start_copies_to_host(tree) -> None:
    """Every leaf's device-to-host transfer in flight before the first is waited on."""
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            x.copy_to_host_async()


def checksums(state_dict: dict) -> dict:
    """The CRC-32 of every array leaf's bytes (C order), keyed by its path.

    Args:
      state_dict: nested dicts of arrays (numpy, or jax arrays: a leaf sharded
        across processes is gathered first, a collective every process must
        call), empty dicts and ``None``.

    Returns:
      ``{"params/conv/kernel": zlib.crc32(bytes), ...}`` (ints; a zero-size
      leaf's is 0). Empty dicts and ``None`` have none.
    """
    _start_copies_to_host(state_dict)
    return {k: zlib.crc32(np.ascontiguousarray(_on_host(x)).reshape(-1).view(np.uint8))
            for k, x in _leaves(state_dict).items() if _kind(x) == "an array"}


def _on_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _leaves(tree: dict) -> dict:
    """``{"a/b": leaf}``, empty dicts kept (``flax.traverse_util.empty_node``)."""
    return flax.traverse_util.flatten_dict(tree, keep_empty_nodes=True, sep="/")


def _kind(leaf) -> str:
    if leaf is flax.traverse_util.empty_node:
        return "an empty dict"
    return "None" if leaf is None else "an array"


def _is_empty_array(x) -> bool:
    return _kind(x) == "an array" and math.prod(np.shape(x)) == 0


def _without_empty(tree: dict) -> tuple[dict, dict]:
    """``tree`` with its zero-size arrays as ``None`` (orbax refuses to store
    them), and their ``{path: [shape, dtype name]}``."""
    leaves = _leaves(tree)
    empty = {k: [list(np.shape(x)), np.dtype(x.dtype).name]
             for k, x in leaves.items() if _is_empty_array(x)}
    kept = {k: None if k in empty else x for k, x in leaves.items()}
    return flax.traverse_util.unflatten_dict(kept, sep="/"), empty


def _host_copy_possible(state) -> bool:
    return all(x.is_fully_replicated or x.is_fully_addressable
               for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array))


def save(mngr: Manager, state, meta: dict) -> None:
    """Saves ``state`` and ``meta`` (JSON-able) under ``int(state.step)``.

    The state is copied to host memory first (:func:`host_copy`), so the
    caller may donate ``state`` to the next step as soon as this returns; the
    copy's :func:`checksums` go into ``meta`` under :data:`CHECKSUMS_KEY`, its
    zero-size leaves under :data:`EMPTY_KEY`. With an asynchronous manager the
    files are written on orbax's background thread and the call returns once
    the copy is taken (single-process: orbax's ``save`` itself is called on
    the manager's ``handoff`` thread; it first waits for the previous save, if
    still in flight); a failed background write raises at the next
    :func:`save` or :func:`finish`. Leaves of a multi-process sharded state
    have no local host copy: they are saved as device arrays and the save is
    completed before returning; their checksums are of the whole leaves (each
    sharded leaf gathered onto every process, one leaf at a time: a collective
    every process calls, as it calls this function), so the restore verifies them
    as any other checkpoint's.
    """
    step = int(host_value(state.step))
    if _host_copy_possible(state):
        tree = host_copy(state)
        meta, wait = {**meta, CHECKSUMS_KEY: checksums(tree)}, False
    else:
        tree, wait = flax.serialization.to_state_dict(state), True
        meta = {**meta, CHECKSUMS_KEY: checksums(tree)}
    tree, empty = _without_empty(tree)
    meta = {**meta, EMPTY_KEY: empty} if empty else meta
    wait_handed_off(mngr)  # saves start in step order; the previous one's error is raised here
    args = ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
    if getattr(mngr, "handoff", None) is not None and not wait:
        mngr.pending = mngr.handoff.submit(contextvars.copy_context().run,  # its phase, too
                                           functools.partial(mngr.save, step, args=args,
                                                             force=True))
        return
    mngr.save(step, args=args, force=True)
    if wait:
        mngr.wait_until_finished()


def finish(mngr: Manager) -> None:
    """Waits until the save in flight (if any) is on disk and complete.

    Raises:
      the error of a failed background write (the checkpoint it wrote stays a
      temporary directory; the previous checkpoints are untouched).
    """
    try:
        wait_handed_off(mngr)
    finally:
        mngr.wait_until_finished()


def _read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _check_format(path: str, meta: dict) -> None:
    """Raises ``ValueError`` for a checkpoint in trjax's former packed format."""
    if PACKED_FORMAT_KEY in meta:
        raise ValueError(
            f"checkpoint {path} is in trjax's packed format (trjax < 0.2, meta "
            f"'{PACKED_FORMAT_KEY}'); this trjax reads plain orbax pytrees: resume it with "
            "the trjax that wrote it, or start a new workdir")


def _stored_leaves(path: str, meta: dict) -> dict:
    """What the ``state`` item of the checkpoint at ``path`` holds, from
    orbax's metadata (no array is read):
    ``{path: ShapeDtypeStruct | None | empty_node}``, zero-size leaves included.

    Raises:
      DamagedCheckpoint: the meta's zero-size leaves are not where it stored ``None``.
    """
    handler = ocp.StandardCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(path) / "state").tree
    finally:
        handler.close()
    leaves = {k: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) if _kind(x) == "an array" else x
              for k, x in _leaves(tree).items()}
    for k, (shape, dtype) in meta.get(EMPTY_KEY, {}).items():
        if leaves.get(k, 0) is not None:  # save stores None in a zero-size leaf's place
            raise DamagedCheckpoint(f"checkpoint {path}: its meta's {EMPTY_KEY} names {k}, "
                                    "not a None leaf of the state item (a damaged checkpoint)")
        leaves[k] = jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype))
    return leaves


def _check_fits(path: str, stored: dict, want: dict) -> None:
    """Raises :class:`DoesNotFit` naming ``path``, the first leaf and both
    sides unless ``stored`` and ``want`` (:func:`_leaves`) hold the same leaves."""
    missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    if missing or extra:
        raise DoesNotFit(f"checkpoint {path} does not fit this model/world: leaves missing "
                         f"{missing[:5]}, not in this state {extra[:5]}")
    for k, x in want.items():
        v = stored[k]
        if _kind(x) != _kind(v):
            raise DoesNotFit(f"checkpoint {path} does not fit this model/world: {k} is "
                             f"{_kind(v)} in the checkpoint, {_kind(x)} in this run")
        if _kind(x) == "an array" and (tuple(v.shape) != tuple(np.shape(x)) or
                                       np.dtype(v.dtype) != np.dtype(x.dtype)):
            raise DoesNotFit(f"checkpoint {path} does not fit this model/world: {k} is "
                             f"{np.dtype(v.dtype)}{list(v.shape)} in the checkpoint, "
                             f"{np.dtype(x.dtype)}{list(np.shape(x))} in this run")


def _read_state(mngr: ocp.CheckpointManager, step: int, path: str, meta: dict,
                want: dict | None) -> dict:
    """The ``state`` item as ``want`` (a state dict of arrays or
    ``ShapeDtypeStruct``: each leaf gets its sharding, numpy without one;
    ``None``: numpy, as stored), checked against the meta's checksums.

    Raises:
      DoesNotFit: ``want``'s leaves are not the stored ones.
      DamagedCheckpoint: a leaf's bytes are not those saved.
      (orbax's errors): a truncated or corrupt checkpoint.
    """
    stored = _stored_leaves(path, meta)
    if want is None:
        want = flax.traverse_util.unflatten_dict(stored, sep="/")
    _check_fits(path, stored, _leaves(want))
    abstract = aot.abstract(_without_empty(want)[0])
    tree = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    tree = _with_empty(tree, want)
    _verify(path, tree, meta)
    return tree


def _with_empty(tree: dict, like: dict) -> dict:
    """``tree`` with ``like``'s zero-size leaves put back (``None`` on disk),
    on ``like``'s sharding where it has one."""
    leaves = _leaves(tree)
    for k, x in _leaves(like).items():
        if _is_empty_array(x):
            zeros = np.zeros(np.shape(x), x.dtype)
            sharding = getattr(x, "sharding", None)
            leaves[k] = zeros if sharding is None else jax.make_array_from_callback(
                zeros.shape, sharding, lambda i, z=zeros: z[i])
    return flax.traverse_util.unflatten_dict(leaves, sep="/")


def _verify(path: str, tree: dict, meta: dict) -> None:
    """Raises :class:`DamagedCheckpoint` unless every array leaf of ``tree``
    has the CRC-32 the meta holds for it (a checkpoint of trjax before the
    checksums, or a multi-process one of trjax before issue 40, holds none:
    nothing is checked)."""
    if CHECKSUMS_KEY not in meta:
        return
    saved, have = meta[CHECKSUMS_KEY], checksums(tree)
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(f"checkpoint {path}: its meta's {CHECKSUMS_KEY} is a "
                                f"{type(saved).__name__}, not a dict (a damaged checkpoint)")
    bad = sorted(k for k in set(saved) | set(have) if saved.get(k) != have.get(k))
    if bad:
        raise DamagedCheckpoint(
            f"checkpoint {path}: the stored bytes of {bad[:5]} are not those saved (CRC-32 "
            f"{[have.get(k) for k in bad[:5]]} vs {[saved.get(k) for k in bad[:5]]} in its "
            "meta: a damaged checkpoint)")


def newest_meta(mngr: ocp.CheckpointManager) -> tuple[str, dict] | None:
    """``(path, meta)`` of the newest checkpoint whose ``meta`` reads, or
    ``None`` (no checkpoint, or none readable: :func:`restore_latest` reports
    unreadable ones when it falls back)."""
    wait_handed_off(mngr)
    for step in sorted(mngr.all_steps(), reverse=True):
        path = os.path.join(str(mngr.directory), str(step))
        try:
            return path, _read_meta(mngr, step)
        except Exception:
            continue
    return None


def check_compatible(mngr: ocp.CheckpointManager, expect: dict, log=print) -> None:
    """Raises ``ValueError`` if the newest readable checkpoint was written with
    other ``expect`` values, or is in trjax's former packed format (called
    before anything is compiled)."""
    newest = newest_meta(mngr)
    if newest is not None:
        _check_format(*newest)
        _check_meta(*newest, expect)


CODE_KEYS = ("loss_fn", "transform")
"""The ``expect`` keys of the user's own code (:func:`trjax.train.trainer.code_identity`),
not compared against a checkpoint of a trjax that did not record them yet."""
DATA_KEYS = ("train_examples", "train_fingerprint")
"""The ``expect`` keys that say what a data position means
(:func:`trjax.train.trainer.data_identity`)."""


def _check_meta(path: str, meta: dict, expect: dict) -> None:
    """Raises ``ValueError`` naming every ``expect`` key the checkpoint's meta
    differs in (the checkpoint's value and this run's), and the way out.

    A config key (:data:`trjax.train.config.CHECKPOINT_KEYS`) or code key
    (:data:`CODE_KEYS`) the meta does not hold is not compared: the checkpoint was written by a trjax that did not
    record it yet (issue 40 added the recipe keys), and ``config.json``,
    compared first, holds it. Every other ``expect`` key must be there."""
    from trjax.train.config import CHECKPOINT_KEYS
    optional = set(CHECKPOINT_KEYS) | set(CODE_KEYS)
    diff = {k: (meta.get(k), v) for k, v in expect.items()
            if meta.get(k) != v and (k in meta or k not in optional)}
    if not diff:
        return
    named = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
    if set(diff) & set(DATA_KEYS):
        raise ValueError(f"checkpoint {path} counts its data position in other training data: "
                         f"{named}; the training data changed since the checkpoint (files added, "
                         "deleted or relabelled), so its (epoch, batch) position would point at "
                         "other examples. Restore the training data the run started with, or "
                         "start a new run in another workdir")
    code = [k for k in CODE_KEYS if k in diff]
    if code:
        key, (was, _) = code[0], diff[code[0]]
        fix = (f"resume without {key}= (the run used the built-in one)" if was is None else
               f"pass the same {key}= on resume, or, when yours computes the same thing (a "
               f"rename, a refactor), say so: {key}.trjax_identity = {was!r} "
               "(trjax.train.trainer.code_identity)")
        raise ValueError(f"checkpoint {path} was trained with another {' and '.join(code)}: "
                         f"{named}; {fix}; or use another workdir")
    raise ValueError(f"checkpoint {path} is incompatible with this config: {named}; use "
                     "another workdir or the same settings")


def restore_latest(mngr: ocp.CheckpointManager, target, expect: dict, log=print):
    """Restores the newest readable checkpoint into ``target``'s shapes and shardings.

    Args:
      mngr: from :func:`manager`.
      target: a train state on the current world (only shapes, dtypes and
        shardings are used; its buffers are not read). Its jax array leaves
        come back on their shardings, its numpy leaves as numpy arrays.
      expect: config fields that must match the checkpoint's ``meta``.
      log: where to report skipped (unreadable) checkpoints.

    Returns:
      ``(state, meta)``, or ``None`` if there is no checkpoint.

    Raises:
      ValueError: the checkpoint was written with other ``expect`` values, or
        is in trjax's former packed format; :class:`DoesNotFit` (a
        ``ValueError``): its leaves are not ``target``'s (names the directory,
        the leaf and both shapes).
      RuntimeError: checkpoints exist but none is readable.
    """
    wait_handed_off(mngr)
    all_steps = sorted(mngr.all_steps(), reverse=True)
    if not all_steps:
        return None
    errors, bad = [], []

    def unreadable(path, e):  # report it, keep its files, try the next older one
        errors.append(f"{path}: {type(e).__name__}: {str(e)[:300]}")
        bad.append(path)
        log(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
            "trying an older one")

    want = flax.serialization.to_state_dict(target)
    for step in all_steps:
        path = os.path.join(str(mngr.directory), str(step))
        try:
            meta = _read_meta(mngr, step)
        except Exception as e:
            unreadable(path, e)
            continue
        _check_format(path, meta)
        _check_meta(path, meta, expect)
        try:
            tree = _read_state(mngr, step, path, meta, want)
        except DoesNotFit:
            raise
        except Exception as e:
            unreadable(path, e)
            continue
        _move_aside(mngr, bad, log)
        return flax.serialization.from_state_dict(target, tree), meta
    raise RuntimeError("no readable checkpoint in " + str(mngr.directory) + ":\n  " +
                       "\n  ".join(errors) + "\nmove them elsewhere (or delete them) to start "
                       "the run over, or restore a copy")


def read(directory: str, step: int | None = None) -> tuple[dict, dict]:
    """A checkpoint's train state as a state dict of numpy arrays, by name,
    without a model or devices (e.g. ``read(d)[0]["params"]``), and its meta.

    Args:
      directory: a checkpoints folder (``WORKDIR/checkpoints``).
      step: the step to read; ``None``: the newest.

    Returns:
      ``(state_dict, meta)``: nested dicts as
      ``flax.serialization.to_state_dict(TrainState)`` gives them (``params``,
      ``batch_stats``, ``opt_state``, ``step``, ...) of numpy arrays of the
      stored shapes and dtypes, and the meta item.

    Raises:
      FileNotFoundError: no checkpoint (at ``step``) in ``directory``.
      ValueError: the checkpoint is in trjax's former packed format.
      DamagedCheckpoint: a leaf's bytes are not those saved.
    """
    mngr = ocp.CheckpointManager(os.path.abspath(directory))
    steps = mngr.all_steps()
    if step is None and steps:
        step = max(steps)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint {'' if step is None else step} in {directory} "
                                f"(steps there: {sorted(steps)})")
    path = os.path.join(str(mngr.directory), str(step))
    meta = _read_meta(mngr, step)
    _check_format(path, meta)
    return _read_state(mngr, step, path, meta, None), meta


def _move_aside(mngr: ocp.CheckpointManager, paths: list[str], log) -> None:
    """Renames unreadable checkpoints newer than the restored one to
    ``<step>.unreadable`` (kept for inspection; orbax no longer lists them), so
    the resumed run can save at their steps again. Process 0 renames; every
    process then re-reads the folder."""
    if not paths:
        return
    if jax.process_index() == 0:
        for path in paths:
            dest, n = path + ".unreadable", 1
            while os.path.exists(dest):
                n += 1
                dest = f"{path}.unreadable{n}"
            os.rename(path, dest)
            log(f"moved the unreadable checkpoint {path} to {dest}")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("trjax: unreadable checkpoints moved aside")
    mngr.reload()
