"""Starts N local processes of a trjax script on 127.0.0.1 (multi-host on one machine).

  python scripts/launch_local.py --num_processes 2 --cpu_devices 4 -- \\
      scripts/train.py --config configs/default.py --workdir runs/mh

Each process gets ``--config.distributed.coordinator=127.0.0.1:PORT
--config.distributed.num_processes=N --config.distributed.process_id=i
--config.cpu_devices=D`` appended; their output is prefixed with ``[pI]``.
The launcher exits with the first non-zero exit code of any process (after
giving the others ``--grace_s`` to notice; a process ended by signal N
counts as 128 + N, as a shell reports it), or 0 when all succeed.

Signals. SIGTERM and SIGINT to the launcher are forwarded to every process
(a signal it inherited ignored stays ignored, in the processes too): trjax's
processes agree on a stop step, save a checkpoint there and exit with 143
(SIGTERM) or 130 (SIGINT) (``trjax.train.stops``); the launcher waits for them
and exits with that code, as torchrun and SLURM report such a stop. A
terminal's Ctrl-C or a scheduler's signal to every process reaches the
processes directly as well; they take the forwarded copy as the same request.
A second signal is forwarded too: the processes then stop at once, without a
checkpoint.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def catch_signals() -> list:
    """Installs handlers that queue SIGTERM/SIGINT (not ones inherited ignored);
    returns the queue, which :func:`wait` forwards from."""
    pending = []
    for sig in FORWARDED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: pending.append(signum))
    return pending


def start(script, num_processes: int, cpu_devices: int, port: int):
    """Starts the processes; returns them and the threads that print their output."""
    procs, readers = [], []
    for i in range(num_processes):
        cmd = [sys.executable, *script, f"--config.distributed.coordinator=127.0.0.1:{port}",
               f"--config.distributed.num_processes={num_processes}",
               f"--config.distributed.process_id={i}", f"--config.cpu_devices={cpu_devices}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
        print(f"[launch] process {i}: pid {p.pid}", flush=True)
        readers.append(threading.Thread(target=lambda p=p, i=i: [
            print(f"[p{i}] {l}", end="", flush=True) for l in p.stdout], daemon=True))
        readers[-1].start()
        procs.append(p)
    return procs, readers


def wait(procs, readers, pending: list, grace_s: float) -> int:
    """Waits for every process (and the end of its output), forwarding each
    queued signal to those alive; after the first failure the others get
    ``grace_s`` before they are killed. Returns the first non-zero exit code
    (:func:`exit_code`), else 0."""
    first_failure, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        while pending:
            sig = pending.pop(0)
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                p.send_signal(sig)
            print(f"[launch] {signal.Signals(sig).name}: forwarded to {len(alive)} "
                  "process(es); waiting for them to stop", flush=True)
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0) and not first_failure:
                first_failure, failed_at = exit_code(p.returncode), time.monotonic()
                print(f"[launch] process {i} exited with {p.returncode}", flush=True)
        if failed_at and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)  # a queued signal waits at most this long (stops.REPEAT_S)
    for r in readers:  # the processes' last lines (the stop step, the checkpoint)
        r.join(timeout=10)
    codes = [p.returncode for p in procs]
    print(f"[launch] exit codes {codes}", flush=True)
    return first_failure or next((exit_code(c) for c in codes if c), 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--cpu_devices", type=int, default=4, help="simulated CPU devices per process")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    ap.add_argument("--grace_s", type=float, default=90.0,
                    help="after one process fails, how long the others may take to exit")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [its flags]")
    args = ap.parse_args()
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the script to run after --, e.g. -- scripts/train.py --config ...")
    pending = catch_signals()  # before the first process starts: none is left behind
    procs, readers = start(script, args.num_processes, args.cpu_devices,
                           args.port or free_port())
    return wait(procs, readers, pending, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
