"""Every operator against an independent reference (DuckDB or pandas), at 1-4 ranks, on data
with skewed keys, nulls, strings, timestamps and a rank that holds no rows."""

from __future__ import annotations

import io
from contextlib import contextmanager

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from reference import assert_same_rows, gid_table, make_part, whole

import phalanx as px

JOIN_HOT = 0.02  # a hot key on both sides of a join multiplies: keep its output small


def frame(env, seed=0, rows=4000, hot=0.3):
    return px.DataFrame.from_arrow(make_part(env.rank, env.world_size, rows, seed, hot), env)


def gathered(results):
    """Rank 0's collected table (apps return ``df.collect(root=0)``)."""
    return results[0]


def sql(query: str, **tables) -> pa.Table:
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con.sql(query).to_arrow_table()


# ---- construction, collect, sizes ---------------------------------------------------------
def app_roundtrip(env):
    df = frame(env)
    return df.collect(), df.collect(root=0), df.num_rows, df.partition_sizes()


def test_roundtrip_and_sizes(gang):
    n = gang.world_size
    results = gang.run(app_roundtrip)
    expected = whole(n)
    for rank, (everyone, root_only, num_rows, sizes) in enumerate(results):
        assert everyone.equals(expected)
        assert (root_only is not None) == (rank == 0)
        assert num_rows == expected.num_rows
        assert sizes == [make_part(r, n).num_rows for r in range(n)]
    assert results[0][1].equals(expected)


def app_from_pandas(env):
    part = make_part(env.rank, env.world_size).select(["key", "v", "s"]).to_pandas()
    return px.DataFrame.from_pandas(part, env).collect(root=0)


def test_from_pandas_agrees_on_schema_with_an_empty_rank(gang):
    out = gathered(gang.run(app_from_pandas))
    assert_same_rows(out, whole(gang.world_size).select(["key", "v", "s"]))


# ---- local operators ----------------------------------------------------------------------
def app_local(env):
    df = frame(env)
    out = (
        df.filter(pc.field("w") > 0)
        .assign(z=pc.field("w") * 2, c=lambda t: pc.add(t["w"], 1), one=1)
        .filter(lambda t: pc.invert(pc.is_null(t["key"])))
        .rename({"v": "value"})
        .drop(["b", "ts"])
        .add_scalar(10, columns=["w"])
        .select(["key", "value", "w", "s", "z", "c", "one"])
        .map_partitions(lambda t: t.to_pandas().assign(w2=lambda p: p["w"] * 2))
    )
    return out.collect(root=0)


def test_local_operators_match_pandas(gang):
    p = whole(gang.world_size).to_pandas()
    p = p[p["w"] > 0].assign(z=lambda d: d["w"] * 2, c=lambda d: d["w"] + 1, one=1)
    p = p[p["key"].notna()].rename(columns={"v": "value"}).drop(columns=["b", "ts"])
    p["w"] = p["w"] + 10
    p = p[["key", "value", "w", "s", "z", "c", "one"]].assign(w2=lambda d: d["w"] * 2)
    out = gathered(gang.run(app_local))
    expected = pa.Table.from_pandas(p.reset_index(drop=True), preserve_index=False)
    assert_same_rows(out.cast(expected.schema), expected)


def app_arith(env):
    df = frame(env).select(["key", "v", "w"])
    return [(df + 1).collect(root=0), (df * 2).collect(root=0), df.truediv(4, columns="w").collect(root=0)]


def test_scalar_arithmetic_applies_to_numeric_columns(gang):
    plus, times, div = gathered(gang.run(app_arith))
    p = whole(gang.world_size).select(["key", "v", "w"]).to_pandas()
    assert_same_rows(plus, pa.Table.from_pandas(p + 1, preserve_index=False).cast(plus.schema))
    assert_same_rows(times, pa.Table.from_pandas(p * 2, preserve_index=False).cast(times.schema))
    assert div["w"].type == pa.float64()
    assert sorted(div["w"].to_pylist()) == sorted((p["w"] / 4).tolist())


def app_head(env, n):
    return frame(env).head(n).collect(root=0)


@pytest.mark.parametrize("n", [0, 7, 5000, 10**6])
def test_head_is_the_global_first_rows(gang, n):
    out = gathered(gang.run(app_head, n))
    assert out.equals(whole(gang.world_size).slice(0, n))


# ---- shuffle, repartition, drop_duplicates ------------------------------------------------
def app_shuffle(env, on):
    df = frame(env).shuffle(on)
    return df.collect(root=0), df.to_arrow().select(on).to_pylist()


def test_shuffle_keeps_rows_and_colocates_keys(gang):
    for on in (["key"], ["s", "b"]):
        results = gang.run(app_shuffle, on)
        assert_same_rows(results[0][0], whole(gang.world_size))
        seen = {}
        for rank, (_, keys) in enumerate(results):
            for k in keys:
                t = tuple(k.values())
                assert seen.setdefault(t, rank) == rank, f"key {t} on ranks {seen[t]} and {rank}"


def app_repartition(env):
    df = frame(env).repartition()
    return df.collect(root=0), df.local_num_rows


def test_repartition_balances_and_keeps_order(gang):
    results = gang.run(app_repartition)
    assert results[0][0].equals(whole(gang.world_size))
    sizes = [r[1] for r in results]
    assert max(sizes) - min(sizes) <= 1


def app_dedup(env, subset, keep):
    return frame(env).drop_duplicates(subset, keep=keep).collect(root=0)


@pytest.mark.parametrize("subset,keep", [(["key"], "first"), (["key", "s"], "last"), (["s"], False), (None, "first")])
def test_drop_duplicates_matches_pandas(gang, subset, keep):
    out = gathered(gang.run(app_dedup, subset, keep))
    p = whole(gang.world_size).to_pandas()
    expected = p.drop_duplicates(subset=subset, keep=keep).reset_index(drop=True)
    assert_same_rows(out, pa.Table.from_pandas(expected, preserve_index=False).cast(out.schema))


# ---- merge --------------------------------------------------------------------------------
def app_merge(env, how, broadcast, on):
    left = frame(env, seed=1, hot=JOIN_HOT).select(["key", "s", "v", "w"])
    right = frame(env, seed=2, rows=1500, hot=JOIN_HOT).select(["key", "s", "v", "b"])
    return left.merge(right, on=on, how=how, broadcast=broadcast).collect(root=0)


def _null_safe_join_sql(how: str, on: list[str]) -> str:
    cond = " AND ".join(f"l.{k} IS NOT DISTINCT FROM r.{k}" for k in on)
    keys = ", ".join(f"COALESCE(l.{k}, r.{k}) AS {k}" if how in ("right", "outer") else f"l.{k} AS {k}" for k in on)
    lcols = [c for c in ("key", "s", "v", "w") if c not in on]
    rcols = [c for c in ("key", "s", "v", "b") if c not in on]
    both = set(lcols) & set(rcols)
    lsel = ", ".join(f"l.{c} AS {c + '_x' if c in both else c}" for c in lcols)
    rsel = ", ".join(f"r.{c} AS {c + '_y' if c in both else c}" for c in rcols)
    join = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "outer": "FULL JOIN"}[how]
    return f"SELECT {keys}, {lsel}, {rsel} FROM L l {join} R r ON {cond}"


@pytest.mark.parametrize("how", ["inner", "left", "right", "outer"])
@pytest.mark.parametrize("broadcast", [False, None])
def test_merge_matches_null_safe_sql(gang, how, broadcast):
    n = gang.world_size
    for on in (["key"], ["key", "s"]):
        out = gathered(gang.run(app_merge, how, broadcast, on))
        L = whole(n, seed=1, hot=JOIN_HOT).select(["key", "s", "v", "w"])
        R = whole(n, rows=1500, seed=2, hot=JOIN_HOT).select(["key", "s", "v", "b"])
        expected = sql(_null_safe_join_sql(how, on), L=L, R=R)
        assert out.column_names[: len(on)] == on  # keys once, first, as pandas
        assert_same_rows(out, expected)


def app_merge_left_right_on(env):
    left = frame(env, seed=1, hot=JOIN_HOT).select(["key", "w"]).rename({"key": "lk"})
    right = frame(env, seed=2, hot=JOIN_HOT).select(["key", "w"]).rename({"key": "rk"})
    return left.merge(right, left_on="lk", right_on="rk", suffixes=("_l", "_r")).collect(root=0)


def test_merge_left_on_right_on_with_suffixes_matches_pandas(gang):
    out = gathered(gang.run(app_merge_left_right_on))
    L = whole(gang.world_size, seed=1, hot=JOIN_HOT).select(["key", "w"]).to_pandas().rename(columns={"key": "lk"})
    R = whole(gang.world_size, seed=2, hot=JOIN_HOT).select(["key", "w"]).to_pandas().rename(columns={"key": "rk"})
    expected = L.merge(R, left_on="lk", right_on="rk", suffixes=("_l", "_r"))
    assert out.column_names == list(expected.columns)
    assert_same_rows(out, pa.Table.from_pandas(expected, preserve_index=False).cast(out.schema))


def app_merge_int32(env):
    left = frame(env, seed=1, hot=JOIN_HOT).select(["key", "w"])
    right = frame(env, seed=2, hot=JOIN_HOT).select(["key", "v"])
    right = px.DataFrame(right.to_arrow().cast(pa.schema([("key", pa.int32()), ("v", pa.float64())])), env)
    return left.merge(right, on="key", broadcast=False).collect(root=0)


def test_merge_promotes_compatible_key_types(gang):
    out = gathered(gang.run(app_merge_int32))
    L = whole(gang.world_size, seed=1, hot=JOIN_HOT).select(["key", "w"])
    R = whole(gang.world_size, seed=2, hot=JOIN_HOT).select(["key", "v"])
    assert_same_rows(out, sql("SELECT l.key, w, v FROM L l JOIN R r ON l.key IS NOT DISTINCT FROM r.key", L=L, R=R))


# ---- groupby ------------------------------------------------------------------------------
AGG_SQL = """
SELECT {keys},
  COALESCE(SUM(v), 0) AS v_sum, COUNT(v) AS v_count, AVG(v) AS v_mean, MIN(v) AS v_min,
  MAX(v) AS v_max, arg_min(v, gid) FILTER (WHERE v IS NOT NULL) AS v_first,
  arg_max(v, gid) FILTER (WHERE v IS NOT NULL) AS v_last,
  SUM(w) AS w, MIN(s) AS s_min, MAX(ts) AS ts_max, COUNT(*) AS n
FROM T {where} GROUP BY {keys}"""


def app_groupby(env, keys, dropna, combine):
    df = frame(env)
    return (
        df.groupby(keys, dropna=dropna, combine=combine)
        .agg(
            {"v": ["sum", "count", "mean", "min", "max", "first", "last"], "w": "sum"},
            s_min=("s", "min"),
            ts_max=("ts", "max"),
            n=(None, "size"),
        )
        .collect(root=0)
    )


@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("keys,dropna", [(["key"], True), (["key"], False), (["s", "b"], False)])
def test_groupby_matches_duckdb(gang, keys, dropna, combine):
    out = gathered(gang.run(app_groupby, keys, dropna, combine))
    T = gid_table(whole(gang.world_size))
    where = "WHERE " + " AND ".join(f"{k} IS NOT NULL" for k in keys) if dropna else ""
    expected = sql(AGG_SQL.format(keys=", ".join(keys), where=where), T=T)
    assert out.column_names == keys + [
        "v_sum",
        "v_count",
        "v_mean",
        "v_min",
        "v_max",
        "v_first",
        "v_last",
        "w",
        "s_min",
        "ts_max",
        "n",
    ]
    assert out.schema.field("w").type == pa.int64() and out.schema.field("n").type == pa.int64()
    assert_same_rows(out, expected)


def app_groupby_shortcuts(env):
    g = frame(env).select(["key", "v", "w"]).groupby("key")
    return g.sum().collect(root=0), g.size().collect(root=0)


def test_groupby_shortcuts_match_pandas(gang):
    sums, sizes = gathered(gang.run(app_groupby_shortcuts))
    p = whole(gang.world_size).select(["key", "v", "w"]).to_pandas()
    exp_sum = p.groupby("key").sum().reset_index()
    exp_size = p.groupby("key").size().rename("size").reset_index()
    assert_same_rows(sums, pa.Table.from_pandas(exp_sum, preserve_index=False).cast(sums.schema))
    assert_same_rows(sizes, pa.Table.from_pandas(exp_size, preserve_index=False).cast(sizes.schema))


# the aggregations Arrow's hash aggregation runs (arrow_agg), over every key type it takes
ARROW_AGG_SQL = """
SELECT {keys}, COALESCE(SUM(v), 0) AS v_sum, COUNT(v) AS v_count, AVG(v) AS v_mean,
  COALESCE(SUM(big), 0) AS big_sum, AVG(big) AS big_mean, MIN(w) AS w_min, MAX(d) AS d_max,
  COUNT(s) AS s_count, COUNT(*) AS n, MIN(f) AS f_min, MAX(f) AS f_max
FROM T {where} GROUP BY {keys}"""


def arrow_agg_part(rank: int, world: int) -> pa.Table:
    """``make_part`` with dates (``d``) and int64s near 2^60 (``big``): on rank 0 only, where
    three of them summed could leave int64, so that rank's steps fall back to DuckDB while the
    others' run in Arrow (their per-group sums stay inside int64: each key has <= 2 such rows)."""
    t = make_part(rank, world, rows=3000)
    n = t.num_rows
    rng = np.random.default_rng(11 + rank)
    big = rng.integers(-100, 100, n)
    if rank == 0 and n:
        big[:2] = [2**60 + 7, -(2**60) - 3]  # two keys, one row each: no group sum overflows
    t = t.append_column("big", pa.array(big, pa.int64(), mask=rng.random(n) < 0.1))
    days = rng.integers(0, 3000, n).astype("datetime64[D]")
    f = rng.normal(size=n)
    if rank == 0:  # NaN on rank 0 only: DuckDB's max there is NaN, and its partials reach Arrow's ranks
        f[rng.random(n) < 0.02] = np.nan
    t = t.append_column("f", pa.array(f, pa.float64(), mask=rng.random(n) < 0.1))
    return t.append_column("d", pa.array(days, pa.date32(), mask=rng.random(n) < 0.1))


def app_groupby_arrow(env, keys, dropna, combine):
    df = px.DataFrame.from_arrow(arrow_agg_part(env.rank, env.world_size), env)
    out = df.groupby(keys, dropna=dropna, combine=combine).agg(
        v_sum=("v", "sum"), v_count=("v", "count"), v_mean=("v", "mean"), big_sum=("big", "sum"),
        big_mean=("big", "mean"), w_min=("w", "min"), d_max=("d", "max"), s_count=("s", "count"), n=(None, "size"),
        f_min=("f", "min"), f_max=("f", "max"),
    )  # fmt: skip
    text = io.StringIO()
    out.explain(file=text)
    return out.collect(root=0), text.getvalue()


@pytest.mark.parametrize(  # the mixed-engine exchange in the core lane, the rest in the slow lane
    "combine", [pytest.param(None, marks=pytest.mark.slow), True, pytest.param(False, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(
    "keys,dropna",
    [
        (["key"], True),
        pytest.param(["s", "b"], False, marks=pytest.mark.slow),
        pytest.param(["d", "key"], False, marks=pytest.mark.slow),
    ],
)
def test_groupby_in_arrow_matches_duckdb_with_ranks_on_either_engine(gang, keys, dropna, combine):
    """Arrow's hash aggregation (sum, count, mean, min, max, size over integer, string, bool and
    date keys, null keys kept or dropped) against DuckDB on the whole table; rank 0's sums could
    leave int64 and its floats hold NaN, so its steps run in DuckDB while the other ranks' run
    in Arrow: the tables they exchange must agree (a max of NaN is NaN, as DuckDB orders it)."""
    results = gang.run(app_groupby_arrow, keys, dropna, combine)
    out = results[0][0]
    if combine and gang.world_size > 1:  # the partials: rank 0's in DuckDB, the others' in Arrow
        ran = ["per-rank aggregation (Arrow)" in text for _, text in results]
        assert ran == [False] + [True] * (gang.world_size - 1), ran
    T = pa.concat_tables([arrow_agg_part(r, gang.world_size) for r in range(gang.world_size)])
    where = "WHERE " + " AND ".join(f"{k} IS NOT NULL" for k in keys) if dropna else ""
    expected = sql(ARROW_AGG_SQL.format(keys=", ".join(keys), where=where), T=T)
    assert out.schema.field("big_sum").type == pa.int64() and out.schema.field("d_max").type == pa.date32()
    assert_same_rows(out, expected.cast(out.schema))


def _same_table(a: pa.Table, b: pa.Table) -> None:
    assert a.schema.equals(b.schema), (a.schema, b.schema)
    assert_same_rows(a, b)


def test_arrow_agg_steps_equal_duckdbs_sql_steps():
    """Each step (partials from rows, their combine, finals from rows) against the SQL the
    group-by runs in DuckDB otherwise, on the same rows: equal values and types, groups of
    null values (sum null in a partial, 0 in a final; mean null), NaN, empty strings, null keys
    kept and dropped; float keys and float min/max left to DuckDB."""
    from phalanx.operators import arrow_agg, groupby, kernels

    T = arrow_agg_part(1, 2)
    nan_at = np.random.default_rng(2).random(T.num_rows) < 0.01
    v = pc.if_else(pa.array(nan_at), pa.scalar(float("nan")), T.column("v"))
    T = T.set_column(T.schema.get_field_index("v"), "v", v)
    T = pa.concat_tables([T, T.slice(0, 5).set_column(1, "v", pa.nulls(5, pa.float64()))])  # all-null groups
    aggs = groupby.parse_spec(
        None,
        dict(v_sum=("v", "sum"), v_count=("v", "count"), v_mean=("v", "mean"), big_sum=("big", "sum"),
             w_min=("w", "min"), d_max=("d", "max"), s_count=("s", "count"), n=(None, "size")),
    )  # fmt: skip
    q = kernels.quote_ident
    for keys, dropna in ((["key"], True), (["s", "b"], False), (["d"], False)):
        assert arrow_agg.eligible(keys, aggs, T.schema)
        ks = ", ".join(q(k) for k in keys)
        where = " WHERE " + " AND ".join(f"{q(k)} IS NOT NULL" for k in keys) if dropna else ""

        def duck(select: str, ks: str = ks, **tables) -> pa.Table:
            return kernels.run_sql(f"SELECT {ks}, {select} GROUP BY {ks}", **tables)

        parts = ", ".join(e for a in aggs for e in groupby._partial_sql(a, T.schema))
        partial = arrow_agg.partial(T, keys, aggs, dropna, groupby._p, False)
        _same_table(partial, kernels.restore_types(duck(f"{parts} FROM __px_t{where}", __px_t=T), T.schema))
        finals = ", ".join(groupby._final_sql(a, T.schema, raw=False) for a in aggs)
        _same_table(arrow_agg.combine(partial, keys, aggs, groupby._p), duck(f"{finals} FROM __px_p", __px_p=partial))
        rows = ", ".join(e for a in aggs for e in groupby._row_partial_sql(a, T.schema))
        raw = ", ".join(groupby._final_sql(a, T.schema, raw=True) for a in aggs)
        want = duck(f"{raw} FROM (SELECT {ks}, {rows} FROM __px_t{where})", __px_t=T)
        _same_table(
            arrow_agg.final(T, keys, aggs, dropna),
            kernels.restore_types(want, groupby._output_schema(keys, aggs, T.schema)),
        )
    assert not arrow_agg.eligible(["v"], aggs, T.schema)  # float keys: -0.0 and NaN groups
    # float min/max: Arrow's where no NaN; DuckDB's where one is (it orders NaN above numbers)
    extremes = groupby.parse_spec(None, dict(hi=("v", "max"), lo=("v", "min")))
    assert arrow_agg.eligible(["key"], extremes, T.schema)
    assert arrow_agg.final(T, ["key"], extremes, True) is None
    assert arrow_agg.partial(T, ["key"], extremes, True, groupby._p, False) is None
    clean = T.filter(pc.invert(pc.fill_null(pc.is_nan(T.column("v")), False)))
    want = duck('max("v") AS hi, min("v") AS lo FROM __px_t WHERE "key" IS NOT NULL', '"key"', __px_t=clean)
    assert_same_rows(arrow_agg.final(clean, ["key"], extremes, True), want)
    partial = arrow_agg.partial(clean, ["key"], extremes, True, groupby._p, False)
    assert partial is not None and arrow_agg.combine(partial.slice(0, 0), ["key"], extremes, groupby._p) is not None
    # a sum that could leave int64: DuckDB's (it widens, and fails loudly where it must)
    huge = pa.table({"k": [1, 1, 2], "x": [2**62, 2**62, 1]})
    one = groupby.parse_spec(None, dict(x=("x", "sum")))
    assert arrow_agg.partial(huge, ["k"], one, True, groupby._p, False) is None
    assert arrow_agg.final(huge, ["k"], one, True) is None


# ---- sort ---------------------------------------------------------------------------------
@contextmanager
def _sort_path(small: bool):
    """In a rank: frames of test size take the small-frame sort (every rank sorts all rows)
    only where ``small``; else the sample sort, as larger frames do."""
    from phalanx.operators import sort as S

    was = S.SMALL_ROWS
    S.SMALL_ROWS = was if small else -1
    try:
        yield
    finally:  # the gang's ranks serve the next tests
        S.SMALL_ROWS = was


def app_sort(env, by, ascending, small=False):
    with _sort_path(small):
        df = frame(env, rows=6000).sort_values(by, ascending=ascending)
        return df.collect(root=0), df.local_num_rows


@pytest.mark.parametrize("small", [False, True], ids=["sample sort", "small frame"])
@pytest.mark.parametrize(
    "by,ascending",
    [(["key"], True), (["v"], False), (["s", "key", "ts"], [True, False, True]), (["b", "w"], [False, True])],
)
def test_sort_values_matches_duckdb(gang, by, ascending, small):
    results = gang.run(app_sort, by, ascending, small)
    out = results[0][0]
    T = whole(gang.world_size, rows=6000)
    asc = [ascending] * len(by) if isinstance(ascending, bool) else ascending
    order = ", ".join(f"{c} {'ASC' if a else 'DESC'} NULLS LAST" for c, a in zip(by, asc))
    expected = sql(f"SELECT * FROM T ORDER BY {order}", T=T)
    assert out.select(by).equals(expected.select(by))  # globally ordered, across ranks
    assert_same_rows(out, expected)
    if small:  # each rank keeps an even share of the sorted rows
        sizes = [r[1] for r in results]
        assert max(sizes) - min(sizes) <= 1, sizes


def _sort_kernel_input(rows: int = 20_000, chunks: int = 3) -> pa.Table:
    """Keys with many ties, nulls, NaN, strings, a dictionary column; several chunks (the
    string ranks must be one order over every chunk's dictionary)."""
    import numpy as np

    rng = np.random.default_rng(7)
    f = rng.integers(0, 20, rows).astype(float)
    f[rng.random(rows) < 0.05] = np.nan
    words = np.array(["", "a", "ab", "b", "Zebra", "zebra", "é", "a\x00", "ab "], dtype=object)
    s = words[rng.integers(0, len(words), rows)]
    table = pa.table(
        {
            "f": pa.array(f, mask=rng.random(rows) < 0.05),
            "s": pa.array(s, mask=rng.random(rows) < 0.05),
            "i": pa.array(rng.integers(-3, 3, rows), mask=rng.random(rows) < 0.05),
            "b": pa.array(rng.random(rows) < 0.5),
            "d": pa.array(rng.integers(0, 5, rows).astype("datetime64[D]")),
            "cat": pa.array(s).dictionary_encode(),
            "u": pa.array([f"k{x}" for x in rng.integers(0, rows, rows)], pa.large_string()),
            "row": pa.array(np.arange(rows)),
        }
    )
    cuts = np.linspace(0, rows, chunks + 1).astype(int)
    return pa.concat_tables([table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])])


@pytest.mark.parametrize(
    "by,descending",
    [
        (["s"], [False]),
        (["u"], [True]),
        (["f", "s"], [True, False]),
        (["i", "f"], [False, False]),
        (["s", "i", "f"], [True, False, True]),
        (["cat", "b", "d"], [False, True, False]),
        (["b", "u"], [False, False]),
    ],
)
@pytest.mark.parametrize("rows", [20_000, 30_000], ids=["small: Arrow's sort", "Polars"])
def test_sort_kernel_is_the_stable_order(by, descending, rows):
    """The local sort (per-column passes, strings ranked; a small table by Arrow) against
    DuckDB's ORDER BY with the row number as the last key: the stable order, nulls last, NaN
    above every number; its top rows the first of that order."""
    from phalanx.operators import kernels

    T = _sort_kernel_input(rows)
    got = kernels.sort(T, by, descending)
    order = ", ".join(
        f"{'CAST(cat AS VARCHAR)' if c == 'cat' else c} {'DESC' if d else 'ASC'} NULLS LAST"
        for c, d in zip(by, descending)
    )
    expected = sql(f"SELECT row FROM T ORDER BY {order}, row", T=T)
    assert got.column("row").to_pylist() == expected.column("row").to_pylist()
    assert got.schema == T.schema
    top = kernels.top_k(T, by, descending, 150)
    assert top.schema == T.schema and top.column("row").to_pylist() == expected.column("row").to_pylist()[:150]
    # what a sample sort receives (sorted runs) gives the same order
    runs = pa.concat_tables(
        [kernels.sort(T.slice(0, 7000), by, descending), kernels.sort(T.slice(7000), by, descending)]
    )
    assert kernels.sort_runs(runs, by, descending).column("row").equals(got.column("row"))


def test_sort_spreads_a_skewed_key_over_ranks(gang):
    """≈30% of rows have key 0: splitters with tie-breaking must still balance the ranks."""
    sizes = [r[1] for r in gang.run(app_sort, ["key"], True)]
    total = sum(sizes)
    assert max(sizes) <= 1.5 * total / gang.world_size + 50, sizes


# ---- the pipeline -----------------------------------------------------------------
def app_pipeline(env):
    left = frame(env, seed=3, hot=JOIN_HOT).select(["key", "v"])
    right = frame(env, seed=4, hot=JOIN_HOT).select(["key", "w"])
    out = (
        left.merge(right, on="key", how="inner")
        .groupby("key")
        .agg({"v": "sum", "w": "mean"})
        .sort_values("key")
        .add_scalar(1)
    )
    return out.num_rows, out.collect(root=0)


def test_pipeline_join_groupby_sort_add(gang):
    results = gang.run(app_pipeline)
    L = whole(gang.world_size, seed=3, hot=JOIN_HOT).select(["key", "v"])
    R = whole(gang.world_size, seed=4, hot=JOIN_HOT).select(["key", "w"])
    expected = sql(
        """SELECT key + 1 AS key, COALESCE(SUM(v), 0) + 1 AS v, AVG(w) + 1 AS w FROM L JOIN R USING (key)
                      WHERE key IS NOT NULL GROUP BY key ORDER BY key""",
        L=L,
        R=R,
    )
    assert all(r[0] == expected.num_rows for r in results)
    out = results[0][1]
    assert out["key"].to_pylist() == expected["key"].to_pylist()
    assert_same_rows(out, expected)


# ---- partitioning is tracked, so operators on the same keys skip their shuffle -----------
def app_partition_tracking(env):
    df = frame(env).select(["key", "v", "w"]).shuffle("key")
    claims = {
        "shuffle": df.partitioned_by,
        "filter": df.filter(pc.field("w") > 0).partitioned_by,
        "rename": df.rename({"key": "k2"}).partitioned_by,
        "key changed": df.add_scalar(1, columns=["key"]).partitioned_by,
        "key dropped": df.drop("key").partitioned_by,
        "sorted": df.sort_values("v").partitioned_by,
        "outer, different key names": df.merge(
            df.rename({"key": "k2", "v": "v2", "w": "w2"}), left_on="key", right_on="k2", how="outer", broadcast=False
        ).partitioned_by,
        "inner": df.merge(
            frame(env, seed=5, hot=JOIN_HOT).select(["key", "s"]), on="key", broadcast=False
        ).partitioned_by,
    }
    same_keys = df.groupby("key").agg({"v": "sum", "w": "max"}).collect(root=0)
    moved_keys = df.add_scalar(1, columns=["key"]).groupby("key").agg({"w": "max"}).collect(root=0)
    dedup = df.drop_duplicates("key").collect(root=0)
    return claims, same_keys, moved_keys, dedup


def test_partitioning_is_tracked_and_results_stay_correct(gang):
    claims, same_keys, moved_keys, dedup = gathered(gang.run(app_partition_tracking))
    assert claims == {
        "shuffle": ("key",),
        "filter": ("key",),
        "rename": ("k2",),
        "key changed": None,
        "key dropped": None,
        "sorted": None,
        "outer, different key names": None,
        "inner": ("key",),
    }
    T = whole(gang.world_size).select(["key", "v", "w"])
    assert_same_rows(
        same_keys,
        sql("SELECT key, COALESCE(SUM(v), 0) AS v, MAX(w) AS w FROM T WHERE key IS NOT NULL GROUP BY key", T=T),
    )
    assert_same_rows(
        moved_keys, sql("SELECT key + 1 AS key, MAX(w) AS w FROM T WHERE key IS NOT NULL GROUP BY key", T=T)
    )
    assert dedup.num_rows == len(set(T["key"].to_pylist()))


# ---- frames with no rows on any rank, or rows on rank 0 only --------------------------------
def app_sparse(env, rows_on_rank0):
    t = make_part(env.rank, env.world_size, rows=rows_on_rank0 if env.rank == 0 else 0)
    df = px.DataFrame.from_arrow(t, env).select(["key", "v", "w", "s"])
    out = {
        "sort": df.sort_values(["s", "key"], ascending=[False, True]),
        "merge": df.merge(df.select(["key", "w"]), on="key", how="outer", broadcast=False),
        "groupby": df.select(["key", "v", "w"]).groupby("key").sum(),
        "drop_duplicates": df.drop_duplicates("key", keep="last"),
        "head": df.head(3),
    }
    return {name: result.collect(root=0) for name, result in out.items()}


@pytest.mark.parametrize("rows_on_rank0", [0, 40], ids=["empty-everywhere", "rows-on-rank0-only"])
def test_operators_on_empty_ranks_match_pandas(gang, rows_on_rank0):
    out = gathered(gang.run(app_sparse, rows_on_rank0))
    p = make_part(0, gang.world_size, rows=rows_on_rank0).select(["key", "v", "w", "s"]).to_pandas()
    expected = {
        "sort": p.sort_values(["s", "key"], ascending=[False, True], na_position="last"),
        "merge": p.merge(p[["key", "w"]], on="key", how="outer"),
        "groupby": p[["key", "v", "w"]].groupby("key").sum().reset_index(),
        "drop_duplicates": p.drop_duplicates("key", keep="last"),
        "head": p.head(3),
    }
    for name, exp in expected.items():
        got = out[name]
        assert got.column_names == list(exp.columns), name
        exp = pa.Table.from_pandas(exp, preserve_index=False).cast(got.schema)
        assert_same_rows(got, exp)
        if name in ("sort", "head"):
            assert got.equals(exp), name


# ---- the partition paths: hash (counting pass + one gather) and range (numeric sort key) ---
def test_hash_partition_kernel_keeps_order_and_colocates_equal_keys():
    from phalanx.operators import kernels

    rng = __import__("numpy").random.default_rng(7)
    n = 5000
    key = rng.integers(-50, 50, n)
    t = pa.table(
        {
            "k": pa.array(key, pa.int64(), mask=rng.random(n) < 0.1),
            "k2": pa.array(rng.integers(0, 3, n), pa.int64()),
            "s": pa.array(rng.choice(["a", "b", "", "ε"], n), mask=rng.random(n) < 0.1),
            "pos": pa.array(range(n), pa.int64()),
        }
    )
    for keys in (["k"], ["k", "k2"], ["s"], ["s", "k"]):
        for nparts in (2, 3, 7, 300):
            parts = kernels.hash_partition(t, keys, nparts)
            assert len(parts) == nparts and sum(p.num_rows for p in parts) == n
            home = {}
            for i, p in enumerate(parts):
                pos = p["pos"].to_pylist()
                assert pos == sorted(pos), "row order kept within a partition"
                for row in p.select(keys).to_pylist():
                    assert home.setdefault(tuple(row.values()), i) == i
    # equal integer keys hash equally whatever their width or encoding, and nulls stay together
    a = pa.table({"k": pa.array([1, 2, None, 300], pa.int64())})
    for other in (pa.array([1, 2, None, 300], pa.int16()), pa.array([1, 2, None, 300]).dictionary_encode()):
        assert (kernels.partition_ids(a, ["k"], 5) == kernels.partition_ids(pa.table({"k": other}), ["k"], 5)).all()
    # skew: one key everywhere moves nothing and copies nothing
    same = pa.table({"k": pa.array([4] * 100, pa.int64()), "v": pa.array(range(100))})
    parts = kernels.hash_partition(same, ["k"], 4)
    assert sorted(p.num_rows for p in parts) == [0, 0, 0, 100]
    assert any(p is same for p in parts)
    assert all(p.num_rows == 0 for p in kernels.hash_partition(same.slice(0, 0), ["k"], 3))


def app_shuffle_cases(env):
    import numpy as np

    rng = np.random.default_rng(env.rank)
    rows = 0 if (env.world_size >= 3 and env.rank == 1) else 3000
    t = pa.table(
        {
            "a": pa.array(rng.integers(0, 40, rows), pa.int32(), mask=rng.random(rows) < 0.1),
            "b": pa.array(rng.integers(0, 3, rows), pa.int64()),
            "s": pa.array(rng.choice(["x", "y", "zz", ""], rows), mask=rng.random(rows) < 0.1),
            "same": pa.array(np.full(rows, 9), pa.int64()),
            "gid": pa.array(np.arange(rows) + env.rank * 10**6, pa.int64()),
        }
    )
    df = px.DataFrame.from_arrow(t, env)
    out = {}
    for on in (["a"], ["a", "b"], ["s"], ["s", "a"], ["same"]):
        sh = df.shuffle(on)
        out[tuple(on)] = (sh.collect(root=0), sh.to_arrow().select(on + ["gid"]).to_pylist())
    return t, out


def test_shuffle_skew_nulls_strings_multikey_and_empty_ranks(gang):
    results = gang.run(app_shuffle_cases)
    expected = pa.concat_tables([r[0] for r in results])
    for on, (whole_out, _) in results[0][1].items():
        assert_same_rows(whole_out, expected)
        home = {}
        for rank, (_, per_rank) in enumerate(results):
            rank_rows = per_rank[on][1]
            gids = [r["gid"] for r in rank_rows]
            # pieces arrive in source-rank order, each in its original order
            assert gids == sorted(gids), on
            for row in rank_rows:
                k = tuple(row[c] for c in on)
                assert home.setdefault(k, rank) == rank, f"{on}: key {k} on ranks {home[k]} and {rank}"


def app_sort_numeric(env, column, ascending, skew, small=False):
    with _sort_path(small):
        return _sort_numeric(env, column, ascending, skew)


def _sort_numeric(env, column, ascending, skew):
    import numpy as np

    rng = np.random.default_rng(10 + env.rank)
    rows = 0 if (env.world_size >= 3 and env.rank == 1) else 2500
    f = rng.normal(size=rows).round(1)
    f[rng.random(rows) < 0.05] = np.nan
    f[rng.random(rows) < 0.05] = -0.0
    i = rng.integers(-20, 20, rows) if not skew else np.full(rows, 3)
    t = pa.table(
        {
            "i": pa.array(i, pa.int64(), mask=rng.random(rows) < 0.05),
            "i8": pa.array(rng.integers(-100, 100, rows), pa.int8()),
            "u": pa.array(rng.integers(0, 2**63, rows, dtype=np.uint64) * 2, pa.uint64()),
            "f": pa.array(f, pa.float64(), mask=rng.random(rows) < 0.05),
            "ts": pa.array(
                rng.integers(-(10**6), 10**6, rows).astype("datetime64[s]"),
                pa.timestamp("s"),
                mask=rng.random(rows) < 0.05,
            ),
            "d": pa.array(rng.integers(-1000, 1000, rows).astype("datetime64[D]"), pa.date32()),
            "s": pa.array(rng.choice(["x", "y", "zz", "", "é"], rows), mask=rng.random(rows) < 0.1),
            "c": pa.array(["same"] * rows, pa.string()),
            "gid": pa.array(np.arange(rows) + env.rank * 10**6, pa.int64()),
        }
    )
    df = px.DataFrame.from_arrow(t, env).sort_values(column, ascending=ascending)
    return t, df.collect(root=0), df.local_num_rows


@pytest.mark.parametrize(
    "column,ascending,skew",
    [
        ("i", True, False),
        ("i", False, False),
        ("i", True, True),
        ("i8", False, False),
        ("u", True, False),
        ("f", True, False),
        ("f", False, False),
        ("ts", False, False),
        ("d", True, False),
        # several columns / strings: range-partitioned first by compare passes over splitter rows
        ("s", False, False),
        (["s", "f"], [True, False], False),
        (["f", "s"], [False, True], False),
        (["i", "s", "ts"], [True, False, True], True),
        (["s", "i"], [False, False], True),
        (["i", "c"], [True, False], True),
    ],
)  # every row ties: only the frame position spreads them
def test_sort_range_first_is_the_stable_global_order(gang, column, ascending, skew):
    """The range-partition-first paths: nulls last, NaN as DuckDB/polars, -0.0 == 0.0, ties in
    frame order (a stable sort), a key shared by every row still spread over the ranks."""
    results = gang.run(app_sort_numeric, column, ascending, skew)
    T = pa.concat_tables([r[0] for r in results])
    columns = [column] if isinstance(column, str) else column
    asc = [ascending] * len(columns) if isinstance(ascending, bool) else ascending
    order = ", ".join(f"{c} {'ASC' if a else 'DESC'} NULLS LAST" for c, a in zip(columns, asc))
    expected = sql(f"SELECT * FROM T ORDER BY {order}, gid", T=T)
    out = results[0][1]
    assert out["gid"].to_pylist() == expected["gid"].to_pylist()  # the whole rows, in order
    assert_same_rows(out, expected)
    sizes = [r[2] for r in results]
    assert max(sizes) <= 1.5 * sum(sizes) / gang.world_size + 50, sizes


@pytest.mark.parametrize(
    "column,ascending,skew",
    [("f", False, False), ("s", True, False), (["i", "s", "ts"], [True, False, True], True), (["i", "c"], True, True)],
)
def test_a_small_frame_sorts_whole_on_every_rank_in_the_stable_order(gang, column, ascending, skew):
    """Under 20k rows in all, every rank sorts all of them and keeps an even share: the same
    order as the sample sort (nulls last, NaN as DuckDB, ties in frame order), one rank with
    no rows among three or four."""
    results = gang.run(app_sort_numeric, column, ascending, skew, True)
    T = pa.concat_tables([r[0] for r in results])
    columns = [column] if isinstance(column, str) else column
    asc = [ascending] * len(columns) if isinstance(ascending, bool) else ascending
    order = ", ".join(f"{c} {'ASC' if a else 'DESC'} NULLS LAST" for c, a in zip(columns, asc))
    expected = sql(f"SELECT * FROM T ORDER BY {order}, gid", T=T)
    assert results[0][1]["gid"].to_pylist() == expected["gid"].to_pylist()
    sizes = [r[2] for r in results]
    assert max(sizes) - min(sizes) <= 1, sizes


def test_range_ids_compare_passes_equal_the_binary_search():
    """Few splitters place rows by compare passes, many by binary search: the same ranks for
    every row, ties with a splitter's key ordered by global position, nulls after numbers."""
    import numpy as np

    from phalanx.operators import sort as S

    rng = np.random.default_rng(7)
    few = S.FEW_SPLITTERS
    try:
        for trial in range(200):
            n, P = int(rng.integers(0, 500)), int(rng.integers(2, 10))
            code = rng.integers(0, int(rng.integers(1, 30)), n).astype(np.uint64)
            nulls = rng.random(n) < 0.1 if trial % 2 else None
            k, nn = P - 1, int(rng.integers(0, P))
            sp_code = np.concatenate([rng.integers(0, 30, nn), np.zeros(k - nn, np.int64)]).astype(np.uint64)
            sp_null = np.array([False] * nn + [True] * (k - nn))
            sp_tag = (rng.integers(0, P, k) << 40) + rng.integers(0, max(n, 1), k)
            order = np.lexsort((sp_tag, sp_code, sp_null))
            args = (code, nulls, int(rng.integers(0, P)), sp_null[order], sp_code[order], sp_tag[order], P)
            S.FEW_SPLITTERS = P
            passes = S._range_ids(*args)
            S.FEW_SPLITTERS = 0
            assert np.array_equal(passes, S._range_ids(*args)), trial
    finally:
        S.FEW_SPLITTERS = few


# ---- global aggregate, semi/anti join, top-k ----------------------------------------------
def app_agg_all(env, rows):
    df = frame(env, rows=rows)
    out = df.agg(
        {"v": ["sum", "count", "mean", "min", "max", "first", "last"], "w": "sum"},
        s_min=("s", "min"),
        ts_max=("ts", "max"),
        n=(None, "size"),
    )
    return out.collect(root=0), out.local_num_rows


@pytest.mark.parametrize("rows", [4000, 0])
def test_a_global_aggregate_is_one_row_on_rank_0_equal_to_duckdb(gang, rows):
    results = gang.run(app_agg_all, rows)
    out = results[0][0]
    assert [r[1] for r in results] == [1] + [0] * (gang.world_size - 1)
    T = gid_table(whole(gang.world_size, rows=rows))
    expected = sql("SELECT " + AGG_SQL.split("SELECT {keys},", 1)[1].split("FROM")[0] + " FROM T", T=T)
    assert out.column_names == [
        "v_sum",
        "v_count",
        "v_mean",
        "v_min",
        "v_max",
        "v_first",
        "v_last",
        "w",
        "s_min",
        "ts_max",
        "n",
    ]
    assert out.schema.field("n").type == pa.int64() and out.schema.field("ts_max").type == T.schema.field("ts").type
    if rows == 0:  # sums and counts of nothing are 0; min, max, mean, first of nothing are null
        assert out.to_pylist() == [
            {
                "v_sum": 0.0,
                "v_count": 0,
                "v_mean": None,
                "v_min": None,
                "v_max": None,
                "v_first": None,
                "v_last": None,
                "w": 0,
                "s_min": None,
                "ts_max": None,
                "n": 0,
            }
        ]
    assert_same_rows(out, expected.cast(out.schema) if rows else out)
    if rows:
        assert out["n"][0].as_py() == T.num_rows


def app_agg_all_arrow(env, rows):
    t = arrow_agg_part(env.rank, env.world_size)
    df = px.DataFrame.from_arrow(t if rows else t.slice(0, 0), env)
    out = df.agg(
        v_sum=("v", "sum"), v_count=("v", "count"), v_mean=("v", "mean"), big_sum=("big", "sum"),
        big_mean=("big", "mean"), w_min=("w", "min"), d_max=("d", "max"), s_count=("s", "count"), n=(None, "size"),
        f_min=("f", "min"), f_max=("f", "max"),
    )  # fmt: skip
    return out.collect(root=0)


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "no rows"])
def test_a_global_aggregate_in_arrow_equals_duckdbs(gang, rows):
    """``agg`` of Arrow's functions (each rank's one row of partials from Arrow's kernels; rank
    0, whose int64 sums could overflow and whose floats hold NaN, from DuckDB) against DuckDB on
    the whole table (a max over NaN is NaN); of no rows: sums and counts 0, mean, min and max
    null."""
    out = gang.run(app_agg_all_arrow, rows)[0]
    T = pa.concat_tables([arrow_agg_part(r, gang.world_size) for r in range(gang.world_size)])
    expected = sql(
        ARROW_AGG_SQL.format(keys="1 AS one", where="" if rows else "WHERE false").replace("GROUP BY 1 AS one", ""), T=T
    )
    expected = expected.drop_columns(["one"])
    assert out.schema.field("big_sum").type == pa.int64() and out.schema.field("d_max").type == pa.date32()
    if not rows:
        assert out.to_pylist() == [
            dict(v_sum=0.0, v_count=0, v_mean=None, big_sum=0, big_mean=None, w_min=None, d_max=None, s_count=0, n=0)
            | dict(f_min=None, f_max=None)
        ]
    assert_same_rows(out, expected.cast(out.schema))


def app_agg_errors(env):
    df = frame(env)
    errors = []
    for call in (
        lambda: df.agg({"nope": "sum"}),
        lambda: df.agg({"v": "mode"}),
        lambda: df.agg(),
        lambda: df.agg({"v": "sum"}, v=("w", "max")),
    ):
        try:
            call()
        except (KeyError, ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_a_global_aggregate_names_a_bad_column_function_or_clash(gang):
    errors = gang.run(app_agg_errors)[0]
    assert len(errors) == 4, errors
    assert "nope" in errors[0] and "mode" in errors[1] and "no aggregations" in errors[2] and "clash" in errors[3]


def app_semi(env, how, on, broadcast):
    left = frame(env, seed=1, hot=JOIN_HOT).select(["key", "s", "v", "w"])
    right = frame(env, seed=2, rows=1500, hot=JOIN_HOT).select(["key", "s", "b"])
    out = left.merge(right, on=on, how=how, broadcast=broadcast)
    return out.collect(root=0), out.partitioned_by


@pytest.mark.parametrize("how", ["semi", "anti"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_semi_and_anti_join_keep_the_lefts_rows_with_and_without_a_match(gang, how, broadcast):
    n = gang.world_size
    for on in (["key"], ["key", "s"]):
        out, placed = gathered(gang.run(app_semi, how, on, broadcast))
        L = whole(n, seed=1, hot=JOIN_HOT).select(["key", "s", "v", "w"])
        R = whole(n, rows=1500, seed=2, hot=JOIN_HOT).select(["key", "s", "b"])
        cond = " AND ".join(f"l.{k} IS NOT DISTINCT FROM r.{k}" for k in on)
        exists = "EXISTS" if how == "semi" else "NOT EXISTS"
        expected = sql(f"SELECT * FROM L l WHERE {exists} (SELECT 1 FROM R r WHERE {cond})", L=L, R=R)
        assert out.column_names == ["key", "s", "v", "w"]
        assert 0 < out.num_rows < L.num_rows  # both kinds of rows exist: the test can fail
        assert_same_rows(out, expected)
        assert placed == (None if broadcast or n == 1 else tuple(on))


def app_top_k(env, by, ascending, k, rows):
    df = frame(env, rows=rows)
    top = df.sort_values(by, ascending=ascending, limit=k)
    return top.collect(root=0), top.local_num_rows, df.nlargest(k, "v").collect(root=0)


@pytest.mark.parametrize(
    "by,ascending,k",
    [
        (["key"], True, 25),
        (["v"], False, 7),
        (["s", "key", "ts"], [True, False, True], 40),
        (["w"], True, 0),
        (["w"], False, 100000),
    ],
)
def test_top_k_equals_sort_then_head_ties_in_frame_order(gang, by, ascending, k):
    rows = 3000
    results = gang.run(app_top_k, by, ascending, k, rows)
    out, largest = results[0][0], results[0][2]
    assert [r[1] for r in results[1:]] == [0] * (gang.world_size - 1)  # rank 0 holds the result
    T = gid_table(whole(gang.world_size, rows=rows))
    asc = [ascending] * len(by) if isinstance(ascending, bool) else ascending
    order = ", ".join(f"{c} {'ASC' if a else 'DESC'} NULLS LAST" for c, a in zip(by, asc))
    expected = sql(f"SELECT * FROM T ORDER BY {order}, gid LIMIT {k}", T=T).drop_columns(["gid"])
    assert out.to_pylist() == expected.to_pylist()  # the same rows in the same order, ties included
    by_v = sql(f"SELECT v FROM T ORDER BY v DESC NULLS LAST, gid LIMIT {k}", T=T)
    assert largest["v"].to_pylist() == by_v["v"].to_pylist()
    if k <= T["v"].drop_null().__len__():  # pandas' nlargest leaves NaN out
        assert largest["v"].to_pylist() == T.to_pandas()["v"].nlargest(k, keep="first").tolist()


def test_top_k_refuses_a_bad_limit(gang):
    def app(env, limit):
        try:
            frame(env).sort_values("v", limit=limit)
        except ValueError as exc:
            return str(exc)

    for bad in (-1, 2.5, True):
        assert "limit must be a count of rows" in gang.run(app, bad)[0]


@pytest.mark.parametrize("kind", [pa.int32(), pa.uint64(), pa.date32()])
def test_a_key_in_runs_aggregates_where_it_lies_as_duckdb_would(kind):
    """Rows sorted by their one key (runs of 1-5 rows; int32, uint64 beyond 2^63, dates):
    each step's groups are reduced run by run, with the SQL steps' answers — sums of all-null
    groups (null in a partial, 0 in a final), NaN, nulls skipped by counts, min/max of integers
    and dates; an unsorted key (a descent an unsigned difference would hide) takes Arrow's hash
    aggregation, with the same answers."""
    from phalanx.operators import arrow_agg, groupby, kernels

    rng = np.random.default_rng(5)
    runs = rng.integers(1, 6, 400)
    n = int(runs.sum())
    keys = np.repeat(np.arange(400, dtype=np.uint64) * 3, runs)
    if kind == pa.uint64():
        keys += np.uint64(2**63 + 10)
    key = pa.array(keys.astype("datetime64[D]") if kind == pa.date32() else keys).cast(kind)
    v = rng.random(n)
    v[rng.random(n) < 0.02] = np.nan
    v_mask = rng.random(n) < 0.1
    v_mask[: runs[0]] = True  # the first group's values all null
    T = pa.table(
        {
            "k": key,
            "v": pa.array(v, mask=v_mask),
            "i": pa.array(rng.integers(-50, 50, n), pa.int32(), mask=rng.random(n) < 0.1),
            "m": pa.array(rng.integers(-1000, 1000, n), pa.int64()),
            "d": pa.array(rng.integers(0, 9000, n).astype("datetime64[D]"), pa.date32()),
        }
    )
    aggs = groupby.parse_spec(
        None,
        dict(v_sum=("v", "sum"), v_count=("v", "count"), v_mean=("v", "mean"), i_sum=("i", "sum"),
             i_mean=("i", "mean"), m_min=("m", "min"), m_max=("m", "max"), d_min=("d", "min"), n=(None, "size")),
    )  # fmt: skip
    specs = [([], "count_all", None), ("v", "sum", arrow_agg._EMPTY_IS_NULL), ("m", "min", None), ("d", "max", None)]
    assert arrow_agg._group_runs(T, ["k"], specs) is not None  # in runs: reduced where they lie
    shuffled = T.take(pa.array(rng.permutation(n)))
    assert arrow_agg._group_runs(shuffled, ["k"], specs) is None
    assert arrow_agg._group_runs(T.set_column(3, "m", pa.array([None] * n, pa.int64())), ["k"], specs) is None

    def duck(select: str, **tables) -> pa.Table:
        return kernels.run_sql(f'SELECT "k", {select} GROUP BY "k"', **tables)

    for rows in (T, shuffled):
        parts = ", ".join(e for a in aggs for e in groupby._partial_sql(a, rows.schema))
        partial = arrow_agg.partial(rows, ["k"], aggs, True, groupby._p, False)
        _same_table(partial, kernels.restore_types(duck(f"{parts} FROM __px_t", __px_t=rows), rows.schema))
        row_parts = ", ".join(e for a in aggs for e in groupby._row_partial_sql(a, rows.schema))
        raw = ", ".join(groupby._final_sql(a, rows.schema, raw=True) for a in aggs)
        want = duck(f'{raw} FROM (SELECT "k", {row_parts} FROM __px_t)', __px_t=rows)
        _same_table(
            arrow_agg.final(rows, ["k"], aggs, True),
            kernels.restore_types(want, groupby._output_schema(["k"], aggs, rows.schema)),
        )
    assert arrow_agg.final(shuffled, ["k"], aggs, True, runs_only=True) is None


@pytest.mark.parametrize(
    "descent", [0, 3, 9_000, 10_000], ids=["none", "among the first rows", "late", "at a chunk's start"]
)
def test_a_key_is_taken_for_sorted_only_where_no_row_descends(descent):
    """The first rows are looked at before all of them (an unsorted key is found out at once);
    a key sorted there that descends later, or across chunks, is still not sorted."""
    from phalanx.operators import arrow_agg

    k = np.arange(20_000, dtype=np.int64)
    if descent:
        k[descent] = 1
    key = pa.chunked_array([k[:10_000], k[10_000:]])
    table = pa.table({"k": key, "v": pa.array(np.ones(len(k)))})
    spec = [("v", "sum", None)]
    assert (arrow_agg._group_runs(table, ["k"], spec) is not None) is (descent == 0)
    assert arrow_agg._sorted_first_key(table, ["k"]) is (descent == 0)


@pytest.mark.parametrize("dropna", [True, False])
def test_keys_constant_in_the_runs_of_a_sorted_first_key_aggregate_in_runs(dropna):
    """Rows sorted by their first key, the other keys the same within each of its runs (a
    customer's key, name, balance and nation, TPC-H Q10): reduced run by run with DuckDB's
    groups and sums (a float key NaN in a run, null keys in a run); where another key changes
    inside a run — a value, a null beside a value, -0.0 beside 0.0 — not in runs (None)."""
    from phalanx.operators import arrow_agg, groupby, kernels

    rng = np.random.default_rng(8)
    runs = rng.integers(1, 5, 300)
    n = int(runs.sum())
    k = np.repeat(np.arange(300) * 2, runs)
    bal = np.repeat(rng.normal(size=300), runs)
    bal[k == 10] = np.nan
    T = pa.table(
        {
            "k": pa.array(k, pa.int64()),
            "name": pa.array([f"customer {x:06d}" for x in k]),
            "bal": pa.array(bal),
            "nation": pa.array([None if x % 7 == 0 else f"n{x % 5}" for x in k]),
            "v": pa.array(rng.random(n), mask=rng.random(n) < 0.1),
        }
    )
    keys = ["k", "name", "bal", "nation"]
    aggs = groupby.parse_spec(None, dict(v=("v", "sum"), c=("v", "count"), n=(None, "size")))
    got = arrow_agg.final(T, keys, aggs, dropna, runs_only=True)
    assert got is not None
    by = ", ".join(keys)
    where = " WHERE nation IS NOT NULL" if dropna else ""
    want = kernels.run_sql(
        f"SELECT {by}, COALESCE(SUM(v), 0) AS v, COUNT(v) AS c, COUNT(*) AS n FROM __px_t{where} GROUP BY {by}",
        __px_t=T,
    )
    assert_same_rows(got, want.cast(got.schema))
    first = int(runs[0])  # a change inside the first run (rows 0 and 1 where it has two)
    for column in ("name", "nation", "bal") if first >= 2 else ():
        values = T.column(column).to_pylist()
        if column == "name":
            values[1] = "someone else"
        elif column == "nation":  # a null beside a value
            values[1] = "n9" if values[0] is None else None
        else:
            values[1] = values[0] + 1
        changed = T.set_column(T.schema.get_field_index(column), column, pa.array(values, T.schema.field(column).type))
        assert arrow_agg.final(changed, keys, aggs, False, runs_only=True) is None, column
    zero = T.set_column(2, "bal", pa.array([0.0 if i == 0 else -0.0 if i == 1 else b for i, b in enumerate(bal)]))
    assert first < 2 or arrow_agg.final(zero, keys, aggs, False, runs_only=True) is None


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_one_byte_string_keys_group_as_bytes_with_duckdbs_answer(kind):
    """Keys of one-byte strings (flags and statuses, TPC-H Q1) group as their bytes, in tables
    of several chunks sliced mid-way, and come back as strings of their type; the partial and
    final steps equal DuckDB's.  Not as bytes: a null, an empty string beside a two-byte one
    (the same total length), a multi-byte character."""
    from phalanx.operators import arrow_agg, groupby, kernels

    rng = np.random.default_rng(3)
    n = 5000
    flags = pa.array(rng.choice(["A", "N", "R"], n).tolist(), kind)
    status = pa.array(rng.choice(["F", "O"], n).tolist(), kind)
    T = pa.table({"f": flags, "s": status, "q": rng.integers(1, 50, n), "p": rng.random(n)})
    T = pa.concat_tables([T.slice(7, 2000), T.slice(2500, 2000)])  # two chunks, offsets not 0
    assert arrow_agg._one_byte_codes(T.column("f")) is not None
    for bad in (["A", None, "N"], ["", "AB", "N"], ["é", "A", "N"]):
        assert arrow_agg._one_byte_codes(pa.chunked_array([pa.array(bad, kind)])) is None, bad
    aggs = groupby.parse_spec(None, dict(q=("q", "sum"), p=("p", "mean"), n=(None, "size")))
    keys = ["f", "s"]
    final = arrow_agg.final(T, keys, aggs, True)
    want = kernels.run_sql("SELECT f, s, SUM(q) AS q, AVG(p) AS p, COUNT(*) AS n FROM __px_t GROUP BY f, s", __px_t=T)
    assert final.schema.field("f").type == kind
    assert_same_rows(final, want.cast(final.schema))
    partial = arrow_agg.partial(T, keys, aggs, True, groupby._p, False)
    combined = arrow_agg.combine(pa.concat_tables([partial, partial]), keys, aggs, groupby._p)
    twice = kernels.run_sql(
        "SELECT f, s, SUM(q) AS q, AVG(p) AS p, COUNT(*) AS n FROM (SELECT * FROM __px_t UNION ALL SELECT * FROM __px_t) "
        "GROUP BY f, s",
        __px_t=T,
    )
    assert_same_rows(combined, twice.cast(combined.schema))
