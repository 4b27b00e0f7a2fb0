"""Tests run on 8 simulated CPU devices (set before jax initialises its backend)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # configs

# LLVM at -O1 for the programs this process compiles. trjax's own CPU steps and state
# initialisation compile at -O1 anyway, in users' runs too (trjax.cpu.compile_options.STEP_OPTIONS,
# INIT_OPTIONS); this brings the tests' references and other
# programs to the same level (not the scripts the tests start, which drop these flags,
# except the session's two dry runs, script_dry_runs below, and test_install's route A,
# which loads their programs): the suite is dominated by compiling many
# small distinct programs, and level 1 compiles them ~20% faster (tests/test_exchange.py +
# test_steps.py: 169 -> 135 s on 2 cores). XLA's HLO passes are the same; LLVM may round a
# few operations differently, so numeric comparisons are within this process or, against a
# script's run, exact or bounded as before (measured: the rows of test_stops' script runs
# equal this process's bit for bit). An XLA_FLAGS that sets a level keeps its own.
_LEVEL = ("" if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
          else " --xla_backend_optimization_level=1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _LEVEL +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Many tests compile the same small train step: a persistent compilation cache for the
# session (a fresh directory each run) loads it instead of compiling it again.
import tempfile  # noqa: E402

_CACHE = tempfile.mkdtemp(prefix="trjax-test-xla-cache-")
jax.config.update("jax_compilation_cache_dir", _CACHE)
# scripts the tests start read it from the environment: they share the session's cache
# instead of writing to the user's (trjax's default, ~/.cache/trjax/xla)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# nanodo's rail: an implicit rank promotion (adding [n] to [m, n] by accident) is an error.
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture
def restore_jax_cache():
    """For tests that change process-wide jax cache settings: puts the session's back."""
    from jax.experimental.compilation_cache import compilation_cache as jax_cache
    keys = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
            "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    jax_cache.reset_cache()


@pytest.fixture(scope="session")
def tiny_time_to_accuracy(tmp_path_factory):
    """One tiny ``--time_to_accuracy`` run (helpers.run_tiny_time_to_accuracy) for the
    session: test_benchmark checks its figures, test_compilation its cold and warm
    processes' compile counts. ``(out folder, completed process, variants)``."""
    from helpers import run_tiny_time_to_accuracy
    out = tmp_path_factory.mktemp("tta")
    proc, variants = run_tiny_time_to_accuracy(out)
    return out, proc, variants


@pytest.fixture(scope="session")
def script_dry_runs(tmp_path_factory):
    """Two script runs for the session, side by side (two processes on the 2 cores):
    ``scripts/gpu_check.py --dry-run`` (test_gpu_check checks its JSON, test_benchmark
    the ``--gpu --dry_run`` benchmark it ran as its ``benchmark`` part) and a tiny CPU
    ``scripts/benchmark.py`` (ResNet-8 on 8x8x1, world sizes 1 and 2, with the memory
    comparison; test_benchmark). ``{"gpu_check": (out, proc), "cpu_tiny": (out, proc)}``."""
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    from helpers import script_xla_flags
    env = dict(os.environ)
    # not the forced device count (the scripts set their own), but this process's LLVM
    # level: both runs are compile-bound stand-ins whose checked figures do not depend on
    # it (the dry run's bf16 ResNet-8 train step compiles in 14.3 s at jaxlib's default
    # level, 4.5 s at level 1, on 2 cores)
    env["XLA_FLAGS"] = script_xla_flags()
    env["JAX_PLATFORMS"] = "cpu"
    gpu_out, cpu_out = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("cpu_tiny")
    commands = {
        "gpu_check": (gpu_out, [os.path.join(root, "scripts", "gpu_check.py"), str(gpu_out),
                                "--dry-run", "--timeout_scale", "4"]),
        "cpu_tiny": (cpu_out, [os.path.join(root, "scripts", "benchmark.py"), "--model",
                               "resnet8", "--image", "8,8,1", "--global_batch", "16",
                               "--world_sizes", "1,2", "--warmup", "1", "--steps", "2",
                               "--rounds", "1", "--variants", "two,per_leaf", "--out",
                               str(cpu_out)])}
    procs = {k: subprocess.Popen([sys.executable, *cmd], cwd=root, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, (_, cmd) in commands.items()}
    done = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=900)
        done[k] = (commands[k][0], subprocess.CompletedProcess(p.args, p.returncode, stdout,
                                                               stderr))
    return done
