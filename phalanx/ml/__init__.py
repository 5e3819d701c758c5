"""Data-parallel training on a gang: store datasets as torch batches, DDP over the gang's NCCL or Gloo group,
checkpoints in the store so a retried or resumed training stage continues where it stopped.

``import phalanx.ml`` (or ``px.ml``, imported on first use) loads torch, which comes with the
``torch`` extra (``pip install 'phalanx[torch]'``); ``import phalanx`` does not.
"""

from ..extras import require

require("torch", "torch", "phalanx.ml (training stages)")

from .checkpoint import Checkpoint, Checkpoints, load_checkpoint  # noqa: E402
from .ddp import RankDevice, choose_backend, ddp, rank_device  # noqa: E402 (after the check that names the extra)
from .loader import Loader, loader  # noqa: E402

__all__ = [
    "Checkpoint",
    "Checkpoints",
    "Loader",
    "RankDevice",
    "choose_backend",
    "ddp",
    "load_checkpoint",
    "loader",
    "rank_device",
]
