"""``concat``, ``value_counts`` and ``pivot`` against pandas / DuckDB at 1-4 ranks (skewed keys,
nulls, strings, timestamps, a rank with no rows), and their errors."""

from __future__ import annotations

import copy

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from reference import assert_same_rows, make_part, whole

import phalanx as px

# 1-4 ranks against DuckDB/pandas: the slow lane (two workers), outside the core lane's 5 minutes
pytestmark = pytest.mark.slow

ROWS = 1000


def frame(env, seed=0, rows=ROWS):
    return px.DataFrame.from_arrow(make_part(env.rank, env.world_size, rows, seed), env)


def sql(query: str, **tables) -> pa.Table:
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con.sql(query).to_arrow_table()


# ---- concat ------------------------------------------------------------------------------------
def _b(t: pa.Table) -> pa.Table:
    """The second input: key as int32, w as float, no s, an extra column."""
    return pa.table(
        {
            "extra": pa.array([f"x{i}" for i in range(t.num_rows)], pa.string()),
            "w": t["w"].cast(pa.float64()),
            "key": t["key"].cast(pa.int32()),
        }
    )


def app_concat(env):
    a = frame(env).select(["key", "w", "s", "ts"])
    b = px.DataFrame.from_arrow(_b(make_part(env.rank, env.world_size, ROWS, 1)), env)
    both = px.concat([a, b, a.head(3)])
    placed = a.shuffle("key").concat(a.shuffle("key"))
    mixed = px.concat([a.shuffle("key"), b.shuffle("key")])  # key's type changes: no longer placed
    local = [f.local_num_rows for f in (a, b, both)]
    return both.collect(root=0), both.to_arrow(), local, placed.partitioned_by, mixed.partitioned_by


def test_concat_unifies_columns_and_types(gang):
    n = gang.world_size
    results = gang.run(app_concat)
    got, _, _, placed, mixed = results[0]
    a = whole(n, ROWS).select(["key", "w", "s", "ts"])
    b = pa.concat_tables([_b(make_part(r, n, ROWS, 1)) for r in range(n)])
    want = pa.concat_tables([a, b, a.slice(0, 3)], promote_options="permissive")
    assert got.schema == pa.schema(
        [
            ("key", pa.int64()),
            ("w", pa.float64()),
            ("s", pa.string()),
            ("ts", pa.timestamp("us")),
            ("extra", pa.string()),
        ]
    )
    assert_same_rows(got, want.select(got.column_names))
    for rank, (_, local, (na, nb, nboth), _, _) in enumerate(results):  # no row moved
        assert (
            local.num_rows
            == nboth
            == na + nb + (min(3, max(0, 3 - sum(make_part(r, n, ROWS).num_rows for r in range(rank)))))
        )
        assert local["extra"].null_count == na + (nboth - na - nb)
    assert placed == ("key",) and mixed is None


def app_concat_errors(env):
    a = frame(env)
    errors = []
    for call in (
        lambda: px.concat([a, a.assign(w=pc.field("w").cast(pa.string()))]),
        lambda: px.concat([a, px.DataFrame(a.to_arrow(), copy.copy(env))]),
        lambda: px.concat(a),
        lambda: px.concat([]),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    return errors


def test_concat_errors_name_the_frame_and_column(gang):
    types, gangs, single, empty = gang.run(app_concat_errors)[0]
    assert "column 'w' is int64 in frame 0 but string in frame 1" in types
    assert "frame 1 belongs to another gang" in gangs
    assert "needs a list of DataFrames" in single
    assert "one or more" in empty


# ---- value_counts ------------------------------------------------------------------------------
def app_value_counts(env):
    df = frame(env)
    return (
        df.value_counts(["s", "b"]).collect(root=0),
        df.value_counts("key", normalize=True, dropna=False).collect(root=0),
        df.value_counts("s", sort=False).collect(root=0),
        df.value_counts(["s", "b"], ascending=True).collect(root=0),
    )


def test_value_counts_matches_duckdb(gang):
    counts, shares, unsorted, rising = gang.run(app_value_counts)[0]
    t = whole(gang.world_size, ROWS)
    want = sql(
        "SELECT s, b, COUNT(*) AS count FROM t WHERE s IS NOT NULL AND b IS NOT NULL GROUP BY s, b "
        "ORDER BY count DESC, s ASC NULLS LAST, b ASC NULLS LAST",
        t=t,
    )
    assert counts.equals(want.cast(counts.schema))  # sorted: the same order
    up = sql("SELECT * FROM w ORDER BY count ASC, s ASC NULLS LAST, b ASC NULLS LAST", w=want)
    assert rising.equals(up.cast(rising.schema))
    total = t.num_rows
    want = sql(
        f"SELECT key, COUNT(*) / {total}.0 AS proportion FROM t GROUP BY key ORDER BY proportion DESC, key NULLS LAST",
        t=t,
    )
    assert shares.column_names == ["key", "proportion"] and shares["key"].null_count == 1
    assert_same_rows(shares, want.cast(shares.schema))
    assert shares["proportion"].to_pylist() == sorted(shares["proportion"].to_pylist(), reverse=True)
    assert_same_rows(unsorted, sql("SELECT s, COUNT(*) AS count FROM t WHERE s IS NOT NULL GROUP BY s", t=t))


# ---- pivot -------------------------------------------------------------------------------------
PIVOT_ROWS = 400  # about 100 distinct keys: a pivot on key makes 100 columns


def app_pivot(env, specs):
    df = frame(env, rows=PIVOT_ROWS)
    out = []
    for index, columns, values, aggfunc, *fill in specs:
        p = df.pivot(index, columns, values, aggfunc=aggfunc, fill_value=fill[0] if fill else None)
        out.append((p.collect(root=0), p.partitioned_by))
    return out


def expected_pivot(t: pa.Table, index, columns, values, aggfunc, fill=None) -> pa.Table:
    index, values = ([index] if isinstance(index, str) else index), ([values] if isinstance(values, str) else values)
    p = t.to_pandas().dropna(subset=[*index, columns])
    wide = p.groupby([*index, columns])[values].agg(aggfunc).unstack(columns)
    if fill is not None:  # pandas' pivot_table: every missing cell (no rows, NaN) filled
        wide = wide.fillna(fill)
    whole_numbers = pa.types.is_integer(t.schema.field(columns).type)  # pandas made them floats (nulls)
    labels = [str(int(d)) if whole_numbers else str(d) for _, d in wide.columns]
    wide.columns = [lab if len(values) == 1 else f"{v}_{lab}" for (v, _), lab in zip(wide.columns, labels)]
    return pa.Table.from_pandas(wide.reset_index(), preserve_index=False)


PIVOTS = [
    ("key", "s", "v", "sum"),
    ("key", "s", "v", "mean"),
    (["b", "key"], "s", ["v", "w"], "count"),
    ("key", "b", "w", "min"),
    ("s", "key", "ts", "max"),
    ("key", "s", "v", "first"),
]


FILLED = [
    ("key", "s", "v", "mean", 0.0),  # all-null groups (NaN in pandas) and absent cells
    (["b", "key"], "s", ["v", "w"], "sum", -1),
    ("key", "b", "w", "count", 0),
    ("key", "s", "v", "std", -1.5),  # one-row groups: null std, filled
    ("key", "s", "w", "median", 0.25),
]


@pytest.mark.parametrize(
    "specs", [PIVOTS[:3], PIVOTS[3:], FILLED], ids=["sum-mean-count", "min-max-first", "fill_value"]
)
def test_pivot_matches_pandas(gang, specs):
    results = gang.run(app_pivot, specs)[0]
    t = whole(gang.world_size, PIVOT_ROWS)
    for (index, columns, values, aggfunc, *fill), (got, placed) in zip(specs, results):
        want = expected_pivot(t, index, columns, values, aggfunc, *fill)
        assert got.column_names == want.column_names, (aggfunc, got.column_names, want.column_names)
        assert_same_rows(
            got, want.cast(pa.schema([pa.field(f.name, got.schema.field(f.name).type) for f in want.schema]))
        )
        keys = [index] if isinstance(index, str) else index
        assert placed is not None and set(placed) <= set(keys)
        if fill:  # no cell left missing
            assert sum(got[c].null_count for c in got.column_names if c not in keys) == 0
            assert any(fill[0] in got[c].to_pylist() for c in got.column_names if c not in keys)


def app_pivot_errors(env):
    df = frame(env)
    errors = []
    for call in (
        lambda: df.concat(frame(env, seed=1)).pivot("key", "v", "w"),  # thousands of distinct values
        lambda: df.pivot("key", "s", "v", aggfunc="product"),
        lambda: df.pivot("key", ["s", "b"], "v"),
        lambda: df.pivot("key", "s", "key"),
        lambda: df.pivot("key", "s", "nope"),
        lambda: df.pivot("key", "s", "w", aggfunc="count", fill_value=0.5),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError, KeyError) as exc:
            errors.append(str(exc))
    return errors


def test_pivot_bad_inputs(gang):
    errors = gang.run(app_pivot_errors)
    assert all(e == errors[0] for e in errors)  # every rank raised the same, none hung
    many, func, cols, same, missing, fill = errors[0]
    assert "more than 1000 distinct values" in many
    assert "aggfunc must be one of" in func
    assert "one column name" in cols
    assert "must be distinct columns" in same
    assert "'nope'" in missing
    assert "fill_value=0.5 does not fit the cells of count('w'), which are int64" in fill
