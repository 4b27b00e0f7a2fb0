"""The MemoryPlan: a static layout of gradients into two contiguous buckets.

In the seed framework one MemoryPlan, computed at compile time, gives every
tensor the same offset on every device, so an all-reduce is simply "the byte
range from region X to region Y". Here the plan maps each parameter leaf to a
``(bucket, offset, size)`` slot in a flat float32 buffer per bucket:

* bucket ``deep`` (the seed's DEEP_COMM): all deep-conv gradients, then the
  step's metric sums (loss sum, top-1 correct, top-5 correct, real-example
  count: the seed's R_RESULT), so the metrics ride in the same all-reduce;
* bucket ``first`` (FIRST_COMM): BN biases, BN scales, FC bias, FC weight, then
  the first conv -- the gradients that are ready last in backward.

The plan is a pure function of the model's abstract parameters: identical on
every device and every process. After compilation it also carries the
compiled executable's memory statistics (:meth:`MemoryPlan.with_memory`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from trjax.regions import Region, path_str

BUCKETS: dict[str, tuple[Region, ...]] = {
    "deep": (Region.DEEP_CONV, Region.RESULT),
    "first": (Region.BN_BIAS, Region.BN_SCALE, Region.FC_BIAS, Region.FC_WEIGHT,
              Region.FIRST_CONV),
}
"""Bucket name -> regions in buffer order. Buckets are all-reduced in this order."""

METRICS = ("loss_sum", "top1_correct", "top5_correct", "count")
"""The per-step sums carried in the RESULT region of the deep bucket."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one leaf lives: ``buffer[bucket][offset : offset + size]``."""
    name: str
    region: Region
    bucket: str
    offset: int
    size: int
    shape: tuple
    dtype: str


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    region: Region
    bucket: str
    offset: int  # elements from the start of the bucket buffer
    size: int    # elements
    nbytes: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Layout of the gradient buckets (and of the BN statistics buffer).

    Attributes:
      slots: one per parameter leaf, in the params tree's flatten order.
      regions: every non-empty region with its bucket, offset and size.
      bucket_sizes: ``{bucket: elements}`` of each flat buffer.
      stats_slots: ``{name: (offset, size, shape)}`` of the BN running
        statistics in the one buffer all-reduced in ``running`` mode.
      memory: the compiled train step's memory statistics in bytes
        (``argument``, ``output``, ``alias``, ``temp``, ``peak``), once known.
    """
    slots: tuple
    regions: tuple
    bucket_sizes: Mapping[str, int]
    stats_slots: Mapping[str, tuple]
    params_treedef: Any
    stats_treedef: Any
    dtype: str = "float32"
    memory: Mapping[str, int] | None = None

    # -- layout queries ---------------------------------------------------
    def bucket_bytes(self, bucket: str) -> int:
        return self.bucket_sizes[bucket] * np.dtype(self.dtype).itemsize

    def region(self, region: Region) -> RegionInfo:
        for r in self.regions:
            if r.region == region:
                return r
        raise KeyError(f"region {region.value!r} is empty in this plan")

    @property
    def metrics_offset(self) -> int:
        return self.region(Region.RESULT).offset

    @property
    def gradient_elements(self) -> int:
        return sum(s.size for s in self.slots)

    def with_memory(self, memory: Mapping[str, int]) -> "MemoryPlan":
        return dataclasses.replace(self, memory=dict(memory))

    def describe(self) -> dict:
        """A JSON-ready summary: regions, buckets, memory statistics."""
        return {
            "buckets": {b: {"elements": n, "bytes": self.bucket_bytes(b),
                            "regions": [r.value for r in BUCKETS[b]]}
                        for b, n in self.bucket_sizes.items()},
            "regions": [{"region": r.region.value, "bucket": r.bucket, "offset": r.offset,
                         "elements": r.size, "bytes": r.nbytes} for r in self.regions],
            "stats_elements": sum(s for _, s, _ in self.stats_slots.values()),
            "memory": self.memory,
        }

    # -- pack / unpack (pure, traceable) ----------------------------------
    def pack(self, grads, metrics) -> dict[str, jax.Array]:
        """Lays gradients and metric sums out as one flat buffer per bucket.

        Args:
          grads: pytree shaped like the params (any float dtype; cast to
            the plan's dtype, float32).
          metrics: ``[len(METRICS)]`` float32.

        Returns:
          ``{"deep": [bucket_sizes["deep"]], "first": [...]}``.
        """
        leaves = jax.tree_util.tree_leaves(grads)
        pieces: dict[str, list] = {b: [] for b in BUCKETS}
        for slot, g in sorted(zip(self.slots, leaves), key=lambda sg: (sg[0].bucket, sg[0].offset)):
            pieces[slot.bucket].append(jnp.ravel(g).astype(self.dtype))
        pieces["deep"].append(jnp.asarray(metrics, self.dtype).reshape(-1))
        return {b: jnp.concatenate(pieces[b]) for b in BUCKETS}

    def unpack(self, buffers: Mapping[str, jax.Array]):
        """Inverse of :meth:`pack`: ``(grads pytree, metrics [len(METRICS)])``."""
        leaves = [buffers[s.bucket][s.offset:s.offset + s.size].reshape(s.shape) for s in self.slots]
        m0 = self.metrics_offset
        return (jax.tree_util.tree_unflatten(self.params_treedef, leaves),
                buffers["deep"][m0:m0 + len(METRICS)])

    def pack_stats(self, batch_stats) -> jax.Array:
        leaves = jax.tree_util.tree_leaves(batch_stats)
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])

    def unpack_stats(self, buffer: jax.Array):
        leaves = [buffer[o:o + n].reshape(shape) for o, n, shape in self.stats_slots.values()]
        return jax.tree_util.tree_unflatten(self.stats_treedef, leaves)


def make_plan(params, batch_stats, regions: Mapping[str, Region], dtype=jnp.float32) -> MemoryPlan:
    """Builds the plan from (abstract) params, BN statistics and their regions.

    Args:
      params, batch_stats: pytrees of arrays or ``jax.ShapeDtypeStruct``.
      regions: from :func:`trjax.regions.assign_regions`; its order (forward
        call order) is the order of leaves inside a region.
      dtype: dtype of the bucket buffers (the all-reduce dtype).

    Raises:
      ValueError: a params leaf without a region.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ["params/" + path_str(p) for p, _ in flat]
    missing = [n for n in names if n not in regions]
    if missing:
        raise ValueError(f"params leaves without a region: {missing[:5]}")
    shapes = {n: tuple(x.shape) for n, (_, x) in zip(names, flat)}
    itemsize = np.dtype(dtype).itemsize
    slot_of: dict[str, Slot] = {}
    infos = []
    sizes = {}
    for bucket, bucket_regions in BUCKETS.items():
        offset = 0
        for region in bucket_regions:
            start = offset
            if region == Region.RESULT:
                offset += len(METRICS)
            else:
                for name, r in regions.items():
                    if r == region and name in shapes:
                        n = math.prod(shapes[name])
                        slot_of[name] = Slot(name, region, bucket, offset, n, shapes[name],
                                             np.dtype(dtype).name)
                        offset += n
            if offset > start:
                infos.append(RegionInfo(region, bucket, start, offset - start,
                                        (offset - start) * itemsize))
        sizes[bucket] = offset
    sflat, streedef = jax.tree_util.tree_flatten_with_path(batch_stats)
    stats_slots, off = {}, 0
    for p, x in sflat:
        n = math.prod(x.shape)
        stats_slots["batch_stats/" + path_str(p)] = (off, n, tuple(x.shape))
        off += n
    return MemoryPlan(slots=tuple(slot_of[n] for n in names), regions=tuple(infos),
                      bucket_sizes=sizes, stats_slots=stats_slots, params_treedef=treedef,
                      stats_treedef=streedef, dtype=np.dtype(dtype).name)
