"""Ahead-of-time compiled steps that never recompile.

:func:`compile_step` lowers and compiles a step function once for the
shapes, dtypes and shardings of example arguments (``jax.ShapeDtypeStruct``
with sharding; nothing runs), optionally donating arguments (the train state).
A :class:`CompiledStep` refuses arguments whose shape, dtype or sharding
differ from the compiled ones instead of recompiling. On XLA:CPU the steps are
compiled with :data:`trjax.cpu.compile_options.STEP_OPTIONS`.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable

import jax
import numpy as np

from trjax.cpu.compile_options import compile_lowered, step_options


def abstract(tree):
    """``jax.ShapeDtypeStruct`` (with sharding) of every leaf of ``tree``."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def _spec_str(a) -> str:
    return f"{tuple(a.shape)} {np.dtype(a.dtype).name}"


def _dead():
    return None


def _sig_str(want) -> str:
    return f"{_spec_str(want)} with sharding {want.sharding}"


def _convert_host(path: str, name: str, got, want):
    """A Python / numpy scalar or numpy array, converted to the compiled leaf ``want``
    (dtype and sharding) when that is safe: the same kind of number (bool; integer;
    float; complex; or an integer exactly representable where a float was
    compiled) and every value representable in the compiled dtype.

    Raises:
      TypeError: naming the leaf and the compiled signature otherwise.
    """
    want_dt = np.dtype(want.dtype)
    host = np.asarray(got)
    family = lambda dt: "i" if dt.kind in "iu" else dt.kind
    fix = (f"pass a jax.Array of {_spec_str(want)} (e.g. jax.device_put(np.asarray(value, "
           f"np.{want_dt.name}), sharding)) or the state the previous call returned")
    int_to_float = family(host.dtype) == "i" and want_dt.kind == "f"
    if family(host.dtype) != family(want_dt) and not int_to_float:
        raise TypeError(f"{name}: argument {path} is a {type(got).__name__} of dtype "
                        f"{host.dtype.name} but the step was compiled for {_sig_str(want)}; "
                        f"a {host.dtype.kind!r}-kind value is not converted to "
                        f"{want_dt.name}: {fix}")
    if tuple(host.shape) != tuple(want.shape):
        raise TypeError(f"{name}: argument {path} has shape {tuple(host.shape)} but the step "
                        f"was compiled for {_sig_str(want)}: {fix}")
    with np.errstate(all="ignore"):
        cast = host.astype(want_dt)
        if family(want_dt) == "i":
            ok = np.array_equal(cast.astype(host.dtype), host) and (
                host.size == 0 or (np.iinfo(want_dt).min <= host.min() and
                                   host.max() <= np.iinfo(want_dt).max))
        elif int_to_float:  # an integer is fine where a float was compiled, if exact
            ok = bool(np.all(cast.astype(np.float64) == host.astype(np.float64)))
        elif want_dt.kind in "fc":
            ok = bool(np.all(np.isfinite(cast) | ~np.isfinite(host)))
        else:
            ok = True
    if not ok:
        raise TypeError(f"{name}: argument {path} holds a value not representable in "
                        f"{want_dt.name} ({host.dtype.name}, e.g. {host.ravel()[:3].tolist()}); "
                        f"the step was compiled for {_sig_str(want)}: {fix}")
    return jax.device_put(cast, want.sharding) if want.sharding is not None else \
        jax.numpy.asarray(cast)


class CompiledStep:
    """An ahead-of-time compiled step that never recompiles.

    Every call checks every argument leaf against the compiled signature
    (XLA's own check skips arguments it eliminated):

    * ``jax.Array`` leaves must match shape, dtype and sharding; an
      uncommitted array (made without a device, e.g. ``jnp.zeros``) is placed
      with the compiled sharding; a committed array on other devices or with
      another sharding, or of another dtype, raises ``TypeError``.
    * Python scalars, numpy scalars and numpy arrays are converted to the
      compiled dtype and sharding when they are the same kind of number
      (bool / integer / float / complex) and every value is representable
      (``TrainState.step`` given as a Python ``int`` is fine; ``1.5`` for an
      int32 leaf, ``2**40`` for an int32 leaf or ``1e300`` for a float32 leaf
      raise ``TypeError``).
    * Donated arguments are de-aliased on EVERY call (:func:`dealias`): two
      leaves sharing one device buffer would hand XLA one buffer twice
      ("donate the same buffer twice", then a crash).

    Errors name the leaf path and the compiled signature.

    Attributes:
      name: for messages and counts.
      compiled: the ``jax.stages.Compiled``.
      compile_s: wall seconds spent lowering + compiling.
      calls: number of calls.
    """

    def __init__(self, name: str, compiled, signature, compile_s: float, donate_argnums=(),
                 lowered_text: str = ""):
        self.name = name
        self.compiled = compiled
        self.signature = signature
        self.compile_s = compile_s
        self.lowered_text = lowered_text
        self.donate_argnums = _argnums(donate_argnums)
        self.calls = 0
        self._paths = [jax.tree_util.keystr(p) for p, _ in
                       jax.tree_util.tree_flatten_with_path(signature)[0]]
        self._leaves, self._treedef = jax.tree_util.tree_flatten(signature)
        self._fresh: dict = {}  # id -> weakref of the previous call's outputs

    def check(self, *args) -> tuple:
        """Checks (and converts, see the class docstring) every argument leaf.

        Returns:
          ``args`` with host scalars / arrays and uncommitted arrays placed as
          compiled (leaves already right are returned as they are).

        Raises:
          TypeError: a structure, shape, dtype or sharding mismatch that is not
            safely convertible, naming the leaf path and the compiled signature.
          RuntimeError: an argument donated to an earlier call.
        """
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != self._treedef:
            raise TypeError(f"{self.name}: argument structure {treedef} differs from the compiled "
                            f"one {self._treedef}")
        out = []
        for path, want, got in zip(self._paths, self._leaves, leaves):
            if not isinstance(got, jax.Array):
                if not isinstance(got, (bool, int, float, complex, np.generic, np.ndarray)):
                    raise TypeError(f"{self.name}: argument {path} is a {type(got).__name__}, "
                                    f"not an array; the step was compiled for {_sig_str(want)}")
                out.append(_convert_host(path, self.name, got, want))
                continue
            if got.is_deleted():
                raise RuntimeError(f"{self.name}: argument {path} was donated to an earlier call "
                                   "and its buffer is gone; pass the state that call returned")
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise TypeError(f"{self.name}: argument {path} is {_spec_str(got)} but the step "
                                f"was compiled for {_spec_str(want)}; build batches of the "
                                "compiled shape (pad the last one with mask 0)")
            sharding = got.sharding
            if want.sharding is not None and \
                    not sharding.is_equivalent_to(want.sharding, len(want.shape)):
                if not got.committed:
                    got = jax.device_put(got, want.sharding)
                else:
                    raise TypeError(
                        f"{self.name}: argument {path} has sharding {sharding} (devices "
                        f"{sorted(d.id for d in sharding.device_set)}) but the step was compiled "
                        f"for {want.sharding} (devices "
                        f"{sorted(d.id for d in want.sharding.device_set)}); use "
                        "jax.device_put with the world's sharding")
            out.append(got)
        return jax.tree_util.tree_unflatten(self._treedef, out)

    def __call__(self, *args):
        args = self.check(*args)
        if self.donate_argnums:
            donated = jax.tree_util.tree_leaves([args[i] for i in self.donate_argnums])
            # Every call, not only the first: a later call may bring aliased leaves
            # too. Fast path (the training loop): every donated leaf is a different
            # output of the previous call, i.e. a distinct buffer XLA returned. Otherwise
            # the buffers of the arguments that are not donated count as taken and
            # each donated leaf gets its own buffer.
            fresh, ids = self._fresh, {id(x) for x in donated}
            if len(ids) < len(donated) or not all(fresh.get(id(x), _dead)() is x
                                                  for x in donated):
                kept = [a for i, a in enumerate(args) if i not in self.donate_argnums]
                seen = _buffers(kept)
                args = tuple(dealias(a, seen) if i in self.donate_argnums else a
                             for i, a in enumerate(args))
        self.calls += 1
        out = self.compiled(*args)
        if self.donate_argnums:
            self._fresh = {id(x): weakref.ref(x) for x in jax.tree_util.tree_leaves(out)
                           if isinstance(x, jax.Array)}
        return out

    def memory(self) -> dict[str, int]:
        """The compiled executable's memory statistics per device, in bytes (XLA's
        ``memory_analysis()``): ``argument``, ``output``, ``alias`` (outputs written
        into donated arguments), ``temp``, and ``peak`` = argument + output - alias +
        temp, everything live at once (XLA:CPU's own ``peak_memory_in_bytes`` counts
        less than temp alone, so it is not used)."""
        m = self.compiled.memory_analysis()
        if m is None:
            return {}
        return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
                "peak": int(m.argument_size_in_bytes + m.output_size_in_bytes
                            - m.alias_size_in_bytes + m.temp_size_in_bytes)}

    def cost(self) -> dict[str, float]:
        """XLA's cost analysis (flops, bytes accessed) of one call, if available."""
        c = self.compiled.cost_analysis()
        if isinstance(c, (list, tuple)):
            c = c[0] if c else {}
        return {k: float(v) for k, v in (c or {}).items() if k in ("flops", "bytes accessed")}

    def hlo_text(self) -> str:
        """The compiled (post-optimisation) HLO."""
        return self.compiled.as_text()


def _buffers(tree) -> set:
    """The device buffer pointers of every ``jax.Array`` leaf of ``tree``."""
    return {s.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)
            if isinstance(x, jax.Array) for s in x.addressable_shards}


def dealias(tree, seen: set | None = None):
    """Copies leaves whose device buffers are shared with an earlier leaf.

    Donating a pytree in which two leaves share a buffer (the same array
    twice, or a ``device_put`` that reused its source) would hand XLA one
    buffer twice; the later leaf gets its own copy instead. Returns the tree
    with distinct buffers; leaves already distinct are returned as they are.

    Args:
      tree: a pytree of ``jax.Array`` (other leaves pass through).
      seen: buffer pointers already taken (updated in place), e.g. those of
        arguments that are not donated.
    """
    seen = set() if seen is None else seen

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        ptrs = tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        if any(p in seen for p in ptrs):
            x = jax.device_put(x, x.sharding, may_alias=False, donate=False)
            ptrs = tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        seen.update(ptrs)
        return x

    return jax.tree_util.tree_map(one, tree)


def compile_step(name: str, fn: Callable, *example_args, donate_argnums=(),
                 traced=None, options: dict | None = None) -> CompiledStep:
    """Lowers and compiles ``fn`` for the shapes/shardings of ``example_args``.

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct`` with sharding;
    nothing is executed. Arguments in ``donate_argnums`` are donated: their
    buffers are reused for the outputs, so the caller must not use them again.
    jax's persistent compilation cache (:mod:`trjax.train.compilation`), keyed
    by the lowered program, serves the executable when it holds it.

    XLA compiles it with :func:`trjax.cpu.compile_options.step_options` (trjax's
    XLA:CPU options on CPU devices, XLA's defaults elsewhere), and on CPU devices
    with ``options`` too (a layout's :attr:`~trjax.parallel.layout.Layout.compile_options`).
    ``traced``: the ``jax.jit(fn, donate_argnums=...).trace(*abstract(example_args))``
    already made (its jaxpr read first, e.g. by the planner), lowered instead of
    tracing again.
    """
    sig = abstract(example_args)
    t0 = time.perf_counter()
    if traced is None:
        traced = jax.jit(fn, donate_argnums=donate_argnums).trace(*sig)
    lowered = traced.lower()
    cpu = step_options(sig)
    compiled = compile_lowered(lowered, cpu if cpu is None else {**cpu, **(options or {})})
    step = CompiledStep(name, compiled, sig, time.perf_counter() - t0, donate_argnums,
                        lowered.as_text())
    step.fn = fn  # the function compiled (scripts/benchmark.py compiles it again undonated)
    return step


def _argnums(donate_argnums) -> tuple:
    return (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
