"""The compiled step's contract on every call (issue 13 item 2): aliased donated leaves
de-aliased on later calls too (no crash), host scalars / numpy arrays converted when safe,
clear errors naming the leaf and the compiled signature otherwise."""
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trjax import aot
from trjax.world import make_world


def _step():
    world = make_world("all", 8)
    rep = world.replicated()

    def f(state, x):
        new = {"step": state["step"] + 1, "w": state["w"] + x.sum(), "b": state["b"] * 2.0,
               "on": ~state["on"]}
        return new, state["w"].sum()

    state = {"step": jax.device_put(np.int32(0), rep), "w": jax.device_put(np.zeros(4, np.float32), rep),
             "b": jax.device_put(np.ones(4, np.float32), rep), "on": jax.device_put(np.bool_(True), rep)}
    x = jax.device_put(np.ones(8, np.float32), world.sharded())
    return world, aot.compile_step("toy", f, state, x, donate_argnums=0), state, x


def test_host_scalars_and_numpy_arrays_are_converted_when_safe():
    world, step, state, x = _step()
    state, _ = step(state, x)
    host = {"step": 1, "w": np.asarray(state["w"]).astype(np.float64), "b": np.ones(4, np.float32),
            "on": np.bool_(False)}
    new, _ = step(host, np.ones(8, np.float32))  # numpy batch too
    assert int(new["step"]) == 2 and new["step"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(new["w"]), np.full(4, 16.0, np.float32))
    assert bool(new["on"]) is True
    for v in (np.int64(5), np.uint8(5), 5):
        out, _ = step({**jax.tree_util.tree_map(np.asarray, new), "step": v}, x)
        assert int(out["step"]) == 6
    # an exact integer where a float leaf was compiled
    out, _ = step({"step": 0, "w": np.zeros(4, np.int64), "b": np.ones(4), "on": True}, x)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full(4, 8.0))
    # an uncommitted jax array (no device chosen) is placed as compiled
    out, _ = step({"step": jnp.int32(3), "w": jnp.zeros(4), "b": jnp.ones(4), "on": jnp.bool_(1)}, x)
    assert int(out["step"]) == 4


@pytest.mark.parametrize("field,value,match", [
    ("step", 1.5, r"\['step'\] is a float of dtype float64 but the step was compiled for \(\) int32"),
    ("step", 2 ** 40, r"\['step'\] holds a value not representable in int32"),
    ("step", np.zeros(2, np.int32), r"\['step'\] has shape \(2,\) but the step was compiled for \(\) int32"),
    ("w", np.full(4, 1e300), r"\['w'\] holds a value not representable in float32"),
    ("w", np.zeros(4, np.complex64), r"\['w'\] is a ndarray of dtype complex64"),
    ("w", np.full(4, 2 ** 30 + 1, np.int64), r"\['w'\] holds a value not representable in float32"),
    ("on", 1, r"\['on'\] is a int of dtype int64 but the step was compiled for \(\) bool"),
    ("w", "zeros", r"\['w'\] is a str, not an array"),
])
def test_unsafe_host_values_raise_naming_the_field_and_signature(field, value, match):
    _, step, state, x = _step()
    with pytest.raises(TypeError, match=match):
        step({**state, field: value}, x)
    assert not state["w"].is_deleted()  # refused before anything was donated


def test_jax_arrays_of_another_dtype_or_devices_are_refused():
    world, step, state, x = _step()
    with pytest.raises(TypeError, match=r"\['w'\] is \(4,\) float16 but the step was compiled "
                                        r"for \(4,\) float32"):
        step({**state, "w": jax.device_put(np.zeros(4, np.float16), world.replicated())}, x)
    other = jax.device_put(np.int32(0), jax.devices()[3])  # committed to one other device
    with pytest.raises(TypeError, match=r"\['step'\] has sharding .*devices \[3\]\) but the step "
                                        r"was compiled for .*devices \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        step({**state, "step": other}, x)


ALIAS_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    import jax, numpy as np
    from test_aot import _step
    world, step, state, x = _step()
    state, _ = step(state, x)                       # first call: distinct leaves
    shared = jax.device_put(np.ones(4, np.float32), world.replicated())
    for i in range(3):                              # later calls: two leaves, one buffer
        state, _ = step({**state, "w": shared, "b": shared}, x)
        shared = state["b"]
    reused = jax.device_put(np.arange(4, dtype=np.float32), world.replicated())
    alias = jax.device_put(reused, world.replicated())   # may reuse the source buffer
    state, _ = step({**state, "w": reused, "b": alias}, x)
    print("OK", int(state["step"]), np.asarray(state["w"]).tolist(), np.asarray(state["b"]).tolist())
""")


def test_aliased_leaves_on_a_later_call_do_not_crash(tmp_path):
    import os
    script = tmp_path / "alias.py"
    script.write_text(ALIAS_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script), root, os.path.join(root, "tests")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # step 5; w = arange + 8 (the batch sum); b = 2 * arange
    assert r.stdout.strip().splitlines()[-1] == "OK 5 [8.0, 9.0, 10.0, 11.0] [0.0, 2.0, 4.0, 6.0]"


def test_cpu_steps_compile_with_region_analysis_same_bits_fewer_copies():
    """compile_step compiles CPU steps with CPU_COMPILER_OPTIONS: copy insertion with region
    analysis drops the copies XLA made of momenta and kernels before updating them in the
    donated state (88 -> 22 per device-step in the main job), and changes no bit."""
    from helpers import random_batch, setup
    from trjax import exchange, steps

    world, model, plan, tx, state = setup("0-1", global_batch=16, bn_mode="running")
    fn = steps.make_train_step(model, exchange.allreduce(tx, plan), plan, world, "running")
    batch = jax.device_put(random_batch(16), world.sharded())
    assert aot.compiler_options((state, batch)) == aot.CPU_COMPILER_OPTIONS
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
    (state.INIT_CPU_COMPILER_OPTIONS: -O1, elemental emitters) gives the same bits; two train
    steps (aot.CPU_COMPILER_OPTIONS: -O1) stay within the rounding of a reordered sum (the
    main job's 180 steps gave the same bits; ResNet-8 on 2 devices differs in a few ulps),
    and an evaluation of the same state gives the same counts and loss sum to 1e-6."""
    from helpers import assert_within_reorder_rounding, random_batch, setup
    from trjax import exchange, state as state_lib, steps
    from trjax.metrics import METRICS

    defaults = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
    assert state_lib.INIT_CPU_COMPILER_OPTIONS["xla_backend_optimization_level"] == 1
    assert aot.CPU_COMPILER_OPTIONS["xla_backend_optimization_level"] == 1
    host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)

    def run():
        world, model, plan, tx, state = setup("0-1", global_batch=16, bn_mode="running")
        first = host(state)
        batch = jax.device_put(random_batch(16), world.sharded())
        train = aot.compile_step("train", steps.make_train_step(
            model, exchange.allreduce(tx, plan), plan, world, "running"), state, batch,
            donate_argnums=0)
        for _ in range(2):
            state, _ = train(state, batch)
        fold = aot.compile_step("fold", steps.make_fold_bn(world, "running"), state)
        acc = jax.device_put(np.zeros((2, len(METRICS)), np.float32), world.sharded())
        evaluate = aot.compile_step("eval", steps.make_eval_step(model, world, "running"),
                                    state.params, fold(state), batch, acc, donate_argnums=3)
        return first, state, lambda s: np.asarray(evaluate(s.params, fold(s), batch, acc.copy()))

    # conftest's XLA_FLAGS sets level 1, and compile_lowered lets a flag the user set win:
    # the flag hidden here, so that the options below are the ones in force
    monkeypatch.setenv("XLA_FLAGS", re.sub(r"--xla_backend_optimization_level=\S*", "",
                                           os.environ.get("XLA_FLAGS", "")))
    assert "xla_backend_optimization_level" not in aot.flags_set_in_env()
    first, ours, ours_eval = run()
    monkeypatch.setattr(state_lib, "INIT_CPU_COMPILER_OPTIONS", defaults)
    monkeypatch.setattr(aot, "CPU_COMPILER_OPTIONS", {**aot.CPU_COMPILER_OPTIONS, **defaults})
    first_ref, ref, ref_eval = run()
    for x, y in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(first_ref)):
        np.testing.assert_array_equal(x, y)
    assert_within_reorder_rounding(ours.params, ref.params, first.params, steps=2, rows=16)
    a, b = ours_eval(ref), ref_eval(ref)  # [device, (loss, top1, top5, count)] sums
    np.testing.assert_array_equal(a[:, 1:], b[:, 1:])
    np.testing.assert_allclose(a[:, 0], b[:, 0], rtol=1e-6)


def test_compile_lowered_drops_the_options_this_xla_does_not_know(monkeypatch):
    """XLA adds and removes compile options between jaxlib releases (jaxlib 0.12 has no
    xla_cpu_use_fusion_emitters): such an option is dropped, the known ones stay in force,
    and any other compile error is raised."""
    monkeypatch.setenv("XLA_FLAGS", "")  # conftest's level flag would win over the option
    lowered = jax.jit(lambda x: x + 1).lower(jnp.float32(1))
    compiled = aot.compile_lowered(lowered, {"xla_trjax_no_such_option": True,
                                             "xla_backend_optimization_level": 1})
    assert float(compiled(jnp.float32(2))) == 3.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="is not a valid int32 value"):
        aot.compile_lowered(lowered, {"xla_trjax_no_such_option": True,
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
    assert aot.flags_set_in_env() == {"xla_force_host_platform_device_count",
                                      "xla_backend_optimization_level"}
    assert aot.compile_lowered(Lowered(), aot.CPU_COMPILER_OPTIONS) == "compiled"
    assert seen[-1] == {"xla_cpu_copy_insertion_use_region_analysis": True}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    aot.compile_lowered(Lowered(), aot.CPU_COMPILER_OPTIONS)
    assert seen[-1] == aot.CPU_COMPILER_OPTIONS
