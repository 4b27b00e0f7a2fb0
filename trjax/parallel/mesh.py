"""From a config's mesh to its :class:`~trjax.parallel.layout.Layout`, and the
checks a model-parallel mesh makes before anything is traced.

The one place that reads a mesh's axis names: ``data`` only is
:func:`~trjax.parallel.layout.data_parallel`, an ``fsdp`` axis
:func:`trjax.parallel.fsdp.layout`, a ``stage`` axis
:func:`trjax.parallel.pipeline.layout`, a ``model`` axis
:func:`trjax.parallel.tensor.layout`.
"""

from __future__ import annotations

from trjax.parallel import fsdp, pipeline, tensor
from trjax.remat import parse as remat_parse
from trjax.parallel.layout import Layout, data_parallel
from trjax.world import FSDP_AXIS, MODEL_AXIS, STAGE_AXIS


def mesh_sizes(config) -> dict:
    """``{axis: size}`` of ``config.mesh`` (``{}`` for the 1-D default "")."""
    from trjax.world import parse_mesh  # noqa: PLC0415
    return dict(parse_mesh(config.mesh)) if config.mesh else {}


def pipeline_microbatches(config, world) -> int:
    """M: ``config.pipeline_microbatches``, or when it is 0
    :func:`trjax.parallel.pipeline.default_microbatches` (the most micro-batches up
    to 4 x stages whose BatchNorm groups keep 16 rows)."""
    return config.pipeline_microbatches or pipeline.default_microbatches(
        dict(world.axes).get(STAGE_AXIS, 1), world.local_batch_size, world.data_size,
        config.bn_mode)


def from_config(config, world, model, image_shape) -> Layout:
    """The :class:`Layout` of ``config.mesh`` for ``model`` (a
    :class:`trjax.models.Network`), with the config's names in every message.

    Raises:
      ValueError: what the constructors raise (not a trjax ResNet, channels that
        do not divide, micro-batches that do not fit, bad stage starts), before
        anything is traced.
    """
    sizes = dict(world.axes)
    out = data_parallel(model, world, image_shape, config.bn_mode)  # each axis adds itself
    if MODEL_AXIS in sizes:
        out = tensor.layout(out, config.tensor_plan)
    if STAGE_AXIS in sizes:
        out = pipeline.layout(out, pipeline_microbatches(config, world),
                              _stage_plan(config, world, model, image_shape),
                              remat=config.pipeline_remat, schedule=config.pipeline_schedule)
    if FSDP_AXIS in sizes:
        out = fsdp.layout(out, config.buckets, config.get("fsdp_reshard_after_forward", False))
    return out


def _stage_plan(config, world, model, image_shape) -> pipeline.StagePlan:
    """The pipeline's stage plan, checked with the config's names in every message."""
    S, M = dict(world.axes)[STAGE_AXIS], pipeline_microbatches(config, world)
    starts = [b.strip() for b in config.pipeline_stage_starts.split(",") if b.strip()]
    what = (f"config.pipeline_microbatches={M}" if config.pipeline_microbatches else
            f"config.pipeline_microbatches=0 (the default for {S} stages: {M})")
    return pipeline.check_pipeline(
        model, image_shape, S, world.local_batch_size, M, starts or None, what=what,
        starts_what=f"config.pipeline_stage_starts={config.pipeline_stage_starts!r}")


def check_config(config, own_model: bool, builtin_models=()) -> None:
    """The combinations a model-parallel mesh allows, before anything is traced.

    Every axis past ``data`` splits leaves, so it runs no hierarchical all-reduce, no
    compression and no ZeRO-1 (the parameters' axes already shard the optimizer
    state); any optimizer, clipping and ``tx=`` run (on global arrays:
    :func:`trjax.steps.make_train_step`); ``stage`` and ``model`` keep BN in
    ``running`` or ``sync`` mode; a pipeline's micro-batches replace
    ``grad_accumulation_steps`` (each mixed as accumulation mixes it). The
    pipeline keys are an error without a ``stage`` axis, the tensor plan without
    a ``model`` one.

    Args:
      config: the run's config (its ``mesh`` already parsed once).
      own_model: ``config.model`` is an import path (the user's model).
      builtin_models: the built-in model names, for the message.

    Raises:
      ValueError: naming the key, its value and the fix.
    """
    c, sizes = config, mesh_sizes(config)
    stage, model = STAGE_AXIS in sizes, MODEL_AXIS in sizes  # size 1 too: a GPU's 1 x 1 check
    sharded = FSDP_AXIS in sizes
    _check_pipeline_keys(c, stage, model)
    _check_reshard(c, sharded, stage)
    if not (stage or model or sharded):
        return
    kind = ("a 'stage' axis with an 'fsdp' axis" if sharded and stage else
            "a 'model' axis with an 'fsdp' axis" if sharded and model else
            "a 'model' axis with a 'stage' axis" if stage and model else
            "an 'fsdp' axis" if sharded else
            "a 'stage' axis (pipeline)" if stage else "a 'model' axis (tensor parallel)")
    if own_model and model and not str(c.tensor_plan).strip():  # a stage axis splits a
        # sequence too (pipeline.plan_stages); a model axis splits by a tensor plan
        raise ValueError(f"config.mesh={c.mesh!r}: {kind} splits your own model "
                         f"(config.model={c.model!r}) by a tensor plan: set "
                         "config.tensor_plan='<conv>=column,<next conv>=row,<head>=column' "
                         "(module paths; trjax.parallel.tensor), use a built-in model "
                         f"({sorted(builtin_models)}) or a mesh with the data axis only")
    # every axis past data splits leaves over its devices (fsdp and stage: every leaf; model:
    # layers): the exchange all-reduces each device's slices over data
    wants = [("allreduce", c.allreduce != "hierarchical",
              "'xla', 'ring', 'halving_doubling' or 'tree' (hierarchical groups consecutive "
              "ranks as a node; on this mesh the data axis' neighbours are the split axes' "
              "size apart, so every data-axis all-reduce already crosses nodes)"),
             ("compression", c.compression == "none",
              "'none' (a compressor is defined on whole gradients; here the data axis "
              "all-reduces each device's slices, and an exact form would need the "
              "compressor's own collectives over the split axes: docs/parallelism.md)"),
             ("shard_optimizer_state", not c.shard_optimizer_state,
              "False (this mesh already shards the optimizer state over its axes)")]
    if stage or model:
        wants.insert(0, ("bn_mode", c.bn_mode in ("running", "sync"), "'running' or 'sync'"))
    if stage:
        wants += [("grad_accumulation_steps", c.grad_accumulation_steps == 1,
                   "1 (the pipeline's micro-batches are its accumulation: "
                   "config.pipeline_microbatches)")]
    for key, ok, fix in wants:
        if not ok:
            raise ValueError(f"config.{key}={c[key]!r} is not supported with {kind} "
                             f"(config.mesh={c.mesh!r}): set it to {fix}, or use a mesh with "
                             "the data axis only")


def _check_reshard(c, sharded: bool, stage: bool) -> None:
    """``config.fsdp_reshard_after_forward``: a bool, and ``True`` only on an ``fsdp``
    mesh without a ``stage`` axis, without gradient accumulation (XLA merges some
    micro-batches' gathers: the byte model would not hold) and without
    ``config.remat`` (its re-gather is a
    ``jax.checkpoint`` around the whole objective, whose policy jax applies to every
    checkpoint inside it: the pipeline's stage recomputation and remat's blocks would
    silently keep their activations).

    Raises:
      ValueError: naming the key, its value and the fix.
    """
    v = c.get("fsdp_reshard_after_forward", False)
    if not isinstance(v, bool):
        raise ValueError(f"config.fsdp_reshard_after_forward={v!r} must be True or False "
                         "(True: the backward gathers each bucket again instead of keeping "
                         "the forward's copy)")
    if not v:
        return
    if not sharded:
        raise ValueError("config.fsdp_reshard_after_forward=True applies to a mesh with an "
                         f"'fsdp' axis (config.mesh={c.mesh!r}): set it to False or shard the "
                         "parameters, e.g. mesh='data:2,fsdp:4'")
    if stage:
        raise ValueError("config.fsdp_reshard_after_forward=True is not supported with a "
                         f"'stage' axis (config.mesh={c.mesh!r}): the pipeline gathers and "
                         "recomputes per stage itself; set it to False")
    if c.grad_accumulation_steps != 1:
        raise ValueError(f"config.fsdp_reshard_after_forward=True needs "
                         f"config.grad_accumulation_steps=1 (got {c.grad_accumulation_steps}): "
                         "each micro-batch would gather again, and XLA merges some of those "
                         "gathers across micro-batches, so the byte model would not hold; set "
                         "grad_accumulation_steps=1 (a larger fsdp or data axis instead) or "
                         "fsdp_reshard_after_forward=False")
    if remat_parse(c.remat):
        raise ValueError(f"config.fsdp_reshard_after_forward=True cannot be combined with "
                         f"config.remat={c.remat!r}: the re-gather's checkpoint policy would "
                         "override remat's (jax applies the outermost one); set remat='none' "
                         "or fsdp_reshard_after_forward=False")


def _check_pipeline_keys(c, stage: bool, model: bool) -> None:
    """The pipeline's own keys and the tensor plan: well formed, and set only on a
    ``stage`` / ``model`` mesh."""
    if stage and c.pipeline_schedule in ("1f1b", "zb-h1") and not c.pipeline_remat:
        raise ValueError("config.pipeline_remat=False applies to pipeline_schedule='gpipe': "
                         f"{c.pipeline_schedule} always recomputes each stage in its backward "
                         "slot; leave pipeline_remat=True or use gpipe")
    starts = str(c.pipeline_stage_starts)
    if starts.strip() and any(not b.strip() for b in starts.split(",")):
        raise ValueError(f"config.pipeline_stage_starts={starts!r} has an empty item: give "
                         "block names separated by commas, e.g. 'stage2_block1,stage3_block1'")
    if str(c.tensor_plan).strip():
        tensor.parse(c.tensor_plan)
        if not model:
            raise ValueError(f"config.tensor_plan={c.tensor_plan!r} applies to a mesh with a "
                             f"'model' axis (config.mesh={c.mesh!r}); set it to '' or use e.g. "
                             "mesh='data:4,model:2'")
    if not stage:
        for key, off in (("pipeline_microbatches", 0), ("pipeline_stage_starts", ""),
                         ("pipeline_schedule", "gpipe"), ("pipeline_remat", True)):
            if c[key] != off:
                raise ValueError(f"config.{key}={c[key]!r} applies to a mesh with a 'stage' "
                                 f"axis (config.mesh={c.mesh!r}); set it to {off!r} or use e.g. "
                                 "mesh='data:2,stage:4'")
