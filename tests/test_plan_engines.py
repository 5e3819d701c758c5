"""The local pipeline rebuilt for other engines gives what Acero gives: in Polars
(``phalanx.operators.plan_polars``) and as DuckDB SQL fused into the next query
(``phalanx.operators.plan_sql``).

Acero — Arrow's own engine, which defines what each Arrow expression means — is the
reference: every expression the translators accept is run each way on columns with nulls,
NaN, empty strings and an empty table, and the results must be equal, types included (for
SQL, values: DuckDB's types are restored by the operator that reads them).  And what they must
not accept (an integer division, a function they do not know) falls back to Acero instead of
giving another answer.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from phalanx.operators import kernels
from phalanx.operators import plan as P
from phalanx.operators import plan_polars as PP
from phalanx.operators import plan_sql as PS

f = pc.field


def _dates(text: str) -> pa.Array:
    return pa.array([None if d == "-" else dt.date.fromisoformat(d) for d in text.split()], pa.date32())


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return pa.table(
        {
            "i": pa.array([1, 2, None, 4, -5, 6, 0, 8], pa.int64()),
            "j": pa.array([3, None, 1, 4, 2, 2, 7, 0], pa.int32()),
            "x": pa.array([1.5, float("nan"), None, -2.0, 0.0, 3.25, 1e9, 2.5]),
            "b": pa.array([True, False, None, True, None, False, True, True]),
            "s": pa.array(
                ["special requests", "", None, "PROMO BRASS", "xspecialyrequestsz", "a_b", "100%", "forest green"]
            ),
            "d": _dates("1994-01-01 1995-03-15 - 1998-09-02 1993-07-01 1996-12-31 1994-06-30 1995-03-14"),
            "e": _dates("1994-01-02 1995-03-15 1990-01-01 - 1993-07-01 1997-01-01 1994-06-29 1995-03-15"),
        }
    )


def _same(a: pa.Table, b: pa.Table) -> bool:
    """Equal tables, types included, NaN equal to NaN (Table.equals says it is not)."""

    def rows(t: pa.Table) -> dict:
        return {
            c: [("NaN" if v != v else v) if isinstance(v, float) else v for v in t[c].to_pylist()]
            for c in t.column_names
        }

    return a.schema.equals(b.schema) and rows(a) == rows(b)


def _both(table: pa.Table, steps: list[P.Step]) -> tuple[pa.Table, pa.Table]:
    compiled = PP.compile_steps(table.schema, steps)
    return compiled.run(table), P._acero(table, steps)


FILTERS = [
    f("i") > 2,
    f("i") <= f("j"),
    f("x") != 2.5,
    (f("i") > 0) & (f("j") < 3),
    (f("i") > 0) | f("b"),
    ~f("b"),
    ~(f("i") == 4),
    f("d") < f("e"),
    f("d") >= pa.scalar(dt.date(1995, 1, 1), pa.date32()),
    pc.match_like(f("s"), "%special%requests%"),
    ~pc.match_like(f("s"), "%special%requests%"),
    pc.match_like(f("s"), "PROMO%"),
    pc.match_like(f("s"), "%BRASS"),
    pc.match_like(f("s"), "a\\_b"),
    pc.match_like(f("s"), "a_b"),
    pc.match_like(f("s"), "100\\%"),
    pc.match_like(f("s"), "%SPECIAL%", ignore_case=True),
    pc.starts_with(f("s"), "forest"),
    f("s") == "a_b",
    pc.less(pc.scalar("b"), f("s")),
    f("s") >= "PROMO",
    pc.is_in(f("s"), pa.array(["", None])),
    (f("s") != "") & pc.match_like(f("s"), "%e%") & (f("i") > 0),
    pc.ends_with(f("s"), "z"),
    pc.match_substring(f("s"), "req"),
    f("s").isin(["", "a_b", "zzz"]),
    ~f("s").isin(["", "a_b"]),
    ~f("i").isin([1, 4]),
    pc.is_in(f("i"), pa.array([1, None])),
    f("i").is_null(),
    f("x").is_valid(),
    pc.year(f("d")) == 1995,
    pc.utf8_slice_codeunits(f("s"), 0, 2) == "PR",
    pc.if_else(f("b"), f("i") > 0, f("j") > 1),
    pc.coalesce(f("i"), f("j")) > 1,
]


@pytest.mark.parametrize("expr", FILTERS, ids=[str(e)[:60] for e in FILTERS])
def test_a_filter_keeps_the_rows_acero_keeps(table, expr):
    got, want = _both(table, [P.Filter(expr, P.references(expr, table.schema))])
    assert _same(got, want), (got.to_pydict(), want.to_pydict())


def _wide(n: int) -> pa.Table:
    """n rows: ``k`` 0..n-1 (every 7th null), ``s`` strings cycling through 5 values and null."""
    words = ["MAIL", "SHIP", "AIR", "", None]
    return pa.table(
        {
            "k": pa.array([None if i % 7 == 3 else i for i in range(n)], pa.int64()),
            "s": pa.array([words[i % 5] for i in range(n)]),
            "t": pa.array([words[(i // 5) % 5] for i in range(n)]),
            "v": pa.array([i * 0.5 for i in range(n)]),
        }
    )


@pytest.mark.parametrize("cut", [10, 900], ids=["few rows pass the fixed-width terms", "most rows pass them"])
@pytest.mark.parametrize(
    ("strings", "engines"),
    [
        (f("s").isin(["MAIL", "SHIP"]), ["polars", "arrow"]),
        ((f("s") == "AIR") | (f("t") != "MAIL"), ["polars", "polars"]),
        (~pc.match_like(f("t"), "%AI%"), ["polars", "polars"]),
        ((f("s") != "SHIP") & pc.match_like(f("t"), "%A%"), ["polars", "arrow", "polars"]),
    ],
    ids=["is_in", "or of two string columns", "not like", "a comparison, then a like"],
)
def test_a_conjunction_runs_its_string_terms_after_its_fixed_width_ones(cut, strings, engines):
    """Fixed-width terms first (Polars), then terms that compare a string column with
    literals (Arrow's kernels, no copy into Polars), then other string terms (Polars)."""
    table = _wide(1000)
    steps = [
        P.Filter(strings & (f("k") < cut) & pc.scalar(True), frozenset(["s", "t", "k"])),
        P.Project((P.Output("v", f("v"), frozenset(["v"]), "v"), P.Output("k", f("k"), frozenset(["k"]), "k"))),
    ]
    compiled = PP.compile_steps(table.schema, steps)
    kind, (stages, _refs, keep) = compiled.parts[0]
    assert kind == "filter" and sorted(stages[0].refs) == ["k"]
    assert [st.kind for st in stages] == engines
    assert set(keep) == {"k", "v"}  # the strings are not carried past the filter
    got, want = compiled.run(table), P._acero(table, steps)
    assert _same(got, want) and want.num_rows > 0, (got.num_rows, want.num_rows)


COMPUTED = {
    "sum": pc.add(f("i"), f("j")),
    "checked_float": f("x") * 2.0 + f("i"),
    "float_mul": pc.multiply(f("x"), pc.subtract(pc.scalar(1.0), f("x"))),
    "int_mul": pc.multiply(f("i"), 3),
    "div_float": pc.divide(f("x"), f("i")),
    "div_by_float_literal": pc.divide(f("i"), 7.0),
    "neg": pc.negate(f("i")),
    "abs": pc.abs(f("i")),
    "year": pc.year(f("d")),
    "month": pc.month(f("d")),
    "cast": f("j").cast(pa.float64()),
    "case": pc.if_else(pc.match_like(f("s"), "PROMO%"), f("x"), 0.0),
    "fill": pc.coalesce(f("i"), pc.scalar(0)),
    "prefix": pc.utf8_slice_codeunits(f("s"), 0, 3),
    "flag": f("s").isin(["a_b"]),
    "cmp": f("x") > 1.0,
    "nan_eq": f("x") == f("x"),
    "nan_ne": f("x") != 2.5,
    "nan_le": pc.less_equal(pc.multiply(f("x"), 1.0), f("i")),
}


def test_computed_columns_equal_acero_s_values_and_types(table):
    schema = table.schema
    outputs = [P.Output(n, f(n), frozenset([n]), n) for n in ("s", "i")]
    outputs += [P.computed(name, expr, schema) for name, expr in COMPUTED.items()]
    step = P.Project(tuple(outputs))
    got, want = _both(table, [step])
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert _same(got, want), {
        c: (got[c].to_pylist(), want[c].to_pylist()) for c in got.column_names if not got[c].equals(want[c])
    }


def test_a_chain_of_filters_and_projections_over_renamed_columns(table):
    schema = table.schema
    renamed = P.Project(tuple(P.Output(n2, f(n), frozenset([n]), n) for n, n2 in [("i", "k"), ("x", "v"), ("s", "s")]))
    mid = pa.schema([("k", pa.int64()), ("v", pa.float64()), ("s", pa.string())])
    steps = [
        P.Filter(f("j") > 0, frozenset(["j"])),
        renamed,
        P.Filter(pc.match_like(f("s"), "%e%"), frozenset(["s"])),
        P.Project((P.computed("w", f("v") * 2.0, mid), P.Output("k", f("k"), frozenset(["k"]), "k"))),
    ]
    got, want = _both(table, steps)
    assert _same(got, want)
    assert PP.compile_steps(schema.empty_table().schema, steps) is not None


def test_an_empty_table_keeps_its_schema(table):
    empty = table.schema.empty_table()
    step = P.Project((P.computed("r", pc.divide(f("x"), 2.0), table.schema),))
    got, want = _both(empty, [P.Filter(f("i") > 1, frozenset(["i"])), step])
    assert got.schema.equals(want.schema) and got.num_rows == 0


@pytest.mark.parametrize(
    "expr",
    [pc.divide(f("i"), 3), pc.power(f("x"), 2), f("i") + f("j"), pc.utf8_upper(f("s")) == "A"],
    ids=["integer division", "power", "checked integer add (overflow must fail)", "utf8_upper"],
)
def test_what_it_cannot_rebuild_runs_in_acero(table, expr):
    step = P.Project((P.computed("r", expr, table.schema),))
    with pytest.raises(PP.Untranslatable):
        PP.compile_steps(table.schema, [step])
    # and the pipeline still gives Acero's answer
    assert _same(
        P.Pipeline(table, (step,), P._acero(table.schema.empty_table(), [step]).schema).run(), P._acero(table, [step])
    )


def test_explain_names_the_engine(table):
    pipe = P.Pipeline(table).then(P.Filter(f("i") > 1, frozenset(["i"])), table.schema)
    assert pipe.describe()[0].endswith("[Polars]")
    upper = pc.utf8_upper(f("s")) == "A"
    pipe = P.Pipeline(table).then(P.Filter(upper, frozenset(["s"])), table.schema)
    assert pipe.describe()[0].endswith("[Acero]")


def test_the_expression_tree_names_the_columns_read():
    expr = (f("a") > 1) & pc.match_like(f("b"), "%x%") | f("c").isin([1, 2])
    assert PP.columns_read(expr) == {"a", "b", "c"}


# ---- the same, as SQL fused into a DuckDB query ----------------------------------------------
def _sql(table: pa.Table, steps: list[P.Step], wanted: list[str]) -> pa.Table:
    lazy = PS.SqlInput(table, PS.pipeline_sql(table.schema, steps, wanted), table.schema)
    return kernels.run_sql("SELECT * FROM __px_t", __px_t=lazy)


def _values(t: pa.Table) -> dict:
    return {
        c: [("NaN" if v != v else v) if isinstance(v, float) else v for v in t[c].to_pylist()] for c in t.column_names
    }


@pytest.mark.parametrize("expr", FILTERS, ids=[str(e)[:60] for e in FILTERS])
def test_a_filter_fused_into_sql_keeps_the_rows_acero_keeps(table, expr):
    steps = [P.Filter(expr, P.references(expr, table.schema))]
    got = _sql(table, steps, table.column_names)
    assert _values(got) == _values(P._acero(table, steps))


@pytest.mark.parametrize("text", ["{src}", "{j0}", "{", "}}"])
def test_braces_in_a_literal_or_a_name_stay_text_in_sql(table, text):
    """The fused query is a template whose placeholders name its tables: a string literal or
    a column name holding braces must not be read as one."""
    expr = (f("s") != text) & ~pc.match_like(f("s"), f"%{text}%")
    steps = [P.Filter(expr, P.references(expr, table.schema))]
    assert _values(_sql(table, steps, table.column_names)) == _values(P._acero(table, steps))
    named = table.rename_columns([f"{c}{text}" if c == "s" else c for c in table.column_names])
    step = P.passthrough(named.column_names)
    assert _sql(named, [step], named.column_names).column_names == named.column_names


def test_computed_columns_in_sql_equal_acero_s_values(table):
    schema = table.schema
    outputs = [P.Output(n, f(n), frozenset([n]), n) for n in ("s", "i")]
    # unchecked integer arithmetic is left to Arrow (it wraps where DuckDB fails): tested below
    sql_computed = {k: v for k, v in COMPUTED.items() if k not in ("sum", "int_mul")}
    outputs += [P.computed(name, expr, schema) for name, expr in sql_computed.items()]
    step = P.Project(tuple(outputs))
    want = P._acero(table, [step])
    got = kernels.restore_types(_sql(table, [step], want.column_names), want.schema)
    assert got.schema.equals(want.schema)
    assert _values(got) == _values(want)


@pytest.mark.parametrize(
    "expr",
    [pc.divide(f("i"), 3), pc.add(f("i"), 1), pc.utf8_upper(f("s")) == "A"],
    ids=["integer division", "unchecked integer add (Arrow wraps, DuckDB fails)", "utf8_upper"],
)
def test_what_sql_cannot_rebuild_is_not_fused(table, expr):
    step = P.Project((P.computed("r", expr, table.schema),))
    with pytest.raises(PS.Untranslatable):
        PS.pipeline_sql(table.schema, [step], ["r"])
    assert P.Pipeline(table, (step,), P._acero(table.schema.empty_table(), [step]).schema).sql_input(["r"]) is None


# ---- the join kernel: Polars where every column's type comes back unchanged, else DuckDB -------
def _join_sides() -> tuple[pa.Table, pa.Table]:
    nan, null = float("nan"), None
    left = pa.table(
        {
            "x": pa.array([1.0, nan, null, -0.0, 2.0, nan, 7.0], pa.float64()),
            "s": pa.array(["a", "b", None, "", "a", "b", "zz"]),
            "__px_r0": pa.array([1, 2, 3, 4, 5, 6, 7], pa.int32()),  # the name the right's first column gets
            "d": _dates("1994-01-01 - 1995-03-15 1998-09-02 1993-07-01 1996-12-31 1994-06-30"),
        }
    )
    right = pa.table(
        {
            "y": pa.array([1.0, nan, null, 0.0, 3.0, 1.0], pa.float64()),
            "t": pa.array(["a", "b", None, "", "q", "a"]),
            "w": pa.array([10, 20, 30, 40, 50, 60], pa.int64()),
        }
    )
    return left, right


def _values(t: pa.Table) -> list[tuple]:
    rows = [tuple(("NaN" if isinstance(v, float) and v != v else v) for v in r.values()) for r in t.to_pylist()]
    return sorted(rows, key=repr)


@pytest.mark.parametrize("how", ["inner", "left", "right", "outer", "semi", "anti"])
@pytest.mark.parametrize("keys", [(["x"], ["y"]), (["x", "s"], ["y", "t"])], ids=["float key", "float and string keys"])
@pytest.mark.parametrize("big_right", [False, True], ids=["small right: Polars", "big right: DuckDB"])
def test_the_join_kernel_matches_null_safe_sql_nan_and_signed_zero_included(how, keys, big_right, monkeypatch):
    if big_right:  # the right side counts as over the size Polars' join table is kept for
        monkeypatch.setattr(kernels, "_POLARS_JOIN_MAX_RIGHT", 3)
    left, right = _join_sides()
    lk, rk = keys
    cond = " AND ".join(f'l."{a}" IS NOT DISTINCT FROM r."{b}"' for a, b in zip(lk, rk))
    sides = "l.*" if how in ("semi", "anti") else "l.*, r.*"
    join = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "outer": "FULL JOIN"}.get(
        how, how.upper() + " JOIN"
    )
    want = kernels.run_sql(f"SELECT {sides} FROM L l {join} R r ON {cond}", L=left, R=right)
    # these types go to Polars, but for the joins that keep every row of the right
    assert (kernels._polars_join(left, right, lk, rk, how) is None) == (big_right or how in ("right", "outer"))
    got = kernels.join(left, right, lk, rk, how)
    assert got.schema.equals(pa.schema(list(left.schema) + ([] if how in ("semi", "anti") else list(right.schema))))
    assert _values(got) == _values(want)


def _lookup_sides(kind: str, duplicate: bool) -> tuple[pa.Table, pa.Table]:
    """One key column of ``kind`` with nulls on both sides, over two chunks on the left;
    the right's keys distinct (a null among them) unless ``duplicate``."""
    values = {
        "int": pa.array([3, 1, None, 7, 1, 5, 2, None, 9], pa.int32()),
        "string": pa.array(["c", "a", None, "", "a", "e", "b", None, "zz"]),
        "date": _dates("1994-01-03 1994-01-01 - 1998-09-02 1994-01-01 1995-03-15 1993-07-01 - 1999-01-01"),
        "timestamp": pa.array([3, 1, None, 7, 1, 5, 2, None, 9], pa.int64()).cast(pa.timestamp("us", "UTC")),
        "bool": pa.array([True, False, None, True, None, False, True, None, False]),
    }[kind]
    right_at = [1, 3, 2, 6, 5] if kind != "bool" else [1, 0, 2]  # a null key among them
    if duplicate:
        right_at = right_at + right_at[:1]
    left = pa.Table.from_batches(
        [
            pa.record_batch({"k": values.slice(0, 4), "v": pa.array(range(4))}),
            pa.record_batch({"k": values.slice(4), "v": pa.array(range(4, len(values)))}),
        ]
    )
    right = pa.table({"rk": values.take(right_at), "w": pa.array([f"w{i}" for i in range(len(right_at))])})
    return left, right


@pytest.mark.parametrize("how", ["inner", "left", "semi", "anti"])
@pytest.mark.parametrize("kind", ["int", "string", "date", "timestamp", "bool"])
@pytest.mark.parametrize("duplicate", [False, True], ids=["distinct right keys", "a right key twice"])
def test_a_join_on_one_key_with_a_small_right_side_by_lookup_matches_null_safe_sql(how, kind, duplicate):
    """Arrow's hash lookup joins one key against a small right side (its keys distinct, or any
    for semi/anti): the rows, nulls matching nulls, and the columns DuckDB's null-safe join
    gives; a right key on two rows is left to the hash join (a row per match)."""
    left, right = _lookup_sides(kind, duplicate)
    join = {"inner": "JOIN", "left": "LEFT JOIN"}.get(how, how.upper() + " JOIN")
    sides = "l.*" if how in ("semi", "anti") else "l.*, r.*"
    want = kernels.run_sql(f"SELECT {sides} FROM L l {join} R r ON l.k IS NOT DISTINCT FROM r.rk", L=left, R=right)
    looked_up = kernels._index_join(left, right, ["k"], ["rk"], how)
    assert (looked_up is None) == (duplicate and how in ("inner", "left"))
    got = kernels.join(left, right, ["k"], ["rk"], how)
    assert got.schema.equals(pa.schema(list(left.schema) + ([] if how in ("semi", "anti") else list(right.schema))))
    assert _values(got) == _values(want.cast(got.schema))
    if looked_up is not None and how in ("left", "semi", "anti"):
        assert got.column("v").to_pylist() == sorted(got.column("v").to_pylist())  # the left's order


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("unique", ["first", "second", "neither"])
def test_a_lookup_join_on_two_keys_finds_the_row_by_the_distinct_one_and_compares_the_other(how, unique):
    """Two keys, one of them distinct on the right (a supplier's key beside its nation, TPC-H
    Q5): the row found by that key counts only where the other key holds the same value too
    (null matching null); the rows and columns DuckDB's null-safe join gives.  Where neither
    right key is distinct, the hash join's."""
    rng = np.random.default_rng(12)
    n = 400
    a = pa.array(rng.integers(0, 60, n), mask=rng.random(n) < 0.05)
    b = pa.array(rng.choice(["x", "y", "z"], n), mask=rng.random(n) < 0.1)
    left = pa.table({"a": a, "b": b, "v": np.arange(n)})
    distinct = pa.array(list(range(50)) + [None])
    repeated = pa.array(["x", "y", None] * 17)
    if unique == "first":
        right = pa.table({"ra": distinct, "rb": repeated})
    elif unique == "second":
        right = pa.table({"ra": pa.array(list(range(17)) * 3), "rb": pa.array([f"k{i}" for i in range(51)])})
        left = left.set_column(1, "b", pa.array([f"k{i}" for i in rng.integers(0, 60, n)]))
    else:
        right = pa.table({"ra": pa.array(list(range(25)) * 2 + [None]), "rb": repeated})
    right = right.append_column("w", pa.array([f"w{i}" for i in range(right.num_rows)]))
    join = "JOIN" if how == "inner" else "LEFT JOIN"
    on = "l.a IS NOT DISTINCT FROM r.ra AND l.b IS NOT DISTINCT FROM r.rb"
    want = kernels.run_sql(f"SELECT l.*, r.* FROM L l {join} R r ON {on}", L=left, R=right)
    looked_up = kernels._index_join(left, right, ["a", "b"], ["ra", "rb"], how)
    assert (looked_up is None) == (unique == "neither")
    got = kernels.join(left, right, ["a", "b"], ["ra", "rb"], how)
    assert got.schema.equals(pa.schema(list(left.schema) + list(right.schema)))
    assert _values(got) == _values(want.cast(got.schema))


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("keys", [["a"], ["a", "b"]], ids=["one key", "two keys"])
def test_an_inner_join_looks_the_right_rows_up_among_a_left_side_with_distinct_keys(how, keys):
    """The right's keys repeat (an order's lines) and the left's are distinct (the orders,
    TPC-H Q7): an inner join looks each right row up among the left's, with DuckDB's rows and
    the merge's columns (the left's first); a left join cannot (its unmatched left rows)."""
    rng = np.random.default_rng(13)
    left = pa.table(
        {
            "a": pa.array(list(range(300)) + [None]),
            "b": pa.array(rng.choice(["x", "y", None], 301)),
            "v": np.arange(301),
        }
    )
    n = 2_000
    right = pa.table(
        {
            "ra": pa.array(rng.integers(-20, 320, n), mask=rng.random(n) < 0.02),
            "rb": pa.array(rng.choice(["x", "y", None], n)),
            "w": pa.array([f"w{i}" for i in range(n)]),
        }
    )
    rkeys = ["r" + k for k in keys]
    on = " AND ".join(f"l.{k} IS NOT DISTINCT FROM r.{r}" for k, r in zip(keys, rkeys))
    join = "JOIN" if how == "inner" else "LEFT JOIN"
    want = kernels.run_sql(f"SELECT l.*, r.* FROM L l {join} R r ON {on}", L=left, R=right)
    assert (kernels._index_join(left, right, keys, rkeys, how) is None) == (how == "left")
    got = kernels.join(left, right, keys, rkeys, how)
    assert got.schema.equals(pa.schema(list(left.schema) + list(right.schema)))
    assert _values(got) == _values(want.cast(got.schema))


def test_a_lookup_join_on_a_key_both_sides_name_alike_keeps_it_once():
    left, right = _lookup_sides("int", False)
    right = right.rename_columns(["k", "w"])
    got = kernels._index_join(left, right, ["k"], ["k"], "left")
    assert got is not None and got.column_names == ["k", "v", "w"]
    # right keys 1, 7, null, 2, 5 are w0..w4
    expected = [None, "w0", "w2", "w1", "w0", "w4", "w3", "w2", None]
    assert got.column("k").equals(left.column("k")) and got.column("w").to_pylist() == expected


def test_a_join_over_a_type_polars_would_change_runs_in_duckdb():
    left, right = _join_sides()
    right = right.append_column("m", pa.array([1, 2, 3, 4, 5, 6], pa.decimal128(12, 2)))
    assert kernels._polars_join(left, right, ["x"], ["y"], "inner") is None
    got = kernels.join(left, right, ["x"], ["y"], "inner")
    assert got.schema.field("m").type == pa.decimal128(12, 2)
    assert _values(got.select(["x", "w"])) == _values(
        pa.table({"x": [1.0, 1.0, float("nan"), float("nan"), None, -0.0], "w": [10, 60, 20, 20, 30, 40]})
    )


# ---- a join with a table on every rank: the filter before it keeps only rows with a match ----
def _keyed(n: int, kind: pa.DataType) -> pa.Table:
    """n rows: ``k`` cycling 0..49 in ``kind`` (every 9th null), ``v`` 0..n-1, ``s`` strings."""
    return pa.table(
        {
            "k": pa.array([None if i % 9 == 4 else i % 50 for i in range(n)], kind),
            "v": pa.array(range(n), pa.int64()),
            "s": pa.array([f"s{i % 7}" for i in range(n)]),
        }
    )


@pytest.mark.parametrize("how", ["inner", "semi"])
@pytest.mark.parametrize(
    "before",
    ["a filter", "a filter, then a rename", "no filter", "a computed key"],
)
@pytest.mark.parametrize(
    "right_keys",
    [
        pa.array([3, 7, 7, 11, 60], pa.int64()),
        pa.array([3, None, 11], pa.int64()),
        pa.array([3, 2**40, 11], pa.int64()),
        pa.array([], pa.int64()),
    ],
    ids=["some keys, one twice", "a null key (matches the left's nulls)", "beyond int32", "no keys"],
)
@pytest.mark.parametrize(
    "rows, cut",
    [(600, 40), (70_000, 35_000), (70_000, 63_000)],
    ids=["short", "long: a lookup table", "long, the filter keeps a tenth: the lookup over those"],
)
def test_a_join_after_a_filter_keeps_the_rows_sql_keeps(how, before, right_keys, rows, cut):
    left = _keyed(rows, pa.int32())
    right = pa.table({"rk": right_keys, "w": pa.array([f"w{i}" for i in range(len(right_keys))])})
    key = "k"
    steps: list[P.Step] = []
    if before != "no filter":
        steps.append(P.Filter(f("v") > cut, frozenset(["v"])))
    if before == "a filter, then a rename":
        key = "k2"
        steps.append(
            P.Project((P.Output("k2", f("k"), frozenset(["k"]), "k"), P.Output("v", f("v"), frozenset(["v"]), "v")))
        )
    if before == "a computed key":
        key = "k2"
        steps.append(
            P.Project((P.Output("k2", f("k") + 0, frozenset(["k"])), P.Output("v", f("v"), frozenset(["v"]), "v")))
        )
    left_out = ("v", key) if before != "no filter" else ("k", "v", "s")
    right_out = () if how == "semi" else ("w",)
    steps.append(P.Join(right, (key,), ("rk",), how, left_out, right_out))
    schema = pa.schema(
        [
            *(pa.field(c, pa.int64() if c in ("v", "k2") else left.schema.field(c).type) for c in left_out),
            *(right.schema.field(c) for c in right_out),
        ]
    )
    got = P._apart(left, list(steps)).select(schema.names)

    # the reference: DuckDB over the same rows, the filter and rename as SQL
    where = f"WHERE v > {cut}" if before != "no filter" else ""
    k_expr = {"a computed key": "k + 0", "a filter, then a rename": "k"}.get(before, "k")
    inner = f"SELECT {k_expr} AS {key}, v, s FROM L {where}"
    cols = ", ".join(f"l.{c}" for c in left_out) + "".join(f", r.{c}" for c in right_out)
    sql = f"SELECT {cols} FROM ({inner}) l {'SEMI JOIN' if how == 'semi' else 'JOIN'} R r ON l.{key} IS NOT DISTINCT FROM r.rk"
    want = kernels.run_sql(sql, L=left, R=right)
    assert got.num_rows == want.num_rows and _values(got) == _values(want.cast(got.schema, safe=False)), (
        got.num_rows,
        want.num_rows,
    )
    # where the key passes from the filter unchanged, the filter is where the membership test goes
    assert P._at_last_filter(steps[:-1], key) == ({"a filter": "k", "a filter, then a rename": "k"}.get(before))


@pytest.mark.parametrize("name", ["o_key", "k"], ids=["keys named apart", "a key both sides name alike"])
def test_an_inner_join_of_a_sorted_key_by_its_runs_keeps_the_rows_sql_keeps(name):
    from phalanx.operators import membership

    rng = np.random.default_rng(11)
    n = membership.MIN_ROWS * 2
    keys = np.repeat(np.arange(n), rng.integers(1, 8, n))[:n]  # sorted, 1-7 rows each (lines of orders)
    left = pa.table({"k": keys, "v": rng.integers(0, 100, n), "s": pa.array([f"s{i % 13}" for i in range(n)])})
    picked = rng.permutation(np.arange(-10, n + 10, 5))[: n // 40]  # unsorted, some outside the keys
    right = pa.table({name: picked, "w": pa.array([f"w{i}" for i in range(len(picked))])})
    right = pa.concat_tables([right.slice(0, 1_000), right.slice(1_000)])  # two chunks
    right_out = ("w",) if name == "k" else (name, "w")
    steps: list[P.Step] = [P.Join(right, ("k",), (name,), "inner", ("k", "v", "s"), right_out)]
    with P.recording() as notes:
        got = P._apart(left, steps)
    assert any("per-rank join (sorted runs)" in n for n in notes)
    assert got.column_names == ["k", "v", "s", *right_out]
    cols = ", ".join(f"r.{c}" for c in right_out)
    want = kernels.run_sql(
        f"SELECT l.k, l.v, l.s, {cols} FROM L l JOIN R r ON l.k = r.{name}",
        L=left,
        R=right,
    )
    assert got.num_rows == want.num_rows > 0
    assert _values(got) == _values(want.cast(got.schema))
    assert got.column("k").to_numpy().tolist() == sorted(got.column("k").to_numpy().tolist())  # the left's order


def test_an_inner_join_of_increasing_keys_against_repeating_ones_keeps_the_rows_sql_keeps():
    rng = np.random.default_rng(12)
    n = 20_000
    ids = np.cumsum(rng.integers(1, 4, n))  # orders by key: each once, increasing
    left = pa.table({"o_key": ids, "c": rng.integers(0, 50, n), "s": pa.array([f"o{i % 17}" for i in range(n)])})
    left = pa.concat_tables([left.slice(0, 7_000), left.slice(7_000)])  # two chunks
    lines = rng.choice(ids, 30_000)  # each order's lines, repeating, unsorted; some keys matching nothing
    right = pa.table({"l_key": np.concatenate([lines, [-5, ids.max() + 1]]), "q": np.arange(30_002)})
    right = pa.concat_tables([right.slice(0, 10_000), right.slice(10_000)])  # two chunks
    steps: list[P.Step] = [P.Join(right, ("o_key",), ("l_key",), "inner", ("o_key", "c", "s"), ("l_key", "q"))]
    with P.recording() as notes:
        got = P._apart(left, steps)
    assert any("binary search of increasing keys" in n for n in notes)
    want = kernels.run_sql(
        "SELECT l.o_key, l.c, l.s, r.l_key, r.q FROM L l JOIN R r ON l.o_key = r.l_key", L=left, R=right
    )
    assert got.column_names == ["o_key", "c", "s", "l_key", "q"]
    assert got.num_rows == want.num_rows == 30_000
    assert _values(got) == _values(want.cast(got.schema))


def test_rows_taken_batch_by_batch_equal_arrow_s_take():
    # columns chunked apart from each other, an empty chunk, strings and nulls
    a = pa.chunked_array([pa.array(range(0, 5)), pa.array([], pa.int64()), pa.array(range(5, 12))])
    s = pa.chunked_array([pa.array([f"s{i}" if i % 4 else None for i in range(7)]), pa.array(["x"] * 5)])
    table = pa.table({"a": a, "s": s})
    for rows in ([], [0], [4, 5, 6, 11], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [6, 6, 7]):
        got = kernels.take_ascending(table, np.asarray(rows, dtype=np.int64))
        assert got.equals(table.take(pa.array(rows, pa.int64()))), rows
    one_chunk = table.combine_chunks()
    assert kernels.take_ascending(one_chunk, np.array([3, 9])).equals(one_chunk.take([3, 9]))
