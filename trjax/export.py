"""Exports a trained run's evaluation function with ``jax.export`` (StableHLO).

  trjax-export WORKDIR OUT [--step N] [--ema] [--platforms cpu,cuda]
  python -m trjax.export WORKDIR OUT ...

Reads ``WORKDIR/config.json`` and the newest checkpoint in ``WORKDIR/checkpoints``
(or ``--step N``), rebuilds the run's model on ONE device, whatever mesh trained it
(:func:`one_device_config`), and writes into the new folder ``OUT``:

* ``model.jax_export``: the serialized :class:`jax.export.Exported` of
  ``predict(images uint8 [B, H, W, C]) -> logits float32 [B, K]``: the
  evaluation trjax runs in its eval step (the data set's standardisation
  ``(x - mean) / std`` included, BatchNorm folded into one scale and bias per
  channel, training flag off), with the parameters as constants, no
  ``shard_map`` and no collective. The batch dimension is symbolic (any
  ``B >= 1``) when the model traces with a symbolic batch; otherwise it is
  fixed to the run's ``eval_batch_size`` and the command says so.
* ``model.json``: the input shape and dtype, ``num_classes``, the class names
  (an ImageFolder run's; ``null`` otherwise), the checkpoint's step, the
  config's model and data set, the platforms the module was lowered for.

Load and call it with jax alone (no trjax, no flax)::

    import jax, numpy as np
    exported = jax.export.deserialize(open("OUT/model.jax_export", "rb").read())
    images = np.zeros((5, 8, 8, 1), np.uint8)          # uint8 [B, H, W, C], B any
    logits = exported.call(images)                     # float32 [B, num_classes]

The module runs on the platforms it was lowered for (``--platforms``; the
default is this host's backend, e.g. ``cpu``). Errors (``error: ...``, exit 1):
no checkpoint in WORKDIR, an ``OUT`` that exists and is not empty, a
checkpoint that does not fit the config's model, a config whose data set is not
the one the run trained on (in-memory data: use :func:`export` with ``data=``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

EXPORT_FILE = "model.jax_export"
"""The serialized ``jax.export.Exported`` under ``OUT``."""
META_FILE = "model.json"
"""What the exported function takes and returns, and where it comes from, under ``OUT``."""


@dataclasses.dataclass
class Restored:
    """A run's checkpoint restored for evaluation on one device (:func:`restore`).

    Attributes:
      config: the run's ``ml_collections.ConfigDict`` (``WORKDIR/config.json``).
      network: the :class:`trjax.models.Network` of the run's model.
      params: the parameters (a pytree of float arrays on one device).
      batch_stats: the BatchNorm running statistics (``[C]`` leaves).
      folded: ``network.fold(params, batch_stats)``: what the eval step reads.
      data: the :class:`trjax.data.Dataset` the model was built for.
      image_dtype: the dtype images enter the evaluation in (uint8 for uint8 data).
      step: the checkpoint's step.
      checkpoint: the checkpoint's directory.
    """
    config: Any
    network: Any
    params: Any
    batch_stats: Any
    folded: Any
    data: Any
    image_dtype: Any
    step: int
    checkpoint: str

    @property
    def image_shape(self) -> tuple:
        """``(H, W, C)`` of one example."""
        return tuple(self.data.image_shape)

    @property
    def num_classes(self) -> int:
        return int(self.data.num_classes)

    @property
    def class_names(self) -> list[str] | None:
        """The training split's class names (an ImageFolder source's), else ``None``."""
        names = getattr(self.data.train, "classes", None)
        return None if names is None else [str(n) for n in names]


def load_run_config(workdir: str):
    """The resolved config a run wrote (``WORKDIR/config.json``) as a ``ConfigDict``.

    Raises:
      FileNotFoundError: ``WORKDIR/config.json`` does not exist (names it).
    """
    import ml_collections
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {workdir} is not the workdir of a "
                                "trjax run (trjax-train --workdir DIR writes config.json and "
                                "checkpoints/ there)")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def _checkpoint_steps(ckpt_dir: str) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def _paths(tree) -> dict:
    import jax
    return {jax.tree_util.keystr(p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _fit(stored: dict, like, what: str, ckpt: str, log) -> Any:
    """``stored`` (a checkpoint's state dict) laid out as ``like`` (abstract
    variables); per-replica ``[world_size, C]`` rows (``bn_mode='local'``) give
    replica 0's. Raises ``ValueError`` naming the first leaf that does not fit."""
    import flax
    import jax
    import numpy as np
    want = _paths(flax.serialization.to_state_dict(like))
    got = _paths(stored)
    if set(want) != set(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(f"checkpoint {ckpt} does not hold the {what} of the config's model: "
                         f"missing {missing[:3]}, unexpected {extra[:3]}; the run used another "
                         "model (export from Python with trjax.export.export(..., model=...)) "
                         "or a mesh whose parameters are laid out otherwise")
    rows = False
    fitted = {}
    for k, w in want.items():
        x = np.asarray(got[k])
        if x.shape != tuple(w.shape):
            if x.ndim == len(w.shape) + 1 and x.shape[1:] == tuple(w.shape):
                x, rows = x[0], True  # one statistics row per replica: replica 0's
            else:
                raise ValueError(f"checkpoint {ckpt}: {what}{k} has shape {x.shape}, the "
                                 f"config's model expects {tuple(w.shape)}")
        fitted[k] = x.astype(w.dtype)
    if rows:
        log(f"the checkpoint holds one row of {what} per replica (bn_mode='local'): "
            "exporting replica 0's")
    leaves = [fitted[jax.tree_util.keystr(p)]
              for p, _ in jax.tree_util.tree_flatten_with_path(
                  flax.serialization.to_state_dict(like))[0]]
    as_dict = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(flax.serialization.to_state_dict(like)), leaves)
    return flax.serialization.from_state_dict(like, as_dict)


MESH_KEYS = {"devices": "1", "mesh": "", "pipeline_microbatches": 0, "pipeline_stage_starts": "",
             "pipeline_schedule": "gpipe", "pipeline_remat": True, "tensor_plan": "",
             "shard_optimizer_state": False, "compression": "none", "allreduce": "xla",
             "allreduce_local_size": 0}
"""The config keys that say how a run lay over its devices, and their one-device values."""


def one_device_config(config):
    """A copy of ``config`` on one device with the data axis only (:data:`MESH_KEYS`):
    the evaluation a checkpoint exports is the unsplit, folded function whatever
    mesh (``fsdp``, ``stage``, ``model``), exchange or ZeRO-1 trained it (a
    checkpoint holds whole leaves)."""
    config = config.copy_and_resolve_references()
    for key, value in MESH_KEYS.items():
        if key in config:
            config[key] = value
    return config


def restore(workdir: str, step: int | None = None, *, data=None, model=None,
            ema: bool = False, log: Callable[[str], None] = print) -> Restored:
    """A run's newest checkpoint (or ``step``), on one device, ready to evaluate.

    Builds the run's model from ``WORKDIR/config.json`` as
    :func:`trjax.train.prepare` does (one device, a data-parallel layout, nothing
    compiled), reads the checkpoint's parameters and BatchNorm statistics
    (:func:`trjax.train.checkpoint.read`) and folds them once.

    Args:
      workdir: a run's workdir (``config.json``, ``checkpoints/``).
      step: the checkpoint to read; ``None``: the newest.
      data: the :class:`trjax.data.Dataset` the run trained on, when it was
        not ``config.dataset`` (in-memory arrays passed to
        ``train_and_evaluate``); its ``mean`` / ``std`` standardise the input.
      model: the flax model the run was given (``model=``), if any.
      ema: the parameters' exponential moving average (``config.ema_decay``,
        :func:`trjax.exchange.with_ema`) instead of the parameters.
      log: one-line messages.

    Returns:
      A :class:`Restored`.

    Raises:
      FileNotFoundError: no ``config.json`` or no checkpoint (at ``step``).
      ValueError: the checkpoint does not fit the config's model, was
        trained on other data than the config's data set loads now, or holds
        no EMA (``ema=True``).
    """
    import jax
    from trjax.data import input_pipeline
    from trjax.train import checkpoint, trainer
    config = load_run_config(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    steps = _checkpoint_steps(ckpt_dir)
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {ckpt_dir}: the run saved none yet (trjax-train --workdir "
            f"{workdir} saves one after each epoch and at halt_after_steps); train first, or "
            "name the workdir of a run that saved one")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {ckpt_dir} (steps there: "
                                f"{steps}): pass one of them, or leave --step out for the newest")
    tr = trainer.prepare(one_device_config(config), data=data, model=model)
    state, meta = checkpoint.read(ckpt_dir, step)
    path = os.path.join(ckpt_dir, str(max(steps) if step is None else step))
    ident = trainer.data_identity(tr.data.train)
    differ = {k: (meta[k], v) for k, v in ident.items() if k in meta and meta[k] != v}
    if differ:
        raise ValueError(
            f"checkpoint {path} was trained on other data than config.dataset="
            f"{config.dataset!r} loads now (" + ", ".join(
                f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in differ.items()) +
            "): its standardisation and classes would not be the run's. Restore the "
            "training data the run used, or, for data given in memory, export from Python: "
            "trjax.export.export(workdir, out, data=<the Dataset the run trained on>)")
    net = tr.model
    like = net.abstract_variables(tr.data.image_shape)
    stored = state["params"]
    if ema:
        opt = state.get("opt_state")  # EmaState(opt, ema) as a state dict
        stored = opt.get("ema") if isinstance(opt, dict) else None
        if stored is None:
            raise ValueError(f"checkpoint {path} holds no EMA of the parameters (the run's "
                             f"config.ema_decay={config.ema_decay!r}): export without --ema, "
                             "or train with ema_decay > 0")
    params = _fit(stored, like["params"], "EMA params" if ema else "params", path, log)
    batch_stats = _fit(state.get("batch_stats", {}), like.get("batch_stats", {}),
                       "batch_stats", path, log)
    device = jax.devices()[0]
    params, batch_stats = jax.device_put((params, batch_stats), device)
    folded = jax.jit(net.fold)(params, batch_stats)
    image_dtype = input_pipeline.device_image_dtype(tr.data.image_dtype, tr.dtype)
    return Restored(config, net, params, batch_stats, folded, tr.data, image_dtype,
                    int(state["step"]), path)


def predict_fn(restored: Restored) -> Callable:
    """The folded evaluation function of ``restored``, parameters closed over.

    Returns:
      ``predict(images) -> logits``: ``images`` ``[B, H, W, C]`` of
      ``restored.image_dtype`` (uint8 for uint8 data), ``logits`` float32
      ``[B, num_classes]``; exactly the eval step's per-device computation
      (:func:`trjax.steps.make_eval_step`: :func:`trjax.models.normalize`, then
      ``network.apply_eval`` on the folded BatchNorm) without ``shard_map``.
    """
    import jax.numpy as jnp
    from trjax import models
    net, params, folded = restored.network, restored.params, restored.folded

    def predict(images):
        x = models.normalize(images, net.mean, net.std, net.dtype)
        return net.apply_eval(params, folded, x, True).astype(jnp.float32)

    return predict


def export(workdir: str, out: str, *, step: int | None = None,
           platforms: Sequence[str] | None = None, data=None, model=None, ema: bool = False,
           log: Callable[[str], None] = print) -> dict:
    """Writes ``OUT/model.jax_export`` and ``OUT/model.json`` (module docstring).

    Args:
      workdir: a run's workdir.
      out: a folder that does not exist or is empty (created).
      step: the checkpoint's step; ``None``: the newest.
      platforms: what to lower for (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``);
        ``None``: this host's default backend.
      data, model, ema: as for :func:`restore`.
      log: one-line messages.

    Returns:
      The metadata written to ``model.json``: ``input`` (``shape`` with ``"b"``
      for a symbolic batch, ``dtype``), ``output``, ``num_classes``,
      ``class_names``, ``step``, ``model``, ``dataset``, ``batch``
      (``"symbolic"`` or ``"fixed"``), ``platforms``, ...

    Raises:
      FileExistsError: ``out`` exists and is not an empty folder.
      FileNotFoundError, ValueError: as :func:`restore`.
    """
    import jax
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise FileExistsError(f"{out} exists and is not an empty folder: the export would mix "
                              "with what is there; delete it, or name a new folder")
    restored = restore(workdir, step, data=data, model=model, ema=ema, log=log)
    predict = jax.jit(predict_fn(restored))
    h, w, c = restored.image_shape
    dtype = restored.image_dtype
    platforms = tuple(platforms) if platforms else None
    try:
        spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape(f"b, {h}, {w}, {c}"), dtype)
        exported = jax.export.export(predict, platforms=platforms)(spec)
        batch, in_shape, out_shape = "symbolic", ["b", h, w, c], ["b", restored.num_classes]
    except Exception as e:  # a model that needs a concrete batch (e.g. reshapes by it)
        b = int(restored.config.eval_batch_size)
        log(f"the model does not export with a symbolic batch ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); exporting for the fixed batch {b} "
            "(config.eval_batch_size): call it with exactly that many images")
        exported = jax.export.export(predict, platforms=platforms)(
            jax.ShapeDtypeStruct((b, h, w, c), dtype))
        batch, in_shape, out_shape = "fixed", [b, h, w, c], [b, restored.num_classes]
    config, net = restored.config, restored.network
    meta = {
        "format": "jax.export",
        "file": EXPORT_FILE,
        "load": f"jax.export.deserialize(open('{EXPORT_FILE}', 'rb').read()).call(images)",
        "input": {"shape": in_shape, "dtype": str(dtype), "layout": "NHWC"},
        "output": {"shape": out_shape, "dtype": "float32", "what": "logits"},
        "batch": batch,
        "num_classes": restored.num_classes,
        "class_names": restored.class_names,
        "standardisation": {"mean": None if net.mean is None else [float(v) for v in net.mean],
                            "std": None if net.std is None else [float(v) for v in net.std],
                            "inside": True},
        "step": restored.step,
        "parameters": "ema" if ema else "params",
        "checkpoint": os.path.abspath(restored.checkpoint),
        "model": config.model,
        "dataset": config.dataset,
        "bn_mode": config.bn_mode,
        "precision": config.precision,
        "platforms": list(exported.platforms),
        "calling_convention_version": exported.calling_convention_version,
        "jax_version": jax.__version__,
    }
    serialized = bytes(exported.serialize())  # before OUT is created: a failure leaves nothing
    os.makedirs(out, exist_ok=True)
    for name, data_bytes in ((EXPORT_FILE, serialized),
                             (META_FILE, (json.dumps(meta, indent=2) + "\n").encode())):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data_bytes)
        os.replace(tmp, os.path.join(out, name))
    log(f"exported step {restored.step} of {workdir} ({config.model}, {batch} batch, "
        f"{','.join(exported.platforms)}) -> {os.path.join(out, EXPORT_FILE)}")
    return meta


def main(argv: list[str] | None = None) -> int:
    """The command (``[project.scripts] trjax-export``, ``python -m trjax.export``).

    Returns:
      0 on success; a bad workdir or ``OUT`` exits with ``error: <message>`` (status 1).
    """
    ap = argparse.ArgumentParser(
        prog="trjax-export", description="Exports a trjax run's folded evaluation function "
        "(uint8 images [B,H,W,C] -> float32 logits [B,K]) with jax.export.",
        epilog="Load it: jax.export.deserialize(open('OUT/model.jax_export', 'rb').read())"
               ".call(images)")
    ap.add_argument("workdir", help="a run's workdir (config.json, checkpoints/)")
    ap.add_argument("out", help="a new (or empty) folder for model.jax_export and model.json")
    ap.add_argument("--step", type=int, default=None,
                    help="the checkpoint's step (default: the newest)")
    ap.add_argument("--ema", action="store_true",
                    help="export the parameters' moving average (a run with ema_decay > 0)")
    ap.add_argument("--platforms", default="",
                    help="comma-separated platforms to lower for, e.g. cpu,cuda "
                         "(default: this host's backend)")
    args = ap.parse_args(argv)
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()] or None
    try:
        export(args.workdir, args.out, step=args.step, platforms=platforms, ema=args.ema)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        sys.exit(f"error: {e}")  # ImportError: jax's serialization needs flatbuffers
    return 0


if __name__ == "__main__":
    sys.exit(main())
