"""The intermediate store between stages: immutable, partitioned Arrow datasets.

Payload tiers (``tiers.Tier``: a directory, an ``s3://`` object store) and metadata backends
(``metadata.MetadataBackend``: SQLite, Redis) sit behind one interface each; see docs/store.md.
Importing this package attaches the store to the rank runtime (``env.store``).
"""

from typing import TYPE_CHECKING

from ..runtime.env import BSPEnv, attach_store
from .metadata import DatasetInfo, MetadataBackend, PartitionInfo
from .store import Store
from .tiers import Tier

if TYPE_CHECKING:
    from .rank import RankStore


def _open_rank_store(env: BSPEnv) -> "RankStore":
    """``env.store`` of a rank: the gang's store (its ``PHALANX_STORE*`` settings), collective."""
    from .rank import RankStore  # (it needs the operators: loaded when a rank first uses env.store)

    return RankStore(env, Store.from_env())


attach_store(_open_rank_store)  # the runtime never imports the store: the store plugs itself in

__all__ = ["DatasetInfo", "MetadataBackend", "PartitionInfo", "Store", "Tier"]
