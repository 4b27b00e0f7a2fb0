"""Several processes on JAX's own distributed runtime (``jax.distributed``).

Between GPUs XLA's collectives run on NCCL, between CPU processes on gloo: no
transport of our own. This module only starts the runtime, checks that the
processes agree, and watches for a stuck step.

* :func:`initialize` -- ``jax.distributed.initialize`` with an explicit
  coordinator (``host:port``, process count, process id) or auto-detection
  (SLURM, Open MPI, ... as ``jax.distributed`` supports), with a heartbeat
  timeout: when a peer dies, the survivors abort within about that time
  instead of hanging.
* :func:`check_agree` -- every process must hold the same values (steps per
  epoch, global example count, config fields); a mismatch names the process.
* :func:`tree_checksum` -- a bit-exact checksum of a pytree, compared across
  processes to prove every process starts from identical parameters.
* :class:`StepWatchdog` -- exits the process (non-zero) when no step has
  finished for ``timeout_s``: a peer that is alive but stuck.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib

import jax
import numpy as np


def initialize(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0,
               auto: bool = False, heartbeat_timeout_s: int = 30,
               initialization_timeout_s: int = 120) -> bool:
    """Starts ``jax.distributed`` before any device is used.

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator.
      num_processes, process_id: this run's size and this process's index.
      auto: let ``jax.distributed.initialize()`` detect the cluster (SLURM,
        Open MPI, Kubernetes...) instead of the explicit values.
      heartbeat_timeout_s: a peer silent this long is declared dead; the
        survivors then abort (non-zero exit) instead of waiting forever.
      initialization_timeout_s: how long to wait for every process to join.

    Returns:
      True if the runtime was started, False for a single-process run.

    Raises:
      ValueError: inconsistent arguments (names them).
    """
    if auto:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=initialization_timeout_s)
        return True
    if num_processes <= 1:
        return False
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError(f"distributed.coordinator={coordinator_address!r} must be 'host:port' "
                         f"when num_processes={num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"distributed.process_id={process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id,
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
