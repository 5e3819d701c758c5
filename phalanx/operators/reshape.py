"""Reshaping: ``concat`` (a union of frames), ``value_counts`` and ``pivot``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .dataframe import DataFrame


def concat(frames: Sequence[DataFrame]) -> DataFrame:
    """``px.concat([a, b, ...])``: the union of the frames' rows (collective)."""
    return concat_frames(list(frames))


def concat_frames(frames: list[DataFrame]) -> DataFrame:
    raise NotImplementedError("concat: being built (issue 27)")


def value_counts(df: DataFrame, subset, normalize: bool, sort: bool, ascending: bool, dropna: bool) -> DataFrame:
    raise NotImplementedError("value_counts: being built (issue 27)")


def pivot(df: DataFrame, index, columns, values, aggfunc: str = "sum") -> DataFrame:
    raise NotImplementedError("pivot: being built (issue 27)")
