"""A normalisation layer applied twice in one training forward pass (issue 40, kind 2):
a block reused with shared weights, one encoder over two views. trjax's rule: refused
while tracing, before anything is compiled, naming the layer, for linen (flax's and
trjax's BatchNorm) and NNX; frozen (running-average) reuse and a shared convolution with a
BatchNorm per use still train."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import small_config, tiny_digits
from trjax import batchnorm
from trjax.train import trainer


class SharedBNLinen(nn.Module):
    """Two views through one encoder whose BatchNorm is shared."""
    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, bn = nn.Conv(8, (3, 3)), nn.BatchNorm(use_running_average=not train)
        a = bn(conv(x))
        b = bn(conv(x[:, ::-1]))  # the second view: the same layers
        return nn.Dense(10)(jnp.mean(nn.relu(a + b), axis=(1, 2)))


class PerUseBNLinen(nn.Module):
    """The fix: the convolution shared, one BatchNorm per use."""
    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = nn.Conv(8, (3, 3))
        a = nn.BatchNorm(use_running_average=not train)(conv(x))
        b = nn.BatchNorm(use_running_average=not train)(conv(x[:, ::-1]))
        return nn.Dense(10)(jnp.mean(nn.relu(a + b), axis=(1, 2)))


class SharedBNNNX(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.linear = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        a, b = self.bn(self.conv(x)), self.bn(self.conv(x[:, ::-1]))
        return self.linear(jnp.mean(nnx.relu(a + b), axis=(1, 2)))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_batchnorm_applied_twice_is_refused_before_compiling(kind, monkeypatch):
    compiled = []
    monkeypatch.setattr("trjax.aot.compile_step", lambda *a, **k: compiled.append(a))
    model = SharedBNLinen() if kind == "linen" else SharedBNNNX(rngs=nnx.Rngs(0))
    cfg = small_config(global_batch_size=16, eval_batch_size=16, devices="2")
    with pytest.raises(ValueError, match="applied twice in one training forward pass") as e:
        trainer.setup(cfg, tiny_digits(), model=model)
    assert ("BatchNorm_0" if kind == "linen" else "bn") in str(e.value).split(":")[0]
    assert "its own BatchNorm" in str(e.value) and compiled == []


class TwiceTrjaxBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        bn = batchnorm.BatchNorm(mode="local")
        return bn(x, train) + bn(2.0 * x, train)


def test_trjax_batchnorm_applied_twice_is_refused_and_frozen_reuse_is_not():
    model, x = TwiceTrjaxBN(), jnp.arange(12.0).reshape(4, 3)
    variables = model.init(jax.random.key(0), x, train=False)

    def run(train):
        ctx = batchnorm.BatchNormContext("local")
        with nn.intercept_methods(batchnorm.linen_interceptor(ctx)):
            return model.apply(variables, x, train, mutable=["batch_stats", "bn_sums"])
    run(False)  # running averages, twice: no statistics taken, accepted
    with pytest.raises(ValueError, match="BatchNorm_0: this BatchNorm is applied twice"):
        run(True)


def test_one_batchnorm_per_use_with_a_shared_convolution_trains():
    cfg = small_config(global_batch_size=16, eval_batch_size=16, devices="2")
    tr = trainer.prepare(cfg, tiny_digits(), model=PerUseBNLinen())
    assert len(tr.plan.stats_slots) == 4  # two BatchNorms, mean and var each
