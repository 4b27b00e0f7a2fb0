"""The users' side: the notebook, a CIFAR-format run, the plot script, config errors, quiet mode."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import tensorboard_scalars

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PY = sys.executable


def _tensorboard_scalars(folder) -> dict:
    """``{(tag, step): float32 value}``; a (tag, step) logged twice is an error."""
    out = {}
    for tag, step, value in tensorboard_scalars(folder):
        assert (tag, step) not in out, (tag, step)
        out[tag, step] = np.float32(value)
    return out


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


@pytest.mark.job
def test_notebook_code_cells_run(tmp_path):
    nb = json.load(open(os.path.join(ROOT, "notebooks", "quickstart.ipynb")))
    code = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    code = "import matplotlib\nmatplotlib.use('Agg')\n" + code.replace(
        "plt.show()", f"plt.savefig({str(tmp_path / 'nb.png')!r})")
    script = tmp_path / "nb.py"
    script.write_text(code)
    out = _run(str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 4:" in out.stdout and "all-reduce" in out.stdout
    # the text above the list explains every all-reduce: each operand is a gradient
    # bucket or a sync BatchNorm layer's sums (issue 40), each bucket in one all-reduce
    sent = [l for l in out.stdout.splitlines() if l.startswith("#") and "all-reduce" in l]
    assert sent and not [l for l in sent if "other" in l], sent
    for bucket in ("deep", "first"):
        assert sum(f"gradient bucket {bucket!r}" in l for l in sent) == 1, sent
    top1 = float(out.stdout.split("epoch 4:")[1].split("val top-1")[1].split()[0])
    assert top1 > 0.8
    assert (tmp_path / "nb.png").stat().st_size > 10_000


@pytest.mark.job
def test_cifar_format_run_plot_and_quiet_mode(tmp_path):
    out = _run("scripts/make_tiny_cifar.py", str(tmp_path / "data"), "--per_batch", "100")
    assert out.returncode == 0, out.stderr
    work = tmp_path / "run"
    out = _run("scripts/train.py", "--config", "configs/cifar10_resnet20.py", "--workdir", str(work),
               f"--config.data_dir={tmp_path / 'data'}", "--config.model=resnet8",
               "--config.num_epochs=2", "--config.eval_batch_size=64", "--config.tensorboard=True")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["dataset"] == "cifar10" and summary["val_examples"] == 1297
    assert summary["compiles_during_training"] == 0
    # not a terminal: no progress bar in the output
    assert "\r" not in out.stdout + out.stderr and "step/s" not in out.stderr
    # TensorBoard holds every logged scalar of metrics.jsonl, at its step, with its value
    # (tags grouped by quantity: loss/train, top1/val, lr, ...), and the end's hparams
    from trjax.train.loop_io import epoch_tag
    rows = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
    want = {(epoch_tag(k), r["step"]): v for r in rows for k, v in r.items()
            if k not in ("epoch", "step")}
    want.update({(f"hparam/{k}", summary["steps"]): summary[k]
                 for k in ("val_top1", "val_top5", "val_loss")})
    got = _tensorboard_scalars(work / "tensorboard")
    assert set(got) == set(want) and len(rows) == 2
    for key, v in want.items():
        assert got[key] == np.float32(v), (key, got[key], v)
    out = _run("scripts/plot.py", str(work))
    assert out.returncode == 0, out.stderr
    png = (work / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


CONFIG_ERRORS = [
    ("--config.bn_mod=sync", "no such config field; did you mean bn_mode"),
    ("--config.num_epochs=ten", "--config.num_epochs='ten': expected an int"),
    ("--config.halt_on_nonfinite=maybe", "expected a bool"),
    ("--config.distributed.num_proceses=2", "did you mean distributed.num_processes"),
    ("--config.dataset=cifar10", "dataset 'cifar10' reads files: set --config.data_dir=FOLDER"),
]


@pytest.mark.job
def test_config_errors_are_clear(tmp_path):
    """Each override of CONFIG_ERRORS (one scripts/train.py process each, all started at
    once: formerly one parametrized case each) fails with its message, no traceback, and
    leaves nothing behind."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    from helpers import run_at_once
    done = run_at_once([[PY, "scripts/train.py", "--config", "configs/default.py", "--workdir",
                         str(tmp_path / str(i)), override]
                        for i, (override, _) in enumerate(CONFIG_ERRORS)], ROOT, env, 120)
    for i, ((override, needle), p) in enumerate(zip(CONFIG_ERRORS, done)):
        stderr = p.stderr
        assert p.returncode != 0, override
        assert needle in stderr, (override, stderr[-2000:])
        assert "Traceback" not in stderr, override
        assert not (tmp_path / str(i) / "checkpoints").exists()  # a refused run leaves nothing


@pytest.mark.job
def test_plot_without_metrics_is_a_clear_error(tmp_path):
    out = _run("scripts/plot.py", str(tmp_path))
    assert out.returncode != 0 and "metrics.jsonl does not exist" in out.stderr
