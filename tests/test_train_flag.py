"""The training flag under another name, inverted, or through nn.Sequential (issue 40,
kind 3). The right value: flax itself on one device, the model called with ITS flag in
training (batch statistics, dropout on) and in evaluation (running statistics). A name
trjax cannot tell apart from an ordinary argument is refused naming the parameter."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trjax import models
from trjax.batchnorm import BatchNormContext

X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 6, 6, 1)), jnp.float32)


class IsTraining(nn.Module):
    @nn.compact
    def __call__(self, x, is_training: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not is_training, momentum=0.5)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class Deterministic(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=deterministic, momentum=0.5)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(x))


def _sequential():
    return nn.Sequential([Block(), Block(), lambda x: jnp.mean(x, axis=(1, 2)), nn.Dense(10)])


def _flax_reference(module, flag, variables, train):
    """flax on one device: the model called with its own flag, nothing of trjax."""
    if isinstance(module, nn.Sequential):  # what the user means: each block with train
        def run(v, x):
            return module.apply(v, x, method=lambda m, x: functools.reduce(
                lambda h, layer: layer(h, train=train) if isinstance(layer, Block) else layer(h),
                m.layers, x), mutable=["batch_stats"] if train else False)
    else:
        value = (not train) if flag == "deterministic" else train
        def run(v, x):
            return module.apply(v, x, **{flag: value},
                                mutable=["batch_stats"] if train else False)
    out = run(variables, X)
    return out[0] if train else out


@pytest.mark.parametrize("make,flag", [(IsTraining, "is_training"),
                                       (Deterministic, "deterministic"),
                                       (_sequential, "train")])
def test_each_convention_trains_and_evaluates_in_its_mode(make, flag):
    module = make()
    net = models.as_network(module)
    variables = net.init(jax.random.key(0), X.shape[1:])
    ctx = BatchNormContext("local")
    logits, _ = net.apply_train(variables["params"], variables["batch_stats"], X, ctx)
    want = _flax_reference(module, flag, {"params": variables["params"],
                                          "batch_stats": variables["batch_stats"]}, True)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    assert ctx.rules  # its BatchNorms took batch statistics (not frozen)
    ev = net.apply_eval(variables["params"], variables["batch_stats"], X)
    np.testing.assert_allclose(ev, _flax_reference(module, flag, variables, False),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits, ev)  # batch statistics against running ones


def test_a_sequential_keeps_flax_s_parameter_names():
    seq = _sequential()
    ours = models.as_network(seq).init(jax.random.key(0), X.shape[1:])["params"]
    theirs = seq.init(jax.random.key(0), X)["params"]
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    assert sorted(ours) == ["layers_0", "layers_1", "layers_3"]


class IsEval(nn.Module):
    @nn.compact
    def __call__(self, x, is_eval: bool = False):
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def test_an_unrecognised_mode_switch_is_refused_naming_it():
    with pytest.raises(ValueError, match="'is_eval', which looks like a training/evaluation"):
        models.as_network(IsEval())
