"""The planner (trjax.train.planner): FLOPs counted by hand, the choice under a budget,
the compiled peak against a trainer's own, bad input before compiling, mesh="auto"."""
import json
import math

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config, tiny_digits
from trjax import cost, hardware
from trjax.train import planner


def _conv(w, x):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_flops_count_loops_recompute_and_the_largest_branch():
    w, x = jnp.ones((3, 3, 4, 8)), jnp.ones((2, 6, 6, 4))
    fwd = 2 * 2 * 6 * 6 * 8 * (3 * 3 * 4)  # 2 x output elements x (kernel taps x in-channels)
    loss = lambda w, x: jnp.sum(_conv(w, x) ** 2)  # noqa: E731
    count = lambda f, *a: cost.jaxpr_flops(jax.make_jaxpr(f)(*a), 1)  # noqa: E731
    assert count(loss, w, x)["flops"] == fwd
    assert count(jax.grad(loss, argnums=(0, 1)), w, x)["flops"] == 3 * fwd  # fwd, dx, dw
    assert count(jax.grad(jax.checkpoint(loss), argnums=(0, 1)), w, x)["flops"] == 4 * fwd

    def looped(w, x):  # 5 ticks of one conv whose output has x's shape
        w2 = jnp.ones((3, 3, 4, 4))
        return jax.lax.fori_loop(0, 5, lambda i, y: jnp.tanh(_conv(w2, y)), x).sum() + w.sum()
    c = count(looped, w, x)
    one = fwd // 2  # 4 output channels instead of 8
    assert (c["flops"], c["flops_once"], c["loop_factor"]) == (5 * one, one, 5.0)
    # XLA's own count sees the body once: what the loop factor corrects
    xla = jax.jit(looped).lower(w, x).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    assert xla["flops"] < 2 * one
    branches = lambda i, w, x: jax.lax.switch(i, [lambda: _conv(w, x).sum(),  # noqa: E731
                                                  lambda: x.sum()])
    assert count(branches, 0, w, x)["flops"] == fwd  # the largest branch
    # outside shard_map, global shapes count 1/world_size per device
    assert cost.jaxpr_flops(jax.make_jaxpr(loss)(w, x), 4)["flops"] == fwd / 4


def test_time_model_links_and_rank_correlation():
    hw = hardware.PROFILES["h100"]
    axes = (("data", 2), ("fsdp", 8))
    assert cost.axis_link("fsdp", axes, hw) is hw.intra_node  # groups of 8 inside a node
    assert cost.axis_link("data", axes, hw) is hw.inter_node  # spans 16 devices
    per_axis = {"fsdp": {"count": 4, "sent_bytes": 450e6}, None: {"count": 1, "sent_bytes": 1}}
    p = cost.predict(hw, "bf16", 989.4e12, 3.35e12 / 2, per_axis, axes)
    assert p["compute_s"] == pytest.approx(1.0) and p["memory_s"] == pytest.approx(0.5)
    assert p["roofline_s"] == pytest.approx(1.0)  # max: the roofline
    assert p["comm_s"] == {"fsdp": pytest.approx(4 * 10e-6 + 1e-3)}
    assert p["step_s"] == pytest.approx(1.0 + 4e-5 + 1e-3)
    assert cost.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert cost.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert cost.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)  # 1 - 6*4/120


def test_bad_input_is_named_before_compiling(tmp_path):
    assert hardware.parse_bytes("24GiB") == 24 * 2 ** 30
    assert hardware.parse_bytes("1.5 GB") == 1_500_000_000
    for bad in ("24", "24 parsecs", "-1GiB", "GiB"):
        with pytest.raises(ValueError, match="with a unit"):
            hardware.parse_bytes(bad)
    from trjax.train import config as config_lib
    with pytest.raises(ValueError, match="config.memory_per_device.*unit"):
        config_lib.validate(small_config(mesh="auto", memory_per_device="512"))
    with pytest.raises(ValueError, match="config.plan_axes='data,pipe'"):
        config_lib.validate(small_config(mesh="auto", plan_axes="data,pipe"))
    from trjax.world import make_world
    with pytest.raises(ValueError, match="mesh 'auto' is chosen by the planner"):
        make_world("all", 32, mesh="auto")
    with pytest.raises(ValueError, match="needs config.memory_per_device"):
        planner.budget_of(small_config(mesh="auto"), jax.devices())
    with pytest.raises(ValueError, match="neither a profile"):
        hardware.resolve("tpu9")
    (tmp_path / "hw.json").write_text(json.dumps({"name": "x", "flops": 1}))
    with pytest.raises(ValueError, match="unknown hardware fields \\['flops'\\]"):
        hardware.resolve(str(tmp_path / "hw.json"))
    cands = planner.candidates(8, ("data", "fsdp"), remat=("none",))
    assert [x.name for x in cands] == ["data:8", "data:4,fsdp:2", "data:2,fsdp:4",
                                       "data:1,fsdp:8"]
    assert len(planner.factorizations(8)) == 20  # 8 = 2^3 over 4 ordered axes: C(6, 3)

    class Net(nn.Module):  # a user's model: no tensor plan splits it on 'model'
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(10)(nn.relu(nn.Conv(8, (3, 3))(x)).mean(axis=(1, 2)))
    with pytest.raises(ValueError, match="the planner cannot split this model on axis 'model'"
                                         ".*it can use \\['data'\\]"):
        planner.plan(small_config(global_batch_size=16, eval_batch_size=16), tiny_digits(32),
                     Net(), memory_per_device="1GiB", hardware_spec="h100",
                     axes=("data", "model"), max_candidates=0, say=lambda *a: None)


def _cand(name, peak, step):
    return planner.Candidate(name, {"mesh": name}, status="compiled", peak_bytes=peak,
                             predicted={"step_s": step}, fits=True)


def test_choose_the_fastest_that_fits_or_name_the_smallest_peak():
    a, b, c = _cand("a", 300, 1.0), _cand("b", 200, 2.0), _cand("c", 100, 3.0)
    assert planner.choose([a, b, c], 300) is a
    assert planner.choose([a, b, c], 250) is b  # between two peaks: the one that fits
    assert planner.choose([a, b, c], 100) is c
    with pytest.raises(ValueError, match="smallest peak is .* per device \\(c\\)"):
        planner.choose([a, b, c], 99)
    bad = planner.Candidate("d", {}, status="invalid: config.global_batch_size 12 is not "
                                           "divisible by world_size 8")
    with pytest.raises(ValueError, match="no candidate can be built.*not divisible"):
        planner.choose([bad], 99)


def test_plan_compiles_ranks_and_matches_the_trainers_peak(tmp_path):
    """One plan on 4 devices over data and fsdp (3 meshes, 2 compiled), then mesh="auto"
    in the loop: the winner's peak and state bytes equal its trainer's own."""
    data = tiny_digits(64)
    c = small_config(devices="4", global_batch_size=32, eval_batch_size=32, num_epochs=1,
                     plan_hardware="h100", plan_axes="data,fsdp")  # the programs of auto's run
    p = planner.plan(c, data, memory_per_device="512MiB", hardware_spec="h100",
                     axes=("data", "fsdp"), remat=("none",), max_candidates=2,
                     say=lambda *a: None)
    compiled = [x for x in p.candidates if x.status == "compiled"]
    assert len(p.candidates) == 3 and len(compiled) == 2
    assert all(x.status.startswith("pruned") for x in p.candidates if x not in compiled)
    assert p.chosen is min(compiled, key=lambda x: x.step_s)
    # a budget between two candidates' peaks: the one under it
    big, small = sorted(compiled, key=lambda x: -x.peak_bytes)[:2]
    if big.peak_bytes > small.peak_bytes:
        mid = (big.peak_bytes + small.peak_bytes) // 2
        assert planner.choose(p.candidates, mid).peak_bytes <= mid
    with pytest.raises(ValueError, match="smallest peak"):
        planner.choose(p.candidates, min(x.peak_bytes for x in compiled) - 1)
    saved = json.load(open(planner.write(p, str(tmp_path))))
    assert saved["chosen"] == p.chosen.name
    row = next(r for r in saved["candidates"] if r["name"] == p.chosen.name)
    assert row["peak_bytes"] == p.chosen.peak_bytes and row["fits"]
    assert row["images_per_s"] == pytest.approx(32 / p.chosen.step_s)
    assert math.isfinite(row["predicted_step_s"]) and row["flops"]["flops"] > 0
    assert "**chosen**" in (tmp_path / "plan.md").read_text()
    # mesh="auto" with a budget that rules out data:4: the loop trains the winner, says why
    # and keeps the plan in summary.json
    from trjax.train import train_and_evaluate
    dp = next(x for x in compiled if x.name == "data:4")
    under = [x for x in compiled if x.peak_bytes < dp.peak_bytes]
    assert under, [(x.name, x.peak_bytes) for x in compiled]
    budget_kib = (dp.peak_bytes - 1) // 1024
    auto = planner.with_overrides(c, {"mesh": "auto", "memory_per_device": f"{budget_kib}KiB"})
    _, summary = train_and_evaluate(auto, str(tmp_path / "run"), data=data)
    chosen = summary["plan"]["chosen"]
    row = next(r for r in summary["plan"]["candidates"] if r["name"] == chosen)
    assert chosen != "data:4" and row["peak_bytes"] <= budget_kib * 1024
    assert summary["mesh"] == chosen.split()[0] and summary["steps"] == 2
    assert summary["memory_plan"]["memory"]["peak"] == row["peak_bytes"]  # the trainer's own
    states = {r["name"]: r["state_bytes"] for r in summary["plan"]["candidates"]}
    assert states["data:4"] > states["data:2,fsdp:2"] > states["data:1,fsdp:4"]
    status = {r["name"]: r["status"] for r in summary["plan"]["candidates"]}
    assert status["data:4 remat:blocks"] == "compiled"  # data:4 does not fit: remat is tried
    assert status[f"{chosen} remat:blocks"].startswith(f"pruned: {chosen} fits without remat")
    # --verify: one step of the winner against its data-parallel oracle, within the bound
    v = planner.verify(auto, row["config"], data)
    assert v["ok"] and v["worst_ratio"] <= 1, v  # fsdp:4 against data:4: bitwise here
    assert v["oracle"] == {"mesh": "", "devices": "4", "grad_accumulation_steps": 1,
                           "remat": "none"}
    assert json.load(open(tmp_path / "run" / "config.json"))["mesh"] == chosen.split()[0]
