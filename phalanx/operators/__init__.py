"""Distributed dataframe operators on Arrow partitions."""

from .dataframe import DataFrame
from .groupby import GroupBy
from .io import read_csv, read_parquet
from .reshape import concat

__all__ = ["DataFrame", "GroupBy", "concat", "read_csv", "read_parquet"]
