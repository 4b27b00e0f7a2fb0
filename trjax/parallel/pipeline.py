"""Pipeline parallelism (GPipe, 1F1B, ZB-H1) for trjax's ResNets and sequences of layers,
one SPMD program.

:func:`layout` is the :class:`~trjax.parallel.layout.Layout` of a mesh with a
``stage`` axis (``config.mesh="data:2,stage:4"``): its ``forward_backward`` is
:func:`pipeline_forward_backward` with the schedule bound, which
:func:`trjax.steps.make_train_step` calls like any other (design v2: the
parameters are split over ``stage`` and each stage's leaves gathered whole onto its
own devices for the step, :mod:`trjax.parallel.stage_owned`). Sources: GPipe (Huang et al., "GPipe: Efficient Training of Giant
Neural Networks using Pipeline Parallelism", NeurIPS 2019: fill/drain schedule,
the backward from the forward loop); the jax ``shard_map`` notebook,
§"SPMD pipeline parallelism" (a loop of ``M + S - 1`` ticks and a ``ppermute``
shift per tick); praxis ``praxis/layers/pipeline.py`` (bubble iterations must
not touch parameters' gradients nor BatchNorm statistics; the NaN-polluted
bubble test); torchgpipe ``DeferredBatchNorm`` (each micro-batch is normalised
with its own statistics, the running statistics add every micro-batch's sums
once per step).

Layout. The ResNet's residual blocks are split into ``S`` contiguous stages
(:func:`plan_stages`; the stem goes with the first stage, the pooling + dense
head with the last), balanced by multiply-accumulates. Stage ``s`` runs on the
devices of mesh coordinate ``stage = s``; only one activation tensor crosses
each stage boundary (the skips stay inside their block).

Schedule (:func:`pipeline_forward_backward`, called per device inside
``jax.shard_map`` over ``("data", "stage")``): a ``lax.scan`` over ``T = M + S
- 1`` ticks; at tick ``t`` the device of stage ``s`` runs its stage
(``lax.switch(s, [stage_fn_0, ...])``) on micro-batch ``j = t - s``; then one
exact-shape ``lax.ppermute`` per boundary ``b`` (the single pair ``(b, b +
1)``) hands the stage outputs on. Slots with ``j`` outside ``[0, M)`` are
bubbles: all-padding micro-batches (mask 0), their inputs replaced by zeros by
select (never by multiplication), so whatever the buffers held (NaN included)
reaches no gradient, metric or BatchNorm sum. The backward is autodiff's
transpose of the loop (GPipe's drain: the inverse permutes carry the
cotangents upstream).

Memory. Differentiating a ``lax.switch`` stores, per tick, the residuals of
every branch (the untaken ones as zeros), so without ``remat`` the loop keeps
S stages' residuals for each of the M + S - 1 ticks; ``remat=True`` keeps only
each stage call's inputs and recomputes the stage in the backward (the test
model at S = 3, M = 4 on XLA:CPU: temp 379 KB -> 98 KB). The 1F1B schedule
(:func:`_one_f_one_b`) stashes O(S) micro-batches' stage inputs instead of O(M).

Equivalence. Micro-batch ``j`` on data rank ``r`` holds the local rows ``[j
mu, (j + 1) mu)``, ``mu = local / M``: the grouping of
:func:`trjax.objective.forward_backward` with ``grad_accumulation_steps = M``, so
the two agree up to the order of fp32 sums (BatchNorm normalises each
micro-batch with its own statistics in both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import comm, models, tensor
from trjax.batchnorm import BatchNormContext, linen_interceptor
from trjax.collectives import as_varying
from trjax.metrics import batch_metrics
from trjax.objective import StepOptions, example_losses
from trjax.parallel import fsdp, zero_bubble
from trjax.parallel.layout import Layout, check_bn_mode
from trjax.parallel.stage_owned import StageRows, subtree


# -- the stages: contiguous runs of residual blocks ---------------------------------------


def balanced_split(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of ``costs`` into ``num_stages`` non-empty
    parts minimising the largest part's sum (exact dynamic programme, ties to
    the earliest cut).

    Raises:
      ValueError: ``num_stages < 1`` or more stages than items.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} residual blocks into {num_stages} stages: "
                         f"use 1..{n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    # best[k][i]: min over splits of items [0, i) into k parts of the max part
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for m in range(k - 1, i):
                v = max(best[k - 1][m], prefix[i] - prefix[m])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, m
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        m = cut[k][i]
        bounds.append((m, i))
        i = m
    return bounds[::-1]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How a ResNet is split into pipeline stages.

    Attributes:
      blocks: the residual block names (a sequence's layer names, ``layers_i``)
        in call order.
      bounds: per stage ``(lo, hi)``: it runs ``blocks[lo:hi]`` (stage 0 also
        the stem, the last stage also the head).
      first, last: the names the first / last stage owns besides its blocks
        (a ResNet's stem and head; none for a sequence).
      macs: per stage, multiply-accumulates per example.
      shares: per stage, its fraction of the model's MACs.
      imbalance: ``max(macs) / mean(macs)`` (1 = perfectly balanced; the
        pipeline's efficiency is at most ``1 / imbalance``).
    """
    blocks: tuple
    bounds: tuple
    macs: tuple
    shares: tuple
    imbalance: float
    first: tuple = ("stem_conv", "stem_bn")
    last: tuple = ("head",)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def names(self, s: int) -> list[str]:
        """The top-level parameter names stage ``s`` owns (stem / blocks / head)."""
        lo, hi = self.bounds[s]
        names = list(self.blocks[lo:hi])
        if s == 0:
            names = list(self.first) + names
        if s == self.num_stages - 1:
            names = names + list(self.last)
        return names


SPLITTABLE = ("trjax's ResNets (trjax.models.ResNet) or a sequence of layers (flax nn.Sequential, "
              "nnx.Sequential or a list of layers)")
SEQUENCES = (models.FlaggedSequential, models.NNXSequence)


def _units(module, image_shape) -> tuple[list[str], list[float], dict]:
    """``(names, costs, StagePlan fields)`` of what a pipeline splits: a ResNet's
    residual blocks (MACs) or a sequence's layers (XLA's flops / 2)."""
    if isinstance(module, models.ResNet):
        info = module.blocks_info(image_shape)
        return [b["name"] for b in info], [b["macs"] for b in info], {}
    _check_splittable(module)
    info = module.layer_costs(image_shape)
    return [b["name"] for b in info], [b["flops"] / 2 for b in info], {"first": (), "last": ()}


def _check_splittable(module) -> None:
    """Raises ``ValueError`` unless a pipeline can split ``module`` (a ResNet or a
    sequence), naming the way to write another model as a sequence."""
    if isinstance(module, (models.ResNet,) + SEQUENCES):
        return
    cls = type(module)
    raise ValueError(f"a 'stage' mesh axis splits {SPLITTABLE} into stages; your model "
                     f"{cls.__module__}.{cls.__qualname__} is neither: write it as "
                     "nn.Sequential([...]) (or nnx.Sequential(...), or a list) of layers that "
                     "each take one array (a residual block is one layer; each gets the "
                     "training flag it takes), use a built-in ResNet, or a mesh without 'stage'")


def plan_stages(module, image_shape: Sequence[int], num_stages: int,
                starts: Sequence[str] | None = None) -> StagePlan:
    """Splits a ResNet's residual blocks, or a sequence's layers, into
    ``num_stages`` contiguous stages balanced by their cost.

    Args:
      module: a :class:`trjax.models.ResNet` (cost: MACs) or a
        :class:`trjax.models.FlaggedSequential` (a flax ``nn.Sequential`` as
        :func:`trjax.models.as_network` holds it; cost: XLA's cost analysis of
        each layer alone, :meth:`~trjax.models.FlaggedSequential.layer_costs`;
        torchgpipe's ``nn.Sequential`` contract).
      image_shape: ``(H, W, C)`` of one image (for the MACs).
      num_stages: S >= 1.
      starts: ``None`` (balanced by MACs, :func:`balanced_split`) or the S - 1
        block names that begin stages 1 .. S-1, in call order.

    Returns:
      A :class:`StagePlan` (each stage's MAC share in ``shares``).

    Raises:
      ValueError: a model of another kind (naming the way to express it as a
        sequence); from :meth:`trjax.models.ResNet.blocks_info` /
        :func:`balanced_split`; ``starts`` of the wrong length, naming an unknown
        block or the first block, or out of order.
    """
    names, costs, extra = _units(models.splittable(module), image_shape)
    if starts is None:
        bounds = balanced_split(costs, num_stages)
    else:
        starts = list(starts)
        if len(starts) != num_stages - 1:
            raise ValueError(f"{num_stages} stages need {num_stages - 1} stage starts, got "
                             f"{starts}")
        unknown = [s for s in starts if s not in names[1:]]
        if unknown:
            raise ValueError(f"stage starts {unknown} are not blocks after the first; the "
                             f"blocks are {names}")
        idx = [names.index(s) for s in starts]
        if idx != sorted(set(idx)):
            raise ValueError(f"stage starts {starts} must be distinct and in call order")
        edges = [0] + idx + [len(names)]
        bounds = list(zip(edges[:-1], edges[1:]))
    macs = tuple(sum(costs[lo:hi]) for lo, hi in bounds)
    total = sum(macs)
    return StagePlan(blocks=tuple(names), bounds=tuple(bounds), macs=macs,
                     shares=tuple(m / total for m in macs),
                     imbalance=max(macs) / (total / len(macs)), **extra)


def stage_modules(module, plan: StagePlan) -> list[nn.Module]:
    """One module per stage of ``plan``: the model itself, run over the stage's
    blocks (``ResNet(blocks=(lo, hi))``: the stem with the first, the head with
    the last; ``FlaggedSequential(span=(lo, hi))``); each reads the whole
    model's parameter / ``batch_stats`` paths of the names it owns
    (:meth:`StagePlan.names`)."""
    module = models.splittable(module)
    key = "blocks" if isinstance(module, models.ResNet) else "span"
    return [module.clone(**{key: (lo, hi)}) for lo, hi in plan.bounds]


# -- the pipelined forward + backward -------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
"""Pipeline schedules (``config.pipeline_schedule``): GPipe (Huang et al. 2019) and
1F1B (PipeDream-Flush: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021; Megatron-LM's ``forward_backward_pipelining_without_interleaving``) and
ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; :mod:`trjax.parallel.zero_bubble`)."""




def pipeline_forward_backward(model, params, batch_stats, batch, num_microbatches: int,
                              plan: StagePlan | None = None, loss_scale=None,
                              bn_mode: str = "running", data_axis: str = "data",
                              stage_axis: str = "stage", num_stages: int | None = None,
                              loss_fn=None, label_smoothing: float = 0.0,
                              remat: bool = False, bubble_fill: float = 0.0,
                              schedule: str = "gpipe", select=None, rng=None):
    """Per device, GPipe: gradients of the summed loss, metric sums, BN batch sums.

    Call inside ``jax.shard_map`` over a mesh with axes ``(data_axis,
    stage_axis)`` (:func:`trjax.world.make_world` with ``mesh="data:D,stage:S"``),
    the batch split over ``data`` and replicated over ``stage``; ``params`` the
    whole tree on every device, or (``select``) the stage's own leaves packed. The parameters are cast to varying over both axes here (if they are
    not already), so every result is this device's own part; summing over
    ``stage_axis`` (e.g. the gradient exchange run over ``(data, stage)``) gives
    what :func:`trjax.objective.forward_backward` with ``grad_accumulation_steps =
    num_microbatches`` returns on that data rank.

    Args:
      model: a :class:`trjax.models.Network` wrapping, or a bare,
        :class:`trjax.models.ResNet` (its BatchNorm mode must be ``bn_mode``) or
        :class:`trjax.models.FlaggedSequential` (flax's ``nn.Sequential``).
      params: the full parameter tree.
      batch_stats: this device's BN running statistics (full tree, ``[C]`` leaves).
      batch: ``{"image": [L, H, W, C], "label": [L] int32, "mask": [L] float32}``
        (the local batch of this data rank; standardised here with
        :func:`trjax.models.normalize`).
      num_microbatches: M; micro-batch ``j`` holds rows ``[j L/M, (j+1) L/M)``.
      plan: the stage split (:func:`plan_stages`), or ``None``: balanced by MACs
        over ``num_stages`` (default: the size of ``stage_axis``).
      loss_scale: multiplies the loss before backward (fp16), or ``None``.
      bn_mode: ``"running"`` (each micro-batch normalised with its own rows'
        statistics), ``"sync"`` (each micro-batch's statistics psum'ed over
        ``data_axis``, inside the stage's switch branch: every member of a data
        group runs the same stage; checked on XLA:CPU only) or ``"local"``
        (untested). The model's BatchNorm mode and axis name must match.
      data_axis, stage_axis: the mesh axis names.
      loss_fn, label_smoothing: the per-example loss
        (:func:`trjax.objective.example_losses`); default softmax cross-entropy.
      remat: ``jax.checkpoint`` each stage call (the backward recomputes the
        stage; stored per tick: its inputs only).
      bubble_fill: the value bubble slots' input buffers hold before masking
        (a test hook: NaN must give bitwise the same results as 0).
      schedule: ``"gpipe"`` (all forwards, then autodiff's backward through
        the tick loop) or ``"1f1b"`` (:func:`_one_f_one_b`: an explicit backward
        per micro-batch, at most 2S - 1 stage inputs stashed per device instead
        of every tick's; ``remat`` does not apply, its backward always recomputes)
        or ``"zb-h1"`` (:func:`trjax.parallel.zero_bubble.forward_backward`: a tick
        table with the backward split into the input and the weight gradient).
      select: ``(k, params) -> stage k's subtree {name: ...}``; ``None``: ``params``
        is the whole tree (design v1) and stage k takes its names' subtrees. The
        stage-owned layout passes its packed rows
        (:meth:`trjax.parallel.stage_owned.StageRows.select`): the gradient is then
        of the same packed structure, this stage's leaves only.
      rng: this data rank's step key (:func:`trjax.objective.dropout_key`
        without ``micro``): micro-batch ``j`` draws from ``fold_in(rng, j)``, as
        under gradient accumulation; ``None``: no random streams.

    Returns:
      ``(grads, sums [4] float32, bn_sums, rules)`` as
      :func:`trjax.objective.forward_backward`, per device: ``grads`` (the full
      tree, float32) are nonzero only on the leaves of this device's stage;
      ``sums`` (``[loss_sum, top1, top5, count]``) are nonzero on the last
      stage only; ``bn_sums`` (every BatchNorm's ``{"sums": [2C+1]}``) hold this
      stage's layers' sums over its M valid micro-batches and zeros for the
      other stages' layers; ``rules`` every BatchNorm's running rule.

    Raises:
      ValueError (while tracing): the model is neither a ResNet nor a sequence
        (:func:`plan_stages`); a ResNet's ``bn_mode``
        differs from ``bn_mode``; M < 1, M < S, or L not divisible by M; a plan
        for another stage count than the mesh's; more stages than blocks.
    """
    net = models.as_network(model)
    S = lax.axis_size(stage_axis) if num_stages is None else int(num_stages)
    M = int(num_microbatches)
    _check_schedule(models.splittable(net), bn_mode, batch["image"].shape[0], M, S, schedule)
    if plan is None:
        plan = plan_stages(net, batch["image"].shape[1:], S)
    if plan.num_stages != S:
        raise ValueError(f"the stage plan has {plan.num_stages} stages, the mesh axis "
                         f"{stage_axis!r} {S}")
    rules: dict = {}
    if select is None:
        select = lambda k, p: subtree(p, plan.names(k))  # noqa: E731
    run_stage = _stage_runner(stage_modules(net, plan), plan, batch_stats, bn_mode,
                              data_axis, remat, rules, select, rng, net._split)
    lp = _loop(net, batch, params, run_stage, S, M, bn_mode, fsdp._axes(data_axis, stage_axis),
               bubble_fill)
    branches = [_forward_branch(k, run_stage, lp, loss_fn, label_smoothing) for k in range(S)]
    p = jax.tree_util.tree_map(lambda a: as_varying(a, lp.axes), params)
    loss = lambda y, label, mask: _loss_sum(y, label, mask, loss_fn, label_smoothing,  # noqa: E731
                                            loss_scale)
    if schedule == "zb-h1":
        grads, sums, bn_sums = zero_bubble.forward_backward(p, branches, run_stage, lp, loss)
    elif schedule == "1f1b":
        grads, sums, bn_sums = _one_f_one_b(
            p, branches, run_stage, lp,
            lambda y, label, mask: _loss_sum(y, label, mask, loss_fn, label_smoothing,
                                             loss_scale))
    else:
        grads, sums, bn_sums = _gpipe(p, branches, lp, loss_scale)
    models.check_batch_stats(batch_stats, rules)
    return grads, sums, bn_sums, rules


def _check_schedule(module, bn_mode: str, rows: int, M: int, S: int, schedule: str) -> None:
    """The checks :func:`pipeline_forward_backward` makes while tracing."""
    if not isinstance(module, (models.ResNet,) + SEQUENCES):
        raise ValueError(f"the pipeline splits {SPLITTABLE}, got {type(module).__name__}")
    if isinstance(module, models.ResNet) and module.bn_mode != bn_mode:
        raise ValueError(f"the model's BatchNorm mode {module.bn_mode!r} differs from "
                         f"bn_mode {bn_mode!r}")
    if M < 1 or rows % M:
        raise ValueError(f"the local batch of {rows} rows does not split into {M} micro-batches")
    if M < S:
        raise ValueError(f"{M} micro-batches cannot fill {S} stages: use at least {S} "
                         f"(GPipe's rule of thumb: {4 * S})")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {SCHEDULES}")


def _stage_runner(mods, plan: StagePlan, batch_stats, bn_mode: str, data_axis: str,
                  remat: bool, rules: dict, select, rng=None, split=contextlib.nullcontext):
    """``run_stage(k, params, x_in, mask, j) -> (y, bn_sums)``: stage ``k``'s module on
    its own subtrees (``select(k, params)``; ``jax.checkpoint``-ed with ``remat``) for
    micro-batch ``j``, whose random streams come from ``fold_in(rng, j)`` as under
    gradient accumulation (:func:`trjax.objective.forward_backward`; a layer's key
    folds in its own path, the same in a stage as in the whole model); every
    BatchNorm's running rule lands in ``rules``; ``split``: the tensor plan's interception
    (:meth:`trjax.models.Network._split`), a null context without one."""
    def run_stage(k, p, x_in, mask, j=0):
        names = plan.names(k)
        ctx = BatchNormContext(bn_mode, data_axis, mask)

        def call(p, x_in, mask, j):
            if isinstance(mods[k], models.NNXSequence):
                key = None if rng is None else jax.random.fold_in(rng, j)
                return mods[k].apply_span(select(k, p), subtree(batch_stats, names), x_in, ctx,
                                          key)
            rngs = None if rng is None else models._linen_rngs(jax.random.fold_in(rng, j))
            with nn.intercept_methods(linen_interceptor(ctx)), split():
                y, new = mods[k].apply(
                    {"params": select(k, p), "batch_stats": subtree(batch_stats, names)},
                    x_in, train=True, mutable=["batch_stats", "bn_sums"], rngs=rngs)
            return y, new.get("bn_sums", {})

        out = (jax.checkpoint(call) if remat else call)(p, x_in, mask, j)
        rules.update(ctx.rules)
        return out
    return run_stage


def _loop(net, batch, params, run_stage, S: int, M: int, bn_mode: str, axes: tuple,
          bubble_fill: float) -> "_Loop":
    """The micro-batches (standardised, the last ``S - 1`` slots bubbles) and the
    boundaries' shapes (traced abstractly, stage by stage) the loops share."""
    image = batch["image"]
    mu = image.shape[0] // M
    x = models.normalize(image, net.mean, net.std, net.dtype)
    pad = lambda a, v: jnp.concatenate(
        [a.reshape((M, mu) + a.shape[1:]),
         jnp.full((S - 1, mu) + a.shape[1:], v, a.dtype)], axis=0)
    images = pad(x, bubble_fill)                       # [T, mu, H, W, C]
    shapes, bn_shapes = [], {}
    cur = (images.shape[1:], images.dtype)
    for k in range(S):  # every boundary (stage b's output, b+1's input) and each stage's sums
        y, sums_k = jax.eval_shape(lambda p, xi, m, k=k: run_stage(k, p, xi, m, 0), params,
                                   jax.ShapeDtypeStruct(*cur),
                                   jax.ShapeDtypeStruct((mu,), jnp.float32))
        _deep_update(bn_shapes, sums_k)
        if k < S - 1:
            shapes.append(y)
            cur = (y.shape, y.dtype)
    # sync mode's sums come out of a psum over data: the same on every data rank, typed so
    # (the step then all-reduces them over the stage axis only)
    bn_axes = (axes[-1],) if bn_mode == "sync" else axes
    zeros_bn = lambda: jax.tree_util.tree_map(
        lambda s: as_varying(jnp.zeros(s.shape, s.dtype), bn_axes), bn_shapes)
    zeros_buf = lambda b, v=0.0: as_varying(jnp.full(shapes[b].shape, v, shapes[b].dtype), axes)
    return _Loop(S, M, mu, axes, axes[-1], lax.axis_index(axes[-1]), shapes, zeros_bn, zeros_buf,
                 images, pad(batch["label"], 0), pad(batch["mask"].astype(jnp.float32), 0),
                 bubble_fill, bn_axes)


def _deep_update(tree: dict, other: dict) -> None:
    """``tree.update(other)`` one level down where both hold a dict (an nnx list's
    layers share the top-level key ``layers``)."""
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict) and "sums" not in v:
            _deep_update(tree[k], v)
        else:
            tree[k] = v


def _forward_branch(k: int, run_stage, lp: "_Loop", loss_fn, label_smoothing):
    """Stage ``k``'s forward slot: ``(params, inputs, mask, label, valid, j) -> (outs,
    sums, bn)`` for micro-batch ``j``; a bubble's input is replaced by zeros by select
    (NaN-safe)."""
    S = lp.S

    def fn(p, inputs, mask, label, valid, j):
        x_in = jnp.where(valid, inputs[k], jnp.zeros_like(inputs[k]))  # select, NaN-safe
        y, own = run_stage(k, p, x_in, mask, j)
        bn = lp.zeros_bn()
        _deep_update(bn, own)
        bn = jax.tree_util.tree_map(lambda a: as_varying(a, lp.bn_axes), bn)
        outs = [lp.zeros_buf(b) for b in range(S - 1)]
        if k < S - 1:
            outs[k] = as_varying(y.astype(lp.shapes[k].dtype), lp.axes)
            sums = jnp.zeros((4,), jnp.float32)
        else:
            sums = _loss_sum(y, label, mask, loss_fn, label_smoothing, None)[0]
        return tuple(outs), as_varying(sums, lp.axes), bn
    return fn


def _gpipe(p, branches, lp: "_Loop", loss_scale):
    """GPipe's loop of ``M + S - 1`` ticks (the forward), differentiated by
    autodiff (the backward: the transposed loop, the inverse permutes carrying
    the cotangents upstream). Returns ``(grads, sums, bn_sums)``."""
    S, M, axes, stage = lp.S, lp.M, lp.axes, lp.stage

    def objective(p):
        def tick(carry, t):
            bufs, sums_acc, bn_acc, loss_acc = carry
            j = t - stage
            valid = (j >= 0) & (j < M)
            jc = jnp.clip(j, 0, M + S - 2)
            mask = jnp.where(valid, lp.masks[jc], jnp.zeros_like(lp.masks[jc]))
            inputs = (as_varying(lp.images[t], axes),) + tuple(bufs)
            outs, sums, bn = lax.switch(stage, branches, p, inputs, as_varying(mask, axes),
                                        as_varying(lp.labels[jc], axes), valid, jc)
            sums = jnp.where(valid, sums, jnp.zeros_like(sums))
            bn = jax.tree_util.tree_map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), bn)
            outs = [jnp.where(valid, o, jnp.zeros_like(o)) for o in outs]
            new_bufs = tuple(lax.ppermute(outs[b], lp.stage_axis, [(b, b + 1)])
                             for b in range(S - 1))
            loss = sums[0] if loss_scale is None else sums[0] * loss_scale
            return (new_bufs, sums_acc + sums,
                    jax.tree_util.tree_map(jnp.add, bn_acc, bn), loss_acc + loss), None

        init = (tuple(lp.zeros_buf(b, lp.fill) for b in range(S - 1)),
                as_varying(jnp.zeros((4,), jnp.float32), axes), lp.zeros_bn(),
                as_varying(jnp.zeros((), jnp.float32), axes))
        (_, sums, bn, loss), _ = lax.scan(tick, init, jnp.arange(M + S - 1, dtype=jnp.int32))
        return loss, (sums, bn)

    (_, (sums, bn_sums)), grads = jax.value_and_grad(objective, has_aux=True)(p)
    return grads, sums, bn_sums


def _loss_sum(y, label, mask, loss_fn, label_smoothing, loss_scale):
    """The last stage's metric sums and the (scaled) summed loss it differentiates."""
    losses = None
    if loss_fn is not None or label_smoothing > 0:
        losses = example_losses(y, label, loss_fn, label_smoothing)
    sums = batch_metrics(y, label, mask, losses)
    return sums, (sums[0] if loss_scale is None else sums[0] * loss_scale)


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What the GPipe and 1F1B loops share (built in :func:`pipeline_forward_backward`)."""
    S: int
    M: int
    mu: int
    axes: tuple
    stage_axis: str
    stage: jax.Array      # this device's stage index
    shapes: list          # boundary b's activation (ShapeDtypeStruct of mu rows)
    zeros_bn: object      # () -> every BN layer's zero sums
    zeros_buf: object     # (b, value) -> boundary b's buffer
    images: jax.Array     # [M + S - 1, mu, H, W, C], standardised; the last S - 1 bubbles
    labels: jax.Array     # [M + S - 1, mu]
    masks: jax.Array      # [M + S - 1, mu] (0 in the bubbles)
    fill: float           # the value unused buffers start with (bubble_fill)
    bn_axes: tuple        # the axes the BN sums vary over


def _one_f_one_b(p, forward_branches, run_stage, lp: _Loop, loss_sum):
    """1F1B in one lock-step SPMD loop of ``M + 2S - 2`` ticks (PipeDream-Flush).

    At tick ``t`` the device of stage ``s`` runs the forward (F) of micro-batch
    ``t - s`` (its output to stage ``s + 1`` by ``ppermute``; its input stashed)
    and then the backward (B) of micro-batch ``t - 2(S-1) + s``: the stage is
    recomputed from the stashed input under ``jax.vjp`` and the input's
    cotangent goes to stage ``s - 1`` by the reverse ``ppermute``; the last
    stage's B seeds its cotangent from the loss of the micro-batch whose F it
    has just run. So stage ``s`` holds at most ``2(S-1-s) + 1`` stashed inputs
    (a ring of ``2S - 1`` flat slots, padded to the largest stage input),
    whatever M, where GPipe's autodiff keeps every tick's. The schedule is the
    same bubble as GPipe's, ``(S-1)/(M+S-1)``. BN's running-statistics sums
    are counted in the F slot only, never in the recompute (torchgpipe's
    ``is_recomputing``): the recompute's forward statistics equal the F
    slot's (the same input and, in sync mode, the same psum).

    Returns ``(grads, sums, bn_sums)`` as :func:`pipeline_forward_backward`.
    """
    S, M, axes, stage = lp.S, lp.M, lp.axes, lp.stage
    in_shapes = [lp.images.shape[1:]] + [b.shape for b in lp.shapes]
    in_dtypes = [lp.images.dtype] + [b.dtype for b in lp.shapes]
    width = max(math.prod(s) for s in in_shapes)
    K = 2 * S - 1
    dtype = jnp.result_type(*in_dtypes)
    flat = lambda x: as_varying(jnp.pad(x.reshape(-1).astype(dtype), (0, width - x.size)), axes)
    zeros_grads = jax.tree_util.tree_map(lambda a: as_varying(jnp.zeros_like(a), axes), p)

    def backward(k):
        def fn(x_flat, cots, mask, label, valid, j):
            x_in = x_flat[:math.prod(in_shapes[k])].reshape(in_shapes[k]).astype(in_dtypes[k])
            x_in = jnp.where(valid, x_in, jnp.zeros_like(x_in))
            if k < S - 1:
                y, vjp = jax.vjp(lambda q, x: run_stage(k, q, x, mask, j)[0], p, x_in)
                ct = jnp.where(valid, cots[k], jnp.zeros_like(cots[k])).astype(y.dtype)
            else:
                y, vjp = jax.vjp(lambda q, x: loss_sum(run_stage(k, q, x, mask, j)[0], label,
                                                       mask)[1], p, x_in)
                ct = jnp.where(valid, jnp.ones_like(y), jnp.zeros_like(y))
            dp, dx = vjp(ct)
            dp = jax.tree_util.tree_map(
                lambda g: as_varying(jnp.where(valid, g, jnp.zeros_like(g)), axes), dp)
            outs = [lp.zeros_buf(b) for b in range(S - 1)]
            if k > 0:
                outs[k - 1] = as_varying(jnp.where(valid, dx, jnp.zeros_like(dx)).astype(
                    lp.shapes[k - 1].dtype), axes)
            return dp, tuple(outs)
        return fn

    backward_branches = [backward(k) for k in range(S)]

    def tick(carry, t):
        fwd, bwd, stash, grads, sums_acc, bn_acc = carry
        jf, jb = t - stage, t - 2 * (S - 1) + stage
        vf, vb = (jf >= 0) & (jf < M), (jb >= 0) & (jb < M)
        cf, cb = jnp.clip(jf, 0, M - 1), jnp.clip(jb, 0, M - 1)
        mf = jnp.where(vf, lp.masks[cf], jnp.zeros_like(lp.masks[cf]))
        mb = jnp.where(vb, lp.masks[cb], jnp.zeros_like(lp.masks[cb]))
        inputs = (as_varying(lp.images[cf], axes),) + tuple(fwd)
        # F: this device's stage on micro-batch jf; its input goes into the stash
        outs, sums, bn = lax.switch(stage, forward_branches, p, inputs, as_varying(mf, axes),
                                    as_varying(lp.labels[cf], axes), vf, cf)
        x_in = lax.switch(stage, [lambda i, k=k: flat(i[k]) for k in range(S)], inputs)
        slot = jf % K
        stash = stash.at[slot].set(jnp.where(vf, x_in, stash[slot]))
        sums_acc = sums_acc + jnp.where(vf, sums, jnp.zeros_like(sums))
        bn_acc = jax.tree_util.tree_map(lambda acc, a: acc + jnp.where(vf, a, jnp.zeros_like(a)),
                                        bn_acc, bn)
        outs = [jnp.where(vf, o, jnp.zeros_like(o)) for o in outs]
        # B: micro-batch jb from its stashed input and the cotangent received last tick
        dp, douts = lax.switch(stage, backward_branches, stash[jb % K], tuple(bwd),
                               as_varying(mb, axes), as_varying(lp.labels[cb], axes), vb, cb)
        grads = jax.tree_util.tree_map(jnp.add, grads, dp)
        fwd = tuple(lax.ppermute(outs[b], lp.stage_axis, [(b, b + 1)]) for b in range(S - 1))
        bwd = tuple(lax.ppermute(douts[b], lp.stage_axis, [(b + 1, b)]) for b in range(S - 1))
        return (fwd, bwd, stash, grads, sums_acc, bn_acc), None

    init = (tuple(lp.zeros_buf(b, lp.fill) for b in range(S - 1)),
            tuple(lp.zeros_buf(b, lp.fill) for b in range(S - 1)),
            as_varying(jnp.full((K, width), lp.fill, dtype), axes), zeros_grads,
            as_varying(jnp.zeros((4,), jnp.float32), axes), lp.zeros_bn())
    (_, _, _, grads, sums, bn), _ = lax.scan(tick, init,
                                             jnp.arange(M + 2 * S - 2, dtype=jnp.int32))
    return grads, sums, bn


# -- the pipelined train step ---------------------------------------------------------------


MIN_BN_ROWS = 16
"""Rows a BatchNorm should normalise together: below 16 per group its error rises
quickly (Wu & He, "Group Normalization", ECCV 2018, Fig. 1: ResNet-50 on ImageNet,
batch 32 -> 16 -> 8 per group); the default micro-batch count keeps at least this many."""


def bn_rows(local_batch: int, num_microbatches: int, data_size: int, bn_mode: str) -> int:
    """Rows one BatchNorm normalises together in a pipelined step: a micro-batch's rows
    on one data rank (``local_batch / M``), times the data ranks in ``sync`` mode (its
    statistics are summed over ``data`` per micro-batch)."""
    return local_batch // num_microbatches * (data_size if bn_mode == "sync" else 1)


def default_microbatches(num_stages: int, local_batch: int, data_size: int,
                         bn_mode: str) -> int:
    """M when the config leaves it 0: the largest divisor of ``local_batch`` in
    ``[S, 4 S]`` (GPipe's rule of thumb, Huang et al. 2019: the bubble
    ``(S-1)/(M+S-1)`` is small for M >= 4 S) whose BatchNorm groups keep at least
    :data:`MIN_BN_ROWS` rows (:func:`bn_rows`); the smallest valid M (the largest
    groups) when none does, and ``4 S`` when no M in ``[S, 4 S]`` divides (the
    checks then name the valid ones)."""
    fits = [m for m in range(num_stages, 4 * num_stages + 1) if local_batch % m == 0]
    if not fits:
        return 4 * num_stages
    healthy = [m for m in fits if bn_rows(local_batch, m, data_size, bn_mode) >= MIN_BN_ROWS]
    return max(healthy) if healthy else min(fits)


def check_pipeline(module, image_shape: Sequence[int], num_stages: int, local_batch: int,
                   num_microbatches: int, starts: Sequence[str] | None = None,
                   what: str | None = None, starts_what: str | None = None) -> StagePlan:
    """Every check of a pipelined run, before anything is traced.

    Args:
      module: the model (a :class:`trjax.models.ResNet`, bare or in a
        :class:`trjax.models.Network`).
      image_shape: ``(H, W, C)``.
      num_stages: S, the mesh's ``stage`` size.
      local_batch: rows per data rank (``global_batch_size // data_size``).
      num_microbatches: M.
      starts: the block names that begin stages 1 .. S-1, or ``None`` (balanced).
      what: how the messages name M (default ``config.pipeline_microbatches=M``).
      starts_what: how the messages name ``starts`` (e.g.
        ``"config.pipeline_stage_starts='...'"``), prefixed to their errors.

    Returns:
      The :class:`StagePlan`.

    Raises:
      ValueError: not a trjax ResNet (naming the type and the way out), more
        stages than residual blocks, ``M < S`` or ``M`` not dividing the local
        batch (naming the valid counts), or bad ``starts``.
    """
    module = models.splittable(module)
    _check_splittable(module)
    valid = [m for m in range(num_stages, local_batch + 1) if local_batch % m == 0]
    if num_microbatches < num_stages or local_batch % num_microbatches:
        what = what or f"config.pipeline_microbatches={num_microbatches}"
        raise ValueError(f"{what} does not fit "
                         f"{num_stages} stages and a local batch of {local_batch} rows: it must "
                         f"be >= {num_stages} (else stages idle) and divide {local_batch}; "
                         f"valid: {valid[:12]}")
    try:
        return plan_stages(module, image_shape, num_stages, starts)
    except ValueError as e:
        if starts is None or starts_what is None:
            raise
        raise ValueError(f"{starts_what}: {e}") from e


def _forward_backward(network, stages: StagePlan, num_microbatches: int, bn_mode: str,
                      data_axis: str, num_stages: int, remat: bool, schedule: str,
                      rows: StageRows, params, batch_stats, batch, options: StepOptions,
                      loss_scale, rng):
    """The layout's ``forward_backward``: this device's stage's leaves gathered
    whole (:meth:`StageRows.gather`), :func:`pipeline_forward_backward` with the
    schedule bound on them, and the gradient handed back to the devices that hold
    each slice (:meth:`StageRows.scatter`; ``rng``: the data rank's step key, each
    micro-batch's streams folded from it). Returns this device's slices' gradients
    and the metric sums summed over ``stage``.

    Raises:
      ValueError (while tracing): ``options`` asking for gradient accumulation
        (the micro-batches are the pipeline's accumulation) or mixup / cutmix
        (they mix rows across a micro-batch).
    """
    if options.grad_accumulation_steps != 1 or options.mixup_alpha or options.cutmix_alpha:
        raise ValueError(f"a pipeline's step takes no grad_accumulation_steps (its "
                         f"{num_microbatches} micro-batches are its accumulation) and no "
                         f"mixup/cutmix; got {options}")
    grads, sums, bn_sums, rules = pipeline_forward_backward(
        network, rows.gather(params), batch_stats, batch, num_microbatches, stages, loss_scale,
        bn_mode, data_axis, "stage", num_stages, options.loss_fn, options.label_smoothing, remat,
        schedule=schedule, select=lambda k, p: rows.select(k, p, stages.names(k)), rng=rng)
    grads, sums = rows.scatter(grads, sums)
    return grads, sums, bn_sums, rules


def boundary_traffic(module, image_shape, stages: StagePlan, num_microbatches: int,
                     local_batch: int, itemsize: int) -> dict:
    """The GPipe point-to-point model of one step (:func:`trjax.comm.pipeline_bytes`'s
    formula ``sum_b 2 M mu |a_b|``): useful bytes per data replica's pipeline, and
    what the loop issues (M + S - 1 permutes per boundary and direction).

    Args:
      module: the :class:`trjax.models.ResNet`; image_shape: ``(H, W, C)``.
      stages: the split; num_microbatches: M; local_batch: rows per data rank.
      itemsize: bytes per activation element (2 for bf16 / fp16, 4 for fp32).
    """
    module = models.splittable(module)
    blocks = module.blocks_info(image_shape) if isinstance(module, models.ResNet) else \
        module.layer_costs(image_shape)
    shapes = [blocks[hi - 1]["out_shape"] for _, hi in stages.bounds[:-1]]
    m, mu = num_microbatches, local_batch // num_microbatches
    useful = comm.pipeline_bytes(m, mu, shapes, itemsize)
    return {"formula": "sum_b 2 M mu |a_b|", "microbatches": m, "micro_batch": mu,
            "boundary_shapes": [list(x) for x in shapes], "useful_bytes": useful,
            "issued_bytes": useful * (m + stages.num_stages - 1) // m}


def layout(model, world, image_shape, bn_mode: str = "running", num_microbatches: int = 0,
           stages: StagePlan | None = None, remat: bool = True,
           schedule: str = "gpipe", base: Layout | None = None) -> Layout:
    """The pipeline :class:`Layout` on a ``("data", "stage")`` world.

    Stage-owned parameters (design v2, :mod:`trjax.parallel.stage_owned`): every
    leaf, its optimizer state and EMA are split over ``stage`` (1/S per device);
    one all-to-all gathers each stage's leaves whole onto its devices, the
    backward accumulates those only, and one all-to-all hands each gradient slice
    back (the metric sums, made on the last stage, riding in it); the two-bucket
    exchange then runs over ``data`` only on each device's slices (deep bucket
    first, the metrics inside it), and a non-finite flag is summed over ``stage``
    so every device applies or skips the same update. The BN sums: ``running`` mode all-reduces them over
    ``("data", "stage")`` (the seed's one STATS_COMM); ``sync`` mode already
    summed each micro-batch's over ``data`` in the forward, and all-reduces
    them over ``stage`` only. Each summed BN layer is owned by one stage, so
    every device commits the same running statistics. The exchange must reduce
    with ``lax.psum`` (``allreduce="xla"``, no compression, no ZeRO-1) and the
    optimizer must be elementwise (sgd, adamw: :func:`trjax.parallel.check_config`).

    Args:
      model: a trjax ResNet (bare or in a :class:`trjax.models.Network`).
      world: a world with a ``stage`` axis; image_shape: ``(H, W, C)``.
      bn_mode: ``running`` or ``sync``.
      num_microbatches: M per step (each of ``local / M`` rows); 0:
        :func:`default_microbatches` (BatchNorm groups of >= :data:`MIN_BN_ROWS` rows).
      stages: the split (:func:`check_pipeline`); ``None``: balanced by MACs.
      remat: GPipe: recompute each stage in the backward (store its inputs only).
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"`` (:data:`SCHEDULES`).
      base: the tensor-parallel layout of the same world
        (:func:`trjax.parallel.tensor.layout`; mesh ``data:D,stage:S,model:T``) or
        ``None``. With it the stages run its split network, and each device's
        ``model`` slice of a leaf is what is split over ``stage`` and gathered
        (:func:`trjax.parallel.fsdp.combined_specs`).

    Raises:
      ValueError: ``bn_mode`` other than running/sync, a world without a
        ``stage`` axis, or what :func:`check_pipeline` raises.

    Warns (``UserWarning``): an M whose BatchNorm groups hold fewer than
    :data:`MIN_BN_ROWS` rows.
    """
    check_bn_mode(bn_mode, ("running", "sync"), "a 'stage' axis (a pipeline keeps one set "
                  "of running statistics, not one row per replica)")
    sizes = dict(world.axes)
    if "stage" not in sizes:
        raise ValueError(f"the world's mesh {world.axes} has no 'stage' axis")
    net, data, S = models.as_network(model), world.axis_name, sizes["stage"]
    D, local = world.data_size, world.local_batch_size
    M = num_microbatches or default_microbatches(S, local, D, bn_mode)
    if stages is None:
        stages = check_pipeline(net, image_shape, S, local, M)
    rows = bn_rows(local, M, D, bn_mode)
    if rows < MIN_BN_ROWS:
        warnings.warn(f"trjax: {M} micro-batches of {local // M} rows: each BatchNorm "
                      f"normalises {rows} rows ({bn_mode} mode), fewer than {MIN_BN_ROWS}, so its "
                      "statistics are noisy and accuracy suffers; use fewer micro-batches "
                      "(config.pipeline_microbatches=0 picks the most that keep "
                      f"{MIN_BN_ROWS}) or a larger global batch"
                      + (", or bn_mode='sync'" if bn_mode == "running" else ""), stacklevel=2)
    params = net.abstract_variables(image_shape)["params"]
    inner = jax.tree_util.tree_map(lambda _: P(), params) if base is None else base.params
    own = tensor.local_shapes(params, inner, sizes)  # a model slice (the whole leaf alone)
    dims = fsdp.shard_dims(own, S)
    specs = fsdp.combined_specs(dims, inner, "stage")
    stats = P() if base is None else base.batch_stats
    packing = StageRows.build(own, dims, [stages.names(k) for k in range(S)])
    network = net if base is None else base.network
    fb = functools.partial(_forward_backward, network, stages, M, bn_mode, data, S, remat,
                           schedule, packing)
    everything = [("all", list(range(len(packing.shapes))))]  # the evaluation's one all-gather
    line = (f"pipeline: {S} stages x {M} micro-batches ({schedule}; BatchNorm over {rows} "
            f"rows), stage MAC shares "
            + "/".join(f"{100 * x:.1f}%" for x in stages.shares)
            + f" (max/mean {stages.imbalance:.2f}), stages begin at "
            + ", ".join(stages.blocks[lo] for lo, _ in stages.bounds))
    traffic = functools.partial(boundary_traffic, net, tuple(image_shape), stages, M,
                                world.local_batch_size)
    return Layout(world=world, model=net, network=network, image_shape=tuple(image_shape),
                  bn_mode=bn_mode, forward_backward=fb,
                  grad_axes="data" if sizes["data"] > 1 else (),
                  bn_reduce_axes=fsdp._axes(data, "stage") if bn_mode == "running" else "stage",
                  params=specs, batch_stats=stats,
                  folded=P() if base is None else base.folded, check_vma=False,
                  local_shapes=lambda p, s: (tensor.local_shapes(p, specs, sizes),
                                             s if base is None else
                                             tensor.local_shapes(s, stats, sizes)),
                  gather=functools.partial(fsdp.gather, dims=dims, groups=everything, size=S,
                                           axis_name="stage"),
                  finite_axes="stage" if base is None else ("stage", tensor.TENSOR_AXIS),
                  kind="pipeline" if base is None else "pipeline+tensor",
                  line=line if base is None else f"{line}; {base.line}",
                  point_to_point=traffic,
                  collective_labels={**({} if base is None else base.collective_labels),
                                     "stage": {
                      "collective-permute": "pipeline:boundary activation / cotangent",
                      "all-to-all": "pipeline:stage-owned parameters / gradients",
                      "all-gather": "pipeline:parameters for the evaluation",
                      "all-reduce": "pipeline:BN statistics or the non-finite flag"}},
                  details={"pipeline_microbatches": M,
                           "pipeline_stage_shares": list(stages.shares)})
