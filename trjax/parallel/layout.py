"""The :class:`Layout`: what a mesh means for the train state and the step.

Every field is something a step, the state's creation, the plan, the
checkpoint or the report reads; only :mod:`trjax.parallel` decides them from
the mesh's axis names (after torchtitan's ``ParallelDims`` and big_vision's one
sharding tree for init, step and restore). :func:`data_parallel` is the bottom
of every composition; each strategy's ``layout(base, ...)``
(:func:`trjax.parallel.tensor.layout`, :func:`trjax.parallel.pipeline.layout`,
:func:`trjax.parallel.fsdp.layout`) returns ``base`` with its own axis added
(``dataclasses.replace``: what it does not change, it keeps), and
:func:`trjax.parallel.from_config` composes them by ``config.mesh``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import models, objective

BN_MODES = ("running", "sync", "local")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one run lies over its mesh.

    Attributes:
      world: the :class:`trjax.world.World` (devices, mesh; ``axis_name`` is
        the data axis).
      model: the unsplit :class:`trjax.models.Network`: initialisation, the
        plan's regions, the checks.
      network: the per-device network the steps apply inside ``shard_map``
        (tensor parallel: the split one, on local slices).
      image_shape: ``(H, W, C)`` of one example.
      bn_mode: ``running``, ``sync`` or ``local`` (:mod:`trjax.batchnorm`).
      forward_backward: ``(params, batch_stats, batch, options, loss_scale,
        rng) -> (grads, sums [4], bn_sums, rules)`` per device (``options``: a
        :class:`trjax.objective.StepOptions`); the schedule's own options are
        bound with ``functools.partial``.
      grad_axes: the axes the gradient buckets are reduced over (every axis
        that holds a replica's partial gradient).
      bn_reduce_axes: the axes the BN batch sums are still all-reduced over
        after the forward (``running`` mode), or ``None`` (already global, or
        per replica).
      per_replica_stats: ``local`` mode: the state keeps one BN statistics row
        per data replica (``[world_size, C]``).
      params, batch_stats, folded: ``PartitionSpec`` (a prefix or a tree) of
        the parameters, the BN running statistics and the evaluation's folded
        BatchNorm tree.
      opt_state: the optimizer state's specs where the parameters are split
        (:meth:`with_exchange`), else ``None`` (the exchange's own specs).
      check_vma: whether ``shard_map`` may type the step (a tensor-parallel
        step mixes split and replicated leaves in its buckets: ``False``).
      local_shapes: ``(params, batch_stats) -> (params, batch_stats)`` of one
        device's shapes for the bucket plan, or ``None`` (the full shapes).
      strategies: the strategies laid over data parallelism, outermost first
        (``("fsdp", "pipeline", "tensor")``); ``()``: data parallelism alone.
      details: what ``summary.json`` records about the layout (the pipeline's
        micro-batches and stage shares).
      line: the start-up line that describes it (``""``: none).
      point_to_point: ``(itemsize) -> dict``: the pipeline's traffic model over
        ``stage`` for the communication report
        (:func:`trjax.parallel.pipeline.boundary_traffic`), or ``None``.
      tensor_traffic: ``(itemsize) -> dict``: the byte model of the collectives over
        ``model`` (:func:`trjax.parallel.tensor.traffic`; on a pipeline
        :func:`trjax.parallel.pipeline.tensor_traffic`), or ``None``.
      collective_labels: ``{axis: {collective kind: label}}``: what a collective
        over a model-parallel axis carries (the report's labels of collectives
        the plan's sizes do not name).
      gather: ``(params) -> params`` inside ``shard_map``: the parameters the
        network applies to, from what this device holds (FSDP's and the
        pipeline's all-gathers), for the evaluation and the BN folding; the
        identity where the network runs on what is held.
      split_axes: the axes over which devices hold different slices of the
        parameters and their reduced gradient (``fsdp``, ``stage``, ``model``;
        ``()`` for data parallelism): the non-finite flag is summed over them so
        that every device applies or skips the same update, and the optimizer
        runs on global arrays outside ``shard_map`` (:func:`trjax.steps.make_train_step`:
        a norm over a split leaf is the unsplit leaf's).
      compile_options: XLA:CPU options the train step needs beside trjax's own
        (:data:`trjax.parallel.fsdp.REGATHER_OPTIONS`); ``{}``: none.
    """
    world: Any
    model: Any
    network: Any
    image_shape: tuple
    bn_mode: str
    forward_backward: Callable
    grad_axes: Any
    bn_reduce_axes: Any = None
    per_replica_stats: bool = False
    params: Any = P()
    batch_stats: Any = P()
    folded: Any = P()
    opt_state: Any = None
    check_vma: bool = True
    local_shapes: Callable | None = None
    strategies: tuple = ()
    details: dict = dataclasses.field(default_factory=dict)
    line: str = ""
    point_to_point: Callable | None = None
    tensor_traffic: Callable | None = None
    collective_labels: dict = dataclasses.field(default_factory=dict)
    gather: Callable = lambda params: params
    split_axes: tuple = ()
    compile_options: dict = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``"data"``, or the strategies joined outermost first (``"fsdp+tensor"``)."""
        return "+".join(self.strategies) or "data"

    @property
    def data_axis(self) -> str:
        """The data-parallel axis (batches split over it)."""
        return self.world.axis_name

    @property
    def batch(self) -> dict:
        """The ``shard_map`` specs of a batch: every leaf split over the data axis."""
        axis = self.data_axis
        return {"image": P(axis), "label": P(axis), "mask": P(axis)}

    @property
    def grad_replicas(self) -> int:
        """How many devices the gradient all-reduce spans (the product of the
        sizes of :attr:`grad_axes`)."""
        axes = self.grad_axes if isinstance(self.grad_axes, tuple) else (self.grad_axes,)
        sizes = dict(self.world.axes)
        return math.prod(sizes[a] for a in axes)

    def own_stats(self, batch_stats):
        """This device's BN statistics ``[C]`` (one row per replica: its own row)."""
        if not self.per_replica_stats:
            return batch_stats
        return jax.tree_util.tree_map(lambda x: x[0], batch_stats)

    def stats_rows(self, batch_stats):
        """This device's ``[C]`` statistics laid out as the state holds them."""
        if not self.per_replica_stats:
            return batch_stats
        return jax.tree_util.tree_map(lambda x: x[None], batch_stats)

    def replica_rows(self, batch_stats):
        """Global ``[C]`` statistics (outside ``shard_map``) as the state holds
        them: ``[world_size, C]``, every row equal, with per-replica rows."""
        if not self.per_replica_stats:
            return batch_stats
        n = self.world.world_size
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), batch_stats)

    def checkpoint_keys(self) -> dict:
        """What a checkpoint of this layout must match to be resumed: the world
        size with per-replica statistics (one row per replica), else nothing."""
        return {"world_size": self.world.world_size} if self.per_replica_stats else {}

    def describe(self) -> dict:
        """What ``summary.json`` records about the layout (:attr:`details`) and the
        network's remat (``{"paths": [...], "policy"}``, or ``None``)."""
        remat = self.network.remat
        return {**self.details, "remat": None if remat is None else {
            "paths": sorted("/".join(p) for p in remat.paths), "policy": remat.policy}}

    def with_exchange(self, exchange) -> "Layout":
        """This layout with the specs of ``exchange``'s optimizer state where the
        parameters are split (a parameter-shaped subtree gets the parameters'
        specs, :func:`like_params`); unchanged where they are replicated (the
        exchange lays its state out itself, e.g. ZeRO-1)."""
        if isinstance(self.params, P):
            return self
        variables = self.model.abstract_variables(self.image_shape)
        opt = jax.eval_shape(lambda p: exchange.init(p, self.world)[0], variables["params"])
        return dataclasses.replace(self, opt_state=like_params(opt, self.params))


def like_params(tree, param_specs):
    """Specs for ``tree`` (an optimizer state): each subtree with the structure of
    the parameters gets ``param_specs`` (optax's ``trace``, Adam's ``mu``/``nu``,
    trjax's EMA), every other leaf ``P()`` (step counts, empty states).
    ``optax.tree_map_params`` does this for a bare optax transformation; the
    exchange's state also holds :func:`trjax.exchange.with_ema`'s average."""
    target = jax.tree_util.tree_structure(param_specs, is_leaf=lambda x: isinstance(x, P))

    def walk(t):
        if jax.tree_util.tree_structure(t) == target:
            return param_specs
        if isinstance(t, (tuple, list)) and not hasattr(t, "_fields"):
            return type(t)(walk(x) for x in t)
        if hasattr(t, "_fields"):  # NamedTuple optax states
            return type(t)(*(walk(x) for x in t))
        if isinstance(t, dict):
            return {k: walk(v) for k, v in t.items()}
        return jax.tree_util.tree_map(lambda _: P(), t)
    return walk(tree)


def check_bn_mode(bn_mode: str, allowed=BN_MODES, what: str = "this mesh") -> None:
    """Raises ``ValueError`` naming ``bn_mode`` unless it is one of ``allowed``."""
    if bn_mode not in allowed:
        raise ValueError(f"bn_mode={bn_mode!r} is not supported on {what}: use one of "
                         f"{list(allowed)}")


def data_forward_backward(network, bn_mode: str, axis: str, params, batch_stats, batch,
                          options: objective.StepOptions, loss_scale, rng):
    """:func:`trjax.objective.forward_backward` on this device's own rows, its
    parameters cast to varying over ``axis`` first (so autodiff gives this
    device's partial gradient and the exchange's collectives are the only
    gradient collectives). The layouts bind ``network``, ``bn_mode`` and ``axis``."""
    o = options
    return objective.forward_backward(
        network, lax.pcast(params, axis, to="varying"), batch_stats, batch, loss_scale,
        o.grad_accumulation_steps, o.padding, bn_mode, axis, rng, o.loss_fn,
        o.label_smoothing, o.mixup_alpha, o.cutmix_alpha, o.objective_wrap)


def data_parallel(model, world, image_shape, bn_mode: str = "sync") -> Layout:
    """The data-parallel :class:`Layout`: every parameter replicated, the batch
    split over ``world.axis_name``, the gradient buckets and (``running`` mode)
    the BN sums all-reduced over it; ``local`` mode keeps one statistics row per
    replica.

    Args:
      model: a :class:`trjax.models.Network` or a flax module
        (:func:`trjax.models.as_network`; a trjax ResNet's BatchNorm
        ``axis_name`` is the data axis).
      world: a :class:`trjax.world.World` (its ``axis_name`` is the data axis).
      image_shape: ``(H, W, C)`` of one example.
      bn_mode: ``running``, ``sync`` or ``local``.

    Raises:
      ValueError: an unknown ``bn_mode``.
    """
    check_bn_mode(bn_mode, what="a data-parallel mesh")
    net, axis = models.as_network(model), world.axis_name
    local = bn_mode == "local"
    return Layout(world=world, model=net, network=net, image_shape=tuple(image_shape),
                  bn_mode=bn_mode,
                  forward_backward=functools.partial(data_forward_backward, net, bn_mode, axis),
                  grad_axes=axis, bn_reduce_axes=axis if bn_mode == "running" else None,
                  per_replica_stats=local, batch_stats=P(axis) if local else P(),
                  folded=P(axis) if local else P())
