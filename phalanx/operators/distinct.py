"""``drop_duplicates``: rows with equal keys are shuffled to one rank, which keeps one of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pyarrow as pa

from ..runtime.comm.base import Communicator
from . import kernels
from .shuffle import shuffle_table

_KEEP: dict[str | bool, Literal["first", "last", "none"]] = {"first": "first", "last": "last", False: "none"}


def drop_duplicates(
    comm: Communicator, table: pa.Table, subset: Sequence[str], keep: str | bool, colocated: bool = False
) -> pa.Table:
    """This rank's rows of the frame without duplicates over ``subset`` (collective); ``keep``
    as in pandas over the whole frame's order; ``colocated``: equal keys already share a rank."""
    if keep not in _KEEP:
        raise ValueError(f"drop_duplicates: keep must be 'first', 'last' or False, got {keep!r}")
    # Shuffled pieces arrive in source-rank order, each in its original order, so "first"
    # on the receiving rank is the first in the whole frame's order.
    shuffled = table if colocated else shuffle_table(comm, table, subset)
    out = kernels.to_polars(shuffled).unique(subset=list(subset), keep=_KEEP[keep], maintain_order=True)
    return kernels.from_polars(out, table.schema)
