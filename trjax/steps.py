"""The train and eval steps: pure per-device functions, shard_mapped.

Per device, one train step is (the seed's graph order; :func:`make_train_step`):

1. forward + backward (the layout's ``forward_backward``, :mod:`trjax.parallel`:
   :func:`trjax.objective.forward_backward` on the local batch, with gradient
   accumulation over micro-batches, or a pipeline schedule; loss = SUM of
   per-example losses over real rows, padding rows carry mask 0);
2. pack the gradients into the MemoryPlan's bucket buffers, with the metric
   sums (loss, top-1, top-5, count) in the plan's metrics slot;
3. the gradient exchange (:mod:`trjax.exchange`) over the layout's grad axes:
   all-reduce (or reduce-scatter, or compress) the buckets in order, apply
   ``1/global_count`` once inside the optimizer update;
4. the BN running statistics from the batch's per-channel sums over real
   rows (:func:`sync_batch_stats`); ``running`` mode: one all-reduce of every
   layer's sums and counts (STATS_COMM), chained after the last bucket;
5. the loss scale (fp16) and a skip of the whole update when the reduced
   gradient is non-finite (every replica sees the same reduced values, so
   they agree without another collective);
6. the metric ``grad_norm``: the global L2 norm of the mean gradient the
   optimizer received (after the mean, before any clip, unscaled), taken by
   the exchange (:attr:`trjax.exchange.Update.grad_norm`) or, on a mesh that
   splits parameters, on the global arrays (:func:`_split_train_step`).

The model is any flax model, as a :class:`trjax.models.Network` (a bare linen or
nnx module is wrapped by :func:`trjax.models.as_network`): the steps standardise
the uint8 input (:func:`trjax.models.normalize`), then call it; flax's
BatchNorm layers compute trjax's statistics (:mod:`trjax.batchnorm`) and dropout
gets the key :func:`dropout_key`.

Autodiff inside ``shard_map`` (``check_vma=True``) sums the gradient of a
replicated (invariant) parameter over devices by itself; the parameters are
therefore cast to *varying* before differentiation, so each device gets only
its own partial gradient and the exchange's collectives are the only
gradient collectives.

Compile the returned functions with :func:`trjax.aot.compile_step`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import collectives
from trjax.batchnorm import update_running_tree
from trjax.exchange import GradientExchange, grad_norm_of
from trjax.metrics import StepMetrics, batch_metrics
from trjax.objective import (MIX_STREAM, StepOptions, check_loss_fn, cutmix_box,  # noqa: F401
                             dropout_key, example_losses, forward_backward, mix_batch,
                             mix_images, mix_partner)
from trjax.plan import MemoryPlan
from trjax import models
from trjax.precision import update_loss_scale
from trjax.state import TrainState, state_specs
from trjax.world import World

Layout = Any
"""A :class:`trjax.parallel.Layout` (read by its fields; this module sits below
:mod:`trjax.parallel` and does not import it)."""


def sync_batch_stats(batch_stats, bn_sums, reduce_axes, momentum, last, finite, rules=None):
    """The step's new BN running statistics from the batch's sums.

    With ``reduce_axes`` (``running`` mode: the sums are this device's own),
    every layer's shifted sums ``(sum (x-r), sum (x-r)^2, n)`` (``r``: its
    running mean, :mod:`trjax.batchnorm`) are packed into ONE buffer and
    all-reduced once (chained after ``last``; count-weighted by construction,
    see :func:`trjax.collectives.allreduce_batch_stats`), the result folded into
    ``finite``. ``None``: the sums are already what the update needs (``sync``
    mode: global; ``local`` mode: this replica's own). The update is
    :func:`trjax.batchnorm.update_running_tree`. A model without BatchNorm
    (``bn_sums`` empty) has no statistics all-reduce.

    Args:
      batch_stats: this device's running statistics (``[C]`` leaves).
      bn_sums: from the forward/backward (``{"sums": [2C + 1]}`` per layer).
      reduce_axes: an axis name or tuple of them
        (:attr:`trjax.parallel.Layout.bn_reduce_axes`), or ``None``.
      momentum: the momentum of every layer not in ``rules``.
      last: the token the all-reduce is chained after (the last bucket).
      finite: bool scalar, whether the update is good so far.
      rules: ``{module path: (momentum, unbiased)}`` per layer, or ``None``.

    Returns:
      ``(new batch_stats [C] leaves, finite)``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(bn_sums)
    if reduce_axes is not None and leaves:
        sizes = [x.size for x in leaves]
        packed = collectives.allreduce_batch_stats(
            jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]), reduce_axes,
            done=last)
        finite = finite & jnp.isfinite(jnp.sum(packed))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        bn_sums = jax.tree_util.tree_unflatten(
            treedef, [packed[o:o + n].reshape(x.shape) for o, n, x in zip(offsets, sizes, leaves)])
    return update_running_tree(batch_stats, bn_sums, momentum, rules), finite


def make_train_step(layout: Layout, exchange: GradientExchange, plan: MemoryPlan,
                    options: StepOptions | None = None) -> Callable:
    """Returns ``train_step(state, batch) -> (state, StepMetrics)`` over ``layout``'s mesh.

    Per device: ``layout.forward_backward`` (data parallel, tensor parallel or
    a pipeline schedule: :mod:`trjax.parallel`), then :func:`apply_gradients`
    (the buckets, the exchange over ``layout.grad_axes``, the BN statistics,
    the loss scale and the skip of a non-finite update). A layout that splits
    the parameters (``layout.split_axes``) runs the optimizer on global arrays
    instead (:func:`_split_train_step`).

    Args:
      layout: a :class:`trjax.parallel.Layout` (e.g.
        ``parallel.data_parallel(model, world, image_shape, bn_mode)``): the
        per-device network, the state's and the batch's specs and the axes
        every sum is reduced over. Dropout gets :func:`dropout_key` of the
        network's ``seed``, ``state.step``, the data rank and the micro-batch.
      exchange: the strategy (:mod:`trjax.exchange`): collectives, optimizer,
        state layout.
      plan: the MemoryPlan the gradients are packed with.
      options: a :class:`trjax.objective.StepOptions` (loss, mixing,
        accumulation, loss scaling); ``None``: the defaults (check a
        ``loss_fn`` with :func:`check_loss_fn` first). The mixing key depends only
        on the seed, the step, the rank and the micro-batch, so a resumed run
        mixes as one never stopped.

    Args of the returned function (global view): ``state``, a
    :class:`~trjax.state.TrainState`; ``batch``, ``{"image": [G, H, W, C],
    "label": [G] int32, "mask": [G] float32}`` sharded over the data axis.
    It returns the new state and a :class:`~trjax.metrics.StepMetrics` of the
    global sums of this step's batch (``finite`` 0.0 when the update was
    skipped on every replica) and ``grad_norm``, the global L2 norm of the mean
    gradient the optimizer received (before any clip; unscaled under fp16).
    """
    options = StepOptions() if options is None else options
    if layout.split_axes:
        return _split_train_step(layout, exchange, plan, options)

    def local_step(state: TrainState, batch):
        grads, sums, bn_sums, rules = _local_forward_backward(layout, options, state, batch)
        return apply_gradients(state, grads, sums, bn_sums, rules, plan, exchange, layout,
                               options)

    specs = state_specs(layout, exchange)
    return jax.shard_map(local_step, mesh=layout.world.mesh, in_specs=(specs, layout.batch),
                         out_specs=(specs, P()), check_vma=exchange.check_vma and layout.check_vma)


def apply_gradients(state: TrainState, grads, sums, bn_sums, rules, plan: MemoryPlan,
                    exchange: GradientExchange, layout: Layout,
                    options: StepOptions | None = None):
    """Per device, the tail of every train step: steps 2-5 of the module docstring.

    Args:
      state: this device's view of the :class:`~trjax.state.TrainState`.
      grads, sums, bn_sums, rules: from ``layout.forward_backward``: this
        device's gradient SUMS (loss-scaled), metric sums ``[4]``, BN batch sums.
      plan, exchange: pack the gradients and metric sums into the buckets and
        exchange them over ``layout.grad_axes`` (the data axis: a model-parallel
        layout's gradients are each device's own slices).
      layout: the :class:`trjax.parallel.Layout`: the grad axes, the axes the BN
        sums are still reduced over (``bn_reduce_axes``) and the statistics'
        rows (``stats_rows``).
      options: the loss scaling of :class:`trjax.objective.StepOptions`.

    Returns:
      ``(new_state, StepMetrics)``: the update is skipped (every leaf kept)
      when the reduced gradient or statistics are not finite.
    """
    options = StepOptions() if options is None else options
    scale = state.loss_scale if options.dynamic_loss_scale else None
    buffers = plan.pack(grads, lax.stop_gradient(sums))
    up = exchange.update(buffers, state.params, state.opt_state, state.comm_state,
                         state.step, scale, layout.grad_axes)
    new_bs, finite = _statistics_and_flag(layout, state.batch_stats, bn_sums, rules, up.last,
                                          up.finite)
    new = state.replace(params=up.params, opt_state=up.opt_state, comm_state=up.comm_state,
                        batch_stats=new_bs)
    return finish_step(state, new, up.sums, finite, options, up.grad_norm)


def _local_forward_backward(layout: Layout, options: StepOptions, state: TrainState, batch):
    """Per device: ``layout.forward_backward`` on the state, with the loss scale and the
    dropout key of the step and data rank (:func:`dropout_key`)."""
    scale = state.loss_scale if options.dynamic_loss_scale else None
    rng = dropout_key(layout.network.seed, state.step, lax.axis_index(layout.data_axis))
    return layout.forward_backward(state.params, layout.own_stats(state.batch_stats), batch,
                                   options, scale, rng)


def _statistics_and_flag(layout: Layout, batch_stats, bn_sums, rules, last, finite):
    """The new BN statistics as the state holds them (:func:`sync_batch_stats`) and
    whether the update is finite: on a layout that splits parameters each device
    checked its own slices, so the flag is summed over ``layout.split_axes`` and all
    devices skip or apply together."""
    new_bs, finite = sync_batch_stats(layout.own_stats(batch_stats), bn_sums,
                                      layout.bn_reduce_axes, 0.9, last, finite, rules)
    if layout.split_axes:
        bad = collectives.after((~finite).astype(jnp.float32), last)
        finite = lax.psum(bad, layout.split_axes) == 0
    return layout.stats_rows(new_bs), finite


def finish_step(state: TrainState, new: TrainState, sums, finite, options: StepOptions,
                grad_norm=None):
    """The loss scale's update, and ``new``'s params, optimizer, comm and BN
    states where ``finite``, else ``state``'s (the skip of a non-finite
    update); the step and skip counters advanced. Elementwise: per device or
    on global arrays alike.

    Args:
      grad_norm: the global norm of the mean gradient the optimizer received
        (:func:`trjax.exchange.grad_norm_of`), or ``None`` (an exchange that
        does not measure it: NaN).

    Returns:
      ``(new_state, StepMetrics)`` of the global metric ``sums``.
    """
    loss_scale, good_steps = state.loss_scale, state.good_steps
    if options.dynamic_loss_scale:
        loss_scale, good_steps = update_loss_scale(loss_scale, good_steps, finite,
                                                   options.growth_interval)
    keep = lambda new, old: jax.tree_util.tree_map(
        lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(
        comm_state=keep(new.comm_state, state.comm_state),
        step=state.step + 1,
        params=keep(new.params, state.params),
        batch_stats=keep(new.batch_stats, state.batch_stats),
        opt_state=keep(new.opt_state, state.opt_state),
        skipped_steps=state.skipped_steps + (1 - finite.astype(jnp.int32)),
        loss_scale=loss_scale, good_steps=good_steps)
    grad_norm = jnp.float32(jnp.nan) if grad_norm is None else grad_norm
    return new_state, StepMetrics.from_sums(sums, finite.astype(jnp.float32), loss_scale,
                                            grad_norm.astype(jnp.float32))


def _split_train_step(layout: Layout, exchange: GradientExchange, plan: MemoryPlan,
                      options: StepOptions) -> Callable:
    """:func:`make_train_step` of a mesh that splits parameters (``layout.split_axes``).

    Inside ``shard_map``: the forward and backward, the buckets' mean over
    ``layout.grad_axes`` (:attr:`~trjax.exchange.GradientExchange.mean`), the BN
    statistics and the non-finite flag summed over the split axes. Outside it,
    on global arrays laid out by ``layout``'s specs: the optimizer
    (:attr:`~trjax.exchange.GradientExchange.apply`) and the skip. A norm the
    optimizer takes (LARS's trust ratio, a global-norm clip, any in the user's
    own optax chain) is thus the norm of the unsplit leaf: XLA's partitioner
    sums each split leaf's squares over the axes that split it (MaxText's and
    big_vision's way); elementwise optimizers stay on each device's slices, with
    no collective. The step's ``grad_norm`` is taken there too, of the same
    global mean gradient (:func:`trjax.exchange.grad_norm_of`): each element of a
    split leaf once, a stage-owned leaf's padding never (the global arrays hold
    whole leaves).

    Raises:
      ValueError: an exchange without ``mean``/``apply`` (ZeRO-1: refused on
        these meshes by :func:`trjax.parallel.mesh.check_config`).
    """
    if exchange.apply is None:
        raise ValueError(f"exchange {exchange.name!r} updates inside shard_map only; a mesh "
                         f"with split axes {layout.split_axes} needs one with mean/apply")
    mesh, specs = layout.world.mesh, state_specs(layout, exchange)

    def local_mean(state: TrainState, batch):
        grads, sums, bn_sums, rules = _local_forward_backward(layout, options, state, batch)
        scale = state.loss_scale if options.dynamic_loss_scale else None
        m = exchange.mean(plan.pack(grads, lax.stop_gradient(sums)), state.comm_state,
                          state.step, scale, layout.grad_axes)
        new_bs, finite = _statistics_and_flag(layout, state.batch_stats, bn_sums, rules,
                                              m.last, m.finite)
        return m.grads, m.sums, finite, new_bs, m.comm_state

    mean = jax.shard_map(local_mean, mesh=mesh, in_specs=(specs, layout.batch),
                         out_specs=(specs.params, P(), P(), specs.batch_stats, specs.comm_state),
                         check_vma=False)

    def train_step(state: TrainState, batch):
        grads, sums, finite, new_bs, comm_state = mean(state, batch)
        params, opt_state = exchange.apply(grads, state.params, state.opt_state, state.step)
        new = state.replace(params=params, opt_state=opt_state, comm_state=comm_state,
                            batch_stats=new_bs)
        new_state, metrics = finish_step(state, new, sums, finite, options, grad_norm_of(grads))
        return _constrain(new_state, specs, mesh), metrics

    return train_step


def _constrain(tree, specs, mesh):
    """``tree`` laid out by ``specs`` (a pytree prefix of ``PartitionSpec``): the
    state a step returns keeps the layout it was given (donation, the next step)."""
    return lax.with_sharding_constraint(tree, jax.tree_util.tree_map(
        lambda s: jax.sharding.NamedSharding(mesh, s), specs,
        is_leaf=lambda x: isinstance(x, P)))


def make_fold_bn(layout: Layout) -> Callable:
    """Returns ``fold_bn(state) -> folded``: every BN's running statistics and
    affine folded into one per-channel ``scale``/``bias``, once per evaluation
    (see :func:`trjax.batchnorm.fold_batchnorm_tree`). No collective.

    Folded leaves are laid out as ``layout.folded`` says (``[C]`` replicated,
    ``[world_size, C]`` with one row per replica, or split over ``model``). A
    network that does not fold (:attr:`trjax.models.Network.folds` False: any
    model but trjax's ResNets) gets its ``batch_stats`` as they are
    (:meth:`trjax.models.Network.fold`)."""
    net = layout.network

    def local_fold(state: TrainState):
        params = layout.gather(state.params)
        return layout.stats_rows(net.fold(params, layout.own_stats(state.batch_stats)))

    return jax.shard_map(local_fold, mesh=layout.world.mesh, in_specs=(state_specs(layout),),
                         out_specs=layout.folded, check_vma=layout.check_vma)


def make_eval_step(layout: Layout, folded: bool = True) -> Callable:
    """Returns ``eval_step(params, bn, batch, acc) -> acc``: no collective.

    Args (of the returned function):
      params: the model params (laid out as ``layout.params``).
      bn: with ``folded=True`` the output of :func:`make_fold_bn` (the raw
        ``batch_stats`` for a network that does not fold); otherwise the raw
        ``batch_stats`` (BN then folds on every batch).
      batch: as for the train step (``eval_batch_size`` rows).
      acc: ``[data_size, 4] float32`` sharded over the data axis: each device
        adds its batch's ``loss_sum, top1, top5, count`` to its own row.

    ``layout``'s network runs with its training flag off (no randomness) on
    the standardised input (tensor parallel: the split network on the local
    slices; its head all-gathers the logits over ``model``).
    :func:`make_eval_reduce` turns ``acc`` into exact global values once per
    pass (the seed's VAL_RESULT_COMM).
    """
    net, axis = layout.network, layout.data_axis
    bn_spec = layout.folded if folded and net.folds else layout.batch_stats

    def local_eval(params, bn, batch, acc):
        x = models.normalize(batch["image"], net.mean, net.std, net.dtype)
        params = layout.gather(params)  # FSDP, pipeline: the whole parameters, per batch
        logits = net.apply_eval(params, layout.own_stats(bn), x, folded)
        return acc + batch_metrics(logits, batch["label"], batch["mask"])[None]

    return jax.shard_map(local_eval, mesh=layout.world.mesh,
                         in_specs=(layout.params, bn_spec, layout.batch, P(axis)),
                         out_specs=P(axis), check_vma=layout.check_vma)


def make_eval_reduce(world: World) -> Callable:
    """Returns ``reduce(acc [N, 4]) -> [4]``: the one all-reduce of a validation
    pass, giving global ``loss_sum, top1, top5, count``."""
    axis = world.axis_name
    return jax.shard_map(lambda acc: collectives.allreduce_sums(acc[0], axis),
                         mesh=world.mesh, in_specs=P(axis), out_specs=P())
