"""Compilation: JAX's persistent compilation cache, and every compile counted by phase.

Persistent cache (:func:`configure_cache`). JAX can store each compiled
executable on disk under a key of the program, the devices and the compile
options, and load it instead of compiling the next time the same program is
built, in any process. trjax turns it on by default in a folder of the user's
cache directory (``$XDG_CACHE_HOME/trjax/xla``, else ``~/.cache/trjax/xla``),
so a second run of a config compiles nothing the first compiled. jax writes an
entry only for programs that took ``jax_persistent_cache_min_compile_time_secs``
(default 1 s) to compile; trjax lowers that to 0, so the small programs (state
initialisation pieces, BN folding, the eval reduction) are loaded too. A cache
directory already set (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``,
the test session) is kept as it is, with its thresholds.

Compile events (:class:`CompileLog`). jax reports every executable it builds
through ``jax.monitoring``: ``/jax/core/compile/backend_compile_duration``
(seconds, with the program's name ``fun_name``) around each build, whether
XLA compiled it or it was loaded from the persistent cache; inside it, on the
same thread, ``/jax/compilation_cache/compile_requests_use_cache`` when the
cache was looked up and ``/jax/compilation_cache/cache_hits`` when the entry
was found (``/jax/compilation_cache/cache_misses`` is jax's name for an entry
*written*). ``CompileLog`` listens to them while open and files each build
under the phase the training thread is in (``with log.phase("train"):``);
builds on other threads (an asynchronous checkpoint writer) are filed under
``"background"``. Source of the event names: ``jax/_src/dispatch.py``,
``jax/_src/compiler.py`` (``compile_or_get_cached``),
``jax/_src/compilation_cache.py``.

Damaged entries. jax's file cache (``jax/_src/lru_cache.py``) writes an entry
in place, so a process killed while writing (or a full disk) leaves a
truncated file. jax reads it, fails to decompress or load it, warns ("Error
reading persistent compilation cache entry"), compiles, and asks the cache to
store the result; the file cache skips a store whose file exists, so the
damaged entry would stay and every later start would compile again.
trjax wraps jax's cache so that such a store (the same key, after a read
that returned bytes, on the same thread) first removes the file: jax writes
it anew, and the repair is counted (``damaged``) by an open
:class:`CompileLog`. The wrapping is installed when this module is imported
(every file cache jax opens from then on, also after ``reset_cache``, is
wrapped) and again by :func:`configure_cache` (a cache jax opened before):
so every program's entry is repaired, also those of jax's own small programs
built before :func:`configure_cache` runs or outside any log (the PRNG
seed's ``jit(_threefry_seed)``, ``jit(stage)``). Only the process that
writes entries (process 0) repairs them.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import os
import re
import threading
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

try:  # jax's cache internals, for the repair of damaged entries (skipped without them)
    from jax._src import compilation_cache as _jax_cc
    from jax._src import lru_cache as _jax_lru
    from jax._src.compilation_cache_interface import CacheInterface as _CacheInterface
except ImportError:  # another jax layout: no repair
    _jax_cc = None
    _CacheInterface = object

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"  # recorded when an entry is written
DAMAGED_EVENT = "/trjax/compilation_cache/damaged_entries"  # trjax's: one entry repaired
BACKGROUND = "background"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/trjax/xla``, else ``~/.cache/trjax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trjax", "xla")


def cache_dir() -> str | None:
    """The persistent cache directory in effect in this process, or ``None`` when off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


def configure_cache(enabled: bool = True, directory: str = "") -> dict:
    """Turns JAX's persistent compilation cache on (or off) for this process.

    Call it before the first compile whose result should be stored or loaded
    (it may come after the backend started). Precedence for the directory: an
    explicit ``directory``; else a directory already set in jax (environment
    ``JAX_COMPILATION_CACHE_DIR``, ``jax.config``, a test session), kept with
    its thresholds untouched; else :func:`default_cache_dir`. When trjax picks
    the directory it also sets ``jax_persistent_cache_min_compile_time_secs``
    to 0 so that every program is stored, not only those taking over 1 s.

    Args:
      enabled: ``config.compilation_cache``; False turns the cache off for the
        process (also a cache another caller turned on).
      directory: ``config.compilation_cache_dir``; ``""`` for the default.

    Returns:
      ``{"dir": path or None, "source": "config" | "jax" | "default" | "off"}``.

    Raises:
      ValueError: ``enabled`` is not a bool, ``directory`` is not a string or
        cannot be created or written. The default directory failing that
        turns the cache off with a warning instead.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"config.compilation_cache={enabled!r} must be True or False")
    if not isinstance(directory, str):
        raise ValueError(f"config.compilation_cache_dir={directory!r} must be a path string "
                         "('' for the default under the user's cache directory)")
    if not enabled:
        if jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            jax_cache.reset_cache()  # jax decides once per process whether to use it
        return {"dir": None, "source": "off"}
    current = jax.config.jax_compilation_cache_dir
    if directory:
        path, source = os.path.abspath(os.path.expanduser(directory)), "config"
    elif current:
        path, source = current, "jax"
    else:
        path, source = default_cache_dir(), "default"
    if source != "jax":
        try:
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "not writable", path)
        except OSError as e:
            if source == "config":
                raise ValueError(f"config.compilation_cache_dir={directory!r} cannot be used: "
                                 f"{e.strerror} ({e.filename}); pass a writable folder, or '' "
                                 "for the default") from e
            # a read-only home directory (some clusters): run without the cache
            warnings.warn(f"trjax: compilation cache off: {path} cannot be used ({e.strerror}); "
                          "set config.compilation_cache_dir to a writable folder to keep "
                          "compiled programs between runs")
            return configure_cache(False)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if path != current or not jax.config.jax_enable_compilation_cache:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax_cache.reset_cache()  # a cache opened on another directory would be kept otherwise
    _repair_damaged_entries()
    return {"dir": path, "source": source}


class _RepairingCache(_CacheInterface):
    """jax's persistent cache, removing a damaged entry before jax stores it again.

    jax calls ``get`` and, when the bytes it got cannot be loaded, compiles
    and calls ``put`` with the same key on the same thread; a ``put`` after a
    ``get`` that returned bytes is therefore a damaged entry (a loaded one is
    never stored again).
    """

    def __init__(self, base):
        self._base = base
        self._local = threading.local()

    @property
    def _path(self):
        return self._base._path

    def _loaded(self) -> set:
        """Keys whose last ``get`` on this thread returned bytes."""
        if not hasattr(self._local, "keys"):
            self._local.keys = set()
        return self._local.keys

    def get(self, key: str):
        """The base cache's entry for ``key`` (bytes or None), remembered."""
        value = self._base.get(key)
        if value is None:
            self._loaded().discard(key)
        else:
            self._loaded().add(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        """Stores the entry; a damaged one of the same key is removed first.

        Raises:
          OSError: the damaged file cannot be removed (jax warns and goes on).
        """
        if key in self._loaded():
            self._loaded().discard(key)
            try:
                (self._base._path / f"{key}{_jax_lru._CACHE_SUFFIX}").unlink()
            except FileNotFoundError:
                pass
            jax.monitoring.record_event(DAMAGED_EVENT)
        self._base.put(key, value)


def _install_repairing_file_cache() -> bool:
    """Makes every file cache jax opens from now on a :class:`_RepairingCache`
    (jax's ``_initialize_cache`` opens it through ``get_file_cache``, at the
    first compile that uses the cache and again after each ``reset_cache``).
    Returns whether it is installed (jax's internals as expected)."""
    if _jax_cc is None or not callable(getattr(_jax_cc, "get_file_cache", None)):
        return False
    opener = _jax_cc.get_file_cache
    if getattr(opener, "_trjax_repairing", False):
        return True

    @functools.wraps(opener)
    def get_file_cache(path):
        made = opener(path)
        if made is None:
            return None
        cache, where = made
        if not isinstance(cache, _RepairingCache) and hasattr(cache, "_path"):
            cache = _RepairingCache(cache)
        return cache, where

    get_file_cache._trjax_repairing = True
    _jax_cc.get_file_cache = get_file_cache
    _wrap_open_cache()  # one jax opened before this module was imported
    return True


def _wrap_open_cache() -> None:
    """Wraps the file cache jax has open in this process, if any and not yet."""
    base = getattr(_jax_cc, "_cache", None)
    if base is not None and not isinstance(base, _RepairingCache) and \
            hasattr(base, "_path"):
        _jax_cc._cache = _RepairingCache(base)


def _repair_damaged_entries() -> None:
    """Wraps jax's persistent cache of this process (made now if not yet) in
    :class:`_RepairingCache`; nothing without jax's internals or a cache."""
    if _jax_cc is None or not hasattr(_jax_cc, "_initialize_cache"):
        return
    _install_repairing_file_cache()
    try:
        _jax_cc._initialize_cache()  # once per reset_cache: jax's own file cache
    except OSError:
        return  # jax opens it again at the first compile and warns there
    _wrap_open_cache()


_install_repairing_file_cache()  # before any compile of a process that imports trjax.train


def program_id(name: str) -> str:
    """A program's name as jax's compile event and its module name both reduce to:
    ``"jit(<lambda>)"`` and ``"jit__lambda"`` -> ``"jit_lambda"``."""
    return re.sub(r"[\W_]+", "_", name).strip("_")


@dataclasses.dataclass(frozen=True)
class Build:
    """One executable built: ``phase``, ``program`` (jax's name for it),
    ``seconds`` (wall), ``cache``: ``"hit"`` (loaded from the persistent cache),
    ``"miss"`` (looked up, not found, compiled) or
    ``"off"`` (compiled, no cache)."""
    phase: str
    program: str
    seconds: float
    cache: str

    @property
    def compiled(self) -> bool:
        """True when XLA compiled it (not loaded from a cache)."""
        return self.cache != "hit"


_PHASES: contextvars.ContextVar = contextvars.ContextVar("trjax_compile_phases", default=())
"""``((id(log), phase), ...)``: the open :class:`CompileLog` phases of the
current context, innermost last (a ``ContextVar``, so a thread run in a copy
of the opener's context, ``contextvars.copy_context().run``, carries them)."""


class CompileLog:
    """Every executable jax builds while the log is open, filed by phase.

    Use as a context manager (registers the ``jax.monitoring`` listeners on
    entry, removes them on exit); ``with log.phase(name):`` sets the phase of
    builds in the opener's context (phases nest; the innermost counts). A
    thread run in a copy of that context (``contextvars.copy_context().run``,
    as :func:`trjax.train.trainer.setup` runs the state initialisation beside the
    steps' compiles) files its builds under the phase current at the copy;
    builds on other threads (e.g. a checkpoint writer) under ``"background"``.

    Attributes:
      builds: list of :class:`Build`, in event order.
      writes: persistent cache entries written.
      damaged: damaged entries removed so that jax writes them again.
    """

    def __init__(self, phase: str = "startup"):
        self.builds: list[Build] = []
        self.writes = self.damaged = 0
        self._phase0 = phase
        self._tokens: list = []
        self._pending = threading.local()
        self._lock = threading.Lock()

    def _current_phase(self) -> str:
        for log_id, phase in reversed(_PHASES.get()):
            if log_id == id(self):
                return phase
        return BACKGROUND

    def _event(self, event: str, **kwargs) -> None:
        if event in (CACHE_LOOKUP_EVENT, CACHE_HIT_EVENT):
            setattr(self._pending, "hit" if event == CACHE_HIT_EVENT else "lookup", True)
        elif event == CACHE_WRITE_EVENT:
            with self._lock:
                self.writes += 1
        elif event == DAMAGED_EVENT:
            with self._lock:
                self.damaged += 1

    def _duration(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            hit = getattr(self._pending, "hit", False)
            lookup = getattr(self._pending, "lookup", False)
            self._pending.hit = self._pending.lookup = False
            cache = "hit" if hit else ("miss" if lookup and cache_dir() else "off")
        else:
            return
        phase = self._current_phase()
        with self._lock:
            self.builds.append(Build(phase, str(kwargs.get("fun_name", "")), float(duration),
                                     cache))

    def __enter__(self) -> "CompileLog":
        self._tokens.append(_PHASES.set(_PHASES.get() + ((id(self), self._phase0),)))
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)
        _PHASES.reset(self._tokens.pop())

    @contextlib.contextmanager
    def phase(self, name: str):
        """Files the builds of the opener's context inside the block under ``name``."""
        token = _PHASES.set(_PHASES.get() + ((id(self), name),))
        try:
            yield self
        finally:
            _PHASES.reset(token)

    def refile(self, phase: str, program: str, to_phase: str) -> None:
        """Moves the builds of ``program`` (by :func:`program_id`) filed under
        ``phase`` to ``to_phase`` (e.g. a compiled step's builds out of start-up)."""
        key = program_id(program)
        with self._lock:
            self.builds = [dataclasses.replace(b, phase=to_phase)
                           if b.phase == phase and program_id(b.program) == key else b
                           for b in self.builds]

    def count(self, phases=None, program: str | None = None) -> int:
        """Executables built (compiled or loaded) in ``phases`` (a name or a
        collection; all when None) whose program is ``program`` (any when None,
        compared by :func:`program_id`)."""
        return len(self._select(phases, program))

    def _select(self, phases, program):
        if isinstance(phases, str):
            phases = (phases,)
        key = None if program is None else program_id(program)
        return [b for b in list(self.builds) if (phases is None or b.phase in phases)
                and (key is None or program_id(b.program) == key)]

    def by_phase(self) -> dict[str, dict]:
        """``{phase: {"built", "compiled", "cache_hits", "seconds"}}`` in
        order of first appearance: programs built, those XLA compiled, those
        loaded from the persistent cache, wall seconds of all builds."""
        out: dict[str, dict] = collections.OrderedDict()
        for b in list(self.builds):
            row = out.setdefault(b.phase, {"built": 0, "compiled": 0, "cache_hits": 0,
                                           "seconds": 0.0})
            row["built"] += 1
            row["compiled"] += b.compiled
            row["cache_hits"] += not b.compiled
            row["seconds"] += b.seconds
        for row in out.values():
            row["seconds"] = round(row["seconds"], 3)
        return dict(out)

    def cache_summary(self) -> dict:
        """``{"dir", "hits", "misses", "writes", "damaged", "compile_s", "load_s"}``:
        the persistent cache over the whole log (``misses``: looked up, not
        found or not loadable, compiled; ``damaged``: entries found but not
        loadable, removed and written again; ``compile_s``: seconds XLA
        compiled; ``load_s``: seconds of the builds served from the cache)."""
        builds = list(self.builds)
        return {"dir": cache_dir(),
                "hits": sum(b.cache == "hit" for b in builds),
                "misses": sum(b.cache == "miss" for b in builds),
                "writes": self.writes,
                "damaged": self.damaged,
                "compile_s": round(sum(b.seconds for b in builds if b.compiled), 3),
                "load_s": round(sum(b.seconds for b in builds if not b.compiled), 3)}


def module_name(lowered_text: str) -> str:
    """The program name jax reports for a lowered module (``module @jit_local_step``
    -> ``jit_local_step``), from its StableHLO or HLO text.

    Raises:
      ValueError: the text names no module.
    """
    m = re.search(r"(?:module|HloModule)\s+@?([\w.$-]+)", lowered_text)
    if m is None:
        raise ValueError("no module name in the lowered text")
    return m.group(1)


def step_program(step) -> str:
    """The program name jax reports for a :class:`trjax.aot.CompiledStep`
    (from its lowered module, ``module @jit_local_step``)."""
    try:
        return module_name(getattr(step, "lowered_text", "") or step.compiled.as_text())
    except ValueError:
        raise ValueError(f"{step.name}: no module name in its lowered text") from None
