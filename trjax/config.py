"""Command-line overrides checked before anything runs: unknown keys and wrong types.

``ml_collections``' own messages for ``--config.KEY=VALUE`` do not suggest the
key you meant; :func:`check_overrides` does, and is called by the scripts
before flag parsing.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports ``path`` and returns its ``get_config()``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file defines no ``get_config``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (e.g. configs/default.py)")
    spec = importlib.util.spec_from_file_location("trjax_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} defines no get_config()")
    return module.get_config()


def _keys(cfg, prefix=""):
    for k, v in cfg.items():
        yield prefix + k
        if isinstance(v, ml_collections.ConfigDict):
            yield from _keys(v, prefix + k + ".")


def check_overrides(config: ml_collections.ConfigDict, argv: list[str]) -> None:
    """Checks every ``--config.KEY=VALUE`` in ``argv`` against ``config``.

    Raises:
      ValueError: an unknown key (with the closest known keys), or a value
        that does not parse as the field's type (names both).
    """
    known = list(_keys(config))
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key, eq, value = arg[len("--config."):].partition("=")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"--config.{key}: no such config field{hint} "
                             f"(fields: {', '.join(k for k in known if '.' not in k)})")
        if not eq:
            continue
        current = config
        for part in key.split("."):
            current = current[part]
        if isinstance(current, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--config.{key}={value!r}: expected a bool (True/False)")
            continue
        for kind, parse, word in ((int, int, "an int"), (float, float, "a number")):
            if isinstance(current, kind):
                try:
                    parse(value)
                except ValueError:
                    raise ValueError(f"--config.{key}={value!r}: expected {word} "
                                     f"(default {current!r})") from None
                break


def check_argv(argv: list[str]) -> None:
    """For scripts: finds ``--config PATH`` in ``argv`` and checks the
    overrides; on a bad one, exits with ``error: <message>`` (status 1)."""
    import sys
    path = next((a.split("=", 1)[1] if "=" in a else argv[i + 1]
                 for i, a in enumerate(argv) if a.split("=")[0] == "--config" and
                 ("=" in a or i + 1 < len(argv))), None)
    if path:
        try:
            check_overrides(load_config_file(path), argv)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"error: {e}")
