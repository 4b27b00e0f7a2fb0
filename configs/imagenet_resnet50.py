"""Re-exports trjax/configs/imagenet_resnet50.py (trjax-train --config imagenet_resnet50)."""
from trjax.configs.imagenet_resnet50 import get_config  # noqa: F401
