"""Which rows of a stored dataset go to consumer rank r of M: the three get plans.

- balanced: contiguous global row ranges, as zero-copy slices of the memory-mapped partitions
  (of a partition on another host, only the slice is fetched: ``select_rows`` runs there);
- hash by keys: the stored partition itself when it was written hash-partitioned by the same
  keys for M ranks with the same hash function, else balanced + a shuffle among consumers;
- random: a seeded permutation of all rows, each rank taking a disjoint share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..operators.common import balanced_bounds
from ..operators.kernels import HASH_ID
from .metadata import DatasetInfo

OpenRows = Callable[[int, dict[str, Any]], pa.Table]  # (partition, select_rows' selection) → rows


def hash_partitioning(keys: Sequence[str], nparts: int) -> dict[str, Any]:
    return {"kind": "hash", "keys": list(keys), "n": nparts, "hash": HASH_ID}


def matches_hash(info: DatasetInfo, keys: Sequence[str], nparts: int) -> bool:
    return info.partitioning == hash_partitioning(keys, nparts)


def row_offsets(info: DatasetInfo) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([p.rows for p in info.partitions], dtype=np.int64)])


def balanced_pieces(info: DatasetInfo, rank: int, nranks: int) -> list[tuple[int, dict[str, Any]]]:
    """Rows [lo, hi) of the whole dataset for this rank, as (partition, row selection) pieces
    in partition order."""
    bounds = balanced_bounds(info.num_rows, nranks)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    offsets = row_offsets(info)
    pieces = []
    for i in range(info.num_partitions):
        start, stop = max(lo, int(offsets[i])), min(hi, int(offsets[i + 1]))
        if start < stop:
            pieces.append((i, {"slice": [start - int(offsets[i]), stop - int(offsets[i])]}))
    return pieces


def balanced_rows(info: DatasetInfo, open_rows: OpenRows, rank: int, nranks: int) -> pa.Table:
    """Rows [lo, hi) of the whole dataset for this rank: slices (no copy where the partition
    is mapped here; only the slice moves where it is fetched)."""
    pieces = [open_rows(i, select) for i, select in balanced_pieces(info, rank, nranks)]
    return pa.concat_tables(pieces) if pieces else info.schema.empty_table()


def permutation_share(total: int, seed: int, rank: int, nranks: int) -> np.ndarray:
    """This rank's share of one seeded global permutation (the same on every rank)."""
    perm = np.random.default_rng(seed).permutation(total)
    bounds = balanced_bounds(total, nranks)
    return perm[int(bounds[rank]) : int(bounds[rank + 1])]


def random_share(info: DatasetInfo, open_rows: OpenRows, seed: int, rank: int, nranks: int) -> pa.Table:
    """This rank's share of one seeded permutation of all rows, in the permutation's order:
    from each partition the rows of the share it holds (``select_rows``), then reordered."""
    rows = permutation_share(info.num_rows, seed, rank, nranks)
    if len(rows) == 0:
        return info.schema.empty_table()
    offsets = row_offsets(info)
    part = np.searchsorted(offsets, rows, side="right") - 1
    order = np.argsort(part, kind="stable")
    pieces = []
    for i in np.unique(part):
        perm = [info.num_rows, seed, rank, nranks, int(offsets[i])]
        pieces.append(open_rows(int(i), {"perm": perm}))
    grouped = pa.concat_tables(pieces)  # partition by partition, each in the permutation's order
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return grouped.take(pa.array(inverse))  # back to the permutation's order


def select_rows(table: pa.Table, select: dict[str, Any]) -> pa.Table:
    """The rows of one partition a reader asked for — ``{"slice": [start, stop]}``, or
    ``{"perm": [total, seed, rank, nranks, offset]}``: those of ``permutation_share`` that fall
    in this partition (which starts at global row ``offset``), in the permutation's order.  The
    same function runs where the partition is mapped and in the store service that holds it."""
    if "slice" in select:
        start, stop = (int(x) for x in select["slice"])
        return table.slice(start, stop - start)
    total, seed, rank, nranks, offset = (int(x) for x in select["perm"])
    share = _cached_share(total, seed, rank, nranks)
    mine = share[(share >= offset) & (share < offset + table.num_rows)] - offset
    return table.take(pa.array(mine))


@functools.lru_cache(maxsize=16)
def _cached_share(total: int, seed: int, rank: int, nranks: int) -> np.ndarray:
    return permutation_share(total, seed, rank, nranks)


def rank_hosts(infos: Sequence[DatasetInfo], nranks: int) -> list[str] | None:
    """The host each of ``nranks`` reader ranks should run on so that most of what it reads
    is in that host's memory: for a balanced read (rank r takes rows [lo, hi) of each
    dataset; a read by the stored hash partitioning takes partition r, the same rows when the
    counts match), the host holding the most of those bytes.  None when no partition records a
    host (one host, a shared root, an object store): placement then does not matter."""
    weights: list[dict[str, float]] = [{} for _ in range(nranks)]
    for info in infos:
        bounds, offsets = balanced_bounds(info.num_rows, nranks), row_offsets(info)
        for r in range(nranks):
            lo, hi = int(bounds[r]), int(bounds[r + 1])
            for i, part in enumerate(info.partitions):
                overlap = min(hi, int(offsets[i + 1])) - max(lo, int(offsets[i]))
                if overlap > 0 and part.host:
                    w = weights[r]
                    w[part.host] = w.get(part.host, 0.0) + part.bytes * overlap / max(part.rows, 1)
    if not any(weights):
        return None
    return [max(sorted(w), key=w.__getitem__) if w else "" for w in weights]
