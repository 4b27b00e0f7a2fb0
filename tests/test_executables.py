"""The executable store: a warm start loads the compiled steps whole, untraced,
and they compute exactly what freshly compiled ones do; any change to what
determined a program gives another key; a damaged entry is compiled again."""
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import small_config

from trjax import aot, compilation, executables, input_pipeline, program_key, steps, trainer
from trjax.state import train_state_program
from trjax.world import make_world


def _store(tmp_path, context=("ctx",)):
    return executables.ExecutableStore(str(tmp_path / executables.SUBDIR), context)


def test_a_second_setup_loads_every_program_untraced_and_computes_the_same_bits(
        tmp_path, restore_jax_cache):
    compilation.configure_cache(True, str(tmp_path / "xla"))  # a cold cache: XLA compiles
    c = small_config(num_epochs=1)
    first = trainer.prepare(c)
    tr1 = trainer.setup(c, prepared=first,
                        store=_store(tmp_path, trainer.store_context(first)))
    names = sorted(f.split("-")[0] for f in os.listdir(tmp_path / executables.SUBDIR))
    assert names == ["create_train_state", "eval_reduce", "eval_step", "fold_bn", "train_step"]

    second = trainer.prepare(c)  # a new process would build these objects again
    other = tmp_path / executables.SUBDIR / "another-config"  # another config's program
    other.write_bytes(b"\0" * 1000)
    os.utime(other, (time.time() - 600, time.time() - 600))
    with compilation.CompileLog() as log:  # a limit below this run's own programs
        tr2 = trainer.setup(c, prepared=second, store=executables.ExecutableStore(
            str(tmp_path / executables.SUBDIR), trainer.store_context(second), max_bytes=1))
    assert [b.cache for b in log.builds] == ["store"] * 5, log.builds
    # the set-up evicted once at its end: the other config's program, none of its own
    assert sorted(f.split("-")[0] for f in os.listdir(tmp_path / executables.SUBDIR)) == names
    assert {compilation.program_key(b.program) for b in log.builds} == {
        "jit_create", *(compilation.program_key(compilation.step_program(s))
                        for s in tr2.compiled)}
    assert tr2.train_step.lowered_text == tr1.train_step.lowered_text

    world = tr1.world
    batches = list(input_pipeline.iterate_batches(tr1.data.train, world.global_batch_size,
                                                  shuffle=True, seed=0, epoch=1))[:2]
    results = []
    for tr in (tr1, tr2):
        state = tr.state
        for b in batches:
            before = state
            state, m = tr.train_step(state, input_pipeline.to_device(
                b, world.sharded(), tr.data.num_classes, tr.dtype))
            # a loaded train step donates the state as a compiled one does
            assert jax.tree_util.tree_leaves(before.params)[0].is_deleted()
        results.append((jax.tree_util.tree_map(np.asarray, state), np.asarray(m.to_host()),
                        trainer.evaluate_pass(tr, state)["sums"]))
    (s1, m1, e1), (s2, m2, e2) = results
    for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(m1, m2)
    assert e1 == e2


def _lowered_train_step(config) -> str:
    tr = trainer.prepare(config)
    init = train_state_program(config.seed, tr.model, tr.exchange, tr.world, tr.data.image_shape,
                               config.bn_mode)
    batch = {k: jax.ShapeDtypeStruct((config.global_batch_size,) + shape, dtype,
                                     sharding=tr.world.sharded())
             for k, shape, dtype in (("image", tr.data.image_shape, np.uint8),
                                     ("label", (), np.int32), ("mask", (), np.float32))}
    step = steps.make_train_step(tr.model, tr.exchange, tr.plan, tr.world, config.bn_mode,
                                 padding=not tr.full_batches)
    return jax.jit(step, donate_argnums=0).lower(init.abstract, batch).as_text()


def test_config_keys_left_out_of_the_key_do_not_enter_the_programs():
    """trainer.OUTSIDE_PROGRAMS (left out of the store's key): all of them changed at
    once, the train step lowers to the same text and the key context is the same."""
    changed = dict(checkpoint_async=False, checkpoint_every_steps=5, compilation_cache=False,
                   compilation_cache_dir="/elsewhere", data_workers=0,
                   executable_store=False, executable_store_max_mb=1, halt_after_steps=3, halt_on_nonfinite=True,
                   keep_checkpoints=1, log_every_steps=0, max_consecutive_overflows=2,
                   metrics_lag=2, preemption_check_every_steps=7, prefetch=0,
                   profile_steps="1:2", progress=False, resume=False, skip_bad_images=True,
                   step_timeout_s=60, tensorboard=False, verify_images=True)
    # data_dir: digits reads no folder (the data itself is described by the context)
    assert set(changed) == set(trainer.OUTSIDE_PROGRAMS) - {"distributed", "data_dir"}
    base, other = small_config(), small_config(**changed)
    other.distributed.coordinator = "localhost:1234"
    assert trainer.store_context(trainer.prepare(base)) == \
        trainer.store_context(trainer.prepare(other))
    assert _lowered_train_step(base) == _lowered_train_step(other)


def test_the_key_tells_the_masked_train_step_from_the_unmasked_one():
    """Whether the train step masks padding rows (Trainer.full_batches) is decided by the
    data too (a source given as data= that skips undecodable files keeps the mask under
    the same config): the store's key context carries it, so neither program is served
    for the other (found by a breaker: a skipping ImageFolder got the unmasked step)."""
    tr = trainer.prepare(small_config(train_remainder="drop"))
    assert tr.full_batches
    assert trainer.store_context(tr) != trainer.store_context(
        dataclasses.replace(tr, full_batches=False))


def _fn(x):
    return jnp.sin(x) * 2.0


def _other(x):
    return jnp.cos(x) * 2.0


def test_the_key_changes_with_everything_that_decides_the_program(tmp_path):
    world = make_world("all", 8)
    x = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=world.sharded())
    store = _store(tmp_path)
    key = store.key("f", _fn, (x,), (0,))
    assert key == _store(tmp_path).key("f", _fn, (x,), (0,))  # a new process: the same key
    y = jax.ShapeDtypeStruct((16, 3), jnp.float32, sharding=world.sharded())
    z = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=world.replicated())

    def closing_over(g):
        return lambda v: g(v)

    others = [store.key("g", _fn, (x,), (0,)),                     # name
              store.key("f", _other, (x,), (0,)),                  # code
              store.key("f", _fn, (y,), (0,)),                     # shape
              store.key("f", _fn, (x.update(dtype=jnp.bfloat16),), (0,)),  # dtype
              store.key("f", _fn, (z,), (0,)),                     # sharding
              store.key("f", _fn, (x,), ()),                       # donation
              store.key("f", _fn, (x,), (0,), {"xla_backend_optimization_level": 1}),
              _store(tmp_path, ("another config",)).key("f", _fn, (x,), (0,))]
    assert len({key, *others}) == len(others) + 1
    # a function closed over counts by its code (a step builder replaced in a test)
    assert store.key("f", closing_over(_fn), (x,)) != store.key("f", closing_over(_other), (x,))
    assert store.key("f", closing_over(_fn), (x,)) == store.key("f", closing_over(_fn), (x,))


def _sin2():
    """A new function object each call (jax's in-memory caches do not answer), the same code."""
    return lambda v: jnp.sin(v) * 2.0


def _one_stored_program(tmp_path):
    """``(world, x, store, first, path)``: ``_sin2`` compiled on 8 devices for ``x``
    and stored as the store's only entry, at ``path``."""
    world = make_world("all", 8)
    x = jax.device_put(np.arange(24, dtype=np.float32).reshape(8, 3), world.sharded())
    store = _store(tmp_path)
    first = aot.compile_step("f", _sin2(), x, store=store)
    (entry,) = os.listdir(tmp_path / executables.SUBDIR)
    return world, x, store, first, tmp_path / executables.SUBDIR / entry


def test_a_damaged_entry_is_reported_compiled_again_and_replaced(tmp_path):
    world, x, store, first, path = _one_stored_program(tmp_path)
    path.write_bytes(b"not a pickle")
    with pytest.warns(UserWarning, match=r"executable store entry .* is unreadable"):
        again = aot.compile_step("f", _sin2(), x, store=store)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))
    with compilation.CompileLog() as log, warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = aot.compile_step("f", _sin2(), x, store=store)  # the entry was written again
    assert [b.cache for b in log.builds] == ["store"]
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(first(x)))


def test_a_program_in_jax_cache_is_compiled_again_for_the_store(tmp_path, restore_jax_cache):
    """XLA:CPU cannot serialize an executable it loaded from jax's persistent cache
    again (the copy fails at its first call): the store compiles with jax's cache
    off, so a program jax has cached is compiled anew, stored, and its stored copy
    runs; jax's cache is on again afterwards. One that jax's in-memory cache
    answers (it may be such a loaded one) is not stored."""
    compilation.configure_cache(True, str(tmp_path / "xla"))  # every program cached
    world = make_world("all", 8)
    x = jax.device_put(np.arange(24, dtype=np.float32).reshape(8, 3), world.sharded())
    make = lambda: (lambda v: jnp.cos(v) * 5.0)  # new function objects, the same code
    fresh = aot.compile_step("f", make(), x)  # compiled, written to jax's cache
    with compilation.CompileLog() as log:
        aot.compile_step("f", make(), x)  # (without the store: served by jax's cache)
        stored = aot.compile_step("f", make(), x, store=_store(tmp_path))
        loaded = aot.compile_step("f", make(), x, store=_store(tmp_path))
    assert [b.cache for b in log.builds] == ["hit", "off", "store"]
    assert jax.config.jax_enable_compilation_cache
    for step in (stored, loaded):
        np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(fresh(x)))

    again = make()
    aot.compile_step("g", again, x)
    with compilation.CompileLog() as log:
        repeated = aot.compile_step("g", again, x, store=_store(tmp_path / "other"))
    assert log.builds == []  # jax's in-memory cache answered
    assert not os.path.exists(tmp_path / "other")  # nothing stored
    np.testing.assert_array_equal(np.asarray(repeated(x)), np.asarray(fresh(x)))


def test_open_store(tmp_path):
    assert executables.open_store(False, str(tmp_path), ()) is None
    assert executables.open_store(True, None, ()) is None  # the compilation cache is off
    store = executables.open_store(True, str(tmp_path), ())
    assert store.directory == str(tmp_path / executables.SUBDIR)
    with pytest.raises(ValueError, match="executable_store='yes' must be True or False"):
        executables.open_store("yes", str(tmp_path), ())


def test_flax_config_flags_are_in_the_key(tmp_path):
    """A flax flag (``FLAX_FIX_RNG_SEPARATOR`` in the environment) changes the keys
    ``model.init`` draws from, hence every initial parameter: an entry stored
    without it must not be loaded with it."""
    import flax
    import flax.linen as nn
    world = make_world("all", 8)
    x = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=world.sharded())

    def init():
        return nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 3)))["params"]["kernel"]

    key, params = _store(tmp_path).key("f", _fn, (x,)), np.asarray(init())
    with flax.config.temp_flip_flag("fix_rng_separator", not flax.config.flax_fix_rng_separator):
        assert not np.array_equal(np.asarray(init()), params)  # another program's result
        assert _store(tmp_path).key("f", _fn, (x,)) != key
    assert _store(tmp_path).key("f", _fn, (x,)) == key


def test_a_key_array_initialisation_is_stored_per_prng_impl(tmp_path):
    """``rbg`` and ``unsafe_rbg`` keys have the same key data (shape, dtype, bits) but
    draw different parameters: the state initialisation stored for one must not be
    loaded for the other (it equals its own compiled-without-store reference)."""
    c = small_config()
    tr = trainer.prepare(c)
    store = _store(tmp_path, trainer.store_context(tr))
    args = (tr.model, tr.exchange, tr.world, tr.data.image_shape, c.bn_mode)
    train_state_program(jax.random.key(0, impl="rbg"), *args, store=store).finish()  # stored
    key = jax.random.key(0, impl="unsafe_rbg")
    ref = train_state_program(key, *args).finish()
    got = train_state_program(key, *args, store=store).finish()
    for a, b in zip(jax.tree_util.tree_leaves(ref.params), jax.tree_util.tree_leaves(got.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(os.listdir(tmp_path / executables.SUBDIR)) == 2



def test_a_program_on_some_devices_is_loaded_onto_those(tmp_path):
    """jax loads a serialized executable onto every device unless told which: a program
    for fewer (one device here; ``config.devices="0-3"`` in a run) failed at its first
    call ("Expected args ... to have 8 shards, got: [1]"; with 4 of 8 devices XLA
    aborted the process: the fresh-process test below)."""
    x = np.arange(6, dtype=np.float32)
    store = _store(tmp_path)
    first = aot.compile_step("f", _sin2(), x, store=store)
    with compilation.CompileLog() as log:
        loaded = aot.compile_step("f", _sin2(), x, store=store)
    assert [b.cache for b in log.builds] == ["store"]
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(first(x)))


_LAPACK_SCRIPT = """
import json
import sys
import numpy as np
import jax.numpy as jnp
import jax
from trjax import aot, compilation, executables
from trjax.world import make_world

def orthonormal(x):  # a QR: a LAPACK custom call on CPU (as PowerSGD's step makes)
    return jnp.linalg.qr(x)[0]

def doubled(x):  # no LAPACK call
    return x * 2

def gram_factors(x):  # Cholesky and a symmetric eigensolver: two other LAPACK routines
    g = jnp.einsum("bij,bik->bjk", x, x) + jnp.eye(3)
    return jnp.linalg.cholesky(g) + jnp.linalg.eigh(g)[1]

world = make_world("2-5", 4)  # 4 of the 8 devices
x = jax.device_put(np.arange(48, dtype=np.float32).reshape(4, 4, 3) + np.eye(4, 3, dtype=np.float32),
                   world.sharded())
with compilation.CompileLog() as log:
    step = aot.compile_step(sys.argv[2], {"qr": orthonormal, "double": doubled,
                                                     "gram": gram_factors}[sys.argv[2]], x,
                            store=executables.ExecutableStore(sys.argv[1], ("qr",)))
out = np.asarray(step(x)).tolist()
print(json.dumps([[b.cache for b in log.builds], out, "scipy.linalg" in sys.modules]))
"""


def test_a_program_calling_lapack_runs_when_loaded_in_a_fresh_process(tmp_path):
    """A fresh process loads what another stored and runs it: on the devices it was
    built for (4 of 8, in a world's mesh) and with jaxlib's LAPACK kernels filled in
    (jaxlib does that when a program calling them is lowered; a process that traces
    nothing crashed with a segmentation fault at the first call: PowerSGD's step)."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
        os.path.abspath(executables.__file__)))}
    runs = [subprocess.run([sys.executable, "-c", _LAPACK_SCRIPT, str(tmp_path / "store"), name],
                           env=env, capture_output=True, text=True, timeout=120)
            for name in ("qr", "qr", "double", "double", "gram", "gram")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    (built, q, _), (loaded, again, lapack_set_up), (_, d, _), (loaded_d, d_again, scipy_in), \
        (_, g, _), (loaded_g, g_again, _) = (json.loads(r.stdout.splitlines()[-1]) for r in runs)
    assert loaded_g == ["store"] and g_again == g  # potrf and syevd: set up as well
    assert built == ["off"] and loaded == ["store"], (built, loaded)  # compiled, then loaded
    assert again == q and lapack_set_up  # the kernels' pointers come from scipy's LAPACK
    for m in np.asarray(q):
        np.testing.assert_allclose(m.T @ m, np.eye(3), atol=1e-5)
    # a program without LAPACK calls loads without that set-up (scipy: 0.19 s of a warm start)
    assert loaded_d == ["store"] and d_again == d and not scipy_in


def test_no_store_when_trjax_changed_on_disk_since_import(tmp_path, monkeypatch):
    """A run keys its programs by trjax's source as it imported it; when the files on
    disk differ by the time it opens the store (a branch switched while it loaded its
    data), its programs are the old code's (and a module imported later the new one's):
    no store, a warning. It stored them under the new code's key, and the next run of
    the new code loaded them (val top-1 0.303 against 0.367: the BN epsilon edited)."""
    import trjax
    assert program_key.source_digest() == trjax.SOURCE_DIGEST == trjax.source_digest_on_disk()
    assert executables.open_store(True, str(tmp_path), ()) is not None
    monkeypatch.setattr(trjax, "SOURCE_DIGEST", "the digest of other files")
    with pytest.warns(UserWarning, match="source files changed since this process imported"):
        assert executables.open_store(True, str(tmp_path), ()) is None


def test_a_copied_cache_dir_keeps_its_keys(tmp_path, restore_jax_cache):
    """Where and how jax caches is left out of the key: the same program in a cache
    dir copied or moved elsewhere is found."""
    world = make_world("all", 8)
    x = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=world.sharded())
    keys = []
    for d in ("a", "b"):
        compilation.configure_cache(True, str(tmp_path / d))
        keys.append(_store(tmp_path / d).key("f", _fn, (x,)))
    assert keys[0] == keys[1]


def test_a_stored_initialisation_loads_beside_the_steps_and_a_damaged_one_compiles(
        tmp_path, restore_jax_cache):
    """The state initialisation's results are known from its entry's record before it is
    loaded (trainer.setup loads it on its own thread beside the steps); an entry whose
    record reads but whose executable does not is reported and compiled again on that
    thread, with the same bits; a record that does not read falls back to loading."""
    import pickle
    compilation.configure_cache(True, str(tmp_path / "xla"))
    c = small_config(num_epochs=1)
    tr = trainer.prepare(c)
    store = _store(tmp_path, trainer.store_context(tr))
    make = lambda: train_state_program(c.seed, tr.model, tr.exchange, tr.world,
                                       tr.data.image_shape, c.bn_mode, store=store)
    first = make()
    reference = jax.tree_util.tree_map(np.asarray, first.finish())
    (entry,) = [f for f in os.listdir(tmp_path / executables.SUBDIR)
                if f.startswith("create_train_state")]
    path = tmp_path / executables.SUBDIR / entry
    key = entry
    assert program_key.describe(store.out_info(key, tr.world.mesh)) == \
        program_key.describe(first.abstract)
    import hashlib
    digest, body = pickle.loads(path.read_bytes())
    fields = list(pickle.loads(body))
    fields[0] = b"not an executable"  # with a valid digest: only the executable fails
    body = pickle.dumps(tuple(fields))
    path.write_bytes(pickle.dumps((hashlib.sha256(body).hexdigest(), body)))
    program = make()  # the record still reads: the results are known, nothing loaded yet
    assert program_key.describe(program.abstract) == program_key.describe(first.abstract)
    with pytest.warns(UserWarning, match=r"executable store entry .* is unreadable"):
        state = program.finish()
    for a, b in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    with compilation.CompileLog() as log:  # compiled again and stored
        make().finish()
    assert [b.cache for b in log.builds] == ["store"]
    path.write_bytes(b"not a pickle")  # no record: loaded (here: compiled) before returning
    with pytest.warns(UserWarning, match=r"executable store entry .* is unreadable"):
        program = make()
    assert program_key.describe(program.abstract) == program_key.describe(first.abstract)


def test_a_flipped_bit_in_an_entry_is_caught_by_its_digest(tmp_path):
    """One flipped bit anywhere in an entry's body (the executable, its trees, its record):
    the SHA-256 written with it differs, the entry is reported and compiled again, and the
    result is what the first compile computed."""
    import pickle
    world, x, store, first, path = _one_stored_program(tmp_path)
    digest, body = pickle.loads(path.read_bytes())
    for where in (len(body) // 3, len(body) - 5):
        flipped = bytearray(body)
        flipped[where] ^= 0x10
        path.write_bytes(pickle.dumps((digest, bytes(flipped))))
        assert store.out_info(path.name, world.mesh) is None
        with pytest.warns(UserWarning, match=r"is unreadable \(ValueError: its SHA-256 is not "
                                             r"the one written with it"):
            again = aot.compile_step("f", _sin2(), x, store=store)
        np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))


def test_the_store_evicts_least_recently_used_entries_beyond_its_limit(tmp_path, monkeypatch):
    """Entries by hand (sizes and ages set): a write beyond ``max_bytes`` deletes the least
    recently used ones, never one this process wrote or loaded; a load marks its entry
    used; a writer's temporary file goes once an hour old."""
    world, x, store, first, path = _one_stored_program(tmp_path)
    size = path.stat().st_size
    folder, now = path.parent, time.time()
    for i, name in enumerate(["old-a", "old-b", "old-c"]):  # another process's entries
        (folder / name).write_bytes(b"\0" * 1000)
        os.utime(folder / name, (now - 300 + i, now - 300 + i))  # old-a least recent
    (folder / "a-folder").mkdir()  # not an entry: left alone
    hexkey = "0123456789" * 4
    killed, writing = f".f-{hexkey}.kx3q_a1", f".g-{hexkey}.zz9_b2"  # save's temporary names
    for name, age in ((killed, 7200), (writing, 60), (".user-notes", 7200)):
        (folder / name).write_bytes(b"\0" * 10)
        os.utime(folder / name, (now - age, now - age))
    # a new process with a limit that holds the program and two of the three others
    other = executables.ExecutableStore(str(folder), ("ctx",), max_bytes=size + 2000)
    assert other.load(path.name) is not None  # marks the program used (now)
    os.utime(path, (now - 1000, now - 1000))  # oldest on disk, but this process loaded it
    assert other.evict() == [killed, "old-a"]  # an old hidden file not named as save's stays
    assert sorted(os.listdir(folder)) == sorted([path.name, "old-b", "old-c", writing,
                                                 "a-folder", ".user-notes"])
    other.max_bytes = 1  # even alone over the limit, the entry in use stays
    assert other.evict() == ["old-b", "old-c"]
    assert sorted(os.listdir(folder)) == sorted([path.name, writing, "a-folder", ".user-notes"])
    # a write does not evict (trainer.setup evicts once, at its end); the writer's evict
    # keeps what it wrote
    (folder / "old-d").write_bytes(b"\0" * 1000)
    os.utime(folder / "old-d", (now - 50, now - 50))
    writer = executables.ExecutableStore(str(folder), ("ctx",), max_bytes=1)
    assert writer.save(path.name, first.compiled, "m", "text")
    assert (folder / "old-d").exists()
    assert writer.evict() == ["old-d"]
    assert sorted(os.listdir(folder)) == sorted([path.name, writing, "a-folder", ".user-notes"])
    (folder / "old-e").write_bytes(b"\0" * 1000)

    def refused(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(os, "unlink", refused)  # a folder it may not write to (as a user)
    assert writer.evict() == [] and (folder / "old-e").exists()  # nothing raised


def test_the_store_size_limit_is_checked():
    for bad in (0, -5, float("inf"), "1024", True, None):
        with pytest.raises(ValueError, match=r"config.executable_store_max_mb=.* must be a number"):
            executables.open_store(True, "/tmp", ("ctx",), bad)


def test_the_store_eviction_skips_what_it_cannot_delete_and_leaves_links(tmp_path, monkeypatch):
    """An entry it may not delete (another user's, in a shared folder with the sticky bit)
    does not count as freed: the next least recently used goes instead. A symbolic link is
    not a regular file: left alone, and its target's size not counted."""
    folder, now = tmp_path / "store", time.time()
    folder.mkdir()
    for i, name in enumerate(["theirs", "old-a", "old-b"]):  # least recently used first
        (folder / name).write_bytes(b"\0" * 1000)
        os.utime(folder / name, (now - 300 + i, now - 300 + i))
    target = tmp_path / "outside"
    target.write_bytes(b"\0" * 5000)
    (folder / "a-link").symlink_to(target)
    os.utime(folder / "a-link", (now - 1000, now - 1000), follow_symlinks=False)
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) == "theirs":
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *args, **kwargs)
    monkeypatch.setattr(os, "unlink", unlink)
    store = executables.ExecutableStore(str(folder), ("ctx",), max_bytes=2000)
    assert store.evict() == ["old-a"]  # 3000 bytes of entries, "theirs" stays: "old-a" goes
    assert sorted(os.listdir(folder)) == ["a-link", "old-b", "theirs"]
    assert target.exists()


def test_an_entry_another_process_evicts_while_it_is_looked_up_is_compiled_quietly(
        tmp_path, monkeypatch):
    """Another process's eviction may delete an entry between the store's check that it
    exists and its read: that is an absent entry (compiled, stored again), not a damaged
    one (it was reported as "unreadable")."""
    world, x, store, first, path = _one_stored_program(tmp_path)
    real_read = executables._read_entry

    def evicted_first(p):
        os.unlink(p)  # the other process's evict() wins the race
        return real_read(p)
    monkeypatch.setattr(executables, "_read_entry", evicted_first)
    fresh = executables.ExecutableStore(store.directory, ("ctx",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.load(path.name) is None
    monkeypatch.setattr(executables, "_read_entry", real_read)
    with compilation.CompileLog() as log, warnings.catch_warnings():
        warnings.simplefilter("error")
        again = aot.compile_step("f", _sin2(), x, store=store)
    assert [b.cache for b in log.builds] != ["store"] and path.exists()  # compiled, stored
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))


def test_a_huge_finite_store_limit_is_no_limit(tmp_path):
    """config.validate lets any finite limit through; in bytes 1e305 MB overflowed a float
    and open_store raised a bare OverflowError ("cannot convert float infinity to integer")."""
    for mb in (1e305, 1.7e308):
        store = executables.open_store(True, str(tmp_path), ("ctx",), mb)
        assert store is not None and store.max_bytes >= 2 ** 63 - 1
    assert executables.open_store(True, str(tmp_path), ("ctx",), 0.5).max_bytes == 1 << 19


def test_the_store_keeps_an_entry_this_process_is_about_to_load(tmp_path):
    """trjax.trainer.setup loads the state initialisation's entry on a thread (its key and
    results' record taken first) while the main thread compiles and saves a missing step:
    that save's eviction deleted the entry about to be loaded, when it was the least
    recently used, and the initialisation was compiled again."""
    world, x, store, first, path = _one_stored_program(tmp_path)
    old = time.time() - 600
    os.utime(path, (old, old))  # the least recently used entry
    fresh = executables.ExecutableStore(store.directory, ("ctx",), max_bytes=1)
    key = fresh.key("f", _sin2(), (x,), (), aot.compiler_options((x,)))  # as compile_step keys it
    assert key == path.name and fresh.out_info(key, world.mesh) is not None
    fresh.save("another-program", first.compiled, "m", "text")  # the other thread's save
    assert fresh.evict() == [] and path.exists() and fresh.load(key) is not None
