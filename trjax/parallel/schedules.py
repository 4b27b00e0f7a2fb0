"""The pipeline's schedules, one signature: ``schedule(p, branches, run_stage, lp,
loss_sum) -> (grads, sums [4], bn_sums)`` per device, inside ``shard_map``.

``p``: the stage's parameters (varying over the loop's axes); ``branches``: per
stage its forward slot (:func:`forward_branch`); ``run_stage``: the stage runner
(:func:`trjax.parallel.pipeline.stage_runner`); ``lp``: the :class:`Loop` the
schedules share (micro-batches, boundary shapes, zero buffers, the loss scale);
``loss_sum``: ``(y, label, mask) -> (metric sums, scaled loss)`` of the last stage.

* ``gpipe`` (:func:`gpipe`): GPipe's loop of ``M + S - 1`` ticks, differentiated
  by autodiff (Huang et al., NeurIPS 2019);
* ``1f1b`` (:func:`one_f_one_b`): PipeDream-Flush's one forward, one backward per
  tick, ``M + 2S - 2`` ticks, O(S) stashed inputs (Narayanan et al., 2021);
* ``zb-h1`` (:func:`trjax.parallel.zero_bubble.forward_backward`): the backward
  split into input and weight gradients (Qi et al., ICLR 2024).

:data:`SCHEDULES` maps the names (``config.pipeline_schedule``) to them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from trjax import models
from trjax.collectives import as_varying
from trjax.metrics import batch_metrics
from trjax.objective import MIX_STREAM, example_losses, mix_batch
from trjax.parallel import zero_bubble

def make_loop(net, batch, params, run_stage, S: int, M: int, bn_mode: str, axes: tuple,
              bubble_fill: float, loss_scale=None, mixing=(0.0, 0.0), rng=None) -> "Loop":
    """The micro-batches (standardised, the last ``S - 1`` slots bubbles) and the
    boundaries' shapes (traced abstractly, stage by stage) the loops share.

    ``mixing``: ``(mixup_alpha, cutmix_alpha)``; either > 0 mixes micro-batch ``j``
    as gradient accumulation does (:func:`trjax.objective.mix_batch` with
    ``fold_in(fold_in(rng, j), MIX_STREAM)``), and its labels carry the partners and
    ``lam`` (:meth:`Loop.label`)."""
    image = batch["image"]
    mu = image.shape[0] // M
    x = models.normalize(image, net.mean, net.std, net.dtype)
    pad = lambda a, v: jnp.concatenate(
        [a.reshape((M, mu) + a.shape[1:]),
         jnp.full((S - 1, mu) + a.shape[1:], v, a.dtype)], axis=0)
    labels = pad(batch["label"], 0)
    if mixing[0] > 0 or mixing[1] > 0:
        if rng is None:
            raise ValueError("mixup_alpha / cutmix_alpha need the step's key (rng)")
        mix = lambda xj, mj, j: mix_batch(  # noqa: E731
            xj, mj, jax.random.fold_in(jax.random.fold_in(rng, j), MIX_STREAM), *mixing)
        xs, perm, lam = jax.vmap(mix)(x.reshape((M, mu) + x.shape[1:]),
                                      batch["mask"].reshape(M, mu),
                                      jnp.arange(M, dtype=jnp.int32))
        x = xs.reshape(x.shape)
        labels = {"label": labels, "perm": pad(perm.reshape(-1), 0),
                  "lam": jnp.concatenate([lam, jnp.ones((S - 1,), lam.dtype)])}
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
    return Loop(S, M, mu, axes, axes[-1], lax.axis_index(axes[-1]), shapes, zeros_bn, zeros_buf,
                 images, labels, pad(batch["mask"].astype(jnp.float32), 0),
                 bubble_fill, bn_axes, loss_scale)


def _deep_update(tree: dict, other: dict) -> None:
    """``tree.update(other)`` one level down where both hold a dict (an nnx list's
    layers share the top-level key ``layers``)."""
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict) and "sums" not in v:
            _deep_update(tree[k], v)
        else:
            tree[k] = v


def forward_branch(k: int, run_stage, lp: "Loop", loss_fn, label_smoothing):
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
            sums = loss_sum(y, label, mask, loss_fn, label_smoothing, None)[0]
        return tuple(outs), as_varying(sums, lp.axes), bn
    return fn


def gpipe(p, branches, run_stage, lp: "Loop", loss_sum):
    """GPipe's loop of ``M + S - 1`` ticks (the forward), differentiated by
    autodiff (the backward: the transposed loop, the inverse permutes carrying
    the cotangents upstream); ``run_stage`` and ``loss_sum`` are in the branches.
    Returns ``(grads, sums, bn_sums)``."""
    S, M, axes, stage, loss_scale = lp.S, lp.M, lp.axes, lp.stage, lp.loss_scale

    def objective(p):
        def tick(carry, t):
            bufs, sums_acc, bn_acc, loss_acc = carry
            j = t - stage
            valid = (j >= 0) & (j < M)
            jc = jnp.clip(j, 0, M + S - 2)
            mask = jnp.where(valid, lp.masks[jc], jnp.zeros_like(lp.masks[jc]))
            inputs = (as_varying(lp.images[t], axes),) + tuple(bufs)
            outs, sums, bn = lax.switch(stage, branches, p, inputs, as_varying(mask, axes),
                                        lp.label(jc), valid, jc)
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


def loss_sum(y, label, mask, loss_fn, label_smoothing, loss_scale):
    """The last stage's metric sums and the (scaled) summed loss it differentiates;
    ``label``: ``[mu]``, or with mixing ``{"label", "perm", "lam"}`` (the soft target of
    :func:`trjax.objective.example_losses`; top-1/top-5 count the rows' own labels)."""
    losses, mix = None, None
    if isinstance(label, dict):
        label, mix = label["label"], (label["perm"], label["lam"])
    if loss_fn is not None or label_smoothing > 0 or mix is not None:
        losses = example_losses(y, label, loss_fn, label_smoothing, mix)
    sums = batch_metrics(y, label, mask, losses)
    return sums, (sums[0] if loss_scale is None else sums[0] * loss_scale)


@dataclasses.dataclass(frozen=True)
class Loop:
    """What the GPipe and 1F1B loops share (built by :func:`make_loop`)."""
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
    loss_scale: object = None  # multiplies the loss GPipe differentiates (fp16), or None

    @property
    def width(self) -> int:
        """The largest stage input's elements (the micro-batch images or a boundary)."""
        return max([math.prod(self.images.shape[1:])] +
                   [math.prod(b.shape) for b in self.shapes])

    def label(self, j):
        """Micro-batch ``j``'s labels ``[mu]`` (with mixing, ``{"label", "perm", "lam"}``:
        :func:`make_loop`), varying over the loop's axes."""
        return jax.tree_util.tree_map(lambda a: as_varying(a[j], self.axes), self.labels)


def one_f_one_b(p, forward_branches, run_stage, lp: Loop, loss_sum):
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
    S, M, axes = lp.S, lp.M, lp.axes
    in_shapes = [lp.images.shape[1:]] + [b.shape for b in lp.shapes]
    in_dtypes = [lp.images.dtype] + [b.dtype for b in lp.shapes]
    width, dtype = lp.width, jnp.result_type(*in_dtypes)
    flat = lambda x: as_varying(jnp.pad(x.reshape(-1).astype(dtype), (0, width - x.size)), axes)
    zeros_grads = jax.tree_util.tree_map(lambda a: as_varying(jnp.zeros_like(a), axes), p)
    backward_branches = [_backward_branch(k, p, run_stage, lp, loss_sum, in_shapes[k],
                                          in_dtypes[k]) for k in range(S)]
    tick = functools.partial(_one_f_one_b_tick, p, forward_branches, backward_branches, lp,
                             flat)
    init = (tuple(lp.zeros_buf(b, lp.fill) for b in range(S - 1)),
            tuple(lp.zeros_buf(b, lp.fill) for b in range(S - 1)),
            as_varying(jnp.full((2 * S - 1, width), lp.fill, dtype), axes), zeros_grads,
            as_varying(jnp.zeros((4,), jnp.float32), axes), lp.zeros_bn())
    (_, _, _, grads, sums, bn), _ = lax.scan(tick, init,
                                             jnp.arange(M + 2 * S - 2, dtype=jnp.int32))
    return grads, sums, bn


def _backward_branch(k: int, p, run_stage, lp: Loop, loss_sum, in_shape, in_dtype):
    """1F1B's B slot of stage ``k``: ``(x_flat, cots, mask, label, valid, j) -> (dp,
    outs)``: the stage recomputed from its stashed input under ``jax.vjp``, the
    parameters' cotangent and the input's (to stage ``k - 1``); zeros when not ``valid``."""
    S, axes = lp.S, lp.axes

    def fn(x_flat, cots, mask, label, valid, j):
        x_in = x_flat[:math.prod(in_shape)].reshape(in_shape).astype(in_dtype)
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


def _one_f_one_b_tick(p, forward_branches, backward_branches, lp: Loop, flat, carry, t):
    """One 1F1B tick: F of micro-batch ``t - s`` (its input stashed), then B of
    ``t - 2(S-1) + s``, then one ``ppermute`` per boundary and direction."""
    S, M, axes, stage, K = lp.S, lp.M, lp.axes, lp.stage, 2 * lp.S - 1
    fwd, bwd, stash, grads, sums_acc, bn_acc = carry
    jf, jb = t - stage, t - 2 * (S - 1) + stage
    vf, vb = (jf >= 0) & (jf < M), (jb >= 0) & (jb < M)
    cf, cb = jnp.clip(jf, 0, M - 1), jnp.clip(jb, 0, M - 1)
    mf = jnp.where(vf, lp.masks[cf], jnp.zeros_like(lp.masks[cf]))
    mb = jnp.where(vb, lp.masks[cb], jnp.zeros_like(lp.masks[cb]))
    inputs = (as_varying(lp.images[cf], axes),) + tuple(fwd)
    # F: this device's stage on micro-batch jf; its input goes into the stash
    outs, sums, bn = lax.switch(stage, forward_branches, p, inputs, as_varying(mf, axes),
                                lp.label(cf), vf, cf)
    x_in = lax.switch(stage, [lambda i, k=k: flat(i[k]) for k in range(S)], inputs)
    slot = jf % K
    stash = stash.at[slot].set(jnp.where(vf, x_in, stash[slot]))
    sums_acc = sums_acc + jnp.where(vf, sums, jnp.zeros_like(sums))
    bn_acc = jax.tree_util.tree_map(lambda acc, a: acc + jnp.where(vf, a, jnp.zeros_like(a)),
                                    bn_acc, bn)
    outs = [jnp.where(vf, o, jnp.zeros_like(o)) for o in outs]
    # B: micro-batch jb from its stashed input and the cotangent received last tick
    dp, douts = lax.switch(stage, backward_branches, stash[jb % K], tuple(bwd),
                           as_varying(mb, axes), lp.label(cb), vb, cb)
    grads = jax.tree_util.tree_map(jnp.add, grads, dp)
    fwd = tuple(lax.ppermute(outs[b], lp.stage_axis, [(b, b + 1)]) for b in range(S - 1))
    bwd = tuple(lax.ppermute(douts[b], lp.stage_axis, [(b + 1, b)]) for b in range(S - 1))
    return (fwd, bwd, stash, grads, sums_acc, bn_acc), None


# -- the pipelined train step ---------------------------------------------------------------


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble.forward_backward}
"""``config.pipeline_schedule`` -> the schedule (one signature, module docstring): GPipe
(Huang et al. 2019), 1F1B (PipeDream-Flush: Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021; Megatron-LM's
``forward_backward_pipelining_without_interleaving``) and ZB-H1 (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024; :mod:`trjax.parallel.zero_bubble`)."""
