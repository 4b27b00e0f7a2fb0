"""The train and eval steps: pure per-device functions, shard_mapped and compiled.

Per device, one train step is (the seed's graph order):

1. forward + backward on the local batch (loss = SUM of per-example losses
   over real examples; padding rows carry mask 0);
2. pack the gradients into the two bucket buffers of the MemoryPlan, with the
   metric sums (loss, top-1, top-5, count) at the end of the deep bucket;
3. all-reduce ``deep``, then ``first`` (one collective each);
4. ``1/global_count`` applied once, inside the optimizer update's fusion: the
   gradient is the mean over every real example of the global batch;
5. a non-finite reduced gradient skips the update on every replica (all see
   the same reduced values, so they agree without another collective);
6. ``running`` BN mode: one all-reduce of the running statistics (STATS_COMM).

Autodiff inside ``shard_map`` (``check_vma=True``) sums the gradient of a
replicated (invariant) parameter over devices by itself; the parameters are
therefore cast to *varying* before differentiation, so each device gets only
its own partial gradient and the bucket all-reduces are the only gradient
collectives.

The steps are compiled ahead of time (:func:`compile_step`) with the train
state donated; :class:`CompiledStep` refuses arguments whose shape, dtype or
sharding differ from the compiled ones instead of recompiling.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from trjax import collectives
from trjax.batchnorm import fold_batchnorm_tree
from trjax.plan import METRICS, MemoryPlan, make_plan
from trjax.precision import update_loss_scale
from trjax.regions import assign_regions
from trjax.world import DATA_AXIS, World, host_value


@flax.struct.dataclass
class TrainState:
    """Everything a train step reads and writes.

    ``batch_stats`` leaves are ``[C]`` (replicated) in ``sync``/``running``
    BN mode and ``[world_size, C]`` (one row per replica) in ``local`` mode.
    ``skipped_steps`` counts updates skipped for non-finite gradients.
    ``loss_scale`` / ``good_steps``: dynamic loss scaling (fp16; 1.0 and
    unused otherwise). ``comm_state``: the gradient compressor's state per
    bucket (error feedback...), one row per replica (``[world_size, ...]``);
    ``{}`` without compression.
    """
    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any
    skipped_steps: jax.Array
    loss_scale: jax.Array
    good_steps: jax.Array
    comm_state: Any = None


def state_specs(bn_mode: str, opt_specs=None) -> TrainState:
    """shard_map partition specs of a :class:`TrainState` (a pytree prefix).

    ``opt_specs``: specs of the optimizer state when it is sharded (ZeRO-1,
    :func:`zero1_opt_specs`); replicated otherwise.
    """
    return TrainState(step=P(), params=P(), opt_state=P() if opt_specs is None else opt_specs,
                      skipped_steps=P(), loss_scale=P(),
                      good_steps=P(), batch_stats=P(DATA_AXIS) if bn_mode == "local" else P(),
                      comm_state=P(DATA_AXIS))


BATCH_SPEC = {"image": P(DATA_AXIS), "label": P(DATA_AXIS), "mask": P(DATA_AXIS)}


def batch_metrics(logits, labels, mask):
    """Per-batch sums over real rows: ``[loss_sum, top1, top5, count]`` float32.

    Args:
      logits: ``[B, K]`` float32; labels: ``[B]`` int32; mask: ``[B]`` float32.

    top-k counts an example as correct when fewer than k logits are strictly
    greater than the true class's logit (k = min(5, K) for top-5).
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    true_logit = jnp.take_along_axis(logits, labels[:, None], axis=1)
    rank = jnp.sum(logits > true_logit, axis=1)
    k5 = min(5, logits.shape[1])
    return jnp.stack([jnp.sum(losses * mask), jnp.sum((rank < 1) * mask),
                      jnp.sum((rank < k5) * mask), jnp.sum(mask)]).astype(jnp.float32)


# --------------------------------------------------------------------------
# initialisation
# --------------------------------------------------------------------------

def compressors_per_bucket(compressor, plan: MemoryPlan) -> dict:
    """``{bucket: Compressor}`` from one compressor for all buckets, or a dict."""
    return compressor if isinstance(compressor, dict) else {b: compressor for b in plan.bucket_sizes}


def create_train_state(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                       world: World, image_shape: tuple, bn_mode: str,
                       loss_scale: float = 1.0, plan: MemoryPlan | None = None,
                       compressor=None, zero1: bool = False) -> TrainState:
    """Initialises on every replica, then broadcasts rank 0's parameters.

    Each replica runs ``model.init`` with its own key ``fold_in(rng, rank)``
    (as independent DDP processes would); :func:`trjax.collectives.broadcast_from_rank0` then
    gives every replica rank 0's bits, and :func:`check_replicas_identical`
    verifies it.

    Args:
      rng: PRNG key.
      model: the network (its ``axis_name`` is the data axis).
      tx: the optimizer.
      world: devices and mesh.
      image_shape: ``(H, W, C)`` of one example.
      bn_mode: ``sync``, ``running`` or ``local``.
      loss_scale: initial loss scale (fp16 dynamic scaling; 1.0 otherwise).
      plan, compressor: with a :class:`trjax.compression.Compressor`, its
        initial state for every bucket of ``plan`` (one row per replica).
      zero1: the optimizer state is ZeRO-1 sharded (see :func:`make_train_step`).

    Returns:
      A :class:`TrainState` laid out as :func:`state_specs` says.
    """
    n = world.world_size
    # rank r initialises with fold_in(rng, r): rank 0's key, hence the broadcast
    # parameters, do not depend on the world size.
    keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(np.arange(n))
    keys = world.put(np.asarray(jax.random.key_data(keys)), world.sharded())

    def init_local(key_data):
        x = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
        variables = model.init(jax.random.wrap_key_data(key_data[0]), x, train=False)
        variables = collectives.broadcast_from_rank0(variables, DATA_AXIS)
        return variables["params"], variables["batch_stats"]

    init = jax.jit(jax.shard_map(init_local, mesh=world.mesh, in_specs=P(DATA_AXIS),
                                 out_specs=(P(), P())))
    params, batch_stats = init(keys)
    if bn_mode == "local":
        batch_stats = jax.tree_util.tree_map(
            lambda x: world.put(np.broadcast_to(host_value(x), (n,) + x.shape), world.sharded()),
            batch_stats)
    if zero1:  # flat {bucket: [padded]} state, split over the data axis
        specs = zero1_opt_specs(tx, plan, n)
        flat = {b: np.zeros(size, np.float32) for b, (size, _) in zero1_layout(plan, n).items()}
        opt_state = jax.jit(tx.init, out_shardings=jax.tree_util.tree_map(
            lambda sp: NamedSharding(world.mesh, sp), specs))(flat)
    else:
        opt_state = jax.jit(tx.init, out_shardings=world.replicated())(params)
    scalar = lambda v, dt: world.put(np.asarray(v, dt))
    comm_state = {}
    if compressor is not None:
        per_bucket = compressors_per_bucket(compressor, plan)
        comm_state = {b: jax.tree_util.tree_map(
            lambda x: world.put(np.broadcast_to(np.asarray(x), (n,) + x.shape), world.sharded()),
            per_bucket[b].init(jax.ShapeDtypeStruct(
                (size - (len(METRICS) if b == plan.metrics_slot[0] else 0),), jnp.float32)))
            for b, size in plan.bucket_sizes.items()}
    state = TrainState(step=scalar(0, np.int32), params=params, batch_stats=batch_stats,
                       opt_state=opt_state, skipped_steps=scalar(0, np.int32),
                       loss_scale=scalar(loss_scale, np.float32), good_steps=scalar(0, np.int32),
                       comm_state=comm_state)
    check_replicas_identical(state.params)
    return state


def check_replicas_identical(tree) -> None:
    """Raises ``RuntimeError`` unless every device's copy of each replicated
    leaf is bitwise equal to device 0's (a host-side check, used at start-up)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        ref = shards[0].tobytes()
        for i, s in enumerate(shards[1:], 1):
            if s.tobytes() != ref:
                raise RuntimeError(f"replica {i} differs from rank 0 at {jax.tree_util.keystr(path)}")


def build_plan(model: nn.Module, image_shape: tuple, policy: str = "two",
               kernel_order: str = "HWIO") -> MemoryPlan:
    """The MemoryPlan of ``model`` under a bucket ``policy`` and conv-kernel
    order (see :mod:`trjax.plan`), from abstract shapes only (no compute)."""
    x = jax.ShapeDtypeStruct((2,) + tuple(image_shape), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape), train=False))
    regions = assign_regions(model, variables, x)
    return make_plan(variables["params"], variables["batch_stats"], regions, policy=policy,
                     kernel_order=kernel_order)


# --------------------------------------------------------------------------
# the steps
# --------------------------------------------------------------------------

def layer_matrices(plan: MemoryPlan, bucket: str) -> list[tuple[int, int, int]]:
    """``(offset, rows, cols)`` of every conv/dense kernel in ``bucket``, offsets
    counted with the metric sums taken out of the bucket (as the compressed
    all-reduce sends them apart): the per-layer matrices of PowerSGD."""
    from trjax.optim import KERNEL_REGIONS
    mb, mo = plan.metrics_slot
    out = []
    for slot in plan.slots:
        if slot.bucket == bucket and slot.region in KERNEL_REGIONS and len(slot.shape) >= 2:
            off = slot.offset - (len(METRICS) if bucket == mb and slot.offset > mo else 0)
            out.append((off, slot.size // slot.shape[-1], slot.shape[-1]))
    return out


def zero1_layout(plan: MemoryPlan, world_size: int) -> dict[str, tuple[int, np.ndarray]]:
    """ZeRO-1 layout: per bucket, the padded length (a multiple of the world
    size) and a float32 mask of the kernel elements (weight decay applies there)."""
    from trjax.optim import KERNEL_REGIONS
    out = {}
    for b, n in plan.bucket_sizes.items():
        mask = np.zeros(n + (-n) % world_size, np.float32)
        for slot in plan.slots:
            if slot.bucket == b and slot.region in KERNEL_REGIONS:
                mask[slot.offset:slot.offset + slot.size] = 1.0
        out[b] = (len(mask), mask)
    return out


def zero1_opt_specs(tx: optax.GradientTransformation, plan: MemoryPlan, world_size: int):
    """Partition specs of a ZeRO-1 optimizer state: arrays split over the data
    axis (each device holds 1/N), scalars (step counts) replicated."""
    flat = {b: jax.ShapeDtypeStruct((n,), jnp.float32)
            for b, (n, _) in zero1_layout(plan, world_size).items()}
    return jax.tree_util.tree_map(lambda x: P() if x.ndim == 0 else P(DATA_AXIS),
                                  jax.eval_shape(tx.init, flat))


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, plan: MemoryPlan,
                    world: World, bn_mode: str, dynamic_loss_scale: bool = False,
                    growth_interval: int = 2000, allreduce: str = "xla",
                    compressor=None, accumulation_steps: int = 1, zero1: bool = False,
                    weight_decay: float = 0.0, compression_start_step: int = 0) -> Callable:
    """Returns ``train_step(state, batch) -> (state, metrics)`` over ``world``.

    Args (of the returned function, global view):
      state: :class:`TrainState`.
      batch: ``{"image": [G, H, W, C] float, "label": [G] int32,
        "mask": [G] float32}`` sharded over the data axis, G the global batch.

    Returns:
      The new state and ``metrics [5] float32``: global ``loss_sum,
      top1_correct, top5_correct, count`` of this step's batch, then
      ``finite`` (1.0, or 0.0 when the update was skipped).

    With ``dynamic_loss_scale`` (fp16) the loss is multiplied by
    ``state.loss_scale`` before backward and the scale is updated by
    :func:`trjax.precision.update_loss_scale` from the all-reduced gradients.

    ``allreduce`` picks the algorithm of the bucket all-reduces
    (:mod:`trjax.allreduce`: ``xla`` = ``lax.psum``, lowered to NCCL on GPUs;
    ``ring``, ``halving_doubling``, ``tree`` written with ``ppermute``).
    ``compressor`` (:mod:`trjax.compression`, or ``{bucket: compressor}``)
    compresses each bucket's gradients;
    the metric sums then travel uncompressed in one small extra all-reduce
    (they must stay exact). Before ``compression_start_step`` the buckets are
    all-reduced uncompressed (``lax.cond``; PyTorch's ``start_powerSGD_iter``).
    Both run the step with ``check_vma=False``: their
    results are replicated in value but typed per-device by JAX.

    ``accumulation_steps`` = k splits each device's local batch into k
    micro-batches whose gradients and metric sums are accumulated locally
    (``lax.scan``) before the one all-reduce of the step.

    ``zero1`` (ZeRO stage 1, Rajbhandari et al., SC 2020): each bucket is
    reduce-scattered instead of all-reduced; each device updates its 1/N
    shard of the parameters with its 1/N shard of the optimizer state, and the
    new parameters are all-gathered. ``tx`` must then be elementwise (momentum
    SGD) and gets flat ``{bucket: shard}`` trees; ``weight_decay`` is applied
    here to the kernel elements (as ``add_decayed_weights`` with the kernel
    mask would). The metric sums and a non-finite flag travel in one small
    all-reduce.
    """
    axis = DATA_AXIS
    check_vma = allreduce == "xla" and compressor is None and not zero1

    def local_step(state: TrainState, batch):
        bs = state.batch_stats
        if bn_mode == "local":
            bs = jax.tree_util.tree_map(lambda x: x[0], bs)
        params_v = lax.pcast(state.params, axis, to="varying")

        scale = state.loss_scale if dynamic_loss_scale else None

        def loss_fn(params, micro):
            logits, new_vars = model.apply({"params": params, "batch_stats": bs}, micro["image"],
                                           train=True, mask=micro["mask"], mutable=["batch_stats"])
            metrics = batch_metrics(logits, micro["label"], micro["mask"])
            loss = metrics[0] if scale is None else metrics[0] * scale
            return loss, (metrics, new_vars["batch_stats"])

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accumulation_steps == 1:
            (_, (metrics, new_bs)), grads = grad_fn(params_v, batch)
        else:
            # k micro-batches summed locally, ONE all-reduce per optimizer step. Each
            # micro-batch's BN running-stat update starts from the step's statistics and
            # the k results are averaged: exactly what k times as many replicas would do.
            k = accumulation_steps
            micro = jax.tree_util.tree_map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)

            def body(carry, mb):
                (_, (m, st)), g = grad_fn(params_v, mb)
                return jax.tree_util.tree_map(jnp.add, carry, (g, m, st)), None

            (_, (metrics, bs_sum)), grads = grad_fn(
                params_v, jax.tree_util.tree_map(lambda x: x[0], micro))
            (grads, metrics, bs_sum), _ = lax.scan(
                body, (grads, metrics, bs_sum), jax.tree_util.tree_map(lambda x: x[1:], micro))
            new_bs = jax.tree_util.tree_map(lambda x: x / k, bs_sum)
        buffers = plan.pack(grads, lax.stop_gradient(metrics))
        new_comm = state.comm_state
        if zero1:
            params, opt_state, metrics, finite, last = zero1_update(state, buffers, scale)
        elif compressor is None:
            reduced = collectives.allreduce_buckets(buffers, axis, chain=plan.policy != "per_leaf",
                                                    reduce_fn=reduce_fn)
        else:
            reduced, new_comm = compressed_allreduce(buffers, state.comm_state, state.step)
        if not zero1:
            grads, metrics = plan.unpack(reduced)
            last = list(reduced.values())[-1]
            # every replica sees the same reduced values: they agree without a collective
            finite = jnp.isfinite(sum(jnp.sum(b) for b in reduced.values()))
            inv_count = 1.0 / jnp.maximum(metrics[3], 1.0)
            if scale is not None:
                inv_count = inv_count / scale
            grads = jax.tree_util.tree_map(lambda g: g * inv_count, grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)

        if bn_mode == "running":
            stats = collectives.allreduce_batch_stats(plan.pack_stats(new_bs), axis,
                                                      done=last)
            finite = finite & jnp.isfinite(jnp.sum(stats))
            new_bs = plan.unpack_stats(stats)
        elif bn_mode == "local":
            new_bs = jax.tree_util.tree_map(lambda x: x[None], new_bs)
        if dynamic_loss_scale:
            loss_scale, good_steps = update_loss_scale(state.loss_scale, state.good_steps, finite,
                                                       growth_interval)
        else:
            loss_scale, good_steps = state.loss_scale, state.good_steps

        keep = lambda new, old: jax.tree_util.tree_map(
            lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = TrainState(
            comm_state=keep(new_comm, state.comm_state),
            step=state.step + 1,
            params=keep(params, state.params),
            batch_stats=keep(new_bs, state.batch_stats),
            opt_state=keep(opt_state, state.opt_state),
            skipped_steps=state.skipped_steps + (1 - finite.astype(jnp.int32)),
            loss_scale=loss_scale, good_steps=good_steps)
        return new_state, jnp.concatenate([metrics, finite.astype(jnp.float32)[None]])

    from trjax import allreduce as allreduce_lib
    reduce_fn = None if allreduce == "xla" else allreduce_lib.ALGORITHMS[allreduce]
    mbucket, moff = plan.metrics_slot

    per_bucket = compressors_per_bucket(compressor, plan)

    def compressed_allreduce(buffers, comm_state, step):
        reduced, new_comm, previous = {}, {}, None
        for b, x in buffers.items():
            if previous is not None:
                x = collectives.after(x, previous)
            st = jax.tree_util.tree_map(lambda v: v[0], comm_state[b])
            compress = per_bucket[b].allreduce
            if compression_start_step > 0:
                compress = lambda g, st, ax, f=compress: lax.cond(
                    step < compression_start_step, lambda g, st: (lax.psum(g, ax), st),
                    lambda g, st: f(g, st, ax), g, st)
            if b == mbucket:  # metrics leave the bucket: they must stay exact
                m = lax.psum(x[moff:moff + len(METRICS)], axis)
                g = jnp.concatenate([x[:moff], x[moff + len(METRICS):]])
                g, st = compress(g, st, axis)
                x = jnp.concatenate([g[:moff], m, g[moff:]])
            else:
                x, st = compress(x, st, axis)
            reduced[b] = previous = x
            new_comm[b] = jax.tree_util.tree_map(lambda v: v[None], st)
        return reduced, new_comm

    layout = zero1_layout(plan, world.world_size) if zero1 else {}

    def zero1_update(state, buffers, scale):
        n, rank = world.world_size, lax.axis_index(axis)
        shards, previous = {}, None
        for b, x in buffers.items():  # reduce-scatter, one per bucket, in order
            x = jnp.pad(x, (0, layout[b][0] - x.shape[0]))
            if previous is not None:
                x = collectives.after(x, previous)
            shards[b] = previous = lax.psum_scatter(x, axis, tiled=True)
        mb, mo = plan.metrics_slot
        local_bad = 1.0 - jnp.isfinite(sum(jnp.sum(v) for v in shards.values())).astype(jnp.float32)
        summed = lax.psum(jnp.concatenate([buffers[mb][mo:mo + len(METRICS)], local_bad[None]]),
                          axis)
        metrics, finite = summed[:len(METRICS)], summed[len(METRICS)] == 0
        inv_count = 1.0 / jnp.maximum(metrics[3], 1.0)
        if scale is not None:
            inv_count = inv_count / scale
        pflat = plan.pack(state.params, jnp.zeros(len(METRICS)))
        mine, grads = {}, {}
        for b, g in shards.items():
            size = layout[b][0] // n
            p_full = jnp.pad(pflat[b], (0, layout[b][0] - pflat[b].shape[0]))
            mine[b] = lax.dynamic_slice_in_dim(p_full, rank * size, size)
            mask = lax.dynamic_slice_in_dim(jnp.asarray(layout[b][1]), rank * size, size)
            grads[b] = g * inv_count + weight_decay * mask * mine[b]
        updates, opt_state = tx.update(grads, state.opt_state, mine)
        new_flat = {b: lax.all_gather(mine[b] + updates[b], axis, tiled=True)[:pflat[b].shape[0]]
                    for b in shards}
        params, _ = plan.unpack(new_flat)
        return params, opt_state, metrics, finite, previous

    opt_specs = zero1_opt_specs(tx, plan, world.world_size) if zero1 else None
    return jax.shard_map(local_step, mesh=world.mesh,
                         in_specs=(state_specs(bn_mode, opt_specs), BATCH_SPEC),
                         out_specs=(state_specs(bn_mode, opt_specs), P()),
                         check_vma=check_vma)


def make_fold_bn(world: World, bn_mode: str) -> Callable:
    """Returns ``fold_bn(state) -> folded``: every BN's running statistics and
    affine folded into one per-channel ``scale``/``bias``, once per evaluation
    (see :func:`trjax.batchnorm.fold_batchnorm_tree`). No collective.
    Folded leaves are ``[C]`` (``[world_size, C]`` in ``local`` mode)."""
    spec = P(DATA_AXIS) if bn_mode == "local" else P()

    def local_fold(state: TrainState):
        bs = state.batch_stats
        if bn_mode == "local":
            bs = jax.tree_util.tree_map(lambda x: x[0], bs)
        folded = fold_batchnorm_tree(state.params, bs)
        if bn_mode == "local":
            folded = jax.tree_util.tree_map(lambda x: x[None], folded)
        return folded

    return jax.shard_map(local_fold, mesh=world.mesh, in_specs=(state_specs(bn_mode),),
                         out_specs=spec)


def make_eval_step(model: nn.Module, world: World, bn_mode: str, folded: bool = True) -> Callable:
    """Returns ``eval_step(params, bn, batch, acc) -> acc``: no collective.

    Args (of the returned function):
      params: the model params (replicated).
      bn: with ``folded=True`` the output of :func:`make_fold_bn`; otherwise
        the raw ``batch_stats`` (BN then folds on every batch).
      batch: as for the train step (``eval_batch_size`` rows).
      acc: ``[world_size, 4] float32`` sharded over the data axis: each device
        adds its batch's ``loss_sum, top1, top5, count`` to its own row.

    :func:`make_eval_reduce` turns ``acc`` into exact global values once per
    pass (the seed's VAL_RESULT_COMM).
    """
    collection = "bn_folded" if folded else "batch_stats"
    bn_spec = P(DATA_AXIS) if bn_mode == "local" else P()

    def local_eval(params, bn, batch, acc):
        if bn_mode == "local":
            bn = jax.tree_util.tree_map(lambda x: x[0], bn)
        logits = model.apply({"params": params, collection: bn}, batch["image"], train=False)
        return acc + batch_metrics(logits, batch["label"], batch["mask"])[None]

    return jax.shard_map(local_eval, mesh=world.mesh,
                         in_specs=(P(), bn_spec, BATCH_SPEC, P(DATA_AXIS)),
                         out_specs=P(DATA_AXIS))


def make_eval_reduce(world: World) -> Callable:
    """Returns ``reduce(acc [N, 4]) -> [4]``: the one all-reduce of a validation
    pass, giving global ``loss_sum, top1, top5, count``."""
    return jax.shard_map(lambda acc: collectives.allreduce_sums(acc[0], DATA_AXIS),
                         mesh=world.mesh, in_specs=P(DATA_AXIS), out_specs=P())


# --------------------------------------------------------------------------
# compile step
# --------------------------------------------------------------------------

def abstract(tree):
    """``jax.ShapeDtypeStruct`` (with sharding) of every leaf of ``tree``."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def _spec_str(a) -> str:
    return f"{tuple(a.shape)} {np.dtype(a.dtype).name}"


class CompiledStep:
    """An ahead-of-time compiled step that never recompiles.

    Calling it checks every argument leaf's shape, dtype and sharding against
    the compiled signature and raises ``TypeError`` naming the leaf and both
    signatures on a mismatch (XLA's own check skips arguments it eliminated).

    Attributes:
      name: for messages and counts.
      compiled: the ``jax.stages.Compiled``.
      compile_s: wall seconds spent lowering + compiling.
      calls: number of calls.
    """

    def __init__(self, name: str, compiled, signature, compile_s: float, donate_argnums=(),
                 lowered_text: str = ""):
        self.name = name
        self.compiled = compiled
        self.signature = signature
        self.compile_s = compile_s
        self.lowered_text = lowered_text
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.calls = 0
        self._paths = [jax.tree_util.keystr(p) for p, _ in
                       jax.tree_util.tree_flatten_with_path(signature)[0]]
        self._leaves, self._treedef = jax.tree_util.tree_flatten(signature)

    def check(self, *args) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != self._treedef:
            raise TypeError(f"{self.name}: argument structure {treedef} differs from the compiled "
                            f"one {self._treedef}")
        for path, want, got in zip(self._paths, self._leaves, leaves):
            if getattr(got, "is_deleted", lambda: False)():
                raise RuntimeError(f"{self.name}: argument {path} was donated to an earlier call "
                                   "and its buffer is gone; pass the state that call returned")
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise TypeError(f"{self.name}: argument {path} is {_spec_str(got)} but the step "
                                f"was compiled for {_spec_str(want)}; build batches of the "
                                "compiled shape (pad the last one with mask 0)")
            sharding = getattr(got, "sharding", None)
            if want.sharding is not None and sharding is not None and \
                    not sharding.is_equivalent_to(want.sharding, len(want.shape)):
                raise TypeError(f"{self.name}: argument {path} has sharding {sharding} but the step "
                                f"was compiled for {want.sharding}; use jax.device_put with the "
                                "world's sharding")

    def __call__(self, *args):
        self.check(*args)
        if self.calls == 0 and self.donate_argnums:
            args = tuple(dealias(a) if i in self.donate_argnums else a for i, a in enumerate(args))
        self.calls += 1
        return self.compiled(*args)

    def memory(self) -> dict[str, int]:
        """The compiled executable's memory statistics, in bytes."""
        m = self.compiled.memory_analysis()
        if m is None:
            return {}
        return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
                "peak": int(getattr(m, "peak_memory_in_bytes", 0) or
                            m.argument_size_in_bytes + m.output_size_in_bytes
                            - m.alias_size_in_bytes + m.temp_size_in_bytes)}

    def cost(self) -> dict[str, float]:
        """XLA's cost analysis (flops, bytes accessed) of one call, if available."""
        c = self.compiled.cost_analysis()
        if isinstance(c, (list, tuple)):
            c = c[0] if c else {}
        return {k: float(v) for k, v in (c or {}).items() if k in ("flops", "bytes accessed")}

    def hlo_text(self) -> str:
        """The compiled (post-optimisation) HLO."""
        return self.compiled.as_text()


def dealias(tree):
    """Copies leaves whose device buffers are shared with an earlier leaf.

    Donating a pytree in which two leaves share a buffer (the same array
    twice, or a ``device_put`` that reused its source) would hand XLA one
    buffer twice; the later leaf gets its own copy instead. Returns the tree
    with distinct buffers; leaves already distinct are returned as they are.
    """
    seen: set = set()

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        ptrs = tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        if any(p in seen for p in ptrs):
            x = jax.device_put(x, x.sharding, may_alias=False, donate=False)
            ptrs = tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        seen.update(ptrs)
        return x

    return jax.tree_util.tree_map(one, tree)


def compile_step(name: str, fn: Callable, *example_args, donate_argnums=()) -> CompiledStep:
    """Lowers and compiles ``fn`` for the shapes/shardings of ``example_args``.

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct`` with sharding;
    nothing is executed. Arguments in ``donate_argnums`` are donated: their
    buffers are reused for the outputs, so the caller must not use them again.
    """
    sig = abstract(example_args)
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*sig)
    compiled = lowered.compile()
    return CompiledStep(name, compiled, sig, time.perf_counter() - t0, donate_argnums,
                        lowered.as_text())
