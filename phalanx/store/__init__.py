"""The intermediate store between stages: immutable, partitioned Arrow datasets."""

from .metadata import DatasetInfo, PartitionInfo
from .store import Store

__all__ = ["DatasetInfo", "PartitionInfo", "Store"]
