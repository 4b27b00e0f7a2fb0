"""trjax.config: every numeric key of the default config has a checked range."""

import importlib.util
import os

from trjax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# numeric keys checked by the module that uses them, before anything is compiled
CHECKED_ELSEWHERE = {"cpu_devices": "trjax.host.resolve_cpu_convolutions",
                     "data_workers": "trjax.input_pipeline.resolve_workers",
                     "distributed.process_id": "trjax.distributed (against num_processes)"}


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
