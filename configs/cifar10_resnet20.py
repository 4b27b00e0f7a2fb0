"""Re-exports trjax/configs/cifar10_resnet20.py (trjax-train --config cifar10_resnet20)."""
from trjax.configs.cifar10_resnet20 import get_config  # noqa: F401
