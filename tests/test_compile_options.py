"""trjax's XLA:CPU compile options save compile time, not accuracy; an option this XLA does
not know, or one the user's XLA_FLAGS sets, is left out."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trjax import aot
from trjax.cpu import compile_options as co


def _setup():
    """helpers.setup's running-BN train state on 2 devices (global batch 16) for ResNet-8 cut
    to one BasicBlock of 8 channels: every layer kind (convs, BatchNorm, the residual, the
    head) at a fraction of the full model's compile time, which these tests pay under two
    option sets, -O3 included."""
    from trjax import exchange, models, optim, parallel
    from trjax.plan import build_plan
    from trjax.state import create_train_state
    from trjax.world import make_world
    world = make_world("0-1", 16)
    model = models.create_model("resnet8", num_classes=10, stage_sizes=(1,), widths=(8,),
                                stem_width=8, bn_mode="running", axis_name="data")
    plan = build_plan(model, (8, 8, 1))
    tx = optim.make_optimizer("sgd", 0.1, plan, weight_decay=1e-3)
    state = create_train_state(jax.random.key(0),
                               parallel.data_parallel(model, world, (8, 8, 1), "running"),
                               exchange.allreduce(tx, plan))
    return world, model, plan, tx, state


def test_cpu_steps_compile_with_region_analysis_same_bits_fewer_copies():
    """compile_step compiles CPU steps with STEP_OPTIONS: copy insertion with region
    analysis drops the copies XLA made of momenta and kernels before updating them in the
    donated state (88 -> 22 per device-step in the main job), and changes no bit."""
    from helpers import random_batch
    from trjax import exchange, parallel, steps

    world, model, plan, tx, state = _setup()
    fn = steps.make_train_step(parallel.data_parallel(model, world, (8, 8, 1), "running"),
                               exchange.allreduce(tx, plan), plan)
    batch = jax.device_put(random_batch(16), world.sharded())
    assert co.step_options((state, batch)) == co.STEP_OPTIONS
    ours = aot.compile_step("train", fn, state, batch, donate_argnums=0)
    plain = jax.jit(fn, donate_argnums=0).lower(*aot.abstract((state, batch))).compile()
    copies = lambda compiled: compiled.as_text().count(" copy(")
    assert 0 <= copies(ours.compiled) < copies(plain)
    a = jax.tree_util.tree_map(lambda x: x.copy(), state)
    b = jax.tree_util.tree_map(lambda x: x.copy(), state)
    for _ in range(2):
        a, _ = ours(a, batch)
        b, _ = plain(b, batch)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_cpu_compiler_options_change_no_more_than_rounding(monkeypatch):
    """The XLA:CPU options trjax compiles with save compile time, not accuracy, against
    jaxlib's defaults (LLVM -O3, the MLIR fusion emitters): the state initialisation
    (INIT_OPTIONS: -O1, elemental emitters) gives the same bits; one train
    step (co.STEP_OPTIONS: -O1) from the same state stays within the rounding of a
    reordered sum (the
    main job's 180 steps gave the same bits; ResNet-8 on 2 devices differs in a few ulps;
    here one block of it),
    and an evaluation of the same state gives the same counts and loss sum to 1e-6."""
    from helpers import assert_within_reorder_rounding, random_batch
    from trjax import exchange, parallel, steps
    from trjax.metrics import METRICS

    defaults = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
    assert co.INIT_OPTIONS["xla_backend_optimization_level"] == 1
    assert co.STEP_OPTIONS["xla_backend_optimization_level"] == 1
    host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)

    def run():
        world, model, plan, tx, state = _setup()
        layout = parallel.data_parallel(model, world, (8, 8, 1), "running")
        first = host(state)
        batch = jax.device_put(random_batch(16), world.sharded())
        train = aot.compile_step("train", steps.make_train_step(
            layout, exchange.allreduce(tx, plan), plan), state, batch,
            donate_argnums=0)
        state, _ = train(state, batch)
        fold = aot.compile_step("fold", steps.make_fold_bn(layout), state)
        acc = jax.device_put(np.zeros((2, len(METRICS)), np.float32), world.sharded())
        evaluate = aot.compile_step("eval", steps.make_eval_step(layout),
                                    state.params, fold(state), batch, acc, donate_argnums=3)
        return first, state, lambda s: np.asarray(evaluate(s.params, fold(s), batch, acc.copy()))

    # conftest's XLA_FLAGS sets level 1, and compile_lowered lets a flag the user set win:
    # the flag hidden here, so that the options below are the ones in force
    monkeypatch.setenv("XLA_FLAGS", re.sub(r"--xla_backend_optimization_level=\S*", "",
                                           os.environ.get("XLA_FLAGS", "")))
    assert "xla_backend_optimization_level" not in co.flags_set_in_env()
    first, ours, ours_eval = run()
    monkeypatch.setattr(co, "INIT_OPTIONS", defaults)
    monkeypatch.setattr(co, "STEP_OPTIONS", {**co.STEP_OPTIONS, **defaults})
    first_ref, ref, ref_eval = run()
    for x, y in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(first_ref)):
        np.testing.assert_array_equal(x, y)
    assert_within_reorder_rounding(ours.params, ref.params, first.params, rows=16 * 64)
    a, b = ours_eval(ref), ref_eval(ref)  # [device, (loss, top1, top5, count)] sums
    np.testing.assert_array_equal(a[:, 1:], b[:, 1:])
    np.testing.assert_allclose(a[:, 0], b[:, 0], rtol=1e-6)


def test_compile_lowered_drops_the_options_this_xla_does_not_know(monkeypatch):
    """XLA adds and removes compile options between jaxlib releases (jaxlib 0.12 has no
    xla_cpu_use_fusion_emitters): such an option is dropped, the known ones stay in force,
    and any other compile error is raised."""
    monkeypatch.setenv("XLA_FLAGS", "")  # conftest's level flag would win over the option
    lowered = jax.jit(lambda x: x + 1).lower(jnp.float32(1))
    compiled = co.compile_lowered(lowered, {"xla_trjax_no_such_option": True,
                                             "xla_backend_optimization_level": 1})
    assert float(compiled(jnp.float32(2))) == 3.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="is not a valid int32 value"):
        co.compile_lowered(lowered, {"xla_trjax_no_such_option": True,
                                      "xla_backend_optimization_level": "high"})


def test_an_xla_flag_the_user_sets_wins_over_trjax_options(monkeypatch):
    """compile options override XLA_FLAGS, so compile_lowered leaves out every option the
    process's XLA_FLAGS names: XLA_FLAGS=--xla_backend_optimization_level=3 compiles
    trjax's steps at -O3 (the flag's value), the other options stay."""
    seen = []

    class Lowered:  # records what XLA would be asked for
        def compile(self, compiler_options=None):
            seen.append(compiler_options)
            return "compiled"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    "--xla_backend_optimization_level=3")
    assert co.flags_set_in_env() == {"xla_force_host_platform_device_count",
                                      "xla_backend_optimization_level"}
    assert co.compile_lowered(Lowered(), co.STEP_OPTIONS) == "compiled"
    assert seen[-1] == {"xla_cpu_copy_insertion_use_region_analysis": True}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    co.compile_lowered(Lowered(), co.STEP_OPTIONS)
    assert seen[-1] == co.STEP_OPTIONS
