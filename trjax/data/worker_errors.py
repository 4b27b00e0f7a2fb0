"""Errors across the worker-process boundary: an input worker's exception, raised in the parent.

A worker process (grain) hands what it makes to the parent by pickling it, and
an exception does not always survive that: pickle rebuilds one by calling its
class with its ``args``, which fails for a class whose ``__init__`` takes other
arguments (the parent then sees an unrelated ``TypeError`` and the bad file is
never named), and a class or an attribute may not pickle at all. So the
worker's function is wrapped in :class:`Catching`: it returns a :class:`Failure`
instead of raising, and the parent raises :meth:`Failure.rebuild`, which is

* the worker's exception itself when it pickles back to the same type and message;
* else the same type with the same ``args``, message and attributes, rebuilt
  without calling ``__init__``;
* else a :class:`WorkerError` naming the type (``module.qualname``) and the message;

each with a note holding the worker's traceback. Only ``Exception``\\ s are
caught (``KeyboardInterrupt``, ``SystemExit`` stop the worker as they would).
This module imports no jax.
"""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Callable


class WorkerError(RuntimeError):
    """An exception from a worker process whose type cannot be rebuilt in this one.

    Attributes:
      type_name: the original type, ``module.qualname``.
      message: the original ``str(exception)``.
    """

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message = type_name, message

    def __reduce__(self):
        return type(self), (self.type_name, self.message), self.__dict__


def _from_state(cls, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls, *args)
    error.__dict__.update(state)
    return error


class _ByState:
    """Pickles as ``cls.__new__(cls, *args)`` + its ``__dict__``: no ``__init__`` call."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        e = self.error
        return _from_state, (type(e), e.args, dict(getattr(e, "__dict__", {})))


def _portable(error: BaseException) -> bytes | None:
    """``error`` pickled so that it loads back as the same type with the same message, or None."""
    for form in (error, _ByState(error)):
        try:
            data = pickle.dumps(form)
            back = pickle.loads(data)
        except Exception:  # noqa: BLE001 - any failure: try the next form
            continue
        if type(back) is type(error) and str(back) == str(error):
            return data
    return None


class Failure:
    """An exception raised in a worker process, in a form that always pickles.

    Attributes:
      type_name: ``module.qualname`` of the exception's type.
      message: ``str(exception)``.
      worker_traceback: the formatted traceback (with its chained causes).
      pid: the worker's process id.
    """

    def __init__(self, error: Exception):
        self.type_name = f"{type(error).__module__}.{type(error).__qualname__}"
        self.message = str(error)
        self.worker_traceback = "".join(traceback.format_exception(error))
        self.pid = os.getpid()
        self._pickled = _portable(error)

    def rebuild(self) -> BaseException:
        """The exception to raise in the parent (see the module docstring), with a
        note holding the worker's traceback."""
        error = None
        if self._pickled is not None:
            try:
                error = pickle.loads(self._pickled)
            except Exception:  # noqa: BLE001 - e.g. the type cannot be imported here
                error = None
        if not isinstance(error, BaseException):
            error = WorkerError(self.type_name, self.message)
        error.add_note(f"raised in input worker process {self.pid}:\n{self.worker_traceback}")
        return error


class Catching:
    """``fn`` for a worker process: its result, or a :class:`Failure` for the
    ``Exception`` it raised. Picklable when ``fn`` is."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except Exception as e:  # noqa: BLE001 - sent to the parent, raised there
            return Failure(e)
