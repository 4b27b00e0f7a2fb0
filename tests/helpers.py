"""Shared test helpers: a small model, a world, a random batch, a short config."""
import os
import sys

import jax
import numpy as np
import optax

from trjax import exchange, models, optim, parallel
from trjax.plan import build_plan
from trjax.state import create_train_state
from trjax.world import make_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))  # benchmarking
import default as default_config  # noqa: E402
from benchmarking.common import without_forced_device_count  # noqa: E402

IMAGE_SHAPE = (8, 8, 1)


def small_config(**overrides):
    """The default config with ResNet-8 and 2 epochs, then ``overrides``."""
    c = default_config.get_config()
    c.model = "resnet8"
    c.num_epochs = 2
    for k, v in overrides.items():
        c[k] = v
    return c


def setup(world_spec="all", global_batch=32, bn_mode="sync", lr=0.1, opt="sgd", model_name="resnet8",
          conv_lowering="auto"):
    world = make_world(world_spec, global_batch)
    model = models.create_model(model_name, num_classes=10, bn_mode=bn_mode, axis_name="data",
                                conv_lowering=conv_lowering)
    plan = build_plan(model, IMAGE_SHAPE)
    tx = optim.make_optimizer(opt, lr, plan, weight_decay=1e-3)
    state = create_train_state(jax.random.key(0),
                               parallel.data_parallel(model, world, IMAGE_SHAPE, bn_mode),
                               exchange.allreduce(tx, plan))
    return world, model, plan, tx, state


def script_xla_flags() -> str:
    """This process's ``XLA_FLAGS`` less conftest's forced device count (a script sets its
    own count): conftest's LLVM level for the scripts a test runs at that level."""
    return without_forced_device_count(os.environ.get("XLA_FLAGS", ""))


def skip_train_step_compile(monkeypatch):
    """For tests of the evaluation programs only: ``trjax.train.setup`` then builds the
    state, ``fold_bn``, ``eval_step`` and ``eval_reduce`` as always, but its train step is
    the identity ``state -> state`` (compiled in milliseconds instead of seconds; calling
    it trains nothing)."""
    from trjax import steps
    monkeypatch.setattr(steps, "make_train_step", lambda *a, **k: lambda state, batch: state)


def random_batch(n, seed=0, num_classes=10):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n,) + IMAGE_SHAPE).astype(np.float32),
            "label": rng.integers(0, num_classes, n).astype(np.int32),
            "mask": np.ones(n, np.float32)}


def tiny_digits(n=64, seed=0):
    """An in-memory Dataset of ``n`` digit-like uint8 images ``[8, 8, 1]`` (values 0-16)
    and 10 classes, the same split for training and validation."""
    from trjax.data import input_pipeline as ip
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 17, (n, 8, 8, 1)).astype(np.uint8)
    split = ip.Split(x, rng.integers(0, 10, n).astype(np.int32))
    return ip.Dataset(split, split, 10, "tiny")


def digit_like_batches(n, global_batch, padding=(3, 20, 21), seed=0):
    """``n`` host batches shaped as the digits' (uint8 ``[G, 8, 8, 1]`` with values 0-16,
    int32 labels of 10 classes), with mask-0 rows at ``padding`` (on both halves of a
    2-rank data axis by default)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = {"image": rng.integers(0, 17, (global_batch, 8, 8, 1)).astype(np.uint8),
             "label": rng.integers(0, 10, global_batch).astype(np.int32),
             "mask": np.ones(global_batch, np.float32)}
        b["mask"][list(padding)] = 0
        out.append(b)
    return out


def to_host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def max_rel(a, b):
    """Max over leaves of max|a-b| / max(max|b|, 1e-6)."""
    out = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-6)))
    return out


def reference_step(model_name, params, batch_stats, opt_state, tx, batch, bn_momentum=0.9,
                   **model_kwargs):
    """One plain single-device step on the whole batch (no shard_map, no buckets)."""
    return reference_step_fn(model_name, tx, bn_momentum, **model_kwargs)(
        params, batch_stats, opt_state, batch)


def reference_step_fn(model_name, tx, bn_momentum=0.9, **model_kwargs):
    """:func:`reference_step` as a jitted ``(params, batch_stats, opt_state, batch) ->
    (params, batch_stats, opt_state, loss, grads)`` to call again (traced once per batch
    shape); ``model_kwargs`` go to ``models.create_model`` (e.g. a smaller ResNet-8).
    Compiled as one program: run op by op, each new batch shape compiled every primitive of
    the forward and backward pass on its own (5-9 s on 2 cores, against 1.5 s jitted)."""
    model = models.create_model(model_name, num_classes=10, bn_mode="local", axis_name=None,
                                bn_momentum=bn_momentum, **model_kwargs)

    def step(params, batch_stats, opt_state, batch):
        def loss_fn(p):
            logits, new_vars = model.apply({"params": p, "batch_stats": batch_stats},
                                           batch["image"], train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, new_vars["batch_stats"]

        (loss, new_bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_bs, new_opt_state, loss, grads
    return jax.jit(step)


HALF_ULP = 2.0 ** -11
"""fp16's unit roundoff: a gradient computed by half-precision convolutions is rounded
to fp16 once per (micro-)batch, and two runs whose kernels order the sum differently
may round it to neighbouring fp16 values (XLA:CPU's fp16 kernels differ from CPU to
CPU: issue 39's host, an AMD EPYC, rounds a pipelined fp16 step's BatchNorm bias
gradient 1.7x past the fp32 bound)."""


def reorder_rounding_bound(start, rows: int, half: float = 0.0):
    """Per-leaf bound on how far ONE step from ``start`` may land from another run of the
    same step from the same ``start`` when the two differ only in the order of their fp32
    sums (device count, processes, fusion, a refactor, a mesh).

    The step sums ``rows`` rows twice in another order (the BatchNorm statistics forward,
    the gradient backward). Recursive summation of n fp32 terms errs by at most
    (n-1)·u·sum|x_i| (Higham, Accuracy and Stability of Numerical Algorithms, §4.2;
    u = 2^-24), so the step's update differs by at most 2·(rows-1)·u of its own size;
    adding it to the leaf rounds once more in each run (u·|p|):
        |a - b| <= 2·(rows-1)·u·max|b - start| + 2·u·max|b|
    (the distance the leaf moved in the step, and its size).

    One step only, on purpose: over several steps the training dynamics (a ReLU that
    flips, a BN statistic that shifts, momentum) amplify a rounding difference by a
    factor that depends on the machine's code generation (issue 36: 55x this bound after
    7 steps on one Xeon, within it on another host). Compare several steps with
    :func:`assert_each_step_within_reorder_rounding` (every step from the same state).

    ``half``: with half-precision compute (``HALF_ULP`` for fp16), each run also rounds
    its gradient to that precision once, adding ``2·half·max|b - start|``.

    Returns ``bound(path, b) -> float`` for leaves of the tree ``start``.
    """
    u = 2.0 ** -24
    flat = {jax.tree_util.keystr(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(start)[0]}

    def bound(path, b):
        b = np.asarray(b, np.float64)
        moved = np.abs(b - flat[path]).max()
        return (2 * (rows - 1) * u + 2 * half) * moved + 2 * u * np.abs(b).max()
    return bound


def assert_within_reorder_rounding(a, b, start, rows: int, half: float = 0.0,
                                   factor: float = 1.0) -> float:
    """Asserts every leaf of ``a`` is within :func:`reorder_rounding_bound` of ``b``'s, both
    ONE step from ``start`` (a zero leaf that did not move must stay exactly zero);
    returns the worst ``|a - b| / bound`` (a margin to report). ``factor`` widens the bound
    (a normed update's: tests/test_recipe_mesh.py derives it)."""
    bound = reorder_rounding_bound(start, rows, half)
    worst = 0.0
    for (path, y), x in zip(jax.tree_util.tree_flatten_with_path(b)[0],
                            jax.tree_util.tree_leaves(a)):
        key = jax.tree_util.keystr(path)
        lim = factor * bound(key, y)
        diff = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()
        assert diff <= lim, (key, diff, lim)  # a leaf at 0 that did not move: equal
        worst = max(worst, diff / lim if lim else 0.0)
    return worst


def assert_within_bound_except_still(a, b, start, rows: int, factor: float = 1.0):
    """assert_within_reorder_rounding (its bound times ``factor``) leaf by leaf, except a
    leaf the reference barely moves (a conv bias right before BatchNorm: its gradient is 0
    up to rounding, a sum of cancelling terms the bound does not cover): both runs must
    leave it within 1e-6 of the start. Returns the worst ratio to the bound."""
    worst = 0.0
    for (path, y), x, x0 in zip(jax.tree_util.tree_flatten_with_path(b)[0],
                                jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(start)):
        y, x, x0 = (np.asarray(v, np.float64) for v in (y, x, x0))
        if np.abs(y - x0).max() < 1e-6:
            assert np.abs(x - x0).max() < 1e-6, jax.tree_util.keystr(path)
            continue
        worst = max(worst, assert_within_reorder_rounding([x], [y], [x0], rows, factor=factor))
    return worst


def save_stand_in_checkpoint(workdir, meta: dict) -> None:
    """A tiny train state saved with ``meta`` under ``workdir/checkpoints`` (checksums
    and all): what a resume reads before anything about the model is compiled."""
    from trjax.state import TrainState
    from trjax.train import checkpoint
    one = np.ones((), np.int32)
    stand_in = TrainState(step=one, params={"w": np.ones(3, np.float32)}, batch_stats={},
                          opt_state={}, skipped_steps=one, loss_scale=np.float32(1),
                          good_steps=one)
    mngr = checkpoint.manager(os.path.join(str(workdir), "checkpoints"))
    checkpoint.save(mngr, stand_in, meta)
    checkpoint.finish(mngr)


def put_like(host_tree, like):
    """``host_tree`` (numpy leaves) placed on the shardings of the jax arrays of ``like``
    (the same structure and global shapes): one run's state handed to another layout."""
    return jax.tree_util.tree_map(
        lambda x, y: jax.device_put(x, y.sharding) if isinstance(y, jax.Array) else x,
        host_tree, like)


def trainer_states(tr, batches):
    """A trainer's (``trjax.train.trainer.setup``) run over host ``batches`` from its own
    state (donated): ``([s_0, s_1, ..., s_n] host states, [metrics per step])``."""
    state, states, metrics = tr.state, [to_host(tr.state)], []
    for b in batches:
        state, m = tr.train_step(state, trainer_batch(tr, b))
        states.append(to_host(state))
        metrics.append(to_host(m))
    return states, metrics


def trainer_batch(tr, host_batch):
    """A host batch as the trainer's train step takes it."""
    from trjax.data import input_pipeline
    return input_pipeline.to_device(host_batch, tr.world.sharded(), tr.data.num_classes, tr.dtype)


def assert_each_step_within_reorder_rounding(ref_states, step, like, batches, rows: int,
                                             tree=lambda s: (s.params, s.batch_stats,
                                                             s.opt_state), half: float = 0.0):
    """Teacher forcing: a multi-step comparison whose every step has a valid bound.

    ``ref_states`` are one run's host states ``[s_0, s_1, ..., s_n]`` (s_k after batch k);
    for each k, ``step(put_like(s_{k-1}, like), batches[k-1])`` (the other run's step, from
    the SAME state) must land within :func:`reorder_rounding_bound` of s_k. Over several
    steps the two runs' own trajectories may drift apart by more than any one-step bound
    (the dynamics amplify rounding), so they are never compared with each other.

    ``like``: a state of the other run (its shardings; not read, not donated). Returns
    ``(worst |a - b| / bound over the steps, the other run's metrics per step)``.
    """
    worst, metrics = 0.0, []
    for k, batch in enumerate(batches, 1):
        got, m = step(put_like(ref_states[k - 1], like), batch)
        got = to_host(got)
        metrics.append(to_host(m))
        worst = max(worst, assert_within_reorder_rounding(
            tree(got), tree(ref_states[k]), tree(ref_states[k - 1]), rows, half))
        assert int(got.step) == int(ref_states[k].step)
    return worst, metrics


def run_at_once(commands, cwd, env, timeout: float):
    """Starts every command of ``commands`` at once (processes side by side) and waits for
    all; ``[subprocess.CompletedProcess]`` with text stdout and stderr, in order. A process
    still running when another's wait fails is killed."""
    import subprocess
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs)]


def tensorboard_values(folder):
    """``[(file, tag, step, Summary.Value)]`` of every summary value in the event files
    under ``folder`` (recursively, files in sorted order), read as TFRecords (uint64
    length, uint32 crc, an ``Event`` proto, uint32 crc) with tensorboardX's protos."""
    import struct
    from tensorboardX.proto import event_pb2
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(str(folder)) for f in fs
                   if "tfevents" in f)
    assert files, f"no event files under {folder}"
    out = []
    for path in files:
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            out += [(path, v.tag, event.step, v) for v in event.summary.value]
    return out


def tensorboard_scalars(folder):
    """``[(tag, step, value)]`` of every scalar in the event files under ``folder``
    (:func:`tensorboard_values`; text and hparams summaries left out)."""
    return [(tag, step, v.simple_value) for _, tag, step, v in tensorboard_values(folder)
            if v.HasField("simple_value")]


def run_tiny_time_to_accuracy(out):
    """``scripts/benchmark.py --time_to_accuracy`` with a tiny job (ResNet-8, 1 epoch, 2
    devices, global batch 64) into the folder ``out``: a cold run of ``scripts/train.py`` on
    a fresh ``--config.compilation_cache_dir`` (``out/tta_runs/cache_warm``), then a warm run
    on the cache it filled (and the torch twin when torch is importable). Returns
    ``(completed process, variants)``; the runs' workdirs are ``out/tta_runs/r1_<variant>``.
    """
    import importlib.util
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    variants = "cold,warm,torch" if importlib.util.find_spec("torch") is not None else "cold,warm"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # conftest's forced device count: the script sets its own
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "benchmark.py"), "--time_to_accuracy",
         "--model", "resnet8", "--epochs", "1", "--global_batch", "64", "--tta_variants",
         variants, "--out", str(out),
         "--train_flags", "--config.cpu_devices=2 --config.eval_batch_size=64"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    return proc, variants
