"""scripts/benchmark.py end to end, tiny: the GPU code path on CPU (--gpu --dry_run, as
scripts/gpu_check.py's dry run runs it) and a tiny CPU run (two world sizes, two steps).
conftest runs both as subprocesses, side by side, once per session; each must write the
JSON, the markdown table and the PNG plot."""
import importlib.util
import json

import pytest

from trjax.cpu.host import available_cores

pytestmark = pytest.mark.job

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _check_outputs(out, expect_variants, world, worlds=None):
    for name in ("benchmark.json", "benchmark.md", "benchmark.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads((out / "benchmark.json").read_text())
    rows = {x["variant"]: x for x in r["results"] if x["world_size"] == world}
    assert set(rows) == set(expect_variants)
    assert sorted({x["world_size"] for x in r["results"]}) == (worlds or [world])
    for row in r["results"]:
        assert row["images_per_s"] > 0 and row["median_step_s"] > 0
        assert row["steps_timed"] == 2
    two = rows["trjax/two"]["info"]
    assert two["compile_s"] > 0 and two["flops_per_step"] > 0
    assert two["comm"]["ring_model_per_rank_bytes"] > 0  # world 2: traffic is not zero
    md = (out / "benchmark.md").read_text()
    assert "| world | variant |" in md and " images/s |" in md
    return r


def test_gpu_dry_run(script_dry_runs):
    """The ``--gpu --dry_run`` benchmark that gpu_check's dry run ran (its ``benchmark``
    part: resnet8, 2 CPU devices; conftest runs it once for the session)."""
    out, proc = script_dry_runs["gpu_check"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gpu_out = out / "benchmark"
    r = _check_outputs(gpu_out, ["trjax/two"] + (["torch/ddp"] if HAVE_TORCH else []), world=2)
    assert r["meta"]["mode"] == "gpu-dry-run" and r["meta"]["precision"] == "bf16"
    assert r["meta"]["image"] == [32, 32, 3] and r["meta"]["steps_per_round"] == 2
    assert all(x["mfu"] is not None and 0 < x["mfu"] < 1 for x in r["results"])
    if HAVE_TORCH:
        assert "trjax / torch DDP at world 2" in r["ratios"]
        assert "MFU" in (gpu_out / "benchmark.md").read_text()
    else:
        assert "torch is not importable" in r["meta"]["torch_skipped"]


def test_tiny_cpu_mode(script_dry_runs):
    """Two world sizes: one child process each, with exactly N simulated devices; with
    the compile without donation (memory statistics donated and not). Run by conftest,
    side by side with gpu_check's dry run."""
    cpu_out, cpu = script_dry_runs["cpu_tiny"]
    assert cpu.returncode == 0, cpu.stdout[-3000:] + cpu.stderr[-3000:]
    info = json.loads((cpu_out / "benchmark.json").read_text())["results"][0]["info"]
    assert info["memory_not_donated"]["peak"] > info["memory_donated"]["peak"]
    assert info["not_donated_flops_match"] and info["flops_per_device"] > 0
    assert abs(info["flops_per_device_not_donated"] / info["flops_per_device"] - 1) <= 1e-6

    r = _check_outputs(cpu_out, ["trjax/two", "trjax/per_leaf"], world=2, worlds=[1, 2])
    assert r["meta"]["mode"] == "cpu"
    for row in r["results"]:  # each world size ran on its own N devices, Eigen convolutions
        assert row["simulated_devices"] == row["world_size"]
        assert row["cpu_convolutions"] == ("eigen" if row["world_size"] <= available_cores()
                                           else "ynnpack")
        assert row["reuse_host_memory"] is (row["cpu_convolutions"] == "ynnpack")
    assert (cpu_out / "world1" / "benchmark.json").is_file()
    assert "| 1 | trjax/two | 1 / " in (cpu_out / "benchmark.md").read_text()
    assert "two-bucket / per-leaf at world 2" in r["ratios"]
    assert "two-bucket / per-leaf at world 2" in cpu.stdout


def test_time_to_accuracy_tiny(tiny_time_to_accuracy):
    """--time_to_accuracy with a tiny job (ResNet-8, 1 epoch, 2 devices): every run's
    figures in the JSON agree with its own summary.json, the warm run loads every
    program the cold run compiled, and the ratios are the medians' quotients. (The run is
    the session's, shared with test_compilation, which checks the same two processes'
    compile counts.)"""
    out, proc, variants = tiny_time_to_accuracy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "time_to_accuracy.json").read_text())
    runs = {x["variant"]: x for x in r["runs"]}
    assert [x["variant"] for x in r["runs"]] == variants.split(",")
    for v, x in runs.items():
        s = json.loads((out / "tta_runs" / f"r1_{v}" / "summary.json").read_text())
        assert x["val_top1"] == s["val_top1"] and 0.0 <= x["val_top1"] <= 1.0
        assert 0 < x["first_step_s"] < x["wall_s"]
        if v != "torch":
            assert s["epochs"] == 1 and s["world_size"] == 2 and s["model"] == "resnet8"
            assert x["compiles_during_training"] == 0 == s["compiles_during_training"]
            assert x["wall_s"] > s["wall_s"] > 0  # the process outlives train_and_evaluate
            assert x["profile"]["train_s"] > 0
            t = x["profile"]["seconds"]  # summary.json's measured parts, and the rest
            assert t["train"] == s["seconds"]["train"] > 0 and t["setup"] > 0
            assert sum(t.values()) == pytest.approx(s["wall_s"], abs=0.01)
    cold, warm = runs["cold"]["profile"], runs["warm"]["profile"]
    assert cold["startup_programs"]["compiled"] >= 1 and cold["compile_s_total"] > 0
    assert warm["startup_programs"]["compiled"] == 0 and warm["compile_s_total"] == 0.0
    assert warm["startup_programs"]["cache_hits"] == cold["startup_programs"]["built"]
    assert all(p["compiled"] == 0 and p["cache_hits"] == 1 for p in warm["step_programs"].values())
    md = (out / "time_to_accuracy.md").read_text()
    assert "| trjax, warm compilation cache | 1 |" in md
    assert f"| warm | 1 | {runs['warm']['profile']['before_train_and_evaluate_s']:.1f} |" in md
    if HAVE_TORCH:
        assert runs["torch"]["val_top1"] > 0.1  # one epoch of ResNet-8 learns something
        assert r["ratios"]["warm / torch wall"] == runs["warm"]["wall_s"] / runs["torch"]["wall_s"]
        assert "PyTorch DDP, gloo, 2 processes" in md
