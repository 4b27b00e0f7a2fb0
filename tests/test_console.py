"""The command (``trjax-train``, ``python -m trjax.train``, ``scripts/train.py``), the
packaged configs it takes by name, and a model named by import path
(``--config.model=package.module:Name``). The command installed by pip and run from an
empty folder: tests/test_install.py."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from trjax import configs, models
from trjax.configs import default
from trjax.train import config as config_lib
from trjax.train import main as main_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER_ARGS = dict(bn_mode="running", axis_name="data", bn_momentum=0.9, dtype=jnp.float32,
                    conv_lowering="auto")
NETS = '''
    import functools
    import flax.linen as nn
    import jax.numpy as jnp
    from flax import nnx
    from trjax import models
    from trjax.batchnorm import BatchNorm

    Net = functools.partial(models.ResNet, stage_sizes=(1, 1, 1))  # = resnet8

    class Tiny(nn.Module):
        num_classes: int
        width: int = 8
        bn_mode: str = "sync"
        axis_name: str | None = None

        @nn.compact
        def __call__(self, x, train=True, mask=None):
            x = nn.Conv(self.width, (3, 3), use_bias=False)(x.astype(jnp.float32))
            x = nn.relu(BatchNorm(mode=self.bn_mode, axis_name=self.axis_name)(x, train, mask))
            return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))

    def make_tiny(num_classes, width=4):
        return Tiny(num_classes=num_classes, width=width)

    def not_a_module(num_classes):
        return "a string"

    class NnxNet(nnx.Module):
        def __init__(self, num_classes, width=8, *, rngs):
            self.conv = nnx.Conv(1, width, (3, 3), rngs=rngs)
            self.head = nnx.Linear(width, num_classes, rngs=rngs)

        def __call__(self, x, train=True, mask=None):
            return self.head(jnp.mean(nnx.relu(self.conv(x.astype(jnp.float32))), axis=(1, 2)))

    def make_nnx(num_classes):
        return NnxNet(num_classes, rngs=nnx.Rngs(0))

    NOT_CALLABLE = 3

    class HFStyle(nn.Module):  # the class count under another name
        n_classes: int

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.n_classes)(x.reshape((x.shape[0], -1)).astype(jnp.float32))

    class FixedHead(nn.Module):  # no class count: a published 10-way head
        width: int = 4

        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.Dense(self.width)(x.reshape((x.shape[0], -1)).astype(jnp.float32)))

    class KerasStyle(nnx.Module):
        def __init__(self, classes, *, rngs):
            self.head = nnx.Linear(64, classes, rngs=rngs)

        def __call__(self, x):
            return self.head(x.reshape((x.shape[0], -1)).astype(jnp.float32))
'''


@pytest.fixture
def nets(tmp_path, monkeypatch):
    """A user's module ``trjax_test_nets`` (and ``trjax_test_broken``, which raises on
    import) on sys.path; both forgotten afterwards."""
    (tmp_path / "trjax_test_nets.py").write_text(textwrap.dedent(NETS))
    (tmp_path / "trjax_test_broken.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "trjax_test_nets"
    for name in ("trjax_test_nets", "trjax_test_broken"):
        sys.modules.pop(name, None)


def _config(model, **kwargs):
    c = default.get_config()
    c.model = model
    c.model_kwargs = kwargs
    return c


def _error(config) -> str:
    with pytest.raises(ValueError) as e:
        config_lib.validate(config)
    return str(e.value)


def test_the_packaged_configs_are_the_repository_configs():
    names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                   if f.endswith(".py") and not f.startswith("_"))
    assert configs.names() == names == ["cifar10_resnet20", "default", "imagenet_resnet50"]
    for name in names:
        path = configs.config_path(name)
        assert path == os.path.join(configs.DIR, name + ".py") == configs.config_path(name + ".py")
        packaged = config_lib.load_config_file(path)
        assert packaged.to_dict() == config_lib.load_config_file(
            os.path.join(ROOT, "configs", name + ".py")).to_dict(), name
        config_lib.validate(packaged)
    assert packaged.model_kwargs.to_dict() == {}
    repo_file = os.path.join(ROOT, "configs", "default.py")
    assert configs.config_path(repo_file) == repo_file  # a file is taken as it is
    assert configs.config_path("default:arg") == configs.config_path("default") + ":arg"
    with pytest.raises(FileNotFoundError, match=r"'configs/nosuch.py': no such file and no "
                       r"packaged config .*\['cifar10_resnet20', 'default', 'imagenet_resnet50'\]"):
        configs.config_path("configs/nosuch.py")


def test_the_command_resolves_the_config_name_before_flag_parsing():
    default = os.path.join(configs.DIR, "default.py")
    argv = ["prog", "--config", "default", "--workdir", "w", "--config.model=resnet8"]
    assert main_lib.resolve_config_argv(argv) == ["prog", "--config", default, "--workdir", "w",
                                                  "--config.model=resnet8"]
    assert main_lib.resolve_config_argv(["prog", "--config=cifar10_resnet20"]) == [
        "prog", "--config=" + os.path.join(configs.DIR, "cifar10_resnet20.py")]
    with pytest.raises(SystemExit) as e:
        main_lib.resolve_config_argv(["prog", "--config", "nosuch"])
    assert str(e.value).startswith("error: --config 'nosuch': no such file")


def test_model_kwargs_is_overridden_as_a_whole_dict():
    c = default.get_config()
    config_lib.check_overrides(c, ["--config.model_kwargs={'width': 32}"])
    with pytest.raises(ValueError, match=r"--config.model_kwargs.width: config.model_kwargs has "
                       r"no key 'width' to override; give the whole dict: "
                       r"--config.model_kwargs=\"\{'width': 32\}\""):
        config_lib.check_overrides(c, ["--config.model_kwargs.width=32"])


def test_a_model_path_that_does_not_import_is_an_error_naming_it(nets):
    form = "expected an import path 'package.module:Name'"
    msg = _error(_config("trjax_test_nowhere.nets:Net"))
    assert "config.model='trjax_test_nowhere.nets:Net': module 'trjax_test_nowhere.nets' does " \
        "not import: ModuleNotFoundError: No module named 'trjax_test_nowhere'" in msg
    assert form in msg
    msg = _error(_config(f"{nets}:Nett"))
    assert f"config.model='{nets}:Nett': AttributeError: '{nets}' has no attribute 'Nett'; did " \
        "you mean Net" in msg and form in msg
    msg = _error(_config(f"{nets}:Tiny.Inner"))
    assert f"AttributeError: '{nets}:Tiny' has no attribute 'Inner'" in msg
    msg = _error(_config("trjax_test_broken:Net"))
    assert "module 'trjax_test_broken' does not import: RuntimeError: no GPU here" in msg
    msg = _error(_config(f"{nets}:NOT_CALLABLE"))
    assert "is an object of type 'int', not a Module class" in msg
    for bad in (f"{nets}:", ":Net", "my nets:Net", f"{nets}:Net:x"):
        assert f"config.model={bad!r} is not of the form 'package.module:Name'" in \
            _error(_config(bad)), bad
    msg = _error(_config(f"{nets}.Net"))  # a dot for the colon
    assert f"is not one of {sorted(models.MODELS)} nor an import path" in msg and \
        f"did you mean '{nets}:Net'?" in msg
    assert "did you mean" not in _error(_config("resnet9"))
    msg = _error(_config(f"{nets}:Tiny", bn_mode="sync"))
    assert "config.model_kwargs sets ['bn_mode']: the trainer passes" in msg
    with pytest.raises(ValueError, match="config.model_kwargs=3 must be a dict of keyword"):
        config_lib.check_model(f"{nets}:Tiny", 3)  # a ConfigDict keeps the type; a dict does not
    config_lib.validate(_config(f"{nets}:Tiny", width=4))  # fine


def test_resolve_model_builds_a_model_by_name_or_by_path(nets):
    resnet8 = models.create_model("resnet8", num_classes=10, **TRAINER_ARGS)
    assert config_lib.resolve_model(_config("resnet8"), 10, **TRAINER_ARGS) == resnet8
    # by path, a Module the trainer's arguments fit is built exactly as the built-in one
    assert config_lib.resolve_model(_config("trjax.models:ResNet8"), 10, **TRAINER_ARGS) == resnet8
    assert config_lib.resolve_model(_config(f"{nets}:Net"), 10, **TRAINER_ARGS) == resnet8
    # model_kwargs reach the built-in models too (they override attributes)
    wide = config_lib.resolve_model(_config("resnet8", widths=(8, 16, 32)), 10, **TRAINER_ARGS)
    assert wide == models.create_model("resnet8", num_classes=10, widths=(8, 16, 32),
                                       **TRAINER_ARGS)
    # a user's linen Module: the trainer's arguments it declares, and model_kwargs
    tiny = config_lib.resolve_model(_config(f"{nets}:Tiny", width=4), 7, **TRAINER_ARGS)
    assert (tiny.num_classes, tiny.width, tiny.bn_mode, tiny.axis_name) == (7, 4, "running", "data")
    shapes = jax.eval_shape(lambda: tiny.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)),
                                              train=False))
    assert shapes["params"]["Dense_0"]["kernel"].shape == (4, 7) and shapes["batch_stats"]
    # a factory gets only the arguments it names
    made = config_lib.resolve_model(_config(f"{nets}:make_tiny"), 3, **TRAINER_ARGS)
    assert (made.num_classes, made.width, made.bn_mode, made.axis_name) == (3, 4, "sync", None)
    # an nnx Module class becomes a linen module (flax.nnx.bridge.to_linen)
    net = config_lib.resolve_model(_config(f"{nets}:NnxNet", width=4), 5, **TRAINER_ARGS)
    shapes = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)),
                                             train=False))
    assert shapes["params"]["head"]["kernel"].shape == (4, 5)
    from flax import nnx  # a factory may return an nnx instance
    assert isinstance(config_lib.resolve_model(_config(f"{nets}:make_nnx"), 5), nnx.Module)
    # the constructor refuses the arguments / returns no Module: named, before compiling
    with pytest.raises(ValueError, match=rf"config.model='{nets}:Tiny': {nets}:Tiny\(num_classes"
                       r"=\.\.\., bn_mode=\.\.\., axis_name=\.\.\., depth=\.\.\.\) failed: "
                       r"TypeError: .*'depth'"):
        config_lib.resolve_model(_config(f"{nets}:Tiny", depth=3), 10, **TRAINER_ARGS)
    with pytest.raises(ValueError, match="returned a str, not a flax Module"):
        config_lib.resolve_model(_config(f"{nets}:not_a_module"), 10, **TRAINER_ARGS)


def test_a_constructor_without_num_classes_is_built_as_published(nets):
    """Issue 40: a published model's class count under another name (n_classes, Keras's
    classes) gets the data set's; one without any is built without it and its head checked
    (10 logits for digits: trains; 3 classes: the wrap's logits check names the mismatch);
    model_kwargs may give the count under its own name."""
    hf = config_lib.resolve_model(_config(f"{nets}:HFStyle"), 7, **TRAINER_ARGS)
    assert hf.n_classes == 7
    assert config_lib.resolve_model(_config(f"{nets}:HFStyle", n_classes=7), 7).n_classes == 7
    fixed = config_lib.resolve_model(_config(f"{nets}:FixedHead", width=3), 10, **TRAINER_ARGS)
    assert fixed.width == 3
    keras = config_lib.resolve_model(_config(f"{nets}:KerasStyle"), 5, **TRAINER_ARGS)
    shapes = jax.eval_shape(lambda: keras.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1))))
    assert shapes["params"]["head"]["kernel"].shape == (64, 5)
    net = models.wrap(fixed, image_shape=(8, 8, 1), num_classes=10)  # fits digits
    assert net.module is fixed
    with pytest.raises(ValueError, match="10"):
        models.wrap(fixed, image_shape=(8, 8, 1), num_classes=3)


def test_a_model_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    """As ``python -m`` would: the console script's sys.path has its bin folder, not the
    folder it runs in."""
    (tmp_path / "trjax_test_here.py").write_text("from trjax.models import ResNet8 as Net\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert config_lib.import_model("trjax_test_here:Net") is models.ResNet8
    finally:
        sys.modules.pop("trjax_test_here", None)


def _command(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "trjax.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _commands(*argvs, cwd=ROOT):
    """``python -m trjax.train`` with each of ``argvs``, the processes started at once."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    from helpers import run_at_once
    return run_at_once([[sys.executable, "-m", "trjax.train", *a] for a in argvs], cwd, env, 300)


@pytest.mark.job
def test_python_m_trjax_train_help_and_errors_before_compiling(tmp_path):
    out, nosuch, modle, nowhere = _commands(
        ["--help"],
        ["--config", "nosuch", "--workdir", str(tmp_path / "w")],
        ["--config", "default", "--workdir", str(tmp_path / "w"), "--config.modle=x"],
        ["--config", "default", "--workdir", str(tmp_path / "w"),
         "--config.model=trjax_test_nowhere:Net", "--config.cpu_devices=2"])
    assert out.returncode == 1  # absl's --help exit status, as scripts/train.py's
    assert "trjax-train --config default --workdir runs/default" in out.stdout
    assert "--config: A packaged config's name (default, cifar10_resnet20," in out.stdout
    assert "--workdir: Directory for metrics.jsonl" in out.stdout
    assert "  --config.global_batch_size=128" in out.stdout  # every key, with its default
    assert "--config.bn_mode=\"running\"" in out.stdout and "SyncBatchNorm" in out.stdout
    out = nosuch
    assert out.returncode == 1 and "error: --config 'nosuch': no such file and no packaged " \
        "config of that name" in out.stderr, out.stderr
    out = modle
    assert out.returncode == 1 and "error: --config.modle: no such config field; did you mean " \
        "model" in out.stderr, out.stderr
    out = nowhere
    assert out.returncode == 1 and "error: config.model='trjax_test_nowhere:Net': module " \
        "'trjax_test_nowhere' does not import: ModuleNotFoundError" in out.stderr, out.stderr
    assert "compiled" not in out.stdout and not os.path.exists(tmp_path / "w" / "checkpoints")


def test_a_model_resolved_by_path_is_one_the_trainer_prepares(nets):
    """What trainer.prepare does with an import path (nothing is compiled): the resolved
    module passes the trainer's checks (logits [B, num_classes]) and gets a MemoryPlan."""
    from trjax.train import trainer
    c = _config(f"{nets}:Tiny", width=4)
    model = config_lib.resolve_model(c, 10, **TRAINER_ARGS)
    tr = trainer.prepare(c, model=model)
    assert tr.data.num_classes == 10 and sum(s.size for s in tr.plan.slots) > 0


@pytest.mark.job
def test_the_command_trains_a_model_named_by_path_from_the_current_directory(tmp_path):
    """``--config.model=mynets:Net`` with ``mynets.py`` beside the run; Net is ResNet-8, so
    the programs are those of tests/test_install.py's run (the session's compilation cache)."""
    (tmp_path / "trjax_test_mynets.py").write_text(
        "import functools\nfrom trjax import models\n"
        "Net = functools.partial(models.ResNet, stage_sizes=(1, 1, 1))\n")
    out = _command("--config", "default", "--workdir", "runs/x",
                   "--config.model=trjax_test_mynets:Net", "--config.num_epochs=1",
                   "--config.warmup_epochs=0", "--config.bn_momentum=0.5",
                   "--config.cpu_devices=2", "--config.progress=False",
                   "--config.tensorboard=False", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "x" / "summary.json").read_text())
    assert summary["model"] == "trjax_test_mynets:Net" and summary["val_top1"] > 0.5, summary
