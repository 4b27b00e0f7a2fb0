"""XLA:CPU compile options of trjax's programs, and a compile that tolerates unknown ones.

Only compile time is at stake: on CPU the large kernels run in YNNPACK and
Eigen, so what LLVM optimises is elementwise and reduction fusions, and its
default level (3) mostly costs compile time. The measurements behind each
option are in ``docs/performance.md``. On other platforms XLA's defaults hold.
"""

from __future__ import annotations

import os
import re

import jax

STEP_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True,
                "xla_backend_optimization_level": 1}
"""XLA:CPU options of the compiled steps.

* Copy insertion with region analysis: the train step writes the new
  parameters and momenta into the donated state's buffers, and XLA duplicates
  the momentum arithmetic into the parameter's fusion; without the analysis it
  copies each momentum before overwriting it. Same bits.
* LLVM at level 1 (``-O1``). LLVM may round a few operations differently:
  results stay within the rounding of a reordered sum (``tests/test_aot.py``).
"""

INIT_OPTIONS = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}
"""XLA:CPU options of the state-initialisation program (threefry hashes and the
initialisers' normal transforms): LLVM -O1 and XLA's elemental emitters give the
bits of jaxlib's defaults (level 0 does not: 1 ulp in some normals). The program
runs once, so its speed does not matter."""


def platform_of(tree) -> str:
    """The platform of the first leaf of ``tree`` that has a sharding (else jax's default backend)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()


def step_options(example_args) -> dict | None:
    """:data:`STEP_OPTIONS` when ``example_args`` live on CPU devices, else ``None``."""
    return _known(STEP_OPTIONS) if platform_of(example_args) == "cpu" else None


REMOVED_IN = {"xla_cpu_use_fusion_emitters": (0, 12)}
"""Options of :data:`INIT_OPTIONS` / :data:`STEP_OPTIONS` and the jaxlib
release whose XLA no longer knows them (XLA refuses an unknown option, and the
refused attempt would count as a compile and a cache miss)."""


def _jaxlib_version() -> tuple:
    import jaxlib.version
    return tuple(int(p) for p in re.findall(r"\d+", jaxlib.version.__version__)[:3])


def _known(options: dict) -> dict:
    """``options`` less those this jaxlib's XLA no longer has (:data:`REMOVED_IN`)."""
    version = _jaxlib_version()
    return {k: v for k, v in options.items() if k not in REMOVED_IN or version < REMOVED_IN[k]}


def init_options(platform: str) -> dict | None:
    """:data:`INIT_OPTIONS` on ``"cpu"`` (those this jaxlib knows), else ``None``."""
    return _known(INIT_OPTIONS) if platform == "cpu" else None


_UNKNOWN_OPTION = re.compile(r"No such compile option: '([^']+)'")


def flags_set_in_env() -> set[str]:
    """The XLA option names this process's ``XLA_FLAGS`` sets (``--name=value`` or
    ``--name``), e.g. ``{"xla_backend_optimization_level"}``."""
    return set(re.findall(r"(?:^|\s)--([A-Za-z0-9_]+)", os.environ.get("XLA_FLAGS", "")))


def compile_lowered(lowered, compiler_options: dict | None = None):
    """``lowered.compile(compiler_options=...)`` (a ``jax.stages.Lowered``), less
    the options this jaxlib's XLA does not know and those ``XLA_FLAGS`` sets.

    XLA adds and removes such options between releases (jaxlib 0.12 has no
    ``xla_cpu_use_fusion_emitters``) and refuses an unknown one before compiling
    anything (``INVALID_ARGUMENT: No such compile option``), so each one it names
    is dropped and the compile tried again. An option the process's
    ``XLA_FLAGS`` sets is dropped too, so that the user's flag is the one in
    force (compile options override ``XLA_FLAGS``).

    Raises:
      jax.errors.JaxRuntimeError: any other compile error.
    """
    user = flags_set_in_env()
    options = {k: v for k, v in (compiler_options or {}).items() if k not in user}
    while True:
        try:
            return lowered.compile(compiler_options=options or None)
        except jax.errors.JaxRuntimeError as e:
            unknown = _UNKNOWN_OPTION.search(str(e))
            if unknown is None or unknown.group(1) not in options:
                raise
            del options[unknown.group(1)]
