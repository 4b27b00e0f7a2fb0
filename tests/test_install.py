"""The offline install of docs/gpu.md, in a fresh virtual environment that, like the GPU
image, has jax, flax, optax, orbax, ... but neither ml_collections nor
tensorboardX, and no package index (--no-index).

The environment: a venv of this interpreter without pip or system site-packages,
whose one .pth file adds a folder of links to this environment's packages minus
ml_collections, tensorboardX and trjax (so nothing is downloaded or rebuilt and
the test stays fast). The carried wheels come from scripts/offline_wheels.sh,
run here once (it needs the package index, as the networked machine of docs/gpu.md
does; without one the tests skip and say so).

Routes, as docs/gpu.md documents them:
  A. repo and wheels on PYTHONPATH, no pip: scripts/train.py trains one step and
     writes TensorBoard events through tensorboardX imported from its wheel;
  B. pip install --no-index of the wheels, then trjax with
     --find-links wheels (pip's isolated build from the carried setuptools) and
     with --no-build-isolation (setuptools installed from the carried wheels);
  C. scripts/gpu_check.py finds the wheels itself when ml_collections is missing,
     and says what to do when they are missing too.

And installed, not only cloned: ``pip install`` of the repository (not editable) into a
fresh venv that has everything but trjax, then the ``trjax-train`` command from an empty
folder trains the main job with a packaged config, the clone deleted; the wheel's other
commands (``trjax-plot``, ``trjax-export``, ``trjax-tiny-cifar``) run there too.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = ("ml_collections", "tensorboardx", "trjax", "__editable__", "_trjax")
ONLY_TRJAX_MISSING = ("trjax", "__editable__", "_trjax")

pytestmark = pytest.mark.job  # each test builds a venv (and installs into it, or trains)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    d = tmp_path_factory.mktemp("wheels")
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "offline_wheels.sh"), str(d)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHON=sys.executable))
    if out.returncode != 0:
        pytest.skip("scripts/offline_wheels.sh could not reach a package index: "
                    + out.stderr.strip().splitlines()[-1][:200])
    names = sorted(os.path.basename(w) for w in glob.glob(str(d / "*.whl")))
    assert any(n.startswith("ml_collections-") for n in names), names
    assert any(n.lower().startswith("tensorboardx-") for n in names), names
    assert any(n.startswith("flatbuffers-") for n in names), names  # trjax-export
    assert any(n.startswith("setuptools-") for n in names), names
    return d


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """``(repo copy, python)``: one fresh venv like the GPU image (``_fresh_venv``) and one
    copy of the repository, shared by the tests that only read them (the image's checks,
    routes A and C: their carried packages come on PYTHONPATH, nothing is installed)."""
    root = tmp_path_factory.mktemp("image")
    return _repo_copy(root / "repo"), _fresh_venv(root)


def _setuptools_version() -> tuple:
    import setuptools
    return tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())


def _repo_copy(dest):
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("trjax", "scripts", "configs"):
        shutil.copytree(os.path.join(ROOT, name), dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest / name)
    return dest


def _fresh_venv(root, missing=MISSING):
    """A venv that sees this environment's packages except ``missing`` (by default
    ml_collections, tensorboardX and trjax); returns its python."""
    venv, site = root / "venv", root / "image-site-packages"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site.mkdir()
    ours = sysconfig.get_paths()["purelib"]
    for name in os.listdir(ours):
        if not name.lower().startswith(missing):
            os.symlink(os.path.join(ours, name), site / name)
    py = venv / "bin" / "python"
    venv_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip()
    with open(os.path.join(venv_site, "_image.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({str(site)!r})\n")
    return str(py)


def _env(**more):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "XLA_FLAGS"))}
    # no index, no machine-wide pip configuration or find-links
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "JAX_PLATFORMS": "cpu", **more}


def _run(cmd, cwd, env, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-3000:])
    return out.stdout


def test_the_image_lacks_them(image, tmp_path):
    py = image[1]
    for mod in ("ml_collections", "tensorboardX", "trjax"):
        out = subprocess.run([py, "-c", f"import {mod}"], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True)
        assert out.returncode == 1 and f"No module named '{mod}'" in out.stderr
    _run([py, "-c", "import jax, flax, optax, orbax.checkpoint"], tmp_path, _env())


def test_route_a_pythonpath_trains_one_step(image, tmp_path, wheels):
    repo, py = image
    carried = [w for w in glob.glob(str(wheels / "*.whl"))
               if os.path.basename(w).lower().startswith(("ml_collections", "tensorboardx"))]
    # the programs of gpu_check's dry-run main job (resnet8, 2 devices, batch 32, 2 epochs,
    # conftest's LLVM level; halt_after_steps and tensorboard enter no program): after
    # conftest's script_dry_runs the session's executable store holds them, so the route
    # loads them instead of compiling (run alone, it compiles them)
    from helpers import script_xla_flags
    env = _env(PYTHONPATH=os.pathsep.join([str(repo), *carried]), XLA_FLAGS=script_xla_flags())
    work = tmp_path / "run"
    _run([py, str(repo / "scripts" / "train.py"), "--config", str(repo / "configs" / "default.py"),
          "--workdir", str(work), "--config.model=resnet8", "--config.num_epochs=2",
          "--config.halt_after_steps=1", "--config.cpu_devices=2", "--config.progress=False",
          "--config.tensorboard=True", "--config.global_batch_size=32",
          "--config.eval_batch_size=32"], tmp_path, env)
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["world_size"] == 2
    assert glob.glob(str(work / "tensorboard" / "events.out.tfevents.*"))
    where = _run([py, "-c", "import ml_collections, tensorboardX, trjax; print(ml_collections."
                  "__file__); print(tensorboardX.__file__); print(trjax.__file__)"], tmp_path, env)
    assert [".whl" in line for line in where.split()] == [True, True, False]


def test_route_b_pip_without_index(tmp_path, wheels):
    carried = [w for w in glob.glob(str(wheels / "*.whl"))
               if os.path.basename(w).lower().startswith(("ml_collections", "tensorboardx"))]
    for route in ("find-links", "no-build-isolation"):
        root = tmp_path / route
        root.mkdir()
        repo, py = _repo_copy(root / "repo"), _fresh_venv(root)
        pip = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        _run([*pip, *carried], root, _env())
        if route == "find-links":  # pip's isolated build gets setuptools from the folder
            _run([*pip, "--find-links", str(wheels), "-e", str(repo)], root, _env())
        else:  # the build backend installed first, from the carried wheels
            _run([*pip, *glob.glob(str(wheels / "setuptools-*.whl")),
                  *glob.glob(str(wheels / "wheel-*.whl")),
                  *glob.glob(str(wheels / "packaging-*.whl"))], root, _env())
            _run([*pip, "--no-build-isolation", "-e", str(repo)], root, _env())
        out = _run([py, "-c", "import trjax, trjax.train, ml_collections, tensorboardX\n"
                    "from trjax.train.config import load_config_file\n"
                    f"c = load_config_file({str(repo / 'configs' / 'default.py')!r})\n"
                    "print(trjax.__file__, c.model)"], root, _env())
        assert out.split() == [str(repo / "trjax" / "__init__.py"), "resnet20"], route


def test_route_c_gpu_check_takes_the_wheels(image, tmp_path, wheels):
    repo, py = image
    script = str(repo / "scripts" / "gpu_check.py")
    out = subprocess.run([py, script, str(tmp_path / "none"), "--dry-run", "--parts", "devices",
                          "--wheels", str(tmp_path / "nowhere")], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "ml_collections is not importable" in out.stderr \
        and "scripts/offline_wheels.sh" in out.stderr
    _run([py, script, str(tmp_path / "out"), "--dry-run", "--parts", "devices",
          "--wheels", str(wheels)], tmp_path, _env())
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r["ok"] and any(w.startswith("ml_collections-") for w in r["wheels_on_path"])
    assert r["parts"]["devices"]["packages"]["ml_collections"]  # importable from the wheel


def test_pip_install_then_the_console_command_trains_from_an_empty_folder(tmp_path):
    """``pip install REPO`` (a wheel built from a copy of the repository, with this
    environment's setuptools when it is new enough, else in pip's isolated build, which
    fetches one; the wheel installed with no index and no deps), the copy deleted, then
    ``trjax-train --config default`` in an empty folder: the packaged config, the digits
    file and the command all come from the installed package. One epoch of ResNet-8 on 2
    devices (BN momentum 0.5, no warm-up: the running statistics catch up within it)."""
    repo = _repo_copy(tmp_path / "repo")
    py = _fresh_venv(tmp_path, missing=ONLY_TRJAX_MISSING)
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(repo)]
    if _setuptools_version() >= (70, 1):  # pyproject's build requirement: no index needed
        build.insert(4, "--no-build-isolation")
    built = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True,  # the index
                           timeout=300)
    if built.returncode != 0 and "--no-build-isolation" not in build:
        pytest.skip("building the wheel needs setuptools>=70.1 from a package index, which this "
                    f"machine cannot reach: {built.stderr.strip()[-300:]}")
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = dist.glob("trjax-*.whl")
    _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], tmp_path,
         _env())
    shutil.rmtree(repo)
    empty = tmp_path / "empty"
    empty.mkdir()
    where = _run([py, "-c", "import trjax, trjax.configs; print(trjax.__file__); "
                  "print(trjax.configs.names())"], empty, _env()).split("\n")
    assert where[0].startswith(str(tmp_path / "venv")), where
    assert where[1] == "['cifar10_resnet20', 'default', 'imagenet_resnet50']", where
    out = _run([os.path.join(os.path.dirname(py), "trjax-train"), "--config", "default",
                "--workdir", "runs/x", "--config.model=resnet8", "--config.num_epochs=1",
                "--config.warmup_epochs=0", "--config.bn_momentum=0.5", "--config.cpu_devices=2",
                "--config.progress=False", "--config.tensorboard=False"], empty, _env())
    summary = json.loads((empty / "runs" / "x" / "summary.json").read_text())
    assert summary["model"] == "resnet8" and summary["world_size"] == 2, summary
    assert summary["val_top1"] > 0.5, (summary["val_top1"], out[-2000:])
    assert "val_top1=" in out and "runs/x/summary.json" in out
    # python -m trjax.train is the same command
    helped = subprocess.run([py, "-m", "trjax.train", "--help"], cwd=empty, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert "--config: A packaged config's name" in helped.stdout, helped.stdout[-2000:]
    # the other commands of the wheel: the run's curves, its export, the tiny CIFAR
    bin_dir = os.path.dirname(py)
    out = _run([os.path.join(bin_dir, "trjax-plot"), "runs/x"], empty, _env())
    assert "wrote runs/x/curves.png" in out and (empty / "runs/x/curves.png").stat().st_size
    _run([os.path.join(bin_dir, "trjax-export"), "runs/x", "exported"], empty, _env())
    meta = json.loads((empty / "exported" / "model.json").read_text())
    assert meta["input"]["shape"] == ["b", 8, 8, 1] and meta["model"] == "resnet8", meta
    out = _run([py, "-c", "import jax, numpy as np; e = jax.export.deserialize(open("
                "'exported/model.jax_export', 'rb').read()); "
                "print(e.call(np.zeros((3, 8, 8, 1), np.uint8)).shape)"], empty, _env())
    assert out.strip() == "(3, 10)", out
    helped = _run([os.path.join(bin_dir, "trjax-tiny-cifar"), "--help"], empty, _env())
    assert "CIFAR-10-format" in helped
    for module in ("trjax.export", "trjax.tools.plot", "trjax.tools.tiny_cifar"):
        assert "usage:" in _run([py, "-m", module, "--help"], empty, _env())
