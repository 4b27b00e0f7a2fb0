"""Tests run on 8 simulated CPU devices (set before jax initialises its backend)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # configs

# LLVM at -O1 for the programs this process compiles (not for users' runs, nor for the
# scripts the tests start, which drop these flags): the suite is dominated by compiling many
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
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# nanodo's rail: an implicit rank promotion (adding [n] to [m, n] by accident) is an error.
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_time_to_accuracy(tmp_path_factory):
    """One tiny ``--time_to_accuracy`` run (helpers.run_tiny_time_to_accuracy) for the
    session: test_benchmark checks its figures, test_compilation its cold and warm
    processes' compile counts. ``(out folder, completed process, variants)``."""
    from helpers import run_tiny_time_to_accuracy
    out = tmp_path_factory.mktemp("tta")
    proc, variants = run_tiny_time_to_accuracy(out)
    return out, proc, variants
