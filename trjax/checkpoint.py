"""Checkpoints with orbax: the whole train state plus where the data stream stands.

A checkpoint at step s holds the :class:`trjax.steps.TrainState` (parameters,
optimizer state, BN statistics, step, skipped steps, loss scale) and a JSON
``meta`` item: epoch, batch index inside the epoch, seed and the config fields
that must not change across a resume. The data order is a pure function of
``(seed, epoch)``, so ``(seed, epoch, batch)`` is the whole data/RNG position.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a run killed during a save leaves the previous checkpoints
readable. Arrays are stored as global (replicated) arrays: the layout does not
depend on the device count, and a checkpoint written on 8 devices restores on
4 or 1 (``local`` BN mode, whose statistics have one row per replica, is the
exception: it restores on the same world size only).

Resume policy: :func:`restore_latest` tries the newest checkpoint first; one
that cannot be read (truncated, corrupt) is reported and left untouched, and
the next older one is tried. A readable checkpoint whose config does not match
is an error (no silent fallback: resuming it would be wrong).
"""

from __future__ import annotations

import os

import flax
import jax
import orbax.checkpoint as ocp

from trjax.world import host_value

COMPATIBLE_FIELDS = ("model", "bn_mode", "global_batch_size", "dataset", "optimizer",
                     "precision", "seed", "buckets", "compression", "shard_optimizer_state")


def manager(directory: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
    """An orbax manager on ``directory`` (created if needed), synchronous saves.

    Saves are synchronous: the train step donates the state it is given, so the
    checkpoint must be written before the next step reuses those buffers.
    """
    os.makedirs(directory, exist_ok=True)
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=False))


def save(mngr: ocp.CheckpointManager, state, meta: dict) -> None:
    """Saves ``state`` and ``meta`` (JSON-able) under ``int(state.step)``."""
    step = int(host_value(state.step))
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
        meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()


def _abstract(state):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        flax.serialization.to_state_dict(state))


def check_compatible(mngr: ocp.CheckpointManager, expect: dict, log=print) -> None:
    """Raises ``ValueError`` if the newest readable checkpoint was written with
    other ``expect`` values (called before anything is compiled)."""
    for step in sorted(mngr.all_steps(), reverse=True):
        path = os.path.join(str(mngr.directory), str(step))
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:
            continue  # unreadable: restore_latest reports it and falls back
        _check_meta(path, meta, expect)
        return


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
    all_steps = sorted(mngr.all_steps(), reverse=True)
    if not all_steps:
        return None
    errors = []

    def unreadable(path, e):  # report it, keep its files, try the next older one
        errors.append(f"{path}: {type(e).__name__}: {str(e)[:300]}")
        log(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
            "left in place, trying an older one")

    for step in all_steps:
        path = os.path.join(str(mngr.directory), str(step))
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            unreadable(path, e)
            continue
        _check_meta(path, meta, expect)
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target))))["state"]
        except Exception as e:
            if isinstance(e, ValueError) and ("shape" in str(e).lower() or
                                              "mismatch" in str(e).lower()):
                raise ValueError(f"checkpoint {path} does not fit this model/world: {e}") from e
            unreadable(path, e)
            continue
        return flax.serialization.from_state_dict(target, restored), meta
    raise RuntimeError("no readable checkpoint in " + str(mngr.directory) + ":\n  " +
                       "\n  ".join(errors))
