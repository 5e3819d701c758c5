"""A stored dataset as the source of a lazy frame: this rank's balanced share of its rows,
read when the frame's rows are needed, and then only the columns the frame's plan uses.

The partitions in this host's file tiers are mapped at once, as an eager read maps them: a
mapping costs no copy, and it holds the file, so a replacement or deletion of the dataset while
the app runs cannot take the rows away (a spill or reload the store follows in any case).
Their columns are sliced as they are used.  The partitions in other hosts' memory (a store
spanning hosts) and in an object store are read later, and then only the columns used cross
the network.  A column read once is kept, so two frames made from the same input (a filter
here, a group-by there) fetch it once.  Filters are not pushed in: the store holds no
statistics to skip rows with, and the frame's own engine filters faster than a pass here would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from . import repartition as R
from .metadata import DatasetInfo
from .store import Store
from .tiers import FileTier


class StoreScan:
    """This rank's rows [lo, hi) of the dataset ``info`` (``repartition.balanced_pieces``) in
    ``store``.  ``stats``: the rows of the share, and the bytes read so far, of them read on
    this host and fetched from others (the store's counters): what a stage reports of its
    input."""

    pushes_filters = False  # see the module's docstring
    keeps_columns = True  # a column is read once: operators may read only the columns they use

    def __init__(
        self,
        store: Store,
        info: DatasetInfo,
        rank: int,
        nranks: int,
        schema: pa.Schema | None = None,
        verify: bool = True,
    ):
        self.store, self.info, self.verify = store, info, verify
        self.schema = schema if schema is not None else info.schema
        self.pieces = R.balanced_pieces(info, rank, nranks)
        self.num_rows = sum(select["slice"][1] - select["slice"][0] for _, select in self.pieces)
        self.stats = {"rows": self.num_rows, "bytes": 0, "read_here": 0, "fetched": 0}
        reads = store.reads
        here, fetched = reads.local, reads.fetched
        mapped_here = isinstance(store.tier, FileTier)
        self._mapped = {
            i: store.partition(info, i, verify=verify)
            for i, _ in self.pieces
            if mapped_here and store.is_here(info.partitions[i])
        }
        self.stats["read_here"] += reads.local - here
        self.stats["fetched"] += reads.fetched - fetched
        self._columns: dict[str, pa.ChunkedArray] = {}

    def _piece(self, i: int, select: dict[str, Any], names: list[str]) -> pa.Table:
        if i in self._mapped:
            return R.select_rows(self._mapped[i].select(names), select)
        return self.store.rows(self.info, i, select, names, self.verify)

    def read(self, columns: list[str], filters: Sequence[Any]) -> pa.Table:
        if filters:  # pushes_filters is False: the pipeline keeps them
            raise ValueError("StoreScan.read: filters are applied by the frame's pipeline, not pushed in")
        missing = [c for c in columns if c not in self._columns]
        if missing or not self._columns:
            # at least one column read: a frame of no columns still has its rows
            wanted = missing or [self.schema.names[0]]
            reads = self.store.reads
            here, fetched = reads.local, reads.fetched
            pieces = [self._piece(i, select, wanted) for i, select in self.pieces]
            table = (
                pa.concat_tables(pieces) if pieces else pa.schema([self.schema.field(c) for c in wanted]).empty_table()
            )
            self.stats["bytes"] += table.nbytes
            self.stats["read_here"] += reads.local - here
            self.stats["fetched"] += reads.fetched - fetched
            for name in wanted:
                self._columns[name] = table.column(name)
        if not columns:
            first = next(iter(self._columns))
            return pa.table({first: self._columns[first]}).select([])
        schema = pa.schema([self.schema.field(c) for c in columns])
        return pa.Table.from_arrays([self._columns[c] for c in columns], schema=schema)

    def describe(self, columns: list[str], filters: Sequence[Any]) -> str:
        away = sum(1 for i, _ in self.pieces if i not in self._mapped)
        where = f" ({len(self._mapped)} mapped here, {away} read from elsewhere)" if away else " (mapped here)"
        return (
            f"Scan store dataset {self.info.name!r}: rows {self.num_rows} of {self.info.num_rows} on this rank "
            f"from {len(self.pieces)} of {self.info.num_partitions} partitions{where}, columns {columns}"
        )
