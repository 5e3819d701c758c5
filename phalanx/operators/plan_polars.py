"""A rank's local pipeline (``plan.Pipeline``) evaluated by Polars' engine instead of Acero.

Why: on one rank's share of TPC-H's lineitem (3M rows, one thread) Acero's filter and project
nodes cost 3-7x what Polars' do — ``l_commitdate < l_receiptdate`` 34 ms vs 5 ms, a
``LIKE '%special%requests%'`` 103 ms vs 22 ms, Q12's three predicates 92 ms vs 36 ms, Arrow ⇄
Polars conversion included (docs/performance.md, "The local pipeline in Polars").

How: the expression's tree (``exprtree``) is rebuilt as a Polars expression, for the functions of its tables (``to_polars``) with Arrow's semantics (Kleene logic, ``is_in`` on nulls,
``if_else`` on a null condition, LIKE patterns).  Anything else — another function, an integer
division, a column type Polars would not give back unchanged — raises ``Untranslatable`` and
the pipeline runs in Acero, as before.

Only the columns an expression reads travel to Polars: a filter's mask comes back as one
boolean array that Arrow applies to the whole table (so wide rows of strings that pass through
are never converted), and a projection's computed columns come back cast to the types Arrow
would have given them.  A filter's terms over fixed-width columns run first; where they keep
few rows, its terms over strings (which Polars copies) run on those rows only.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from .exprtree import Node, Untranslatable, columns_read, plain_type, tree
from .exprtree import fields as _fields
from .membership import member_mask

__all__ = ["Compiled", "Untranslatable", "compile_steps", "to_polars"]


# ---- rebuilding it in Polars ---------------------------------------------------------------
def _simple(t: pa.DataType) -> bool:
    """Types that go to Polars and come back as the same Arrow type after a cast."""
    return plain_type(t) or (pa.types.is_timestamp(t) and t.tz is None)


@lru_cache(maxsize=256)
def _polars_type(t: pa.DataType) -> pl.DataType:
    return pl.from_arrow(pa.array([], t)).dtype  # type: ignore[union-attr]


def _literal(s: pa.Scalar) -> pl.Expr:
    if not _simple(s.type):
        raise Untranslatable(f"a literal of type {s.type}")
    return pl.lit(s.as_py(), dtype=_polars_type(s.type))


def _like_regex(pattern: str, ignore_case: bool) -> str:
    """SQL LIKE (``%``, ``_``, backslash escapes) as a regex; unanchored where the pattern
    starts or ends with ``%``."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if c == "%" else "." if c == "_" else re.escape(c))
        i += 1
    body = "".join(out)
    head = "" if body.startswith(".*") else "^"
    tail = "" if body.endswith(".*") and not body.endswith("\\.*") else "$"
    body = body.removeprefix(".*") if not head else body
    body = body[:-2] if not tail else body
    return ("(?si)" if ignore_case else "(?s)") + head + body + tail


def _like(col: pl.Expr, options: Any) -> pl.Expr:
    pattern, ignore_case = options["pattern"].as_py(), options["ignore_case"].as_py()
    plain = not re.search(r"[_\\]", pattern)
    core = pattern.strip("%")
    if plain and not ignore_case and "%" not in core and core:
        if pattern == core:
            return col == core
        if pattern == core + "%":
            return col.str.starts_with(core)
        if pattern == "%" + core:
            return col.str.ends_with(core)
        return col.str.contains(core, literal=True)
    return col.str.contains(_like_regex(pattern, ignore_case))


def _matched_set(options: Any) -> pa.Array | None:
    """An ``is_in``'s value set where a null matches a null in it (MATCH, the default), else None."""
    fields = {f.name for f in options.type}
    behaviour = options["null_matching_behavior"].as_py() if "null_matching_behavior" in fields else None
    return options["value_set"].values if behaviour == 0 else None


def _is_in(col: pl.Expr, options: Any) -> pl.Expr:
    items = _matched_set(options)
    kind = options["value_set"].type.value_type
    if items is None or not _simple(kind) or pa.types.is_floating(kind):
        raise Untranslatable("is_in of floats (NaN), or other than null_matching_behavior=MATCH")
    has_null = items.null_count > 0
    kept = items.drop_null() if items.null_count else items
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        # Polars' is_in over strings is 5x Arrow's (750k rows, 7 codes: 90 ms vs 17 ms); a chain
        # of equalities is 32 ms
        if len(kept) <= _STRING_SET_AS_EQUALITIES:
            found = functools.reduce(operator.or_, [col == v for v in kept.to_pylist()], pl.lit(False))
        else:
            raise Untranslatable("is_in over a large set of strings (Acero's hash lookup is faster)")
    else:
        found = col.is_in(pl.Series(kept).implode())
    # Arrow: a null matches only a null in the set (true/false, never null)
    return pl.when(col.is_null()).then(pl.lit(has_null)).otherwise(found)


_STRING_SET_AS_EQUALITIES = 32


def _if_else(c: pl.Expr, a: pl.Expr, b: pl.Expr) -> pl.Expr:
    return pl.when(c).then(a).when(~c).then(b)  # a null condition gives null, as in Arrow


def _slice(col: pl.Expr, options: Any) -> pl.Expr:
    start, stop, step = (options[k].as_py() for k in ("start", "stop", "step"))
    if step != 1 or start < 0 or stop < start:
        raise Untranslatable("utf8_slice_codeunits with a negative start or a step")
    return col.str.slice(start, stop - start)


def _cast(col: pl.Expr, options: Any) -> pl.Expr:
    to = options["to_type"].type if hasattr(options["to_type"], "type") else None
    if to is None or not (pa.types.is_floating(to) or pa.types.is_string(to) or pa.types.is_large_string(to)):
        raise Untranslatable("a cast to a type other than floating point or string")
    return col.cast(_polars_type(to))


_COMPARISONS: dict[str, Callable[[pl.Expr, pl.Expr], pl.Expr]] = {
    "equal": lambda a, b: a == b,
    "not_equal": lambda a, b: a != b,
    "less": lambda a, b: a < b,
    "less_equal": lambda a, b: a <= b,
    "greater": lambda a, b: a > b,
    "greater_equal": lambda a, b: a >= b,
}


def _compare(n: Node, args: list[pl.Expr], schema: pa.Schema) -> pl.Expr:
    """Arrow compares NaN as IEEE 754 does (false, or true for not_equal); Polars orders NaN
    above every number and NaN == NaN: a NaN side gets Arrow's answer explicitly."""
    a, b = args
    out = _COMPARISONS[n.name](a, b)
    nan = [x.is_nan() for x, side in zip(args, n.args) if is_float(side, schema)]
    if not nan:
        return out
    either = nan[0] if len(nan) == 1 else nan[0] | nan[1]
    return pl.when(a.is_null() | b.is_null()).then(None).when(either).then(n.name == "not_equal").otherwise(out)


_BINARY: dict[str, Callable[[pl.Expr, pl.Expr], pl.Expr]] = {
    "and_kleene": lambda a, b: a & b,  # Polars' & and | are Kleene's, as these
    "or_kleene": lambda a, b: a | b,
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
}
_UNARY: dict[str, Callable[[pl.Expr], pl.Expr]] = {
    "invert": lambda a: ~a,
    "negate": lambda a: -a,
    "abs": lambda a: a.abs(),
    "is_null": lambda a: a.is_null(),
    "is_valid": lambda a: a.is_not_null(),
    "year": lambda a: a.dt.year().cast(pl.Int64),
    "month": lambda a: a.dt.month().cast(pl.Int64),
    "day": lambda a: a.dt.day().cast(pl.Int64),
}
_WITH_OPTIONS: dict[str, Callable[[pl.Expr, Any], pl.Expr]] = {
    "match_like": _like,
    "is_in": _is_in,
    "utf8_slice_codeunits": _slice,
    "cast": _cast,
    "starts_with": lambda a, o: _plain(o, a.str.starts_with),
    "ends_with": lambda a, o: _plain(o, a.str.ends_with),
    "match_substring": lambda a, o: _plain(o, lambda p: a.str.contains(p, literal=True)),
}


def _plain(options: Any, fn: Callable[[str], pl.Expr]) -> pl.Expr:
    if options["ignore_case"].as_py():
        raise Untranslatable("a case-insensitive match")
    return fn(options["pattern"].as_py())


def to_polars(expr: pc.Expression, schema: pa.Schema) -> pl.Expr:
    """``expr`` as a Polars expression over ``schema``'s columns, or ``Untranslatable``."""
    return polars_of(tree(expr), schema)


def is_float(n: Node, schema: pa.Schema) -> bool:
    """Whether a subtree's values are floating point (its Polars rebuild's type, on no rows)."""
    empty = pl.from_arrow(schema.empty_table()).lazy()  # type: ignore[union-attr]
    return empty.select(polars_of(n, schema)).collect_schema().dtypes()[0].is_float()


def polars_of(node: Node, schema: pa.Schema) -> pl.Expr:
    """A tree as a Polars expression (see ``to_polars``)."""

    def build(n: Node) -> pl.Expr:
        if n.kind == "field":
            if n.name not in schema.names or not _simple(schema.field(n.name).type):
                raise Untranslatable(f"column {n.name!r}")
            return pl.col(n.name)
        if n.kind == "literal":
            return _literal(n.value)
        args = [build(a) for a in n.args]
        if n.name in _COMPARISONS and len(args) == 2:
            return _compare(n, args, schema)
        if n.name in _BINARY and len(args) == 2:
            return _BINARY[n.name](*args)
        if n.name in _UNARY and len(args) == 1:
            return _UNARY[n.name](*args)
        if n.name in _WITH_OPTIONS and len(args) == 1 and n.value is not None:
            return _WITH_OPTIONS[n.name](args[0], n.value)
        if n.name == "if_else" and len(args) == 3:
            return _if_else(*args)
        if n.name in ("coalesce", "fill_null") and args:
            return pl.coalesce(args)
        if n.name in _FLOATING_ONLY and len(args) == 2 and _floating(n, schema):
            return _FLOATING_ONLY[n.name](*args)
        raise Untranslatable(f"function {n.name!r}")

    return build(node)


# Arrow divides integers as integers (failing on zero), and the checked variants (what the
# operators + - * / of an Expression make) fail on integer overflow where Polars wraps: these are
# rebuilt only where Arrow's result is floating point.
_FLOATING_ONLY: dict[str, Callable[[pl.Expr, pl.Expr], pl.Expr]] = {
    "divide": lambda a, b: a / b,
    "divide_checked": lambda a, b: a / b,
    "add_checked": lambda a, b: a + b,
    "subtract_checked": lambda a, b: a - b,
    "multiply_checked": lambda a, b: a * b,
}


def _floating(n: Node, schema: pa.Schema) -> bool:
    """Whether Arrow's result of the call ``n`` is floating point (asked of Arrow, on no rows)."""
    from .plan import evaluate

    return pa.types.is_floating(evaluate(schema.empty_table(), _arrow(n)).type)


def _arrow(n: Node) -> pc.Expression:
    """The Arrow expression of a tree without options (those are not rebuilt)."""
    if n.kind == "field":
        return pc.field(n.name)
    if n.kind == "literal":
        return pc.scalar(n.value)
    if n.value is not None:
        raise Untranslatable(f"the type of {n.name!r} inside an arithmetic operation")
    return pc.Expression._call(n.name, [_arrow(a) for a in n.args])


# ---- running a pipeline's steps ---------------------------------------------------------------
@dataclass
class Compiled:
    """A pipeline's steps as Polars expressions: filters (consecutive ones combined) and
    projections, each with the columns it reads."""

    parts: list[tuple[str, Any]]

    def run(self, table: pa.Table, matching: tuple[str, pa.ChunkedArray] | None = None) -> pa.Table:
        """The steps over the table; ``matching``, a column and values, adds the term "the
        column's value is one of these" to the last filter (``plan._apart``: the rows a join
        after the steps would drop are not copied out)."""
        last = max((i for i, (kind, _) in enumerate(self.parts) if kind == "filter"), default=-1)
        for i, (kind, what) in enumerate(self.parts):
            if kind == "filter":
                stages, refs, keep = what
                table = _filter(table, stages, refs, keep, matching if i == last else None)
            else:
                table = _project(table, what)
        return table

    def mask(self, table: pa.Table, min_share: float) -> Any | None:
        """A compiled filter's rows as a mask over the table (true where kept, never null),
        where it keeps at least ``min_share`` of them; None where it keeps fewer (checked
        after each stage: a string stage does not run where the ones before keep fewer)."""
        ((kind, (stages, _refs, _keep)),) = self.parts
        assert kind == "filter"
        mask = None
        for stage in stages:
            here = _mask(table, stage)
            mask = here if mask is None else pc.and_(mask, here)
            if (pc.sum(mask).as_py() or 0) < min_share * table.num_rows:
                return None
        return mask


def compile_steps(schema: pa.Schema, steps: Sequence[Any]) -> Compiled:
    """The pipeline's steps (``plan.Filter`` / ``plan.Project``) over rows of ``schema``, or
    ``Untranslatable`` when one cannot run in Polars (checked on no rows: all or nothing)."""
    from .plan import Filter, evaluate

    if len(set(schema.names)) != len(schema.names):
        raise Untranslatable("duplicate column names")
    parts: list[tuple[str, Any]] = []
    before: list[pa.Schema] = []  # the columns each part reads from
    i = 0
    while i < len(steps):
        before.append(schema)
        if isinstance(steps[i], Filter):
            group = []
            while i < len(steps) and isinstance(steps[i], Filter):
                group.append(steps[i])
                i += 1
            conjuncts = [c for s in group for c in _conjuncts(tree(s.expr))]
            if not set().union(*(_fields(c) for c in conjuncts)):
                raise Untranslatable("a filter that reads no column")
            stages: list[Stage] = []
            for kind, stage in _stages(conjuncts, schema):
                refs = sorted(set().union(*(_fields(c) for c in stage)))
                if kind == "arrow":
                    stages.append(Stage("arrow", [_arrow_term(c, schema) for c in stage], refs))
                    continue
                preds = [polars_of(c, schema) for c in stage]
                stages.append(Stage("polars", pl.all_horizontal(preds) if len(preds) > 1 else preds[0], refs))
            parts.append(("filter", (stages, sorted({r for st in stages for r in st.refs}))))
            continue
        step = steps[i]
        i += 1
        empty = schema.empty_table()
        outputs: list[tuple[str, str, Any, Any]] = []
        fields = []
        for o in step.outputs:
            if o.passes is not None:
                outputs.append((o.name, "pass", o.passes, None))
                fields.append(schema.field(o.passes).with_name(o.name))
                continue
            kind = evaluate(empty, o.expr).type
            fields.append(pa.field(o.name, kind))
            refs = sorted(columns_read(o.expr))
            if not refs:  # a constant: Arrow broadcasts it
                outputs.append((o.name, "arrow", o.expr, None))
                continue
            if not _simple(kind):
                raise Untranslatable(f"an output of type {kind}")
            outputs.append((o.name, "polars", to_polars(o.expr, schema), (kind, refs)))
        parts.append(("project", outputs))
        schema = pa.schema(fields)
    return Compiled(_drop_dead_columns(parts, before, schema.names))


def _conjuncts(n: Node) -> list[Node]:
    """The terms of a predicate's top-level AND (a row passes when every term is true, with
    Kleene logic or without: a null term drops it either way)."""
    if n.kind == "call" and n.name in ("and", "and_kleene") and len(n.args) == 2:
        return [*_conjuncts(n.args[0]), *_conjuncts(n.args[1])]
    return [n]


@dataclass
class Stage:
    """Terms of a filter evaluated together: one Polars predicate, or Arrow kernels' terms."""

    kind: str  # "polars" or "arrow"
    what: Any  # a pl.Expr, or a list of functions (table -> boolean array)
    refs: list[str]  # the columns the terms read


def _stages(conjuncts: list[Node], schema: pa.Schema) -> list[tuple[str, list[Node]]]:
    """Terms over fixed-width columns first (Polars), then terms that compare one string
    column with literals (Arrow's kernels), then the other terms that read strings (Polars),
    each stage on the rows the ones before it keep where they keep few.

    Why: fixed-width columns go to Polars without a copy, strings are copied into Polars'
    string views (28 ms for 3M short strings), while Arrow compares them where they lie: one
    rank's 3M lineitem rows, ``l_shipinstruct = 'DELIVER IN PERSON'`` 9 ms in Arrow vs 43 ms
    in Polars, ``l_shipmode IN ('AIR', 'AIR REG')`` 26 ms vs 50 (TPC-H Q19).  Polars stays
    faster at LIKE '%...%' (its copy included: 2.6 ms vs 4.9 on 100k part names).  Staging:
    Q12's filter, 59 ms as one mask, 12 ms with the three date terms first and
    ``l_shipmode IN (...)`` on the 15,575 rows they keep."""

    def fixed_width(name: str) -> bool:
        t = schema.field(name).type if name in schema.names else pa.string()
        return not (pa.types.is_string(t) or pa.types.is_large_string(t))

    first: list[Node] = []
    in_arrow: list[Node] = []
    rest: list[Node] = []
    constant: list[Node] = []
    for c in conjuncts:
        fields = _fields(c)
        if not fields:
            constant.append(c)
        elif all(map(fixed_width, fields)):
            first.append(c)
        elif _arrow_term(c, schema) is not None:
            in_arrow.append(c)
        else:
            rest.append(c)
    if constant and not (first or rest):  # a term that reads no column joins a Polars stage
        rest, in_arrow = in_arrow, []
    (first or rest).extend(constant)
    return [(k, s) for k, s in (("polars", first), ("arrow", in_arrow), ("polars", rest)) if s]


_ARROW_COMPARISONS = {
    "equal": pc.equal,
    "not_equal": pc.not_equal,
    "less": pc.less,
    "less_equal": pc.less_equal,
    "greater": pc.greater,
    "greater_equal": pc.greater_equal,
}
_MIRRORED = {"less": "greater", "less_equal": "greater_equal", "greater": "less", "greater_equal": "less_equal"}


def _arrow_term(n: Node, schema: pa.Schema) -> Callable[[pa.Table], Any] | None:
    """A term that compares one string column with a string literal, tests it against a set
    (``is_in``) or a prefix or suffix, as Arrow's kernel over the column (true/false/null per
    row); None for any other term."""

    def string_column(a: Node) -> bool:
        return a.kind == "field" and a.name in schema.names and _is_string(schema.field(a.name).type)

    if n.kind != "call":
        return None
    if n.name in _ARROW_COMPARISONS and len(n.args) == 2:
        a, b, name = *n.args, n.name
        if b.kind == "field":
            a, b, name = b, a, _MIRRORED.get(name, name)
        if string_column(a) and b.kind == "literal" and _is_string(b.value.type):
            column, value, fn = a.name, b.value, _ARROW_COMPARISONS[name]
            return lambda t: fn(t.column(column), value)
    if len(n.args) != 1 or not string_column(n.args[0]) or n.value is None:
        return None
    column, options = n.args[0].name, n.value
    if n.name == "is_in":
        values = _matched_set(options)
        if values is None or not _is_string(values.type):
            return None
        return lambda t: pc.is_in(t.column(column), value_set=values)
    if n.name in ("starts_with", "ends_with") and not options["ignore_case"].as_py():
        pattern, fn = options["pattern"].as_py(), getattr(pc, n.name)
        return lambda t: fn(t.column(column), pattern)
    return None


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _drop_dead_columns(parts: list[tuple[str, Any]], before: list[pa.Schema], out: list[str]) -> list[tuple[str, Any]]:
    """Give each filter the columns something after it reads: a column read only by the
    filter itself is not copied with the surviving rows (Q4: 2 of lineitem's 3 columns)."""
    live = set(out)
    for idx in reversed(range(len(parts))):
        kind, what = parts[idx]
        if kind == "project":
            live = set()
            for _name, how, src, extra in what:
                live |= {src} if how == "pass" else set(extra[1]) if how == "polars" else set()
            continue
        keep = [c for c in before[idx].names if c in live] or before[idx].names[:1]  # keep the row count
        parts[idx] = (kind, (*what, keep))
        live |= set(what[1])
    return parts


def _frame(table: pa.Table, columns: Sequence[str]) -> pl.DataFrame:
    return pl.from_arrow(table.select(list(columns)), rechunk=False)  # type: ignore[return-value]


def _mask(table: pa.Table, stage: Stage) -> Any:
    """Where the stage's terms are all true over the table's rows (null counts as false)."""
    if stage.kind == "polars":
        return _frame(table, stage.refs).select(stage.what.fill_null(False)).to_series().to_arrow()
    masks = [pc.fill_null(term(table), False) for term in stage.what]
    return functools.reduce(pc.and_, masks)


# the share of rows the fixed-width terms may keep for the string terms to run on the kept rows
# only: above it, copying the kept rows' strings costs more than converting them all (Q19's 60%:
# 101 ms in one pass, 183 ms staged; Q12's 0.5%: 59 ms in one pass, 12 ms staged)
_STAGED_SHARE = 0.25


def _filter(
    table: pa.Table,
    stages: list[Stage],
    refs: Sequence[str],
    keep: Sequence[str],
    matching: tuple[str, pa.ChunkedArray] | None = None,
) -> pa.Table:
    """The rows where every stage's terms are true: where the stages before one keep few
    rows, it runs on those rows only (copied out with the columns still needed).  With
    ``matching`` (an integer column and values), only rows whose column holds one of them."""
    if matching is not None:
        stages = _with_membership(table, stages, *matching)
    mask = None
    for i, stage in enumerate(stages):
        if mask is not None and (pc.sum(mask).as_py() or 0) <= _STAGED_SHARE * table.num_rows:
            later = sorted({c for st in stages[i:] for c in st.refs} - set(keep))
            table, mask = table.select([*keep, *later]).filter(mask), None
        here = _mask(table, stage)
        mask = here if mask is None else pc.and_(mask, here)
    table = table.select(list(keep)) if len(keep) < table.num_columns else table
    return table if mask is None else table.filter(mask)


def _with_membership(table: pa.Table, stages: list[Stage], column: str, values: pa.ChunkedArray) -> list[Stage]:
    """The stages with the term "``column`` is one of ``values``" as a stage of its own (a
    lookup table: ``membership.member_mask``, else Polars' hash lookup) after the first,
    fixed-width one: where that one keeps few rows, asked of those only (TPC-H Q20's lines of
    1994); else of every row, 3M lines' date and 774 suppliers 16.7 -> 9.4 ms, Polars' hash
    lookup in the one pass being most of it (Q7).  Unchanged where the column is not an
    integer one."""
    if not integer_column(table, column):
        return stages
    first = stages[0]
    own = Stage("arrow", [lambda t: _member_mask(t, column, values)], [column])
    if first.kind == "polars" and all(not _is_string(table.schema.field(c).type) for c in first.refs):
        return [first, own, *stages[1:]]
    return [own, *stages]


def integer_column(table: pa.Table, column: str) -> bool:
    return column in table.column_names and pa.types.is_integer(table.schema.field(column).type)


def _membership(table: pa.Table, column: str, values: pa.ChunkedArray) -> pl.Expr:
    kind = _polars_type(table.schema.field(column).type)
    wanted = pl.Series(values).cast(kind, strict=False).drop_nulls()  # out of range: no match
    return pl.col(column).is_in(wanted.implode())


def members(table: pa.Table, column: str, values: pa.ChunkedArray) -> pa.Table:
    """The rows whose integer ``column`` holds one of ``values`` (a null holds none)."""
    from . import kernels
    from .membership import sorted_rows

    rows = sorted_rows(table.column(column), values)
    if rows is not None:
        return kernels.take_ascending(table, rows)
    return table.filter(pc.fill_null(_member_mask(table, column, values), False))


def _member_mask(table: pa.Table, column: str, values: pa.ChunkedArray) -> Any:
    """Where the integer ``column`` holds one of ``values``: ``membership.member_mask``, else
    Polars' hash lookup."""
    found = member_mask(table.column(column), values)
    if found is None:
        found = _frame(table, [column]).select(_membership(table, column, values)).to_series().to_arrow()
    return found


def _project(table: pa.Table, outputs: list[tuple[str, str, Any, Any]]) -> pa.Table:
    from .plan import evaluate

    computed = [(name, expr, extra) for name, how, expr, extra in outputs if how == "polars"]
    values: dict[str, Any] = {}
    if computed:
        refs = sorted(set().union(*(set(extra[1]) for _, _, extra in computed)))
        frame = _frame(table, refs).select([expr.alias(name) for name, expr, _ in computed])
        for (name, _, (kind, _refs)), series in zip(computed, frame.get_columns()):
            values[name] = series.to_arrow().cast(kind)
    columns, names = [], []
    for name, how, src, _ in outputs:
        names.append(name)
        if how == "pass":
            columns.append(table.column(src))
        elif how == "arrow":
            columns.append(evaluate(table, src))
        else:
            columns.append(values[name])
    return pa.Table.from_arrays(columns, names=names)
