"""The intermediate store between stages: immutable, partitioned Arrow datasets.

Payload tiers (``tiers.Tier``: a directory, an ``s3://`` object store) and metadata backends
(``metadata.MetadataBackend``: SQLite, Redis) sit behind one interface each; see docs/store.md.
"""

from .metadata import DatasetInfo, MetadataBackend, PartitionInfo
from .store import Store
from .tiers import Tier

__all__ = ["DatasetInfo", "MetadataBackend", "PartitionInfo", "Store", "Tier"]
