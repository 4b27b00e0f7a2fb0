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
