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
* the environment (:func:`environment`): a digest of every trjax source file
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
An entry that cannot be read is reported and replaced. Entries are pickles:
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
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

import trjax

from trjax.compilation import BACKEND_COMPILE_EVENT, STORE_LOAD_EVENT, module_name

SUBDIR = "trjax_executables"
_CACHE_SETTINGS = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                   "jax_raise_persistent_cache_errors", "jax_explain_cache_misses")
_FORMAT = 4  # bump when the entry layout changes


def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the trjax package as this process
    imported it (:data:`trjax.SOURCE_DIGEST`)."""
    return trjax.SOURCE_DIGEST


def environment() -> dict:
    """What besides the program and its context decides the executable: library
    versions, jax's and flax's config values, ``XLA_FLAGS``, the backend and its devices."""
    import flax
    import jaxlib
    import numpy
    import optax
    devices = jax.devices()
    return {
        "format": _FORMAT, "trjax_source": source_digest(), "python": sys.version,
        "versions": [trjax.__version__, jax.__version__, jaxlib.__version__, flax.__version__,
                     optax.__version__, numpy.__version__],
        # every jax config value but where and when jax caches (a copied cache dir still hits)
        "jax_config": sorted((k, repr(v)) for k, v in jax.config.values.items()
                             if not k.startswith(_CACHE_SETTINGS)),
        "flax_config": repr(flax.config),  # e.g. flax_fix_rng_separator: model.init's keys
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend": [devices[0].platform, devices[0].client.platform_version,
                    jax.process_count(), jax.process_index()],
        "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
    }


def _code_digest(fn) -> str:
    """A digest of the code ``fn`` runs: its qualified name, bytecode, constants
    and names, with those of the nested functions it defines and of the
    functions it closes over (also inside tuples, e.g. an exchange's
    ``update``); other closed-over values count by type only (the caller's
    context describes them)."""
    h = hashlib.sha256()
    seen: set = set()

    def add_code(c):
        h.update(getattr(c, "co_qualname", c.co_name).encode())
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for k in c.co_consts:
            if hasattr(k, "co_code"):
                add_code(k)
            else:
                h.update(repr(k).encode())

    def add(f):
        if id(f) in seen:
            return
        seen.add(id(f))
        f = getattr(f, "func", f)  # functools.partial
        code = getattr(f, "__code__", None)
        if code is None:
            h.update(type(f).__qualname__.encode())
            return
        h.update(f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}".encode())
        add_code(code)
        for cell in f.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            items = v if isinstance(v, tuple) else (v,)
            for x in items:
                if callable(x) and hasattr(getattr(x, "func", x), "__code__"):
                    add(x)
                else:
                    h.update(type(x).__qualname__.encode())

    add(fn)
    return h.hexdigest()


def describe(tree) -> str:
    """The tree structure of abstract arguments and each leaf's shape, dtype
    and sharding (other leaves, e.g. Python numbers: their ``repr``)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return repr(treedef) + repr([(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)))
                                 if hasattr(x, "shape") else repr(x) for x in leaves])


class ExecutableStore:
    """Compiled executables on disk under a key of what determined them (module docstring).

    Args:
      directory: the folder of the entries (created on the first write).
      context: the caller's description of everything its step functions
        close over (a JSON-able or ``repr``-able value).
    """

    def __init__(self, directory: str, context):
        self.directory = directory
        self._base = repr((environment(), context))

    def key(self, name: str, fn, args, donate_argnums=(), options=None) -> str:
        """The entry name for ``fn`` compiled as ``name`` for the abstract ``args``."""
        h = hashlib.sha256(self._base.encode())
        h.update(repr((name, _code_digest(fn), describe(args), tuple(donate_argnums),
                       sorted((options or {}).items()))).encode())
        return f"{name}-{h.hexdigest()[:40]}"

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
        """``lowered.compile(compiler_options)``, stored as entry ``key``.

        XLA compiles it with jax's persistent cache off (neither read nor
        written): XLA:CPU cannot serialize an executable it loaded from that
        cache again (measured with jax 0.10: the copy fails at its first call
        with "Function ... not found"), so a program served from there could
        never enter the store. Programs the store holds thus live in the store
        only. Only an executable XLA compiled in this call is stored (one jax
        found in its in-memory cache may be a loaded one). Thread-safe."""
        with _without_persistent_cache(), _compiled_here() as built:
            compiled = lowered.compile(compiler_options=compiler_options)
        if built["compiled"]:
            text = lowered.as_text()
            self.save(key, compiled, module_name(text), text)
        return compiled

    def load(self, key: str):
        """``(compiled, module_name, lowered_text)`` of entry ``key``, or ``None``.

        Records :data:`trjax.compilation.STORE_LOAD_EVENT` (``jax.monitoring``, the
        load's seconds, ``fun_name``: the module name), which
        :class:`trjax.compilation.CompileLog` files as a build served from the
        store. An unreadable entry is reported (a warning) and treated as absent."""
        path = os.path.join(self.directory, key)
        if not os.path.isfile(path):
            return None
        t = time.perf_counter()
        try:
            payload, in_tree, out_tree, device_ids, module, text, _ = _read_entry(path)
            with _LAPACK_LOCK:
                _initialize_cpu_kernels()
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # noqa: BLE001 - a damaged entry: compile as if absent
            warnings.warn(f"trjax: executable store entry {path} is unreadable "
                          f"({type(e).__name__}: {str(e)[:200]}); compiling instead")
            return None
        jax.monitoring.record_event_duration_secs(STORE_LOAD_EVENT, time.perf_counter() - t,
                                                  fun_name=module)
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
        return True


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


def _initialize_cpu_kernels() -> None:
    """Fills in jaxlib's LAPACK kernels (function pointers taken from scipy), as
    lowering a program that calls them does: a process that only loads such a
    program (PowerSGD's QR) crashed at its first call without it. As jax's
    ``jax.export`` does for a loaded CPU module (``_ensure_backends_initialized``
    in ``jax/_src/export/_export.py``)."""
    from jax._src.lax import linalg
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


def open_store(enabled: bool, cache_dir: str | None, context) -> ExecutableStore | None:
    """The store under ``cache_dir`` (the persistent compilation cache's
    folder, :func:`trjax.compilation.cache_dir`), or ``None`` when ``enabled``
    is False, the compilation cache is off, the run is not a single-process
    CPU run, or trjax's files changed on disk since this process imported
    them (a warning: the code it runs is no longer the code its key would
    name, and a module imported later may be the new one).

    Raises:
      ValueError: ``enabled`` is not a bool (``config.executable_store``).
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"config.executable_store={enabled!r} must be True or False")
    if not enabled or not cache_dir or jax.process_count() != 1 or \
            jax.devices()[0].platform != "cpu":
        return None
    if trjax.source_digest_on_disk() != trjax.SOURCE_DIGEST:
        warnings.warn("trjax: its source files changed since this process imported them; "
                      "the executable store is off for this run (it would store the old "
                      "code's programs)")
        return None
    return ExecutableStore(os.path.join(cache_dir, SUBDIR), context)
