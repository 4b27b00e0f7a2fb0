"""``metrics.jsonl``: one JSON object per line, written so that a crash cannot corrupt it.

* :func:`read_rows` -- every reader's way in (``trjax-plot``, notebooks,
  tests): a line that is not a complete JSON object (a crash cut it off, or
  someone edited the file) is skipped with a warning naming the line number,
  never an exception.
* :class:`MetricsWriter` -- the training loop's way out. Each row goes to the
  file in ONE ``write`` on an ``O_APPEND`` descriptor, so a reader sees a
  row whole or not at all (short of a crash inside that one call). On
  resume it first repairs the file: a cut-off last line is truncated away,
  and rows past the restored step (written after the checkpoint the run
  resumes from) are dropped, since the resumed run writes them again. The
  rewrite goes through a temporary file and ``os.replace``, so the old file
  survives a crash during the repair.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Callable


def _parse(line: str):
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_rows(path: str, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl``, skipping lines that do not parse.

    Args:
      path: the file.
      warn: called with one message per skipped line (default:
        ``warnings.warn``).

    Returns:
      The parsed rows (dicts), in file order. Blank lines are ignored
      silently; a line that is not a complete JSON object is skipped with a
      warning naming ``path`` and its 1-based line number.

    Raises:
      FileNotFoundError: ``path`` does not exist.
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = _parse(line)
            if row is None:
                warn(f"{path}:{number}: skipped a line that is not a complete JSON object "
                     f"({line.strip()[:60]!r}); a run was probably cut off while writing it")
                continue
            rows.append(row)
    return rows


def repair(path: str, keep_until_step: int | None = None) -> int:
    """Makes ``path`` a clean JSONL file before a resumed run appends to it.

    Drops every line that does not parse (a cut-off last line, in practice)
    and, when ``keep_until_step`` is given, every row whose ``"step"`` is
    larger (rows written after the checkpoint being resumed from). The file is
    rewritten atomically (temporary file + ``os.replace``) only if something
    was dropped.

    Returns:
      The number of lines dropped (0 when the file is missing or clean).
    """
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        if not line.strip():
            continue
        row = _parse(line)
        if row is None or (keep_until_step is not None and
                           isinstance(row.get("step"), (int, float)) and
                           row["step"] > keep_until_step):
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    dropped = len([l for l in lines if l.strip()]) - len(kept)
    if dropped or any(not l.endswith("\n") for l in lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """Appends rows to a ``metrics.jsonl``, one whole line per ``write``.

    Args:
      path: the file.
      resume: keep the existing rows (after :func:`repair`); otherwise start
        an empty file.
      keep_until_step: with ``resume``, the step of the restored checkpoint:
        rows past it are dropped (the resumed run writes them again).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str, resume: bool = False, keep_until_step: int | None = None):
        self.path = path
        self.dropped = repair(path, keep_until_step) if resume else 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o644)

    def write(self, row: dict) -> None:
        """Appends ``row`` (JSON-serialisable; NaN/inf written as JSON's
        ``NaN``/``Infinity`` tokens, which :func:`read_rows` and Python's
        ``json`` read back) as one line, in one system call."""
        data = (json.dumps(row) + "\n").encode("utf-8")
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file takes it all at once; be safe anyway
            written += os.write(self._fd, data[written:])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
