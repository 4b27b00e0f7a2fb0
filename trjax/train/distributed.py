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
* :class:`PeerMonitor` -- every process publishes a heartbeat (its last
  finished step, a counter) into ``jax.distributed``'s key-value store every
  :data:`HEARTBEAT_S` and reads its peers'. When a peer's heartbeat stands
  still (it died, or is stopped) or the coordinator stops answering, every
  survivor exits with :data:`trjax.train.stops.EXIT_PEER_LOST` and a line
  naming its own step and the lost process and its last step -- whichever of
  the monitor, the step watchdog, a failed collective
  (:func:`exit_peer_lost`) or jax's own runtime notices first
  (:func:`initialize` starts it; jax's runtime aborts a survivor with SIGABRT,
  which trjax turns into the same report when it can name the lost peer).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import sys
import threading
import time
import zlib
from typing import Mapping

import jax
import numpy as np

from trjax.train.stops import EXIT_PEER_LOST


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
      heartbeat_timeout_s: a peer silent this long is declared dead by jax's
        runtime, which then aborts the survivors. trjax's own
        :class:`PeerMonitor` (started here) declares a peer lost sooner
        (:func:`stale_after_s`) and exits with ``EXIT_PEER_LOST`` and a line
        naming it.
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
    start_peer_monitor(stale_after_s(heartbeat_timeout_s))
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


# --------------------------------------------------------------------------- peers

HEARTBEAT_S = 1.0
"""How often each process publishes its heartbeat and reads its peers'."""
HEARTBEAT_KEY = "trjax/heartbeat/"
"""The key-value store's directory of heartbeats: ``HEARTBEAT_KEY + str(process)``."""


def stale_after_s(heartbeat_timeout_s: float) -> float:
    """How long a peer's heartbeat may stand still before :class:`PeerMonitor`
    declares the peer lost: 0.3 of ``jax.distributed``'s heartbeat timeout (so
    trjax names the peer before jax's runtime aborts the process), at least
    three heartbeats, at most 30 s."""
    return float(min(30.0, max(3 * HEARTBEAT_S, 0.3 * heartbeat_timeout_s)))


@dataclasses.dataclass
class Peer:
    """Another process as this one last read its heartbeat.

    Attributes:
      process: its index.
      step: the last step it reported finished (0: none yet).
      state: ``"unread"`` (no heartbeat read yet), ``"running"``, ``"exited"``
        (it ended through Python's exit) or ``"lost"`` (it exited because it
        lost a peer; ``note`` says which).
      seq: its heartbeat counter.
      changed_at: this process's clock when ``seq`` last changed (or, before
        any heartbeat of it, when this process first read the store).
    """
    process: int
    step: int = 0
    state: str = "unread"
    note: str = ""
    seq: int = -1
    changed_at: float | None = None


class PeerMonitor:
    """Heartbeats of every process in ``jax.distributed``'s key-value store.

    Two daemon threads. One publishes ``{"seq", "step", "state"}`` under
    ``HEARTBEAT_KEY + str(process_id)`` every ``tick_s`` and reads every
    peer's (one directory read; every ``ceil(num_processes / 32)`` ticks) --
    in runs of up to 32 processes also when the step changed, at most every
    ``tick_s / 4``;
    the store lives in process 0, so this thread may block when process 0 is
    gone or stopped -- the time its call has been in flight (or failing) is
    then the evidence. The other never calls the store: it exits the process
    (``exit_code``) with a report (:meth:`findings`) as soon as a peer's
    heartbeat has stood still for ``stale_s``, a peer exited because it lost
    another, or process 0 has not answered for ``stale_s``.

    :meth:`set_step` (called by :meth:`StepWatchdog.beat`) sets what this
    process publishes as its last finished step.

    Args:
      client: ``jax._src.distributed.global_state.client`` (or anything with
        ``key_value_set(key, value, allow_overwrite=True)`` and
        ``key_value_dir_get(prefix) -> [(key, value)]``).
      process_id, num_processes: this process and the run's size.
      stale_s: see :func:`stale_after_s`.
      exit_code: the code of an exit on a lost peer.
      tick_s: the heartbeat period.
      clock: a monotonic clock (seconds).
      alive: ``() -> bool``; the threads end when it turns False (the runtime
        was shut down).
    """

    def __init__(self, client, process_id: int, num_processes: int, stale_s: float,
                 exit_code: int = EXIT_PEER_LOST, tick_s: float = HEARTBEAT_S,
                 clock=time.monotonic, alive=lambda: True):
        self.client, self.process_id, self.num_processes = client, process_id, num_processes
        self.stale_s, self.exit_code, self.tick_s, self.clock = stale_s, exit_code, tick_s, clock
        self.alive = alive
        self.step = 0
        self.peers = {p: Peer(p) for p in range(num_processes) if p != process_id}
        self.read_every = max(1, math.ceil(num_processes / 32))
        self.step_gap_s = tick_s / 4 if num_processes <= 32 else tick_s
        self._published_step, self._published_at = None, -math.inf
        self._wake = threading.Event()
        self._seq = 0
        self._ticks = 0
        self._rpc_since: float | None = None  # the store call in flight started then
        self._failing_since: float | None = None  # the first of the failing calls in a row
        self._last_error = ""
        self._last_read = None  # the clock at the last successful read
        self._stop = threading.Event()
        self._exiting = threading.Event()  # Python's exit: published "exited", still reading
        self.disabled = ""  # why the threads ended early (a client without the store API)
        self._threads: list[threading.Thread] = []

    # -- the store ---------------------------------------------------------
    def _call(self, fn):
        start = self.clock()
        self._rpc_since = start
        try:
            out = fn()
        except (TypeError, AttributeError):  # a client without this API: not the store's fault
            raise
        except Exception as e:  # the store is unreachable, or shut down
            if self._failing_since is None:
                self._failing_since = start
            self._last_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" \
                if str(e).strip() else type(e).__name__
            return None
        finally:
            self._rpc_since = None
        self._failing_since = None
        return out

    def publish(self, state: str = "running", note: str = "") -> None:
        """Writes this process's heartbeat (one store call)."""
        self._seq += 1
        step = int(self.step)
        self._published_step, self._published_at = step, self.clock()
        value = json.dumps({"seq": self._seq, "step": step, "state": state,
                            "note": note, "time": round(time.time(), 3)})
        self._call(lambda: self.client.key_value_set(
            f"{HEARTBEAT_KEY}{self.process_id}", value, allow_overwrite=True))

    def read(self) -> bool:
        """Reads every peer's heartbeat (one store call); False if the store did not answer."""
        entries = self._call(lambda: self.client.key_value_dir_get(HEARTBEAT_KEY))
        if entries is None:
            return False
        now = self.clock()
        for key, value in entries:
            try:
                p, hb = int(str(key).rstrip("/").rsplit("/", 1)[-1]), json.loads(value)
            except (ValueError, TypeError):
                continue
            peer = self.peers.get(p)
            if peer is None:
                continue
            if int(hb.get("seq", -1)) != peer.seq:
                peer.seq, peer.changed_at = int(hb.get("seq", -1)), now
            peer.step, peer.state, peer.note = int(hb.get("step", 0)), str(hb.get("state")), \
                str(hb.get("note", ""))
        for peer in self.peers.values():  # a peer without a heartbeat yet: watched from now
            if peer.changed_at is None:
                peer.changed_at = now
        self._last_read = now
        return True

    def set_step(self, step: int) -> None:
        """This process's last finished step, published soon (see the class docstring)."""
        self.step = step
        self._wake.set()

    def tick(self) -> None:
        """One heartbeat: publish (not once exiting), then (every ``read_every``
        ticks) read."""
        if not self._exiting.is_set():
            self.publish()
        if self._ticks % self.read_every == 0:
            self.read()
        self._ticks += 1

    # -- what it knows -------------------------------------------------------
    def unanswered_s(self, now: float | None = None) -> float:
        """How long the store has not answered: the call in flight's age, or the
        age of the first of the failing calls in a row (0 while it answers)."""
        now = self.clock() if now is None else now
        since = [t for t in (self._rpc_since, self._failing_since) if t is not None]
        return max((now - t for t in since), default=0.0)

    def findings(self, min_stale_s: float, exited: bool = False, coordinator: bool = True,
                 now: float | None = None) -> list[str]:
        """What is known to be wrong with the peers, one phrase per lost process.

        A peer is named when it exited after losing a peer (its ``note``), when
        its heartbeat stood still for ``min_stale_s`` across this process's
        reads (only while the reads succeed: a store that does not answer
        leaves every peer unchanged), with ``exited=True`` (a diagnosis after a
        failure) also when it ended or never sent a heartbeat, and (with
        ``coordinator``) process 0 when the store it holds has not answered
        for ``min_stale_s``.
        """
        now = self.clock() if now is None else now
        out, named = [], set()
        read_window = self.tick_s * self.read_every
        for peer in sorted(self.peers.values(), key=lambda q: q.process):
            seen = self._last_read is not None and peer.changed_at is not None
            age = (self._last_read - peer.changed_at) if seen else 0.0
            if peer.state == "lost":
                out.append(f"process {peer.process} exited at step {peer.step} after losing a "
                           f"peer ({peer.note})")
            elif peer.state == "exited" and exited:
                out.append(f"process {peer.process} exited after step {peer.step}")
            elif (peer.state == "running" or (peer.state == "unread" and exited)) and seen and \
                    age >= max(min_stale_s, 2 * read_window):
                what = f"stopped (last heartbeat {age:.0f} s ago, at step {peer.step})" \
                    if peer.state == "running" else f"never sent a heartbeat ({age:.0f} s)"
                out.append(f"process {peer.process} {what}: it died or stalled")
            else:
                continue
            named.add(peer.process)
        silent = self.unanswered_s(now)
        if coordinator and self.process_id != 0 and 0 not in named and 0 < silent and \
                silent >= min_stale_s:
            p0 = self.peers[0]
            last = (f"last heartbeat {now - p0.changed_at:.0f} s ago, at step {p0.step}"
                    if p0.seq >= 0 else "no heartbeat of it was read")
            out.append(f"process 0 (the coordinator: it holds jax.distributed's service) "
                       f"stopped answering {silent:.0f} s ago ({last}; "
                       f"{self._last_error or 'a call to it hangs'}): it died or stalled")
        return out

    def describe(self) -> str:
        """Every peer's last heartbeat, lowest step first (8 at most)."""
        now = self._last_read if self._last_read is not None else self.clock()
        peers = sorted(self.peers.values(), key=lambda q: (q.step, q.process))
        text = ", ".join(
            f"process {q.process} at step {q.step} ({q.state}, heartbeat "
            f"{max(0.0, now - q.changed_at):.0f} s old)" if q.seq >= 0 else
            f"process {q.process} (no heartbeat read)" for q in peers[:8])
        return text + (f" and {len(peers) - 8} more" if len(peers) > 8 else "")

    def diagnose(self, wait_s: float = 0.0, min_stale_s: float | None = None) -> list[str]:
        """:meth:`findings` (ended peers included) within ``wait_s``: after a
        failure (a collective raised, the runtime aborts) a peer that just
        died still has a fresh heartbeat; this waits until it stands still for
        ``min_stale_s`` (default two heartbeats) or the store stops answering
        for that long. Returns ``[]`` when nothing was found by then."""
        min_stale_s = 2 * self.tick_s if min_stale_s is None else min_stale_s
        deadline = self.clock() + wait_s
        while True:
            found = self.findings(min_stale_s, exited=True)
            if found or self.clock() >= deadline:
                return found
            time.sleep(min(0.2, self.tick_s / 4))

    def report(self, findings: list[str], what: str = "") -> str:
        """The line printed on an exit: this process, its step, the findings."""
        head = f"trjax: process {self.process_id} after step {self.step}"
        head += f" ({what})" if what else ""
        if findings:
            return f"{head}: {'; '.join(findings)}. Exiting with code {self.exit_code}."
        return (f"{head}: no peer's heartbeat stopped ({self.describe() or 'no peers'}). "
                f"Exiting with code {self.exit_code}.")

    # -- the threads -----------------------------------------------------------
    def _publisher(self):
        try:
            self._publish_loop()
        except (TypeError, AttributeError) as e:  # another jax's client API: no monitor
            self.disabled = f"{type(e).__name__}: {e}"
            self._stop.set()

    def _publish_loop(self):
        next_tick = self.clock()
        while not self._stop.is_set() and self.alive():
            now = self.clock()
            changed = self.step != self._published_step and not self._exiting.is_set()
            if now >= next_tick:
                self.tick()
                next_tick = now + self.tick_s
            elif changed and now - self._published_at >= self.step_gap_s:
                self.publish()
                if self.read_every == 1:
                    self.read()
            now = self.clock()
            wait = next_tick - now
            if self.step != self._published_step:
                wait = min(wait, self._published_at + self.step_gap_s - now)
            self._wake.wait(max(0.01, wait))
            self._wake.clear()

    def _checker(self):
        while not self._stop.wait(self.tick_s / 4):
            if not self.alive():  # jax.distributed was shut down
                self._stop.set()
                return
            # while exiting, process 0's service ends with the run: only silent peers count
            found = self.findings(self.stale_s, coordinator=not self._exiting.is_set())
            if found and not self._stop.is_set():
                exit_reporting(self.report(found), self.exit_code, self, found)

    def start(self) -> "PeerMonitor":
        if not self._threads:
            self._threads = [threading.Thread(target=f, daemon=True, name=n) for f, n in
                             ((self._publisher, "trjax-heartbeat"),
                              (self._checker, "trjax-peer-check"))]
            for t in self._threads:
                t.start()
        return self

    def exiting(self, wait_s: float = 1.0) -> None:
        """At Python's exit: publishes ``exited`` (peers do not take this
        process's silence for a loss) and stops publishing, but keeps
        watching: a peer that dies meanwhile would hold ``jax.distributed``'s
        shutdown barrier until jax aborts the process; the monitor reports it
        first."""
        self._publish_within("exited", "", wait_s)
        self._exiting.set()

    def stop(self, state: str = "exited", note: str = "", wait_s: float = 1.0) -> None:
        """Stops both threads and publishes ``state`` (so peers do not take this
        process's silence for a loss), waiting at most ``wait_s`` for the store."""
        self._stop.set()
        self._publish_within(state, note, wait_s)

    def _publish_within(self, state: str, note: str, wait_s: float) -> None:
        def publish():
            try:
                self.publish(state, note)
            except (TypeError, AttributeError):  # a client without the store API
                pass
        t = threading.Thread(target=publish, daemon=True)
        t.start()
        t.join(wait_s)


_MONITOR: PeerMonitor | None = None


def _client():
    """``jax.distributed``'s client, or None (not started, or another jax layout)."""
    try:
        from jax._src import distributed as jax_distributed
        return jax_distributed.global_state.client
    except (ImportError, AttributeError):
        return None


def start_peer_monitor(stale_s: float, exit_code: int = EXIT_PEER_LOST) -> PeerMonitor | None:
    """Starts this process's :class:`PeerMonitor` once ``jax.distributed`` runs
    with several processes (None otherwise, or when one already runs: that one
    is returned). At Python's exit it publishes ``exited`` (:meth:`PeerMonitor.exiting`);
    SIGABRT (jax's runtime ending the process on a lost peer) is reported
    first (:func:`_install_abort_report`)."""
    global _MONITOR
    if _MONITOR is not None:
        return _MONITOR
    client = _client()
    if client is None:
        return None
    from jax._src import distributed as jax_distributed  # not jax.process_count(): that
    state = jax_distributed.global_state               # would start the backend here
    if state.num_processes <= 1:
        return None
    _MONITOR = PeerMonitor(client, state.process_id, state.num_processes, stale_s, exit_code,
                           alive=lambda: _client() is client).start()
    atexit.register(_MONITOR.exiting)  # runs before jax's own shutdown (registered at import)
    _install_abort_report(_MONITOR)
    return _MONITOR


_EXITING = threading.Lock()


def exit_reporting(line: str, code: int, monitor: PeerMonitor | None = None,
                   findings: list[str] = ()) -> None:
    """Prints ``line`` to stderr and ends the process with ``code`` at once
    (``os._exit``: no ``jax.distributed`` shutdown, whose barrier would wait on
    the lost peer); with a monitor, first publishes ``lost`` with ``findings``
    (so the other processes name this one's reason). Only the first caller
    reports; a second thread waits here for the exit."""
    if not _EXITING.acquire(blocking=False):
        while True:
            time.sleep(60)
    print(line, file=sys.stderr, flush=True)
    if monitor is not None:
        monitor.stop("lost", "; ".join(findings)[:300] or "no peer named")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


_ABORT_HANDLER = None  # the ctypes handler and the one it replaced, kept alive


def _install_abort_report(monitor: PeerMonitor, wait_s: float = 3.0) -> bool:
    """On SIGABRT, names the lost peer before the process ends.

    jax's runtime ends every other process with ``abort()`` when it learns of
    a lost peer (at once when process 0 is gone), before Python could run.
    This C-level handler (``ctypes``) waits up to ``wait_s`` for the monitor's
    evidence (:meth:`PeerMonitor.diagnose`); with some it reports and exits
    with the monitor's code, without any it restores the previous handler and
    aborts as before (an abort for another reason stays one). Returns whether
    the handler is installed (POSIX with ctypes only)."""
    global _ABORT_HANDLER
    import signal
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        handler_t = ctypes.CFUNCTYPE(None, ctypes.c_int)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    except (ImportError, OSError, AttributeError):
        return False

    def on_abort(signum):
        found = [] if monitor._stop.is_set() else monitor.diagnose(wait_s)  # stopped: exiting
        if found or _EXITING.locked():  # (another thread's report under way: it ends the process)
            exit_reporting(monitor.report(found, "jax's distributed runtime aborts it"),
                           monitor.exit_code, monitor, found)
        libc.signal(signal.SIGABRT, previous)
        os.abort()

    callback = handler_t(on_abort)
    previous = libc.signal(signal.SIGABRT, ctypes.cast(callback, ctypes.c_void_p).value)
    _ABORT_HANDLER = (callback, previous)
    return True


class StepWatchdog:
    """Exits the process when no step finished for ``timeout_s`` seconds.

    Call :meth:`beat` after each finished step (the host has read its
    metrics); the step is also what this process's :class:`PeerMonitor`
    publishes. A background thread checks once a second; on timeout it prints
    the last finished step and what the peers' heartbeats say (the lost or
    lagging process, :meth:`PeerMonitor.findings`) and calls
    ``os._exit(exit_code)`` -- a collective stuck in XLA cannot be interrupted
    any other way. ``timeout_s <= 0`` disables the timeout (not the peer
    monitor). Use as a context manager.
    """

    def __init__(self, timeout_s: float, exit_code: int = EXIT_PEER_LOST, what: str = "step"):
        self.timeout_s, self.exit_code, self.what = timeout_s, exit_code, what
        self.last = time.monotonic()
        self.step = 0
        self._stop = threading.Event()
        self._thread = None

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()
        if _MONITOR is not None:
            _MONITOR.set_step(step)

    def _message(self, idle: float) -> str:
        head = (f"watchdog: no {self.what} finished for {idle:.0f} s (last finished: "
                f"{self.step}) on process {jax.process_index()}")
        monitor = _MONITOR
        if monitor is None:
            return f"{head}; a peer is dead or stuck. Exiting with code {self.exit_code}."
        found = monitor.findings(2 * monitor.tick_s, exited=True)
        if not found:  # every heartbeat runs: the lowest step is where the run hangs
            lag = min(monitor.peers.values(), key=lambda q: (q.step, q.process), default=None)
            found = [f"every peer's heartbeat runs ({monitor.describe()})"]
            if lag is not None and lag.step < self.step:
                found[0] += f"; process {lag.process} lags at step {lag.step}: it hangs"
        return f"{head}: {'; '.join(found)}. Exiting with code {self.exit_code}."

    def _run(self):
        while not self._stop.wait(1.0):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                exit_reporting(self._message(idle), self.exit_code, _MONITOR,
                               [f"no {self.what} finished for {idle:.0f} s"])

    def __enter__(self):
        if _MONITOR is None and jax.process_count() > 1:  # jax.distributed started elsewhere
            start_peer_monitor(stale_after_s(30), self.exit_code)
        if self.timeout_s > 0:
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._run, daemon=True, name="step-watchdog")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False


def exit_peer_lost(code: int = EXIT_PEER_LOST, what: str = "a collective failed") -> None:
    """Ends this process with ``code`` at once, naming the lost peer.

    For a survivor whose collective failed because a peer died: it waits (at
    most the monitor's ``stale_s`` and two heartbeats) until the peers'
    heartbeats show which process stopped (:meth:`PeerMonitor.diagnose`),
    prints one line naming this process's step and the lost process with its
    last step, and ends with ``os._exit``: a normal exit runs
    ``jax.distributed``'s shutdown, whose barrier waits on the dead peer and
    then aborts the process (SIGABRT, rc -6), hiding the run's own exit code.
    The watchdog (:class:`StepWatchdog`) exits the same way.
    """
    monitor = _MONITOR
    if monitor is None:
        exit_reporting(f"trjax: process {jax.process_index()} ({what}): no peer monitor runs "
                       f"(jax.distributed not started by trjax.train.distributed.initialize). "
                       f"Exiting with code {code}.", code)
    monitor.exit_code = code
    found = monitor.diagnose(monitor.stale_s + 2 * monitor.tick_s)
    exit_reporting(monitor.report(found, what), code, monitor, found or [what])
