"""A rank's pending local work, planned before it runs.

Local operators (``select``, ``drop``, ``rename``, ``filter`` and ``assign`` with Arrow
expressions, arithmetic with scalars) do not touch rows when called: they append a step to the
frame's pipeline, whose output schema is computed at once on an empty table (so a bad column or
expression fails at the call, as it always did).  The pipeline runs when rows are needed — a
distributed operator, ``to_arrow``, ``collect``, ``num_rows``, ``compute()`` — as one pass:

- **projection pushdown**: each step keeps only the columns that a later step or the output
  uses, and a file scan reads only those (Parquet column chunks not needed are never read);
- **filter pushdown**: filters that only read columns passed through unchanged since the scan
  go into the scan itself, where Parquet row-group statistics skip whole row groups;
- **fusion**: what remains runs as one Acero plan (filter and project nodes over the batches
  of the source, Arrow in and out), not one full-table pass per operator.

Callables (``filter(fn)``, ``assign(x=fn)``, ``map_partitions``) are opaque: the pipeline
before them runs, then they do.  ``DataFrame.explain()`` prints the plan.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class Source(Protocol):
    """Where a lazy pipeline's rows come from: a file scan or a stored dataset, that can read
    fewer columns (and, where ``pushes_filters``, rows) than it holds.  A source whose
    ``pushes_filters`` is False is given no filters: the pipeline applies them."""

    schema: pa.Schema
    pushes_filters: bool

    def read(self, columns: list[str], filters: Sequence[pc.Expression]) -> pa.Table: ...

    def describe(self, columns: list[str], filters: Sequence[pc.Expression]) -> str: ...


@dataclass(frozen=True)
class Filter:
    expr: pc.Expression
    refs: frozenset[str]  # the columns it reads

    def describe(self) -> str:
        return f"Filter {self.expr}"


@dataclass(frozen=True)
class Output:
    """One column a projection makes: ``expr`` reads ``refs``; ``passes`` names the input
    column it carries unchanged (a select, a rename, a kept column), None for a computed one."""

    name: str
    expr: pc.Expression
    refs: frozenset[str]
    passes: str | None = None


@dataclass(frozen=True)
class Project:
    outputs: tuple[Output, ...]

    def describe(self) -> str:
        shown = [o.name if o.passes == o.name else f"{o.name} := {o.expr}" for o in self.outputs]
        return f"Project [{', '.join(shown)}]"


@dataclass(frozen=True, eq=False)
class Join:
    """A join with a table this rank holds whole (a broadcast side, or the right's distinct
    keys for semi/anti): the left's rows stay where they are, so the join is local work that
    fuses with the steps around it.  Null keys match each other (as every merge).  Outputs
    ``left_out`` (left columns, unchanged) then ``right_out`` (the table's, none named like a
    left column); semi and anti output no right column."""

    table: pa.Table
    left_on: tuple[str, ...]
    right_on: tuple[str, ...]
    how: str  # inner, left, semi, anti
    left_out: tuple[str, ...]
    right_out: tuple[str, ...]
    exchange: str = ""  # how the table came to every rank, for explain
    made_by: Origin | None = None  # the plan of the frame the table came from, for explain
    partial: bool = False  # the table holds only the rows this rank's rows can match (not all)

    @property
    def refs(self) -> frozenset[str]:
        """The left columns it reads (its keys) besides those it carries."""
        return frozenset(self.left_on)

    def output_schema(self, left: pa.Schema) -> pa.Schema:
        right = [self.table.schema.field(c) for c in self.right_out]
        if self.how == "left":  # unmatched rows get nulls, whatever the table declares
            right = [f.with_nullable(True) for f in right]
        return pa.schema([left.field(c) for c in self.left_out] + right)

    def pruned(self, live: set[str]) -> Join:
        return Join(
            self.table,
            self.left_on,
            self.right_on,
            self.how,
            tuple(c for c in self.left_out if c in live),
            tuple(c for c in self.right_out if c in live),
            self.exchange,
            self.made_by,
            self.partial,
        )

    def describe(self) -> str:
        on = ", ".join(f"{a} = {b}" if a != b else a for a, b in zip(self.left_on, self.right_on))
        where = "the rows this rank's can match" if self.partial else "a table on every rank"
        line = f"Join {self.how} on {on} with {where} ({self.table.num_rows} rows)"
        return f"{line}: {self.exchange}" if self.exchange else line


Step = Filter | Project | Join


@dataclass
class Origin:
    """A node of ``explain``'s tree: what an operator did (lines, output first) over its inputs."""

    lines: list[str]  # a chain: each line's input is the next line
    inputs: list[Origin]
    notes: list[str] = field(default_factory=list)  # what the last line's operator did, in order
    seconds: float | None = None  # how long the lines took on this rank (their inputs made first)

    def render(self, depth: int = 0, times: bool = False, shown: set[int] | None = None) -> list[str]:
        """The lines, indented by ``depth``; a node that made a frame several operators read
        (TPC-H Q21 reads one semi merge three times) is shown in full once, then by its first
        line and "(shown above)"."""
        shown = set() if shown is None else shown
        if id(self) in shown and self.lines:
            return ["  " * depth + self.lines[0] + " (shown above)"]
        if self.inputs or self.notes:
            shown.add(id(self))
        out = []
        for i, line in enumerate(self.lines):
            took = f"  [{self.seconds * 1e3:.1f} ms]" if times and i == 0 and self.seconds is not None else ""
            out.append("  " * depth + line + took)
            depth += 1
        out += ["  " * depth + "· " + n for n in self.notes]
        for child in self.inputs:
            out += child.render(depth, times, shown)
        return out


class Timed(str):
    """An operator's description that carries how long it ran on this rank (``explain(times=True)``)."""

    seconds: float | None = None

    @classmethod
    def of(cls, text: str, seconds: float) -> Timed:
        op = cls(text)
        op.seconds = seconds
        return op


@dataclass
class Pipeline:
    """The steps after a source (a table or a scan), and the schema they produce."""

    source: pa.Table | Source
    steps: tuple[Step, ...] = ()
    schema: pa.Schema = field(default=None)

    def __post_init__(self) -> None:
        if self.schema is None:
            self.schema = self.source.schema

    @property
    def pending(self) -> bool:
        return bool(self.steps) or not isinstance(self.source, pa.Table)

    @property
    def costly(self) -> bool:
        """Whether running the steps again costs more than keeping their rows (a join)."""
        return any(isinstance(s, Join) for s in self.steps)

    def then(self, step: Step, schema: pa.Schema) -> Pipeline:
        return Pipeline(self.source, (*self.steps, step), schema)

    # ---- planning ---------------------------------------------------------------------------
    def optimized(self) -> tuple[list[str], list[pc.Expression], list[Step]]:
        """(the columns to read from the source, the filters pushed into it, the steps left),
        projections pruned to the columns later steps use."""
        steps = list(self.steps)
        pushed: list[pc.Expression] = []
        if not isinstance(self.source, pa.Table) and self.source.pushes_filters:
            steps, pushed = _push_filters(steps)
        steps = _prune(steps, list(self.schema.names))
        needed = _needed(steps, list(self.schema.names))
        columns = [c for c in self.source.schema.names if c in needed]
        return columns, pushed, steps

    def run(self) -> pa.Table:
        columns, pushed, steps = self.optimized()
        if isinstance(self.source, pa.Table):
            table = self.source.select(columns) if len(columns) < self.source.num_columns else self.source
        else:
            table = self.source.read(columns, pushed)
        if not steps:
            return table
        if any(isinstance(s, Join) for s in steps):
            return _joined(table, steps, self.schema)
        compiled = _in_polars(table.schema, steps)
        return compiled.run(table) if compiled is not None else _acero(table, steps)

    def sql_input(self, wanted: Sequence[str]) -> Any:
        """The pending steps over an in-memory table as a ``plan_sql.SqlInput`` of the ``wanted``
        columns (the table's columns they read, and the steps as SQL) to be fused into a DuckDB
        query; None when nothing is pending, the source is a scan, or a step has no SQL form."""
        # a scan source is left to run(): a frame read once is then reused from memory, where
        # a fused scan would decode the file again for every operator that reads the frame
        if not self.steps or _engine_setting() == "acero" or not isinstance(self.source, pa.Table):
            return None
        steps = _prune(list(self.steps), list(wanted))
        needed = _needed(steps, list(wanted))
        columns = [c for c in self.source.schema.names if c in needed]
        schema = pa.schema([self.source.schema.field(c) for c in columns])
        select = _as_sql(schema, steps, wanted)
        if select is None:
            return None
        from .plan_sql import SqlInput

        table = self.source.select(columns) if len(columns) < self.source.num_columns else self.source
        joined = tuple(s.table for s in steps if isinstance(s, Join))
        return SqlInput(table, select, pa.schema([self.schema.field(c) for c in wanted]), joined)

    def run_deferring(self) -> tuple[pa.Table, pa.ChunkedArray | None] | None:
        """The rows with the last filter not applied where it keeps most rows (at least
        ``DEFERRED_SHARE`` of them): (the rows, the filter's mask) — an aggregation then leaves
        the masked-out rows out of its groups, and no row is copied.  (the rows, None) where
        it keeps fewer: the pipeline's output as ``run`` makes it.  None where the steps cannot
        run so (a scan or a join, no filter, a step after the filter that could fail on a row
        it drops, no Polars form).

        Why: TPC-H Q1's filter keeps 98% of a rank's 3M rows, and copying them (seven columns,
        40 ms) cost more than any other step but the aggregation."""
        if not isinstance(self.source, pa.Table) or self.costly or _engine_setting() != "polars":
            return None
        wanted = list(self.schema.names)
        steps = _prune(list(self.steps), wanted)
        at = max((i for i, s in enumerate(steps) if isinstance(s, Filter)), default=None)
        if at is None or not all(_total(s) for s in steps[at + 1 :]):
            return None
        columns = [c for c in self.source.schema.names if c in _needed(steps, wanted)]
        table = self.source.select(columns) if len(columns) < self.source.num_columns else self.source
        if at:
            before = _in_polars(table.schema, steps[:at])
            if before is None:
                return None
            table = before.run(table)
        tail = steps[at + 1 :]
        after = _in_polars(table.schema, tail) if tail else None
        masking = _in_polars(table.schema, steps[at : at + 1]) if after is not None or not tail else None
        mask = masking.mask(table, DEFERRED_SHARE) if masking is not None else None
        if mask is None:  # the filter applied (Acero's steps after it only see the rows it keeps)
            rest = steps[at:]
            compiled = _in_polars(table.schema, rest)
            table = compiled.run(table) if compiled is not None else _acero(table, rest)
        else:
            kept = pc.sum(mask).as_py() or 0
            note(f"filter as a mask, no rows copied: {kept} of {table.num_rows} rows kept")
            table = after.run(table) if after is not None else table
        return table.select(wanted), mask

    def carried(self, name: str) -> str | None:
        """The source column that output column ``name`` is (renamed or not), None if computed."""
        for step in reversed(self.steps):
            if isinstance(step, Join) and name not in step.left_out:
                return None  # the joined table's
            if isinstance(step, Project):
                passed = _passed(step, name)
                if passed is None:
                    return None
                name = passed
        return name if name in self.source.schema.names else None

    def key_set(self, name: str) -> tuple[Join, str] | None:
        """A join among the steps that keeps only rows whose column ``name`` (as the output
        calls it; carried unchanged since) is one of its table's keys — an inner or semi join
        on that one column — and the table's key column; the latest such, None if none."""
        for step in reversed(self.steps):
            if isinstance(step, Join):
                if name not in step.left_out:
                    return None
                if step.how in ("inner", "semi") and step.left_on == (name,) and not step.partial:
                    return step, step.right_on[0]
            elif isinstance(step, Project):
                passed = _passed(step, name)
                if passed is None:
                    return None
                name = passed
        return None

    def describe(self) -> list[str]:
        """The plan, top (output) first: the steps left after pushdown (with the engine that
        runs them), then the source."""
        columns, pushed, steps = self.optimized()
        lines = [s.describe() for s in reversed(steps)]
        if lines:
            schema = pa.schema([self.source.schema.field(c) for c in columns])
            if any(isinstance(s, Join) for s in steps):
                apart = _apart_in_polars(schema, steps) or _as_sql(schema, steps, self.schema.names) is None
                engine = "steps apart" if apart else "DuckDB"
            else:
                engine = "Polars" if _in_polars(schema, steps) is not None else "Acero"
            lines[0] += f" [{engine}]"
        if isinstance(self.source, pa.Table):
            lines.append(f"Table {self.source.num_rows} rows, columns {columns}")
        else:
            lines.append(self.source.describe(columns, pushed))
        return lines


# the least share of rows a filter keeps for an aggregation to take it as a mask
# (``Pipeline.run_deferring``): each row it keeps costs a copy when applied (about 13 ns a row
# for Q1's seven columns), each row it drops costs the aggregation's pass over it when not
# (about 22 ns a row for Q1's eleven aggregates): even at 0.63
DEFERRED_SHARE = 0.75

# calls whose Polars form (``plan_polars``) cannot fail on any row: a projection of only these
# may run on rows a filter before it drops (arithmetic wraps or gives inf/null; a cast may not)
_TOTAL_CALLS = frozenset(
    {"and_kleene", "or_kleene", "add", "subtract", "multiply", "invert", "negate", "abs", "is_null", "is_valid"}
    | {"year", "month", "day", "if_else", "coalesce", "fill_null", "equal", "not_equal", "less", "less_equal"}
    | {"greater", "greater_equal", "divide", "divide_checked", "add_checked", "subtract_checked"}
    | {"multiply_checked", "is_in", "match_like", "starts_with", "ends_with", "match_substring"}
)


def _total(step: Step) -> bool:
    """Whether a step can run on any row without failing: a projection of total calls."""
    from .exprtree import Node, tree

    def total(n: Node) -> bool:
        return n.kind != "call" or (n.name in _TOTAL_CALLS and all(map(total, n.args)))

    return isinstance(step, Project) and all(o.passes is not None or total(tree(o.expr)) for o in step.outputs)


def _in_polars(schema: pa.Schema, steps: Sequence[Step]) -> Any:
    """The steps compiled for Polars' engine (3-7x faster than Acero on a rank's filters and
    projections, docs/performance.md), or None where an expression has no Polars equivalent
    (Acero runs them) or ``PHALANX_PIPELINE_ENGINE=acero`` says so."""
    from . import plan_polars

    if _engine_setting() == "acero":
        return None
    key = ("polars", tuple((f.name, str(f.type)) for f in schema), tuple(_step_key(s) for s in steps))
    if key not in _COMPILED:
        try:
            _remember(key, plan_polars.compile_steps(schema, steps))
        except plan_polars.Untranslatable:
            _remember(key, None)
    return _COMPILED[key]


def _engine_setting() -> str:
    import os

    from ..runtime.envvars import ENV_PIPELINE_ENGINE

    return os.environ.get(ENV_PIPELINE_ENGINE, "polars")


_COMPILED: dict[tuple, Any] = {}  # compiled pipelines: a query is re-run with the same plan


def _remember(key: tuple, compiled: Any) -> None:
    if len(_COMPILED) >= 512:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = compiled


def _step_key(step: Step) -> tuple:
    """A hashable identity of a step (an Expression is not hashable; its serialization is)."""
    if isinstance(step, Filter):
        return ("filter", _expr_key(step.expr))
    if isinstance(step, Join):  # the SQL names the table, so its schema identifies the step
        kinds = tuple((f.name, str(f.type)) for f in step.table.schema)
        return ("join", step.how, step.left_on, step.right_on, step.left_out, step.right_out, kinds)
    return ("project", tuple((o.name, o.passes, None if o.passes else _expr_key(o.expr)) for o in step.outputs))


def _expr_key(expr: pc.Expression) -> bytes:
    return expr.__reduce__()[1][0].to_pybytes()


# ---- what distributed operators did, for explain ---------------------------------------------
_notes: ContextVar[list[str] | None] = ContextVar("phalanx_plan_notes", default=None)


@contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the ``note``s of the operator run inside (its exchanges and choices); an
    enclosing recording gets them too (an operator built of others did their exchanges)."""
    outer = _notes.get()
    notes: list[str] = []
    token = _notes.set(notes)
    try:
        yield notes
    finally:
        _notes.reset(token)
        if outer is not None:
            outer.extend(notes)


def noting() -> bool:
    """Whether an operator's notes are being recorded (callers skip building them otherwise)."""
    return _notes.get() is not None


def note(text: str) -> None:
    """Say what an operator chose (an exchange, one it skipped, a broadcast) for ``explain``."""
    notes = _notes.get()
    if notes is not None:
        notes.append(text)


def rows(table: pa.Table) -> str:
    return f"{table.num_rows} rows, {table.nbytes / 1e6:.1f} MB on this rank"


# ---- building steps -------------------------------------------------------------------------
def passthrough(names: Sequence[str], renames: dict[str, str] | None = None) -> Project:
    renames = renames or {}
    return Project(tuple(Output(renames.get(n, n), pc.field(n), frozenset([n]), n) for n in names))


def computed(name: str, expr: pc.Expression, schema: pa.Schema) -> Output:
    return Output(name, expr, references(expr, schema))


_MISSING = re.compile(r"No match for FieldRef\.Name\((.*?)\) in ")


def references(expr: pc.Expression, schema: pa.Schema) -> frozenset[str]:
    """The columns of ``schema`` that ``expr`` reads.  Arrow has no public walk of an
    expression's tree, so bind it to ever larger empty tables: each failure names one missing
    column.  Anything else (a nested reference) → every column, which is always safe."""
    found: list[str] = []
    for _ in range(len(schema) + 1):
        try:
            evaluate(pa.schema([schema.field(n) for n in found]).empty_table(), expr)
            return frozenset(found)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            m = _MISSING.search(str(exc))
            if not m or m.group(1) not in schema.names or m.group(1) in found:
                return frozenset(schema.names)
            found.append(m.group(1))
    return frozenset(schema.names)


def evaluate(table: pa.Table, expr: pc.Expression) -> pa.ChunkedArray:
    """One expression over a table (Acero's project node)."""
    import pyarrow.acero as acero  # imported on first use: it pulls in pandas (~0.2 s)

    decl = acero.Declaration.from_sequence(
        [
            acero.Declaration("table_source", acero.TableSourceNodeOptions(table)),
            acero.Declaration("project", acero.ProjectNodeOptions([expr], ["__px_value"])),
        ]
    )
    return decl.to_table(use_threads=False).column(0)


# ---- optimizing -----------------------------------------------------------------------------
def _push_filters(steps: list[Step]) -> tuple[list[Step], list[pc.Expression]]:
    """Filters whose columns every projection before them carries unchanged under the same
    name move into the scan; the rest stay where they are."""
    pushed: list[pc.Expression] = []
    kept: list[Step] = []
    intact: set[str] | None = None  # columns unchanged since the source (None: all)
    for step in steps:
        if isinstance(step, Filter) and (intact is None or step.refs <= intact):
            # past a join too: its left rows are kept, dropped or repeated whole, so a filter on
            # their unchanged columns commutes with it (inner, left, semi, anti)
            pushed.append(step.expr)
            continue
        if isinstance(step, Join):
            intact = set(step.left_out) if intact is None else intact & set(step.left_out)
        if isinstance(step, Project):
            same = {o.name for o in step.outputs if o.passes == o.name}
            intact = same if intact is None else intact & same
        kept.append(step)
    return kept, pushed


def _prune(steps: list[Step], wanted: list[str]) -> list[Step]:
    """Drop from each projection the outputs nothing after it reads (walking backwards)."""
    live = set(wanted)
    out: list[Step] = []
    for step in reversed(steps):
        if isinstance(step, Filter):
            out.append(step)
            live |= step.refs
        elif isinstance(step, Join):
            step = step.pruned(live)
            out.append(step)
            live = set(step.left_out) | step.refs
        else:
            outputs = tuple(o for o in step.outputs if o.name in live)
            out.append(Project(outputs))
            live = set().union(*(o.refs for o in outputs)) if outputs else set()
    return list(reversed(out))


def _needed(steps: list[Step], wanted: list[str]) -> set[str]:
    """The source columns the steps read to produce ``wanted``."""
    live = set(wanted)
    for step in reversed(steps):
        if isinstance(step, Filter):
            live |= step.refs
        elif isinstance(step, Join):
            live = (live & set(step.left_out)) | step.refs
        else:
            live = set().union(*(o.refs for o in step.outputs)) if step.outputs else set()
    return live


def _as_sql(schema: pa.Schema, steps: Sequence[Step], wanted: Sequence[str]) -> str | None:
    """The steps over rows of ``schema`` as one DuckDB query over ``{src}`` (and ``{j0}``...
    for joins), compiled once; None where a step has no SQL form or
    ``PHALANX_PIPELINE_ENGINE=acero`` says so."""
    if _engine_setting() == "acero":
        return None
    key = ("sql", tuple((f.name, str(f.type)) for f in schema), tuple(map(_step_key, steps)), tuple(wanted))
    if key not in _COMPILED:
        from . import plan_sql

        try:
            _remember(key, plan_sql.pipeline_sql(schema, steps, wanted))
        except plan_sql.Untranslatable:
            _remember(key, None)
    return _COMPILED[key]


def _joined(table: pa.Table, steps: list[Step], schema: pa.Schema) -> pa.Table:
    """Steps with joins over a table: the runs of filters and projections between the joins
    in Polars and each join on its own (``kernels.join``: Polars for a small side); where a
    run has no Polars form, one DuckDB query for them all if every step has an SQL form, else
    the runs apart in Acero.

    Why apart first: TPC-H's queries with such joins, alternated 5 times in one session,
    0.89x the time of one DuckDB query (Q2 0.67, Q8 0.83, Q9 0.85, Q11 0.83; none slower than
    1.04, within the runs' spread): DuckDB reads each Arrow column through its scan, where
    Polars takes fixed-width columns as they are and its join over a small side probes
    faster (docs/performance.md, "Joins in Polars")."""
    from . import kernels
    from .plan_sql import SqlInput

    if not _apart_in_polars(table.schema, steps):
        select = _as_sql(table.schema, steps, schema.names)
        if select is not None:
            joined = tuple(s.table for s in steps if isinstance(s, Join))
            rows = SqlInput(table, select, schema, joined)
            return kernels.restore_types(kernels.run_sql('SELECT * FROM "__px_t"', __px_t=rows), schema)
    return kernels.restore_types(_apart(table, steps).select(schema.names), schema)


def _apart(table: pa.Table, steps: list[Step], empty: bool = False) -> pa.Table:
    """The steps with each run between joins as one local pass (Polars, else Acero) and each
    join on its own; ``empty``: with each join's table as an empty one of its schema."""
    shares: dict = {}  # selectivity's answers in this run
    while steps:
        at = next((i for i, s in enumerate(steps) if isinstance(s, Join)), len(steps))
        local = steps[:at]
        matching = _matching(steps[at]) if at < len(steps) and _engine_setting() == "polars" else None
        filtered = False
        if at:
            compiled = _in_polars(table.schema, local)
            at_filter = _at_last_filter(local, matching[0]) if compiled is not None and matching else None
            if compiled is not None:
                table = compiled.run(table, (at_filter, matching[1]) if at_filter and matching else None)
            else:
                table = _acero(table, local)
            filtered = at_filter is not None
        if at == len(steps):
            break
        join: Join = steps[at]  # type: ignore[assignment]
        swapped = None if empty or matching is None else _more_selective_next(table, steps, at, shares)
        if swapped is not None:  # the next join keeps fewer rows: it runs first
            first, second, order, replaced = swapped
            table = _join_step(
                _join_step(table, first, _matching(first), False, shares=shares), second, _matching(second), False
            )
            table = table.select(order)
            steps = steps[at + replaced :]
            continue
        table = _join_step(table, join, matching, filtered, empty, shares)
        steps = steps[at + 1 :]
    return table


def _join_step(
    table: pa.Table,
    join: Join,
    matching: tuple[str, pa.ChunkedArray] | None,
    filtered: bool,
    empty: bool = False,
    shares: dict | None = None,
) -> pa.Table:
    """One join step over the rows before it (``filtered``: its membership filter ran already)."""
    from . import kernels
    from .membership import increasing_pairs, sorted_pairs
    from .plan_polars import integer_column, members

    usable = matching is not None and integer_column(table, matching[0])
    if matching is not None and usable and join.how == "inner" and not empty and _keys_shared_only(join):
        pairs = sorted_pairs(table.column(matching[0]), matching[1])
        if pairs is not None:
            return _sorted_join(table, join, *pairs)
        pairs = increasing_pairs(table.column(matching[0]), matching[1])
        if pairs is not None:
            return _sorted_join(table, join, *pairs, ascending=False)
    if matching is not None and usable and not filtered:
        # a semi join keeps the rows whose key is one of the right's: a filter (in the last
        # filter before it, else Polars' hash lookup here); 3M rows against 1337 parts' keys
        # 17 -> 7 ms (TPC-H Q8).  So does an inner join that keeps few rows, before its
        # gather: 750k orders against 12k customers' keys 10.6 -> 6.4 ms (Q7); where most
        # rows match, the lookup is a pass for nothing (14.3 -> 10.7 ms the other way round)
        if join.how == "semi" or selectivity(table, *matching, shares) <= MEMBERSHIP_SHARE:
            table = members(table, *matching)
            filtered = True
    if join.how == "semi" and usable and filtered:
        return table.select(list(join.left_out))
    right = join.table.schema.empty_table() if empty else join.table
    right = right.select(list(dict.fromkeys([*join.right_on, *join.right_out])))
    out = kernels.join(table, right, list(join.left_on), list(join.right_on), join.how)
    return out.select([*join.left_out, *join.right_out])


def _sorted_join(table: pa.Table, join: Join, rows: np.ndarray, at: np.ndarray, ascending: bool = True) -> pa.Table:
    """An inner join's output from its row pairs (``membership.sorted_pairs``: ``rows``
    ascending; ``increasing_pairs``: not): no hash table, and of a rank's 3M lines only the
    91k that join 23k orders are read (TPC-H Q5)."""
    from . import kernels

    if noting():
        how = "sorted runs" if ascending else "binary search of increasing keys"
        note(
            f"per-rank join ({how}): inner on {join.left_on[0]} = {join.right_on[0]}, "
            f"{table.num_rows} x {join.table.num_rows} rows"
        )
    left = table.select(list(join.left_out))
    left = kernels.take_ascending(left, rows) if ascending else left.take(rows)
    own = dict(zip(left.column_names, left.columns))
    right = join.table.select([c for c in join.right_out if c not in own])
    taken = right.take(at) if ascending else kernels.take_ascending(right, at)  # (then ``at`` ascends)
    own.update(zip(taken.column_names, taken.columns))
    names = [*join.left_out, *join.right_out]
    return pa.Table.from_arrays([own[n] for n in names], names=names)


def _keys_shared_only(join: Join) -> bool:
    """Whether the only names both sides give out are keys joined to themselves (each
    output once, from the left, as the hash joins do)."""
    same = {a for a, b in zip(join.left_on, join.right_on) if a == b}
    return not (set(join.left_out) & set(join.right_out)) - same


MEMBERSHIP_SHARE = 0.3  # an inner join keeping at most this share of its rows filters them first
SAMPLE_ROWS = 1024


def selectivity(table: pa.Table, key: str, keys: pa.ChunkedArray, memo: dict | None = None) -> float:
    """The share of ``table``'s rows whose ``key`` is one of ``keys``, from a sample of rows
    spread evenly over the table; ``memo`` keeps the answers of one plan's run (the same
    table and keys are asked again when a join's order is chosen: TPC-H Q7's orders)."""
    at = (id(table), key, id(keys))
    if memo is not None and at in memo:
        return memo[at][0]
    share = _sampled_share(table.column(key), keys)
    if memo is not None:  # the objects kept with the answer: their ids are not reused meanwhile
        memo[at] = (share, table, keys)
    return share


def _sampled_share(column: pa.ChunkedArray, keys: pa.ChunkedArray) -> float:
    """Of ``SAMPLE_ROWS`` rows of the column, the share holding one of ``keys``: integers by
    a binary search of the sorted keys (750k orders against 70k lines' keys: 0.4 ms, where a
    hash set of the sample probed by every key took 1.2); other types by hash."""
    n = len(column)
    if n == 0:
        return 1.0
    every = max(1, n // SAMPLE_ROWS)
    if not (pa.types.is_integer(column.type) and column.type == keys.type):
        sample = column.take(pa.array(np.arange(0, n, every)))
        values = pc.unique(sample)
        found = np.zeros(len(values) + 1, dtype=bool)  # the last: a null (no match: no null key)
        hits = pc.drop_null(pc.index_in(keys, value_set=values)).to_numpy(zero_copy_only=False)
        found[hits] = True
        at = pc.fill_null(pc.index_in(sample, value_set=values), len(values)).to_numpy(zero_copy_only=False)
        return float(found[at].mean())
    parts, start, rows, nulls = [], 0, 0, 0  # every ``every``-th row, chunk by chunk (no copy)
    for chunk in column.chunks:
        rows += len(range(start, len(chunk), every))
        if start < len(chunk):
            picked = chunk.slice(start).take(pa.array(np.arange(0, len(chunk) - start, every)))
            nulls += picked.null_count
            parts.append(pc.drop_null(picked).to_numpy())
        start = (start - len(chunk)) % every
    matches = nulls if keys.null_count else 0  # a null key matches a null (the joins' rule)
    sample = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    wanted = np.sort(pc.drop_null(keys).to_numpy())
    if len(sample) and len(wanted):
        matches += int((wanted[np.minimum(np.searchsorted(wanted, sample), len(wanted) - 1)] == sample).sum())
    return matches / rows


def _more_selective_next(
    table: pa.Table, steps: list[Step], at: int, shares: dict
) -> tuple[Join, Join, list[str], int] | None:
    """Two inner joins, each on one integer key, with at most projections that select columns
    between them, where the second reads only columns the rows before the first hold and keeps
    at most half the share of rows the first keeps (sampled from those rows), or about as
    many from a table a quarter the size: (the second as
    the first join, the first as the second, the columns the steps made, the steps they
    replace).  TPC-H Q7's orders meet the 12k customers of two nations (8%) before the 140k
    lines of their suppliers (12%)."""
    a = steps[at]
    between = 1
    while at + between < len(steps) and _selects(steps[at + between]):
        between += 1
    b = steps[at + between] if at + between < len(steps) else None
    if not (isinstance(a, Join) and isinstance(b, Join) and a.how == b.how == "inner"):
        return None
    ma, mb = _matching(a), _matching(b)
    if ma is None or mb is None or mb[0] not in a.left_out:
        return None
    wanted = set(b.left_out) | set(a.left_on) | set(b.left_on)
    inputs = [c for c in table.column_names if c in wanted]
    if set(b.right_out) & set(inputs):
        return None
    # rows kept decide; where they are alike, the smaller table (its hash set stays in cache:
    # 750k orders probe 12k customers' keys in 6.3 ms, 140k lines' in 9.3)
    share_a, share_b = selectivity(table, *ma, shares), selectivity(table, *mb, shares)
    smaller = 4 * b.table.num_rows <= a.table.num_rows
    if not (share_b <= 0.5 * share_a or (smaller and share_b <= 1.5 * share_a)):
        return None
    first = Join(b.table, b.left_on, b.right_on, "inner", tuple(inputs), b.right_out, b.exchange, b.made_by, b.partial)
    kept = tuple(c for c in a.right_out if c in b.left_out)
    second = Join(
        a.table, a.left_on, a.right_on, "inner", (*inputs, *b.right_out), kept, a.exchange, a.made_by, a.partial
    )
    return first, second, [*b.left_out, *b.right_out], between + 1


def _selects(step: Step) -> bool:
    """Whether a step only selects columns (each output an input column of the same name)."""
    return isinstance(step, Project) and all(o.passes == o.name for o in step.outputs)


def _matching(join: Step) -> tuple[str, pa.ChunkedArray] | None:
    """For an inner or semi join on one integer key: (the left key, the right side's keys), for
    the filter before the join to keep only the rows that find a match — a join with a few
    suppliers after a date filter on lineitem then copies 70k rows out of 3M instead of 900k
    (TPC-H Q7: 25 -> 14 ms a rank).  None where a right key is null (a left null matches it)."""
    if not (isinstance(join, Join) and join.how in ("inner", "semi") and len(join.left_on) == 1):
        return None
    keys = join.table.column(join.right_on[0])
    if not pa.types.is_integer(keys.type) or keys.null_count:
        return None
    return join.left_on[0], keys


def _at_last_filter(local: list[Step], name: str) -> str | None:
    """What column ``name`` (after the steps) is called at the last filter among them, where
    the projections after that filter carry it unchanged; None if they compute it, or there
    is no filter."""
    for step in reversed(local):
        if isinstance(step, Filter):
            return name
        if isinstance(step, Project):
            passed = _passed(step, name)
            if passed is None:
                return None
            name = passed
    return None


def _passed(step: Project, name: str) -> str | None:
    """The input column a projection's output ``name`` carries unchanged; None if it computes
    it or has no such output."""
    out = next((o for o in step.outputs if o.name == name), None)
    return None if out is None else out.passes


def _apart_in_polars(schema: pa.Schema, steps: list[Step]) -> bool:
    """Whether every run of filters and projections between the joins has a Polars form
    (asked once per plan, of empty tables); False under ``PHALANX_PIPELINE_ENGINE=duckdb``
    or ``acero``."""
    if _engine_setting() in ("acero", "duckdb"):
        return False
    key = ("apart", tuple((f.name, str(f.type)) for f in schema), tuple(map(_step_key, steps)))
    if key not in _COMPILED:
        ok = True
        table = schema.empty_table()
        rest = list(steps)
        silent = _notes.set(None)  # the trial joins of empty tables are not the operator's
        try:
            while rest and ok:
                at = next((i for i, s in enumerate(rest) if isinstance(s, Join)), len(rest))
                if at:
                    ok = _in_polars(table.schema, rest[:at]) is not None
                if not ok or at == len(rest):
                    break
                table = _apart(table, rest[: at + 1], empty=True)
                rest = rest[at + 1 :]
        finally:
            _notes.reset(silent)
        _remember(key, ok)
    return bool(_COMPILED[key])


def _acero(table: pa.Table, steps: list[Step]) -> pa.Table:
    """The steps as one Acero plan over the table's batches (one thread: a rank owns a core,
    and a single-threaded plan keeps the rows' order)."""
    import pyarrow.acero as acero

    nodes = [acero.Declaration("table_source", acero.TableSourceNodeOptions(table))]
    for step in steps:
        if isinstance(step, Filter):
            nodes.append(acero.Declaration("filter", acero.FilterNodeOptions(step.expr)))
        elif isinstance(step, Project):  # joins never come here (_joined runs them)
            nodes.append(
                acero.Declaration(
                    "project", acero.ProjectNodeOptions([o.expr for o in step.outputs], [o.name for o in step.outputs])
                )
            )
    return acero.Declaration.from_sequence(nodes).to_table(use_threads=False)
