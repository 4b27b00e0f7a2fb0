"""Parameters in a low-precision dtype (issue 40, kind 1). trjax's rule: parameters and
BN statistics are float32 master weights (the optimizer state, the EMA, the buckets,
ZeRO-1's shards and the checkpoints follow them) and ``config.precision`` sets the
compute dtype. A model whose layers keep bfloat16 parameters (``param_dtype``) is refused
before anything is compiled, naming the leaves, on the trainer's path and the library's
(the plan every train step is built with); a bfloat16 COMPUTE dtype with float32
parameters trains."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import small_config, tiny_digits
from trjax import plan as plan_lib
from trjax.train import trainer


class LinenCNN(nn.Module):
    num_classes: int = 10
    param_dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), param_dtype=self.param_dtype, dtype=jnp.bfloat16)(x)
        x = nn.BatchNorm(use_running_average=not train, param_dtype=self.param_dtype)(x)
        x = jnp.mean(nn.relu(x), axis=(1, 2))
        return nn.Dense(self.num_classes, param_dtype=jnp.float32)(x).astype(jnp.float32)


class NNXCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.linear = nnx.Linear(8, 10, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.linear(jnp.mean(nnx.relu(self.conv(x)), axis=(1, 2))).astype(jnp.float32)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_bfloat16_parameters_are_refused_before_compiling_naming_the_leaves(kind, monkeypatch):
    compiled = []
    monkeypatch.setattr("trjax.aot.compile_step", lambda *a, **k: compiled.append(a))
    model = LinenCNN() if kind == "linen" else NNXCNN(rngs=nnx.Rngs(0))
    cfg = small_config(global_batch_size=16, eval_batch_size=16, devices="2")
    with pytest.raises(ValueError) as e:
        trainer.setup(cfg, tiny_digits(), model=model)
    msg = str(e.value)
    leaf = "params/Conv_0/kernel (bfloat16)" if kind == "linen" else \
        "params/linear/kernel (bfloat16)"
    assert leaf in msg and "param_dtype=jnp.float32" in msg and "precision='bf16'" in msg
    if kind == "linen":
        assert "params/BatchNorm_0/scale (bfloat16)" in msg and "Dense_0" not in msg
    assert compiled == []


def test_the_plan_refuses_them_on_the_library_path_too():
    params = {"w": jnp.zeros((3, 3), jnp.float16), "b": jnp.zeros((3,), jnp.float32)}
    with pytest.raises(ValueError, match=r"params/w \(float16\)"):
        plan_lib.check_float32(params, {})
    with pytest.raises(ValueError, match=r"batch_stats/bn/mean \(bfloat16\)"):
        plan_lib.check_float32({}, {"bn": {"mean": jnp.zeros((3,), jnp.bfloat16)}})
    plan_lib.check_float32({"w": jnp.zeros(2, jnp.float32)}, {})  # float32: accepted


def test_bfloat16_compute_with_float32_parameters_is_accepted():
    cfg = small_config(global_batch_size=16, eval_batch_size=16, devices="2")
    tr = trainer.prepare(cfg, tiny_digits(), model=LinenCNN(param_dtype=jnp.float32))
    params = jax.tree_util.tree_leaves(tr.model.abstract_variables((8, 8, 1))["params"])
    assert all(x.dtype == jnp.float32 for x in params) and len(tr.plan.slots) == len(params)
