"""trjax.export (``trjax-export WORKDIR OUT``): a tiny run's newest checkpoint exported with
jax.export gives, deserialized and called on one device, the logits of trjax's own
evaluation bit for bit, at two batch sizes (the batch is symbolic); errors name the path
and the fix."""
import json
import os

import jax
import numpy as np
import pytest

from helpers import small_config
from trjax import export as export_lib


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.job
def test_exported_logits_are_trjax_evaluation_bit_for_bit(tmp_path):
    from trjax import models, steps
    from trjax.data import input_pipeline
    from trjax.metrics import batch_metrics
    from trjax.train import prepare, train_and_evaluate
    data = input_pipeline.load_dataset("digits")
    cfg = small_config(num_epochs=1, halt_after_steps=2, devices="2", global_batch_size=32,
                       eval_batch_size=64, log_every_steps=0, tensorboard=False)
    work, out = str(tmp_path / "run"), str(tmp_path / "export")
    state, summary = train_and_evaluate(cfg, work, data=data)
    meta = export_lib.export(work, out)
    assert sorted(os.listdir(out)) == ["model.jax_export", "model.json"]
    assert json.load(open(os.path.join(out, "model.json"))) == meta
    assert meta["batch"] == "symbolic" and meta["input"] == {
        "shape": ["b", 8, 8, 1], "dtype": "uint8", "layout": "NHWC"}
    assert meta["output"]["shape"] == ["b", 10] and meta["num_classes"] == 10
    assert meta["step"] == 2 and meta["model"] == "resnet8" and meta["platforms"] == ["cpu"]
    exported = jax.export.deserialize(open(os.path.join(out, "model.jax_export"), "rb").read())

    # trjax's own evaluation of the run's final state: its BN fold program over the run's
    # 2-device mesh, then the eval step's per-device computation on one device
    tr = prepare(cfg, data=data)
    net, dev = tr.model, jax.devices()[0]
    folded = jax.jit(steps.make_fold_bn(tr.layout))(state)
    params, folded = jax.device_put((state.params, folded), dev)
    evaluate = jax.jit(lambda p, bn, x: net.apply_eval(
        p, bn, models.normalize(x, net.mean, net.std, net.dtype), True))
    for n in (64, 7):  # the eval batch and another size: one symbolic batch dimension
        images = data.val.images[:n]
        got, want = exported.call(images), evaluate(params, folded, images)
        assert got.shape == (n, 10) and got.dtype == np.float32
        np.testing.assert_array_equal(_bits(got), _bits(want))
    # the whole validation set through the export: the run's own val top-1, exactly
    logits = exported.call(data.val.images)
    sums = np.asarray(batch_metrics(logits, data.val.labels,
                                    np.ones(len(data.val.labels), np.float32)))
    assert sums[3] == summary["val_examples"] == 360
    assert sums[1] / sums[3] == summary["val_top1"]
    assert sums[0] / sums[3] == pytest.approx(summary["val_loss"], rel=1e-5)


@pytest.mark.job
def test_a_run_on_a_split_mesh_exports_its_unsplit_evaluation(tmp_path):
    """Runs trained on fsdp:8 (bn_mode='local'), data:2,stage:4 and data:4,model:2 (with an
    EMA) export the one-device folded evaluation: the whole validation set through each
    export gives exactly the run's own val_top1 (its evaluation ran split over the mesh),
    and --ema the run's EMA val_top1. In local mode each replica evaluated with its own
    statistics row and the export holds replica 0's: it gives the run's evaluation with
    replica 0's row on every device."""
    from trjax.data import input_pipeline
    from trjax.metrics import batch_metrics
    from trjax.train import setup, train_and_evaluate
    from trjax.train.trainer import evaluate_pass
    data = input_pipeline.load_dataset("digits")
    common = dict(num_epochs=1, halt_after_steps=3, devices="8", global_batch_size=32,
                  eval_batch_size=40, log_every_steps=0, tensorboard=False, learning_rate=0.2)
    runs = {"fsdp:8": dict(bn_mode="local"),
            "data:2,stage:4": dict(model_kwargs={"stage_sizes": (2, 1, 1)},
                                   pipeline_microbatches=4),
            "data:4,model:2": dict(ema_decay=0.5)}
    mask = np.ones(len(data.val.labels), np.float32)
    for i, (mesh, extra) in enumerate(runs.items()):
        work, cfg = str(tmp_path / f"run{i}"), small_config(mesh=mesh, **common, **extra)
        state, summary = train_and_evaluate(cfg, work, data=data)
        if extra.get("bn_mode") == "local":
            row0 = jax.tree_util.tree_map(lambda x: jax.device_put(
                np.broadcast_to(np.asarray(x)[:1], x.shape), x.sharding), state.batch_stats)
            summary = {f"val_{k}": v for k, v in evaluate_pass(
                setup(cfg, data), state.replace(batch_stats=row0)).items()}
        kinds = [("", False)] + ([("ema_", True)] if extra.get("ema_decay") else [])
        for prefix, ema in kinds:
            out = str(tmp_path / f"export{i}{prefix}")
            meta = export_lib.export(work, out, ema=ema)
            assert meta["parameters"] == ("ema" if ema else "params")
            exported = jax.export.deserialize(open(os.path.join(out, "model.jax_export"),
                                                   "rb").read())
            sums = np.asarray(batch_metrics(exported.call(data.val.images), data.val.labels,
                                            mask))
            assert sums[1] / sums[3] == summary[f"val_{prefix}top1"], (mesh, prefix)
            assert sums[0] / sums[3] == pytest.approx(summary[f"val_{prefix}loss"], rel=1e-4)
    with pytest.raises(ValueError, match="holds no EMA of the parameters"):
        export_lib.export(str(tmp_path / "run0"), str(tmp_path / "no_ema"), ema=True)


def _workdir(tmp_path):
    """A workdir with a config.json and no checkpoint."""
    from trjax.train import loop_io
    work = tmp_path / "run"
    work.mkdir()
    loop_io.save_config(small_config(), str(work), resuming=False)
    return work


def test_export_errors_name_the_path_and_the_fix(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match=r"config.json does not exist: .* is not the "
                                                r"workdir of a trjax run"):
        export_lib.export(str(tmp_path), str(out))
    work = _workdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint in {work}/checkpoints: .*"
                                                "train first"):
        export_lib.export(str(work), str(out))
    assert not out.exists()  # a failed export leaves nothing
    out.mkdir()
    (out / "model.jax_export").write_bytes(b"old")
    with pytest.raises(FileExistsError, match=rf"{out} exists and is not an empty folder: .*"
                                              "delete it, or name a new folder"):
        export_lib.export(str(work), str(out))
    # the command: one line, no traceback
    with pytest.raises(SystemExit) as e:
        export_lib.main([str(work), str(tmp_path / "new")])
    assert str(e.value).startswith(f"error: no checkpoint in {work}/checkpoints")
    with pytest.raises(SystemExit) as e:
        export_lib.main(["--help"])
    assert e.value.code == 0 and "jax.export.deserialize" in capsys.readouterr().out
