"""Several processes on JAX's own distributed runtime (``jax.distributed``).

Between GPUs XLA's collectives run on NCCL, between CPU processes on gloo: no
transport of our own. This module only starts the runtime, checks that the
processes agree, and watches for a stuck step (one writer per workdir is
:mod:`trjax.train.workdir`).

* :func:`detect_launch` / :func:`initialize` -- ``jax.distributed.initialize``
  with an explicit coordinator (``host:port``, process count, process id) or,
  by default, from the launcher's environment (SLURM ``srun``, Open MPI
  ``mpirun``, ``JAX_COORDINATOR_ADDRESS``), with a heartbeat timeout: when a
  peer dies, the survivors abort within about that time instead of hanging.
* :func:`check_agree` -- every process must hold the same values (steps per
  epoch, global example count, config fields); a mismatch names the process.
* :func:`tree_checksum` -- a bit-exact checksum of a pytree, compared across
  processes to prove every process starts from identical parameters.
* :class:`StepWatchdog` -- exits the process (non-zero) when no step has
  finished for ``timeout_s``: a peer that is alive but stuck.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import zlib
from typing import Mapping

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was started, as :func:`detect_launch` read it.

    Attributes:
      source: ``"config"``, ``"SLURM"``, ``"Open MPI"`` or
        ``"JAX_COORDINATOR_ADDRESS"``.
      coordinator: ``"host:port"`` of process 0, or None to let
        ``jax.distributed`` derive it from the launcher (SLURM: first node of
        ``SLURM_STEP_NODELIST``, port from the job id; Open MPI: the HNP URI).
      num_processes, process_id: the run's size and this process's index.
      local_device_ids: the accelerators this process takes, or None for
        ``jax.distributed``'s default (one per process: the launcher's local
        rank).
    """
    source: str
    coordinator: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None


def _local_gpus(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Indices of this host's GPUs (``CUDA_VISIBLE_DEVICES``, else ``/dev/nvidiaN``)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = len([v for v in visible.split(",") if v.strip()])
    else:
        try:
            n = sum(1 for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit())
        except OSError:
            n = 0
    return tuple(range(n)) if n else None


def detect_launch(env: Mapping[str, str] | None = None) -> Launch | None:
    """Reads a multi-process launch from the environment.

    The variables are those ``jax.distributed``'s cluster detection reads
    (``jax/_src/clusters``): SLURM (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
    ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``), Open MPI
    (``OMPI_MCA_orte_hnp_uri``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_RANK``), and ``JAX_COORDINATOR_ADDRESS`` (with the
    process count and index from one of those launchers, or from
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, which trjax reads). A launch
    of one process is no launch (None).

    jax gives each process one accelerator (its local rank) under a launcher;
    with one process per host (``SLURM_NTASKS == SLURM_STEP_NUM_NODES``,
    ``OMPI_COMM_WORLD_LOCAL_SIZE == 1``) the process takes all of the host's
    GPUs instead.

    Returns:
      A :class:`Launch`, or None when this is a single-process run.

    Raises:
      ValueError: a launch of several processes that cannot be started as one
        run (e.g. Open MPI without ``OMPI_MCA_orte_hnp_uri``, as Open MPI 5
        starts processes), naming the variables to set.
    """
    env = os.environ if env is None else env
    coordinator = env.get("JAX_COORDINATOR_ADDRESS") or None
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_LOCALID")
    if "OMPI_COMM_WORLD_SIZE" in env and int(env["OMPI_COMM_WORLD_SIZE"]) > 1:
        if "OMPI_MCA_orte_hnp_uri" not in env and coordinator is None:
            raise ValueError(
                f"an Open MPI launch of {env['OMPI_COMM_WORLD_SIZE']} processes without "
                "OMPI_MCA_orte_hnp_uri (Open MPI >= 5): jax.distributed cannot find process 0. "
                "Set JAX_COORDINATOR_ADDRESS=<host of rank 0>:<free port> for every process "
                "(or --config.distributed.coordinator)")
        one_per_host = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"
        return Launch("Open MPI", coordinator, int(env["OMPI_COMM_WORLD_SIZE"]),
                      int(env["OMPI_COMM_WORLD_RANK"]),
                      _local_gpus(env) if one_per_host else None)
    if all(k in env for k in slurm) and int(env["SLURM_NTASKS"]) > 1:
        one_per_host = env.get("SLURM_STEP_NUM_NODES") == env["SLURM_NTASKS"]
        return Launch("SLURM", coordinator, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]),
                      _local_gpus(env) if one_per_host else None)
    if coordinator is not None:
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS={coordinator!r} is set but "
                             f"{' and '.join(missing)} not, and no SLURM or Open MPI launch "
                             "gives them: set both for every process (or unset "
                             "JAX_COORDINATOR_ADDRESS for a single-process run)")
        n, i = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        return Launch("JAX_COORDINATOR_ADDRESS", coordinator, n, i) if n > 1 else None
    return None


def resolve_launch(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0,
                   auto: bool = True, env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch to start: explicit config values win, else (``auto``) the
    environment's (:func:`detect_launch`). None for a single process.

    Raises:
      ValueError: inconsistent explicit values, or an environment
        :func:`detect_launch` refuses.
    """
    if num_processes > 1 or coordinator_address:
        if not coordinator_address or ":" not in coordinator_address:
            raise ValueError(f"distributed.coordinator={coordinator_address!r} must be "
                             f"'host:port' when num_processes={num_processes}")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"distributed.process_id={process_id} must be in "
                             f"[0, distributed.num_processes={num_processes})")
        return Launch("config", coordinator_address, num_processes, process_id)
    return detect_launch(env) if auto else None


def initialize(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0,
               auto: bool = True, heartbeat_timeout_s: int = 30,
               initialization_timeout_s: int = 120, log=print) -> bool:
    """Starts ``jax.distributed`` before any device is used.

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator.
      num_processes, process_id: this run's size and this process's index.
      auto: without explicit values, start the run the environment describes
        (:func:`detect_launch`: ``srun``, ``mpirun``,
        ``JAX_COORDINATOR_ADDRESS``); False: a single process whatever the
        environment says.
      heartbeat_timeout_s: a peer silent this long is declared dead; the
        survivors then abort (non-zero exit) instead of waiting forever.
      initialization_timeout_s: how long to wait for every process to join.
      log: prints one line saying where the launch came from.

    Returns:
      True if the runtime was started, False for a single-process run.

    Raises:
      ValueError: inconsistent arguments or environment (names them).
    """
    launch = resolve_launch(coordinator_address, num_processes, process_id, auto)
    if launch is None:
        return False
    if launch.source != "config":
        log(f"trjax: {launch.source} launch detected: process {launch.process_id} of "
            f"{launch.num_processes}, coordinator "
            f"{launch.coordinator or '(from the launcher)'}; --config.distributed.auto=False "
            "runs a single process instead")
    jax.distributed.initialize(launch.coordinator, num_processes=launch.num_processes,
                               process_id=launch.process_id,
                               local_device_ids=(list(launch.local_device_ids)
                                                 if launch.local_device_ids else None),
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)
    return True


def check_agree(values: dict) -> None:
    """Raises ``RuntimeError`` unless every process passes the same ``values``.

    ``values`` maps names to ints (or bools/strings, compared through a
    CRC32). One all-gather; a no-op with one process.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    keys = sorted(values)
    enc = lambda v: int(v) if isinstance(v, (int, np.integer, bool)) else zlib.crc32(str(v).encode())
    mine = np.array([enc(values[k]) for k in keys], np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, len(keys)]
    for j, k in enumerate(keys):
        col = every[:, j]
        if (col != col[0]).any():
            bad = int(np.flatnonzero(col != col[0])[0])
            raise RuntimeError(f"processes disagree on {k}: process 0 has {values[k] if jax.process_index() == 0 else col[0]}, "
                               f"process {bad} has {col[bad]}; every process must run the same "
                               "config on the same data")


def tree_checksum(tree) -> int:
    """A bit-exact checksum (CRC32 chain) of this process's first shard of every leaf."""
    crc = 0
    for x in jax.tree_util.tree_leaves(tree):
        crc = zlib.crc32(np.asarray(x.addressable_shards[0].data).tobytes(), crc)
    return crc


class StepWatchdog:
    """Exits the process when no step finished for ``timeout_s`` seconds.

    Call :meth:`beat` after each finished step (the host has read its
    metrics). A background thread checks once a second; on timeout it prints
    the last finished step and calls ``os._exit(exit_code)`` -- a collective
    stuck in XLA cannot be interrupted any other way. ``timeout_s <= 0``
    disables it. Use as a context manager.
    """

    def __init__(self, timeout_s: float, exit_code: int = 3, what: str = "step"):
        self.timeout_s, self.exit_code, self.what = timeout_s, exit_code, what
        self.last = time.monotonic()
        self.step = 0
        self._stop = threading.Event()
        self._thread = None

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()

    def _run(self):
        while not self._stop.wait(1.0):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                print(f"watchdog: no {self.what} finished for {idle:.0f} s (last finished: "
                      f"{self.step}) on process {jax.process_index()}; a peer is dead or stuck. "
                      f"Exiting with code {self.exit_code}.", file=sys.stderr, flush=True)
                os._exit(self.exit_code)

    def __enter__(self):
        if self.timeout_s > 0:
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._run, daemon=True, name="step-watchdog")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False


def exit_peer_lost(code: int = 3) -> None:
    """Ends this process with ``code`` at once, after flushing stdout/stderr.

    For a survivor whose collective failed because a peer died: a normal
    exit runs ``jax.distributed``'s shutdown, whose barrier waits on the dead
    peer and then aborts the process (SIGABRT, rc -6), hiding the run's own
    exit code. The watchdog (:class:`StepWatchdog`) exits the same way.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
