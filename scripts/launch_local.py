"""Starts N local processes of a trjax script on 127.0.0.1 (multi-host on one machine).

  python scripts/launch_local.py --num_processes 2 --cpu_devices 4 -- \\
      scripts/train.py --config configs/default.py --workdir runs/mh

Each process gets ``--config.distributed.coordinator=127.0.0.1:PORT
--config.distributed.num_processes=N --config.distributed.process_id=i
--config.cpu_devices=D`` appended; their output is prefixed with ``[pI]``.
The launcher exits with the first non-zero exit code of any process (after
giving the others ``--grace_s`` to notice), or 0 when all succeed.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = args.port or free_port()
    procs = []
    for i in range(args.num_processes):
        cmd = [sys.executable, *script, f"--config.distributed.coordinator=127.0.0.1:{port}",
               f"--config.distributed.num_processes={args.num_processes}",
               f"--config.distributed.process_id={i}", f"--config.cpu_devices={args.cpu_devices}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=lambda p=p, i=i: [print(f"[p{i}] {l}", end="", flush=True)
                                                  for l in p.stdout], daemon=True).start()
        procs.append(p)
    first_failure, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0) and not first_failure:
                first_failure, failed_at = p.returncode, time.monotonic()
                print(f"[launch] process {i} exited with {p.returncode}", flush=True)
        if failed_at and time.monotonic() - failed_at > args.grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    print(f"[launch] exit codes {codes}", flush=True)
    return first_failure or next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
