#!/usr/bin/env bash
# Downloads the pure-Python wheels trjax needs beyond a typical JAX GPU image
# (ml_collections for configs and scripts; tensorboardX for config.tensorboard;
# flatbuffers for jax.export's serializer, trjax-export;
# setuptools and wheel, the build backend `pip install -e .` asks for) into a folder that
# travels with the repository to a machine without network (about 1.5 MB).
#
#   scripts/offline_wheels.sh [DIR]        # on a machine with network; DIR defaults to wheels/
#
# On the machine without network, either put them on PYTHONPATH (a pure-Python
# wheel is a zip archive Python can import from):
#   export PYTHONPATH=$PWD:$PWD/wheels/ml_collections-1.1.0-py3-none-any.whl:...
# or install them and trjax (pip builds trjax with the carried setuptools):
#   pip install --no-index --no-deps wheels/ml_collections-*.whl wheels/tensorboard[xX]-*.whl \
#       wheels/flatbuffers-*.whl
#   pip install --no-index --find-links wheels --no-deps -e .
# Their own dependencies (absl-py, PyYAML; numpy, packaging, protobuf) come
# with jax, optax, orbax-checkpoint and tensorboard, so --no-deps is enough.
set -euo pipefail
dir="${1:-$(cd "$(dirname "$0")/.." && pwd)/wheels}"
py="${PYTHON:-python3}"
mkdir -p "$dir"
# what the GPU image lacks; their own dependencies are there (--no-deps)
"$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
    "ml_collections>=0.1.1" "tensorboardX>=2.6" "flatbuffers>=24"
# the build backend and everything it pulls in (pip's isolated build environment)
"$py" -m pip download --quiet --only-binary=:all: --dest "$dir" "setuptools>=70.1" wheel
ls -l "$dir"
