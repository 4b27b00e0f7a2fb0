"""trjax.train.compilation: the persistent cache set-up and compile events filed by phase."""
import functools
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config
from trjax import aot
from trjax.train import compilation
from trjax.data import input_pipeline
from trjax.train import train_and_evaluate


def _fresh_compile(x):
    """A new jit object each call: jax lowers again and asks the backend (or the
    persistent cache) for the executable; jax's in-memory caches do not answer."""
    return jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0).lower(x).compile()


def test_program_key_matches_event_and_module_names():
    assert compilation.program_id("jit(<lambda>)") == compilation.program_id("jit__lambda")
    assert compilation.program_id("jit(local_step)") == "jit_local_step"
    assert compilation.program_id("jit(local_step)") != compilation.program_id("jit(local_fold)")


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation.default_cache_dir() == str(tmp_path / "trjax" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compilation.default_cache_dir() == os.path.expanduser("~/.cache/trjax/xla")


def test_cache_miss_then_hit_filed_by_phase_and_thread(tmp_path, restore_jax_cache):
    session_dir = jax.config.jax_compilation_cache_dir
    assert compilation.configure_cache(True, "")["source"] == "jax"  # the session's dir is kept
    assert jax.config.jax_compilation_cache_dir == session_dir
    info = compilation.configure_cache(True, str(tmp_path / "xla"))
    assert info == {"dir": str(tmp_path / "xla"), "source": "config"}
    x = np.arange(7, dtype=np.float32)
    with compilation.CompileLog("startup") as log:
        with log.phase("a"):
            _fresh_compile(x)  # empty cache: compiled and written
        with log.phase("b"):
            _fresh_compile(x)  # same program: loaded
        t = threading.Thread(target=_fresh_compile, args=(x,))
        t.start()
        t.join()
    _fresh_compile(x)  # after the log closed: not recorded
    assert [(b.phase, b.cache) for b in log.builds] == [("a", "miss"), ("b", "hit"),
                                                        (compilation.BACKGROUND, "hit")]
    assert log.writes == 1 and os.listdir(tmp_path / "xla")
    by = log.by_phase()
    assert by["a"]["compiled"] == 1 and by["b"] == {**by["b"], "built": 1, "compiled": 0,
                                                    "cache_hits": 1}
    s = log.cache_summary()
    assert (s["hits"], s["misses"], s["writes"], s["dir"]) == (2, 1, 1, str(tmp_path / "xla"))
    assert log.count("b") == 1 and log.count(None, program="jit(<lambda>)") == 3

    assert compilation.configure_cache(False) == {"dir": None, "source": "off"}
    with compilation.CompileLog() as off:
        _fresh_compile(x)  # in the cache, but the cache is off: compiled
    assert [b.cache for b in off.builds] == ["off"] and compilation.cache_dir() is None


ONE_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from trjax.train import compilation
compilation.configure_cache(True, sys.argv[1])
with compilation.CompileLog() as log:
    jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0).lower(np.arange(7, dtype=np.float32)).compile()
print(json.dumps(log.cache_summary()))
"""


@pytest.mark.job
def test_a_damaged_cache_entry_is_written_again_and_counted(tmp_path):
    """The field failure: a truncated entry (a process killed while jax wrote it) that jax
    cannot load, while its file exists, so jax's file cache never replaced it and every
    start compiled again. Three fresh processes on one cache: fill, repair, hit."""
    cache = tmp_path / "xla"
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

    def run():
        out = subprocess.run([sys.executable, "-c", ONE_PROGRAM, str(cache)], cwd=root,
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=root))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1]), out.stderr

    first, _ = run()
    assert (first["misses"], first["writes"], first["damaged"]) == (1, 1, 0)
    (entry,) = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    whole = entry.read_bytes()
    entry.write_bytes(whole[:len(whole) // 2])
    second, err = run()
    assert "Error reading persistent compilation cache entry" in err  # jax's warning
    assert (second["hits"], second["misses"], second["writes"], second["damaged"]) == \
        (0, 1, 1, 1)
    assert len(entry.read_bytes()) > len(whole) // 2  # written again (the third run loads it)
    third, err = run()
    assert (third["hits"], third["misses"], third["damaged"]) == (1, 0, 0), err[-2000:]


BEFORE_CONFIGURE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from trjax.train import compilation
# jax's own small programs, built before configure_cache and outside any CompileLog, on
# the cache jax opened from its environment (JAX_COMPILATION_CACHE_DIR)
jax.random.key(0)                                                        # jit(_threefry_seed)
jax.jit(lambda v: jnp.cos(v) - 2.0).lower(np.arange(5, dtype=np.float32)).compile()
assert compilation.configure_cache(True, "")["source"] == "jax"
with compilation.CompileLog() as log:
    jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0).lower(np.arange(7, dtype=np.float32)).compile()
print(json.dumps(log.cache_summary()))
"""


@pytest.mark.job
def test_every_damaged_entry_is_rewritten_also_those_built_before_the_log(tmp_path):
    """Issue 40: the repair covered only the programs built after configure_cache (those
    summary.json counts); the entries of jax's small programs built before it (the PRNG
    seed's, ...) stayed damaged, so every later start warned and compiled them again.
    Three fresh processes on one cache: fill, repair, and the third reads every entry."""
    cache = tmp_path / "xla"
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=root, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def run():
        out = subprocess.run([sys.executable, "-c", BEFORE_CONFIGURE], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1]), out.stderr

    first, _ = run()
    entries = sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))
    assert any(p.name.startswith("jit__threefry_seed") for p in entries), entries
    assert len(entries) >= 3 and (first["misses"], first["writes"]) == (1, 1)
    sizes = {}
    for p in entries:  # every entry truncated, as by a process killed while writing
        whole = p.read_bytes()
        p.write_bytes(whole[:len(whole) // 2])
        sizes[p.name] = len(whole) // 2
    second, err = run()
    assert "Error reading persistent compilation cache entry for 'jit__threefry_seed'" in err
    assert second["damaged"] == 1  # the log counts the repairs made while it is open
    assert all(p.stat().st_size > sizes[p.name] for p in entries)  # every one written again
    third, err = run()
    assert "Error reading persistent compilation cache entry" not in err, err[-2000:]
    assert (third["hits"], third["misses"], third["damaged"]) == (1, 0, 0)


def test_configure_cache_rejects_bad_values():
    with pytest.raises(ValueError, match="compilation_cache='yes' must be True or False"):
        compilation.configure_cache("yes")
    with pytest.raises(ValueError, match="compilation_cache_dir=3 must be a path"):
        compilation.configure_cache(True, 3)


def test_a_cache_folder_that_cannot_be_made_is_named_or_turned_off(tmp_path, monkeypatch,
                                                                   restore_jax_cache):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"config.compilation_cache_dir='.*afile/xla' cannot "
                                         r"be used: .*pass a writable folder"):
        compilation.configure_cache(True, str(afile / "xla"))
    # the default under a home directory where it cannot be made: a warning, no cache
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setattr(compilation, "default_cache_dir", lambda: str(afile / "trjax" / "xla"))
    with pytest.warns(UserWarning, match="compilation cache off: .*afile/trjax/xla cannot be used"):
        assert compilation.configure_cache(True, "") == {"dir": None, "source": "off"}
    assert compilation.cache_dir() is None


@pytest.mark.job
def test_second_process_with_the_same_cache_compiles_nothing(tiny_time_to_accuracy):
    """scripts/train.py twice on one --config.compilation_cache_dir: the first process
    (a fresh cache) compiles, the second loads every program from jax's persistent cache
    (it traces and lowers again). The two processes are the
    cold and warm runs of the session's tiny --time_to_accuracy (conftest), which
    launches exactly that pair (ResNet-8, 1 epoch, 2 devices)."""
    out, proc, _ = tiny_time_to_accuracy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = out / "tta_runs"
    cache = runs / "cache_warm"
    cold, warm = (json.loads((runs / f"r1_{v}" / "summary.json").read_text())
                  for v in ("cold", "warm"))
    step_names = ("train_step", "fold_bn", "eval_step", "eval_reduce")
    for s in (cold, warm):
        assert s["compilation_cache"]["dir"] == str(cache)
        assert s["compilation_cache"]["source"] == "config"
        assert s["compiles"] == {n: 1 for n in step_names}
        assert s["compiles_during_training"] == 0 and s["checkpoint_io_compiles"] == 0
    assert all(cold["compiles_by_phase"][n]["compiled"] == 1 for n in step_names)
    assert cold["compilation_cache"]["misses"] > 0 and cold["compilation_cache"]["writes"] > 0
    # a fresh process: every program comes from the cache, steps and start-up alike
    for n in step_names:
        assert warm["compiles_by_phase"][n] == {**warm["compiles_by_phase"][n], "built": 1,
                                                "compiled": 0, "cache_hits": 1}
    assert warm["compilation_cache"]["misses"] == 0 and warm["compilation_cache"]["writes"] == 0
    # every program (the four steps, the state initialisation, the learning-rate table)
    # from jax's cache
    assert warm["compilation_cache"]["hits"] == sum(
        p["built"] for p in warm["compiles_by_phase"].values()) >= 5
    assert cold["compilation_cache"]["hits"] == 0
    assert warm["compilation_cache"]["compile_s"] == 0.0


@pytest.mark.job
def test_summary_counts_are_measured_a_forced_compile_shows(tmp_path, monkeypatch):
    real_compile_step, real_to_device = aot.compile_step, input_pipeline.to_device

    def compile_train_step_twice(name, fn, *args, **kwargs):
        if name == "train_step":  # the same program under a new function object: built again
            real_compile_step(name, functools.wraps(fn)(lambda *a: fn(*a)), *args, **kwargs)
        return real_compile_step(name, fn, *args, **kwargs)

    forced = []

    def to_device_with_a_compile(*args, **kwargs):
        if not forced:  # one new program in the training loop
            forced.append(_fresh_compile(np.arange(5, dtype=np.float32)))
        return real_to_device(*args, **kwargs)

    monkeypatch.setattr(aot, "compile_step", compile_train_step_twice)
    monkeypatch.setattr(input_pipeline, "to_device", to_device_with_a_compile)
    _, s = train_and_evaluate(small_config(num_epochs=1, halt_after_steps=2), str(tmp_path))
    assert s["compiles"] == {"train_step": 2, "fold_bn": 1, "eval_step": 1, "eval_reduce": 1}
    assert s["compiles_during_training"] == 1
    assert s["compiles_by_phase"]["train"]["built"] == 1
    assert "evaluate" not in s["compiles_by_phase"] and s["checkpoint_io_compiles"] == 0


@pytest.mark.parametrize("bn_mode, shard", [("running", False), ("local", True)])
def test_train_state_is_one_program_with_rank0_bits(bn_mode, shard):
    """create_train_state builds ONE program (init, broadcast, optimizer and comm state),
    compiled at a lower XLA:CPU optimisation level, and its parameters are bit for bit
    model.init on rank 0's key compiled at jaxlib's default level; a key and the same
    int seed give the same state."""
    from trjax import exchange, models, optim, parallel
    from trjax.plan import build_plan
    from trjax.state import create_train_state, state_specs
    from trjax.world import make_world
    world = make_world("all", 32)
    # ResNet-8 cut to one BasicBlock of 8 channels: every layer kind's initialiser
    model = models.create_model("resnet8", num_classes=10, stage_sizes=(1,), widths=(8,),
                                stem_width=8, bn_mode=bn_mode, axis_name="data")
    plan = build_plan(model, (8, 8, 1))
    ex = (exchange.shard_optimizer_state(plan, world.world_size,
                                         lambda mask: optim.make_optimizer("sgd", 0.1, mask=mask))
          if shard else exchange.allreduce(optim.make_optimizer("sgd", 0.1, plan), plan))
    layout = parallel.data_parallel(model, world, (8, 8, 1), bn_mode)
    with compilation.CompileLog() as log:
        state = create_train_state(7, layout, ex, loss_scale=2.0)
    assert [compilation.program_id(b.program) for b in log.builds] == ["jit_create"]

    rank0 = jax.random.fold_in(jax.random.key(7), 0)
    ref = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8, 8, 1)), train=False))(rank0)
    for got, want in zip(jax.tree_util.tree_leaves(state.params),
                         jax.tree_util.tree_leaves(ref["params"]), strict=True):
        assert got.sharding.is_fully_replicated
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    n = world.world_size
    for got, want in zip(jax.tree_util.tree_leaves(state.batch_stats),
                         jax.tree_util.tree_leaves(ref["batch_stats"]), strict=True):
        expect = np.broadcast_to(want, (n,) + want.shape) if bn_mode == "local" else want
        assert np.array_equal(np.asarray(got), expect)
    P = jax.sharding.PartitionSpec

    def laid_out(spec, sub):  # every leaf as state_specs says (a pytree prefix)
        for x in jax.tree_util.tree_leaves(sub):
            assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(world.mesh, spec), x.ndim)
    jax.tree_util.tree_map(laid_out, state_specs(layout, ex), state,
                           is_leaf=lambda s: isinstance(s, P))
    assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(state.opt_state)
               if x.ndim)  # momentum starts at zero
    assert (int(state.step), int(state.skipped_steps), int(state.good_steps),
            float(state.loss_scale)) == (0, 0, 0, 2.0)
    again = create_train_state(jax.random.key(7), layout, ex, loss_scale=2.0)
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(state),
                    strict=True):
        assert a.sharding == b.sharding and np.asarray(a).tobytes() == np.asarray(b).tobytes()
