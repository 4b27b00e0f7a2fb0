"""trjax.train.config: every numeric key of the default config has a checked range."""

import importlib.util
import os

from trjax.train import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# numeric keys checked by the module that uses them, before anything is compiled
CHECKED_ELSEWHERE = {"cpu_devices": "trjax.cpu.host.resolve_cpu_convolutions",
                     "data_workers": "trjax.data.input_pipeline.resolve_workers",
                     "distributed.process_id": "trjax.train.distributed (against num_processes)"}


def _numeric_keys(c, prefix=""):
    for k, v in c.items():
        if hasattr(v, "items"):
            yield from _numeric_keys(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + k


def test_every_numeric_key_has_a_range():
    spec = importlib.util.spec_from_file_location("default", os.path.join(REPO, "configs",
                                                                          "default.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ranged = set(config_lib.POSITIVE_INTS) | set(config_lib.NON_NEGATIVE_INTS) | \
        set(config_lib.FLOAT_RANGES) | set(CHECKED_ELSEWHERE)
    missing = sorted(set(_numeric_keys(module.get_config())) - ranged)
    assert not missing, f"numeric config keys without a range check: {missing}"


def test_every_float_key_takes_a_fraction_on_the_command_line(monkeypatch):
    """A key of FLOAT_RANGES whose default is an int parses its command-line
    override with int() (ml_collections keeps the default's type):
    ``--config.executable_store_max_mb=0.5`` or ``--config.step_timeout_s=0.5``
    failed in flag parsing ("invalid literal for int()")."""
    from absl import flags
    from ml_collections import config_flags

    for name in sorted(f for f in os.listdir(os.path.join(REPO, "configs"))
                       if f.endswith(".py") and not f.startswith("_")):
        values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, "", flag_values=values)
        argv = ["prog", f"--config={os.path.join(REPO, 'configs', name)}",
                *(f"--config.{key}=0.5" for key in config_lib.FLOAT_RANGES)]
        monkeypatch.setattr("sys.argv", argv)  # ml_collections reads the overrides there
        values(argv)
        for key in config_lib.FLOAT_RANGES:
            assert config_lib._get(values.config, key) == 0.5, (name, key)
