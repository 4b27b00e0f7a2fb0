"""Host prefetching: an iterator run ahead in a background thread.

The loop's batches are made (gathered, decoded, augmented) on a thread while
the devices run the previous steps; :func:`prefetch` bounds how far ahead it
runs, keeps the order, carries the producer's exception to the consumer and
leaves no thread behind when the consumer stops early.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

_END = object()


class _Raised:
    """An exception from the producer, distinguishable from any item."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def prefetch(iterator: Iterable, depth: int = 2) -> Iterator:
    """Runs ``iterator`` in a background thread, with up to ``depth`` items queued.

    The producer holds at most one more item while it waits for a free slot.

    Items arrive in order. An exception raised by the producer is re-raised in
    the consumer at the point it occurred (after the items produced before it).
    When the consumer stops early (``close()``, ``break`` in a for loop, or the
    generator being garbage collected), the producer is told to stop, the
    source iterator's ``close()`` (if any) is called in the producer thread and
    the thread is joined: no thread is left behind. A producer blocked inside a
    slow ``next()`` finishes that one item first. The thread starts on the
    first ``next()``. ``depth=0``: no thread, ``iter(iterator)`` itself.

    Raises:
      ValueError: ``depth`` is not an int >= 0.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"prefetch depth={depth!r} must be an int >= 0 (0: no thread)")
    if depth == 0:
        return iter(iterator)
    return _prefetch(iter(iterator), depth)


def _prefetch(source: Iterator, depth: int) -> Iterator:
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in source:
                if not put(item):
                    return
            put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(_Raised(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="trjax-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
