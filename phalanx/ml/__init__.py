"""Data-parallel training on a gang: store datasets as torch batches, DDP over the gang's Gloo group.

``import phalanx.ml`` (or ``px.ml``, imported on first use) loads torch, which comes with the
``torch`` extra (``pip install 'phalanx[torch]'``); ``import phalanx`` does not.
"""

from ..extras import require

require("torch", "torch", "phalanx.ml (training stages)")

from .ddp import ddp  # noqa: E402 (after the check that names the extra)
from .loader import Loader, loader  # noqa: E402

__all__ = ["Loader", "ddp", "loader"]
