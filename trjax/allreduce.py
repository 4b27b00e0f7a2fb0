"""All-reduce algorithms written out with point-to-point ``lax.ppermute``.

``lax.psum`` leaves the algorithm to XLA (NCCL on GPUs picks ring or tree by
itself). The functions here spell the classic algorithms out step by step, so
their schedules, traffic and summation orders are explicit and can be
compared; each one is a pure function of a per-device buffer, to be called
inside ``jax.shard_map`` over a mesh axis, and each returns the sum over that
axis (like ``lax.psum``, not the mean).

* :func:`ring_allreduce` -- ring reduce-scatter then ring all-gather,
  2(N-1) steps (Patarasuk & Yuan 2009; the NCCL/Horovod/Baidu ring).
* :func:`halving_doubling_allreduce` -- recursive-halving reduce-scatter then
  recursive-doubling all-gather, 2 log2 N steps (Rabenseifner's algorithm,
  Thakur, Rabenseifner & Gropp 2005); non-powers of two fold the extra ranks
  in first and back out last.
* :func:`tree_allreduce` -- binomial-tree reduce to rank 0 then binomial-tree
  broadcast, 2 ceil(log2 N) steps.
* :func:`hierarchical_allreduce` -- ranks grouped into nodes: reduce-scatter
  within a node, all-reduce across nodes, all-gather within a node (Horovod's
  hierarchical all-reduce; Mikami et al. 2018's 2D-torus all-reduce);
  ``config.allreduce="hierarchical"`` (:mod:`trjax.exchange`).
* :data:`ALGORITHMS` -- the flat algorithms by name (``"xla"`` is plain
  ``lax.psum``); :func:`cost_model` -- the alpha-beta model of each.

The world size ``N = lax.axis_size(axis_name)`` is a static Python int inside
``shard_map``, so every permutation is known at trace time. Every algorithm
reduces each element exactly once, on one rank, and then copies it, so every
rank ends with bitwise identical results; the summation order differs between
algorithms (each docstring gives it), so results differ from ``lax.psum`` by
float rounding only. Typing: ``ppermute`` results are "varying" over the
axis, so (unlike ``lax.psum``) the results here are typed varying although
their values are replicated: return them with ``out_specs=P(axis)`` (one row
per device) or build the ``shard_map`` with ``check_vma=False``.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from trjax.collectives import as_varying

__all__ = ["ring_allreduce", "halving_doubling_allreduce", "tree_allreduce",
           "hierarchical_allreduce", "xla_allreduce", "ALGORITHMS", "cost_model"]


# --------------------------------------------------------------------------- helpers

def _chunks(x: jax.Array, parts: int) -> tuple[jax.Array, int]:
    """``x`` flattened, zero-padded to a multiple of ``parts`` and reshaped to
    ``[parts, ceil(n / parts)]``; also returns ``n = x.size``."""
    n = x.size
    c = -(-n // parts)
    flat = x.reshape(-1)
    if c * parts != n:
        flat = jnp.pad(flat, (0, c * parts - n))
    return flat.reshape(parts, c), n


def _unchunk(chunks: jax.Array, n: int, shape) -> jax.Array:
    return chunks.reshape(-1)[:n].reshape(shape)


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


# --------------------------------------------------------------------------- algorithms

def xla_allreduce(x: jax.Array, axis_name) -> jax.Array:
    """``lax.psum``: one all-reduce, algorithm chosen by XLA / NCCL.

    The only algorithm here whose result is typed invariant over the axis.
    """
    return lax.psum(x, axis_name)


def ring_allreduce(x: jax.Array, axis_name) -> jax.Array:
    """Ring all-reduce: ring reduce-scatter, then ring all-gather.

    The buffer is split into N chunks (zero-padded to a multiple of N, the
    padding dropped at the end). Reduce-scatter: at step ``s = 0..N-2`` rank
    ``r`` sends its partial chunk ``(r - s) mod N`` to rank ``r + 1`` and adds
    the chunk ``(r - s - 1) mod N`` it receives from ``r - 1`` into its own;
    after N-1 steps rank ``r`` holds the full sum of chunk ``(r + 1) mod N``.
    All-gather: N-1 more steps pass the finished chunks around the ring. Each
    step is one ``lax.ppermute`` (XLA ``collective-permute``) of ``n / N``
    elements, inside a ``lax.fori_loop`` so the program size does not grow
    with N. Source: Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 2009 (the ring of NCCL,
    Baidu's ring all-reduce and Horovod).

    Summation order: chunk ``k`` is ``((x_k + x_{k+1}) + ...) + x_{k+N-1}``
    (rank indices mod N), reduced once on rank ``k - 1`` and copied to all.

    Args:
      x: per-device buffer, any shape (flattened internally) and numeric dtype.
      axis_name: the mesh axis to reduce over; any size N >= 1.

    Returns:
      ``x.shape``, ``x.dtype``: the sum over the axis, bitwise identical on
      every rank; typed varying (see the module docstring). N == 1 returns
      ``x`` itself.
    """
    n_ranks = lax.axis_size(axis_name)
    if n_ranks == 1 or x.size == 0:
        return x
    chunks, n = _chunks(as_varying(x, axis_name), n_ranks)
    rank = lax.axis_index(axis_name)
    to_next = [(i, (i + 1) % n_ranks) for i in range(n_ranks)]

    def reduce_scatter_step(s, chunks):
        send = lax.dynamic_index_in_dim(chunks, (rank - s) % n_ranks, keepdims=False)
        recv = lax.ppermute(send, axis_name, to_next)
        idx = (rank - s - 1) % n_ranks
        mine = lax.dynamic_index_in_dim(chunks, idx, keepdims=False)
        return lax.dynamic_update_index_in_dim(chunks, mine + recv, idx, 0)

    def all_gather_step(s, chunks):
        send = lax.dynamic_index_in_dim(chunks, (rank + 1 - s) % n_ranks, keepdims=False)
        recv = lax.ppermute(send, axis_name, to_next)
        return lax.dynamic_update_index_in_dim(chunks, recv, (rank - s) % n_ranks, 0)

    chunks = lax.fori_loop(0, n_ranks - 1, reduce_scatter_step, chunks)
    chunks = lax.fori_loop(0, n_ranks - 1, all_gather_step, chunks)
    return _unchunk(chunks, n, x.shape)


def halving_doubling_allreduce(x: jax.Array, axis_name) -> jax.Array:
    """Rabenseifner's all-reduce: recursive halving, then recursive doubling.

    For ``N = p = 2^k`` ranks the buffer is split into p chunks. Reduce-scatter
    by recursive halving: for ``d = p/2, p/4, ..., 1`` rank ``r`` swaps with
    partner ``r XOR d`` the half of its current chunk range that the partner
    keeps, and adds the half it receives into the half it keeps; after k steps
    rank ``r`` holds the full sum of chunk ``r``. All-gather by recursive
    doubling mirrors it (``d = 1, 2, ..., p/2``, the owned range doubling each
    step). 2 log2 p ``ppermute`` steps, each rank sending
    ``2 (p-1)/p * n`` elements in all. Source: Thakur, Rabenseifner & Gropp,
    "Optimization of collective communication operations in MPICH", IJHPCA
    2005, Sec. 4.5 (Rabenseifner's algorithm).

    Any other N (``N = p + rem``, ``p`` the largest power of two below N) is
    handled as in that paper, simplified: first the ``2 rem`` lowest ranks
    pair up and each even rank ``2i`` sends its whole buffer to ``2i + 1``,
    which adds it (the paper exchanges halves); the p remaining ranks run the
    power-of-two algorithm; last each ``2i + 1`` sends the result back to
    ``2i``. That costs 2 extra steps and ``n`` extra elements on the critical
    path.

    Summation order: with ``y`` = the inputs after folding (``x_{2i} +
    x_{2i+1}`` for ``i < rem``, then ``x_{2 rem}, ..., x_{N-1}``), the result is
    the pairwise tree obtained by repeatedly adding the upper half of ``y`` to
    the lower half (``y[:h] + y[h:]``) until one row is left.

    Args:
      x: per-device buffer, any shape (flattened internally) and numeric dtype.
      axis_name: the mesh axis; any size N >= 1.

    Returns:
      ``x.shape``, ``x.dtype``: the sum over the axis, bitwise identical on
      every rank; typed varying.
    """
    n_ranks = lax.axis_size(axis_name)
    if n_ranks == 1 or x.size == 0:
        return x
    p = 1 << (n_ranks.bit_length() - 1)
    rem = n_ranks - p
    rank = lax.axis_index(axis_name)
    flat = as_varying(x, axis_name).reshape(-1)
    if rem:  # fold ranks 2i into 2i+1 (i < rem)
        folded = lax.ppermute(flat, axis_name, [(2 * i, 2 * i + 1) for i in range(rem)])
        flat = jnp.where((rank < 2 * rem) & (rank % 2 == 1), flat + folded, flat)
    vrank = jnp.where(rank < 2 * rem, rank // 2, rank - rem)  # rank among the p active ranks

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    chunks, n = _chunks(flat, p)
    d = p // 2
    while d >= 1:  # recursive halving: current range has 2d chunks, keep the half holding vrank
        pairs = [(real(v), real(v ^ d)) for v in range(p)]
        start = vrank & ~(2 * d - 1)
        keep = start + (vrank & d)
        send = start + (d - (vrank & d))
        recv = lax.ppermute(lax.dynamic_slice_in_dim(chunks, send, d, 0), axis_name, pairs)
        mine = lax.dynamic_slice_in_dim(chunks, keep, d, 0)
        chunks = lax.dynamic_update_slice_in_dim(chunks, mine + recv, keep, 0)
        d //= 2
    d = 1
    while d < p:  # recursive doubling: owned range of d chunks, swap with partner's
        pairs = [(real(v), real(v ^ d)) for v in range(p)]
        own = vrank & ~(d - 1)
        recv = lax.ppermute(lax.dynamic_slice_in_dim(chunks, own, d, 0), axis_name, pairs)
        chunks = lax.dynamic_update_slice_in_dim(chunks, recv, own ^ d, 0)
        d *= 2
    out = chunks.reshape(-1)[:n]
    if rem:  # send the result back to the folded-in ranks
        back = lax.ppermute(out, axis_name, [(2 * i + 1, 2 * i) for i in range(rem)])
        out = jnp.where((rank < 2 * rem) & (rank % 2 == 0), back, out)
    return out.reshape(x.shape)


def tree_allreduce(x: jax.Array, axis_name) -> jax.Array:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0.

    Not a double binary tree: one binomial tree, the whole buffer per message.
    Reduce: for ``d = 1, 2, 4, ...`` (< N) every rank ``r`` with
    ``r mod 2d == d`` sends its partial sum to ``r - d``, which adds it.
    Broadcast: the same steps in reverse, rank ``r mod 2d == 0`` sending the
    total to ``r + d``. 2 ceil(log2 N) ``ppermute`` steps of ``n`` elements
    each; latency-optimal for small buffers, but every step carries the whole
    buffer (Thakur, Rabenseifner & Gropp 2005, Sec. 4.1 and 4.5: "binomial
    tree" reduce + broadcast).

    Summation order: pairwise by rank distance, ``((x0 + x1) + (x2 + x3)) +
    ...``; a rank without a partner at some distance carries its partial sum
    on unchanged (N = 3: ``(x0 + x1) + x2``).

    Args:
      x: per-device buffer, any shape and numeric dtype.
      axis_name: the mesh axis; any size N >= 1.

    Returns:
      ``x.shape``, ``x.dtype``: the sum over the axis (rank 0's total, copied
      bit for bit to every rank); typed varying.
    """
    n_ranks = lax.axis_size(axis_name)
    if n_ranks == 1 or x.size == 0:
        return x
    rank = lax.axis_index(axis_name)
    acc = as_varying(x, axis_name)
    dists = [1 << i for i in range(_ceil_log2(n_ranks))]
    for d in dists:
        recv = lax.ppermute(acc, axis_name, [(r, r - d) for r in range(d, n_ranks, 2 * d)])
        receives = (rank % (2 * d) == 0) & (rank + d < n_ranks)
        acc = jnp.where(receives, acc + recv, acc)
    for d in reversed(dists):
        recv = lax.ppermute(acc, axis_name,
                            [(r, r + d) for r in range(0, n_ranks, 2 * d) if r + d < n_ranks])
        acc = jnp.where(rank % (2 * d) == d, recv, acc)
    return acc


def hierarchical_allreduce(x: jax.Array, axis_name, local_size: int) -> jax.Array:
    """Two-level all-reduce: ranks grouped into nodes of ``local_size`` consecutive ranks.

    1. reduce-scatter within each node (``lax.psum_scatter`` over the node's
       ranks): each of its L devices gets the node's sum of one ``1/L`` slice;
    2. all-reduce that slice across nodes (``lax.psum`` over the ranks with
       the same position in their node): only ``n / L`` elements cross nodes;
    3. all-gather within each node (``lax.all_gather``) rebuilds the buffer.

    This is Horovod's hierarchical all-reduce (NCCL reduce-scatter, MPI
    all-reduce, NCCL all-gather; Sergeev & Del Balso 2018) and the 2D-torus
    all-reduce of Mikami et al. 2018, with the fast intra-node links inside a
    group (JAX numbers the devices of one process consecutively). The groups
    are ``axis_index_groups`` of one mesh axis; the buffer is zero-padded to a
    multiple of L and unpadded. Summation order: within the node first, then
    across nodes.

    Args:
      x: per-device buffer, any shape and numeric dtype.
      axis_name: the (1-D) data axis, of size N.
      local_size: L, devices per node; must divide N.

    Returns:
      ``x.shape``, ``x.dtype``: the sum over the axis.

    Raises:
      ValueError: ``local_size`` not a divisor of N (naming both).
    """
    n_ranks = lax.axis_size(axis_name)
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or n_ranks % local_size:
        raise ValueError(f"hierarchical all-reduce: local_size={local_size!r} must be an int "
                         f">= 1 dividing the world size {n_ranks}")
    if x.size == 0 or local_size == 1 or local_size == n_ranks:
        return lax.psum(x, axis_name) if x.size else x
    nodes = [list(range(s, s + local_size)) for s in range(0, n_ranks, local_size)]
    peers = [list(range(i, n_ranks, local_size)) for i in range(local_size)]
    chunks, n = _chunks(x, local_size)
    part = lax.psum_scatter(chunks.reshape(-1), axis_name, scatter_dimension=0, tiled=True,
                            axis_index_groups=nodes)
    part = lax.psum(part, axis_name, axis_index_groups=peers)
    full = lax.all_gather(part, axis_name, axis=0, tiled=True, axis_index_groups=nodes)
    return full[:n].reshape(x.shape)


ALGORITHMS: dict[str, Callable[[jax.Array, str], jax.Array]] = {
    "xla": xla_allreduce,
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "tree": tree_allreduce,
}
"""Name -> ``f(x, axis_name)`` returning the sum of ``x`` over the axis."""


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; "
                         f"choose one of {sorted(ALGORITHMS)}")


# --------------------------------------------------------------------------- cost model

def cost_model(algorithm: str, nbytes: float, world_size: int, alpha_s: float = 5e-6,
               beta_s_per_byte: float = 1.0 / 25e9) -> dict:
    """Alpha-beta (latency-bandwidth) cost of an all-reduce of ``nbytes``.

    A message of m bytes costs ``alpha + m * beta``; computation (the
    additions) is ignored. With ``N = world_size``, ``n = nbytes``,
    ``p = 2^floor(log2 N)``, ``L = ceil(log2 N)``:

    ====================  =================  ==========================  ======================
    algorithm             steps              bytes_sent_per_rank         critical_path_bytes
    ====================  =================  ==========================  ======================
    ring (and ``xla``)    2(N-1)             2(N-1)/N * n                same
    halving_doubling      2 log2 N           2(N-1)/N * n                same
      N not a power of 2  2 log2 p + 2       2(p-1)/p * n + n            2(p-1)/p * n + 2n
    tree                  2 L                L * n                       2 L * n
    ====================  =================  ==========================  ======================

    and ``time_s = steps * alpha_s + critical_path_bytes * beta_s_per_byte``.
    ``bytes_sent_per_rank`` is the busiest rank's total (tree: rank 0 sends
    the whole buffer at each of its L broadcast steps; halving_doubling with a
    fold: the ranks ``2i + 1``). Ring and halving-doubling move the
    bandwidth-optimal ``2(N-1)/N * n`` (reduce-scatter + all-gather); ring pays
    2(N-1) latencies, halving-doubling 2 log2 N, the tree 2 L latencies but
    the whole buffer per step. Sources: Thakur, Rabenseifner & Gropp 2005
    (Sec. 4.5, all-reduce: binomial tree reduce + broadcast, Rabenseifner's
    algorithm and its non-power-of-two fold); Patarasuk & Yuan 2009 (ring).
    ``"xla"`` is modelled as a ring, NCCL's choice for large buffers (as in
    :func:`trjax.comm.ring_traffic_bytes`). The ring's actual chunks are
    ``ceil(n / N)`` elements (padding), ignored here. The defaults (5 us,
    25 GB/s) are placeholders: pass measured values.

    Args:
      algorithm: ``"xla"``, ``"ring"``, ``"halving_doubling"`` or ``"tree"``.
      nbytes: buffer size in bytes (>= 0).
      world_size: N >= 1 (an int).
      alpha_s: per-message latency in seconds.
      beta_s_per_byte: seconds per byte (1 / bandwidth).

    Returns:
      ``{"steps": int, "bytes_sent_per_rank": float, "critical_path_bytes":
      float, "time_s": float}``; all zero for N == 1.

    Raises:
      ValueError: unknown algorithm, ``world_size`` not an int >= 1, or
      negative ``nbytes`` (naming the value).
    """
    _check_algorithm(algorithm)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    N, n = world_size, float(nbytes)
    if N == 1:
        steps, sent, path = 0, 0.0, 0.0
    elif algorithm in ("ring", "xla"):
        steps, sent = 2 * (N - 1), 2.0 * (N - 1) / N * n
        path = sent
    elif algorithm == "halving_doubling":
        p = 1 << (N.bit_length() - 1)
        core = 2.0 * (p - 1) / p * n
        if p == N:
            steps, sent, path = 2 * int(math.log2(p)), core, core
        else:
            steps, sent, path = 2 * int(math.log2(p)) + 2, core + n, core + 2 * n
    else:  # tree
        L = _ceil_log2(N)
        steps, sent, path = 2 * L, L * n, 2 * L * n
    return {"steps": steps, "bytes_sent_per_rank": sent, "critical_path_bytes": path,
            "time_s": steps * alpha_s + path * beta_s_per_byte}
