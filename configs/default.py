"""Re-exports trjax/configs/default.py (trjax-train --config default)."""
from trjax.configs.default import get_config  # noqa: F401
