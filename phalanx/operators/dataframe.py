"""The distributed DataFrame: every rank holds one Arrow partition of it.

Local operators touch only this rank's partition and need no communication.  Distributed
operators (shuffle, merge, groupby, sort_values, repartition, drop_duplicates, head, collect,
num_rows) are collective: every rank of the gang must call them, in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import common as C
from . import plan as P
from .common import agree_schema, as_list, balanced_bounds, check_columns
from .exchange import allgather_tables, concat, exchange_tables, gather_tables

if TYPE_CHECKING:
    import pandas as pd

    from ..runtime.env import BSPEnv
    from .groupby import GroupBy

TableFn = Callable[[pa.Table], Any]


class DataFrame:
    """A distributed table: ``to_arrow()`` is this rank's partition, ``collect()`` the whole.

    Local operators are lazy (``phalanx.operators.plan``): they add a step to this rank's
    pipeline, which runs as one pass, with its projections and filters pushed into the scan,
    when the rows are needed.  Distributed operators run when called."""

    def __init__(
        self,
        table: pa.Table,
        env: BSPEnv,
        partitioned_by: Sequence[str] | None = None,
        origin: P.Origin | None = None,
    ):
        self._pipe = P.Pipeline(table)
        self.env = env
        # Set when rows are hash-partitioned by these columns (after a shuffle, a shuffled
        # merge or a groupby): a later operator on the same keys skips its shuffle.
        self.partitioned_by: tuple[str, ...] | None = tuple(partitioned_by) if partitioned_by else None
        # Other names of the same placement: after an inner join on l = r the rows are placed by
        # r as much as by l (equal values), so a later group-by on r needs no exchange either.
        self._aliases: tuple[tuple[str, ...], ...] = ()
        self._origin = origin  # the distributed operator that made the table (for explain)
        self._fusions = 0  # operators whose query ran the pending steps (see _sql_input)
        self._reads = 0  # frames derived from this one, and operators that fused it (see _read)

    @classmethod
    def lazy(cls, source: P.Source, env: BSPEnv, partitioned_by: Sequence[str] | None = None) -> DataFrame:
        """A frame whose rows a ``source`` (a file scan) yields when they are needed."""
        df = cls(source.schema.empty_table(), env, partitioned_by)
        df._pipe = P.Pipeline(source)
        return df

    @property
    def _table(self) -> pa.Table:
        """This rank's rows: the pending pipeline runs once (and is replaced by its result)."""
        if self._pipe.pending:
            start = time.perf_counter()
            self._made(self._pipe.run(), start)
        return self._pipe.source

    def _made(self, rows: pa.Table, start: float) -> None:
        """The pending pipeline ran (since ``start``) into ``rows``: they replace it."""
        origin = self._node()
        self._pipe = P.Pipeline(rows)
        origin.seconds = time.perf_counter() - start
        self._origin = origin

    def compute(self) -> DataFrame:
        """Run the pending local work now (it otherwise runs when rows are needed); the same
        frame, its rows materialized.  ``persist()`` is the same."""
        self._table  # noqa: B018 - materializes
        return self

    persist = compute

    def _sql_input(self, columns: Sequence[str]) -> Any:
        """This rank's rows of ``columns`` for a DuckDB query: the pending pipeline as a
        ``plan_sql.SqlInput`` the query fuses (no copy of the rows made first), or None where
        nothing is pending, a step has no SQL form, or an operator fused the pipeline already
        (then ``to_arrow()``: a frame read by several operators makes its rows once, at the
        second read, instead of running its steps in each).  The frame stays pending until
        then; explain shows the pipeline under the operator that fused it.  An operator that
        uses the input says so with ``_fused()``.  Steps that hold a join make their rows at
        the first operator's read instead: another read would join again (TPC-H Q2 reads its
        joined frame in a group-by, then joins it with the group-by's result)."""
        if self._pipe.costly:
            self.compute()
        return self._pipe.sql_input(columns) if self._pipe.pending and not self._fusions else None

    def _fused(self) -> None:
        """An operator's query ran this frame's pending steps (``_sql_input``).  Every rank
        runs the same operators on the same frames: they count alike."""
        self._fusions += 1
        self._reads += 1

    def _read(self) -> None:
        """Before a second reader of pending steps that are costly to repeat (a join: each
        frame derived from this one, and each operator fusing it, would run it again), this
        frame makes its rows once; filters and projections stay pending (they fuse into what
        reads them).  Every rank derives and reads the same frames: they count alike."""
        if self._reads and self._pipe.costly:
            self.compute()

    def _rows_of(self, columns: Sequence[str]) -> pa.Table:
        """This rank's rows of ``columns`` alone.  Over a source that keeps what it read (a
        stored dataset: ``store.scan.StoreScan``) the pending pipeline runs for those columns
        (the source reads only the ones it has not yet; the frame stays pending); otherwise the
        frame's rows (materialized once) are selected from."""
        if self._pipe.pending and getattr(self._pipe.source, "keeps_columns", False):
            return self.select(list(columns)).to_arrow()
        return self._table.select(list(columns))

    def _rows_masked(self, columns: Sequence[str]) -> tuple[pa.Table, Any]:
        """This rank's rows of ``columns`` and a mask of those to use (None: all), for an
        aggregation: where the pending pipeline's last filter keeps most rows it comes back as
        the mask, not applied (``Pipeline.run_deferring``); the frame stays pending, read
        once as ``_sql_input`` reads it.  Otherwise ``_rows_of`` (the frame's rows made)."""
        if self._pipe.pending and not self._fusions:
            start = time.perf_counter()
            got = self._pipe.run_deferring()
            if got is not None and got[1] is not None:
                self._fused()
                return got[0].select(list(columns)), got[1]
            if got is not None:  # the filter applied: the frame's rows, made as _table makes them
                self._made(got[0], start)
        return self._rows_of(columns), None

    def _carried(self, name: str) -> str | None:
        """The source column (of the pending pipeline) that column ``name`` is, if unchanged."""
        return self._pipe.carried(name)

    def _then(
        self, step: P.Step, schema: pa.Schema, changed: Iterable[str] = (), renames: Mapping[str, str] | None = None
    ) -> DataFrame:
        """A frame with one more pending local step (rows stay on their ranks)."""
        self._read()
        self._reads += 1
        placed, aliases = self._kept_placements(schema.names, changed, renames)
        df = DataFrame(pa.table({}), self.env, placed, self._origin)
        df._aliases = aliases
        df._pipe = self._pipe.then(step, schema)
        return df

    def _node(self) -> P.Origin:
        """How this frame's rows are (or will be) made, for ``explain``."""
        if self._origin is not None and not self._pipe.pending:
            return self._origin
        lines = self._pipe.describe()
        joined = [s.made_by for s in self._pipe.steps if isinstance(s, P.Join) and s.made_by is not None]
        if self._origin is None:
            return P.Origin(lines, joined)
        return P.Origin(lines[:-1], [self._origin, *joined])  # the table is what the origin made

    def explain(self, file: Any = None, times: bool = False) -> str:
        """This frame's plan: the distributed operators that made it (exchanges marked) and
        the pending local pipeline, output first; printed (to ``file``) and returned.  With
        ``times``, each operator that ran says how long it took on this rank, ``[12.3 ms]``
        (its inputs made before it; waits for slower ranks included: an operator that shows
        more time on one rank than on the others waited there for them)."""
        text = "\n".join(self._node().render(times=times))
        print(text, file=file)
        return text

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_arrow(cls, table: pa.Table | pa.RecordBatch, env: BSPEnv) -> DataFrame:
        """This rank's partition from an Arrow table (collective: ranks agree on the schema)."""
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise TypeError(f"from_arrow needs a pyarrow.Table, got {type(table).__name__}")
        return cls(agree_schema(env.comm, table, "from_arrow"), env)

    @classmethod
    def from_pandas(cls, frame: pd.DataFrame, env: BSPEnv, preserve_index: bool = False) -> DataFrame:
        return cls.from_arrow(pa.Table.from_pandas(frame, preserve_index=preserve_index), env)

    def _new(
        self,
        table: pa.Table,
        partitioned_by: Sequence[str] | None = None,
        op: str | None = None,
        *inputs: DataFrame,
        aliases: Sequence[Sequence[str]] = (),
    ) -> DataFrame:
        """A frame of rows a distributed operator ``op`` made from this frame (and ``inputs``),
        placed by ``partitioned_by`` (and, equally, by each of ``aliases``)."""
        label, *notes = op.split("\n") if op else [""]
        seconds = getattr(op, "seconds", None)
        origin = P.Origin([label], [f._node() for f in (self, *inputs)], notes, seconds) if op else None
        df = DataFrame(table, self.env, partitioned_by, origin)
        names = set(table.column_names)
        if partitioned_by:
            df._aliases = tuple(tuple(a) for a in aliases if set(a) <= names and tuple(a) != tuple(partitioned_by))
        return df

    def _placements(self) -> tuple[tuple[str, ...], ...]:
        """Every column tuple this frame's rows are hash-placed by (the first is ``partitioned_by``)."""
        return (self.partitioned_by, *self._aliases) if self.partitioned_by else ()

    def _placed_by(self, keys: Sequence[str]) -> tuple[str, ...] | None:
        """A placement under which rows with equal ``keys`` are already on one rank, if any."""
        return next((p for p in self._placements() if C.colocated(p, keys)), None)

    def _run(self, op: str, fn: Callable[[], Any], *inputs: DataFrame, fuses: bool = False) -> tuple[Any, str]:
        """Run a distributed operator's ``fn`` (its inputs' pending work first, so that their
        plans are described as they ran, unless the operator ``fuses`` this frame's pipeline
        into its own query), and ``op`` with the exchanges it noted."""
        for f in (*(() if fuses else (self,)), *inputs):
            f.compute()
        start = time.perf_counter()
        with P.recording() as notes:
            result = fn()
        return result, P.Timed.of("\n".join([op, *notes]), time.perf_counter() - start)

    def _keeping(
        self, table: pa.Table, changed: Iterable[str] = (), renames: Mapping[str, str] | None = None
    ) -> DataFrame:
        """A frame whose rows stayed on their ranks: still partitioned unless a key changed."""
        placed, aliases = self._kept_placements(table.column_names, changed, renames)
        df = DataFrame(table, self.env, placed, self._origin)
        df._aliases = aliases
        return df

    def _kept_placements(
        self, names: Sequence[str], changed: Iterable[str] = (), renames: Mapping[str, str] | None = None
    ) -> tuple[tuple[str, ...] | None, tuple[tuple[str, ...], ...]]:
        """(partitioned_by, aliases) after a local step; an alias takes over when the first
        placement's columns are gone or changed."""
        kept = [k for k in (_kept(p, names, changed, renames) for p in self._placements()) if k is not None]
        return (kept[0], tuple(kept[1:])) if kept else (None, ())

    # ---- inspection ---------------------------------------------------------------------
    @property
    def schema(self) -> pa.Schema:
        return self._pipe.schema

    @property
    def columns(self) -> list[str]:
        return self._pipe.schema.names

    @property
    def local_num_rows(self) -> int:
        return self._table.num_rows

    @property
    def num_rows(self) -> int:
        """Rows over all ranks (collective)."""
        return int(self.env.comm.allreduce_scalar(self._table.num_rows))

    def partition_sizes(self) -> list[int]:
        """Rows on each rank (collective)."""
        counts = np.zeros(self.env.world_size, dtype=np.int64)
        counts[self.env.rank] = self._table.num_rows
        return self.env.comm.allreduce(counts).tolist()

    def to_arrow(self) -> pa.Table:
        """This rank's partition."""
        return self._table

    def to_pandas(self) -> pd.DataFrame:
        """This rank's partition as pandas."""
        return self._table.to_pandas()

    def collect(self, root: int | None = None, limit: int | None = None) -> pa.Table | None:
        """The whole frame in rank order: on every rank, or only on ``root`` (None elsewhere).
        ``limit``: only its first rows (a preview: no more than those travel)."""
        if limit is not None:  # a look at a big frame, e.g. from a notebook
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"collect: limit must be an integer ≥ 0, got {limit!r}")
            return self.head(limit).collect(root)
        comm = self.env.comm
        if root is None:
            return concat(allgather_tables(comm, self._table), self.schema)
        return gather_tables(comm, self._table, root)

    def __repr__(self) -> str:
        return (
            f"<phalanx.DataFrame rank {self.env.rank}/{self.env.world_size}: "
            f"{self._table.num_rows} local rows, columns {self.columns}>"
        )

    # ---- local operators ----------------------------------------------------------------
    def select(self, columns: str | Sequence[str]) -> DataFrame:
        cols = as_list(columns)
        check_columns(self.schema, cols, "select")
        return self._then(P.passthrough(cols), pa.schema([self.schema.field(c) for c in cols]))

    def __getitem__(self, columns: str | Sequence[str]) -> DataFrame:
        return self.select(columns)

    def drop(self, columns: str | Sequence[str]) -> DataFrame:
        cols = as_list(columns)
        check_columns(self.schema, cols, "drop")
        keep = [c for c in self.columns if c not in cols]
        return self._then(P.passthrough(keep), pa.schema([self.schema.field(c) for c in keep]))

    def rename(self, columns: Mapping[str, str]) -> DataFrame:
        check_columns(self.schema, list(columns), "rename")
        renames = dict(columns)
        schema = pa.schema([f.with_name(renames.get(f.name, f.name)) for f in self.schema])
        return self._then(P.passthrough(self.columns, renames), schema, renames=renames)

    def filter(self, condition: pc.Expression | TableFn) -> DataFrame:
        """Keep rows where ``condition`` holds: an Arrow expression (``pc.field("x") > 3``)
        or a callable returning a boolean mask for the local table."""
        if isinstance(condition, pc.Expression):
            try:  # bound now, on no rows: a bad column or type fails here, not later
                self.schema.empty_table().filter(condition)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise _expression_error(exc, "filter", self.schema) from None
            return self._then(P.Filter(condition, P.references(condition, self.schema)), self.schema)
        if callable(condition):
            return self._keeping(self._table.filter(condition(self._table)))
        raise TypeError(f"filter needs a pyarrow.compute.Expression or a callable, got {condition!r}")

    def assign(self, **columns: pc.Expression | TableFn | Any) -> DataFrame:
        """Add or replace columns: Arrow expressions, callables on the local table, arrays
        of the local length, or scalars."""
        if all(isinstance(v, pc.Expression) or _is_scalar(v) for v in columns.values()):
            return self._assign_lazy(columns)
        table = self._table
        for name, value in columns.items():
            if isinstance(value, pc.Expression):
                try:
                    value = P.evaluate(table, value)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                    raise _expression_error(exc, f"assign({name}=...)", table.schema) from None
            elif callable(value):
                value = value(table)
            if not isinstance(value, (pa.Array, pa.ChunkedArray, np.ndarray, list)):
                value = pa.repeat(pa.scalar(value), table.num_rows)
            idx = table.schema.get_field_index(name)
            table = table.set_column(idx, name, value) if idx >= 0 else table.append_column(name, value)
        return self._keeping(table, changed=columns)

    def _assign_lazy(self, columns: Mapping[str, Any]) -> DataFrame:
        """``assign`` of expressions and scalars as one projection step (checked now, on no rows)."""
        schema, empty = self.schema, self.schema.empty_table()
        outputs = {n: P.Output(n, pc.field(n), frozenset([n]), n) for n in schema.names}
        fields = {f.name: f for f in schema}
        for name, value in columns.items():
            expr = value if isinstance(value, pc.Expression) else pc.scalar(value)
            try:
                kind = P.evaluate(empty, expr).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise _expression_error(exc, f"assign({name}=...)", schema) from None
            outputs[name] = P.computed(name, expr, schema)
            fields[name] = pa.field(name, kind)
        step = P.Project(tuple(outputs.values()))
        return self._then(step, pa.schema(list(fields.values())), changed=columns)

    def head(self, n: int = 5) -> DataFrame:
        """The first ``n`` rows of the whole frame, in rank order (collective)."""
        counts = self.partition_sizes()
        before = sum(counts[: self.env.rank])
        keep = max(0, min(self._table.num_rows, n - before))
        return self._keeping(self._table.slice(0, keep))

    def map_partitions(self, fn: Callable[[pa.Table], Any]) -> DataFrame:
        """Apply ``fn`` to the local partition; it may return Arrow, pandas or polars."""
        return self._new(_to_table(fn(self._table)))

    # arithmetic with scalars, pandas-style: every numeric column unless ``columns`` is given
    def _arith(self, fn: Callable, value: Any, columns: str | Sequence[str] | None, op: str) -> DataFrame:
        cols = as_list(columns) or [
            f.name for f in self.schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)
        ]
        check_columns(self.schema, cols, op)
        return self.assign(**{c: fn(pc.field(c), value) for c in cols})

    def add(self, value: Any, columns: str | Sequence[str] | None = None) -> DataFrame:
        return self._arith(pc.add, value, columns, "add")

    add_scalar = add  # CylonFlow's name

    def sub(self, value: Any, columns: str | Sequence[str] | None = None) -> DataFrame:
        return self._arith(pc.subtract, value, columns, "sub")

    def mul(self, value: Any, columns: str | Sequence[str] | None = None) -> DataFrame:
        return self._arith(pc.multiply, value, columns, "mul")

    def truediv(self, value: Any, columns: str | Sequence[str] | None = None) -> DataFrame:
        return self._arith(lambda a, v: pc.divide(a.cast(pa.float64()), v), value, columns, "truediv")

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = truediv

    # ---- distributed operators ----------------------------------------------------------
    def shuffle(self, on: str | Sequence[str]) -> DataFrame:
        """Hash-partition rows by ``on``: equal keys end on the same rank (collective)."""
        from .shuffle import shuffle_table

        keys = as_list(on)
        check_columns(self.schema, keys, "shuffle")
        table, op = self._run(f"Shuffle by {keys}", lambda: shuffle_table(self.env.comm, self._table, keys))
        return self._new(table, keys, op)

    def repartition(self) -> DataFrame:
        """Balance rows over the ranks, keeping the global row order (collective)."""
        comm = self.env.comm
        counts = np.array(self.partition_sizes(), dtype=np.int64)
        bounds = balanced_bounds(int(counts.sum()), comm.world_size)
        start = int(counts[: comm.rank].sum())
        parts = []
        for dest in range(comm.world_size):
            lo = max(start, int(bounds[dest]))
            hi = min(start + self._table.num_rows, int(bounds[dest + 1]))
            parts.append(self._table.slice(lo - start, max(0, hi - lo)))
        P.note(f"Exchange contiguous slices: {P.rows(self._table)}")
        return self._new(concat(exchange_tables(comm, parts, self.schema), self.schema), None, "Repartition (balanced)")

    def merge(
        self,
        right: DataFrame,
        on: str | Sequence[str] | None = None,
        how: str = "inner",
        left_on: str | Sequence[str] | None = None,
        right_on: str | Sequence[str] | None = None,
        suffixes: tuple[str, str] = ("_x", "_y"),
        broadcast: bool | None = None,
    ) -> DataFrame:
        """pandas-style join (collective); see ``phalanx.operators.join``.  ``how``: inner, left,
        right, outer; or semi / anti: the left's rows that have / have no match (SQL's IN / NOT IN
        a subquery), the left's columns only, null keys matching each other as in every merge."""
        from .join import merge, pending_join, pending_join_into_right, right_by_left_key_sets, semi_join_through_right

        keys = {"on": on, "how": how, "left_on": left_on, "right_on": right_on, "broadcast": broadcast}
        what = f"Merge {how} on {on if on is not None else (left_on, right_on)}"
        # right rows whose key the left's rows were already filtered out of are dropped first
        right = right_by_left_key_sets(self, right, **keys)
        # few left keys against a right side still to be filtered: only the keys move
        reduction = semi_join_through_right(self, right, **keys)
        if reduction is not None:
            table, op = self._run(what, reduction)
            return self._new(table, self.partitioned_by, op, right, aliases=self._aliases)
        # a small left side goes to every rank now; the join waits in the right's pipeline,
        # whose filter then keeps only rows with a match.  A left with a join pending is
        # sized only by making it: a small right that has a join of its own to make first may
        # join in the left's pipeline instead (TPC-H Q7's orders meet the lines, then the
        # customers of two nations, in one pass)
        joins_pending = self._pipe.pending and self._pipe.costly and right._pipe.costly
        into_right = None if joins_pending else pending_join_into_right(self, right, **keys)
        if into_right is not None:
            step, order = into_right
            return right._then(step, step.output_schema(right.schema)).select(order)
        # a small right side goes to every rank now; the join waits in this frame's pipeline
        pending = pending_join(self, right, **keys)
        if pending is not None:
            return self._then(pending, pending.output_schema(self.schema))
        into_right = pending_join_into_right(self, right, **keys) if joins_pending else None
        if into_right is not None:
            step, order = into_right
            return right._then(step, step.output_schema(right.schema)).select(order)
        (table, partitioned_by, aliases), op = self._run(
            what,
            lambda: merge(
                self, right, on=on, how=how, left_on=left_on, right_on=right_on, suffixes=suffixes, broadcast=broadcast
            ),
            right,
        )
        return self._new(table, partitioned_by, op, right, aliases=aliases)

    def groupby(self, by: str | Sequence[str], dropna: bool = True, combine: bool | None = None) -> GroupBy:
        from .groupby import GroupBy

        return GroupBy(self, as_list(by), dropna=dropna, combine=combine)

    def agg(self, spec: Mapping[str, Any] | None = None, **named: Any) -> DataFrame:
        """Aggregates over the whole frame, without keys (collective): a one-row frame held by
        rank 0.  ``spec`` and ``named`` as in ``groupby(...).agg``: ``agg({"v": "sum"})``,
        ``agg(revenue=("price", "sum"), n=(None, "size"))``."""
        from .groupby import aggregate_all, check_outputs, parse_spec

        aggs = parse_spec(spec, named)
        check_columns(self.schema, [a.column for a in aggs if a.column], "agg")
        check_outputs(aggs, [], "agg")
        table, op = self._run(
            "Aggregate " + ", ".join(str(a) for a in aggs),
            lambda: aggregate_all(self, aggs),
            fuses=True,
        )
        return self._new(table, None, op)

    def sort_values(
        self, by: str | Sequence[str], ascending: bool | Sequence[bool] = True, limit: int | None = None
    ) -> DataFrame:
        """Global sort by sample sort: rank 0 holds the smallest rows (collective).

        ``limit=k`` keeps only the first k rows of the sorted frame — the same rows as
        ``sort_values(...).head(k)``, ties in frame order — as a top-k: every rank keeps its best
        k, rank 0 picks from P·k rows and holds the result; nothing else moves."""
        from .sort import sort_values, top_k

        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"sort_values: limit must be a count of rows (an int >= 0), got {limit!r}")
            table, op = self._run(
                f"TopK {limit} by {as_list(by)} (rank 0 picks from each rank's best)",
                lambda: top_k(self, as_list(by), ascending, limit),
            )
            return self._new(table, None, op)
        table, op = self._run(
            f"Sort by {as_list(by)} (sample sort: Exchange by ranges)",
            lambda: sort_values(self, as_list(by), ascending),
        )
        return self._new(table, None, op)

    def nlargest(self, n: int, columns: str | Sequence[str]) -> DataFrame:
        """The ``n`` rows with the largest ``columns`` (pandas' nlargest, keep='first'), on rank 0."""
        return self.sort_values(columns, ascending=False, limit=n)

    def nsmallest(self, n: int, columns: str | Sequence[str]) -> DataFrame:
        """The ``n`` rows with the smallest ``columns`` (pandas' nsmallest, keep='first'), on rank 0."""
        return self.sort_values(columns, ascending=True, limit=n)

    def drop_duplicates(self, subset: str | Sequence[str] | None = None, keep: str | bool = "first") -> DataFrame:
        """Remove duplicate rows over the whole frame (collective); ``keep`` as in pandas."""
        from .distinct import drop_duplicates

        cols = as_list(subset) or self.columns
        check_columns(self.schema, cols, "drop_duplicates")
        placed = self._placed_by(cols)
        table, op = self._run(
            f"Distinct on {cols}" + (" (no exchange: already partitioned by them)" if placed else ""),
            lambda: drop_duplicates(self.env.comm, self._table, cols, keep, placed is not None),
        )
        return self._new(table, placed or cols, op)

    # ---- windows, time-series joins, reshaping (each in its own module) -----------------
    def window(
        self,
        order_by: str | Sequence[str] | None = None,
        partition_by: str | Sequence[str] | None = None,
        ascending: bool | Sequence[bool] = True,
        **outputs: Any,
    ) -> DataFrame:
        """Window functions over ``partition_by`` + ``order_by`` (collective); see
        ``phalanx.operators.window``: ``df.window(order_by="t", partition_by="k",
        n=("row_number",), total=("v", "cumsum"), prev=("v", "lag", 1))``."""
        from .window import window

        return window(self, order_by=order_by, partition_by=partition_by, ascending=ascending, outputs=outputs)

    def merge_asof(
        self,
        right: DataFrame,
        on: str,
        by: str | Sequence[str] | None = None,
        tolerance: Any = None,
        direction: str = "backward",
        suffixes: tuple[str, str] = ("_x", "_y"),
        broadcast: bool | None = None,
        left_by: str | Sequence[str] | None = None,
        right_by: str | Sequence[str] | None = None,
        allow_exact_matches: bool = True,
    ) -> DataFrame:
        """pandas' ``merge_asof`` (collective): each left row joined with the right row of the
        same ``by`` keys (or ``left_by`` = ``right_by``) whose ``on`` is the nearest earlier (or
        equal, unless ``allow_exact_matches=False``); see ``phalanx.operators.asof``.
        ``broadcast``: replicate the right side (True), never (False), or when it is small (None)."""
        from .asof import merge_asof

        return merge_asof(
            self,
            right,
            on=on,
            by=by,
            tolerance=tolerance,
            direction=direction,
            suffixes=suffixes,
            broadcast=broadcast,
            left_by=left_by,
            right_by=right_by,
            allow_exact_matches=allow_exact_matches,
        )

    def value_counts(
        self,
        subset: str | Sequence[str] | None = None,
        normalize: bool = False,
        sort: bool = True,
        ascending: bool = False,
        dropna: bool = True,
    ) -> DataFrame:
        """Rows per distinct value of ``subset`` (collective), pandas' ``value_counts`` as a frame
        with a ``count`` (or ``proportion``) column; see ``phalanx.operators.reshape``."""
        from .reshape import value_counts

        return value_counts(self, subset, normalize=normalize, sort=sort, ascending=ascending, dropna=dropna)

    def pivot(
        self,
        index: str | Sequence[str],
        columns: str,
        values: str | Sequence[str],
        aggfunc: str = "sum",
        fill_value: Any = None,
    ) -> DataFrame:
        """A pivot table (collective): one row per ``index``, one column per distinct value of
        ``columns`` (a small number of them), missing cells ``fill_value`` (default null); see
        ``phalanx.operators.reshape``."""
        from .reshape import pivot

        return pivot(self, index, columns, values, aggfunc=aggfunc, fill_value=fill_value)

    def concat(self, *others: DataFrame) -> DataFrame:
        """The union of this frame's rows and ``others``' (collective: columns matched by name);
        ``px.concat([a, b, c])`` is the same; see ``phalanx.operators.reshape``."""
        from .reshape import concat_frames

        return concat_frames([self, *others])

    # ---- output -------------------------------------------------------------------------
    def write_parquet(self, directory: str, **options: Any) -> str:
        """One file per rank, ``directory/part-00000.parquet``... (collective)."""
        from .io import write_parquet

        return write_parquet(self, directory, **options)


def _kept(
    keys: tuple[str, ...] | None, names: Sequence[str], changed: Iterable[str], renames: Mapping[str, str] | None
) -> tuple[str, ...] | None:
    """Placement keys after a local step: renamed with their columns, lost if one changed or
    is gone."""
    if keys is None or set(keys) & set(changed):
        return None
    keys = tuple((renames or {}).get(k, k) for k in keys)
    return keys if set(keys) <= set(names) else None


def _to_table(value: Any) -> pa.Table:
    if isinstance(value, pa.Table):
        return value
    if isinstance(value, pa.RecordBatch):
        return pa.Table.from_batches([value])
    if hasattr(value, "to_arrow"):  # polars
        return value.to_arrow()
    if type(value).__module__.startswith("pandas"):
        return pa.Table.from_pandas(value, preserve_index=False)
    raise TypeError(f"map_partitions: the function must return a table, got {type(value).__name__}")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, bytes, pa.Scalar)) or np.isscalar(value)


def _expression_error(exc: Exception, op: str, schema: pa.Schema) -> Exception:
    """Arrow's "No match for FieldRef" as a KeyError naming the operator and the columns."""
    msg = str(exc).splitlines()[0]
    if "No match for FieldRef" in msg:
        return KeyError(f"{op}: {msg}; columns are {schema.names}")
    return type(exc)(f"{op}: {msg}")
