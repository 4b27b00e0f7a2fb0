"""The compiled step's contract on every call (issue 13 item 2): aliased donated leaves
de-aliased on later calls too (no crash), host scalars / numpy arrays converted when safe,
clear errors naming the leaf and the compiled signature otherwise."""
import os
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


@pytest.mark.job
def test_aliased_leaves_on_a_later_call_do_not_crash(tmp_path):
    script = tmp_path / "alias.py"
    script.write_text(ALIAS_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script), root, os.path.join(root, "tests")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # step 5; w = arange + 8 (the batch sum); b = 2 * arange
    assert r.stdout.strip().splitlines()[-1] == "OK 5 [8.0, 9.0, 10.0, 11.0] [0.0, 2.0, 4.0, 6.0]"
