"""The CPU backend: simulated devices, convolution kernels and host memory reuse.

Without an accelerator trjax runs on XLA:CPU, with ``cpu_devices`` simulated
devices so that the data-parallel path (mesh, shard_map, all-reduces) is the
same as on GPUs. Three process-wide settings decide how fast that is, and all
must be made before the backend starts (the first ``jax.devices()`` or
computation):

* ``jax_num_cpu_devices``: the number of simulated devices.
* the convolution library of XLA:CPU. By default jaxlib sends convolutions to
  YNNPACK fusions. Eigen's convolutions are faster when every simulated device
  has a core of its own; the YNNPACK convolutions win slightly when more
  devices than cores share them. YNNPACK keeps its other fusions (reductions,
  dots) either way: with those in Eigen/LLVM too, the BN reductions are slow.

* host memory reuse (:func:`reuse_host_memory`). XLA:CPU allocates each
  execution's temporary buffer (hundreds of MB for a ResNet step) with
  ``malloc``. glibc serves such blocks with fresh ``mmap`` pages, also in the
  per-thread arenas the device threads use, and unmaps them on ``free``, so
  every step page-faults its whole temp again. Keeping freed memory in one
  heap makes later steps reuse the same pages. The single heap has a cost,
  paid by every thread that allocates: Eigen's multi-threaded convolutions,
  XLA's compiler and small steps (the main job) get slower. So it is off
  unless asked for: turn it on for big models whose steps need temporaries of
  tens of MB per device.

* remat's barriers. ``jax.checkpoint`` keeps a recompute apart from the forward
  with optimization barriers; XLA:CPU's ``cse_barrier_expander`` pass removes them
  before common-subexpression elimination, which then merges the recompute back
  into the forward, and the activations stay live: ``config.remat`` saved nothing
  (a 12-block convolutional chain kept 208 MiB of temp with and without it, 68 MiB
  with the pass off; the gradients bitwise the same). :data:`KEEP_BARRIERS_FLAG`
  turns the pass off, as XLA:GPU keeps the barriers.

The measured figures (per step, side by side, on a 2-core host) are in
``docs/performance.md``, sections 3 (Eigen convolutions) and 4 (host memory
reuse).

:func:`configure_cpu` applies all four. ``"auto"`` picks Eigen convolutions
when ``cpu_devices`` is at most the number of cores this process may run on,
YNNPACK convolutions otherwise.
"""

from __future__ import annotations

import ctypes
import os
import platform

import jax

CPU_CONVOLUTIONS = ("auto", "eigen", "ynnpack")
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
# jaxlib's default YNNPACK fusions, minus convolutions (they go to Eigen)
EIGEN_CONV_FLAG = f"{YNN_FLAG}=-individual_convolution"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_cpu_convolutions(setting: str, cpu_devices: int, cores: int | None = None) -> str:
    """``"eigen"`` or ``"ynnpack"`` for ``setting`` (one of :data:`CPU_CONVOLUTIONS`).

    ``"auto"`` is ``"eigen"`` when ``cpu_devices <= cores`` (default: the
    available cores), else ``"ynnpack"``.

    Raises:
      ValueError: an unknown ``setting`` or a ``cpu_devices`` below 1.
    """
    if setting not in CPU_CONVOLUTIONS:
        raise ValueError(f"config.cpu_convolutions={setting!r} is not one of {CPU_CONVOLUTIONS}")
    if isinstance(cpu_devices, bool) or not isinstance(cpu_devices, int) or cpu_devices < 1:
        raise ValueError(f"config.cpu_devices={cpu_devices!r} must be a positive int")
    if setting != "auto":
        return setting
    return "eigen" if cpu_devices <= (cores or available_cores()) else "ynnpack"


def reuse_host_memory() -> bool:
    """Makes glibc keep freed memory in the process for reuse.

    ``mallopt``: one arena (``M_ARENA_MAX=1``, so XLA's device threads share
    the main heap), no ``mmap`` for large blocks (``M_MMAP_MAX=0``) and no
    trimming of the heap's top below 2 GiB (``M_TRIM_THRESHOLD``). Freed
    blocks then return to the heap instead of to the kernel, so the next step's
    buffers are already-mapped pages. The process's resident memory stays at
    its peak instead of shrinking after each step. Call it before the backend
    starts its threads; threads that already have an arena keep it.

    Returns:
      True when applied; False off Linux/glibc (nothing is changed).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # <malloc.h>
    return bool(libc.mallopt(m_arena_max, 1) and libc.mallopt(m_mmap_max, 0)
                and libc.mallopt(m_trim_threshold, 2**31 - 1))


KEEP_BARRIERS_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
"""The ``XLA_FLAGS`` entry that keeps ``jax.checkpoint``'s barriers on XLA:CPU (remat)."""


def configure_cpu(cpu_devices: int, convolutions: str = "auto",
                  reuse_memory: bool = False) -> dict:
    """Sets the simulated CPU device count, the convolution library and host
    memory reuse.

    Call it before anything touches a device (as ``trjax-train`` does). On
    a host with an accelerator it only affects the (unused) CPU backend.

    Args:
      cpu_devices: simulated CPU devices (``jax_num_cpu_devices``).
      convolutions: ``"auto"``, ``"eigen"`` or ``"ynnpack"`` (see the module
        docstring). An explicit ``--xla_cpu_experimental_ynn_fusion_type`` in
        ``XLA_FLAGS`` always wins.
      reuse_memory: apply :func:`reuse_host_memory` (see the module
        docstring for when it pays).

    Returns:
      ``{"convolutions": convolution_library(), "reuse_memory": bool}``: what
      is in effect.

    Raises:
      ValueError: a bad setting, or the backend is already running (the
        settings could no longer take effect).
    """
    library = resolve_cpu_convolutions(convolutions, cpu_devices)
    if not isinstance(reuse_memory, bool):
        raise ValueError(f"config.cpu_reuse_memory={reuse_memory!r} must be True or False")
    initialized = getattr(getattr(jax._src, "xla_bridge", None), "backends_are_initialized",
                          lambda: False)
    if initialized():
        raise ValueError("trjax.cpu.host.configure_cpu: the jax backend is already initialized; "
                         "call it before the first jax.devices() or computation")
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    flags = os.environ.get("XLA_FLAGS", "")
    if library == "eigen" and YNN_FLAG not in flags:
        flags = f"{flags} {EIGEN_CONV_FLAG}".strip()
    if "--xla_disable_hlo_passes" not in flags:  # an explicit list always wins
        flags = f"{flags} {KEEP_BARRIERS_FLAG}".strip()
    os.environ["XLA_FLAGS"] = flags
    reused = reuse_host_memory() if reuse_memory else False
    return {"convolutions": convolution_library(), "reuse_memory": reused}


def convolution_library() -> str:
    """What this process's ``XLA_FLAGS`` select for XLA:CPU convolutions:
    ``"eigen"``, ``"ynnpack"`` (jaxlib's default) or ``"XLA_FLAGS"`` (some
    other explicit YNNPACK fusion list)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if EIGEN_CONV_FLAG in flags:
        return "eigen"
    return "XLA_FLAGS" if YNN_FLAG in flags else "ynnpack"
