"""Start from weights: another run's checkpoint or a parameter file, loaded by name.

``config.init_from`` (or ``prepare(..., init_from=)``) names where a fresh run's
parameters and BatchNorm statistics come from, as timm's ``--initial-checkpoint``
and big_vision's ``model_init`` do:

- a trjax workdir, or its ``checkpoints`` folder (the newest step is read with
  :func:`trjax.train.checkpoint.read`, checksums verified);
- a ``.npz`` file whose keys are ``/``-joined paths (``params/stem_conv/kernel``;
  keys without a ``params/`` or ``batch_stats/`` head are parameters);
- a flax msgpack file (``flax.serialization.msgpack_serialize`` of the
  variables, or of the parameters alone);
- in Python, a tree ``{"params": ..., "batch_stats": ...}`` of arrays.

Each leaf of the new model is taken from the leaf of the same path when the
shapes agree; a leaf whose shape differs (a classifier for another number of
classes) keeps its fresh initialisation, and so does a leaf the weights do not
hold. What was loaded, re-initialised and left unused is printed; a load that
matches no leaf is an error before anything compiles. Only a fresh run loads:
a run that resumes from its own checkpoint continues from it. The optimizer
state starts fresh; an EMA (``ema_decay``) starts at the loaded parameters.
"""

from __future__ import annotations

import dataclasses
import os
import jax
import numpy as np
from flax import traverse_util

COLLECTIONS = ("params", "batch_stats")


def _nest(flat: dict) -> dict:
    out = {c: {} for c in COLLECTIONS}
    for key, v in flat.items():
        parts = key.split("/")
        head = parts[0] if parts[0] in COLLECTIONS else "params"
        parts = parts[1:] if parts[0] in COLLECTIONS else parts
        out[head]["/".join(parts)] = np.asarray(v)
    return out


def _flat(tree) -> dict:
    """``{"a/b/kernel": array}`` of a nested dict (flax's ``{"params": ...}`` or a bare one)."""
    if not isinstance(tree, dict):
        tree = dict(tree)
    flat = traverse_util.flatten_dict(tree, sep="/")
    return {k: v for k, v in flat.items() if hasattr(v, "shape")}


def read_weights(source) -> dict:
    """``{"params": {path: array}, "batch_stats": {path: array}}`` (flat,
    ``/``-joined paths, numpy) from any of the module docstring's sources.

    Raises:
      FileNotFoundError: a path that does not exist.
      ValueError: a folder without checkpoints, or a file of another kind
        (names the path and the kinds read).
    """
    if isinstance(source, dict):
        return _nest(_flat(source))
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"init_from={path!r} does not exist: give a trjax workdir, its "
                                "checkpoints folder, a .npz or a flax .msgpack file")
    if os.path.isdir(path):
        from trjax.train import checkpoint
        folder = os.path.join(path, "checkpoints")
        folder = folder if os.path.isdir(folder) else path
        try:
            state, _ = checkpoint.read(folder)
        except FileNotFoundError as e:
            raise ValueError(f"init_from={path!r} holds no trjax checkpoint ({e}): give a "
                             "workdir of a run that saved one, or a parameter file") from None
        return _nest({**{f"params/{k}": v for k, v in _flat(state["params"]).items()},
                      **{f"batch_stats/{k}": v for k, v in
                         _flat(state.get("batch_stats") or {}).items()}})
    if path.endswith(".npz"):
        with np.load(path) as z:
            return _nest({k: z[k] for k in z.files})
    if path.endswith(".msgpack"):
        from flax import serialization
        with open(path, "rb") as f:
            return _nest(_flat(serialization.msgpack_restore(f.read())))
    raise ValueError(f"init_from={path!r}: trjax reads a workdir or checkpoints folder, a .npz "
                     "or a flax .msgpack file")


@dataclasses.dataclass
class LoadPlan:
    """What :func:`plan_load` matched: ``values`` ``{collection: {path: array}}``
    to load (cast to the model's dtypes); ``loaded``, ``missing`` (the model's
    paths the weights lack), ``reinitialised`` (``(path, model shape, stored
    shape)``) and ``unused`` (stored paths the model lacks)."""
    values: dict
    loaded: list
    missing: list
    reinitialised: list
    unused: list

    def describe(self) -> str:
        """A few lines for the log: counts, and every re-initialised leaf."""
        lines = [f"init_from: loaded {len(self.loaded)} leaves, re-initialised "
                 f"{len(self.reinitialised)} (another shape), kept {len(self.missing)} fresh "
                 f"(not in the weights), {len(self.unused)} stored leaves unused"]
        lines += [f"  re-initialised {p}: the model's {w}, stored {g}"
                  for p, w, g in self.reinitialised]
        if self.missing:
            lines.append(f"  fresh: {', '.join(self.missing[:8])}"
                         + (" ..." if len(self.missing) > 8 else ""))
        if self.unused:
            lines.append(f"  unused: {', '.join(self.unused[:8])}"
                         + (" ..." if len(self.unused) > 8 else ""))
        return "\n".join(lines)


def plan_load(abstract: dict, weights: dict) -> LoadPlan:
    """Matches ``weights`` (:func:`read_weights`) to the model's variables.

    Args:
      abstract: the model's ``{"params", "batch_stats"}`` with
        ``jax.ShapeDtypeStruct`` (or array) leaves
        (:meth:`trjax.models.Network.abstract_variables`).
      weights: from :func:`read_weights`.

    Raises:
      ValueError: no leaf matched by path and shape (names a few paths of
        each side: usually a prefix, e.g. a wrapper's ``inner/``).
    """
    values, loaded, missing, reinit = {c: {} for c in COLLECTIONS}, [], [], []
    stored = {f"{c}/{p}" for c in COLLECTIONS for p in weights.get(c, {})}
    for c in COLLECTIONS:
        for path, leaf in _flat(abstract.get(c) or {}).items():
            name = f"{c}/{path}"
            got = weights.get(c, {}).get(path)
            if got is None:
                missing.append(name)
            elif tuple(got.shape) != tuple(leaf.shape):
                reinit.append((name, tuple(leaf.shape), tuple(got.shape)))
            else:
                values[c][path] = np.asarray(got).astype(leaf.dtype)
                loaded.append(name)
    unused = sorted(stored - set(loaded) - {n for n, _, _ in reinit})
    if not loaded:
        raise ValueError(f"init_from matched none of the model's {len(missing) + len(reinit)} "
                         f"leaves by path and shape: the model has e.g. {sorted(missing)[:3]}, "
                         f"the weights {sorted(stored)[:3]}; rename the weights' paths (a "
                         "wrapper adds a prefix) or load into the model they came from")
    return LoadPlan(values, loaded, sorted(missing), reinit, unused)


def _put(host: np.ndarray, like: jax.Array) -> jax.Array:
    """``host`` as a global array with ``like``'s sharding; a ``[C]`` statistic
    into ``local`` mode's ``[R, C]`` rows (every replica the same)."""
    if host.shape != like.shape:
        host = np.broadcast_to(host, like.shape)
    host = np.ascontiguousarray(host, dtype=like.dtype)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda idx: host[idx])


def _replace(tree, flat_values: dict):
    def one(path, leaf):
        key = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return _put(flat_values[key], leaf) if key in flat_values else leaf
    return jax.tree_util.tree_map_with_path(one, tree)


def apply(state, plan: LoadPlan):
    """The train state with ``plan``'s leaves placed (each leaf keeps its
    sharding: replicated, split over fsdp/stage/model, or ``local`` rows), and
    an EMA (:func:`trjax.exchange.with_ema`) restarted at the loaded
    parameters. Every process calls it with the same weights."""
    from trjax.exchange import EmaState
    params = _replace(state.params, plan.values["params"])
    stats = _replace(state.batch_stats, plan.values["batch_stats"])
    opt_state = state.opt_state
    if isinstance(opt_state, EmaState):
        opt_state = opt_state._replace(ema=_replace(opt_state.ema, plan.values["params"]))
    return state.replace(params=params, batch_stats=stats, opt_state=opt_state)


# -- torchvision's ResNets -> trjax's ----------------------------------------------------------

_TV_BN = {"weight": ("params", "scale"), "bias": ("params", "bias"),
          "running_mean": ("batch_stats", "mean"), "running_var": ("batch_stats", "var")}


def _tv_module(parts: list[str]) -> str:
    """torchvision's module path (``layer2.0.conv1``) -> trjax's (``stage2_block1/Conv_0``)."""
    if parts[0] in ("conv1", "bn1"):
        return {"conv1": "stem_conv", "bn1": "stem_bn"}[parts[0]]
    if parts[0] == "fc":
        return "head"
    if parts[0].startswith("layer") and len(parts) >= 3:
        block = f"stage{int(parts[0][5:])}_block{int(parts[1]) + 1}"
        inner = parts[2:]
        if inner[0] == "downsample":
            return f"{block}/{'proj_conv' if inner[1] == '0' else 'proj_bn'}"
        kind, n = inner[0].rstrip("0123456789"), int(inner[0][len(inner[0].rstrip('0123456789')):])
        return f"{block}/{'Conv' if kind == 'conv' else 'BatchNorm'}_{n - 1}"
    raise KeyError(".".join(parts))


def from_torchvision_resnet(state_dict) -> dict:
    """torchvision's ResNet ``state_dict`` (resnet18/34/50, any ``num_classes``)
    as trjax's ResNet variables: ``{"params": ..., "batch_stats": ...}`` of
    numpy arrays, for ``init_from`` (save it with :func:`save_npz`).

    Names: ``conv1``/``bn1`` -> ``stem_conv``/``stem_bn``; ``layer{i}.{j}.conv{n}``
    / ``bn{n}`` -> ``stage{i}_block{j+1}/Conv_{n-1}`` / ``BatchNorm_{n-1}``;
    ``downsample.0``/``.1`` -> ``proj_conv``/``proj_bn``; ``fc`` -> ``head``.
    Layouts: a conv weight ``[O, I, kh, kw]`` becomes a kernel ``[kh, kw, I, O]``,
    ``fc.weight [K, F]`` a kernel ``[F, K]``; BatchNorm ``weight``/``bias`` the
    ``scale``/``bias`` parameters, ``running_mean``/``running_var`` the
    statistics (``num_batches_tracked`` is dropped). trjax's ImageNet ResNets
    have torchvision's padding (stem 3, max-pool 1) and strides (v1.5: the 3x3
    of a bottleneck), so the logits agree on the same normalised input.

    Raises:
      ValueError: a key that is not a torchvision ResNet's (names it).
    """
    out = {"params": {}, "batch_stats": {}}
    for key, value in state_dict.items():
        parts = key.split(".")
        if parts[-1] == "num_batches_tracked":
            continue
        try:
            module = _tv_module(parts[:-1])
        except (KeyError, ValueError, IndexError):
            raise ValueError(f"{key!r} is not a torchvision ResNet state_dict key (conv1, bn1, "
                             "layer{i}.{j}.conv{n}/bn{n}/downsample, fc)") from None
        v = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
        if parts[-1] == "weight" and v.ndim == 4:
            out["params"][f"{module}/kernel"] = v.transpose(2, 3, 1, 0)
        elif parts[-1] == "weight" and module == "head":
            out["params"]["head/kernel"] = v.T
        elif module == "head":
            out["params"]["head/bias"] = v
        else:
            collection, name = _TV_BN[parts[-1]]
            out[collection][f"{module}/{name}"] = v
    return {c: traverse_util.unflatten_dict(d, sep="/") for c, d in out.items()}


def save_npz(path, variables: dict) -> str:
    """Writes ``{"params", "batch_stats"}`` as a ``.npz`` of ``/``-joined paths
    (what ``init_from`` reads). Returns the path."""
    flat = {f"{c}/{k}": np.asarray(v) for c in COLLECTIONS
            for k, v in _flat(variables.get(c) or {}).items()}
    np.savez(path, **flat)
    return os.fspath(path)

