"""trjax.cpu.host: the simulated CPU device count and XLA:CPU's convolution library."""
import os
import subprocess
import sys

import pytest

from trjax.cpu import host

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_resolve_cpu_convolutions():
    assert host.resolve_cpu_convolutions("auto", 2, cores=2) == "eigen"
    assert host.resolve_cpu_convolutions("auto", 1, cores=2) == "eigen"
    assert host.resolve_cpu_convolutions("auto", 8, cores=2) == "ynnpack"
    assert host.resolve_cpu_convolutions("ynnpack", 1, cores=2) == "ynnpack"
    assert host.resolve_cpu_convolutions("eigen", 8, cores=2) == "eigen"
    assert host.available_cores() == len(os.sched_getaffinity(0))
    assert host.resolve_cpu_convolutions("auto", host.available_cores()) == "eigen"
    assert host.resolve_cpu_convolutions("auto", host.available_cores() + 1) == "ynnpack"


def test_available_cores_follows_the_affinity_mask(monkeypatch):
    mask = os.sched_getaffinity(0)
    one = min(mask)
    os.sched_setaffinity(0, {one})  # this thread only (pid 0); restored below
    try:
        assert host.available_cores() == 1
    finally:
        os.sched_setaffinity(0, mask)
    assert host.available_cores() == len(mask)
    # no affinity call on this platform: the CPU count
    def missing(_):
        raise AttributeError("sched_getaffinity")
    monkeypatch.setattr(os, "sched_getaffinity", missing)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert host.available_cores() == 5
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert host.available_cores() == 1
    with pytest.raises(ValueError, match=r"cpu_convolutions='onednn' is not one of"):
        host.resolve_cpu_convolutions("onednn", 2)
    with pytest.raises(ValueError, match=r"cpu_devices=0 must be a positive int"):
        host.resolve_cpu_convolutions("auto", 0)


def test_configure_cpu_refuses_a_running_backend():
    import jax
    jax.devices()  # conftest's 8 devices are up
    with pytest.raises(ValueError, match="already initialized"):
        host.configure_cpu(2)


_PROBE = """
import os, sys
os.environ.pop("XLA_FLAGS", None)
if sys.argv[2]:
    os.environ["XLA_FLAGS"] = sys.argv[2]
import jax, jax.numpy as jnp
from trjax.cpu import host
lib = host.configure_cpu(2, sys.argv[1], sys.argv[1] == "ynnpack")
x, w = jnp.ones((8, 32, 32, 64)), jnp.ones((3, 3, 64, 64))
conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
hlo = jax.jit(conv).lower(x, w).compile().as_text()
def temp(remat):  # a chain of 6 conv blocks: remat keeps each block's input only
    block = lambda x, w: x + jnp.tanh(conv(jnp.tanh(conv(x, w)), w))
    f = jax.checkpoint(block) if remat else block
    def loss(x, w):
        for _ in range(6):
            x = f(x, w)
        return x.sum()
    return jax.jit(jax.grad(loss)).lower(x, w).compile().memory_analysis().temp_size_in_bytes
print(lib["convolutions"], host.convolution_library(), len(jax.devices()), "__ynn_fusion" in hlo,
      lib["reuse_memory"], temp(True) < 0.6 * temp(False))
"""


@pytest.mark.parametrize("setting,flags,expect", [
    ("eigen", "", "eigen eigen 2 False False True"),     # Eigen's convolution, outside YNNPACK
    ("ynnpack", "", "ynnpack ynnpack 2 True True True"),
    ("eigen", "--xla_cpu_experimental_ynn_fusion_type=+eltwise",
     "XLA_FLAGS XLA_FLAGS 2 True False False"),  # measured: with YNNPACK's elementwise
    # fusions asked for, the chain's temp is not reduced (the default fusions keep it apart)
])
def test_configure_cpu_selects_the_convolution_library(setting, flags, expect):
    """... and keeps remat's barriers: a checkpointed chain's temp is below 0.6x the plain
    one's (with XLA:CPU's cse_barrier_expander on, the two are equal)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, setting, flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == expect


_FAULTS = """
import resource, sys
import jax, jax.numpy as jnp
from trjax.cpu import host
print(host.configure_cpu(1, "ynnpack", sys.argv[1] == "on")["reuse_memory"])
# XLA:CPU's sort of 2^23 floats: a 32 MB sorted copy, 64 MB of int64 indices and the merge
# scratch, each above glibc's largest mmap threshold (32 MB): 160 MB of temporaries per call
f = jax.jit(lambda x: jnp.sort(x)[::4096].sum())
x = jnp.arange(2 ** 23, dtype=jnp.float32)
for _ in range(2):
    f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) * 4096 / 3 / 2 ** 20)
"""


def test_reuse_host_memory_stops_per_call_page_faults():
    """Without reuse every call maps its temporaries (a sort of 2^23 floats) afresh
    and faults them in page by page (160 MB per call measured, all of them); with it,
    later calls mostly run on pages already mapped (0-32 MB per call measured)."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    mb = {}
    # both processes at once (their own page-fault counts; one core each on 2 cores)
    procs = {setting: subprocess.Popen(
        [sys.executable, "-c", _FAULTS, setting], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}) for setting in ("off", "on")}
    for setting, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr[-2000:]
        applied, faulted = stdout.split()[-2:]
        assert applied == str(setting == "on")
        mb[setting] = float(faulted)
    assert mb["off"] > 128, mb   # MB faulted in per call
    assert mb["on"] < 0.5 * mb["off"], mb
