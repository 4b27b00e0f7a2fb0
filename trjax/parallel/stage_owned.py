"""Stage-owned parameters for the pipeline (design v2): each leaf split over ``stage``,
each stage's leaves gathered whole onto its own devices by one all-to-all.

Between steps every parameter leaf (and its optimizer state and EMA) is split over the
``stage`` axis along one dimension (:func:`trjax.parallel.shards.shard_dims`), so a
device holds 1/S of the model, as a checkpoint's whole arrays sharded (they restore
onto any mesh). Per step and device:

1. :meth:`StageRows.gather`: this device packs its slices of stage ``j``'s leaves into
   row ``j`` of an ``[S, R]`` buffer, and one ``all_to_all`` over ``stage`` hands row
   ``j`` to stage ``j``'s device: each device receives its own stage's leaves, whole
   (``R``: the largest stage's parameters / S), and nothing of the others;
2. the pipeline differentiates with respect to that buffer (and the few leaves that
   stay whole): the backward accumulates the stage's own leaves only, ``[S, R]``
   instead of the whole tree;
3. :meth:`StageRows.scatter`: the reverse ``all_to_all`` returns each chunk of the
   stage's gradient to the device that holds its slice; the whole leaves' gradients
   and the metric sums (made on one stage each) ride in the same collective, tiled S
   times, and are summed over the rows received.

The gradient buckets then hold each device's slices and are all-reduced over ``data``
only (:class:`trjax.parallel.layout.Layout` ``grad_axes``), deep first. Sources:
ZeRO-3's partitioned parameters (Rajbhandari et al., SC 2020) laid over the stage axis;
the all-to-all as in Megatron's and DeepSpeed's expert exchange.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from trjax.parallel.shards import from_rows
from trjax.world import STAGE_AXIS


def unit_path(name: str) -> tuple:
    """The key path of a pipeline unit's name: ``"layers_3"`` -> ``("layers_3",)``, an
    nnx list's ``"layers/3"`` -> ``("layers", 3)``."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("/"))


def subtree(tree: dict, names) -> dict:
    """The part of ``tree`` under the units ``names`` (:func:`unit_path`), nested as in
    ``tree``; a unit ``tree`` does not hold (a layer without parameters) is left out."""
    out: dict = {}
    for name in names:
        path, node = unit_path(name), tree
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            continue
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = node
    return out


@dataclasses.dataclass(frozen=True)
class StageRows:
    """How the leaves of a parameter tree pack into the ``[S, R]`` all-to-all rows.

    Attributes:
      treedef: the parameter tree's structure.
      shapes: every leaf's whole shape (flattened order).
      dims: every leaf's split dimension over ``stage`` (``None``: whole).
      owner: every leaf's stage (:meth:`trjax.parallel.pipeline.StagePlan.names`).
      offsets: per split leaf, its offset in its stage's row (local elements).
      width: R, the longest row (the largest stage's split elements / S).
      size: S.
    """
    treedef: object
    shapes: tuple
    dims: tuple
    owner: tuple
    offsets: dict
    width: int
    size: int

    @classmethod
    def build(cls, params, dims, stage_names) -> "StageRows":
        """``params``: the abstract whole tree; ``dims``:
        :func:`trjax.parallel.shards.shard_dims` of it;
        ``stage_names``: per stage, the units it owns (:func:`unit_path`)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        flat_dims = tuple(treedef.flatten_up_to(dims))
        stage_of = {unit_path(n): s for s, names in enumerate(stage_names) for n in names}
        keys = [tuple(getattr(k, "key", k) for k in p) for p, _ in flat]
        owner = tuple(next(stage_of[k[:n]] for n in range(1, len(k) + 1) if k[:n] in stage_of)
                      for k in keys)
        size = len(stage_names)
        offsets, fill = {}, [0] * size
        for i, ((_, x), d) in enumerate(zip(flat, flat_dims)):
            if d is not None:
                offsets[i] = fill[owner[i]]
                fill[owner[i]] += math.prod(x.shape) // size
        return cls(treedef, tuple(tuple(x.shape) for _, x in flat), flat_dims, owner, offsets,
                   max(fill + [1]), size)

    def exchange_bytes(self, itemsize: int = 4) -> dict:
        """The two all-to-alls' result bytes per device and step (float32 leaves):
        :meth:`gather`'s ``S * R`` elements and :meth:`scatter`'s ``S * (R + w + 4)``
        (``w`` the whole leaves' elements, 4 the metric sums), as
        :func:`trjax.comm.by_axis` counts them."""
        whole = sum(math.prod(self.shapes[i]) for i, d in enumerate(self.dims) if d is None)
        return {"gather": self.size * self.width * itemsize,
                "scatter": self.size * (self.width + whole + 4) * itemsize}

    def local_shape(self, i: int) -> tuple:
        shape, d = list(self.shapes[i]), self.dims[i]
        if d is not None:
            shape[d] //= self.size
        return tuple(shape)

    def gather(self, local_params):
        """Inside ``shard_map``: ``(rows, whole leaves tuple)``: ``rows``, a tuple of S
        ``[R]`` arrays, row ``k`` device ``k``'s slice of this device's stage's packed
        leaves (one ``all_to_all`` over ``stage``). The rows stay separate arrays, not one
        ``[S, R]``: XLA then passes them to and from the collective without a copy of the
        stacked buffer (measured on ResNet-50, docs/performance.md)."""
        leaves = self.treedef.flatten_up_to(local_params)
        rows = []
        for j in range(self.size):
            mine = [leaves[i].reshape(-1) for i in self.offsets if self.owner[i] == j]
            row = jnp.concatenate(mine) if mine else jnp.zeros((0,), jnp.float32)
            rows.append(jnp.pad(row, (0, self.width - row.shape[0])))
        received = lax.all_to_all(jnp.stack(rows), STAGE_AXIS, 0, 0, tiled=False)
        whole = tuple(leaves[i] for i, d in enumerate(self.dims) if d is None)
        return tuple(received[k] for k in range(self.size)), whole

    def select(self, stage: int, packed, names):
        """Stage ``stage``'s subtree ``{name: ...}`` of the whole parameters, from
        ``packed = (rows, whole)`` of :meth:`gather` on that stage's device."""
        rows, whole = packed
        out, w = [None] * len(self.shapes), iter(whole)
        mine = sorted((self.offsets[i], i) for i in self.offsets if self.owner[i] == stage)
        # one split per row (its transpose: one concatenate, not a padded row per leaf)
        cuts = [o for o, _ in mine[1:]] + ([mine[-1][0] + math.prod(
            self.local_shape(mine[-1][1]))] if mine else [])
        pieces = [jnp.split(r, cuts) for r in rows] if mine else []
        for n, (_, i) in enumerate(mine):
            piece = jnp.stack([p[n] for p in pieces])
            out[i] = from_rows(piece, self.dims[i], self.local_shape(i))
        for i, d in enumerate(self.dims):
            if d is None:
                out[i] = next(w)
        return subtree(jax.tree_util.tree_unflatten(self.treedef, out), names)

    def scatter(self, grads, sums):
        """Inside ``shard_map``: ``grads = (rows, whole)`` (this device's stage's
        gradient, as :meth:`gather`'s layout) back to this device's slices of every
        leaf, and ``sums`` ([4], made on the last stage) summed over ``stage``; one
        ``all_to_all``. Returns ``(local gradient tree, sums)``."""
        rows, whole = grads
        tail = jnp.concatenate([w.reshape(-1) for w in whole] + [sums.reshape(-1)])
        buf = jnp.stack([jnp.concatenate([r, tail]) for r in rows])
        got = lax.all_to_all(buf, STAGE_AXIS, 0, 0, tiled=False)  # row j: from stage j
        total = jnp.sum(got[:, self.width:], axis=0)  # one stage's nonzero, exact
        out, off = [None] * len(self.shapes), 0
        for i, d in enumerate(self.dims):
            if d is None:
                n = math.prod(self.shapes[i])
                out[i] = total[off:off + n].reshape(self.shapes[i])
                off += n
            else:
                n, o = math.prod(self.local_shape(i)), self.offsets[i]
                out[i] = got[self.owner[i], o:o + n].reshape(self.local_shape(i))
        return jax.tree_util.tree_unflatten(self.treedef, out), total[off:off + sums.size]
