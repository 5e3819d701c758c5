"""Data-parallel training on a gang: store datasets as torch batches, DDP over the gang's Gloo group.

``import phalanx.ml`` (or ``px.ml``, imported on first use) loads torch; ``import phalanx`` does not.
"""

from .ddp import ddp
from .loader import Loader, loader

__all__ = ["Loader", "ddp", "loader"]
