"""Ahead-of-time compiled steps that never recompile.

:func:`compile_step` lowers and compiles a step function once for the
shapes, dtypes and shardings of example arguments (``jax.ShapeDtypeStruct``
with sharding; nothing runs), optionally donating arguments (the train state).
A :class:`CompiledStep` refuses arguments whose shape, dtype or sharding
differ from the compiled ones instead of recompiling.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np


def abstract(tree):
    """``jax.ShapeDtypeStruct`` (with sharding) of every leaf of ``tree``."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def _spec_str(a) -> str:
    return f"{tuple(a.shape)} {np.dtype(a.dtype).name}"


class CompiledStep:
    """An ahead-of-time compiled step that never recompiles.

    Calling it checks every argument leaf's shape, dtype and sharding against
    the compiled signature and raises ``TypeError`` naming the leaf and both
    signatures on a mismatch (XLA's own check skips arguments it eliminated).

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
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.calls = 0
        self._paths = [jax.tree_util.keystr(p) for p, _ in
                       jax.tree_util.tree_flatten_with_path(signature)[0]]
        self._leaves, self._treedef = jax.tree_util.tree_flatten(signature)

    def check(self, *args) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != self._treedef:
            raise TypeError(f"{self.name}: argument structure {treedef} differs from the compiled "
                            f"one {self._treedef}")
        for path, want, got in zip(self._paths, self._leaves, leaves):
            if getattr(got, "is_deleted", lambda: False)():
                raise RuntimeError(f"{self.name}: argument {path} was donated to an earlier call "
                                   "and its buffer is gone; pass the state that call returned")
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise TypeError(f"{self.name}: argument {path} is {_spec_str(got)} but the step "
                                f"was compiled for {_spec_str(want)}; build batches of the "
                                "compiled shape (pad the last one with mask 0)")
            sharding = getattr(got, "sharding", None)
            if want.sharding is not None and sharding is not None and \
                    not sharding.is_equivalent_to(want.sharding, len(want.shape)):
                raise TypeError(f"{self.name}: argument {path} has sharding {sharding} but the step "
                                f"was compiled for {want.sharding}; use jax.device_put with the "
                                "world's sharding")

    def __call__(self, *args):
        self.check(*args)
        if self.calls == 0 and self.donate_argnums:
            args = tuple(dealias(a) if i in self.donate_argnums else a for i, a in enumerate(args))
        self.calls += 1
        return self.compiled(*args)

    def memory(self) -> dict[str, int]:
        """The compiled executable's memory statistics, in bytes."""
        m = self.compiled.memory_analysis()
        if m is None:
            return {}
        return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
                "peak": int(getattr(m, "peak_memory_in_bytes", 0) or
                            m.argument_size_in_bytes + m.output_size_in_bytes
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


def dealias(tree):
    """Copies leaves whose device buffers are shared with an earlier leaf.

    Donating a pytree in which two leaves share a buffer (the same array
    twice, or a ``device_put`` that reused its source) would hand XLA one
    buffer twice; the later leaf gets its own copy instead. Returns the tree
    with distinct buffers; leaves already distinct are returned as they are.
    """
    seen: set = set()

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


def compile_step(name: str, fn: Callable, *example_args, donate_argnums=()) -> CompiledStep:
    """Lowers and compiles ``fn`` for the shapes/shardings of ``example_args``.

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct`` with sharding;
    nothing is executed. Arguments in ``donate_argnums`` are donated: their
    buffers are reused for the outputs, so the caller must not use them again.
    """
    sig = abstract(example_args)
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*sig)
    compiled = lowered.compile()
    step = CompiledStep(name, compiled, sig, time.perf_counter() - t0, donate_argnums,
                        lowered.as_text())
    step.fn = fn  # the function compiled (scripts/benchmark.py compiles it again undonated)
    return step
