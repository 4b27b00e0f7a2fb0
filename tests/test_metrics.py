"""batch_metrics: the top-k rule (ties against the label, NaN never correct), padding
counts nowhere, and a NaN validation loss reported as NaN end to end (issue 13 item 3)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from trjax.metrics import batch_metrics


def _m(logits, labels, mask=None):
    logits = jnp.asarray(logits, jnp.float32)
    mask = np.ones(len(labels), np.float32) if mask is None else np.asarray(mask, np.float32)
    return np.asarray(batch_metrics(logits, jnp.asarray(labels, jnp.int32), jnp.asarray(mask)))


def _np_topk(logits, label, k):
    """Independent reference: ties against the label, NaN rows never correct."""
    if np.isnan(logits).any():
        return 0.0
    others = np.delete(logits, label)
    return float(np.sum(others >= logits[label]) < k)


def test_nan_rows_are_never_correct():
    out = _m(np.full((10, 10), np.nan), np.arange(10))
    assert out[1] == 0 and out[2] == 0 and out[3] == 10
    assert np.isnan(out[0])
    # one NaN among otherwise winning logits
    row = np.zeros(10)
    row[3], row[7] = 5.0, np.nan
    assert _m([row], [3])[1:3].tolist() == [0.0, 0.0]


def test_ties_are_broken_against_the_label():
    out = _m(np.zeros((10, 10)), np.arange(10))
    assert out[1] == 0 and out[2] == 0
    np.testing.assert_allclose(out[0], 10 * np.log(10), rtol=1e-6)
    row = np.array([3.0, 3.0, 1.0, 0.0, 0.0])  # label 0 ties with class 1
    assert _m([row], [0])[1:3].tolist() == [0.0, 1.0]
    row = np.array([9, 9, 9, 9, 9, 1, 0, 0.0])  # label 4 ties with 4 others: rank 4 -> top-5
    assert _m([row], [4])[1:3].tolist() == [0.0, 1.0]
    row = np.array([9, 9, 9, 9, 9, 9, 0.0])  # ties with 5 others: not in the top 5
    assert _m([row], [0])[1:3].tolist() == [0.0, 0.0]


def test_inf_logits_follow_the_same_rule():
    row = np.array([np.inf, 0, 0, 0.0])
    assert _m([row], [0])[1] == 1.0
    row = np.array([np.inf, np.inf, 0, 0.0])
    assert _m([row], [0])[1] == 0.0


def test_random_rows_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.integers(-2, 3, size=(200, 7)).astype(np.float32)  # many ties
    logits[rng.random(200) < 0.1, 2] = np.nan
    labels = rng.integers(0, 7, 200)
    mask = (rng.random(200) < 0.8).astype(np.float32)
    out = _m(logits, labels, mask)
    want1 = sum(_np_topk(l, y, 1) * m for l, y, m in zip(logits, labels, mask))
    want5 = sum(_np_topk(l, y, 5) * m for l, y, m in zip(logits, labels, mask))
    assert out[1] == want1 and out[2] == want5 and out[3] == mask.sum()


def test_padding_rows_count_nowhere_even_when_nan():
    logits = np.zeros((4, 3), np.float32)
    logits[:2, 1] = 1.0
    logits[2:] = np.nan  # padding rows with NaN logits
    out = _m(logits, [1, 1, 0, 0], [1, 1, 0, 0])
    assert out[1] == 2 and out[3] == 2 and np.isfinite(out[0])
    want = -np.log(np.exp(1) / (np.exp(1) + 2))
    np.testing.assert_allclose(out[0], 2 * want, rtol=1e-6)


@pytest.mark.job
def test_nan_validation_is_reported_as_nan_end_to_end(tmp_path, monkeypatch, capsys):
    """A model whose evaluation logits are NaN: val_top1 0 and val_loss NaN in the log
    line, metrics.jsonl and summary.json (before the fix: val_top1 1.0)."""
    import functools

    from helpers import small_config
    from trjax import models
    from trjax.train import train_and_evaluate

    class NaNEval(models.ResNet):
        def __call__(self, x, train: bool = True, mask=None):
            y = models.ResNet.__call__(self, x, train, mask)
            return y if train else y * jnp.float32(np.nan)

    monkeypatch.setitem(models.MODELS, "resnet8", functools.partial(NaNEval, stage_sizes=(1, 1, 1)))
    _, s = train_and_evaluate(small_config(num_epochs=1), str(tmp_path))
    assert s["val_top1"] == 0.0 and s["val_top5"] == 0.0 and np.isnan(s["val_loss"])
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["val_top1"] == 0.0 and np.isnan(on_disk["val_loss"])
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_top1"] == 0.0 and np.isnan(rows[-1]["val_loss"])
    out = capsys.readouterr().out
    assert "val loss nan top1 0.0000" in out
