"""One live run per workdir: a lock the kernel releases when its holder ends.

* :class:`WorkdirLock` -- an exclusive ``flock`` on ``WORKDIR/trjax.lock``,
  held on a file kept open for the run's life. The kernel drops it when the
  holding process ends, however it ends (an exception, a crash, SIGKILL, the
  OOM killer), so no stale lock is ever left to judge or clean up, and
  liveness does not depend on pids: runs in other PID namespaces
  (containers, ``unshare --pid``) see each other's lock. While held, the file
  holds a note (host, pid, start time, command) that names the holder in the
  second run's :class:`WorkdirBusy`; its pid is one of the holder's PID
  namespace. The holder removes the file when it gives the lock back (before
  it closes it, so still holding the lock), and a workdir the lock itself
  created is removed too when nothing else was written into it: a start that
  fails (a config refused before compiling) leaves no trace. A run that
  locked a file removed meanwhile (it opened the path just before the holder
  removed it) sees that the path no longer names its file and opens the path
  again, so two runs never hold two files. A killed holder cannot remove it:
  its note stays, and the next run takes the lock and replaces the note.
* :func:`holds_workdir` -- decorator: process 0 of a run holds the lock while
  the wrapped ``fn(config, workdir, ...)`` runs.

A cluster launch that was not recognised as one run (every task starting its
own single-process job) is the case this guards against: the tasks would
otherwise interleave checkpoints and logs in one folder.

Network file systems (``man 2 flock``). Linux NFS clients emulate ``flock``
with a POSIX byte-range lock on the whole file (since Linux 2.6.12), which
the server arbitrates across clients (NFSv4 locking; lockd for NFSv3); a
mount with ``nolock`` or ``local_lock=flock|all`` keeps it local to each
client. SMB/CIFS propagates it since Linux 5.5 (local only before; the lock
is mandatory there, so the second run may not read the note). On some FUSE
mounts a lock is local to one machine. A local-only lock still refuses a
second run on the same machine, not one on another client. A file system
that refuses ``flock`` (ENOLCK, ENOSYS, EOPNOTSUPP) runs unlocked, with a
message. A forked child shares the lock while the holder lives; a holder that
is killed leaves it to the last such child, one that releases it removes the
file, and the next run locks a new one.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import shlex
import socket
import sys
import time

import jax


LOCK_NAME = "trjax.lock"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # flock refused by the file system
_HELD: dict[str, "WorkdirLock"] = {}  # real path of a lock file -> this process's holder


class WorkdirError(RuntimeError):
    """The workdir cannot be used: not a folder, not writable, or busy."""


class WorkdirBusy(WorkdirError):
    """Another live run writes into this workdir."""


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


def _note() -> bytes:
    """This process's holder note: host, pid, start time and command (JSON)."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "command": shlex.join(sys.argv[:8])}).encode()


def _read_note(path: str) -> dict | str:
    """The holder's note, or why it cannot be read. A holder writes it just
    after taking the lock, so an empty note is read again for a moment."""
    why = "it is empty"
    for _ in range(5):
        try:
            with open(path, "rb") as f:
                note = json.loads(f.read() or b"null")
            if isinstance(note, dict) and "pid" in note:
                return note
            why = "it is empty" if note is None else "it is not a note trjax wrote"
        except OSError as e:  # e.g. SMB: a locked file cannot be read from another client
            return e.strerror or str(e)
        except ValueError:
            why = "it is not a note trjax wrote"
        time.sleep(0.1)
    return why


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _busy(workdir: str, path: str) -> WorkdirBusy:
    note = _read_note(path)
    if isinstance(note, str):
        return WorkdirBusy(f"workdir {workdir!r} is in use by another process (its note in "
                           f"{path} cannot be read: {note}); wait for it or use another "
                           "--workdir")
    return WorkdirBusy(f"workdir {workdir!r} is in use by pid {note.get('pid')} on host "
                       f"{note.get('host')} since {note.get('started')}; wait for it or use "
                       f"another --workdir (its command: {note.get('command')})")


class WorkdirLock:
    """One writer per workdir: an exclusive ``flock`` on ``WORKDIR/trjax.lock``
    (see the module docstring), with a note naming the holder.

    :meth:`acquire` takes it without waiting; :meth:`release` (or the end of
    the process) gives it back. A process that holds it may acquire it again
    through another ``WorkdirLock``: that one holds nothing of its own and its
    release leaves the lock to the first.
    """

    def __init__(self, workdir: str, log=print):
        self.workdir, self.log = workdir, log
        self.path = os.path.join(workdir, LOCK_NAME)
        self.held = False
        self._fd: int | None = None
        self._key = ""
        self._made_workdir = False  # acquire created the folder: release removes it if empty

    def acquire(self) -> "WorkdirLock":
        """Takes the lock (creating the workdir if needed).

        Raises:
          WorkdirBusy: another live process holds it; the message names its
            pid, host, start time and command from the note (or says why the
            note cannot be read), and what to do.
          WorkdirError: the workdir or its lock file cannot be created or opened.
        """
        for attempt in range(100):  # again when a holder removed the file (or folder) meanwhile
            try:
                made = not os.path.isdir(self.workdir)
                os.makedirs(self.workdir, exist_ok=True)
                key = os.path.realpath(self.path)
                if key in _HELD:  # this process holds it already
                    self.held = True
                    return self
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError as e:  # a holder removed the empty folder it had made
                if attempt < 99:
                    continue
                raise _unusable(self.workdir, e) from e
            except OSError as e:  # a file where the folder should be, no permission, ...
                raise _unusable(self.workdir, e) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not _names(self.path, fd) and attempt < 99:  # its holder just released it
                    os.close(fd)
                    continue
                os.close(fd)
                raise _busy(self.workdir, self.path) from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise _unusable(self.workdir, e) from e
                self.log(f"trjax: {self.path} cannot be locked on this file system "
                         f"({e.strerror}): running without the one-run-per-workdir check")
            if _names(self.path, fd):
                break
            os.close(fd)  # the file we locked was removed by its releasing holder: again
        else:
            raise WorkdirError(f"workdir {self.workdir!r}: its lock file {self.path} kept being "
                               "replaced while this run locked it; is another program removing "
                               "it?")
        self._made_workdir = made
        os.ftruncate(fd, 0)  # a holder that was killed left its note
        os.pwrite(fd, _note(), 0)
        self._fd, self._key, self.held = fd, key, True
        _HELD[key] = self
        return self

    def release(self) -> None:
        """Removes the lock file and gives the lock back, if this object holds
        it; then the workdir too when :meth:`acquire` created it and it is
        empty (a start that failed before writing anything)."""
        self.held = False
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.pop(self._key, None)
        try:
            os.ftruncate(fd, 0)
            if _names(self.path, fd):  # removed while still locked (see the module docstring)
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)  # the kernel drops the flock with the last descriptor
        if self._made_workdir:
            try:
                os.rmdir(self.workdir)  # only an empty folder; anything written keeps it
            except OSError:
                pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def holds_workdir(fn):
    """Decorator for ``fn(config, workdir, ...)``: process 0 holds
    :class:`WorkdirLock` on ``workdir`` while ``fn`` runs (other processes of
    a multi-process run write nothing there). A nested call keeps the outer
    call's lock.

    Raises:
      WorkdirBusy: before ``fn`` starts, when another process holds the workdir.
      WorkdirError: the workdir cannot be created or its lock file opened.
    """
    @functools.wraps(fn)
    def wrapper(config, workdir, *args, **kwargs):
        if jax.process_index() != 0:
            return fn(config, workdir, *args, **kwargs)
        with WorkdirLock(workdir):
            return fn(config, workdir, *args, **kwargs)
    return wrapper
