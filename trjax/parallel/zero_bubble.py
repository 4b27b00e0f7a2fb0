"""The zero-bubble pipeline schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024), as a tick table run by one SPMD loop.

The backward of a stage splits into B, the input gradient (on the critical path: the
stage before waits for it), and W, the weight gradient (which nothing waits for). ZB-H1
keeps 1F1B's order of F and B and lets W fill the slots where a stage would wait, so in
the paper's unit-time model (F = B = W) a step takes ``3M + S - 1`` units against 1F1B's
``3(M + S - 1)``: the bubble falls from ``3(S - 1)`` units per device to ``S - 1``.

:func:`table` builds the schedule greedily, tick by tick, from the dependencies (F of
micro-batch j on stage s after stage s - 1's; B after stage s + 1's, the last stage's after
its own F; W after B) with the priority B > F > W, and two caps: a stage runs at most
``S - s`` micro-batches between their F and their B (1F1B's activations in flight) and
at most :func:`slots` between F and W (what it keeps: the stage input and, for W, the
output cotangent), with a slot free on the next stage for what it sends. With these caps
the greedy schedule reaches ``3M + S - 1`` ticks at S = 2 (any M) and S = 4, M = 4, and two
ticks more at S = 4, M = 8 or 12 and S = 8, M = 16 (:func:`ticks`; a cap of ``S + 1`` would
reach ``3M + S - 1`` at S = 4 for two more slots of memory).

:func:`forward_backward` runs a table: a ``lax.scan`` over its ticks, each device running
its own entry (``lax.switch`` over idle and each stage's F, B and W: an idle slot runs
nothing), then one exact-shape ``ppermute`` per boundary and direction; what a device
receives is stored by micro-batch in two rings of :func:`slots` flat slots. B and W each
recompute the stage from its stashed input (as 1F1B's backward does) and differentiate
with respect to the input only, or the parameters only, so XLA keeps only that half.
Every entry of the table is a real micro-batch: no slot computes on padding, and a buffer
is read only after it was written (NaN-filled buffers give bitwise the same result).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from trjax.collectives import as_varying

IDLE, F, B, W = 0, 1, 2, 3


def slots(num_stages: int) -> int:
    """Micro-batches a stage keeps between their F and their W: ``S`` (each slot a stage
    input and an output cotangent; 1F1B keeps ``2S - 1`` stage inputs)."""
    return num_stages


@functools.lru_cache(maxsize=None)
def table(num_stages: int, num_microbatches: int) -> np.ndarray:
    """ZB-H1's tick table: ``[T, S, 2]`` int32, entry ``(kind, j)`` of stage ``s`` at
    tick ``t`` (kind :data:`IDLE`, :data:`F`, :data:`B` or :data:`W`; ``j`` the
    micro-batch). See the module docstring for the rules.

    Raises:
      ValueError: ``num_microbatches < num_stages`` or ``num_stages < 1``.
    """
    S, M, K = int(num_stages), int(num_microbatches), slots(num_stages)
    if S < 1 or M < S:
        raise ValueError(f"zb-h1 needs 1 <= S <= M, got S={S}, M={M}")
    done: dict = {}
    nf, nb, nw, rows = [0] * S, [0] * S, [0] * S, []
    while min(nw) < M:
        t, row = len(rows), []
        for s in range(S):
            jf, jb, jw = nf[s], nb[s], nw[s]
            up = done.get((B, jb, s + 1) if s < S - 1 else (F, jb, s), t) < t
            free_next = s == S - 1 or jf - nw[s + 1] < K
            if jb < nf[s] and up:
                row.append((B, jb))
            elif (jf < M and (s == 0 or done.get((F, jf, s - 1), t) < t)
                  and nf[s] - nb[s] < S - s and nf[s] - nw[s] < K and free_next):
                row.append((F, jf))
            elif jw < nb[s]:
                row.append((W, jw))
            else:
                row.append((IDLE, 0))
        for s, (kind, j) in enumerate(row):
            if kind != IDLE:
                done[(kind, j, s)] = t
                counter = {F: nf, B: nb, W: nw}[kind]
                counter[s] += 1
        rows.append(row)
        if len(rows) > 4 * (M + S) * 3:
            raise AssertionError(f"zb-h1 table for S={S}, M={M} does not finish")
    return np.asarray(rows, np.int32)


def ticks(num_stages: int, num_microbatches: int) -> dict:
    """The schedule's length against the unit-time figures: ZB-H1's table, the paper's
    ``3M + S - 1``, 1F1B ``3(M + S - 1)`` (B and W one slot of two units), and the idle
    fraction of the table's slots (the bubble)."""
    tb = table(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    return {"ticks": int(tb.shape[0]), "ideal": 3 * M + S - 1, "one_f_one_b": 3 * (M + S - 1),
            "bubble": float((tb[:, :, 0] == IDLE).mean())}


@dataclasses.dataclass(frozen=True)
class _Ring:
    """What a device keeps between ticks: :func:`slots` flat slots of the widest
    boundary activation (``width`` elements of ``dtype``), one ring for the stage
    inputs received, one for the output cotangents."""
    in_shapes: list   # stage k's input shape (k = 0: the micro-batch images)
    width: int
    dtype: object
    axes: tuple

    @classmethod
    def of(cls, lp) -> "_Ring":
        dtype = jnp.result_type(*[b.dtype for b in lp.shapes]) if lp.S > 1 else jnp.float32
        return cls([lp.images.shape[1:]] + [b.shape for b in lp.shapes],
                   max([1] + [math.prod(b.shape) for b in lp.shapes]), dtype, lp.axes)

    def flat(self, x):
        return as_varying(jnp.pad(x.reshape(-1).astype(self.dtype), (0, self.width - x.size)),
                          self.axes)

    def zeros(self):
        return as_varying(jnp.zeros((self.width,), self.dtype), self.axes)

    def stage_input(self, lp, k, xs, j):
        """Stage ``k``'s input of micro-batch ``j``: the images, or ring slot ``j % K``."""
        if k == 0:
            return lp.images[j]
        return xs[j % slots(lp.S)][:math.prod(self.in_shapes[k])].reshape(
            self.in_shapes[k]).astype(lp.shapes[k - 1].dtype)


class _Step(NamedTuple):
    """One step's fixed parts, shared by every tick's branches."""
    p: object
    forward_branches: list
    run_stage: object
    lp: object
    loss_sum: object
    ring: _Ring
    zeros_grads: object


def _grad_of(c: _Step, k: int, xs, cs, j, wrt_params: bool):
    """B (``wrt_params`` False: the stage input's cotangent) or W (the parameters')
    of stage ``k`` on micro-batch ``j``, recomputing the stage from its stashed input."""
    lp, S, K = c.lp, c.lp.S, slots(c.lp.S)
    x, mask, label = c.ring.stage_input(lp, k, xs, j), lp.masks[j], lp.label(j)
    if k < S - 1:
        f = lambda q, x: c.run_stage(k, q, x, mask, j)[0]  # noqa: E731
        ct = cs[j % K][:math.prod(lp.shapes[k].shape)].reshape(lp.shapes[k].shape)
    else:
        f = lambda q, x: c.loss_sum(c.run_stage(k, q, x, mask, j)[0], label, mask)[1]  # noqa: E731
        ct = None
    if wrt_params:
        y, vjp = jax.vjp(lambda q: f(q, x), c.p)
    else:
        y, vjp = jax.vjp(lambda x: f(c.p, x), x)
    return vjp(jnp.ones_like(y) if ct is None else ct.astype(y.dtype))[0]


def _branch(c: _Step, kind: int, k: int):
    """The ``lax.switch`` branch of ``kind`` (F, B, W or idle) on stage ``k``:
    ``(xs, cs, j) -> (outs, bouts, grads, sums, bn)``, zeros where it makes nothing."""
    lp, S, axes = c.lp, c.lp.S, c.lp.axes

    def fn(xs, cs, j):
        outs = [lp.zeros_buf(b) for b in range(S - 1)]
        bouts = [lp.zeros_buf(b) for b in range(S - 1)]
        grads, sums, bn = c.zeros_grads, as_varying(jnp.zeros((4,), jnp.float32), axes), \
            lp.zeros_bn()
        if kind == F:
            inputs = tuple(c.ring.stage_input(lp, k, xs, j) if i == k else
                           as_varying(jnp.zeros(s, c.ring.dtype), axes)
                           for i, s in enumerate(c.ring.in_shapes))
            outs, sums, bn = c.forward_branches[k](c.p, inputs, as_varying(lp.masks[j], axes),
                                                   lp.label(j), True, j)
            outs = list(outs)
        elif kind == B and k > 0:
            bouts[k - 1] = as_varying(_grad_of(c, k, xs, cs, j, False).astype(
                lp.shapes[k - 1].dtype), axes)
        elif kind == W:
            grads = jax.tree_util.tree_map(lambda g: as_varying(g, axes),
                                           _grad_of(c, k, xs, cs, j, True))
        return tuple(outs), tuple(bouts), grads, sums, bn
    return fn


def _tick(c: _Step, branches, carry, row):
    """One tick: this device's entry of ``row`` (its branch), one ``ppermute`` per
    boundary and direction, and what arrives stored in the rings by micro-batch."""
    lp, S, K, ring = c.lp, c.lp.S, slots(c.lp.S), c.ring
    xs, cs, grads, sums_acc, bn_acc = carry
    stage = lp.stage
    mine = row[stage]
    index = jnp.where(mine[0] == IDLE, 0, (mine[0] - 1) * S + stage + 1)
    outs, bouts, dp, sums, bn = lax.switch(index, branches, xs, cs, mine[1])
    fwd = [lax.ppermute(outs[b], lp.stage_axis, [(b, b + 1)]) for b in range(S - 1)]
    bwd = [lax.ppermute(bouts[b], lp.stage_axis, [(b + 1, b)]) for b in range(S - 1)]
    if S > 1:
        prev, nxt = row[jnp.maximum(stage - 1, 0)], row[jnp.minimum(stage + 1, S - 1)]
        got_x = lax.switch(stage, [ring.zeros] +
                           [lambda b=b: ring.flat(fwd[b]) for b in range(S - 1)])
        got_c = lax.switch(stage, [lambda b=b: ring.flat(bwd[b]) for b in range(S - 1)] +
                           [ring.zeros])
        store_x = (stage > 0) & (prev[0] == F)
        store_c = (stage < S - 1) & (nxt[0] == B)
        xs = xs.at[prev[1] % K].set(jnp.where(store_x, got_x, xs[prev[1] % K]))
        cs = cs.at[nxt[1] % K].set(jnp.where(store_c, got_c, cs[nxt[1] % K]))
    grads = jax.tree_util.tree_map(jnp.add, grads, dp)
    bn_acc = jax.tree_util.tree_map(jnp.add, bn_acc, bn)
    return (xs, cs, grads, sums_acc + sums, bn_acc), None


def forward_backward(p, forward_branches, run_stage, lp, loss_sum):
    """Runs :func:`table` on this device: ``(grads, sums, bn_sums)`` as
    :func:`trjax.parallel.pipeline.pipeline_forward_backward` returns them.

    Args:
      p: the stage's parameters (varying over the loop's axes).
      forward_branches: per stage, the pipeline's F slot
        (:func:`trjax.parallel.schedules.forward_branch`).
      run_stage: ``(k, p, x, mask, j) -> (y, bn_sums)``.
      lp: the schedules' :class:`trjax.parallel.schedules.Loop` (micro-batches,
        boundary shapes, zeros).
      loss_sum: ``(y, label, mask) -> (metric sums, scaled loss)`` of the last stage.
    """
    S, axes, ring = lp.S, lp.axes, _Ring.of(lp)
    zeros_grads = jax.tree_util.tree_map(lambda a: as_varying(jnp.zeros_like(a), axes), p)
    c = _Step(p, forward_branches, run_stage, lp, loss_sum, ring, zeros_grads)
    branches = [_branch(c, IDLE, 0)] + [_branch(c, kind, k) for kind in (F, B, W)
                                        for k in range(S)]
    buf = as_varying(jnp.full((slots(S), ring.width), lp.fill, ring.dtype), axes)
    init = (buf, buf, zeros_grads, as_varying(jnp.zeros((4,), jnp.float32), axes),
            lp.zeros_bn())
    (_, _, grads, sums, bn), _ = lax.scan(functools.partial(_tick, c, branches), init,
                                          jnp.asarray(table(S, lp.M)))
    return grads, sums, bn
