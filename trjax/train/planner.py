"""``trjax-plan``: the mesh, schedule, micro-batches and remat chosen from XLA's own numbers.

For a config, its devices and a memory budget per device, :func:`plan`

1. enumerates candidates (:func:`candidates`): every factorization of the
   world size into ``data x fsdp x stage x model``, each pipeline schedule on a
   ``stage`` axis, remat off and on; a candidate trjax cannot build (a batch
   the batch axes do not divide, a model with no tensor plan, more stages than
   blocks) is dropped with the builder's own reason;
2. prunes before compiling: a candidate whose train state alone (the
   per-device shards of its parameters, optimizer and comm state, exact from
   their shardings) exceeds the budget is not compiled, nor one whose compute
   time alone cannot beat the best fitting candidate so far (before tracing:
   :func:`_compute_bound` from the data-parallel FLOPs of a row; after:
   :func:`trjax.cost.jaxpr_flops` at peak FLOP/s), nor a remat candidate whose
   twin without remat fits; candidates are tried in the order of a cheap work
   estimate (:func:`_work`), so good plans come early;
3. compiles each remaining train step ahead of time
   (:func:`trjax.aot.compile_step`, abstract shapes, nothing runs) and reads
   XLA's ``memory_analysis()`` (the peak per device:
   :meth:`trjax.aot.CompiledStep.memory`), ``cost_analysis()`` (bytes accessed)
   and the collectives per mesh axis (:func:`trjax.comm.by_axis`);
4. predicts the step time (:func:`trjax.cost.predict` on a
   :class:`trjax.hardware.Hardware`) and ranks: the fastest candidate that fits.

Every candidate is exact against its data-parallel oracle (the suite tests each
layout), so the choice changes time and memory, never the values beyond one
step's rounding. ``config.mesh="auto"`` runs the winner (:func:`resolve_auto`).
Sources of the idea: MaxText's ``estimator.py`` (remat x batch by trial compiles),
Alpa / XLA auto-sharding (a cost model over compiled candidates).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time

import jax
import numpy as np

from trjax import aot, comm, cost, hardware
from trjax.world import MESH_AXES

SCHEDULES = ("gpipe", "1f1b", "zb-h1")


@dataclasses.dataclass
class Candidate:
    """One configuration the planner considered.

    Attributes:
      name: e.g. ``"data:2,stage:4 schedule:zb-h1 remat:blocks"``.
      overrides: the config keys it sets (``mesh``, ``pipeline_schedule``, ``remat``).
      status: ``"compiled"``, ``"pruned: ..."`` or ``"invalid: ..."`` (why).
      fits: peak per device <= budget (``None`` when not known).
      peak_bytes: XLA's peak per device of the compiled train step (``None`` if not compiled).
      state_bytes: the train state's bytes per device (exact, from its shardings).
      memory: :meth:`trjax.aot.CompiledStep.memory`.
      flops: :func:`trjax.cost.jaxpr_flops`.
      predicted: :func:`trjax.cost.predict` (``step_s`` and its parts).
      compile_s: seconds to compile (or load) the train step.
    """
    name: str
    overrides: dict
    status: str = "new"
    fits: bool | None = None
    peak_bytes: int | None = None
    state_bytes: int | None = None
    memory: dict = dataclasses.field(default_factory=dict)
    flops: dict = dataclasses.field(default_factory=dict)
    predicted: dict = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0

    @property
    def step_s(self) -> float | None:
        return self.predicted.get("step_s")

    def to_json(self, global_batch: int) -> dict:
        out = dataclasses.asdict(self)
        out["config"] = out.pop("overrides")
        out["predicted_step_s"] = self.step_s
        out["images_per_s"] = global_batch / self.step_s if self.step_s else None
        return out


def factorizations(n: int, axes=MESH_AXES) -> list[dict]:
    """Every ``{axis: size}`` over ``axes`` (``data`` always) whose sizes multiply to
    ``n``; axes of size 1 left out (``data`` kept), in order of fewer split axes."""
    out = []
    for sizes in itertools.product(*[[d for d in range(1, n + 1) if n % d == 0]] * len(axes)):
        if math.prod(sizes) == n:
            m = {a: s for a, s in zip(axes, sizes) if s > 1 or a == "data"}
            out.append(m)
    return sorted(out, key=lambda m: (len(m), -m.get("data", 1)))


def mesh_string(sizes: dict) -> str:
    """``{"data": 8}`` -> ``""`` (the default 1-D mesh); else ``"data:2,stage:4"``."""
    if set(sizes) == {"data"}:
        return ""
    return ",".join(f"{a}:{sizes[a]}" for a in MESH_AXES if a in sizes)


def candidates(world_size: int, axes=MESH_AXES, remat=("none", "blocks"),
               schedules=SCHEDULES) -> list[Candidate]:
    """The candidates for ``world_size`` devices over ``axes``: each mesh, on a
    ``stage`` axis each of ``schedules``, each of ``remat`` (config values)."""
    out = []
    for sizes in factorizations(world_size, tuple(a for a in MESH_AXES if a in axes)):
        mesh = mesh_string(sizes)
        label = mesh or f"data:{world_size}"
        for sched in (schedules if sizes.get("stage", 1) > 1 else (None,)):
            for r in remat:
                over = {"mesh": mesh, "remat": r}
                name = label
                if sched is not None:
                    over["pipeline_schedule"] = sched
                    name += f" schedule:{sched}"
                if r != "none":
                    name += f" remat:{r}"
                out.append(Candidate(name, over))
    return out


def with_overrides(config, overrides: dict):
    """A copy of ``config`` with ``overrides`` set."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        for k, v in overrides.items():
            c[k] = v
    return c


def _state_bytes(abstract) -> int:
    total = 0
    for x in jax.tree_util.tree_leaves(abstract):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return int(total)


def _evaluate(cand: Candidate, tr, hw, budget: int, best_s: float | None) -> None:
    """Traces, bounds and (unless pruned) compiles ``cand``'s train step on the
    prepared trainer ``tr``; fills ``cand`` in place."""
    from trjax.precision import INITIAL_LOSS_SCALE
    from trjax.state import train_state_program
    from trjax.train.trainer import example_batch, make_train_step
    c = tr.config
    init = train_state_program(c.seed, tr.layout, tr.exchange,
                               loss_scale=INITIAL_LOSS_SCALE if c.precision == "fp16" else 1.0)
    batch = example_batch(tr, tr.world.global_batch_size)
    cand.state_bytes = _state_bytes(init.abstract)
    if cand.state_bytes > budget:
        cand.status, cand.fits = "pruned: the train state alone exceeds the budget", False
        return
    fn = make_train_step(tr)
    traced = jax.jit(fn, donate_argnums=0).trace(*aot.abstract((init.abstract, batch)))
    cand.flops = cost.jaxpr_flops(traced.jaxpr, tr.world.world_size)
    bound = cand.flops["flops"] / hw.flops(c.precision)
    if best_s is not None and bound >= best_s:
        cand.status = f"pruned: compute alone {bound:.4g} s >= the best fitting {best_s:.4g} s"
        cand.predicted = {"lower_bound_s": bound}
        return
    step = aot.compile_step("train_step", fn, init.abstract, batch, donate_argnums=0,
                            traced=traced, options=tr.layout.compile_options)
    cand.compile_s = step.compile_s
    cand.memory = step.memory()
    cand.peak_bytes = cand.memory.get("peak")
    cand.fits = cand.peak_bytes is None or cand.peak_bytes <= budget
    per_axis = comm.by_axis(comm.collectives_in_hlo(step.hlo_text()) or [], tr.world.mesh)
    accessed = step.cost().get("bytes accessed", 0.0) * cand.flops["loop_factor"]
    cand.predicted = cost.predict(hw, c.precision, cand.flops["flops"], accessed, per_axis,
                                  tr.world.axes)
    cand.status = "compiled"


@dataclasses.dataclass
class Plan:
    """What :func:`plan` found: every candidate (compiled, pruned or invalid),
    the chosen one and the inputs."""
    candidates: list
    chosen: Candidate
    budget: int
    hardware: hardware.Hardware
    global_batch: int
    seconds: float

    def to_json(self) -> dict:
        return {"chosen": self.chosen.name, "chosen_config": self.chosen.overrides,
                "why": why(self), "memory_per_device": self.budget,
                "hardware": self.hardware.to_json(), "global_batch": self.global_batch,
                "seconds": self.seconds,
                "candidates": [c.to_json(self.global_batch) for c in self.candidates]}


def choose(cands, budget: int) -> Candidate:
    """The candidate with the smallest predicted step among those whose peak per
    device fits ``budget`` bytes (ties: the smaller peak).

    Raises:
      ValueError: nothing fits, naming the smallest peak found and its candidate;
        no candidate can be built (e.g. a global batch no batch axis divides),
        naming the builders' reasons.
    """
    compiled = [c for c in cands if c.status == "compiled"]
    fitting = [c for c in compiled if c.peak_bytes is None or c.peak_bytes <= budget]
    if fitting:
        return min(fitting, key=lambda c: (c.step_s, c.peak_bytes or 0))
    if cands and all(c.status.startswith("invalid") for c in cands):
        reasons = sorted({c.status[len("invalid: "):] for c in cands})
        raise ValueError(f"no candidate can be built on these devices: {reasons[:3]}")
    if not compiled:
        state = min((c for c in cands if c.state_bytes), key=lambda c: c.state_bytes,
                    default=None)
        hint = (f"; the smallest train state is {state.state_bytes / 2 ** 20:.1f} MiB per "
                f"device ({state.name})" if state else "")
        raise ValueError(f"no candidate fits memory_per_device={budget / 2 ** 20:.1f} MiB"
                         f"{hint}: raise the budget, use more devices or a smaller batch")
    small = min(compiled, key=lambda c: c.peak_bytes)
    raise ValueError(f"no candidate fits memory_per_device={budget / 2 ** 20:.1f} MiB: the "
                     f"smallest peak is {small.peak_bytes / 2 ** 20:.1f} MiB per device "
                     f"({small.name}); raise the budget, use more devices or a smaller batch")


def why(p: Plan) -> str:
    """One line: why the chosen candidate won (the faster ones that do not fit, the
    next fitting one)."""
    c = p.chosen
    others = sorted((x for x in p.candidates if x.status == "compiled" and x is not c),
                    key=lambda x: x.step_s)
    faster = [x for x in others if x.step_s < c.step_s]
    fitting = [x for x in others if x.fits]
    text = (f"{c.name}: predicted {c.step_s * 1e3:.2f} ms/step, peak "
            f"{c.peak_bytes / 2 ** 20:.1f} MiB <= budget {p.budget / 2 ** 20:.1f} MiB")
    if faster:
        text += (f"; {len(faster)} faster candidate(s) do not fit (fastest: {faster[0].name}, "
                 f"peak {faster[0].peak_bytes / 2 ** 20:.1f} MiB)")
    if fitting:
        text += f"; next that fits: {fitting[0].name} at {fitting[0].step_s * 1e3:.2f} ms/step"
    return text


def plan(config, data=None, model=None, tx=None, loss_fn=None, transform=None, *,
         memory_per_device, hardware_spec: str = "", axes=None, remat=None,
         max_candidates: int = 64, patience: int = 8, exhaustive: bool = False,
         say=print) -> Plan:
    """Enumerates, prunes, compiles and ranks the candidates for ``config`` on its
    devices (``config.devices``); see the module docstring.

    Args:
      config: the run's config (its ``mesh`` and the keys the candidates set are
        replaced; every other key is kept).
      data, model, tx, loss_fn, transform: as :func:`trjax.train.trainer.prepare`.
      memory_per_device: the budget, bytes (int) or a string with a unit ("24GiB").
      hardware_spec: :func:`trjax.hardware.resolve` (``""``: the devices' own).
      axes: the mesh axes candidates may use (``data`` always; ``None``: every axis
        the model can be split on). An axis given here that the model cannot be
        split on is an error.
      remat: the ``config.remat`` values to try (``None``: ``"none"`` and the
        config's own, ``"blocks"`` when it is ``"none"``). A remat candidate is
        compiled only when the same candidate without remat does not fit: remat
        recomputes, it is never faster.
      max_candidates: compile at most this many.
      patience: stop compiling after this many compiled candidates in a row that
        did not beat the best fitting one (the order tries likely winners first).
      exhaustive: compile every candidate that fits by its state (no time,
        dominance or patience bound).
      say: where progress lines go.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: a budget without a unit, an axis not in ``MESH_AXES``, an axis
        on which no candidate can be built (naming the axis, the builder's reason
        and the axes it can use), or no candidate fits (:func:`choose`).
    """
    from trjax.train.trainer import prepare
    t0 = time.perf_counter()
    budget = memory_per_device if isinstance(memory_per_device, int) else \
        hardware.parse_bytes(memory_per_device)
    strict, axes = axes is not None, tuple(axes or MESH_AXES)
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
        raise ValueError(f"axes {bad} are not mesh axes; choose from {list(MESH_AXES)}")
    devices = _devices(config)
    n, hw = len(devices), hardware.resolve(hardware_spec, devices)
    remat = remat or ("none", config.remat if config.remat != "none" else "blocks")
    cands = candidates(n, axes, remat=remat)
    say(f"trjax-plan: {len(cands)} candidates on {n} devices; budget "
        f"{budget / 2 ** 20:.1f} MiB per device; hardware {hw.name}")
    best, compiled, by_name, per_row = None, 0, {c.name: c for c in cands}, None
    since_best = 0
    for cand in sorted(cands, key=lambda c: _work(c, config.global_batch_size)):
        twin = by_name.get(cand.name.replace(f" remat:{cand.overrides['remat']}", ""))
        if not exhaustive and cand.overrides["remat"] != "none" and twin is not None \
                and twin.fits:
            cand.status = f"pruned: {twin.name} fits without remat (remat only recomputes)"
            continue
        if compiled >= max_candidates and not strict:  # no compile left: no prepare
            cand.status = f"pruned: max_candidates={max_candidates} compiled already"
            continue
        try:  # the builder's own checks: a reason, not a crash
            tr = prepare(with_overrides(config, cand.overrides), data, model, tx, loss_fn,
                         transform)
        except ValueError as e:
            cand.status = f"invalid: {str(e).splitlines()[0]}"
            continue
        if compiled >= max_candidates:
            cand.status = f"pruned: max_candidates={max_candidates} compiled already"
            continue
        if not exhaustive and best is not None and since_best >= patience:
            cand.status = f"pruned: patience={patience} compiled since the best"
            continue
        bound = _compute_bound(tr, per_row) / hw.flops(config.precision) if per_row else 0.0
        if not exhaustive and best is not None and bound >= best.step_s:
            cand.status = (f"pruned: compute alone >= {bound:.4g} s, the best fitting "
                           f"{best.step_s:.4g} s")
            cand.predicted = {"lower_bound_s": bound}
            continue
        _evaluate(cand, tr, hw, budget, None if exhaustive or best is None else best.step_s)
        if per_row is None and cand.flops and set(dict(tr.world.axes)) == {"data"}:
            per_row = cand.flops["flops"] / tr.world.local_batch_size  # the model's FLOPs a row
        if cand.status == "compiled":
            compiled += 1
            say(f"  {cand.name}: peak {cand.peak_bytes / 2 ** 20:.1f} MiB, predicted "
                f"{cand.step_s * 1e3:.2f} ms/step (compiled in {cand.compile_s:.1f} s)")
            since_best += 1
            if cand.fits and (best is None or cand.step_s < best.step_s):
                best, since_best = cand, 0
    if strict:
        _check_axes(cands, axes)
    chosen = choose(cands, budget)
    return Plan(cands, chosen, budget, hw, config.global_batch_size, time.perf_counter() - t0)


def _devices(config):
    from trjax.world import parse_device_spec
    pool = jax.devices()
    return [pool[i] for i in parse_device_spec(config.devices, len(pool))]


def oracle_overrides(tr) -> dict:
    """The data-parallel run that does the same arithmetic as the prepared candidate
    ``tr``: ``data`` only over its batch ranks (``data x fsdp``: the first devices of
    the same spec), a pipeline's micro-batches as gradient accumulation, no remat."""
    sizes = dict(tr.world.axes)
    ranks = sizes.get("data", 1) * sizes.get("fsdp", 1)
    out = {"mesh": "", "remat": "none", "devices": str(ranks)}
    if sizes.get("stage", 1) > 1:
        out["grad_accumulation_steps"] = tr.layout.details["pipeline_microbatches"]
    return out


def verify(config, overrides: dict, data=None, model=None, tx=None, loss_fn=None,
           transform=None) -> dict:
    """One train step of the candidate ``overrides`` against its data-parallel
    oracle (:func:`oracle_overrides`) from the same initial state (rank 0's
    parameters do not depend on the layout) on the first training batch, both
    with ``warmup_epochs=0`` (a warm-up starts at a learning rate of 0).

    Every parameter must land within the one-step reordered-sum bound (Higham,
    Accuracy and Stability of Numerical Algorithms, 4.2; u = 2^-24, n = the
    global batch): ``|a - b| <= 2 (n-1) u max|b - start| + 2 u max|b|``, the
    bound ``tests/helpers.py`` derives; a leaf the oracle does not move (a bias
    before BatchNorm, up to rounding) must stay within 1e-6 of the start. The
    bound is for elementwise optimizers (SGD, AdamW); a normed update (LARS,
    clipping) may exceed it by its gradient's peak-to-norm ratio.

    Returns:
      ``{"ok", "worst_ratio" (the largest |a - b| / bound), "worst_leaf", "oracle"}``.

    Raises:
      RuntimeError: the two runs start from different parameters, or the oracle's
        step moved nothing (nothing would be verified).
    """
    from trjax.data import input_pipeline
    from trjax.train.trainer import prepare, setup
    runs = []  # warmup_epochs=0: a warm-up from lr 0 would not move the first step
    cand = with_overrides(config, {**overrides, "warmup_epochs": 0})
    for c in (cand, with_overrides(cand, oracle_overrides(prepare(cand, data, model, tx,
                                                                    loss_fn, transform)))):
        tr = setup(c, data, model=model, tx=tx, loss_fn=loss_fn, transform=transform)
        g = c.global_batch_size
        batch = next(iter(input_pipeline.iterate_batches(  # the first batch, unshuffled
            tr.data.train, g, shuffle=False, rows=tr.world.process_rows(g),
            image_shape=tr.data.image_shape, workers=0)))
        start = jax.device_get(tr.state.params)
        state, _ = tr.train_step(tr.state, input_pipeline.to_device(
            batch, tr.world.sharded(), tr.data.num_classes, tr.dtype))
        runs.append((start, jax.device_get(state.params), c))
    (s0, a, _), (s1, b, oracle) = runs
    u, n, worst, where = 2.0 ** -24, config.global_batch_size, 0.0, ""
    for (path, y), x, x0, y0 in zip(jax.tree_util.tree_flatten_with_path(b)[0],
                                    jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(s0),
                                    jax.tree_util.tree_leaves(s1)):
        x, y, x0, y0 = (np.asarray(v, np.float64) for v in (x, y, x0, y0))
        if not np.array_equal(x0, y0):
            raise RuntimeError(f"{jax.tree_util.keystr(path)}: the candidate and its oracle "
                               "start from different parameters")
        if np.abs(y - y0).max() < 1e-6:  # still: both stay
            ratio = 0.0 if np.abs(x - x0).max() < 1e-6 else float("inf")
        else:
            lim = 2 * (n - 1) * u * np.abs(y - y0).max() + 2 * u * np.abs(y).max()
            ratio = float(np.abs(x - y).max() / lim)
        if ratio > worst:
            worst, where = ratio, jax.tree_util.keystr(path)
    if not where and all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(b),
                                                              jax.tree_util.tree_leaves(s1))):
        raise RuntimeError("the oracle's step moved no parameter (a learning rate of 0?): "
                           "nothing was verified")
    return {"ok": worst <= 1.0, "worst_ratio": worst, "worst_leaf": where,
            "oracle": {k: oracle[k] for k in ("mesh", "devices", "grad_accumulation_steps",
                                              "remat")}}


def _compute_bound(tr, per_row: float) -> float:
    """A lower bound on a prepared candidate's FLOPs per device, before tracing it:
    the data-parallel FLOPs of a row (``per_row``, counted on a ``data``-only
    candidate's step) times its rows per batch rank, split evenly over ``stage x
    model`` (a device's share is at least the mean: replicated layers and the
    largest stage only add), times a pipeline's ticks per micro-batch (M+S-1)/M and,
    when it recomputes each stage in the backward, 4/3 (a backward costs at most
    twice its forward, so the forward is at least a third of the row's FLOPs)."""
    sizes = dict(tr.world.axes)
    S, T = sizes.get("stage", 1), sizes.get("model", 1)
    rows = tr.world.global_batch_size / (sizes.get("data", 1) * sizes.get("fsdp", 1))
    M = tr.layout.details.get("pipeline_microbatches", 1) if S > 1 else 1
    recompute = 4 / 3 if S > 1 and (tr.config.pipeline_remat or
                                    tr.config.pipeline_schedule != "gpipe") else 1.0
    return per_row * rows / (S * T) * (M + S - 1) / M * recompute


def _work(cand: Candidate, global_batch: int) -> float:
    """A cheap estimate of a candidate's compute per device, to try the likely
    winners first: rows per batch rank / model / stages, x (M+S-1)/M for a
    pipeline's bubble at M = 4S, x 1.3 with remat."""
    sizes = {a: int(s) for a, s in (x.split(":") for x in cand.name.split()[0].split(","))}
    S = sizes.get("stage", 1)
    work = global_batch / (sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("model", 1) * S)
    work *= (5 * S - 1) / (4 * S)
    return work * (1.3 if cand.overrides.get("remat", "none") != "none" else 1.0)


def _check_axes(cands, axes) -> None:
    """An axis asked for on which no candidate could be built is an error."""
    ok = {a for c in cands if not c.status.startswith("invalid")
          for a in MESH_AXES if f"{a}:" in c.overrides["mesh"]} | {"data"}
    for a in axes:
        if a not in ok:
            reason = next((c.status for c in cands if f"{a}:" in c.overrides["mesh"]), "")
            raise ValueError(f"the planner cannot split this model on axis {a!r} ({reason}); "
                             f"it can use {sorted(ok, key=MESH_AXES.index)}")


def table(p: Plan) -> str:
    """The ranked candidates as a markdown table: fitting ones by predicted step,
    then the others by peak, then the pruned and invalid ones."""
    mib = lambda b: "" if b is None else f"{b / 2 ** 20:.1f}"  # noqa: E731
    ms = lambda s: "" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
    compiled = [c for c in p.candidates if c.status == "compiled"]
    ranked = sorted((c for c in compiled if c.fits), key=lambda c: c.step_s) + \
        sorted((c for c in compiled if not c.fits), key=lambda c: c.peak_bytes)
    rest = [c for c in p.candidates if c.status != "compiled"]
    lines = [f"budget {mib(p.budget)} MiB per device, hardware {p.hardware.name}, global "
             f"batch {p.global_batch}; chosen: {why(p)}", "",
             "| candidate | fits | peak MiB/dev | state MiB/dev | predicted ms/step | "
             "compute | memory | comm by axis (ms) | images/s | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in ranked + rest:
        pr = c.predicted
        axes = ", ".join(f"{a} {s * 1e3:.2f}" for a, s in pr.get("comm_s", {}).items())
        ips = f"{p.global_batch / c.step_s:.1f}" if c.step_s else ""
        mark = " **chosen**" if c is p.chosen else ""
        lines.append(f"| {c.name}{mark} | {'' if c.fits is None else ('yes' if c.fits else 'no')}"
                     f" | {mib(c.peak_bytes)} | {mib(c.state_bytes)} | {ms(c.step_s)} | "
                     f"{ms(pr.get('compute_s'))} | {ms(pr.get('memory_s'))} | {axes} | {ips} | "
                     f"{c.status} |")
    return "\n".join(lines) + "\n"


def write(p: Plan, out: str) -> str:
    """Writes ``out/plan.json`` (:meth:`Plan.to_json`) and ``out/plan.md``
    (:func:`table`); returns the JSON's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "plan.json")
    with open(path + ".tmp", "w") as f:
        json.dump(p.to_json(), f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out, "plan.md"), "w") as f:
        f.write(table(p))
    return path


def budget_of(config, devices) -> int:
    """``config.memory_per_device`` in bytes, else the device's own memory limit
    (``memory_stats()["bytes_limit"]`` on a GPU).

    Raises:
      ValueError: no budget on a device that does not report its memory (a CPU),
        or a budget without a unit.
    """
    if str(config.memory_per_device).strip():
        return hardware.parse_bytes(config.memory_per_device)
    stats = getattr(devices[0], "memory_stats", lambda: None)() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    raise ValueError("config.mesh='auto' needs config.memory_per_device (e.g. '24GiB') on "
                     f"{devices[0].platform} devices, which do not report their memory")


def resolve_auto(config, data=None, model=None, tx=None, loss_fn=None, transform=None,
                 say=print):
    """``(config, record)``: for ``config.mesh == "auto"`` the config of
    :func:`plan`'s winner (its ``mesh``, ``pipeline_schedule``, ``remat`` set) and
    ``record`` (:meth:`Plan.to_json`, what ``summary.json`` keeps as ``"plan"``);
    else ``(config, None)``. The budget is :func:`budget_of`, the hardware
    ``config.plan_hardware``, the axes ``config.plan_axes`` ("": all).

    Raises:
      ValueError: as :func:`plan` and :func:`budget_of`.
    """
    if str(config.mesh).strip() != "auto":
        return config, None
    axes = [a.strip() for a in str(config.plan_axes).split(",") if a.strip()] or None
    p = plan(config, data, model, tx, loss_fn, transform,
             memory_per_device=budget_of(config, _devices(config)),
             hardware_spec=config.plan_hardware, axes=axes, say=say)
    say(f"mesh=auto chose {why(p)}")
    return with_overrides(config, p.chosen.overrides), p.to_json()

