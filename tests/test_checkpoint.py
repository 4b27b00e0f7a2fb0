"""Checkpoints: exact resume, another device count, corrupt and incompatible checkpoints."""
import os

import jax
import numpy as np
import pytest

from helpers import max_rel, small_config, to_host
from trjax.train import train_and_evaluate


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]


def test_resume_mid_epoch_is_bitwise_exact(tmp_path):
    cfg = dict(num_epochs=2, checkpoint_every_steps=4)
    full, s_full = train_and_evaluate(small_config(**cfg), str(tmp_path / "full"))
    part, s_part = train_and_evaluate(small_config(halt_after_steps=7, **cfg), str(tmp_path / "cut"))
    assert s_part["halted"] and s_part["steps"] == 7
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["4", "7"]
    resumed, s_res = train_and_evaluate(small_config(**cfg), str(tmp_path / "cut"))
    assert s_res["steps"] == s_full["steps"] == 24
    for name in ("params", "batch_stats", "opt_state"):
        assert _bits(getattr(resumed, name)) == _bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"]


def test_restore_on_another_device_count(tmp_path):
    cfg = dict(num_epochs=2, bn_mode="sync", global_batch_size=64, eval_batch_size=64)
    train_and_evaluate(small_config(devices="8", halt_after_steps=23, **cfg), str(tmp_path / "a"))
    import shutil
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    on8, _ = train_and_evaluate(small_config(devices="8", **cfg), str(tmp_path / "a"))
    on4, s4 = train_and_evaluate(small_config(devices="4", **cfg), str(tmp_path / "b"))
    assert s4["world_size"] == 4 and s4["steps"] == 46
    assert max_rel(to_host(on4.params), to_host(on8.params)) <= 1e-5


def test_truncated_newest_checkpoint_falls_back_to_previous(tmp_path, capsys):
    cfg = dict(num_epochs=1, checkpoint_every_steps=4, halt_after_steps=9)
    train_and_evaluate(small_config(**cfg), str(tmp_path))
    newest = tmp_path / "checkpoints" / "9"
    files = [os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs]
    for f in files:  # truncate every file of the newest checkpoint
        with open(f, "r+b") as fh:
            fh.truncate(max(0, os.path.getsize(f) // 3))
    state, s = train_and_evaluate(small_config(num_epochs=1, halt_after_steps=10), str(tmp_path))
    out = capsys.readouterr().out
    assert f"checkpoint {newest} is unreadable" in out and "resumed from step 8" in out
    assert s["steps"] == 10
    assert newest.exists()  # left in place for inspection


def test_incompatible_checkpoint_is_a_clear_error_before_compiling(tmp_path, monkeypatch):
    train_and_evaluate(small_config(num_epochs=1, halt_after_steps=2), str(tmp_path))
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=r"checkpoint .*2 is incompatible with this config: "
                                         r"model: checkpoint 'resnet8' vs config 'resnet20'"):
        train_and_evaluate(small_config(num_epochs=1, model="resnet20"), str(tmp_path))
    assert (tmp_path / "checkpoints" / "2").exists()
