"""Compiled steps stored whole on disk, so that a warm start traces nothing.

JAX's persistent compilation cache (:mod:`trjax.compilation`) keys an
executable by the lowered program, so every start still traces each step in
Python and lowers it to StableHLO before it can look the key up. For the main
job on 2 cores that is ~1.3 s of a 2.3 s warm start-up (the train step: trace
0.65 s, lowering 0.3 s; the state initialisation 0.3 s), while loading the
finished executables takes 0.47 s.

An :class:`ExecutableStore` keys each executable by what determines the
program instead, so that it can be looked up before tracing:

* the program: its name, the code of the function traced (a step builder
  replaced in a test or a notebook changes it), the abstract arguments
  (shapes, dtypes, shardings), the donated arguments and compile options;
* the caller's context, which fixes everything the function closes over
  (:func:`trjax.trainer.store_context`: the config less the keys that enter no
  program, the data's shape, dtype, classes, mean, std and sizes, the model,
  the plan and the mesh);
* the environment (:func:`trjax.program_key.environment`): a digest of every trjax source file
  as the process imported it, the versions of trjax, Python, jax, jaxlib,
  flax, optax and numpy, every jax config value but the cache's settings and
  every flax config value (both read ``JAX_*`` / ``FLAX_*`` environment
  variables: ``FLAX_FIX_RNG_SEPARATOR`` changes every initial parameter),
  ``XLA_FLAGS`` and the backend (platform, version, device ids and kinds,
  process count and index).

An entry is the executable serialized by jax
(``jax.experimental.serialize_executable``, the format jax's own cache
stores) with its argument and result trees, the ids of the devices it runs
on (in its device assignment's order: jax would load it onto every device,
which breaks a program of fewer, e.g. ``config.devices="0-3"``) and the
lowered module's name and text, and a record of its results' shapes, dtypes
and shardings (:meth:`ExecutableStore.out_info`: a caller can go on with them
while another thread loads the executable), pickled with the SHA-256 of the
pickle (checked before anything is unpickled or loaded) into
``<compilation cache dir>/trjax_executables/<key>`` and written atomically.
An entry that cannot be read is reported and replaced.

The store keeps at most ``max_bytes`` (``config.executable_store_max_mb``,
1024 MB by default; the main job's five programs take 7.5 MB on CPU): a
load marks its entry used (its modification time), and once a set-up has
keyed all its programs (:func:`trjax.trainer.setup`) the least recently used
entries go until the folder fits (:meth:`ExecutableStore.evict`), as jax's
cache does with ``jax_compilation_cache_max_size``. Entries are pickles:
as for jax's cache directory, it must be the user's own (loading one runs
code from it).

A program the store misses is compiled by XLA with jax's persistent cache
off: XLA:CPU cannot serialize an executable it loaded from that cache again
(the copy fails at its first call), so a program served from there could
never enter the store. The programs the store holds live in it only; the
first start after a change to trjax's code (or an upgrade) compiles them in
full once. ``config.executable_store=False`` gives jax's cache back to them
(each start traces and lowers, and an unchanged program still loads).

Scope: single-process CPU runs (``jax.process_count() == 1``), the case
measured and tested; elsewhere :func:`open_store` returns ``None`` and every
start traces.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import stat
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

import trjax
from trjax.aot import compile_lowered
from trjax.compilation import BACKEND_COMPILE_EVENT, STORE_LOAD_EVENT, module_name
from trjax.program_key import code_digest, describe, environment

SUBDIR = "trjax_executables"
DEFAULT_MAX_MB = 1024
_TMP_NAME = re.compile(r"\..+-[0-9a-f]{40}\.[^.]+$")  # save's mkstemp: .<key>.<random>
_STALE_TMP_S = 3600.0  # a writer's temporary file this old was left by a killed process


class ExecutableStore:
    """Compiled executables on disk under a key of what determined them (module docstring).

    Args:
      directory: the folder of the entries (created on the first write).
      context: the caller's description of everything its step functions
        close over (a JSON-able or ``repr``-able value).
      max_bytes: the folder's size limit in bytes: :meth:`evict` (which
        :func:`trjax.trainer.setup` calls once at its end) deletes the least
        recently used entries (by modification time, which :meth:`load`
        refreshes) until it fits, but never one this process keyed
        (:meth:`key`), wrote or loaded.
    """

    def __init__(self, directory: str, context, max_bytes: int = DEFAULT_MAX_MB << 20):
        self.directory = directory
        self.max_bytes = max_bytes
        self._base = repr((environment(), context))
        self._used: set[str] = set()  # entries this process keyed, wrote or loaded: never evicted

    def key(self, name: str, fn, args, donate_argnums=(), options=None) -> str:
        """The entry name for ``fn`` compiled as ``name`` for the abstract ``args``; kept
        by :meth:`evict` from now on."""
        h = hashlib.sha256(self._base.encode())
        h.update(repr((name, code_digest(fn), describe(args), tuple(donate_argnums),
                       sorted((options or {}).items()))).encode())
        key = f"{name}-{h.hexdigest()[:40]}"
        self._used.add(key)
        return key

    def build(self, key: str, lower: Callable[[], Any], compiler_options=None):
        """``(compiled, lowered_text)``: entry ``key`` loaded (nothing traced),
        else ``lower()`` (a ``jax.stages.Lowered``) compiled and stored
        (:meth:`compile`)."""
        found = self.load(key)
        if found is not None:
            return found[0], found[2]
        lowered = lower()
        return self.compile(key, lowered, compiler_options), lowered.as_text()

    def compile(self, key: str, lowered, compiler_options=None):
        """:func:`trjax.aot.compile_lowered` of ``lowered``, stored as entry ``key``.

        XLA compiles it with jax's persistent cache off (neither read nor
        written): XLA:CPU cannot serialize an executable it loaded from that
        cache again (measured with jax 0.10: the copy fails at its first call
        with "Function ... not found"), so a program served from there could
        never enter the store. Programs the store holds thus live in the store
        only. Only an executable XLA compiled in this call is stored (one jax
        found in its in-memory cache may be a loaded one). Thread-safe."""
        with _without_persistent_cache(), _compiled_here() as built:
            compiled = compile_lowered(lowered, compiler_options)
        if built["compiled"]:
            text = lowered.as_text()
            self.save(key, compiled, module_name(text), text)
        return compiled

    def load(self, key: str):
        """``(compiled, module_name, lowered_text)`` of entry ``key``, or ``None``.

        Records :data:`trjax.compilation.STORE_LOAD_EVENT` (``jax.monitoring``, the
        load's seconds, ``fun_name``: the module name), which
        :class:`trjax.compilation.CompileLog` files as a build served from the
        store. An unreadable entry is reported (a warning) and treated as absent; one
        another process's :meth:`evict` deleted after the check is absent, silently."""
        path = os.path.join(self.directory, key)
        if not os.path.isfile(path):
            return None
        t = time.perf_counter()
        try:
            payload, in_tree, out_tree, device_ids, module, text, _ = _read_entry(path)
            _initialize_cpu_kernels(text)
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except FileNotFoundError:  # another process's eviction deleted it since: absent
            return None
        except Exception as e:  # noqa: BLE001 - a damaged entry: compile as if absent
            warnings.warn(f"trjax: executable store entry {path} is unreadable "
                          f"({type(e).__name__}: {str(e)[:200]}); compiling instead")
            return None
        jax.monitoring.record_event_duration_secs(STORE_LOAD_EVENT, time.perf_counter() - t,
                                                  fun_name=module)
        self._used.add(key)
        with contextlib.suppress(OSError):  # a read-only store still loads
            os.utime(path)  # used now: the last entry another process's eviction picks
        return compiled, module, text

    def out_info(self, key: str, mesh):
        """The results' abstract values (``jax.ShapeDtypeStruct`` with their
        ``NamedSharding`` on ``mesh``) of entry ``key``, as ``compiled.out_info``
        of the executable :meth:`load` would give, without loading it; ``None``
        when the entry is absent or unreadable, or its results are not all
        ``NamedSharding``-laid arrays, or the rebuilt description differs from
        the stored one."""
        path = os.path.join(self.directory, key)
        try:
            record = _read_entry(path)[6]
        except Exception:  # noqa: BLE001 - absent or damaged: the caller loads or compiles
            return None
        return _rebuild_out_info(record, mesh)

    def save(self, key: str, compiled, module: str, text: str) -> bool:
        """Writes entry ``key`` atomically; False (and a warning) when the
        executable cannot be serialized or the folder cannot be written."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            record = _out_record(compiled.out_info)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
            try:
                body = pickle.dumps((payload, in_tree, out_tree, device_ids, module, text, record),
                                    protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((hashlib.sha256(body).hexdigest(), body), f,
                                protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, os.path.join(self.directory, key))
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # noqa: BLE001 - the run goes on; the next start traces
            warnings.warn(f"trjax: executable store: {key} not stored "
                          f"({type(e).__name__}: {str(e)[:200]})")
            return False
        self._used.add(key)
        return True

    def evict(self) -> list[str]:
        """Deletes the least recently used entries until the folder holds at
        most ``max_bytes``, and :meth:`save`'s temporary files once an hour
        old (a killed writer's). Kept: entries this process keyed, wrote or
        loaded (even alone over the limit), anything else (folders, links,
        other hidden files), and what it may not delete (the next entry goes
        instead). Never raises; an entry another process deletes first counts
        as freed, and a load that finds its entry gone compiles instead.

        Returns:
          the names deleted, least recently used first.
        """
        now, entries, deleted = time.time(), [], []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return deleted
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                st = os.lstat(path)  # a symbolic link is not followed: it is no entry
            except OSError:  # deleted meanwhile
                continue
            if not stat.S_ISREG(st.st_mode):  # not the store's: left alone
                continue
            if name.startswith("."):  # a writer's temporary file (``save``), or not ours
                if _TMP_NAME.match(name) and now - st.st_mtime > _STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                        deleted.append(name)
                continue
            entries.append((st.st_mtime, name, st.st_size))
        total = sum(size for _, _, size in entries)
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if name in self._used:
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
                deleted.append(name)
            except FileNotFoundError:  # another process deleted it first: freed all the same
                pass
            except OSError:  # not ours to delete (a read-only or sticky folder): still there
                continue
            total -= size
        return deleted


def _read_entry(path: str) -> tuple:
    """An entry's fields, after checking its body against the SHA-256 written
    with it (jax's own cache keeps no checksum: a flipped bit in a stored
    executable loaded without an error).

    Raises:
      ValueError: the body's digest is not the stored one (a damaged entry).
    """
    with open(path, "rb") as f:
        digest, body = pickle.load(f)
    if hashlib.sha256(body).hexdigest() != digest:
        raise ValueError(f"its SHA-256 is not the one written with it ({digest[:12]}...)")
    return pickle.loads(body)


def _out_record(out_info):
    """``(treedef, [(shape, dtype, spec, memory_kind)], description)`` of a
    tree of ``ShapeDtypeStruct`` with ``NamedSharding`` (picklable: jax's
    devices and meshes are not), or ``None`` for any other leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(out_info)
    if not all(isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
               for x in leaves):
        return None
    return (treedef, [(tuple(x.shape), str(x.dtype), x.sharding.spec, x.sharding.memory_kind)
                      for x in leaves], describe(out_info))


def _rebuild_out_info(record, mesh):
    """The tree :func:`_out_record` recorded, on ``mesh``; ``None`` when it
    does not describe exactly as the recorded one did."""
    if record is None:
        return None
    treedef, leaves, description = record
    tree = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
            mesh, spec, memory_kind=kind)) for shape, dtype, spec, kind in leaves])
    return tree if describe(tree) == description else None


_LAPACK_LOCK = threading.Lock()  # loads may run on several threads (trjax.trainer.setup)


def _initialize_cpu_kernels(lowered_text: str) -> None:
    """Fills in jaxlib's LAPACK kernels (pointers from scipy) when the module calls
    them (custom calls ``lapack_<type><routine>``), as lowering it would and as
    ``jax.export`` does for a loaded CPU module: a process that only loaded such a
    program (PowerSGD's QR) crashed at its first call. Others skip it: scipy's
    import took 0.19 s of the main job's 0.8 s warm set-up."""
    if "@lapack_" in lowered_text or '"lapack_' in lowered_text:
        from jax._src.lax import linalg
        with _LAPACK_LOCK:
            linalg.initialize_lapack()


_CACHE_OFF = {"lock": threading.Lock(), "depth": 0, "was_on": False}
"""Nesting count of :func:`_without_persistent_cache` across threads (jax's
cache switch is process-wide, so the guard of it is too)."""


@contextlib.contextmanager
def _without_persistent_cache():
    """jax's persistent compilation cache off inside the block (the outermost
    of concurrent blocks turns it back on, as it was)."""
    from jax.experimental.compilation_cache import compilation_cache as jax_cache
    with _CACHE_OFF["lock"]:
        if _CACHE_OFF["depth"] == 0:
            _CACHE_OFF["was_on"] = bool(jax.config.jax_enable_compilation_cache)
            if _CACHE_OFF["was_on"]:
                jax.config.update("jax_enable_compilation_cache", False)
                jax_cache.reset_cache()  # jax decides once whether to use the cache
        _CACHE_OFF["depth"] += 1
    try:
        yield
    finally:
        with _CACHE_OFF["lock"]:
            _CACHE_OFF["depth"] -= 1
            if _CACHE_OFF["depth"] == 0 and _CACHE_OFF["was_on"]:
                jax.config.update("jax_enable_compilation_cache", True)
                jax_cache.reset_cache()


@contextlib.contextmanager
def _compiled_here():
    """A dict whose ``compiled``, after the block, says whether XLA built an
    executable on this thread inside it (jax reported a backend build; a program
    jax found in its in-memory cache reports none). Used with jax's persistent
    cache off, so such a build is a real compile."""
    seen, me = {"compiled": False}, threading.get_ident()

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT and threading.get_ident() == me:
            seen["compiled"] = True

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def open_store(enabled: bool, cache_dir: str | None, context,
               max_mb: float = DEFAULT_MAX_MB) -> ExecutableStore | None:
    """The store under ``cache_dir`` (the persistent compilation cache's
    folder, :func:`trjax.compilation.cache_dir`), or ``None`` when ``enabled``
    is False, the compilation cache is off, the run is not a single-process
    CPU run, or trjax's files changed on disk since this process imported
    them (a warning: the code it runs is no longer the code its key would
    name, and a module imported later may be the new one).

    Args:
      max_mb: ``config.executable_store_max_mb``, the store's size limit in
        MB (2**20 bytes; least recently used entries go beyond it).

    Raises:
      ValueError: ``enabled`` is not a bool (``config.executable_store``), or
        ``max_mb`` is not a number > 0 (``config.executable_store_max_mb``).
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"config.executable_store={enabled!r} must be True or False")
    if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not max_mb > 0 \
            or max_mb == float("inf"):
        raise ValueError(f"config.executable_store_max_mb={max_mb!r} must be a number of MB "
                         f"> 0 (default {DEFAULT_MAX_MB}); to keep no programs, set "
                         "config.executable_store=False")
    if not enabled or not cache_dir or jax.process_count() != 1 or \
            jax.devices()[0].platform != "cpu":
        return None
    if trjax.source_digest_on_disk() != trjax.SOURCE_DIGEST:
        warnings.warn("trjax: its source files changed since this process imported them; "
                      "the executable store is off for this run (it would store the old "
                      "code's programs)")
        return None
    max_bytes = int(min(max_mb * (1 << 20), float(1 << 63)))  # 1e305 MB: over a float's range
    return ExecutableStore(os.path.join(cache_dir, SUBDIR), context, max_bytes)
