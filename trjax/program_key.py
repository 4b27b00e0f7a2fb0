"""What decides a compiled program, as the executable store keys it (:mod:`trjax.executables`).

* :func:`environment`: everything outside the program and the caller's context
  (trjax's source digest, library versions, jax and flax config values,
  ``XLA_FLAGS``, the backend and its devices);
* :func:`code_digest`: the code a step function runs, with the functions it
  defines and closes over;
* :func:`describe`: the structure, shapes, dtypes and shardings of abstract
  arguments (or results).
"""

from __future__ import annotations

import hashlib
import os
import sys

import jax

import trjax

_CACHE_SETTINGS = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                   "jax_raise_persistent_cache_errors", "jax_explain_cache_misses")
STORE_FORMAT = 4  # bump when trjax.executables' entry layout changes


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
        "format": STORE_FORMAT, "trjax_source": source_digest(), "python": sys.version,
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


def code_digest(fn) -> str:
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
