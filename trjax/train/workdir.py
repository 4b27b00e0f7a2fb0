"""One live run per workdir: a lock file that names its holder.

* :class:`WorkdirLock` -- ``WORKDIR/trjax.lock`` holds the host, pid and the
  pid's start time; a second live run is refused with :class:`WorkdirBusy`
  (naming the holder), a dead holder's lock is taken over.
* :func:`holds_workdir` -- decorator: process 0 of a run holds the lock while
  the wrapped ``fn(config, workdir, ...)`` runs.

A cluster launch that was not recognised as one run (every task starting its
own single-process job) is the case this guards against: the tasks would
otherwise interleave checkpoints and logs in one folder.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time

import jax


LOCK_NAME = "trjax.lock"


class WorkdirError(RuntimeError):
    """The workdir cannot be used: not a folder, not writable, or busy."""


class WorkdirBusy(WorkdirError):
    """Another live run writes into this workdir."""


def _read_lock(path: str) -> dict | None:
    """The lock's record, or None when it is not one trjax wrote (or not yet)."""
    try:
        with open(path) as f:
            other = json.load(f)
        int(other.get("pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return other if isinstance(other, dict) else None


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/PID/stat`` field 22, clock ticks since
    boot), or None when no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` runs on this host and is the process that wrote ``start``."""
    if pid <= 0:  # kill(0 or -1, 0) would ask about whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    now = _start_time(pid)
    return start is None or now is None or now == start  # a recycled pid is another process


def _unusable(workdir: str, e: OSError) -> WorkdirError:
    return WorkdirError(f"workdir {workdir!r} cannot be used: {e.strerror} ({e.filename}); pass "
                        "a writable folder as --workdir")


def check_writable(folder: str) -> None:
    """Creates ``folder`` if needed and writes and removes a probe file in it.

    Raises:
      WorkdirError: naming the folder and the OS error (a read-only or
        immutable folder would otherwise fail only at the first checkpoint,
        after an epoch of training, inside orbax's background writer).
    """
    probe = os.path.join(folder, f".trjax-write-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"cannot write in {folder!r}: {e.strerror} ({e.filename}); make it "
                           "writable or pass another --workdir") from e


class WorkdirLock:
    """One writer per workdir: ``WORKDIR/trjax.lock`` holds the host, pid and
    start time of the run that writes there.

    :meth:`acquire` creates the file atomically (``O_CREAT | O_EXCL``). An
    existing lock of a live process is refused; one left by a process that is
    no longer running on this host (killed, crashed) is taken over with a
    message. A lock from another host cannot be checked and is refused.
    :meth:`release` removes it. The holding process may acquire again.
    """

    def __init__(self, workdir: str, log=print):
        self.workdir, self.log = workdir, log
        self.path = os.path.join(workdir, LOCK_NAME)
        self.held = self.created = False

    def _mine(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[:8]}

    def acquire(self) -> "WorkdirLock":
        """Takes the lock.

        Raises:
          WorkdirBusy: another live run holds the workdir (names its host,
            pid and start, and what to do), or its lock file is not one trjax
            can read.
          WorkdirError: the workdir cannot be created or written.
        """
        self.created = not os.path.isdir(self.workdir)
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as e:  # a file where the folder should be, no permission, ...
            raise _unusable(self.workdir, e) from e
        me = self._mine()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = _read_lock(self.path)
                if other is None:  # being written this instant, or not a lock trjax wrote
                    time.sleep(0.2)
                    if _read_lock(self.path) is None and os.path.lexists(self.path):
                        raise WorkdirBusy(f"workdir {self.workdir!r}: {self.path} is not a lock "
                                           "trjax can read (empty, a folder or other content); "
                                           "if no run uses this workdir, delete it")
                    continue
                if other.get("host") == me["host"] and other.get("pid") == me["pid"]:
                    self.held = True  # this process already holds it
                    return self
                if other.get("host") != me["host"]:
                    raise WorkdirBusy(
                        f"workdir {self.workdir!r} is held by a run on host {other.get('host')!r} "
                        f"(pid {other.get('pid')}, since {other.get('started')}): two runs must "
                        "not write one workdir. Use another --workdir, or, if that run is over, "
                        f"delete {self.path}")
                if _alive(int(other.get("pid") or 0), other.get("start")):
                    raise WorkdirBusy(
                        f"workdir {self.workdir!r} is held by a live run (pid {other['pid']} on "
                        f"this host, since {other.get('started')}): two runs must not write one "
                        "workdir. Use another --workdir, or wait for that run to end")
                self.log(f"trjax: taking over the lock of a run that is no longer running "
                         f"(pid {other.get('pid')} on {other.get('host')}, since "
                         f"{other.get('started')}): {self.path}")
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            except OSError as e:  # no permission, a read-only file system, ...
                raise _unusable(self.workdir, e) from e
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise WorkdirBusy(f"workdir {self.workdir!r}: could not take {self.path} (another "
                           "process keeps replacing it)")

    def release(self) -> None:
        """Removes the lock if this process holds it."""
        if not self.held:
            return
        self.held = False
        try:
            with open(self.path) as f:
                other = json.load(f)
            if other.get("pid") == os.getpid() and other.get("host") == socket.gethostname():
                os.remove(self.path)
            if self.created and not os.listdir(self.workdir):
                os.rmdir(self.workdir)  # a refused or failed run leaves nothing behind
        except (OSError, ValueError):
            pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def holds_workdir(fn):
    """Decorator for ``fn(config, workdir, ...)``: process 0 holds
    :class:`WorkdirLock` on ``workdir`` while ``fn`` runs (other processes of
    a multi-process run write nothing there). Refusal raises
    :class:`WorkdirBusy` before ``fn`` starts."""
    @functools.wraps(fn)
    def wrapper(config, workdir, *args, **kwargs):
        if jax.process_index() != 0:
            return fn(config, workdir, *args, **kwargs)
        lock = WorkdirLock(workdir)
        held_before = os.path.exists(lock.path) and _lock_pid(lock.path) == os.getpid()
        with lock:
            try:
                return fn(config, workdir, *args, **kwargs)
            finally:
                lock.held = lock.held and not held_before  # a nested call keeps the outer lock
    return wrapper


def _lock_pid(path: str):
    try:
        with open(path) as f:
            return json.load(f).get("pid")
    except (OSError, ValueError):
        return None
