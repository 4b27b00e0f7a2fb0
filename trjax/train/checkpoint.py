"""Checkpoints with orbax: the whole train state plus where the data stream stands.

A checkpoint at step s holds the :class:`trjax.state.TrainState` (parameters,
optimizer state, BN statistics, step, skipped steps, loss scale) and a JSON
``meta`` item: epoch, batch index inside the epoch, seed and the config fields
that must not change across a resume. The data order is a pure function of
``(seed, epoch)``, so ``(seed, epoch, batch)`` is the whole data/RNG position.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a run killed during a save, or a save that fails, leaves the
previous checkpoints readable (older ones are deleted only after a newer one
is complete).

Saves are asynchronous by default (:func:`save`): the training thread copies
the state to host memory (numpy: the train step donates the state's device
buffers to the next step, so the writer must not read them) and hands the copy
to orbax, whose background thread writes it while training goes on.

The host copy is packed (:func:`trjax.packing.pack`): one flat array per dtype (``state``
item: ``{"float32": [n], "int32": [m], ...}``) and, in the ``meta`` item, the
layout that names every leaf (its path in the state dict, shape, dtype and
offset), as DeepSpeed's ZeRO checkpoints keep flat fp32 groups beside a map of
parameter shapes. The meta also holds each flat array's CRC-32
(:func:`trjax.packing.checksums`): a damaged byte of the stored arrays makes the
checkpoint unreadable instead of restoring another value. Orbax's cost grows
with the leaf count (about 0.4 ms of CPU per leaf and save, against about 25 ms
per save: ``scripts/bench_checkpoint.py``):
the default job's state has 177 leaves and 2 MB, so packed saves cost a third of
the CPU, which on a small host is taken from the training steps. :func:`read`
returns a checkpoint's state dict by name without a train state; checkpoints
written leaf by leaf (multi-process sharded states, and trjax before the packing)
restore as before. Handing orbax host arrays also spares it the replica-parallel slicing
of replicated device arrays, which compiled ~96 small programs on the first
save of the default job. :func:`finish` waits for the save in flight (before
exit, before reading the checkpoints back). Arrays are stored as global (replicated) arrays: the layout does not
depend on the device count, and a checkpoint written on 8 devices restores on
4 or 1 (``local`` BN mode, whose statistics have one row per replica, is the
exception: it restores on the same world size only).

Resume policy: :func:`restore_latest` tries the newest checkpoint first; one
that cannot be read (truncated, corrupt, a packed layout that is not one
:func:`trjax.packing.pack` writes) is reported and left untouched, and
the next older one is tried. A readable checkpoint whose config does not match
is an error (no silent fallback: resuming it would be wrong).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import os

import flax
import flax.serialization
import flax.traverse_util
import jax
import numpy as np
import orbax.checkpoint as ocp

from trjax import packing
from trjax.world import host_value

COMPATIBLE_FIELDS = ("model", "bn_mode", "global_batch_size", "dataset", "optimizer",
                     "precision", "seed", "buckets", "compression", "shard_optimizer_state")


class Manager(ocp.CheckpointManager):
    """orbax's ``CheckpointManager``, and where :func:`save` hands its saves to.

    With asynchronous saves in a single process, :func:`save` calls orbax's
    ``save`` on a thread of its own (``handoff``), so that the training thread
    returns as soon as the host copy is taken: the call itself (directories,
    metadata, orbax's threads and event loop) took 9-16 ms of the training
    thread per save. Several processes call it on the training thread, in step
    order: a save's commit is a barrier across them."""

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


def _start_copies_to_host(state) -> None:
    """Every leaf's device-to-host transfer in flight before the first is waited on."""
    for x in jax.tree_util.tree_leaves(state):
        if isinstance(x, jax.Array):
            x.copy_to_host_async()


LAYOUT_KEY = "state_layout"
"""The ``meta`` key of a packed checkpoint's layout (:func:`trjax.packing.pack`)."""
CHECKSUMS_KEY = "state_checksums"
"""The ``meta`` key of a packed checkpoint's array checksums (:func:`trjax.packing.checksums`)."""


def _host_copy_possible(state) -> bool:
    return all(x.is_fully_replicated or x.is_fully_addressable
               for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array))


def save(mngr: Manager, state, meta: dict) -> None:
    """Saves ``state`` and ``meta`` (JSON-able) under ``int(state.step)``.

    The state is copied to host memory first and packed (:func:`trjax.packing.pack`; its
    layout goes into ``meta`` under :data:`LAYOUT_KEY`), so the caller may
    donate ``state`` to the next step as soon as this returns. With
    an asynchronous manager the files are written on orbax's background thread
    and the call returns once the copy is taken (single-process: orbax's
    ``save`` itself is called on the manager's ``handoff`` thread; it first
    waits for the previous save, if still in flight); a failed background
    write raises at the next :func:`save` or :func:`finish`. Leaves of a multi-process sharded
    state have no local host copy: they are saved as device arrays, and the
    save is completed before returning.
    """
    step = int(host_value(state.step))
    if _host_copy_possible(state):
        _start_copies_to_host(state)
        tree, layout = packing.pack(flax.serialization.to_state_dict(state))
        meta, wait = {**meta, LAYOUT_KEY: layout, CHECKSUMS_KEY: packing.checksums(tree)}, False
    else:
        tree, wait = flax.serialization.to_state_dict(state), True
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


def _abstract(state):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        flax.serialization.to_state_dict(state))


def _read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _read_packed(mngr: ocp.CheckpointManager, step: int, meta: dict) -> dict | None:
    """The state dict of a packed checkpoint (host arrays, checked against its
    layout and checksums), or ``None`` for one written leaf by leaf.

    Raises:
      trjax.packing.DamagedCheckpoint: see :func:`trjax.packing.unpack`.
    """
    if LAYOUT_KEY not in meta:
        return None
    flat = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(packing.template(meta[LAYOUT_KEY]))))["state"]
    return packing.unpack(flat, meta[LAYOUT_KEY], meta.get(CHECKSUMS_KEY))


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
    other ``expect`` values (called before anything is compiled)."""
    newest = newest_meta(mngr)
    if newest is not None:
        _check_meta(*newest, expect)


def _check_meta(path: str, meta: dict, expect: dict) -> None:
    diff = {k: (meta.get(k), v) for k, v in expect.items() if meta.get(k) != v}
    if diff:
        raise ValueError(f"checkpoint {path} is incompatible with this config: " +
                         ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}"
                                   for k, (a, b) in diff.items()) +
                         "; use another workdir or the same settings")


def restore_latest(mngr: ocp.CheckpointManager, target, expect: dict, log=print):
    """Restores the newest readable checkpoint into ``target``'s shapes and shardings.

    Args:
      mngr: from :func:`manager`.
      target: a train state on the current world (only shapes, dtypes and
        shardings are used; its buffers are not read).
      expect: config fields that must match the checkpoint's ``meta``.
      log: where to report skipped (unreadable) checkpoints.

    Returns:
      ``(state, meta)``, or ``None`` if there is no checkpoint.

    Raises:
      ValueError: the checkpoint was written with other ``expect`` values or
        other array shapes (names the directory and the mismatch).
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

    for step in all_steps:
        path = os.path.join(str(mngr.directory), str(step))
        try:
            meta = _read_meta(mngr, step)
        except Exception as e:
            unreadable(path, e)
            continue
        _check_meta(path, meta, expect)
        try:
            packed = _read_packed(mngr, step, meta)  # host arrays, placed on the devices below
            leaves = None if packed is not None else mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target))))["state"]  # onto the devices
        except Exception as e:
            if isinstance(e, ValueError) and not isinstance(e, packing.DamagedCheckpoint) and (
                    "shape" in str(e).lower() or "mismatch" in str(e).lower()):
                raise ValueError(f"checkpoint {path} does not fit this model/world: {e}") from e
            unreadable(path, e)
            continue
        restored = (packing.place(target, packed, path) if packed is not None  # ValueError:
                    else flax.serialization.from_state_dict(target, leaves))  # another model
        _move_aside(mngr, bad, log)
        return restored, meta
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
      ``batch_stats``, ``opt_state``, ``step``, ...), and the meta item.

    Raises:
      FileNotFoundError: no checkpoint (at ``step``) in ``directory``.
    """
    mngr = ocp.CheckpointManager(os.path.abspath(directory))
    steps = mngr.all_steps()
    if step is None and steps:
        step = max(steps)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint {'' if step is None else step} in {directory} "
                                f"(steps there: {sorted(steps)})")
    meta = _read_meta(mngr, step)
    packed = _read_packed(mngr, step, meta)
    if packed is not None:
        return packed, meta
    return mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"], meta


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
