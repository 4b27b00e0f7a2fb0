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


def _flat_keys(c, prefix=""):
    for k, v in c.items():
        if hasattr(v, "items") and config_lib.KEYS.get(prefix + k, None) is None:  # "dict": a leaf
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def test_the_key_table_covers_every_key_of_every_config():
    for name in ("default.py", "cifar10_resnet20.py", "imagenet_resnet50.py"):
        c = config_lib.load_config_file(os.path.join(REPO, "configs", name))
        assert set(_flat_keys(c)) == set(config_lib.KEYS), name


def test_the_lists_read_from_the_table():
    keys = config_lib.KEYS
    assert set(config_lib.CHECKPOINT_KEYS) == {k for k, v in keys.items() if v.checkpoint}
    assert "seed" in config_lib.CHECKPOINT_KEYS and "num_epochs" not in config_lib.CHECKPOINT_KEYS
    assert "num_epochs" in config_lib.RESUME_MAY_CHANGE and "distributed" in \
        config_lib.RESUME_MAY_CHANGE and "learning_rate" not in config_lib.RESUME_MAY_CHANGE
    # a key that must match the checkpoint never changes freely on resume
    assert not [k for k, v in keys.items() if v.checkpoint and v.resume]


def test_keys_outside_the_programs_leave_the_lowered_train_step_unchanged():
    """Every key the table says enters no compiled program, all changed at once: the
    train step lowers to the same text (the table's ``program`` column is checked, not
    trusted)."""
    import jax
    from helpers import small_config
    from trjax import steps
    from trjax.objective import StepOptions
    from trjax.state import train_state_program
    from trjax.train import trainer

    changed = dict(checkpoint_async=False, checkpoint_every_steps=5, compilation_cache=False,
                   compilation_cache_dir="/elsewhere", data_workers=0, halt_after_steps=3,
                   halt_on_nonfinite=True, keep_checkpoints=1, log_every_steps=0,
                   max_consecutive_overflows=2, metrics_lag=2, preemption_check_every_steps=7,
                   prefetch=0, profile_steps="1:2", progress=False, resume=False,
                   skip_bad_images=True, step_timeout_s=60.0, tensorboard=False,
                   verify_images=True)
    outside = set(config_lib.OUTSIDE_PROGRAMS)
    # data_dir: digits reads no folder; init_from: state values, not the program
    # (tests/test_init_from.py); distributed.*: set below
    assert set(changed) == outside - {"data_dir", "init_from"} - {k for k in outside if "." in k}
    other = small_config(**changed)
    other.distributed.coordinator = "localhost:1234"
    other.distributed.heartbeat_timeout_s = 5

    def lowered(cfg):
        tr = trainer.prepare(cfg)
        init = train_state_program(cfg.seed, tr.layout, tr.exchange)
        n = tr.world.global_batch_size
        batch = {"image": jax.ShapeDtypeStruct((n,) + tr.data.image_shape, "uint8",
                                               sharding=tr.world.sharded()),
                 "label": jax.ShapeDtypeStruct((n,), "int32", sharding=tr.world.sharded()),
                 "mask": jax.ShapeDtypeStruct((n,), "float32", sharding=tr.world.sharded())}
        step = steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                     StepOptions(padding=not tr.full_batches))
        return jax.jit(step, donate_argnums=0).lower(init.abstract, batch).as_text()

    assert lowered(small_config()) == lowered(other)


def test_help_lists_every_config_key_with_its_default():
    """``trjax-train --help`` prints every key of the config (from its own lines and
    comments, so it cannot drift from the defaults), for each packaged config."""
    from trjax.configs import config_path
    from trjax.train.main import config_keys_help
    import importlib.util
    for name in ("default", "cifar10_resnet20", "imagenet_resnet50"):
        path = config_path(name)
        spec = importlib.util.spec_from_file_location(f"cfg_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        text = config_keys_help(path)
        flat = []

        def walk(d, prefix=""):
            for k, v in d.items():
                if hasattr(v, "items") and k != "model_kwargs":
                    walk(v, f"{prefix}{k}.")
                else:
                    flat.append(f"{prefix}{k}")
        walk(module.get_config())
        missing = [k for k in flat if f"--config.{k}=" not in text]
        assert missing == [], (name, missing)
        if name == "default":
            assert "  --config.global_batch_size=128" in text
            assert "--config.bn_mode=\"running\"" in text and "SyncBatchNorm" in text
        else:  # its own keys first, then the default's
            own, rest = text.split("Every other key, as the default config sets it:")
            assert "--config.dataset=" in own and "--config.dataset=\"digits\"" in rest
