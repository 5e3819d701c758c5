"""``env.store``: collective put and get for the ranks of a gang."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..errors import StoreError
from ..operators.common import agree_schema, as_list, check_columns
from ..operators.dataframe import DataFrame
from ..operators.shuffle import shuffle_table
from . import repartition as R
from .metadata import DatasetInfo
from .scan import StoreScan
from .store import Store
from .tiers import FileTier

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv


class RankStore:
    """The gang's view of a ``Store``: every rank calls ``put``/``get`` together."""

    def __init__(self, env: BSPEnv, store: Store):
        self.env = env
        self.store = store
        self.last_plan = ""  # which repartition path the last get took (for benchmarks, logs)
        self.last_scan: StoreScan | None = None  # the last lazy get's source: what it has read
        self._root_ids: list[str] | None = None

    def root_ids(self) -> list[str]:
        """Each rank's store-root identity (``FileTier.root_id``; "" on an object store),
        gathered once (collective): ranks with different ids are on hosts that do not share
        the root — the store then spans hosts, each keeping its ranks' partitions."""
        if self._root_ids is None:
            tier = self.store.tier
            self._root_ids = self.env.comm.allgather_obj(tier.root_id() if isinstance(tier, FileTier) else "")
        return self._root_ids

    def _leads_root(self) -> bool:
        """Whether this rank is the first of those that share its root (it moves their
        partitions into place, or removes them)."""
        ids = self.root_ids()
        return ids.index(ids[self.env.rank]) == self.env.rank

    def for_session(self, session: str) -> RankStore:
        """The same store, another session (namespace)."""
        return RankStore(self.env, self.store.for_session(session))

    # Changes are collective: rank 0 makes them once, every rank gets its result or its error
    # (called on every rank as plain Store calls, one would win and the others fail).
    def delete(self, name: str) -> None:
        self.env.comm.on_root(self.store.delete, name)

    def pin(self, name: str) -> DatasetInfo:
        return self.env.comm.on_root(self.store.pin, name)

    def unpin(self, name: str) -> DatasetInfo:
        return self.env.comm.on_root(self.store.unpin, name)

    def __getattr__(self, attr: str) -> Any:  # list, info, exists, read... of the Store
        return getattr(self.store, attr)

    def put(
        self, name: str, data: DataFrame | pa.Table | Any, replace: bool = False, producer: str = "", run: str = ""
    ) -> DatasetInfo:
        """Every rank writes its partition; the dataset is sealed when all have written."""
        env, comm, store = self.env, self.env.comm, self.store
        table, partitioned_by = _as_table(data)
        if not isinstance(data, DataFrame):  # a DataFrame's ranks already agree on the schema
            table = agree_schema(comm, table, f"put {name!r}")  # e.g. an empty pandas partition

        def plan() -> str:
            if not replace and store.exists(name):
                raise store._exists(name)
            return store.new_staging_id(env.gang_id or "gang")

        staging_id = comm.on_root(plan)
        spans_hosts = len(set(self.root_ids())) > 1
        discards = self._leads_root() if spans_hosts else env.rank == 0  # one remover per root
        try:
            part = comm.on_every_rank(
                f"put {name!r}: writing partitions", store.stage_partition, staging_id, env.rank, table, name
            )
        except Exception:
            if discards:
                store.discard_staging(name, staging_id)
            raise
        reports = comm.allgather_obj((part, table.schema.serialize().to_pybytes()))
        schemas = [pa.ipc.read_schema(pa.py_buffer(s)) for _, s in reports]
        bad = [r for r, s in enumerate(schemas) if not s.equals(schemas[0])]
        if bad:
            if discards:
                store.discard_staging(name, staging_id)
            raise StoreError(
                f"put {name!r}: ranks {bad} have a different schema than rank 0: {schemas[bad[0]]} vs {schemas[0]}"
            )
        if spans_hosts:  # each host's first rank moves that host's partitions into place
            comm.on_every_rank(
                f"put {name!r}: moving partitions into place on each host",
                lambda: store.commit_here(name, staging_id) if discards else None,
            )
        partitioning = R.hash_partitioning(partitioned_by, comm.world_size) if partitioned_by else None
        parts = [p for p, _ in reports]
        info = comm.on_root(
            store.seal, name, staging_id, parts, schemas[0], partitioning, producer, run, replace, spans_hosts
        )
        if spans_hosts and discards and env.rank != 0:  # rank 0's seal did its own host's
            store.within_budget()  # what did not fit before the seal (this put alone over budget)
        return info

    def get(
        self,
        name: str,
        by: str | Sequence[str] | None = None,
        shuffle: str | None = None,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        verify: bool = True,
        lazy: bool = False,
    ) -> DataFrame:
        """This rank's share of a sealed dataset, repartitioned for this gang (collective).

        default: rows balanced, zero-copy slices · ``by=keys``: hash-partitioned by keys ·
        ``shuffle="random"``: a seeded random permutation of all rows.  ``verify``: every
        partition's checksum is checked first (each by one rank), so a corrupted or truncated
        partition fails the read on every rank, naming dataset and partition.

        ``lazy``: a balanced share (no ``by``, no ``shuffle``) is read when the frame's rows
        are needed, and then only the columns its plan uses (``store.scan.StoreScan``): from
        other hosts' memory only those cross the network (this host's partitions are mapped
        now).  The checks above still run now; a partition of another host lost after them
        fails the first use; ``last_scan.stats``: what it read.
        ``env.input`` reads lazily.
        """
        env, comm = self.env, self.env.comm
        if shuffle not in (None, "random"):
            raise ValueError(f"get {name!r}: shuffle must be None or 'random', got {shuffle!r}")
        if by is not None and shuffle is not None:
            raise ValueError(f"get {name!r}: give by= or shuffle=, not both")
        info = comm.on_root(self.store.use, name)  # records the access; reloads if spilled
        keys = as_list(by)
        check_columns(info.schema, keys + as_list(columns), f"get {name!r}")

        # Only the columns asked for (and the keys) are gathered, shuffled or taken.
        wanted = list(dict.fromkeys(keys + as_list(columns))) if columns is not None else None

        if verify:  # split over the ranks: each partition is hashed once, not once per reader
            comm.on_every_rank(
                f"get {name!r}: verifying checksums", verify_share, env, self.store, info, self.root_ids()
            )

        def open_rows(i: int, select: dict[str, Any]) -> pa.Table:
            # checked above where it is local (O(1) now); from another host, only the rows asked
            # for move, picked by the holder after it checked the file
            return self.store.rows(info, i, select, wanted, verify)

        rank, nranks = env.rank, env.world_size
        partitioned_by = None
        if keys and R.matches_hash(info, keys, nranks):
            table = self.store.partition(info, rank, verify=verify)
            table = table.select(wanted) if wanted is not None else table
            self.last_plan, partitioned_by = "hash: stored partition, zero-copy", keys
        elif keys and self.store.spans_hosts(info, self.root_ids()):
            # Partitions in several hosts' memory: each reader pulls its rows by key from every
            # holder, which splits its partition once for all readers (each row moves once).
            def pull() -> pa.Table:
                pieces = [
                    self.store.rows_by_key(info, i, keys, nranks, rank, wanted) for i in range(info.num_partitions)
                ]
                schema = pieces[0].schema if pieces else info.schema
                return pa.concat_tables(pieces) if pieces else schema.empty_table()

            table = comm.on_every_rank(f"get {name!r}: pulling rows by key from the hosts holding them", pull)
            self.last_plan, partitioned_by = "hash: rows split at the hosts holding them", keys
        elif keys:
            local = comm.on_every_rank(
                f"get {name!r}: reading partitions", R.balanced_rows, info, open_rows, rank, nranks
            )
            table = shuffle_table(comm, local, keys)
            self.last_plan, partitioned_by = "hash: balanced read + shuffle", keys
        elif lazy and shuffle is None:
            self.last_plan = "balanced, zero-copy, columns read as used"
            schema = pa.schema([info.schema.field(c) for c in columns]) if columns is not None else None
            self.last_scan = StoreScan(self.store, info, rank, nranks, schema, verify)
            return DataFrame.lazy(self.last_scan, env)
        elif shuffle == "random":
            table, self.last_plan = R.random_share(info, open_rows, seed, rank, nranks), "random permutation"
        else:
            table, self.last_plan = R.balanced_rows(info, open_rows, rank, nranks), "balanced, zero-copy"
        if columns is not None:
            table = table.select(list(columns))
            if partitioned_by and not set(partitioned_by) <= set(columns):
                partitioned_by = None
        return DataFrame(table, env, partitioned_by)


def verify_share(env: BSPEnv, store: Store, info: DatasetInfo, root_ids: Sequence[str] = ()) -> None:
    """Check this rank's share of the checksums that need checking (``Store.needs_verify``):
    partition i by the (i mod k)-th of the k ranks that read its root — all ranks on one host or
    a shared root; on a store spanning hosts, the ranks of the host that holds it (a partition
    no rank here holds is checked by whoever fetches it).  Run on every rank
    (``comm.on_every_rank``) so a bad partition fails the read everywhere."""
    for i, part in enumerate(info.partitions):
        if not store.is_here(part):
            continue
        sharers = [r for r, rid in enumerate(root_ids) if rid == part.root_id] if part.root_id else []
        sharers = sharers or list(range(env.world_size))
        if sharers[i % len(sharers)] == env.rank and store.needs_verify(info, i):
            store.partition(info, i, verify=True, count=False)  # a check, not a read


def _as_table(data: Any) -> tuple[pa.Table, tuple[str, ...] | None]:
    if isinstance(data, DataFrame):
        return data.to_arrow(), data.partitioned_by
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data]), None
    if isinstance(data, pa.Table):
        return data, None
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False), None
    raise TypeError(f"put needs a phalanx DataFrame, a pyarrow Table or a pandas DataFrame, got {type(data).__name__}")
