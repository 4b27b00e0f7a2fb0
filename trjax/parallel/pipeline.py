"""Pipeline parallelism (GPipe, 1F1B, ZB-H1) for trjax's ResNets and sequences of layers,
one SPMD program: the stage runner (:func:`pipeline_forward_backward`) and the layout.
The stage split is :mod:`trjax.parallel.stages`, the schedules
:mod:`trjax.parallel.schedules` (one signature; ZB-H1 in
:mod:`trjax.parallel.zero_bubble`), the stage-owned rows :mod:`trjax.parallel.stage_owned`.

:func:`layout` is the :class:`~trjax.parallel.layout.Layout` of a mesh with a
``stage`` axis (``config.mesh="data:2,stage:4"``): its ``forward_backward`` is
:func:`pipeline_forward_backward` with the schedule bound, which
:func:`trjax.steps.make_train_step` calls like any other (design v2: the
parameters are split over ``stage`` and each stage's leaves gathered whole onto its
own devices for the step, :mod:`trjax.parallel.stage_owned`). Sources: GPipe (Huang
et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
NeurIPS 2019: fill/drain schedule, the backward from the forward loop); the jax ``shard_map`` notebook,
§"SPMD pipeline parallelism" (a loop of ``M + S - 1`` ticks and a ``ppermute``
shift per tick); praxis ``praxis/layers/pipeline.py`` (bubble iterations must
not touch parameters' gradients nor BatchNorm statistics; the NaN-polluted
bubble test); torchgpipe ``DeferredBatchNorm`` (each micro-batch is normalised
with its own statistics, the running statistics add every micro-batch's sums
once per step).

Layout. The ResNet's residual blocks are split into ``S`` contiguous stages
(:func:`plan_stages`; the stem goes with the first stage, the pooling + dense
head with the last), balanced by multiply-accumulates and, within 10 % of that
balance, by parameters (the stage-owned buffers are the largest stage's size).
Stage ``s`` runs on the devices of mesh coordinate ``stage = s``; only one
activation tensor crosses each stage boundary (the skips stay inside their block).

Stage-owned parameters (design v2, :mod:`trjax.parallel.stage_owned`): every
leaf of what a device of ``base`` holds, its optimizer state and EMA are split
over ``stage`` (1/S per device); one all-to-all gathers each stage's leaves
whole onto its devices, the backward accumulates those only, and one
all-to-all hands each gradient slice back (the metric sums, made on the last
stage, riding in it); the two-bucket exchange then runs over ``data`` only on
each device's slices (deep bucket first, the metrics inside it), and
``stage`` joins the axes whose devices hold different slices (the non-finite
flag). The BN sums: ``running`` mode all-reduces them over ``("data",
"stage")`` (the seed's one STATS_COMM); ``sync`` mode already summed each
micro-batch's over ``data`` in the forward, and all-reduces them over
``stage`` only. Each summed BN layer is owned by one stage, so every device
commits the same running statistics.

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
model at S = 3, M = 4 on XLA:CPU: temp 379 KB -> 98 KB); GPipe's checkpoint takes
the input padded to the widest stage input, so the branches share one saved input
per tick (:func:`stage_runner`'s ``width``). The 1F1B schedule
(:func:`trjax.parallel.schedules.one_f_one_b`) stashes O(S) micro-batches' stage
inputs instead of O(M).

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
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import comm, models
from trjax.batchnorm import BatchNormContext, linen_interceptor
from trjax.collectives import as_varying
from trjax.objective import StepOptions
from trjax.parallel.layout import Layout, check_bn_mode
from trjax.parallel.schedules import SCHEDULES, forward_branch, loss_sum, make_loop
from trjax.parallel.shards import combined_specs, flat_axes, gather, local_shapes, shard_dims
from trjax.parallel.stage_owned import StageRows, subtree, unit_path
# re-exported: the stage split is the pipeline's (trjax.parallel.stages)
from trjax.parallel.stages import (MIN_BN_ROWS, SEQUENCES, SPLITTABLE, StagePlan,  # noqa: F401
                                   balanced_split, bn_rows, check_pipeline,
                                   default_microbatches, plan_stages, stage_modules)
from trjax.world import DATA_AXIS, STAGE_AXIS






def pipeline_forward_backward(model, params, batch_stats, batch, num_microbatches: int,
                              plan: StagePlan | None = None, loss_scale=None,
                              bn_mode: str = "running", data_axis: str = DATA_AXIS,
                              stage_axis: str = STAGE_AXIS, num_stages: int | None = None,
                              loss_fn=None, label_smoothing: float = 0.0,
                              remat: bool = False, bubble_fill: float = 0.0,
                              schedule: str = "gpipe", select=None, rng=None,
                              mixing=(0.0, 0.0)):
    """Per device, a pipeline schedule: gradients of the summed loss, metric sums,
    BN batch sums. Call inside ``jax.shard_map`` over ``(data_axis, stage_axis)``,
    the batch split over ``data``; the parameters are cast to varying over both
    axes, so every result is this device's own part; their sum over ``stage_axis``
    is :func:`trjax.objective.forward_backward` with ``grad_accumulation_steps =
    num_microbatches`` on that data rank.

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
        statistics) or ``"sync"`` (each micro-batch's statistics psum'ed over
        ``data_axis`` inside the stage's switch branch); the model's must match.
      data_axis, stage_axis: the mesh axis names.
      loss_fn, label_smoothing: the per-example loss
        (:func:`trjax.objective.example_losses`); default softmax cross-entropy.
      remat: ``jax.checkpoint`` each stage call (the backward recomputes the
        stage; stored per tick: its inputs only).
      bubble_fill: the value bubble slots' input buffers hold before masking
        (a test hook: NaN must give bitwise the same results as 0).
      schedule: a name of :data:`trjax.parallel.schedules.SCHEDULES` (``gpipe``,
        ``1f1b``, ``zb-h1``; ``remat`` applies to GPipe: the others run the stage
        again inside each backward slot, so a checkpoint there would only repeat it).
      select: ``(k, params) -> stage k's subtree``; ``None``: ``params`` is the
        whole tree. The stage-owned layout passes its packed rows
        (:meth:`trjax.parallel.stage_owned.StageRows.select`): the gradient is
        then packed the same way, this stage's leaves only.
      rng: this data rank's step key (:func:`trjax.objective.dropout_key`
        without ``micro``): micro-batch ``j`` draws from ``fold_in(rng, j)``, as
        under gradient accumulation; ``None``: no random streams.
      mixing: ``(mixup_alpha, cutmix_alpha)``: each micro-batch mixed as gradient
        accumulation mixes it (:func:`trjax.parallel.schedules.make_loop`; needs ``rng``).

    Returns:
      ``(grads, sums [4] float32, bn_sums, rules)`` as
      :func:`trjax.objective.forward_backward`, per device: ``grads`` (the full
      tree, float32) are nonzero only on the leaves of this device's stage;
      ``sums`` (``[loss_sum, top1, top5, count]``) are nonzero on the last
      stage only; ``bn_sums`` (every BatchNorm's ``{"sums": [2C+1]}``) hold this
      stage's layers' sums over its M valid micro-batches and zeros for the
      other stages' layers; ``rules`` every BatchNorm's running rule.

    Raises:
      ValueError (while tracing): the model is neither a ResNet nor a sequence; a
        ResNet's ``bn_mode`` differs; M < 1, M < S, or L not divisible by M; a plan
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
    # 1F1B's and ZB-H1's slots take the stage's vjp inside the slot: a checkpoint there
    # would only run the forward again (twice on the last stage, whose loss needs it)
    runner = functools.partial(stage_runner, stage_modules(net, plan), plan, batch_stats,
                               bn_mode, data_axis, remat and schedule == "gpipe", rules,
                               select, rng,
                               functools.partial(net._split, train=True))
    lp = make_loop(net, batch, params, runner(), S, M, bn_mode,
                   flat_axes(data_axis, stage_axis), bubble_fill, loss_scale, mixing, rng)
    # GPipe differentiates the tick's switch: one padded saved input per tick, not S
    run_stage = runner(width=lp.width) if schedule == "gpipe" else runner()
    branches = [forward_branch(k, run_stage, lp, loss_fn, label_smoothing) for k in range(S)]
    p = jax.tree_util.tree_map(lambda a: as_varying(a, lp.axes), params)
    loss = functools.partial(loss_sum, loss_fn=loss_fn, label_smoothing=label_smoothing,
                             loss_scale=loss_scale)
    grads, sums, bn_sums = SCHEDULES[schedule](p, branches, run_stage, lp, loss)
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
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {list(SCHEDULES)}")


def stage_runner(mods, plan: StagePlan, batch_stats, bn_mode: str, data_axis: str,
                  remat: bool, rules: dict, select, rng=None, split=contextlib.nullcontext,
                  width: int | None = None):
    """``run_stage(k, params, x_in, mask, j) -> (y, bn_sums)``: stage ``k``'s module on
    its own subtrees (``select(k, params)``; ``jax.checkpoint``-ed with ``remat``) for
    micro-batch ``j``, whose random streams come from ``fold_in(rng, j)`` as under
    gradient accumulation (:func:`trjax.objective.forward_backward`; a layer's key
    folds in its own path, the same in a stage as in the whole model); every
    BatchNorm's running rule lands in ``rules``; ``split``: the tensor plan's interception
    (:meth:`trjax.models.Network._split`), a null context without one.

    ``width`` (with ``remat``): the checkpoint takes the stage input flattened and padded
    to ``width`` elements, so every stage's saved input has one shape and a
    ``lax.switch`` over the stages, differentiated, keeps one per tick instead of one per
    stage (jax merges branch residuals of equal shape)."""
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

        if remat and width is not None:
            shape, n = x_in.shape, x_in.size
            out = jax.checkpoint(lambda p, x, mask, j: call(p, x[:n].reshape(shape), mask, j))(
                p, jnp.pad(x_in.reshape(-1), (0, width - n)), mask, j)
        else:
            out = (jax.checkpoint(call) if remat else call)(p, x_in, mask, j)
        rules.update(ctx.rules)
        return out
    return run_stage


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
        (the micro-batches are the pipeline's accumulation).
    """
    if options.grad_accumulation_steps != 1:
        raise ValueError(f"a pipeline's step takes no grad_accumulation_steps (its "
                         f"{num_microbatches} micro-batches are its accumulation); got "
                         f"{options}")
    grads, sums, bn_sums, rules = pipeline_forward_backward(
        network, rows.gather(params), batch_stats, batch, num_microbatches, stages, loss_scale,
        bn_mode, data_axis, STAGE_AXIS, num_stages, options.loss_fn, options.label_smoothing, remat,
        schedule=schedule, select=lambda k, p: rows.select(k, p, stages.names(k)), rng=rng,
        mixing=(options.mixup_alpha, options.cutmix_alpha))
    grads, sums = rows.scatter(grads, sums)
    return grads, sums, bn_sums, rules


def schedule_ticks(schedule: str, num_stages: int, num_microbatches: int) -> int:
    """The tick loop's trip count: GPipe ``M + S - 1`` (its transposed loop as many),
    1F1B ``M + 2S - 2``, ZB-H1 its table's length
    (:func:`trjax.parallel.zero_bubble.table`)."""
    S, M = num_stages, num_microbatches
    if schedule == "gpipe":
        return M + S - 1
    if schedule == "1f1b":
        return M + 2 * S - 2
    from trjax.parallel import zero_bubble  # noqa: PLC0415
    return zero_bubble.ticks(S, M)["ticks"]


def boundary_traffic(module, image_shape, stages: StagePlan, num_microbatches: int,
                     local_batch: int, itemsize: int, schedule: str = "gpipe",
                     rows: StageRows | None = None) -> dict:
    """The pipeline's byte model over ``stage`` for one step, per device program.

    * ``useful_bytes`` = :func:`trjax.comm.pipeline_bytes` ``sum_b 2 M mu |a_b|``
      (per data replica's pipeline);
    * ``issued_bytes`` = ``sum_b 2 T mu |a_b|``: every schedule permutes each boundary
      once per direction and tick, T = :func:`schedule_ticks` (GPipe's forward loop
      and its transpose, 1F1B's and ZB-H1's one loop; bubble and idle slots send
      zeros), as :func:`trjax.comm.by_axis` counts the compiled permutes;
    * ``exchange_bytes``: the stage-owned parameters' two all-to-alls
      (:meth:`trjax.parallel.stage_owned.StageRows.exchange_bytes`, float32), 0
      without ``rows``.

    The ``stage`` axis of the compiled step also carries the BN sums where the
    layout reduces them over ``stage`` alone (``sync`` mode) and the non-finite
    flag where ``stage`` is the one split axis.

    Args:
      module: the :class:`trjax.models.ResNet`; image_shape: ``(H, W, C)``.
      stages: the split; num_microbatches: M; local_batch: rows per data rank.
      itemsize: bytes per activation element (2 for bf16 / fp16, 4 for fp32).
      schedule: ``gpipe``, ``1f1b`` or ``zb-h1``; rows: the layout's :class:`StageRows`.
    """
    module = models.splittable(module)
    blocks = module.blocks_info(image_shape) if isinstance(module, models.ResNet) else \
        module.layer_costs(image_shape)
    shapes = [blocks[hi - 1]["out_shape"] for _, hi in stages.bounds[:-1]]
    m, mu = num_microbatches, local_batch // num_microbatches
    ticks = schedule_ticks(schedule, stages.num_stages, m)
    useful = comm.pipeline_bytes(m, mu, shapes, itemsize)
    exchange = rows.exchange_bytes() if rows is not None else {"gather": 0, "scatter": 0}
    return {"formula": "sum_b 2 M mu |a_b|", "microbatches": m, "micro_batch": mu,
            "schedule": schedule, "ticks": ticks,
            "boundary_shapes": [list(x) for x in shapes], "useful_bytes": useful,
            "issued_bytes": comm.pipeline_bytes(ticks, mu, shapes, itemsize),
            "exchange_bytes": exchange["gather"] + exchange["scatter"]}


def slot_passes(schedule: str, num_stages: int, k: int, remat: bool) -> tuple:
    """How many times one tick of the compiled loop issues stage ``k``'s Megatron
    collectives, per micro-batch's worth: ``(a, r, b, i)`` counts of a forward whose
    output is used (its ``g`` all-reduces and heads' all-gathers), a recomputed
    forward (its ``g`` only: an all-gather's backward is a slice, so its recompute
    is dead code), a backward (the ``f`` all-reduces of
    :func:`trjax.parallel.tensor.traffic`'s ``f``) and, of those, the backwards that
    need the stage input's cotangent (its ``f_input`` too: stages ``k > 0``).

    * GPipe: the forward loop's primal; its transpose recomputes (with ``remat``)
      and runs the backward.
    * 1F1B: the F slot's primal, and the B slot: ``jax.vjp`` of the stage (its
      forward again, then its backward). The layout passes ``remat`` to GPipe only;
      with a checkpointed (``remat``) call the B slot's primal output would be dead
      code but on the last stage, whose loss inside the ``vjp`` needs the logits, and
      the backward would recompute the stage once more.
    * ZB-H1: the F slot, and the B slot (input cotangent; stage 0 has none) and W
      slot (parameters only: no input cotangent), each running the stage again as
      1F1B's B.

    Every branch of the tick's ``lax.switch`` counts once per tick, as
    :func:`trjax.comm.by_axis` counts them.
    """
    live = (not remat) or k == num_stages - 1
    if schedule == "gpipe":
        return 1, int(remat), 1, int(k > 0)
    if schedule == "1f1b":
        return 1 + live, int(remat), 1, int(k > 0)
    slots = 1 + (k > 0)  # zb-h1: B (k > 0) and W
    return 1 + slots * live, slots * int(remat), slots, int(k > 0)


def tensor_traffic(per_stage, stages: StagePlan, num_microbatches: int, local_batch: int,
                   schedule: str, remat: bool, itemsize: int) -> dict:
    """The ``model`` axis' byte model of a pipelined step, summed over the stages
    (:func:`trjax.comm.by_axis` counts every stage's ``lax.switch`` branch): stage
    ``k``'s Megatron collectives of one micro-batch (``per_stage``: the tensor
    layout's :func:`trjax.parallel.tensor.traffic`, ``mu`` rows, its units' layers:
    ``g_k``, ``f_k``, ``f_input_k``, ``gather_k``) times the ticks T
    (:func:`schedule_ticks`) times :func:`slot_passes`' ``(a, r, b, i)``:
    ``g = sum_k T (a + r) g_k``, ``f = sum_k T (b f_k + i f_input_k)``,
    ``gather = sum_k T a gather_k``; ``issued = g + f + gather``; a ring sends
    ``total = 2 (T-1)/T (g + f) + (T-1)/T gather`` (T the model axis size)."""
    S, M = stages.num_stages, num_microbatches
    ticks, mu = schedule_ticks(schedule, S, M), local_batch // M
    g = f = gather = 0
    size = None
    for k in range(S):
        units = [tuple(str(x) for x in unit_path(n)) for n in stages.names(k)]
        t = per_stage(itemsize, batch=mu, units=units)
        a, r, b, i = slot_passes(schedule, S, k, remat)
        g += ticks * (a + r) * t["g"]
        f += ticks * (b * t["f"] + i * t["f_input"])
        gather += ticks * a * t["gather"]
        size = t["T"]
    return {"formula": "sum_k T ((a + r) g_k + b f_k + i f_input_k + a gather_k)", "T": size,
            "schedule": schedule, "ticks": ticks, "micro_batch": mu, "g": g, "f": f,
            "gather": gather, "issued": g + f + gather,
            "total": comm.tensor_sent(g, f, gather, size)}


_LABELS = {"collective-permute": "pipeline:boundary activation / cotangent",
           "all-to-all": "pipeline:stage-owned parameters / gradients",
           "all-gather": "pipeline:parameters for the evaluation",
           "all-reduce": "pipeline:BN statistics or the non-finite flag"}
"""What a collective over ``stage`` carries (the communication report's labels)."""


def layout(base: Layout, num_microbatches: int = 0, stages: StagePlan | None = None,
           remat: bool = True, schedule: str = "gpipe") -> Layout:
    """``base`` with its network run as a pipeline over the ``stage`` axis.

    Stage-owned parameters and the BN sums: the module docstring's "Layout".

    Args:
      base: the layout the pipeline runs on, of a world with a ``stage`` axis:
        data parallelism (``bn_mode`` running or sync), or the tensor-parallel
        layout (mesh ``data:D,stage:S,model:T``), whose split network the stages
        run and whose ``model`` slice of a leaf is what is split over ``stage``.
      num_microbatches: M per step (each of ``local / M`` rows); 0:
        :func:`default_microbatches` (BatchNorm groups of >= :data:`MIN_BN_ROWS` rows).
      stages: the split (:func:`check_pipeline`); ``None``: balanced by MACs.
      remat: GPipe: recompute each stage in the backward (store its inputs only).
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"`` (:data:`SCHEDULES`).

    Raises:
      ValueError: ``bn_mode`` other than running/sync, a world without a
        ``stage`` axis, or what :func:`check_pipeline` raises.

    Warns (``UserWarning``): an M whose BatchNorm groups hold fewer than
    :data:`MIN_BN_ROWS` rows.
    """
    bn_mode, world, image_shape = base.bn_mode, base.world, base.image_shape
    check_bn_mode(bn_mode, ("running", "sync"), "a 'stage' axis (a pipeline keeps one set "
                  "of running statistics, not one row per replica)")
    sizes = dict(world.axes)
    if STAGE_AXIS not in sizes:
        raise ValueError(f"the world's mesh {world.axes} has no 'stage' axis")
    net, data, S = base.model, world.axis_name, sizes[STAGE_AXIS]
    M = num_microbatches or default_microbatches(S, world.local_batch_size, world.data_size,
                                                 bn_mode)
    stages = stages or check_pipeline(net, image_shape, S, world.local_batch_size, M)
    rows = _warn_bn_rows(world.local_batch_size, M, world.data_size, bn_mode)
    params = net.abstract_variables(image_shape)["params"]
    own = local_shapes(params, base.params, sizes)  # what a device of base holds
    dims = shard_dims(own, S)
    specs, stats = combined_specs(dims, base.params, STAGE_AXIS), base.batch_stats
    packing = StageRows.build(own, dims, [stages.names(k) for k in range(S)])
    fb = functools.partial(_forward_backward, base.network, stages, M, bn_mode, data, S, remat,
                           schedule, packing)
    everything = [("all", list(range(len(packing.shapes))))]  # the evaluation's one all-gather
    own_gather = functools.partial(gather, dims=dims, groups=everything, size=S,
                                   axis_name=STAGE_AXIS)
    line = (f"pipeline: {S} stages x {M} micro-batches ({schedule}; BatchNorm over {rows} "
            f"rows), stage MAC shares " + "/".join(f"{100 * x:.1f}%" for x in stages.shares)
            + f" (max/mean {stages.imbalance:.2f}), parameter shares "
            + "/".join(f"{100 * x:.1f}%" for x in stages.param_shares) + ", stages begin at "
            + ", ".join(stages.blocks[lo] for lo, _ in stages.bounds))
    return dataclasses.replace(
        base, forward_backward=fb, grad_axes=DATA_AXIS if sizes[DATA_AXIS] > 1 else (),
        bn_reduce_axes=flat_axes(data, STAGE_AXIS) if bn_mode == "running" else STAGE_AXIS,
        params=specs, check_vma=False, strategies=("pipeline",) + base.strategies,
        local_shapes=lambda p, s: (local_shapes(p, specs, sizes),
                                   s if isinstance(stats, P) else local_shapes(s, stats, sizes)),
        gather=lambda p: base.gather(own_gather(p)),
        split_axes=(STAGE_AXIS,) + base.split_axes,
        line="; ".join(x for x in (line, base.line) if x),
        point_to_point=functools.partial(boundary_traffic, net, tuple(image_shape), stages, M,
                                         world.local_batch_size, schedule=schedule,
                                         rows=packing),
        tensor_traffic=None if base.tensor_traffic is None else functools.partial(
            tensor_traffic, base.tensor_traffic, stages, M, world.local_batch_size, schedule,
            remat and schedule == "gpipe"),
        collective_labels={**base.collective_labels, STAGE_AXIS: _LABELS},
        details={**base.details, "pipeline_microbatches": M,
                 "pipeline_stage_shares": list(stages.shares)})


def _warn_bn_rows(local: int, M: int, D: int, bn_mode: str) -> int:
    """The rows each BatchNorm normalises (:func:`bn_rows`), with a warning below
    :data:`MIN_BN_ROWS`."""
    rows = bn_rows(local, M, D, bn_mode)
    if rows < MIN_BN_ROWS:
        warnings.warn(f"trjax: {M} micro-batches of {local // M} rows: each BatchNorm "
                      f"normalises {rows} rows ({bn_mode} mode), fewer than {MIN_BN_ROWS}, so its "
                      "statistics are noisy and accuracy suffers; use fewer micro-batches "
                      "(config.pipeline_microbatches=0 picks the most that keep "
                      f"{MIN_BN_ROWS}) or a larger global batch"
                      + (", or bn_mode='sync'" if bn_mode == "running" else ""), stacklevel=3)
    return rows
