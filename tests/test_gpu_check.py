"""scripts/gpu_check.py: its CPU dry run (the GPU code path, tiny sizes) writes one
JSON whose figures are checked here against what they must be, and a part that
fails (no GPU without --dry-run) is recorded and makes the exit status 1."""
import json
import math
import os
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.job

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # conftest's forced device count: the parts set their own
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_dry_run_writes_every_figure(script_dry_runs):
    tmp_path, out = script_dry_runs["gpu_check"]  # conftest: one dry run for the session
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all parts passed" in out.stdout
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["ok"] and r["dry_run"] and list(r["parts"]) == [
        "devices", "prediction", "main_job", "comm_report", "benchmark", "xla_flags", "input",
        "syncbn", "model_parallel", "plan"]
    p = r["parts"]
    assert all(x["ok"] for x in p.values())

    d = p["devices"]
    assert (d["platform"], d["device_count"], d["jax"]) == ("cpu", 2, jax.__version__)
    assert d["devices"] == ["cpu:0", "cpu:1"] or len(d["devices"]) == 2

    m = p["main_job"]
    on_disk = json.loads((tmp_path / "main_job" / "summary.json").read_text())
    steps = 2 * math.ceil(1437 / 32)  # 2 epochs of the 1,437 training digits at batch 32
    assert (m["epochs"], m["steps"], m["world_size"], m["model"]) == (2, steps, 2, "resnet8")
    assert m["steps"] == on_disk["steps"] and m["val_top1"] == on_disk["val_top1"] >= 0.3
    assert m["compiles_during_training"] == 0 and m["train_images_per_s"] > 0

    c = p["comm_report"]
    full = json.loads((tmp_path / "comm_report.json").read_text())
    assert c["world_size"] == 2 and c["gradient_all_reduces"] == 2
    assert c["deep_before_first_conv_wgrad"] is True and c["async_collectives"] == 0
    grads = [x for x in c["train_step_collectives"] if x["carries"][0].startswith("bucket:")]
    assert [x["elements"] for x in grads] == [c["bucket_elements"]["deep"],
                                              c["bucket_elements"]["first"]]  # deep first
    assert grads[0]["position"] < min(c["first_conv_wgrad_positions"])
    assert c["bucket_elements"] == {b: v["elements"] for b, v in full["buckets"].items()}

    b = p["benchmark"]
    assert (b["precision"], b["model"], b["world_size"]) == ("bf16", "resnet8", 2)
    assert b["trjax_images_per_s"] > 0 and 0 < b["trjax_mfu"] < 1
    assert (tmp_path / "benchmark" / "benchmark.json").is_file()
    if b["torch_images_per_s"] is None:
        assert "torch is not importable" in b["torch_skipped"]
    else:
        assert b["trjax_over_torch"] == b["trjax_images_per_s"] / b["torch_images_per_s"]

    pr = p["prediction"]  # on the CPU, from the compiled steps (test_predict: the arithmetic)
    for step, model, batch in ((pr["benchmark_step"], "resnet8", 4),
                               (pr["main_job_step"], "resnet8", 32)):
        assert (step["model"], step["batch"], step["precision"]) == (model, batch, "bf16")
        assert step["flops"] > 0 and step["bytes_accessed"] > 0
        assert step["predicted_step_s"] == max(step["compute_s"], step["memory_s"]) > 0
    assert pr["main_job_step"]["image"] == [8, 8, 1]
    vs = r["predicted_vs_measured"]
    assert vs["measured_step_s"] == p["xla_flags"]["variants"]["default"]["median_step_s"]
    assert vs["measured_over_predicted"] == vs["measured_step_s"] / vs["predicted_step_s"]

    x = p["xla_flags"]  # every variant ran in its own process, with its own flags
    assert list(x["variants"]) == ["default", "latency-hiding scheduler", "command buffers off",
                                   "autotune level 0"]
    for name, v in x["variants"].items():
        assert v["images_per_s"] > 0 and v["compile_s"] > 0 and v["memory"]["temp"] >= 0, name
        assert (v["flags"] == "") == (name == "default")
    assert x["winner"]["name"] in x["variants"]
    xa = json.loads((tmp_path / "xla_ab" / "xla_ab.json").read_text())
    assert xa["meta"]["global_batch"] == 4 and xa["meta"]["precision"] == "bf16"
    assert p["input"].get("skipped") or p["input"]["images_per_s_per_core"] > 0

    s = p["syncbn"]
    assert s["world_size"] == 2 and s["params_moved_max_abs"] > 0
    assert s["update_max_rel"] <= 1e-3 and s["batch_stats_max_rel"] <= 1e-5
    assert s["params_max_rel"] <= 1e-5
    assert s["loss_rel"] <= 1e-5 and abs(s["loss"] - math.log(10)) < 1.0  # 10 classes, random

    mp = p["model_parallel"]
    assert (mp["stage"]["mesh"], mp["model"]["mesh"]) == ("data:1,stage:2", "data:1,model:2")
    for kind in ("stage", "model"):  # each path ran, learnt, and used its axis
        r = mp[kind]
        assert r["steps"] == steps and r["train_loss_by_epoch"][-1] < r["train_loss_by_epoch"][0]
        assert kind in r["collectives_by_axis"], r["collectives_by_axis"]

    pl = p["plan"]  # the planner on the 2 CPU devices, its winner's step timed
    assert pl["hardware"] == "cpu" and pl["compiled"] >= 1 and pl["peak_bytes"] <= 2 ** 30
    assert pl["chosen"].split()[0] in ("data:2", "data:1,fsdp:2", "data:1,stage:2",
                                       "data:1,model:2")
    assert pl["measured_over_predicted"] == pl["measured_step_s"] / pl["predicted_step_s"] > 0


def test_the_docs_list_every_part_in_order():
    """docs/gpu.md and the script's docstring name each part of PARTS, numbered, in order
    (issue 40: the docs had listed five parts of nine)."""
    import importlib.util
    import re
    spec = importlib.util.spec_from_file_location("gpu_check_doc", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = [n for n, _ in mod.PARTS]
    assert list(mod.PART_FUNCTIONS) == names
    doc = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    section = doc.split("## `scripts/gpu_check.py`")[1].split("How to read the output")[0]
    listed = re.findall(r"^(\d+)\. `(\w+)`", section, re.M)
    assert listed == [(str(i), n) for i, n in enumerate(names, 1)]
    assert f"{['Zero', 'One', 'Two', 'Three', 'Four', 'Five', 'Six', 'Seven', 'Eight', 'Nine', 'Ten'][len(names)]} parts" in section
    assert re.findall(r"^(\d+)\. ``(\w+)``", mod.__doc__, re.M) == listed


def test_without_a_gpu_the_check_fails_and_says_why(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--parts", "devices"],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert out.returncode == 1 and "devices: FAILED" in out.stdout
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not r["ok"] and r["parts"]["devices"]["platform"] == "cpu"
    assert "no GPU visible to jax" in r["parts"]["devices"]["error"]
