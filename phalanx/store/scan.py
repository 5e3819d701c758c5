"""A stored dataset as the source of a lazy frame: this rank's balanced share of its rows,
read when the frame's rows are needed, and then only the columns the frame's plan uses.

Where the partitions are mapped here a column costs nothing until it is used; where they lie
in other hosts' memory (a store spanning hosts) only the columns used cross the network.  A
column read once is kept, so two frames made from the same input (a filter here, a group-by
there) fetch it once.  Filters are not pushed in: the store holds no statistics to skip rows
with, and the frame's own engine filters faster than a pass here would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from ..operators.common import balanced_bounds
from . import repartition as R
from .metadata import DatasetInfo
from .remote import ReadCounts

# (partition index, row selection, columns) → those rows of that partition
OpenRows = Callable[[int, dict[str, Any], list[str]], pa.Table]


class StoreScan:
    """This rank's rows [lo, hi) of the dataset ``info`` (``repartition.balanced_rows``), read
    by ``open_rows`` a column set at a time.  ``stats``: the rows of the share, and the bytes
    read so far, of them read on this host and fetched from others (from ``reads``, the
    store's counters): what a stage reports of its input."""

    pushes_filters = False  # see the module's docstring
    keeps_columns = True  # a column is read once: operators may read only the columns they use

    def __init__(
        self,
        info: DatasetInfo,
        open_rows: OpenRows,
        rank: int,
        nranks: int,
        schema: pa.Schema | None = None,
        reads: ReadCounts | None = None,
    ):
        self.info, self.rank, self.nranks = info, rank, nranks
        self.schema = schema if schema is not None else info.schema
        self._open_rows, self._reads = open_rows, reads or ReadCounts()
        bounds = balanced_bounds(info.num_rows, nranks)
        self.num_rows = int(bounds[rank + 1]) - int(bounds[rank])
        self.stats = {"rows": self.num_rows, "bytes": 0, "read_here": 0, "fetched": 0}
        self._columns: dict[str, pa.ChunkedArray] = {}

    def read(self, columns: list[str], filters: Sequence[Any]) -> pa.Table:
        if filters:  # pushes_filters is False: the pipeline keeps them
            raise ValueError("StoreScan.read: filters are applied by the frame's pipeline, not pushed in")
        missing = [c for c in columns if c not in self._columns]
        if missing or not self._columns:
            # at least one column read: a frame of no columns still has its rows
            wanted = missing or [self.schema.names[0]]
            here, fetched = self._reads.local, self._reads.fetched
            table = R.balanced_rows(
                self.info, lambda i, select: self._open_rows(i, select, wanted), self.rank, self.nranks
            )
            self.stats["bytes"] += table.nbytes
            self.stats["read_here"] += self._reads.local - here
            self.stats["fetched"] += self._reads.fetched - fetched
            for name in wanted:
                self._columns[name] = table.column(name)
        if not columns:
            return pa.table({name: col for name, col in list(self._columns.items())[:1]}).select([])
        schema = pa.schema([self.schema.field(c) for c in columns])
        return pa.Table.from_arrays([self._columns[c] for c in columns], schema=schema)

    def describe(self, columns: list[str], filters: Sequence[Any]) -> str:
        held = sum(1 for p in self.info.partitions if p.endpoint)
        where = f", {held} of them in hosts' memory" if held else ""
        return (
            f"Scan store dataset {self.info.name!r}: rows {self.num_rows} of {self.info.num_rows} on this rank "
            f"from {self.info.num_partitions} partitions{where}, columns {columns}"
        )
