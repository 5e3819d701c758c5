"""The statistical aggregations (std, var, median, quantile, nunique, corr, cov, any, all) of
``groupby(...).agg`` and the global ``agg``, at 1-4 ranks, against DuckDB's own aggregates on
the same whole table: skewed keys, null keys and values, NaN, -0.0 next to 0.0, string keys, a
rank with no rows, a column far from zero (a variance that cancels if computed naively)."""

from __future__ import annotations

import io
import math

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from reference import make_part

import phalanx as px
from phalanx.operators import plan, stats

# 1-4 ranks against DuckDB/pandas: the slow lane (two workers), outside the core lane's 5 minutes
pytestmark = pytest.mark.slow

ROWS = 3000


def stat_part(rank: int, world: int, rows: int = ROWS, hot: float = 0.3) -> pa.Table:
    """``make_part`` and: ``z`` (floats with nulls, a few NaN, zeros of both signs), ``big``
    (1e9 + N(0, 1): sums of squares lose every digit of its variance), ``bn`` (booleans with
    nulls), ``t`` (small integers: many ties for quantiles)."""
    t = make_part(rank, world, rows, hot=hot)
    n = t.num_rows
    rng = np.random.default_rng(7919 + rank)
    z = rng.normal(size=n)
    z[rng.random(n) < 0.05] = 0.0
    z[rng.random(n) < 0.05] = -0.0
    z[rng.random(n) < 0.002] = np.nan
    extra = {
        "z": pa.array(z, pa.float64(), mask=rng.random(n) < 0.1),
        "big": pa.array(1e9 + rng.normal(size=n), pa.float64()),
        "bn": pa.array(rng.random(n) < 0.8, pa.bool_(), mask=rng.random(n) < 0.2),
        "t": pa.array(rng.integers(-3, 4, n), pa.int32()),
    }
    for name, column in extra.items():
        t = t.append_column(name, column)
    return t


def stat_whole(world: int, rows: int = ROWS, hot: float = 0.3) -> pa.Table:
    return pa.concat_tables([stat_part(r, world, rows, hot) for r in range(world)])


def frame(env, rows: int = ROWS, hot: float = 0.3) -> px.DataFrame:
    return px.DataFrame.from_arrow(stat_part(env.rank, env.world_size, rows, hot), env)


def sql(query: str, T: pa.Table) -> pa.Table:
    con = duckdb.connect()
    con.register("T", T)
    return con.sql(query).to_arrow_table()


# A variance of values near 1e9 keeps 5-8 of its digits whichever way it is merged (each rank's
# partial is DuckDB's var_pop of the unshifted values); a sum of squares would keep none.
LOOSE = {"big_var": 1e-4, "big_std": 1e-4, "big": 1e-4, "big_var0": 1e-4}


def assert_close(actual: pa.Table, expected: pa.Table, keys: list[str], rel: float = 1e-9) -> None:
    """Same columns, same rows (matched by the keys); floats within ``rel`` (``LOOSE``: theirs),
    NaN only where DuckDB has NaN, null only where it has null."""
    assert actual.column_names == expected.column_names
    assert actual.num_rows == expected.num_rows, f"{actual.num_rows} rows, expected {expected.num_rows}"
    order = [(k, "ascending", "at_end") for k in keys]
    if keys:
        actual = actual.take(pc.sort_indices(actual, sort_keys=order))
        expected = expected.take(pc.sort_indices(expected, sort_keys=order))
    for name in expected.column_names:
        got, want = actual[name].to_pylist(), expected[name].to_pylist()
        if not pa.types.is_floating(expected.schema.field(name).type):
            assert got == want, f"column {name} differs"
            continue
        for i, (x, y) in enumerate(zip(got, want)):
            if y is None or x is None:
                assert x is None and y is None, f"{name}[{i}]: {x} vs {y}"
            elif math.isnan(y) or math.isnan(x):
                assert math.isnan(x) and math.isnan(y), f"{name}[{i}]: {x} vs {y}"
            else:
                tol = LOOSE.get(name, rel)
                assert math.isclose(x, y, rel_tol=tol, abs_tol=1e-12), f"{name}[{i}]: {x} vs {y}"


# the aggregations under test, and what DuckDB computes for each
DECOMPOSABLE = dict(
    v_std=(("v", "std"), "stddev_samp(v)"),
    v_var=(("v", "var"), "var_samp(v)"),
    big_var=(("big", "var"), "var_samp(big - 1e9)"),  # exact shift: DuckDB's var_samp(big) is off by 1e-7
    w_std=(("w", "std"), "stddev_samp(w)"),
    v_std0=(("v", "std", 0), "stddev_pop(v)"),  # pandas' ddof
    big_var0=(("big", "var", 0), "var_pop(big - 1e9)"),
    z_var2=(("z", "var", 2), "CASE WHEN COUNT(z) > 2 THEN var_samp(z) * (COUNT(z) - 1) / (COUNT(z) - 2) END"),
    z_std=(("z", "std"), "stddev_samp(z)"),
    vw_cov=((("v", "w"), "cov"), "covar_samp(v, w)"),
    vw_corr=((("v", "w"), "corr"), "corr(v, w)"),
    zv_corr=((("z", "v"), "corr"), "corr(z, v)"),
    zt_cov=((("z", "t"), "cov"), "covar_samp(z, t)"),
    b_any=(("b", "any"), "COALESCE(bool_or(b), false)"),
    bn_any=(("bn", "any"), "COALESCE(bool_or(bn), false)"),
    bn_all=(("bn", "all"), "COALESCE(bool_and(bn), true)"),
)
HOLISTIC = dict(
    v_median=(("v", "median"), "quantile_cont(v, 0.5)"),
    v_p90=(("v", "quantile", 0.9), "quantile_cont(v, 0.9)"),
    t_p25=(("t", "quantile", 0.25), "quantile_cont(t, 0.25)"),
    t_p0=(("t", "quantile", 0), "quantile_cont(t, 0.0)"),
    t_p1=(("t", "quantile", 1.0), "quantile_cont(t, 1.0)"),
    z_median=(("z", "median"), "quantile_cont(z, 0.5)"),
    z_p99=(("z", "quantile", 0.99), "quantile_cont(z, 0.99)"),
    s_nunique=(("s", "nunique"), "COUNT(DISTINCT s)"),
    z_nunique=(("z", "nunique"), "COUNT(DISTINCT z)"),
    t_nunique=(("t", "nunique"), "COUNT(DISTINCT t)"),
)
MIXED = {
    **HOLISTIC,
    "v_sum": (("v", "sum"), "COALESCE(SUM(v), 0)"),
    "big_std": (("big", "std"), "stddev_samp(big - 1e9)"),
    "v_std0": DECOMPOSABLE["v_std0"],
    "z_var2": DECOMPOSABLE["z_var2"],
}
MIXED["bn_all"] = DECOMPOSABLE["bn_all"]
MIXED["zv_corr"] = DECOMPOSABLE["zv_corr"]
SETS = {"decomposable": DECOMPOSABLE, "holistic": MIXED}


def expected_sql(aggs: dict, keys: list[str], dropna: bool) -> str:
    cols = ", ".join(f"{ddb} AS {out}" for out, (_, ddb) in aggs.items())
    if not keys:
        return f"SELECT {cols} FROM T"
    where = "WHERE " + " AND ".join(f"{k} IS NOT NULL" for k in keys) if dropna else ""
    return f"SELECT {', '.join(keys)}, {cols} FROM T {where} GROUP BY {', '.join(keys)}"


def app_groupby(env, which, keys, dropna, combine):
    named = {out: spec for out, (spec, _) in SETS[which].items()}
    with plan.recording() as notes:
        out = frame(env).groupby(keys, dropna=dropna, combine=combine).agg(**named)
    return out.collect(root=0), notes


@pytest.mark.parametrize("combine", [None, False, True])
@pytest.mark.parametrize("keys,dropna", [(["key"], True), (["key"], False), (["s", "b"], False)])
def test_decomposable_aggregations_by_key_match_duckdb(gang, keys, dropna, combine):
    out, _ = gang.run(app_groupby, "decomposable", keys, dropna, combine)[0]
    expected = sql(expected_sql(DECOMPOSABLE, keys, dropna), stat_whole(gang.world_size))
    assert out.schema.field("v_std").type == pa.float64() and out.schema.field("bn_all").type == pa.bool_()
    assert_close(out, expected, keys)


@pytest.mark.parametrize("keys,dropna", [(["key"], True), (["s", "b"], False)])
def test_holistic_aggregations_by_key_match_duckdb_after_one_shuffle(gang, keys, dropna):
    out, notes = gang.run(app_groupby, "holistic", keys, dropna, None)[0]
    expected = sql(expected_sql(MIXED, keys, dropna), stat_whole(gang.world_size))
    assert out.schema.field("s_nunique").type == pa.int64()
    assert_close(out, expected, keys)
    # median, quantile and nunique next to sum, std and corr: raw rows shuffled once for all
    exchanges = [n for n in notes if n.startswith("Exchange")]
    assert len(exchanges) == (gang.world_size > 1), notes


def app_skewed(env):
    df = frame(env, hot=0.9)
    g = df.groupby("key").agg(v_std=("v", "std"), v_median=("v", "median"), s_n=("s", "nunique"))
    return (
        g.collect(root=0),
        df.groupby("s").std().collect(root=0),
        df.groupby("s").nunique().collect(root=0),
        df.groupby("s").var(ddof=0).collect(root=0),
    )


def test_a_hot_key_and_the_shortcuts_match_duckdb(gang):
    by_key, std, nunique, var0 = gang.run(app_skewed)[0]
    T = stat_whole(gang.world_size, hot=0.9)
    q = "SELECT key, stddev_samp(v) AS v_std, quantile_cont(v, 0.5) AS v_median, COUNT(DISTINCT s) AS s_n"
    assert_close(by_key, sql(q + " FROM T WHERE key IS NOT NULL GROUP BY key", T), ["key"])
    numeric = ["key", "v", "w", "b", "z", "big", "bn", "t"]  # the shortcut takes every numeric column
    q = ", ".join(f"stddev_samp({c}::DOUBLE) AS {c}" for c in numeric)
    assert_close(std, sql(f"SELECT s, {q} FROM T WHERE s IS NOT NULL GROUP BY s", T), ["s"])
    q = ", ".join(f"var_pop({c}::DOUBLE) AS {c}" for c in numeric)
    assert_close(var0, sql(f"SELECT s, {q} FROM T WHERE s IS NOT NULL GROUP BY s", T), ["s"], rel=1e-7)
    q = ", ".join(f"COUNT(DISTINCT {c}) AS {c}" for c in T.column_names if c != "s")
    assert_close(nunique, sql(f"SELECT s, {q} FROM T WHERE s IS NOT NULL GROUP BY s", T), ["s"])


# ---- without keys: one row on rank 0 ------------------------------------------------------------
def app_agg_all(env, rows):
    named = {out: spec for out, (spec, _) in {**DECOMPOSABLE, **MIXED}.items()}
    out = frame(env, rows=rows).agg({"w": ["var", "median"], "s": "nunique"}, **named)
    return out.collect(root=0), out.local_num_rows, out.explain(file=io.StringIO())


@pytest.mark.parametrize("rows", [ROWS, 0])
def test_global_aggregations_are_one_row_on_rank_0_equal_to_duckdb(gang, rows):
    results = gang.run(app_agg_all, rows)
    out, _, notes = results[0]
    assert [r[1] for r in results] == [1] + [0] * (gang.world_size - 1)
    T = stat_whole(gang.world_size, rows=rows)
    aggs = {
        "w_var": (None, "var_samp(w)"),
        "w_median": (None, "quantile_cont(w, 0.5)"),
        "s": (None, "COUNT(DISTINCT s)"),
        **DECOMPOSABLE,
        **MIXED,
    }
    expected = sql(expected_sql(aggs, [], True), T)
    assert_close(out, expected, [])
    if rows == 0:  # nothing to aggregate: counts 0, any False, all True, statistics null
        row = out.to_pylist()[0]
        assert row["s"] == 0 and row["b_any"] is False and row["bn_all"] is True
        assert row["w_var"] is None and row["w_median"] is None and row["vw_corr"] is None
    if gang.world_size > 1:  # one exchange of distinct values (nunique), no rows for the quantiles
        assert notes.count("Exchange distinct values of ['s', 'z', 't']") == 1, notes
        assert ("order statistics: 4 allreduce rounds, no rows move" in notes) == (rows > 0), notes


def app_quantile_corners(env, values, qs):
    part = pa.table({"x": pa.array(values[env.rank :: env.world_size], pa.float64())})
    df = px.DataFrame.from_arrow(part, env)
    return df.agg(**{f"q{i}": ("x", "quantile", q) for i, q in enumerate(qs)}).collect(root=0)


@pytest.mark.parametrize(
    "values",
    [
        [5.0] * 7,  # all equal
        [-0.0, 0.0, -1.5, None, float("inf"), -float("inf"), 2.5, 1e-300, -1e300],
        [1.0, float("nan"), 2.0, 3.0, None, float("nan")],  # NaN above every number
        [3.0],
        [1e16, 1e16 + 2, 3.0, -7.0, 1e16 + 4],
    ],
)
def test_global_quantiles_by_radix_selection_match_duckdb(gang, values):
    qs = [0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 1.0]
    out = gang.run(app_quantile_corners, values, qs)[0]
    T = pa.table({"x": pa.array(values, pa.float64())})
    expected = sql("SELECT " + ", ".join(f"quantile_cont(x, {q}) AS q{i}" for i, q in enumerate(qs)) + " FROM T", T)
    assert_close(out, expected, [], rel=1e-15)


# ---- errors: the same on every rank, before any communication ---------------------------------
def app_errors(env):
    df = frame(env)
    errors = []
    for call in (
        lambda: df.agg(x=("v", "mode")),
        lambda: df.agg(x=("s", "std")),
        lambda: df.groupby("key").agg(x=("ts", "median")),
        lambda: df.agg(x=(("v", "s"), "corr")),
        lambda: df.agg(x=("v", "quantile", 1.5)),
        lambda: df.groupby("key").agg(x=("v", "quantile", "high")),
        lambda: df.agg(x=("w", "any")),
        lambda: df.groupby("s").agg(x=("v", "corr")),
        lambda: df.agg(x=("v", "sum", 0)),
        lambda: df.groupby("key").agg(x=("v", "std", -1)),
        lambda: df.groupby("key").agg(x=("v", "var", 0.5)),
        lambda: df.groupby("key", combine=True).agg(x=("v", "median"), y=("v", "sum")),
        lambda: df.agg(x=(("v", "nope"), "cov")),
        lambda: df.agg({("v", "w"): "corr"}),
    ):
        try:
            call()
            errors.append(None)
        except (KeyError, ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def test_bad_aggregations_name_the_column_function_and_output(gang):
    errors = gang.run(app_errors)
    assert all(e == errors[0] for e in errors)  # every rank raised the same, none hung
    e = errors[0]
    assert "ValueError" in e[0] and "unknown function 'mode'" in e[0] and "'v'" in e[0]
    assert "TypeError" in e[1] and "std needs a numeric column" in e[1] and "'s'" in e[1] and "x=" in e[1]
    assert "median needs a numeric column" in e[2] and "'ts'" in e[2] and "timestamp" in e[2]
    assert "corr needs a numeric column" in e[3] and "'s'" in e[3]
    assert "ValueError" in e[4] and "[0, 1]" in e[4] and "1.5" in e[4]
    assert "[0, 1]" in e[5] and "'high'" in e[5]
    assert "any needs a boolean column" in e[6] and "'w'" in e[6] and "int64" in e[6]
    assert "corr needs two columns" in e[7] and "(('x', 'y'), 'corr')" in e[7]
    assert "only 'quantile'/'quantile_approx' (its q) and 'std'/'var' (ddof) take a third element" in e[8]
    assert "ddof must be an integer >= 0, got -1" in e[9] and "x=('v', 'std', -1)" in e[9]
    assert "ddof must be an integer >= 0, got 0.5" in e[10]
    assert "combine=True cannot pre-aggregate x=('v', 'median')" in e[11]
    assert "KeyError" in e[12] and "'nope'" in e[12]
    assert "keys of a dict spec are column names" in e[13]


# ---- quantile_approx: merged per-rank sketches, within the documented rank bound ----------------
APPROX = {f"{c}_q{int(q * 100)}": (c, "quantile_approx", q) for c in ("v", "z", "t") for q in (0.0, 0.5, 0.9, 0.99, 1)}


def app_approx(env, keys, hot):
    with plan.recording() as notes:
        df = frame(env, hot=hot)
        out = df.groupby(keys).agg(**APPROX) if keys else df.agg(**APPROX)
    return out.collect(root=0), notes


def _rank_bounds(values: np.ndarray, q: float) -> tuple[float, float]:
    """The exact order statistics of ranks ⌈⌊p⌋ − ε⌉ and ⌈⌈p⌉ + ε⌉ (1-based, clamped), p = 1 +
    q(N−1), ε = N/(2K): where docs/operators.md says quantile_approx lands."""
    s = np.sort(values)  # NaN last, as DuckDB orders them
    n, k = len(s), stats.APPROX_POINTS
    pos, eps = 1 + q * (n - 1), n / (2 * k)
    lo = min(max(math.ceil(math.floor(pos) - eps), 1), n)
    hi = min(max(math.ceil(math.ceil(pos) + eps), 1), n)
    return s[lo - 1], s[hi - 1]


@pytest.mark.parametrize("keys,hot", [(["b"], 0.3), (["key"], 0.9), (["s"], 0.3), ([], 0.3)], ids=str)
def test_quantile_approx_is_within_its_rank_bound_and_exact_for_small_groups(gang, keys, hot):
    out, notes = gang.run(app_approx, keys, hot)[0]
    n = gang.world_size
    by = ", ".join(keys) if keys else "NULL"
    where = " AND ".join(f"{k} IS NOT NULL" for k in keys) or "true"
    cols = ("v", "z", "t")
    lists = ", ".join(f"list({c}::DOUBLE) FILTER (WHERE {c} IS NOT NULL) AS {c}" for c in cols)
    counts = ", ".join(f"COUNT({c}) AS {c}" for c in cols)
    parts = [stat_part(r, n, hot=hot) for r in range(n)]
    ranked = pa.concat_tables(
        [t.append_column("rank", pa.array([r] * t.num_rows, pa.int64())) for r, t in enumerate(parts)]
    )
    most = sql(  # the most values of a group one rank holds, per column
        f"SELECT {by} AS g, {', '.join(f'MAX({c}) AS {c}' for c in cols)} FROM "
        f"(SELECT {by}, rank, {counts} FROM T WHERE {where} GROUP BY ALL) GROUP BY ALL",
        ranked,
    )
    exact = ", ".join(f"quantile_cont({c}, {q}) AS {name}" for name, (c, _, q) in APPROX.items())
    groups = sql(f"SELECT {by} AS g, {lists}, {exact} FROM T WHERE {where} GROUP BY ALL", ranked).to_pylist()
    biggest = {tuple(r.values())[0]: r for r in most.to_pylist()}
    got = {
        tuple(row[k] for k in keys) if len(keys) > 1 else row[keys[0]] if keys else None: row for row in out.to_pylist()
    }
    assert len(got) == len(groups)
    sketched = 0
    for group in groups:
        row = got[group["g"]]
        for name, (c, _, q) in APPROX.items():
            y, values = row[name], np.array(group[c] or [], dtype=np.float64)
            if not len(values):
                assert y is None, (group["g"], name)
                continue
            big = biggest[group["g"]][c] > stats.APPROX_POINTS and bool(keys) and n > 1
            sketched += big
            if not big:  # every rank sent all its values: quantile_cont's answer
                want = group[name]
                same = (math.isnan(y) and math.isnan(want)) or math.isclose(y, want, rel_tol=1e-12, abs_tol=1e-12)
                assert same, (group["g"], name, y, want)
                continue
            low, high = _rank_bounds(values, q)
            if math.isnan(y):
                assert math.isnan(high), (group["g"], name, low, high)
            else:
                assert low <= y and (math.isnan(high) or y <= high), (group["g"], name, low, y, high)
    if n > 1 and keys in (["b"], ["key"]):  # big groups were sketched, and partials moved
        assert sketched, "no group was big enough on a rank to be sketched"
        assert "pre-aggregated before the exchange" in notes, notes


def app_distinct_counts(env, keys, dropna):
    import os

    os.environ["PHALANX_THREADS"] = "1"  # Arrow's one-thread pass: where it counts distinct values
    try:
        with plan.recording() as notes:
            out = (
                frame(env)
                .groupby(keys, dropna=dropna)
                .agg(s_n=("s", "nunique"), key_n=("key", "nunique"), bn_n=("bn", "nunique"), rows=("w", "size"))
            )
            return out.collect(root=0), notes
    finally:
        os.environ.pop("PHALANX_THREADS")


@pytest.mark.parametrize("keys,dropna", [(["t"], True), (["s"], True), (["s"], False), (["t", "b"], False)])
def test_distinct_counts_of_ints_strings_and_bools_run_in_arrow_as_duckdb_counts(gang, keys, dropna):
    """nunique over integer, string and boolean columns with nulls (not counted), after the
    raw rows' shuffle, in Arrow's count_distinct: DuckDB's COUNT(DISTINCT) per group."""
    out, notes = gang.run(app_distinct_counts, keys, dropna)[0]
    query = "COUNT(DISTINCT s) AS s_n, COUNT(DISTINCT key) AS key_n, COUNT(DISTINCT bn) AS bn_n, count(*) AS rows"
    where = "WHERE " + " AND ".join(f"{k} IS NOT NULL" for k in keys) if dropna else ""
    by = ", ".join(keys)
    expected = sql(f"SELECT {by}, {query} FROM T {where} GROUP BY {by}", stat_whole(gang.world_size))
    assert_close(out, expected, keys)
    assert any(n.startswith("per-rank aggregation (Arrow)") for n in notes), notes
