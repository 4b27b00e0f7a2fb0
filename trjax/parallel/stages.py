"""The pipeline's stages: a model's units (a ResNet's residual blocks, a sequence's
layers) split into ``S`` contiguous runs balanced by multiply-accumulates, and
within :data:`MAC_TOLERANCE` of that balance by parameters (:func:`plan_stages`),
each run a module of its own (:func:`stage_modules`), and the checks a pipeline
config makes before anything is traced (:func:`check_pipeline`,
:func:`default_microbatches`).

The stem goes with the first stage, the pooling + dense head with the last; only
one activation tensor crosses each stage boundary (a ResNet's skips stay inside
their block).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from trjax import models
from trjax.parallel.stage_owned import subtree

MAC_TOLERANCE = 0.10
"""How far above the best MAC balance :func:`plan_stages` lets the slowest stage go to
hold fewer parameters on the largest stage (every stage-owned buffer of the pipeline
is the largest stage's size: :mod:`trjax.parallel.stage_owned`)."""


def _prefix(values: Sequence[float]) -> list[float]:
    """``[0, v0, v0 + v1, ...]``: a part ``[lo, hi)``'s sum is ``p[hi] - p[lo]``."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


def _minimax(costs: Sequence[float], num_stages: int, allowed) -> tuple[float, list] | None:
    """The contiguous split of ``costs`` into ``num_stages`` non-empty parts that
    minimises the largest part's sum among the splits whose every part ``[lo, hi)``
    is ``allowed(lo, hi)`` (exact dynamic programme, ties to the earliest cut);
    ``(largest sum, bounds)``, ``None`` when no split is allowed."""
    n, inf, prefix = len(costs), float("inf"), _prefix(costs)
    # best[k][i]: min over splits of items [0, i) into k parts of the max part
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for m in range(k - 1, i):
                v = max(best[k - 1][m], prefix[i] - prefix[m])
                if v < best[k][i] and allowed(m, i):
                    best[k][i], cut[k][i] = v, m
    if best[num_stages][n] == inf:
        return None
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        m = cut[k][i]
        bounds.append((m, i))
        i = m
    return best[num_stages][n], bounds[::-1]


def balanced_split(costs: Sequence[float], num_stages: int, sizes: Sequence[float] | None = None,
                   tolerance: float = MAC_TOLERANCE) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of ``costs`` into ``num_stages`` non-empty
    parts minimising the largest part's sum (exact dynamic programme, ties to
    the earliest cut). With ``sizes`` (each item's parameters): among the splits
    whose largest cost is within ``1 + tolerance`` of the best, the one whose
    largest part holds the fewest ``sizes`` (then the best cost among those).

    Raises:
      ValueError: ``num_stages < 1`` or more stages than items.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} residual blocks into {num_stages} stages: "
                         f"use 1..{n} stages")
    fastest, bounds = _minimax(costs, num_stages, lambda lo, hi: True)
    if sizes is None:
        return bounds
    prefix, size_prefix, cap = _prefix(costs), _prefix(sizes), fastest * (1 + tolerance)
    fits = lambda lo, hi: prefix[hi] - prefix[lo] <= cap  # noqa: E731
    smallest, _ = _minimax(sizes, num_stages, fits)
    return _minimax(costs, num_stages, lambda lo, hi: fits(lo, hi) and
                    size_prefix[hi] - size_prefix[lo] <= smallest)[1]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How a ResNet is split into pipeline stages.

    Attributes:
      blocks: the residual block names (a sequence's layer names, ``layers_i``)
        in call order.
      bounds: per stage ``(lo, hi)``: it runs ``blocks[lo:hi]`` (stage 0 also
        the stem, the last stage also the head).
      first, last: the names the first / last stage owns besides its blocks
        (a ResNet's stem and head; none for a sequence).
      macs: per stage, multiply-accumulates per example.
      shares: per stage, its fraction of the model's MACs.
      imbalance: ``max(macs) / mean(macs)`` (1 = perfectly balanced; the
        pipeline's efficiency is at most ``1 / imbalance``).
      param_shares: per stage, its fraction of the model's parameters (the largest
        sets every stage-owned buffer's size); empty where not computed.
    """
    blocks: tuple
    bounds: tuple
    macs: tuple
    shares: tuple
    imbalance: float
    first: tuple = ("stem_conv", "stem_bn")
    last: tuple = ("head",)
    param_shares: tuple = ()

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def names(self, s: int) -> list[str]:
        """The top-level parameter names stage ``s`` owns (stem / blocks / head)."""
        lo, hi = self.bounds[s]
        names = list(self.blocks[lo:hi])
        if s == 0:
            names = list(self.first) + names
        if s == self.num_stages - 1:
            names = names + list(self.last)
        return names


SPLITTABLE = ("trjax's ResNets (trjax.models.ResNet) or a sequence of layers (flax nn.Sequential, "
              "nnx.Sequential or a list of layers)")
SEQUENCES = (models.FlaggedSequential, models.NNXSequence)


def _units(module, image_shape) -> tuple[list[str], list[float], dict]:
    """``(names, costs, StagePlan fields)`` of what a pipeline splits: a ResNet's
    residual blocks (MACs) or a sequence's layers (XLA's flops / 2)."""
    if isinstance(module, models.ResNet):
        info = module.blocks_info(image_shape)
        return [b["name"] for b in info], [b["macs"] for b in info], {}
    _check_splittable(module)
    info = module.layer_costs(image_shape)
    return [b["name"] for b in info], [b["flops"] / 2 for b in info], {"first": (), "last": ()}


def _unit_sizes(module, image_shape, names, first, last) -> list[int]:
    """Parameters (elements) per unit of ``names``, the ``first`` names' added to the
    first unit and the ``last`` names' to the last (traced abstractly, nothing runs)."""
    if isinstance(module, models.NNXSequence):
        params = module.net.abstract_variables(tuple(image_shape))["params"]
    else:
        x = jax.ShapeDtypeStruct((1,) + tuple(image_shape), jnp.float32)
        params = jax.eval_shape(lambda k, x: module.init(k, x, train=False),
                                jax.random.key(0), x)["params"]
    count = lambda units: sum(math.prod(a.shape) for a in  # noqa: E731
                              jax.tree_util.tree_leaves(subtree(params, units)))
    sizes = [count([n]) for n in names]
    sizes[0] += count(first)
    sizes[-1] += count(last)
    return sizes


def _check_splittable(module) -> None:
    """Raises ``ValueError`` unless a pipeline can split ``module`` (a ResNet or a
    sequence), naming the way to write another model as a sequence."""
    if isinstance(module, (models.ResNet,) + SEQUENCES):
        return
    cls = type(module)
    raise ValueError(f"a 'stage' mesh axis splits {SPLITTABLE} into stages; your model "
                     f"{cls.__module__}.{cls.__qualname__} is neither: write it as "
                     "nn.Sequential([...]) (or nnx.Sequential(...), or a list) of layers that "
                     "each take one array (a residual block is one layer; each gets the "
                     "training flag it takes), use a built-in ResNet, or a mesh without 'stage'")


def plan_stages(module, image_shape: Sequence[int], num_stages: int,
                starts: Sequence[str] | None = None) -> StagePlan:
    """Splits a ResNet's residual blocks, or a sequence's layers, into
    ``num_stages`` contiguous stages balanced by their cost.

    Args:
      module: a :class:`trjax.models.ResNet` (cost: MACs) or a
        :class:`trjax.models.FlaggedSequential` (a flax ``nn.Sequential`` as
        :func:`trjax.models.as_network` holds it; cost: XLA's cost analysis of
        each layer alone, :meth:`~trjax.models.FlaggedSequential.layer_costs`;
        torchgpipe's ``nn.Sequential`` contract).
      image_shape: ``(H, W, C)`` of one image (for the MACs).
      num_stages: S >= 1.
      starts: ``None`` (balanced by MACs and, within :data:`MAC_TOLERANCE` of the
        best MAC balance, by parameters: :func:`balanced_split`) or the S - 1
        block names that begin stages 1 .. S-1, in call order.

    Returns:
      A :class:`StagePlan` (each stage's MAC share in ``shares``).

    Raises:
      ValueError: a model of another kind (naming the way to express it as a
        sequence); from :meth:`trjax.models.ResNet.blocks_info` /
        :func:`balanced_split`; ``starts`` of the wrong length, naming an unknown
        block or the first block, or out of order.
    """
    module = models.splittable(module)
    names, costs, extra = _units(module, image_shape)
    first, last = extra.get("first", StagePlan.first), extra.get("last", StagePlan.last)
    sizes = _unit_sizes(module, image_shape, names, first, last)
    if starts is None:
        bounds = balanced_split(costs, num_stages, sizes)
    else:
        starts = list(starts)
        if len(starts) != num_stages - 1:
            raise ValueError(f"{num_stages} stages need {num_stages - 1} stage starts, got "
                             f"{starts}")
        unknown = [s for s in starts if s not in names[1:]]
        if unknown:
            raise ValueError(f"stage starts {unknown} are not blocks after the first; the "
                             f"blocks are {names}")
        idx = [names.index(s) for s in starts]
        if idx != sorted(set(idx)):
            raise ValueError(f"stage starts {starts} must be distinct and in call order")
        edges = [0] + idx + [len(names)]
        bounds = list(zip(edges[:-1], edges[1:]))
    macs = tuple(sum(costs[lo:hi]) for lo, hi in bounds)
    total, held = sum(macs), [sum(sizes[lo:hi]) for lo, hi in bounds]
    return StagePlan(blocks=tuple(names), bounds=tuple(bounds), macs=macs,
                     shares=tuple(m / total for m in macs),
                     imbalance=max(macs) / (total / len(macs)),
                     param_shares=tuple(h / max(sum(held), 1) for h in held), **extra)


def stage_modules(module, plan: StagePlan) -> list[nn.Module]:
    """One module per stage of ``plan``: the model itself, run over the stage's
    blocks (``ResNet(blocks=(lo, hi))``: the stem with the first, the head with
    the last; ``FlaggedSequential(span=(lo, hi))``); each reads the whole
    model's parameter / ``batch_stats`` paths of the names it owns
    (:meth:`StagePlan.names`)."""
    module = models.splittable(module)
    key = "blocks" if isinstance(module, models.ResNet) else "span"
    return [module.clone(**{key: (lo, hi)}) for lo, hi in plan.bounds]


# -- the pipelined forward + backward -------------------------------------------------------

MIN_BN_ROWS = 16
"""Rows a BatchNorm should normalise together: below 16 per group its error rises
quickly (Wu & He, "Group Normalization", ECCV 2018, Fig. 1: ResNet-50 on ImageNet,
batch 32 -> 16 -> 8 per group); the default micro-batch count keeps at least this many."""


def bn_rows(local_batch: int, num_microbatches: int, data_size: int, bn_mode: str) -> int:
    """Rows one BatchNorm normalises together in a pipelined step: a micro-batch's rows
    on one data rank (``local_batch / M``), times the data ranks in ``sync`` mode (its
    statistics are summed over ``data`` per micro-batch)."""
    return local_batch // num_microbatches * (data_size if bn_mode == "sync" else 1)


def default_microbatches(num_stages: int, local_batch: int, data_size: int,
                         bn_mode: str) -> int:
    """M when the config leaves it 0: the largest divisor of ``local_batch`` in
    ``[S, 4 S]`` (GPipe's rule of thumb, Huang et al. 2019: the bubble
    ``(S-1)/(M+S-1)`` is small for M >= 4 S) whose BatchNorm groups keep at least
    :data:`MIN_BN_ROWS` rows (:func:`bn_rows`); the smallest valid M (the largest
    groups) when none does, and ``4 S`` when no M in ``[S, 4 S]`` divides (the
    checks then name the valid ones)."""
    fits = [m for m in range(num_stages, 4 * num_stages + 1) if local_batch % m == 0]
    if not fits:
        return 4 * num_stages
    healthy = [m for m in fits if bn_rows(local_batch, m, data_size, bn_mode) >= MIN_BN_ROWS]
    return max(healthy) if healthy else min(fits)


def check_pipeline(module, image_shape: Sequence[int], num_stages: int, local_batch: int,
                   num_microbatches: int, starts: Sequence[str] | None = None,
                   what: str | None = None, starts_what: str | None = None) -> StagePlan:
    """Every check of a pipelined run, before anything is traced.

    Args:
      module: the model (a :class:`trjax.models.ResNet`, bare or in a
        :class:`trjax.models.Network`).
      image_shape: ``(H, W, C)``.
      num_stages: S, the mesh's ``stage`` size.
      local_batch: rows per data rank (``global_batch_size // data_size``).
      num_microbatches: M.
      starts: the block names that begin stages 1 .. S-1, or ``None`` (balanced).
      what: how the messages name M (default ``config.pipeline_microbatches=M``).
      starts_what: how the messages name ``starts`` (e.g.
        ``"config.pipeline_stage_starts='...'"``), prefixed to their errors.

    Returns:
      The :class:`StagePlan`.

    Raises:
      ValueError: not a trjax ResNet (naming the type and the way out), more
        stages than residual blocks, ``M < S`` or ``M`` not dividing the local
        batch (naming the valid counts), or bad ``starts``.
    """
    module = models.splittable(module)
    _check_splittable(module)
    valid = [m for m in range(num_stages, local_batch + 1) if local_batch % m == 0]
    if num_microbatches < num_stages or local_batch % num_microbatches:
        what = what or f"config.pipeline_microbatches={num_microbatches}"
        raise ValueError(f"{what} does not fit "
                         f"{num_stages} stages and a local batch of {local_batch} rows: it must "
                         f"be >= {num_stages} (else stages idle) and divide {local_batch}; "
                         f"valid: {valid[:12]}")
    try:
        return plan_stages(module, image_shape, num_stages, starts)
    except ValueError as e:
        if starts is None or starts_what is None:
            raise
        raise ValueError(f"{starts_what}: {e}") from e
