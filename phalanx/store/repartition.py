"""Which rows of a stored dataset go to consumer rank r of M: the three get plans.

- balanced: contiguous global row ranges, as zero-copy slices of the memory-mapped partitions;
- hash by keys: the stored partition itself when it was written hash-partitioned by the same
  keys for M ranks with the same hash function, else balanced + a shuffle among consumers;
- random: a seeded permutation of all rows, each rank taking a disjoint share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..operators.common import balanced_bounds
from ..operators.kernels import HASH_ID
from .metadata import DatasetInfo

OpenPartition = Callable[[int], pa.Table]


def hash_partitioning(keys: Sequence[str], nparts: int) -> dict[str, Any]:
    return {"kind": "hash", "keys": list(keys), "n": nparts, "hash": HASH_ID}


def matches_hash(info: DatasetInfo, keys: Sequence[str], nparts: int) -> bool:
    return info.partitioning == hash_partitioning(keys, nparts)


def row_offsets(info: DatasetInfo) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([p.rows for p in info.partitions], dtype=np.int64)])


def balanced_rows(info: DatasetInfo, open_partition: OpenPartition, rank: int, nranks: int) -> pa.Table:
    """Rows [lo, hi) of the whole dataset for this rank: slices, no copy."""
    bounds = balanced_bounds(info.num_rows, nranks)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    offsets = row_offsets(info)
    pieces = []
    for i in range(info.num_partitions):
        start, stop = max(lo, int(offsets[i])), min(hi, int(offsets[i + 1]))
        if start < stop:
            pieces.append(open_partition(i).slice(start - int(offsets[i]), stop - start))
    return pa.concat_tables(pieces) if pieces else info.schema.empty_table()


def permutation_share(total: int, seed: int, rank: int, nranks: int) -> np.ndarray:
    """This rank's share of one seeded global permutation (the same on every rank)."""
    perm = np.random.default_rng(seed).permutation(total)
    bounds = balanced_bounds(total, nranks)
    return perm[int(bounds[rank]) : int(bounds[rank + 1])]


def take_rows(info: DatasetInfo, open_partition: OpenPartition, rows: np.ndarray) -> pa.Table:
    """Global row numbers → a table in that order (one take per partition touched)."""
    if len(rows) == 0:
        return info.schema.empty_table()
    offsets = row_offsets(info)
    part = np.searchsorted(offsets, rows, side="right") - 1
    order = np.argsort(part, kind="stable")
    grouped_rows, grouped_part = rows[order], part[order]
    pieces = []
    # grouped_part is sorted: each partition's rows are one contiguous run of it
    bounds = np.searchsorted(grouped_part, np.arange(info.num_partitions + 1))
    for i in range(info.num_partitions):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo < hi:
            pieces.append(open_partition(i).take(pa.array(grouped_rows[lo:hi] - offsets[i])))
    grouped = pa.concat_tables(pieces)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return grouped.take(pa.array(inverse))  # back to the permutation's order


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
