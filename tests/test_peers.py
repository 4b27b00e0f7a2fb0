"""A peer process that dies or stalls: every survivor exits with EXIT_PEER_LOST and a line
naming its own step and the lost process (trjax.train.distributed.PeerMonitor).

The unit tests drive a PeerMonitor by hand (a fake key-value store, a fake clock); the
process test runs 2-process jobs of a tiny psum loop on jax.distributed (gloo) and kills
or SIGSTOPs either process -- process 0 holds jax's coordination service, so each side
fails differently (a collective error, jax's runtime aborting the survivor, a store that
stops answering)."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from trjax.train import distributed, stops

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class FakeStore:
    """The part of jax's DistributedRuntimeClient the monitor uses: one dict shared by the
    processes' clients; ``frozen`` makes every call block (process 0 stopped), ``dead``
    makes it raise (process 0 gone)."""

    def __init__(self):
        self.kv, self.frozen, self.dead = {}, threading.Event(), False
        self.release = threading.Event()

    def _enter(self):
        if self.frozen.is_set():
            self.release.wait(30)
        if self.dead:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")

    def key_value_set(self, key, value, allow_overwrite=False):
        self._enter()
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        self._enter()
        return [(k, v) for k, v in sorted(self.kv.items()) if k.startswith(prefix)]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _monitors(n=3, stale_s=3.0):
    store, clock = FakeStore(), Clock()
    mons = [distributed.PeerMonitor(store, i, n, stale_s, clock=clock) for i in range(n)]
    return store, clock, mons


def _ticks(mons, clock, seconds, skip=()):
    for _ in range(int(seconds)):
        clock.t += 1.0
        for i, m in enumerate(mons):
            if i not in skip:
                m.tick()


def test_a_peer_whose_heartbeat_stops_is_named_with_its_step_after_stale_s():
    store, clock, mons = _monitors()
    for m in mons:
        m.step = 7
    _ticks(mons, clock, 5)
    assert all(m.findings(3.0) == [] for m in mons)  # healthy peers are never named
    mons[0].step, mons[2].step = 9, 9
    _ticks(mons, clock, 2, skip=(1,))  # process 1 stops after publishing step 7
    assert mons[0].findings(3.0) == []  # 2 s: not yet
    _ticks(mons, clock, 2, skip=(1,))
    found = mons[0].findings(3.0)
    assert found == ["process 1 stopped (last heartbeat 3 s ago, at step 7): it died or stalled"]
    assert mons[2].findings(3.0) == [found[0].replace("3 s", "4 s")]  # read it 1 s earlier
    line = mons[0].report(found, "a collective failed")
    assert line == ("trjax: process 0 after step 9 (a collective failed): process 1 stopped "
                    "(last heartbeat 3 s ago, at step 7): it died or stalled. Exiting with code 3.")


def test_a_stopped_coordinator_is_named_and_no_other_peer_is_blamed():
    """Process 0 holds the store: when it stops, the others' calls hang. They must name
    process 0 -- and not process 2, whose heartbeat they merely cannot read any more."""
    store, clock, mons = _monitors()
    for m in mons:
        m.step = 5
    _ticks(mons, clock, 3)
    store.frozen.set()
    t = threading.Thread(target=mons[1].tick, daemon=True)  # blocks in the store
    t.start()
    for _ in range(50):
        if mons[1].unanswered_s() == 0.0 and mons[1]._rpc_since is None:
            time.sleep(0.01)
    clock.t += 2.0
    assert mons[1].findings(3.0) == []
    clock.t += 2.0
    found = mons[1].findings(3.0)
    assert len(found) == 1 and found[0].startswith(
        "process 0 (the coordinator: it holds jax.distributed's service) stopped answering 4 s "
        "ago (last heartbeat 4 s ago, at step 5; a call to it hangs): it died or stalled"), found
    store.release.set()
    t.join(5)
    # a store that refuses (process 0 gone) names it the same way, with the error
    store, clock, mons = _monitors()
    _ticks(mons, clock, 3)
    store.dead = True
    clock.t += 1.0
    mons[1].tick()
    clock.t += 3.0
    found = mons[1].findings(3.0)
    assert len(found) == 1 and "process 0 (the coordinator" in found[0] and \
        "RuntimeError: UNAVAILABLE" in found[0], found


def test_exited_and_lost_peers():
    """A peer that ended through Python's exit is named only in a diagnosis after a failure
    (at a normal end the processes exit one after the other); one that exited because it lost
    a peer makes the others exit too, naming both."""
    store, clock, mons = _monitors()
    for m in mons:
        m.step = 4
    _ticks(mons, clock, 2)
    mons[1].exiting()  # atexit: "exited", then silent
    _ticks(mons, clock, 6, skip=(1,))
    assert mons[0].findings(3.0) == []
    assert mons[0].diagnose() == ["process 1 exited after step 4"]
    mons[2].stop("lost", "process 9 stopped at step 3 (no heartbeat for 5 s): it died or stalled")
    _ticks(mons, clock, 1, skip=(1, 2))
    assert mons[0].findings(3.0) == [
        "process 2 exited at step 4 after losing a peer (process 9 stopped at step 3 (no "
        "heartbeat for 5 s): it died or stalled)"]


def test_the_watchdog_names_the_lagging_peer_when_every_heartbeat_runs(monkeypatch):
    store, clock, mons = _monitors(2)
    mons[1].step = 3
    _ticks(mons, clock, 3)
    monkeypatch.setattr(distributed, "_MONITOR", mons[0])
    watchdog = distributed.StepWatchdog(60.0)
    watchdog.beat(8)
    assert mons[0].step == 8  # the step the heartbeat publishes
    msg = watchdog._message(61.0)
    assert msg.startswith("watchdog: no step finished for 61 s (last finished: 8) on process 0: "
                          "every peer's heartbeat runs (process 1 at step 3 (running"), msg
    assert msg.endswith("process 1 lags at step 3: it hangs. Exiting with code 3.")


def test_stale_after_s_stays_below_jax_heartbeat_timeout():
    assert distributed.stale_after_s(10) == 3.0 and distributed.stale_after_s(30) == 9.0
    assert distributed.stale_after_s(1000) == 30.0 and distributed.stale_after_s(1) == 3.0


# --------------------------------------------------------------------------- two processes

WORKER = """
import os, sys, time
import jax, numpy as np
from trjax.train import distributed, stops
pid, port = int(sys.argv[1]), sys.argv[2]
distributed.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_s=10)
P = jax.sharding.PartitionSpec
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                          out_specs=P()))
x = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, P("d")),
                                           np.ones(1, np.float32))
with distributed.StepWatchdog(60.0) as watchdog:  # what the training loop does
    step = 0
    try:
        while True:
            step += 1
            np.asarray(f(x))
            watchdog.beat(step)
            if step == 20:
                print("running", flush=True)
            time.sleep(0.05)
    except Exception as e:  # the training command's handler of a failed collective
        print(f"collective failed: {type(e).__name__}", flush=True)
        distributed.exit_peer_lost(stops.EXIT_PEER_LOST)
"""


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.job
def test_every_survivor_names_the_killed_or_stopped_peer():
    """The four ways a peer goes, at once (8 small processes): kill or SIGSTOP process 1
    (the survivor, process 0, holds jax's service: a collective error or a heartbeat that
    stands still) or process 0 (the survivor's calls to the store hang, or jax's runtime
    aborts it with SIGABRT at once). Each survivor exits with EXIT_PEER_LOST well before
    jax's heartbeat timeout (10 s) would abort it, with a line naming the other process."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cases = [(victim, sig) for victim in (1, 0) for sig in (signal.SIGKILL, signal.SIGSTOP)]
    jobs = []
    for victim, sig in cases:
        port = _port()
        jobs.append([subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for i in range(2)])
    try:
        for procs in jobs:
            for p in procs:
                for line in p.stdout:
                    if line.startswith("running"):
                        break
        t0 = time.monotonic()
        for (victim, sig), procs in zip(cases, jobs):
            procs[victim].send_signal(sig)
        outs = [procs[1 - victim].communicate(timeout=60)[0] for (victim, _), procs in
                zip(cases, jobs)]
        elapsed = time.monotonic() - t0
    finally:
        for procs in jobs:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                p.wait()
    for (victim, sig), procs, out in zip(cases, jobs, outs):
        survivor = procs[1 - victim]
        what = f"{signal.Signals(sig).name} of process {victim}"
        assert survivor.returncode == stops.EXIT_PEER_LOST, (what, out[-3000:])
        assert re.search(rf"trjax: process {1 - victim} after step \d+( \([^)]*\))?: "
                         rf"process {victim} (\(the coordinator[^)]*\) )?stopped"
                         r"[^\n]*at step \d+[^\n]*: it died or stalled\. "
                         r"Exiting with code 3\.", out), (what, out[-3000:])
    assert elapsed < 9.0  # before jax's heartbeat timeout (10 s) aborts a survivor


def test_a_client_without_the_store_api_disables_the_monitor_without_an_exit():
    """Another jax's client (no key_value_dir_get, or no allow_overwrite): the monitor
    stops by itself instead of taking the TypeError for a store that does not answer."""
    class OldClient:
        def key_value_set(self, key, value):
            pass

    mon = distributed.PeerMonitor(OldClient(), 1, 2, 3.0, tick_s=0.05).start()
    for _ in range(100):
        if mon.disabled:
            break
        time.sleep(0.02)
    assert "TypeError" in mon.disabled and mon._stop.is_set()
    assert mon.findings(0.0) == [] and mon.unanswered_s() == 0.0
