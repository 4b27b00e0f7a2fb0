"""The MemoryPlan: a static layout of gradients into contiguous bucket buffers.

In the seed framework one MemoryPlan, computed at compile time, gives every
tensor the same offset on every device, so an all-reduce is simply "the byte
range from region X to region Y". Here the plan maps each parameter leaf to a
``(bucket, offset, size)`` slot in a flat float32 buffer per bucket. The
bucket policy (``BUCKET_POLICIES``) decides the grouping:

* ``two`` (default, the seed's): bucket ``deep`` (DEEP_COMM) = every deep
  kernel's gradient, then the step's metric sums (loss sum, top-1, top-5,
  real-example count: the seed's R_RESULT, riding in the same all-reduce),
  all-reduced first; bucket ``first`` (FIRST_COMM) = every vector parameter
  (BN / norm biases and scales, layer biases), the classifier, the first
  layer's kernel -- the gradients ready last in backward. Which parameter is
  which follows one rule for any model, from the forward pass's order and the
  parameters' shapes, never from layer types (:mod:`trjax.regions`): in words,
  *the first layer(s) applied to the input, every parameter of at most one
  dimension and the last layer (the classifier) go in the first bucket; every
  other kernel goes in the deep bucket, whose gradients are ready first.*
* ``tail_minimal``: bucket ``head`` = FC + deep convs + the BN layers after the
  stem + metrics, issued first; bucket ``stem`` = only the stem conv and its BN.
  In ResNet-50 the FC gradient (8 MB) is produced first in backward: the seed's
  layout leaves it waiting in the last bucket.
* ``size:<MB>``: PyTorch-DDP-style buckets in backward order (reverse forward
  call order), each at most <MB> megabytes (2**20 bytes), the first one 1 MB
  at most, so the first all-reduce starts early; metrics ride in the first.
* ``per_leaf``: one all-reduce per parameter (the Flax-example baseline), the
  metrics in their own small bucket.

Inside a bucket, a conv kernel's gradient is laid out in the plan's
``kernel_order`` (:data:`KERNEL_ORDERS`). ``"HWIO"`` is the parameter's own
order. ``"IHWO"`` is the order in which XLA:CPU's weight-gradient convolution
(YNNPACK) writes it: laying the bucket out that way makes filling the bucket a plain
copy of the convolution outputs, and the transpose back to HWIO happens while
the optimizer reads the reduced bucket. Under ``"HWIO"`` on CPU, XLA writes
each kernel gradient twice: a transpose, then the copy into the bucket (see
``docs/performance.md``). The per-leaf baseline always keeps HWIO, as
``lax.pmean`` of a flax gradient tree does.

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

from trjax import models
from trjax.metrics import METRICS
from trjax.regions import KERNEL_REGIONS, Region, assign_regions, path_str

BUCKETS: dict[str, tuple[Region, ...]] = {
    "deep": (Region.DEEP_CONV, Region.METRICS),
    "first": (Region.BN_BIAS, Region.BN_SCALE, Region.FC_BIAS, Region.FC_WEIGHT,
              Region.FIRST_CONV),
}
"""The ``two`` policy: bucket name -> regions in buffer order, all-reduced in this order."""

BUCKET_POLICIES = ("two", "tail_minimal", "size:<MB>", "per_leaf")
_METRICS_NAME = "result/metrics"


KERNEL_ORDERS = ("HWIO", "IHWO")
"""Axis orders a conv kernel gradient can take inside a bucket."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one leaf lives: ``buffer[bucket][offset : offset + size]``.

    ``order`` is the permutation of the leaf's axes as laid out in the bucket
    (``jnp.transpose(leaf, order).ravel()``); ``None`` means the leaf's own
    order.
    """
    name: str
    region: Region
    bucket: str
    offset: int
    size: int
    shape: tuple
    dtype: str
    order: tuple | None = None

    def to_bucket(self, x: jax.Array) -> jax.Array:
        """``x`` (shaped like the leaf) as the flat run it occupies in the bucket."""
        return jnp.ravel(x if self.order is None else jnp.transpose(x, self.order))

    def from_bucket(self, flat: jax.Array) -> jax.Array:
        """Inverse of :meth:`to_bucket`: ``[size]`` back to the leaf's shape."""
        if self.order is None:
            return flat.reshape(self.shape)
        stored = flat.reshape(tuple(self.shape[a] for a in self.order))
        return jnp.transpose(stored, tuple(np.argsort(self.order)))


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A contiguous run of one region inside one bucket."""
    region: Region
    bucket: str
    offset: int  # elements from the start of the bucket buffer
    size: int    # elements
    nbytes: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Layout of the gradient buckets (and of the BN statistics buffer).

    Attributes:
      policy: the bucket policy that produced it.
      slots: one per parameter leaf, in the params tree's flatten order.
      regions: contiguous region runs with their bucket, offset and size.
      bucket_elements: ``{bucket: elements}`` in all-reduce order.
      metrics_slot: ``(bucket, offset)`` of the ``METRICS`` sums.
      stats_slots: ``{name: (offset, size, shape)}`` of the BN running
        statistics in the one buffer all-reduced in ``running`` mode.
      memory: the compiled train step's memory statistics in bytes
        (``argument``, ``output``, ``alias``, ``temp``, ``peak``), once known.
      kernel_order: the order of conv kernel gradients inside the buckets
        (one of :data:`KERNEL_ORDERS`).
    """
    policy: str
    slots: tuple
    regions: tuple
    bucket_elements: Mapping[str, int]
    metrics_slot: tuple
    stats_slots: Mapping[str, tuple]
    params_treedef: Any
    stats_treedef: Any
    dtype: str = "float32"
    memory: Mapping[str, int] | None = None
    kernel_order: str = "HWIO"

    # -- layout queries ---------------------------------------------------
    def bucket_bytes(self, bucket: str) -> int:
        """Bytes of ``bucket``'s buffer (its ``bucket_elements`` elements, in ``dtype``)."""
        return self.bucket_elements[bucket] * np.dtype(self.dtype).itemsize

    @property
    def gradient_elements(self) -> int:
        return sum(s.size for s in self.slots)

    @property
    def gradient_bytes(self) -> int:
        return self.gradient_elements * np.dtype(self.dtype).itemsize

    def with_memory(self, memory: Mapping[str, int]) -> "MemoryPlan":
        return dataclasses.replace(self, memory=dict(memory))

    def describe(self) -> dict:
        """A JSON-ready summary: policy, buckets, regions, memory statistics."""
        regions_of = {b: [] for b in self.bucket_elements}
        for r in self.regions:
            if r.region.value not in regions_of[r.bucket]:
                regions_of[r.bucket].append(r.region.value)
        return {
            "policy": self.policy,
            "kernel_order": self.kernel_order,
            "buckets": {b: {"elements": n, "bytes": self.bucket_bytes(b), "regions": regions_of[b]}
                        for b, n in self.bucket_elements.items()},
            "regions": [{"region": r.region.value, "bucket": r.bucket, "offset": r.offset,
                         "elements": r.size, "bytes": r.nbytes} for r in self.regions],
            "metrics": {"bucket": self.metrics_slot[0], "offset": self.metrics_slot[1]},
            "stats_elements": sum(s for _, s, _ in self.stats_slots.values()),
            "stat_sums_elements": self.stat_sums_elements,
            "memory": self.memory,
        }

    # -- pack / unpack (pure, traceable) ----------------------------------
    def pack(self, grads, metrics) -> dict[str, jax.Array]:
        """Lays gradients and metric sums out as one flat buffer per bucket.

        Args:
          grads: pytree shaped like the params (any float dtype; cast to the
            plan's dtype, float32).
          metrics: ``[len(METRICS)]`` float32.

        Returns:
          ``{bucket: [bucket_elements[bucket]]}``, in all-reduce order.
        """
        leaves = jax.tree_util.tree_leaves(grads)
        pieces: dict[str, list] = {b: [] for b in self.bucket_elements}
        items = [(s.bucket, s.offset, s.to_bucket(g).astype(self.dtype))
                 for s, g in zip(self.slots, leaves)]
        items.append((*self.metrics_slot, jnp.asarray(metrics, self.dtype).reshape(-1)))
        for bucket, _, x in sorted(items, key=lambda t: (t[0], t[1])):
            pieces[bucket].append(x)
        return {b: jnp.concatenate(pieces[b]) if len(pieces[b]) > 1 else pieces[b][0]
                for b in self.bucket_elements}

    def unpack(self, buffers: Mapping[str, jax.Array]):
        """Inverse of :meth:`pack`: ``(grads pytree, metrics [len(METRICS)])``."""
        leaves = [s.from_bucket(buffers[s.bucket][s.offset:s.offset + s.size]) for s in self.slots]
        b, m0 = self.metrics_slot
        return (jax.tree_util.tree_unflatten(self.params_treedef, leaves),
                buffers[b][m0:m0 + len(METRICS)])

    @property
    def stat_sums_elements(self) -> int:
        """Elements of the ``running`` mode's one statistics all-reduce: per
        BatchNorm ``(sum (x-r) [C], sum (x-r)^2 [C], n)`` (shifted by the running
        mean ``r``), i.e. ``2C + 1``
        (:func:`trjax.steps.sync_batch_stats`)."""
        return sum(2 * n + 1 for name, (_, n, _) in self.stats_slots.items()
                   if name.endswith("/mean"))


def _stem_bn(regions: Mapping[str, Region]) -> str | None:
    """Module path of the BatchNorm called right after the first conv."""
    order = list(dict.fromkeys(n.rsplit("/", 1)[0] for n in regions if n.startswith("params/")))
    first = next((n.rsplit("/", 1)[0] for n, r in regions.items() if r == Region.FIRST_CONV),
                 None)
    if first is None:
        return None
    for mod in order[order.index(first) + 1:]:
        if any(regions.get(f"{mod}/{leaf}") == Region.BN_SCALE for leaf in ("scale",)):
            return mod
    return None


def bucket_assignment(policy: str, regions: Mapping[str, Region], sizes: Mapping[str, int],
                      itemsize: int = 4) -> list[tuple[str, list[str]]]:
    """Groups parameter leaves into ordered buckets under ``policy``.

    Args:
      policy: one of ``BUCKET_POLICIES`` (``size:<MB>`` with a number).
      regions: leaf name -> region, in forward call order (params first).
      sizes: leaf name -> element count.

    Returns:
      ``[(bucket, [leaf names in buffer order, with "result/metrics" in the
      bucket that carries the metrics])]`` in all-reduce order.

    Raises:
      ValueError: an unknown policy or a non-positive size.
    """
    names = [n for n in regions if n.startswith("params/")]
    if policy == "two":
        out = []
        for bucket, rs in BUCKETS.items():
            members = []
            for r in rs:
                members += [_METRICS_NAME] if r == Region.METRICS else \
                    [n for n in names if regions[n] == r]
            out.append((bucket, members))
        return out
    if policy == "tail_minimal":
        stem_bn = _stem_bn(regions)
        tail = [n for n in names if regions[n] == Region.FIRST_CONV or
                (stem_bn and n.rsplit("/", 1)[0] == stem_bn)]
        head = [n for n in reversed(names) if n not in tail]  # backward order: FC first
        return [("head", head + [_METRICS_NAME]), ("stem", tail)]
    if policy == "per_leaf":
        return [(n.removeprefix("params/"), [n]) for n in reversed(names)] + \
            [("metrics", [_METRICS_NAME])]
    if policy.startswith("size:"):
        try:
            cap_mb = float(policy.split(":", 1)[1])
        except ValueError:
            cap_mb = -1.0
        if not cap_mb > 0:
            raise ValueError(f"bucket policy {policy!r}: the size must be a positive number of "
                             "MB, e.g. 'size:25'")
        out, current, used, cap = [], [_METRICS_NAME], 0, min(1.0, cap_mb) * 2 ** 20
        for n in reversed(names):  # backward order
            nbytes = sizes[n] * itemsize
            if current and used and used + nbytes > cap:
                out.append((f"b{len(out)}", current))
                current, used, cap = [], 0, cap_mb * 2 ** 20
            current.append(n)
            used += nbytes
        out.append((f"b{len(out)}", current))
        return out
    raise ValueError(f"bucket policy {policy!r} is not one of {BUCKET_POLICIES}")


def check_float32(params, batch_stats) -> None:
    """trjax's rule for parameter dtypes: parameters and BN statistics are float32
    (the master weights: the optimizer state, the EMA, the buckets and the
    checkpoints follow them); ``config.precision`` sets the compute dtype.

    A model whose layers keep bfloat16 / float16 parameters (flax's
    ``param_dtype``) would have its first update turn the optimizer state
    float32 (a state that no longer fits the compiled step) and its EMA and
    running averages round most increments to zero, so it is refused here,
    before anything is compiled.

    Raises:
      ValueError: naming the leaves that are not float32, their dtypes and the fix.
    """
    bad = [(f"{kind}/{path_str(p)}", str(x.dtype))
           for kind, tree in (("params", params), ("batch_stats", batch_stats))
           for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
           if np.dtype(x.dtype) != np.float32]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"{', '.join(f'{n} ({d})' for n, d in bad[:5])}{more}: trjax keeps parameters and "
            "BatchNorm statistics in float32 (master weights for the optimizer state, the EMA "
            "and checkpoints) and computes in config.precision; build the model with "
            "param_dtype=jnp.float32 (flax's default) and set config.precision='bf16' (or "
            "your layers' dtype=jnp.bfloat16) for low-precision compute")


def make_plan(params, batch_stats, regions: Mapping[str, Region], dtype=jnp.float32,
              policy: str = "two", kernel_order: str = "HWIO") -> MemoryPlan:
    """Builds the plan from (abstract) params, BN statistics and their regions.

    Args:
      params, batch_stats: pytrees of arrays or ``jax.ShapeDtypeStruct``.
      regions: from :func:`trjax.regions.assign_regions`; its order (forward
        call order) is the order of leaves inside a region.
      dtype: dtype of the bucket buffers (the all-reduce dtype).
      policy: see :func:`bucket_assignment`.
      kernel_order: one of :data:`KERNEL_ORDERS`; applies to the 4-D
        (``HWIO``) kernels of the first and deep convs, except under the
        ``per_leaf`` policy, which keeps every leaf in its own order.

    Raises:
      ValueError: a params leaf without a region, a bad policy or a bad
        kernel order; parameters or statistics not float32 (:func:`check_float32`).
    """
    if kernel_order not in KERNEL_ORDERS:
        raise ValueError(f"kernel_order={kernel_order!r} is not one of {KERNEL_ORDERS}")
    if policy == "per_leaf":
        kernel_order = "HWIO"
    # HWIO -> IHWO: (2, 0, 1, 3); HWIO is the leaf's own order
    conv_order = (2, 0, 1, 3) if kernel_order == "IHWO" else None
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ["params/" + path_str(p) for p, _ in flat]
    check_float32(params, batch_stats)
    missing = [n for n in names if n not in regions]
    if missing:
        raise ValueError(f"params leaves without a region: {missing[:5]}")
    shapes = {n: tuple(x.shape) for n, (_, x) in zip(names, flat)}
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    itemsize = np.dtype(dtype).itemsize
    slot_of: dict[str, Slot] = {}
    infos, bucket_elements, metrics_slot = [], {}, None
    for bucket, members in bucket_assignment(policy, regions, sizes, itemsize):
        offset = 0
        for n in members:
            if n == _METRICS_NAME:
                region, size = Region.METRICS, len(METRICS)
                metrics_slot = (bucket, offset)
            else:
                region, size = regions[n], sizes[n]
                order = (conv_order if region in (Region.FIRST_CONV, Region.DEEP_CONV)
                         and len(shapes[n]) == 4 else None)
                slot_of[n] = Slot(n, region, bucket, offset, size, shapes[n], np.dtype(dtype).name,
                                  order)
            if infos and infos[-1].bucket == bucket and infos[-1].region == region:
                last = infos[-1]
                infos[-1] = RegionInfo(region, bucket, last.offset, last.size + size,
                                       (last.size + size) * itemsize)
            else:
                infos.append(RegionInfo(region, bucket, offset, size, size * itemsize))
            offset += size
        bucket_elements[bucket] = offset
    sflat, streedef = jax.tree_util.tree_flatten_with_path(batch_stats)
    stats_slots, off = {}, 0
    for p, x in sflat:
        n = math.prod(x.shape)
        stats_slots["batch_stats/" + path_str(p)] = (off, n, tuple(x.shape))
        off += n
    return MemoryPlan(policy=policy, slots=tuple(slot_of[n] for n in names), regions=tuple(infos),
                      bucket_elements=bucket_elements, metrics_slot=metrics_slot,
                      stats_slots=stats_slots, params_treedef=treedef, stats_treedef=streedef,
                      dtype=np.dtype(dtype).name, kernel_order=kernel_order)


def build_plan(model, image_shape: tuple, policy: str = "two",
               kernel_order: str = "HWIO", local=None) -> MemoryPlan:
    """The MemoryPlan of ``model`` under a bucket ``policy`` and conv-kernel
    order, from abstract shapes only (no compute).

    ``model``: a :class:`trjax.models.Network` or a flax linen / nnx module
    (:func:`trjax.models.as_network`); its parameters are assigned regions by
    :func:`trjax.regions.assign_regions` (call order, not layer types).
    ``local``: ``(params, batch_stats) -> (params, batch_stats)`` of one
    device's shapes (:attr:`trjax.parallel.Layout.local_shapes`),
    or ``None``: the buckets then pack what each device holds, the regions
    stay those of the unsplit model."""
    net = models.as_network(model)
    x = jax.ShapeDtypeStruct((2,) + tuple(image_shape), jnp.float32)
    variables = net.abstract_variables(image_shape)
    regions = assign_regions(net, variables, x)
    params, stats = variables["params"], variables["batch_stats"]
    if local is not None:
        params, stats = local(params, stats)
    return make_plan(params, stats, regions, policy=policy, kernel_order=kernel_order)


def layer_matrices(plan: MemoryPlan, bucket: str) -> list[tuple[int, int, int]]:
    """``(offset, rows, cols)`` of every conv/dense kernel in ``bucket``, offsets
    counted with the metric sums taken out of the bucket (as the compressed
    all-reduce sends them apart): the per-layer matrices of PowerSGD."""
    mb, mo = plan.metrics_slot
    out = []
    for slot in plan.slots:
        if slot.bucket == bucket and slot.region in KERNEL_REGIONS and len(slot.shape) >= 2:
            off = slot.offset - (len(METRICS) if bucket == mb and slot.offset > mo else 0)
            out.append((off, slot.size // slot.shape[-1], slot.shape[-1]))
    return out


def shard_layout(plan: MemoryPlan, world_size: int) -> dict[str, tuple[int, np.ndarray]]:
    """The sharded-optimizer (ZeRO-1) layout: per bucket, the padded length
    (``bucket_elements`` rounded up to a multiple of the world size) and a
    float32 ``[padded]`` mask, 1.0 on kernel elements (:data:`KERNEL_REGIONS`:
    where weight decay applies), 0.0 elsewhere and on padding."""
    out = {}
    for b, n in plan.bucket_elements.items():
        mask = np.zeros(n + (-n) % world_size, np.float32)
        for slot in plan.slots:
            if slot.bucket == b and slot.region in KERNEL_REGIONS:
                mask[slot.offset:slot.offset + slot.size] = 1.0
        out[b] = (len(mask), mask)
    return out

