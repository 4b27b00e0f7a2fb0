"""How a run stops early: exit codes, preemption signals, and the agreed stop step.

* Exit codes of ``trjax-train`` (and ``scripts/train.py``; documented in docs/checkpoints.md):
  :data:`EXIT_ERROR` (bad input, an incompatible checkpoint or config, a busy
  workdir), :data:`EXIT_PEER_LOST` (a peer process died or hangs: a
  collective failed, a peer's heartbeat stopped, or no step finished for
  ``config.step_timeout_s``; the line before the exit names this process's
  step and the lost process, :class:`trjax.train.distributed.PeerMonitor`),
  :data:`EXIT_NONFINITE` (``halt_on_nonfinite`` or
  ``max_consecutive_overflows``), :data:`EXIT_PREEMPTED` (SIGTERM/SIGUSR1:
  the run saved a checkpoint and can be restarted to resume), :data:`EXIT_INTERRUPTED`
  (the same after Ctrl-C).
* :class:`StopSignals` -- SIGTERM (SLURM, Kubernetes, cloud preemption),
  SIGUSR1 (SLURM ``--signal``) and SIGINT (Ctrl-C) set a flag instead of
  killing the process; the
  loop finishes the step in flight, agrees on the stop step with every other
  process (:meth:`StopSignals.should_stop`), saves a checkpoint there, flushes
  its logs and raises :class:`Preempted`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax
import numpy as np

EXIT_ERROR = 1
EXIT_PEER_LOST = 3
EXIT_NONFINITE = 4
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a scheduler sees for a job its SIGTERM ended
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, after the checkpoint is saved
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
REPEAT_S = 1.0  # the same signal again within this many seconds: the same request, twice


class Preempted(Exception):
    """Raised by :func:`trjax.train.train_and_evaluate` after a stop signal:
    the checkpoint at ``step`` is saved and complete and the logs are flushed;
    the next start with the same workdir resumes there.

    Attributes:
      step: the last finished step (the checkpoint's step).
      signal_name: e.g. ``"SIGTERM"``.
    """

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint saved, "
                         "start again with the same --workdir to resume")
        self.step, self.signal_name = step, signal_name


class StopSignals:
    """Turns SIGTERM/SIGUSR1/SIGINT into a flag while installed (a context manager).

    A second signal while the first is being handled ends the process at
    once (the signal's default action), as schedulers' "kill now" expects;
    but the same signal again within :data:`REPEAT_S` of the first is the
    same request delivered twice (a launcher forwards what a terminal's
    Ctrl-C or a scheduler also sent to every process) and is dropped.
    A signal the process finds ignored (``SIG_IGN``, e.g. SIGINT of a job a
    non-interactive shell started with ``&``) stays ignored, as Python leaves
    an ignored SIGINT without its KeyboardInterrupt.
    Handlers can only be installed from the main thread; elsewhere (e.g. a
    training call on a worker thread) the signals keep their handlers and
    :meth:`should_stop` only sees :meth:`request`.

    Args:
      check_every: with several processes, the flag is all-gathered (one tiny
        host collective) every ``check_every`` steps and at each epoch end,
        and every process stops at the first such step where ANY process has
        it set, so all save the same step. One process checks every step.
    """

    def __init__(self, check_every: int = 10):
        self.check_every = max(1, int(check_every))
        self.received: str | None = None
        self._received_at = 0.0
        self._previous: dict = {}

    def request(self, name: str = "SIGTERM") -> None:
        """Sets the flag as a signal would (the handler calls this)."""
        if self.received is None:
            self.received, self._received_at = name, time.monotonic()

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            if name == self.received and time.monotonic() - self._received_at < REPEAT_S:
                return  # one request delivered twice
            signal.signal(signum, signal.SIG_DFL)  # a second signal: the default action, at once
            os.kill(os.getpid(), signum)
            return
        if name == "SIGINT":
            print("trjax: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again "
                  "stops at once, without one)", file=sys.stderr, flush=True)
        self.request(name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return False

    def should_stop(self, step: int, boundary: bool = False) -> str | None:
        """Whether every process stops after ``step``; the signal's name or None.

        Call at EVERY step (and with ``boundary=True`` at each epoch end) on
        every process: with several processes the decision is an all-gather
        at steps divisible by ``check_every`` and at boundaries, the same
        steps on every process.
        """
        if jax.process_count() == 1:
            return self.received
        if not boundary and step % self.check_every:
            return None
        from jax.experimental import multihost_utils
        flags = np.asarray(multihost_utils.process_allgather(
            np.int32(self.received is not None)))
        return (self.received or "SIGTERM (on another process)") if flags.any() else None
