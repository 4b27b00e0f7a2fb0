"""trjax.optim: the learning-rate schedule against its documented formula."""
import math

import numpy as np
import pytest

from trjax.optim import learning_rate_schedule


def formula(t, lr, warmup, total):
    if t < warmup:
        return lr * t / warmup
    return lr * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2


@pytest.mark.parametrize("lr,warmup,total", [(0.2, 12, 180), (0.1, 0, 50), (1.0, 5, 6)])
def test_schedule_matches_its_formula_at_first_warmup_end_middle_and_last_step(lr, warmup, total):
    schedule = learning_rate_schedule(lr, warmup, total)
    middle = warmup + (total - warmup) // 2
    for t in sorted({0, max(warmup - 1, 0), warmup, middle, total - 1, total}):
        assert float(schedule(t)) == pytest.approx(formula(t, lr, warmup, total), rel=1e-5,
                                                   abs=1e-7 * lr), t  # float32
    assert float(schedule(warmup)) == pytest.approx(lr)  # the peak at the warmup's end
    assert float(schedule(total)) == pytest.approx(0.0, abs=1e-9)
    ts = np.arange(warmup, total + 1)
    assert np.all(np.diff([float(schedule(int(t))) for t in ts]) <= 1e-9)  # then decays


def test_warmup_longer_than_the_run_is_cut_to_leave_one_decay_step():
    schedule = learning_rate_schedule(0.5, 100, 10)  # W = 9, T = 10
    assert float(schedule(9)) == pytest.approx(0.5)
    assert float(schedule(4)) == pytest.approx(0.5 * 4 / 9, rel=1e-6)
    assert float(schedule(10)) == pytest.approx(0.0, abs=1e-9)
