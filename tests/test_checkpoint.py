"""Checkpoints: exact resume, another device count, corrupt and incompatible checkpoints,
the stored format (plain orbax pytrees, per-leaf checksums)."""
import json
import os
import zlib

import jax
import numpy as np
import pytest

from helpers import (assert_within_reorder_rounding, save_stand_in_checkpoint,
                     skip_train_step_compile, small_config, to_host)
from trjax.train import checkpoint, compilation
from trjax.train.config import CHECKPOINT_KEYS
from trjax.data import input_pipeline
from trjax.train import setup, train_and_evaluate


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(to_host(tree))]


CUT = dict(num_epochs=1, checkpoint_every_steps=4)  # 12 steps of 128 digits


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted one-epoch run (checkpoints every 4 steps): ``(state, summary)``."""
    return train_and_evaluate(small_config(**CUT), str(tmp_path_factory.mktemp("whole")))


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """The same run halted after step 7 (asynchronous saves at 4 and 7): ``(workdir, state,
    summary)``; tests copy the workdir before they write into it."""
    work = tmp_path_factory.mktemp("cut")
    state, summary = train_and_evaluate(small_config(halt_after_steps=7, **CUT), str(work))
    return work, state, summary


def _copy(src, dst, drop=()):
    """A copy of the workdir ``src`` at ``dst`` without the checkpoints ``drop``."""
    import shutil
    shutil.copytree(src, dst)
    for step in drop:
        shutil.rmtree(dst / "checkpoints" / str(step))
    return dst


@pytest.mark.job
def test_resume_mid_epoch_after_falling_back_from_a_truncated_checkpoint_is_bitwise_exact(
        whole, cut, tmp_path, capsys):
    """A mid-epoch halt (step 7, after a periodic save at 4) resumes bit for bit what the
    uninterrupted run computes; and a truncated newest checkpoint is moved aside (kept for
    inspection), the run falls back to the previous one (4), trains 5..7 again and saves
    7 again, from which the resume runs to the end: both resumes exact.
    (test_resume_mid_epoch_is_bitwise_exact and
    test_truncated_newest_checkpoint_falls_back_to_previous, merged: one halted run.)"""
    full, s_full = whole
    _, _, s_part = cut
    assert s_part["halted"] and s_part["steps"] == 7
    assert s_part["checkpoint_async"] and s_part["checkpoint_io_compiles"] == 0
    assert sorted(os.listdir(cut[0] / "checkpoints")) == ["4", "7"]
    work = _copy(cut[0], tmp_path / "cut")
    newest = work / "checkpoints" / "7"
    files = [os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs]
    for f in files:  # truncate every file of the newest checkpoint
        with open(f, "r+b") as fh:
            fh.truncate(max(0, os.path.getsize(f) // 3))
    truncated = [os.path.getsize(f) for f in files]
    # the run falls back to step 4 and saves at step 7 again: the unreadable one is moved
    # aside, not in the way of the new save
    capsys.readouterr()
    _, s = train_and_evaluate(small_config(halt_after_steps=7, **CUT), str(work))
    out = capsys.readouterr().out
    assert f"checkpoint {newest} is unreadable" in out and "resumed from step 4" in out
    assert f"moved the unreadable checkpoint {newest} to {newest}.unreadable" in out
    assert s["steps"] == 7
    assert sorted(os.listdir(work / "checkpoints")) == ["4", "7", "7.unreadable"]
    moved = [f.replace(str(newest), str(newest) + ".unreadable") for f in files]
    assert [os.path.getsize(f) for f in moved] == truncated  # its files as they were
    resumed, s_res = train_and_evaluate(small_config(**CUT), str(work))
    assert "resumed from step 7" in capsys.readouterr().out
    assert s_res["steps"] == s_full["steps"] == 12
    for name in ("params", "batch_stats", "opt_state"):
        assert _bits(getattr(resumed, name)) == _bits(getattr(full, name)), name
    assert s_res["val_top1"] == s_full["val_top1"]


@pytest.mark.job
def test_restore_on_another_device_count(tmp_path):
    """A checkpoint written on 8 devices restores on 4 with every leaf bitwise what was
    saved, and its next step on 4 devices lands where the same step on 8 does, up to the
    fp32 rounding of reductions done in another order: both take ONE step (step 4) from the
    same restored state (step 3's checkpoint), so helpers.reorder_rounding_bound applies
    (64 rows x 64 positions summed by the stem's BN and kernel gradient; measured: the
    step differs by about one ulp). One step on purpose: over 7 steps the training
    dynamics amplified that ulp to 55x a one-step bound on one Xeon host (issue 36), to
    within it on others. The 8-device run saves every step: its step 4 is the reference,
    its checkpoint 3 the common start (each save bitwise the device state: checked here
    for step 4)."""
    import flax.serialization
    cfg = dict(num_epochs=2, bn_mode="sync", global_batch_size=64, eval_batch_size=64,
               checkpoint_every_steps=1)
    on8, s8 = train_and_evaluate(small_config(devices="8", halt_after_steps=4, **cfg),
                                 str(tmp_path / "a"))
    template = to_host(on8)
    read = lambda d, k: flax.serialization.from_state_dict(
        template, checkpoint.read(str(d / "checkpoints"), k)[0])
    assert _bits(read(tmp_path / "a", 4)) == _bits(on8)  # the save is the device state
    start = read(tmp_path / "a", 3)
    _copy(tmp_path / "a", tmp_path / "b", drop=[4])
    _copy(tmp_path / "a", tmp_path / "c", drop=[4])
    on4, s4 = train_and_evaluate(small_config(devices="4", halt_after_steps=4, **cfg),
                                 str(tmp_path / "b"))
    assert s4["world_size"] == 4 and s4["steps"] == s8["steps"] == 4
    # the restore itself is exact: step 3's checkpoint onto the 4-device run's shardings
    restored, meta = checkpoint.restore_latest(
        checkpoint.manager(str(tmp_path / "c" / "checkpoints")), on4,
        {k: small_config(**cfg)[k] for k in CHECKPOINT_KEYS})
    assert meta["world_size"] == 8 and int(restored.step) == 3
    assert {x.sharding.num_devices for x in jax.tree_util.tree_leaves(restored)
            if isinstance(x, jax.Array)} == {4}
    assert _bits(restored) == _bits(start)
    tree = lambda s: (s.params, s.batch_stats, s.opt_state)
    worst = assert_within_reorder_rounding(tree(to_host(on4)), tree(to_host(on8)), tree(start),
                                           rows=64 * 64)
    print(f"max |p4 - p8| / bound = {worst:.3g}")


@pytest.mark.job
def test_incompatible_checkpoint_is_a_clear_error_before_compiling(cut, tmp_path, monkeypatch):
    work = _copy(cut[0], tmp_path / "w")  # model resnet8, learning_rate 0.2, step 7
    from trjax import aot
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    # WORKDIR/config.json names every key that differs, in one message
    with pytest.raises(ValueError, match=r"differs from the one the run .* was started with "
                                         r".*learning_rate: 0.2 -> 0.05, model: 'resnet8' -> "
                                         r"'resnet20'; resume with the same values"):
        train_and_evaluate(small_config(num_epochs=1, model="resnet20", learning_rate=0.05),
                           str(work))
    with pytest.raises(ValueError, match=r"learning_rate: 0.2 -> 0.1; resume with the same"):
        train_and_evaluate(small_config(num_epochs=1, learning_rate=0.1), str(work))
    saved = json.load(open(work / "config.json"))  # a refused resume leaves it as it was
    assert saved["learning_rate"] == 0.2 and saved["model"] == "resnet8"
    # without config.json (a workdir from before it existed) the checkpoint's own record
    os.remove(work / "config.json")
    with pytest.raises(ValueError, match=r"checkpoint .*7 is incompatible with this config: "
                                         r"model: checkpoint 'resnet8' vs now 'resnet20'"):
        train_and_evaluate(small_config(num_epochs=1, model="resnet20"), str(work))
    assert (work / "checkpoints" / "7").exists()


@pytest.mark.job
def test_sync_saves_resume_bitwise_like_async(cut, tmp_path):
    """The halted run of ``cut`` (asynchronous saves) and the same run with synchronous
    saves: each checkpoint restores what was on the devices at the save, bit for bit."""
    work, a, _ = cut
    b, s_b = train_and_evaluate(small_config(checkpoint_async=False, halt_after_steps=7, **CUT),
                                str(tmp_path / "sync"))
    assert not s_b["checkpoint_async"] and s_b["checkpoint_io_compiles"] == 0
    restored = []
    for d, st in ((work, a), (tmp_path / "sync", b)):
        mngr = checkpoint.manager(str(d / "checkpoints"))
        state, meta = checkpoint.restore_latest(mngr, st, {})
        assert (meta["epoch"], meta["batch"]) == (1, 7) and checkpoint.CHECKSUMS_KEY in meta
        assert _bits(state) == _bits(st)  # what was on the devices at the save, bit for bit
        restored.append(state)
    assert _bits(restored[0]) == _bits(restored[1])


def test_async_save_does_not_read_buffers_the_next_step_donates(tmp_path):
    tr = setup(small_config(num_epochs=1))
    state = tr.state
    data = tr.data
    batch = next(input_pipeline.iterate_batches(data.train, 128, shuffle=True, seed=0, epoch=1))
    on_device = lambda: input_pipeline.to_device(batch, tr.world.sharded(), data.num_classes,
                                                 tr.dtype)
    state, _ = tr.train_step(state, on_device())
    expected = _bits(state)
    mngr = checkpoint.manager(str(tmp_path), asynchronous=True)
    with compilation.CompileLog("save") as log:
        checkpoint.save(mngr, state, {"epoch": 1, "batch": 1})
    assert log.count() == 0  # no slicing programs (orbax compiled 96 on device arrays)
    for _ in range(3):  # donates the saved state's buffers while the writer may still run
        state, _ = tr.train_step(state, on_device())
    checkpoint.finish(mngr)
    restored, meta = checkpoint.restore_latest(mngr, state, {})
    assert _bits(restored) == expected and _bits(state) != expected


@pytest.mark.job
def test_failed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    import orbax.checkpoint as ocp
    real = ocp.type_handlers.NumpyHandler.serialize
    calls = []

    async def fail_second_save(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk full (injected)")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "serialize", fail_second_save)
    cfg = dict(num_epochs=1, checkpoint_every_steps=2, keep_checkpoints=1)
    with pytest.raises(OSError, match="disk full"):
        train_and_evaluate(small_config(**cfg), str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints"))[0] == "2"  # the failed one never replaced it
    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "serialize", real)
    capsys.readouterr()
    _, s = train_and_evaluate(small_config(halt_after_steps=3, **cfg), str(tmp_path))
    assert "resumed from step 2 (epoch 1, batch 2)" in capsys.readouterr().out
    assert s["steps"] == 3


def test_sharded_leaves_round_trip_through_the_host_copy(tmp_path, monkeypatch):
    # local BN statistics [world, C] and ZeRO-1 optimizer shards are per device:
    # the host copy assembles them, the restore shards them again (the state only: no step)
    skip_train_step_compile(monkeypatch)
    tr = setup(small_config(bn_mode="local", shard_optimizer_state=True))
    sharded = [x for x in jax.tree_util.tree_leaves(tr.state) if not x.is_fully_replicated]
    assert sharded
    mngr = checkpoint.manager(str(tmp_path))
    checkpoint.save(mngr, tr.state, {"epoch": 1, "batch": 0})
    checkpoint.finish(mngr)
    restored, _ = checkpoint.restore_latest(mngr, tr.state, {})
    assert _bits(restored) == _bits(tr.state)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(tr.state)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_a_fresh_run_into_a_workdir_with_checkpoints_is_refused(tmp_path, monkeypatch):
    """resume=False where checkpoints exist would restart at step 0 and overwrite them and
    the logs: an error naming the folder, before anything is compiled or written."""
    from trjax import aot
    (tmp_path / "checkpoints" / "12").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "step": 12}\n')
    compiled = []
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: compiled.append(a))
    with pytest.raises(ValueError, match=r"config.resume=False but .*checkpoints holds "
                                         r"checkpoints \(\['12'\]\).*use a new --workdir"):
        train_and_evaluate(small_config(resume=False), str(tmp_path))
    assert not compiled
    assert os.listdir(tmp_path / "checkpoints") == ["12"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"epoch": 1, "step": 12}\n'
    # the lock file stays (the kernel's flock, released; trjax.train.workdir)
    assert sorted(set(os.listdir(tmp_path)) - {"trjax.lock"}) == ["checkpoints", "metrics.jsonl"]


def test_per_device_state_resumes_only_on_its_world_size(tmp_path, monkeypatch):
    """local BN rows, compression error feedback and ZeRO-1 shards are one per device: a
    resume on another device count is an error naming the world sizes, before compiling.
    The checkpoint is one the 8-device run would write (its meta: the config's fields, the
    exchange's keys, world_size 8) around a stand-in state: only the meta is read."""
    from trjax import aot
    from trjax.train import prepare
    from trjax.train.trainer import checkpoint_keys
    cfg = small_config(bn_mode="local", num_epochs=1)
    meta = {**checkpoint_keys(prepare(cfg)), "world_size": 8, "epoch": 1, "batch": 1}
    save_stand_in_checkpoint(tmp_path, meta)
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=r"incompatible with this config: world_size: "
                                         r"checkpoint 8 vs now 4"):
        train_and_evaluate(small_config(bn_mode="local", num_epochs=1, devices="4"),
                           str(tmp_path))
    # the same world size passes this check (and would go on to restore)
    mngr = checkpoint.manager(str(tmp_path / "checkpoints"))
    checkpoint.check_compatible(mngr, {**{k: v for k, v in meta.items()
                                          if k not in ("epoch", "batch")}})


@pytest.mark.job
@pytest.mark.parametrize("exchange", [dict(compression="powersgd")])  # ZeRO-1's shards: the
def test_resume_may_switch_conv_lowering_with_bucket_shaped_state(exchange, tmp_path):  # same key
    """conv_lowering may change on resume (config.RESUME_MAY_CHANGE): the buckets, hence
    PowerSGD's error feedback, are laid out the same under both lowerings, so the resume
    runs and its one step lands where the same step with the run's own lowering does (the
    run's own step 3, from the checkpoint at 2 it saved: an exact resume's, bit for bit;
    the two lowerings differ by float rounding only; one step from the same state, so the
    fixed tolerance is a one-step one)."""
    cfg = dict(num_epochs=1, log_every_steps=0, checkpoint_every_steps=1, **exchange)
    same, _ = train_and_evaluate(small_config(conv_lowering="xla", halt_after_steps=3, **cfg),
                                 str(tmp_path / "a"))
    _copy(tmp_path / "a", tmp_path / "b", drop=[3])
    switched, _ = train_and_evaluate(small_config(conv_lowering="im2col", halt_after_steps=3,
                                                  **cfg), str(tmp_path / "b"))
    meta = checkpoint.newest_meta(checkpoint.manager(str(tmp_path / "b" / "checkpoints")))
    assert meta[0].endswith("3") and meta[1]["world_size"] == 8
    for name in ("params", "opt_state"):
        for a, b in zip(jax.tree_util.tree_leaves(to_host(getattr(switched, name))),
                        jax.tree_util.tree_leaves(to_host(getattr(same, name)))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def _stand_in(step=1, **params):
    """A train state of small replicated jax arrays (no model): checkpoint mechanics only."""
    from trjax.state import TrainState
    one = jax.device_put(np.ones((), np.int32))
    params = params or {"w": np.arange(3, dtype=np.float32), "b": np.float32(0.5)}
    return TrainState(step=jax.device_put(np.int32(step)),
                      params={k: jax.device_put(v) for k, v in params.items()},
                      batch_stats={}, opt_state={"mu": jax.device_put(np.full(3, 2, np.float32))},
                      skipped_steps=one, loss_scale=jax.device_put(np.float32(1)),
                      good_steps=one)

def test_every_kind_of_leaf_round_trips_bit_for_bit(tmp_path):
    """0-d, bfloat16, empty dicts, None and zero-size leaves (orbax refuses to store an empty
    array: the state item holds None in its place, the meta its shape and dtype) come back
    exact, of their shape and dtype, from restore_latest and from read."""
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    state = _stand_in(step=3, kernel=rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
                      half=rng.normal(size=(5,)).astype(jnp.bfloat16),
                      nothing=np.zeros((0, 3), np.float32), e=np.zeros((0, 4), np.int8))
    assert state.batch_stats == {} and state.comm_state is None
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d)
    checkpoint.save(mngr, state, {"epoch": 1, "batch": 3})
    checkpoint.finish(mngr)
    restored, meta = checkpoint.restore_latest(mngr, state, {})
    assert meta[checkpoint.EMPTY_KEY] == {"params/nothing": [[0, 3], "float32"],
                                          "params/e": [[0, 4], "int8"]}
    assert restored.params["e"].shape == (0, 4) and restored.params["e"].dtype == np.int8
    assert restored.batch_stats == {} and restored.comm_state is None
    want = jax.tree_util.tree_leaves_with_path(to_host(state))
    got = jax.tree_util.tree_leaves_with_path(to_host(restored))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(want, got):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    tree = checkpoint.read(d)[0]
    assert (tree["params"]["e"].shape, tree["params"]["e"].dtype) == ((0, 4), np.int8)
    assert tree["params"]["half"].dtype == jnp.bfloat16 and tree["comm_state"] is None
    assert _bits(tree["params"]) == _bits(state.params)


def test_a_checkpoint_restores_by_name_with_orbax_alone(tmp_path):
    """The state item is flax's state dict of the train state, one array per leaf: orbax
    restores it by name onto the devices, given the abstract state dict; the meta item
    holds each leaf's zlib.crc32 under its '/'-joined path."""
    import flax.serialization
    import orbax.checkpoint as ocp
    state = _stand_in(step=3)
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d)
    checkpoint.save(mngr, state, {"epoch": 1, "batch": 3})
    checkpoint.finish(mngr)
    state_dict = flax.serialization.to_state_dict(state)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_dict)
    got = ocp.CheckpointManager(d).restore(3, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    restored, meta = got["state"], got["meta"]
    assert sorted(restored) == sorted(state_dict)
    assert sorted(restored["params"]) == ["b", "w"] and sorted(restored["opt_state"]) == ["mu"]
    assert isinstance(restored["params"]["w"], jax.Array)
    assert restored["params"]["w"].sharding == state.params["w"].sharding
    assert _bits(restored) == _bits(state_dict) and int(restored["step"]) == 3
    assert meta["batch"] == 3 and meta[checkpoint.CHECKSUMS_KEY]["params/w"] == \
        zlib.crc32(np.asarray(state.params["w"]).tobytes())
    assert sorted(meta[checkpoint.CHECKSUMS_KEY]) == [
        "good_steps", "loss_scale", "opt_state/mu", "params/b", "params/w", "skipped_steps",
        "step"]


def test_saves_are_read_by_name_and_checked_against_the_run(tmp_path):
    """checkpoint.read gives the state by name, bit for bit; a stored state that does not
    fit the run's is an error naming the leaf and both shapes (not a fall-back)."""
    state = _stand_in(step=3)
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d)
    checkpoint.save(mngr, state, {"epoch": 1, "batch": 3})
    checkpoint.finish(mngr)
    tree, meta = checkpoint.read(d)
    assert meta["batch"] == 3 and len(meta[checkpoint.CHECKSUMS_KEY]) == \
        len(jax.tree_util.tree_leaves(state))
    assert _bits(tree["params"]) == _bits(state.params)
    assert _bits(tree["opt_state"]) == _bits(state.opt_state) and int(tree["step"]) == 3
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(tree))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 5 in .* \(steps there: \[3\]\)"):
        checkpoint.read(d, step=5)
    wider = _stand_in(w=np.zeros(4, np.float32), b=np.float32(0))
    with pytest.raises(ValueError, match=r"checkpoint .*3 does not fit this model/world: "
                                         r"params/w is float32\[3\] in the checkpoint, "
                                         r"float32\[4\] in this run"):
        checkpoint.restore_latest(mngr, wider, {})
    other = _stand_in(w=np.zeros(3, np.float32), v=np.float32(0))
    with pytest.raises(ValueError, match=r"leaves missing \['params/v'\], not in this state "
                                         r"\['params/b'\]"):
        checkpoint.restore_latest(mngr, other, {})
    arrays = str(tmp_path / "arrays")  # a leaf where this run has an empty dict, same path
    saved = _stand_in(step=4).replace(batch_stats=jax.device_put(np.ones(2, np.float32)))
    mngr = checkpoint.manager(arrays)
    checkpoint.save(mngr, saved, {"epoch": 1, "batch": 4})
    checkpoint.finish(mngr)
    with pytest.raises(ValueError, match=r"batch_stats is an array in the checkpoint, an empty "
                                         r"dict in this run"):
        checkpoint.restore_latest(mngr, _stand_in(), {})


def test_a_checkpoint_without_checksums_restores(tmp_path):
    """A checkpoint whose meta has no checksums (the device arrays several processes save,
    trjax before the checksums: orbax's state dict of leaves) restores, and reads by name."""
    import orbax.checkpoint as ocp
    state = _stand_in(step=2)
    mngr = checkpoint.manager(str(tmp_path / "old"), asynchronous=False)
    mngr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(checkpoint.host_copy(state)),
                                         meta=ocp.args.JsonSave({"epoch": 1, "batch": 2})))
    restored, meta = checkpoint.restore_latest(mngr, state, {})
    assert checkpoint.CHECKSUMS_KEY not in meta and _bits(restored) == _bits(state)
    assert _bits(checkpoint.read(str(tmp_path / "old"))[0]["params"]) == _bits(state.params)


def test_async_save_hands_orbax_call_to_its_thread(tmp_path, monkeypatch):
    """Single-process asynchronous saves: checkpoint.save returns while orbax's save call
    is still running on the manager's thread; finish waits for it; the call's error is
    raised at the next save or finish, and the checkpoint before it stays."""
    import threading
    import orbax.checkpoint as ocp
    state = {"w": np.arange(4, dtype=np.float32)}
    from trjax.state import TrainState
    one = np.ones((), np.int32)
    st = lambda k: TrainState(step=np.int32(k), params=state, batch_stats={}, opt_state={},
                              skipped_steps=one, loss_scale=np.float32(1), good_steps=one)
    mngr = checkpoint.manager(str(tmp_path), asynchronous=True)
    assert mngr.handoff is not None
    release, started, callers = threading.Event(), threading.Event(), []
    real = ocp.CheckpointManager.save

    def held(self, *a, **k):
        callers.append(threading.current_thread().name)
        started.set()
        assert release.wait(60), "checkpoint.save waited for orbax's call"
        return real(self, *a, **k)
    monkeypatch.setattr(ocp.CheckpointManager, "save", held)
    checkpoint.save(mngr, st(1), {"epoch": 1, "batch": 0})  # returns with the call held
    assert started.wait(60) and mngr.pending is not None and not mngr.pending.done()
    release.set()
    checkpoint.finish(mngr)
    assert callers == ["trjax-save_0"] and mngr.all_steps() == [1]

    def failing(self, *a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(ocp.CheckpointManager, "save", failing)
    checkpoint.save(mngr, st(2), {"epoch": 1, "batch": 1})
    with pytest.raises(OSError, match="disk full"):
        checkpoint.finish(mngr)
    checkpoint.save(mngr, st(3), {"epoch": 1, "batch": 2})
    with pytest.raises(OSError, match="disk full"):  # raised by the next save's wait
        checkpoint.save(mngr, st(4), {"epoch": 1, "batch": 3})
    monkeypatch.setattr(ocp.CheckpointManager, "save", real)
    restored, meta = checkpoint.restore_latest(mngr, st(0), {})
    assert int(restored.step) == 1 and meta["batch"] == 0
    assert not checkpoint.manager(str(tmp_path / "sync"), asynchronous=False).handoff

def _two_checkpoints(d, size=3):
    """Steps 1 and 2 of stand-in states in ``d``; returns the state saved at step 1."""
    rng = np.random.default_rng(0)
    mngr = checkpoint.manager(d)
    old = _stand_in(step=1, w=rng.normal(size=size).astype(np.float32), b=np.float32(0.5))
    new = _stand_in(step=2, w=rng.normal(size=size).astype(np.float32), b=np.float32(7))
    checkpoint.save(mngr, old, {"epoch": 1, "batch": 1})
    checkpoint.save(mngr, new, {"epoch": 1, "batch": 2})
    checkpoint.finish(mngr)
    return old, new


def _falls_back_to(d, old):
    log = []
    restored, meta = checkpoint.restore_latest(checkpoint.manager(d), old, {}, log=log.append)
    assert int(restored.step) == 1 and meta["batch"] == 1 and _bits(restored) == _bits(old)
    return log


@pytest.mark.parametrize("damage", ["changed", "missing leaf", "extra leaf", "not a dict",
                                    "empty leaf"])
def test_edited_checksums_fall_back_to_the_previous_checkpoint(tmp_path, damage):
    """A checkpoint whose meta's checksums were edited or damaged is unreadable (never
    restored unchecked, never mistaken for another model): the run falls back to the
    previous checkpoint, bit for bit; checkpoint.read names the damage. So does a zero-size
    leaf (meta: its shape and dtype) named where the state item stores an array."""
    d = str(tmp_path / "checkpoints")
    old, _ = _two_checkpoints(d)
    path = os.path.join(d, "2", "meta", "metadata")
    meta = json.load(open(path))
    sums = meta[checkpoint.CHECKSUMS_KEY]
    if damage == "changed":
        sums["params/w"] ^= 1
    elif damage == "missing leaf":
        del sums["params/w"]
    elif damage == "extra leaf":
        sums["params/v"] = 0
    elif damage == "not a dict":
        meta[checkpoint.CHECKSUMS_KEY] = list(sums.values())
    else:
        meta[checkpoint.EMPTY_KEY] = {"params/w": [[0], "float32"]}
    json.dump(meta, open(path, "w"))
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"checkpoint .*2: .*a damaged "
                                                           r"checkpoint"):
        checkpoint.read(d)
    log = _falls_back_to(d, old)
    assert "checkpoint " + os.path.join(d, "2") + " is unreadable (DamagedCheckpoint" in log[0]


def test_an_interrupted_wait_keeps_the_handed_off_save_pending(tmp_path, monkeypatch):
    """A KeyboardInterrupt (a second Ctrl-C) during finish's wait for the handed-off save
    call does not forget the call: the next finish waits until the checkpoint is on disk."""
    import functools
    import signal
    import threading
    import orbax.checkpoint as ocp
    mngr = checkpoint.manager(str(tmp_path), asynchronous=True)
    release, started = threading.Event(), threading.Event()
    real = ocp.CheckpointManager.save

    def held(self, *a, **k):
        started.set()
        assert release.wait(60)
        return real(self, *a, **k)
    monkeypatch.setattr(ocp.CheckpointManager, "save", held)
    checkpoint.save(mngr, _stand_in(step=5), {"epoch": 1, "batch": 5})
    assert started.wait(60)
    # a real SIGINT while finish waits, with Python's own handler: a suite started with `&`
    # from a script inherits SIGINT ignored (the test then waited 60 s and failed)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = functools.partial(os.kill, os.getpid(), signal.SIGINT)
    threading.Timer(0.2, ctrl_c).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.finish(mngr)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert mngr.pending is not None and not mngr.pending.done()
    threading.Timer(0.2, release.set).start()
    checkpoint.finish(mngr)  # waits for the held call, then for orbax's write
    assert mngr.pending is None and mngr.all_steps() == [5]
    assert int(checkpoint.read(str(tmp_path))[0]["step"]) == 5

def test_a_flipped_bit_in_the_stored_state_falls_back(tmp_path):
    """One flipped bit in a stored array (the largest file of the state item) was restored
    as another value without an error (its chunks carry no checksum): the checksums in the
    meta make that checkpoint unreadable; the run falls back, bit for bit."""
    d = str(tmp_path / "checkpoints")
    old, new = _two_checkpoints(d, size=20000)
    sums = checkpoint.read(d)[1][checkpoint.CHECKSUMS_KEY]
    assert sums == checkpoint.checksums(checkpoint.host_copy(new))  # as save took them
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "2", "state")) for f in fs]
    data = max(files, key=os.path.getsize)
    assert os.path.getsize(data) > 40000  # the 80 kB of w (compressed): the values themselves
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(data, "wb").write(bytes(raw))
    log = _falls_back_to(d, old)
    assert "checkpoint " + os.path.join(d, "2") + " is unreadable" in log[0]


def test_checksums_are_each_leafs_crc32_by_path():
    tree = {"a": np.arange(3, dtype=np.float32), "n": {"m": np.int32(4)}, "e": {}, "z": None,
            "d": jax.device_put(np.arange(4, dtype=np.int8).reshape(2, 2))}
    sums = checkpoint.checksums(tree)
    assert sums == {"a": zlib.crc32(tree["a"].tobytes()), "n/m": zlib.crc32(np.int32(4).tobytes()),
                    "d": zlib.crc32(bytes([0, 1, 2, 3]))}
    tree["a"][1] = np.nextafter(np.float32(1), np.float32(2))  # one ulp: one bit
    changed = checkpoint.checksums(tree)
    assert changed["a"] != sums["a"] and {**changed, "a": sums["a"]} == sums


def test_a_checkpoint_in_the_packed_format_is_a_clear_error(tmp_path):
    """A checkpoint in trjax's former packed format (one flat array per dtype, the layout in
    the meta under "state_layout") is an error naming the format and the way out, from
    restore_latest (not reported unreadable, no fall-back to the older checkpoint),
    check_compatible (before compiling) and read; nothing is moved."""
    import orbax.checkpoint as ocp
    d = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(d, asynchronous=False)
    checkpoint.save(mngr, _stand_in(step=1), {"epoch": 1, "batch": 1})  # a readable older one
    layout = [[["params", "w"], [3], "float32", 0]]
    mngr.save(2, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"float32": np.zeros(3, np.float32)}),
        meta=ocp.args.JsonSave({"epoch": 1, "batch": 2, "state_layout": layout})))
    mngr.wait_until_finished()
    message = (r"checkpoint .*2 is in trjax's packed format \(trjax < 0.2, meta "
               r"'state_layout'\); this trjax reads plain orbax pytrees: resume it with the "
               r"trjax that wrote it, or start a new workdir")
    log = []
    with pytest.raises(ValueError, match=message):
        checkpoint.restore_latest(mngr, _stand_in(), {}, log=log.append)
    assert log == []
    with pytest.raises(ValueError, match=message):
        checkpoint.check_compatible(mngr, {})
    with pytest.raises(ValueError, match=message):
        checkpoint.read(d)
    assert sorted(os.listdir(d)) == ["1", "2"]
