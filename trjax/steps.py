"""The train and eval steps: pure per-device functions, shard_mapped.

Per device, one train step is (the seed's graph order; :func:`make_train_step`):

1. forward + backward on the local batch (:func:`forward_backward`; loss =
   SUM of per-example losses over real rows, padding rows carry mask 0),
   with gradient accumulation over micro-batches;
2. pack the gradients into the MemoryPlan's bucket buffers, with the metric
   sums (loss, top-1, top-5, count) in the plan's metrics slot;
3. the gradient exchange (:mod:`trjax.exchange`): all-reduce (or
   reduce-scatter, or compress) the buckets in order, apply
   ``1/global_count`` once inside the optimizer update;
4. the BN running statistics from the batch's per-channel sums over real
   rows (:func:`sync_batch_stats`); ``running`` mode: one all-reduce of every
   layer's sums and counts (STATS_COMM), chained after the last bucket;
5. the loss scale (fp16) and a skip of the whole update when the reduced
   gradient is non-finite (every replica sees the same reduced values, so
   they agree without another collective).

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

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from trjax import collectives, models
from trjax.batchnorm import BatchNormContext, fold_batchnorm_tree, update_running_tree
from trjax.exchange import GradientExchange
from trjax.metrics import StepMetrics, batch_metrics
from trjax.plan import MemoryPlan
from trjax.precision import update_loss_scale
from trjax.state import TensorLayout, TrainState, state_specs
from trjax.world import World

def batch_spec(axis_name: str) -> dict:
    """The ``shard_map`` specs of a batch: every leaf split over the data axis."""
    return {"image": P(axis_name), "label": P(axis_name), "mask": P(axis_name)}


def dropout_key(seed: int, step, rank, micro=None):
    """The randomness of one micro-batch: ``fold_in(fold_in(fold_in(key(seed),
    step), rank), micro)`` (``micro`` ``None``: the key before the last fold).

    A pure function of the seed, the step counter and the data-parallel rank:
    a run resumed at any step draws the same dropout masks as one never
    stopped. ``seed``: ``config.seed``; ``step``, ``rank``, ``micro``: int32
    scalars (traced or not). Returns a typed PRNG key.
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), rank)
    return key if micro is None else jax.random.fold_in(key, micro)


MIX_STREAM = 0x6D6978
"""Folded into a micro-batch's key (:func:`dropout_key` with ``micro``) for its
mixup / cutmix draws, so they never share bits with the dropout masks."""


def check_loss_fn(loss_fn, num_classes: int) -> None:
    """Checks a per-example loss before anything is compiled (abstract shapes only).

    ``loss_fn(logits [B, K] float32, labels [B] int32) -> [B]`` float: it is
    traced once with :func:`jax.eval_shape` on a ``[2, K]`` example.

    Raises:
      TypeError: ``loss_fn`` is not callable.
      ValueError: it returns another shape (a scalar from ``.mean()``, say) or a
        non-float dtype; the message names what came back and the fix.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable: pass "
                        "loss_fn(logits [B, K] float32, labels [B] int32) -> [B] float32")
    out = jax.eval_shape(loss_fn, jax.ShapeDtypeStruct((2, num_classes), jnp.float32),
                         jax.ShapeDtypeStruct((2,), jnp.int32))
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (2,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"loss_fn returned shape {shape} dtype {dtype} for logits [2, "
                         f"{num_classes}] and labels [2]; it must return [2] float (one loss "
                         "per example): return per-example losses; trjax sums them over real "
                         "rows (no .mean() or .sum())")


def mix_partner(key, mask) -> jax.Array:
    """Each row's mixing partner: a random permutation of the REAL rows only.

    Args:
      key: a PRNG key.
      mask: ``[B]`` float32, 1 for real rows (anywhere in the batch).

    Returns:
      ``perm [B] int32``: real row ``i`` is mixed with real row ``perm[i]``
      (possibly itself); a padding row's partner is itself.
    """
    b = mask.shape[0]
    real = mask > 0
    index_order = jnp.argsort(jnp.where(real, 0, 1), stable=True)  # real rows, then padding
    u = jax.random.uniform(key, (b,))
    shuffled = jnp.argsort(jnp.where(real, u, 2.0), stable=True)  # real shuffled, then padding
    return jnp.zeros((b,), jnp.int32).at[index_order].set(shuffled.astype(jnp.int32))


def cutmix_box(key, lam, height: int, width: int):
    """CutMix's box (Yun et al. 2019): side ratio ``sqrt(1 - lam)``, centre uniform,
    clipped to the image. Returns ``(box [H, W] bool, lam corrected to the true
    area: 1 - box area / (H W))``."""
    ky, kx = jax.random.split(key)
    r = jnp.sqrt(1.0 - lam)
    cut_h, cut_w = jnp.floor(height * r).astype(jnp.int32), jnp.floor(width * r).astype(jnp.int32)
    cy = jax.random.randint(ky, (), 0, height)
    cx = jax.random.randint(kx, (), 0, width)
    y1, y2 = jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height)
    x1, x2 = jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width)
    rows, cols = jnp.arange(height), jnp.arange(width)
    box = ((rows >= y1) & (rows < y2))[:, None] & ((cols >= x1) & (cols < x2))[None, :]
    area = ((y2 - y1) * (x2 - x1)).astype(jnp.float32)
    return box, 1.0 - area / (height * width)


def mix_images(x, mask, perm, lam, box=None):
    """The mixed images of a batch (pure; the train step's mixup / cutmix).

    Args:
      x: ``[B, H, W, C]`` float images (standardised).
      mask: ``[B]``, 1 for real rows; padding rows are returned as they came
        (selected, so anything in them, NaN included, stays there).
      perm: ``[B] int32`` partners (:func:`mix_partner`: real rows only).
      lam: scalar float32 weight of each row's own image.
      box: ``None`` (mixup: ``lam x + (1 - lam) x[perm]``) or ``[H, W]`` bool
        (cutmix: the partner's pixels inside the box).

    Returns:
      ``[B, H, W, C]`` of ``x``'s dtype.
    """
    other = x[perm]
    if box is None:
        mixed = (lam * x.astype(jnp.float32) + (1.0 - lam) * other.astype(jnp.float32))
    else:
        mixed = jnp.where(box[None, :, :, None], other, x)
    real = (mask > 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(real, mixed.astype(x.dtype), x)


def example_losses(logits, labels, loss_fn=None, label_smoothing: float = 0.0, mix=None):
    """Per-example training losses ``[B]`` float32 (summed over real rows by
    :func:`trjax.metrics.batch_metrics`).

    Args:
      logits: ``[B, K]`` float32; labels: ``[B]`` int32 (hard).
      loss_fn: a user loss ``(logits, labels) -> [B]``, or ``None``: softmax
        cross-entropy against ``(1 - label_smoothing) onehot + label_smoothing / K``
        (``optax.smooth_labels``; 0: the plain integer-label CE).
      mix: ``None`` or ``(perm [B] int32, lam)``: the soft target ``lam y +
        (1 - lam) y[perm]`` (built-in CE: on the smoothed one-hots; a user loss:
        ``lam loss(labels) + (1 - lam) loss(labels[perm])``, the same for any
        loss linear in its target).
    """
    k = logits.shape[-1]
    if loss_fn is not None:
        losses = loss_fn(logits, labels)
        if mix is not None:
            perm, lam = mix
            losses = lam * losses + (1.0 - lam) * loss_fn(logits, labels[perm])
        return losses.astype(jnp.float32)
    if mix is None and not label_smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    target = jax.nn.one_hot(labels, k, dtype=jnp.float32)
    if label_smoothing:
        target = optax.smooth_labels(target, label_smoothing)
    if mix is not None:
        perm, lam = mix
        target = lam * target + (1.0 - lam) * target[perm]
    return optax.softmax_cross_entropy(logits, target)


def forward_backward(model, params, batch_stats, batch, loss_scale=None,
                     grad_accumulation_steps: int = 1, padding: bool = True,
                     bn_mode: str = "sync", axis_name=None, rng=None, loss_fn=None,
                     label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                     cutmix_alpha: float = 0.0):
    """Per device: gradients of the summed loss, metric sums, BN batch sums.

    Args:
      model: a :class:`trjax.models.Network` (or a module for
        :func:`trjax.models.as_network`).
      params: the parameters (cast to varying: gradients are this device's own).
      batch_stats: this device's BN statistics (``[C]`` leaves; ``{}`` without BN).
      batch: ``{"image": [B, H, W, C], "label": [B] int32, "mask": [B] float32}``;
        the image is standardised here (:func:`trjax.models.normalize`).
      loss_scale: multiplies the loss before backward (fp16), or ``None``.
      grad_accumulation_steps: k micro-batches of ``B / k`` rows; gradients,
        metric sums and BN batch sums are summed locally (``lax.scan``). The
        BN sums being sums, the step's running-statistics update is that of
        all k micro-batches' real rows together, whatever their real counts
        (an all-padding micro-batch adds nothing).
      padding: whether the batch may hold padding rows. ``False`` (every row
        is real, mask 1): BatchNorm runs without the mask (its sums over all
        rows, no zeroing of padding rows), a program ~20% cheaper to compile
        and ~10% faster per step (the main job's ResNet-20 on 8 simulated
        devices, ``docs/performance.md``); the loss and metrics still use the
        mask, so a row of mask 0 would be wrong only in the BN statistics.
      bn_mode, axis_name: how flax's BatchNorm layers compute their statistics
        (:class:`trjax.batchnorm.BatchNormContext`).
      rng: the step's dropout key on this device (:func:`dropout_key` without
        ``micro``); micro-batch ``i`` uses ``fold_in(rng, i)``. ``None``: no
        randomness.
      loss_fn, label_smoothing: the per-example training loss
        (:func:`example_losses`); top-1/top-5 stay on the hard labels.
      mixup_alpha, cutmix_alpha: > 0: per micro-batch, ``lam ~ Beta(alpha,
        alpha)`` from ``fold_in(fold_in(rng, i), MIX_STREAM)``; each real row
        is mixed with a real partner (:func:`mix_partner`, :func:`mix_images`;
        cutmix's ``lam`` corrected to its box's area, :func:`cutmix_box`), the
        loss taken on the soft target; padding rows stay padding (mask 0).
        Both > 0: each micro-batch draws one of the two with probability 1/2
        (timm's ``switch_prob``). Needs ``rng``.

    Returns:
      ``(grads, sums [4] float32, bn_sums, rules)``; gradients of
      ``loss_scale * sum of losses`` (not yet divided by any count); ``bn_sums``
      the model's ``bn_sums`` collection (per BN ``{"sums": [2C + 1]}``, see
      :class:`trjax.batchnorm.BatchNorm`); ``rules`` ``{module path: (momentum,
      unbiased)}`` of every BatchNorm (for
      :func:`trjax.batchnorm.update_running_tree`).

    Raises:
      ValueError (while tracing): a ``batch_stats`` leaf no adapted BatchNorm keeps.
    """
    net = models.as_network(model)
    rules: dict = {}
    mixing = mixup_alpha > 0 or cutmix_alpha > 0
    custom = loss_fn is not None or label_smoothing > 0 or mixing
    if mixing and rng is None:
        raise ValueError("mixup_alpha / cutmix_alpha need the step's key (rng)")

    def mix(x, mask, key):
        k_perm, k_lam, k_box, k_pick = jax.random.split(key, 4)
        perm = mix_partner(k_perm, mask)
        if mixup_alpha > 0:
            lam_mixup = jax.random.beta(k_lam, mixup_alpha, mixup_alpha).astype(jnp.float32)
            mixed_mixup = mix_images(x, mask, perm, lam_mixup)
        if cutmix_alpha > 0:
            lam_cut = jax.random.beta(jax.random.fold_in(k_lam, 1), cutmix_alpha,
                                      cutmix_alpha).astype(jnp.float32)
            box, lam_cut = cutmix_box(k_box, lam_cut, x.shape[1], x.shape[2])
            mixed_cut = mix_images(x, mask, perm, lam_cut, box)
        if cutmix_alpha <= 0:
            return mixed_mixup, perm, lam_mixup
        if mixup_alpha <= 0:
            return mixed_cut, perm, lam_cut
        use_cut = jax.random.bernoulli(k_pick)
        return (jnp.where(use_cut, mixed_cut, mixed_mixup), perm,
                jnp.where(use_cut, lam_cut, lam_mixup))

    def objective(p, micro, index):
        ctx = BatchNormContext(bn_mode, axis_name, micro["mask"] if padding else None)
        x = models.normalize(micro["image"], net.mean, net.std, net.dtype)
        key = None if rng is None else jax.random.fold_in(rng, index)
        mixed = None
        if mixing:
            x, perm, lam = mix(x, micro["mask"], jax.random.fold_in(key, MIX_STREAM))
            mixed = (perm, lam)
        logits, micro_sums = net.apply_train(p, batch_stats, x, ctx, key)
        rules.update(ctx.rules)
        losses = example_losses(logits, micro["label"], loss_fn, label_smoothing, mixed) \
            if custom else None
        sums = batch_metrics(logits, micro["label"], micro["mask"], losses)
        loss = sums[0] if loss_scale is None else sums[0] * loss_scale
        return loss, (sums, micro_sums)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    k = grad_accumulation_steps
    if k == 1:
        (_, (sums, bn_sums)), grads = grad_fn(params, batch, 0)
        models.check_batch_stats(batch_stats, rules)
        return grads, sums, bn_sums, rules
    micro = jax.tree_util.tree_map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)

    def body(carry, xs):
        mb, index = xs
        (_, (m, st)), g = grad_fn(params, mb, index)
        return jax.tree_util.tree_map(jnp.add, carry, (g, m, st)), None

    (_, (sums, bn_sums)), grads = grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], micro), 0)
    (grads, sums, bn_sums), _ = lax.scan(
        body, (grads, sums, bn_sums),
        (jax.tree_util.tree_map(lambda x: x[1:], micro), jnp.arange(1, k, dtype=jnp.int32)))
    models.check_batch_stats(batch_stats, rules)
    return grads, sums, bn_sums, rules


def sync_batch_stats(batch_stats, bn_sums, bn_mode: str, momentum, last, finite,
                     axis_name: str, rules=None):
    """The step's new BN running statistics by mode.

    ``running``: every layer's shifted sums ``(sum (x-r), sum (x-r)^2, n)``
    (``r``: its running mean, :mod:`trjax.batchnorm`) packed into ONE buffer,
    one all-reduce (chained after ``last``; the sums are count-weighted by
    construction, see :func:`trjax.collectives.allreduce_batch_stats`), the
    result folded into ``finite``; ``sync``: the sums are already global;
    ``local``: this replica's own sums, one row per replica. The update is
    :func:`trjax.batchnorm.update_running_tree` in every mode. A model without
    BatchNorm (``bn_sums`` empty) has no statistics all-reduce.

    Args:
      batch_stats: this device's running statistics (``[C]`` leaves).
      bn_sums: from :func:`forward_backward`.
      momentum: the momentum of every layer not in ``rules``.
      axis_name: the data axis (``running`` mode reduces over it).
      rules: ``{module path: (momentum, unbiased)}`` per layer (from
        :func:`forward_backward`), or ``None``.

    Returns:
      ``(batch_stats laid out as the state holds them, finite)``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(bn_sums)
    if bn_mode == "running" and leaves:
        sizes = [x.size for x in leaves]
        packed = collectives.allreduce_batch_stats(
            jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]), axis_name,
            done=last)
        finite = finite & jnp.isfinite(jnp.sum(packed))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        bn_sums = jax.tree_util.tree_unflatten(
            treedef, [packed[o:o + n].reshape(x.shape) for o, n, x in zip(offsets, sizes, leaves)])
    new = update_running_tree(batch_stats, bn_sums, momentum, rules)
    if bn_mode == "local":
        return jax.tree_util.tree_map(lambda x: x[None], new), finite
    return new, finite


def _local_stats(batch_stats, bn_mode: str):
    """This device's BN statistics (``local`` mode stores one row per replica)."""
    return jax.tree_util.tree_map(lambda x: x[0], batch_stats) if bn_mode == "local" \
        else batch_stats


def make_train_step(model, exchange: GradientExchange, plan: MemoryPlan,
                    world: World, bn_mode: str, dynamic_loss_scale: bool = False,
                    growth_interval: int = 2000, grad_accumulation_steps: int = 1,
                    padding: bool = True, loss_fn=None, label_smoothing: float = 0.0,
                    mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                    layout: TensorLayout | None = None) -> Callable:
    """Returns ``train_step(state, batch) -> (state, StepMetrics)`` over ``world``.

    Args:
      model: a :class:`trjax.models.Network` or a flax module
        (:func:`trjax.models.as_network`; trjax's ResNets with BatchNorm
        ``axis_name`` = the data axis). Every BatchNorm's running update uses
        its own momentum; dropout gets :func:`dropout_key` of the network's
        ``seed``, ``state.step``, the rank and the micro-batch.
      exchange: the strategy (:mod:`trjax.exchange`): collectives, optimizer,
        state layout.
      plan: the MemoryPlan the gradients are packed with.
      world: devices and mesh.
      bn_mode: ``running``, ``sync`` or ``local``.
      dynamic_loss_scale: fp16: the loss is multiplied by ``state.loss_scale``
        before backward and the scale updated by
        :func:`trjax.precision.update_loss_scale`.
      growth_interval: good steps before the loss scale doubles.
      grad_accumulation_steps: micro-batches per optimizer step (see
        :func:`forward_backward`); one exchange per step.
      padding: ``False`` when no batch this step is fed holds a padding row
        (:func:`trjax.data.input_pipeline.train_batches_full`): BatchNorm is then
        traced without the padding mask (see :func:`forward_backward`).
      loss_fn, label_smoothing, mixup_alpha, cutmix_alpha: the training loss
        and mixing (see :func:`forward_backward`; ``loss_fn`` checked first by
        :func:`check_loss_fn`). The metrics' ``loss_sum`` is then that loss;
        the evaluation step always measures the plain cross-entropy. The
        mixing key depends only on the seed, the step, the rank and the
        micro-batch, so a resumed run mixes as one never stopped.
      layout: tensor parallelism (Megatron) over the world's ``model`` axis
        (:func:`trjax.state.tensor_layout`): the split network runs on the
        local slices, its f/g all-reduces over ``model`` inside the forward and
        backward (:mod:`trjax.tensor`), and the exchange all-reduces the local
        gradients over ``data`` only. Traced with ``check_vma=False`` (the
        buckets mix split and replicated leaves; the mappings are explicit).

    Args of the returned function (global view): ``state``, a
    :class:`~trjax.state.TrainState`; ``batch``, ``{"image": [G, H, W, C],
    "label": [G] int32, "mask": [G] float32}`` sharded over the data axis.
    It returns the new state and a :class:`~trjax.metrics.StepMetrics` of the
    global sums of this step's batch (``finite`` 0.0 when the update was
    skipped on every replica).
    """
    net, axis = models.as_network(model), world.axis_name
    if layout is not None:
        net = layout.network

    def local_step(state: TrainState, batch):
        scale = state.loss_scale if dynamic_loss_scale else None
        old_bs = _local_stats(state.batch_stats, bn_mode)
        grads, sums, bn_sums, rules = forward_backward(
            net, lax.pcast(state.params, axis, to="varying"), old_bs, batch, scale,
            grad_accumulation_steps, padding, bn_mode, axis,
            dropout_key(net.seed, state.step, lax.axis_index(axis)), loss_fn,
            label_smoothing, mixup_alpha, cutmix_alpha)
        return apply_gradients(state, grads, sums, bn_sums, rules, plan, exchange, axis,
                               bn_mode, (bn_mode, axis), dynamic_loss_scale, growth_interval)

    specs = state_specs(bn_mode, axis, exchange, layout)
    return jax.shard_map(local_step, mesh=world.mesh, in_specs=(specs, batch_spec(axis)),
                         out_specs=(specs, P()),
                         check_vma=exchange.check_vma and layout is None)


def apply_gradients(state: TrainState, grads, sums, bn_sums, rules, plan: MemoryPlan,
                    exchange: GradientExchange, grad_axis, bn_mode: str, stats,
                    dynamic_loss_scale: bool = False, growth_interval: int = 2000):
    """Per device, the tail of every train step: steps 2-5 of the module docstring.

    Args:
      state: this device's view of the :class:`~trjax.state.TrainState`.
      grads, sums, bn_sums, rules: from :func:`forward_backward` (or
        :func:`trjax.pipeline.pipeline_forward_backward`): this device's
        gradient SUMS (loss-scaled), metric sums ``[4]``, BN batch sums.
      plan, exchange: pack the gradients and metric sums into the buckets and
        exchange them over ``grad_axis`` (an axis name or a tuple of them:
        ``("data", "stage")`` for a pipeline whose devices each hold part of
        the gradient).
      bn_mode: the state's BN layout (``local``: one row per replica).
      stats: ``(mode, axis)`` for :func:`sync_batch_stats`: how the BN sums
        still have to be reduced (``running``: all-reduced over ``axis``;
        ``local`` only with ``bn_mode="local"``).
      dynamic_loss_scale, growth_interval: see :func:`make_train_step`.

    Returns:
      ``(new_state, StepMetrics)``: the update is skipped (every leaf kept)
      when the reduced gradient or statistics are not finite.
    """
    scale = state.loss_scale if dynamic_loss_scale else None
    old_bs = _local_stats(state.batch_stats, bn_mode)
    buffers = plan.pack(grads, lax.stop_gradient(sums))
    up = exchange.update(buffers, state.params, state.opt_state, state.comm_state,
                         state.step, scale, grad_axis)
    new_bs, finite = sync_batch_stats(old_bs, bn_sums, stats[0], 0.9, up.last, up.finite,
                                      stats[1], rules)
    loss_scale, good_steps = state.loss_scale, state.good_steps
    if dynamic_loss_scale:
        loss_scale, good_steps = update_loss_scale(loss_scale, good_steps, finite,
                                                   growth_interval)
    keep = lambda new, old: jax.tree_util.tree_map(
        lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(
        comm_state=keep(up.comm_state, state.comm_state),
        step=state.step + 1,
        params=keep(up.params, state.params),
        batch_stats=keep(new_bs, state.batch_stats),
        opt_state=keep(up.opt_state, state.opt_state),
        skipped_steps=state.skipped_steps + (1 - finite.astype(jnp.int32)),
        loss_scale=loss_scale, good_steps=good_steps)
    return new_state, StepMetrics.from_sums(up.sums, finite.astype(jnp.float32), loss_scale)


def make_fold_bn(world: World, bn_mode: str, model=None,
                 layout: TensorLayout | None = None) -> Callable:
    """Returns ``fold_bn(state) -> folded``: every BN's running statistics and
    affine folded into one per-channel ``scale``/``bias``, once per evaluation
    (see :func:`trjax.batchnorm.fold_batchnorm_tree`). No collective.
    Folded leaves are ``[C]`` (``[world_size, C]`` in ``local`` mode).

    ``model``: a network that does not fold (:attr:`trjax.models.Network.folds`
    False: any model but trjax's ResNets) gets its ``batch_stats`` as they are
    (:meth:`trjax.models.Network.fold`); ``None``: fold (trjax's ResNets)."""
    fold = fold_batchnorm_tree if model is None else models.as_network(model).fold
    spec = P(world.axis_name) if bn_mode == "local" else P()
    if layout is not None:  # tensor parallel: each device folds its own channels
        spec = layout.folded if layout.network.folds else layout.batch_stats

    def local_fold(state: TrainState):
        bs = state.batch_stats
        if bn_mode == "local":
            bs = jax.tree_util.tree_map(lambda x: x[0], bs)
        folded = fold(state.params, bs)
        if bn_mode == "local":
            folded = jax.tree_util.tree_map(lambda x: x[None], folded)
        return folded

    return jax.shard_map(local_fold, mesh=world.mesh,
                         in_specs=(state_specs(bn_mode, world.axis_name, layout=layout),),
                         out_specs=spec)


def make_eval_step(model, world: World, bn_mode: str, folded: bool = True,
                   layout: TensorLayout | None = None) -> Callable:
    """Returns ``eval_step(params, bn, batch, acc) -> acc``: no collective.

    Args (of the returned function):
      params: the model params (replicated).
      bn: with ``folded=True`` the output of :func:`make_fold_bn` (the raw
        ``batch_stats`` for a network that does not fold); otherwise the raw
        ``batch_stats`` (BN then folds on every batch).

    ``model``: a :class:`trjax.models.Network` or a flax module; it runs with
    its training flag off (no randomness) on the standardised input.
      batch: as for the train step (``eval_batch_size`` rows).
      acc: ``[world_size, 4] float32`` sharded over the data axis: each device
        adds its batch's ``loss_sum, top1, top5, count`` to its own row.

    :func:`make_eval_reduce` turns ``acc`` into exact global values once per
    pass (the seed's VAL_RESULT_COMM).

    ``layout``: tensor parallel (:func:`trjax.state.tensor_layout`): the split
    network on the local slices (its head all-gathers the logits over ``model``).
    """
    net, axis = models.as_network(model), world.axis_name
    bn_spec = P(axis) if bn_mode == "local" else P()
    p_spec = P()
    if layout is not None:
        net, p_spec = layout.network, layout.params
        bn_spec = layout.folded if folded and net.folds else layout.batch_stats

    def local_eval(params, bn, batch, acc):
        if bn_mode == "local":
            bn = jax.tree_util.tree_map(lambda x: x[0], bn)
        x = models.normalize(batch["image"], net.mean, net.std, net.dtype)
        logits = net.apply_eval(params, bn, x, folded)
        return acc + batch_metrics(logits, batch["label"], batch["mask"])[None]

    return jax.shard_map(local_eval, mesh=world.mesh,
                         in_specs=(p_spec, bn_spec, batch_spec(axis), P(axis)),
                         out_specs=P(axis), check_vma=layout is None)


def make_eval_reduce(world: World) -> Callable:
    """Returns ``reduce(acc [N, 4]) -> [4]``: the one all-reduce of a validation
    pass, giving global ``loss_sum, top1, top5, count``."""
    axis = world.axis_name
    return jax.shard_map(lambda acc: collectives.allreduce_sums(acc[0], axis),
                         mesh=world.mesh, in_specs=P(axis), out_specs=P())
