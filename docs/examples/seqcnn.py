"""Sequential CNNs as Flax users write them, for the digits main job on any mesh:

  cd docs/examples && ../../.venv/bin/python ../../scripts/train.py \
      --config ../../configs/default.py --workdir /tmp/seq --config.model=seqcnn:linen \
      --config.mesh=data:4,model:2 \
      --config.tensor_plan='layers_*/Conv_0=column,layers_*/Conv_1=row,layers_4/Dense_0=column'

(``seqcnn:nnxseq`` with ``--config.tensor_plan='layers/2=column,layers/5=row,layers/9=column'``;
``--config.mesh=data:2,stage:4`` needs no plan.) Figures: docs/performance.md, issue 39.
"""
import flax.linen as nn
from flax import nnx


class Block(nn.Module):
    features: int = 32

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3))(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Conv(self.features, (3, 3))(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
        return nn.relu(x + y)


class Head(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dropout(0.2, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(self.num_classes)(x)


def linen(num_classes=10):
    return nn.Sequential([nn.Conv(32, (3, 3)), nn.relu, Block(), Block(), Head(num_classes)])


class Pool(nnx.Module):
    def __call__(self, x):
        return x.mean(axis=(1, 2))


def nnxseq(num_classes=10):
    r = nnx.Rngs(0)
    return nnx.Sequential(
        nnx.Conv(1, 32, (3, 3), rngs=r), nnx.relu,
        nnx.Conv(32, 64, (3, 3), rngs=r), nnx.BatchNorm(64, rngs=r), nnx.relu,
        nnx.Conv(64, 32, (3, 3), rngs=r), nnx.BatchNorm(32, rngs=r), nnx.relu,
        Pool(), nnx.Linear(32, num_classes, rngs=r))


def deep(num_classes=10, blocks=8, features=64):
    """A deeper sequence of residual blocks (remat's figure for your own model:
    ``--config.remat='layers_*'``, docs/performance.md)."""
    return nn.Sequential([nn.Conv(features, (3, 3)), nn.relu,
                          *[Block(features) for _ in range(blocks)], Head(num_classes)])
