"""Distributed dataframe operators on Arrow partitions."""

from .dataframe import DataFrame
from .groupby import GroupBy
from .io import read_csv, read_parquet

__all__ = ["DataFrame", "GroupBy", "read_csv", "read_parquet"]
