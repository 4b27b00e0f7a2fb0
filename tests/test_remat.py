"""Remat (config.remat, issue 51): the backward recomputes the matched modules, for a Flax
user's own model on every mesh kind, with dropout on (issue 53, kind 2: a recompute must
draw the forward's random keys).

Each case compiles the train step twice from one start state, with and without remat, and
checks one step against the other within the suite's one-step rounding bound (the
recompute is the same arithmetic; XLA may fuse it otherwise), and that the compiled
program holds what remat builds: more convolutions than the program without it (the
forward of each matched block runs again in the backward), the same number under
``convs_saveable`` (which keeps their outputs). Issue 53, kind 1: an option whose effect the
value oracle cannot see is pinned from the built program.
"""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from helpers import assert_within_bound_except_still, small_config, to_host
from flax import nnx
from test_tensor_plan import LINEN_PLAN, Pool, linen_sequential, nnx_sequential
from trjax import remat as remat_lib
from trjax import steps
from trjax.data import input_pipeline as ip
from trjax.train import trainer

GLOBAL = 32


def _config(mesh, remat, **kw):
    devices = str(np.prod([int(a.split(":")[1]) for a in mesh.split(",")]))
    stage = "stage" in mesh
    return small_config(devices=devices, mesh=mesh, global_batch_size=GLOBAL,
                        eval_batch_size=GLOBAL, warmup_epochs=0, remat=remat,
                        pipeline_microbatches=4 if stage else 0, **kw)


def _one_step(make, mesh, remat, start=None, **kw):
    """``(start, after, convolutions in the compiled step)`` of one train step."""
    data = ip.load_digits()
    tr = trainer.prepare(_config(mesh, remat, **kw), data, model=make())
    init = trainer.train_state_program(0, tr.layout, tr.exchange)
    start = to_host(init.finish()) if start is None else start
    state = jax.tree_util.tree_map(lambda x, a: jax.device_put(x, a.sharding), start,
                                   init.abstract)
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    rows = ip.to_device(batch, tr.world.sharded(), 10)
    step = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                         trainer.step_options(tr))).lower(state, rows).compile()
    after, _ = step(state, rows)
    return start, to_host(after), step.as_text().count(" convolution(")


class NNXBlock(nnx.Module):
    """A residual block as nnx users write one."""
    def __init__(self, c, rngs):
        self.conv1, self.bn1 = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.BatchNorm(c, rngs=rngs)
        self.conv2, self.bn2 = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.BatchNorm(c, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(x + self.drop(self.bn2(self.conv2(y))))


def nnx_blocks():
    r = nnx.Rngs(0)
    return nnx.Sequential(nnx.Conv(1, 16, (3, 3), rngs=r), NNXBlock(16, r), NNXBlock(16, r),
                          Pool(), nnx.Linear(16, 10, rngs=r))


CASES = [
    (linen_sequential, "data:2", "blocks", {}),
    (linen_sequential, "data:2,stage:2", "layers_*", dict(pipeline_schedule="zb-h1")),
    (linen_sequential, "fsdp:2,model:2", "layers_2,layers_4",
     dict(tensor_plan=LINEN_PLAN, remat_policy="convs_saveable")),
    (nnx_blocks, "data:2,fsdp:2", "blocks", {}),
]


@pytest.mark.parametrize("make,mesh,remat,kw", CASES,
                         ids=[f"{m.__name__}-{mesh}-{r}" for m, mesh, r, _ in CASES])
def test_remat_equals_the_step_without_it_and_recomputes(make, mesh, remat, kw):
    start, plain, convs = _one_step(make, mesh, "none", **kw)
    _, rematted, convs_remat = _one_step(make, mesh, remat, start=start, **kw)
    # every block's convolutions run again, unless the policy keeps their outputs
    recomputes = kw.get("remat_policy") != "convs_saveable"
    assert (convs_remat > convs) == recomputes, (convs_remat, convs)
    assert_within_bound_except_still(rematted, plain, start, GLOBAL)


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3), name="stem")(x)
        for i in range(2):
            x = nn.relu(nn.Conv(8, (3, 3), name=f"ResBlock_{i}")(x)) + x
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


@pytest.mark.parametrize("remat,policy,match", [
    ("layers_9", "nothing_saveable", r"'layers_9' matches no module .*layers_0, layers_2"),
    ("layers_2//Conv_0", "nothing_saveable", "empty path component"),
    ("layers_2", "save_all", "remat_policy='save_all' is not one of"),
])
def test_a_bad_remat_is_an_error_before_compiling(remat, policy, match):
    net = trainer.models.as_network(linen_sequential())
    with pytest.raises(ValueError, match=match):
        remat_lib.resolve(net, remat, (8, 8, 1), policy)


def test_blocks_names_a_sequentials_layers_and_your_model_gets_its_own_paths():
    sequential = trainer.models.as_network(linen_sequential())
    assert remat_lib.resolve(sequential, "blocks", (8, 8, 1)).paths == {
        ("layers_0",), ("layers_2",), ("layers_3",), ("layers_4",)}
    own = trainer.models.as_network(Encoder())
    with pytest.raises(ValueError, match=r"your model Encoder is neither.*ResBlock_0"):
        remat_lib.resolve(own, "blocks", (8, 8, 1))
    assert remat_lib.resolve(own, "*Block_*", (8, 8, 1)).paths == {("ResBlock_0",),
                                                                    ("ResBlock_1",)}
    assert remat_lib.resolve(own, "none", (8, 8, 1)) is None
    nnx_net = trainer.models.as_network(nnx_sequential())
    assert ("layers", "3") in remat_lib.resolve(nnx_net, "blocks", (8, 8, 1)).paths


def test_benchmark_options_after_a_mesh_and_the_batch_a_budget_fits():
    """``benchmark --parallel --meshes 'data:8 remat:blocks'`` and ``--memory_per_device``."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from benchmarking import parallel
    assert parallel.split_name("data:2,stage:4 schedule:zb-h1 M:8 remat:blocks") == (
        "data:2,stage:4", {"pipeline_schedule": "zb-h1", "pipeline_microbatches": 8,
                           "remat": "blocks"})
    with pytest.raises(ValueError, match="option 'reshard' is not one of"):
        parallel.split_name("data:8 reshard")
    assert parallel.split_name("data:2,fsdp:4 reshard:1") == (
        "data:2,fsdp:4", {"fsdp_reshard_after_forward": True})
    with pytest.raises(ValueError, match="not one of 1, 0, true, false"):
        parallel.split_name("data:2,fsdp:4 reshard:yes")
    assert parallel._with_references(["data:8", "data:8 remat:blocks"], 4) == [
        ("data:8", None), ("data:8 remat:blocks", "data:8")]
    # 10 MiB fixed (arguments + outputs - donated), 2 MiB temp per row; budget 31 MiB:
    # 10 rows per device, times 4 batch ranks
    m = {"argument": 8 << 20, "output": 8 << 20, "alias": 6 << 20, "temp": 16 << 20}
    assert parallel.fitting_batch(m, 8, 4, 31 << 20) == 40
    assert parallel.fitting_batch(m, 8, 4, 9 << 20) == 0
