"""The planner of local work (phalanx.operators.plan): lazy steps, projections and filters at
the scan, one fused pass, ``explain``; results against pandas/DuckDB, plans asserted by their
structure."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from reference import assert_same_rows, make_part, whole

import phalanx as px


def write_table(path, rows=20_000, group=2_000):
    t = pa.table(
        {
            "k": np.arange(rows) % 97,
            "v": np.arange(rows, dtype="float64") / 3,
            "s": [f"name-{i % 13}" for i in range(rows)],
            "w": np.arange(rows),  # sorted: row-group statistics can rule groups out
            "wide": [f"padding-{i}" * 4 for i in range(rows)],
        }
    )
    pq.write_table(t, path, row_group_size=group)
    return t


def app_pushdown(env, path):
    df = px.read_parquet(path, env)
    q = (
        df.filter(pc.field("w") >= 15_000)
        .assign(z=pc.field("v") * 2, tag="x")
        .rename({"k": "key"})
        .select(["key", "z", "tag"])
        .filter(pc.field("z") > 20_000.0)
    )
    columns, pushed, steps = q._pipe.optimized()
    return columns, [str(f) for f in pushed], len(steps), q.explain(file=open("/dev/null", "w")), q.collect(root=0)


def test_projections_and_filters_go_into_the_parquet_scan_and_the_answer_is_pandas(gang, tmp_path):
    t = write_table(tmp_path / "t.parquet")
    results = gang.run(app_pushdown, str(tmp_path / "t.parquet"))
    columns, pushed, nsteps, plan, _ = results[0]
    assert columns == ["k", "v"]  # not s, not wide; w is read only by the pushed filter
    assert pushed == ["(w >= 15000)"]  # the later filter reads z, computed: it stays
    assert "Scan parquet" in plan and "filter (w >= 15000)" in plan and "wide" not in plan
    p = t.to_pandas()
    p = p[p["w"] >= 15_000].assign(z=lambda d: d["v"] * 2, tag="x").rename(columns={"k": "key"})
    p = p[p["z"] > 20_000.0][["key", "z", "tag"]]
    assert_same_rows(results[0][4], pa.Table.from_pandas(p, preserve_index=False))


def app_read_columns(env, path, columns):
    return px.read_parquet(path, env).select(columns).collect(root=0)


def test_a_column_the_plan_does_not_use_is_never_read(gang, tmp_path):
    """Column 'wide' is damaged on disk: a plan without it succeeds, one with it names it."""
    path = tmp_path / "damaged.parquet"
    t = write_table(path, rows=10_000, group=5_000)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(4)  # 'wide' of row group 1
    middle = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    out = gang.run(app_read_columns, str(path), ["k", "w"])[0]
    assert out.equals(t.select(["k", "w"]))
    with pytest.raises(px.RankError, match="row group 1, column 'wide'"):
        gang.run(app_read_columns, str(path), ["k", "wide"])


def app_row_groups(env, path):
    df = px.read_parquet(path, env).filter(pc.field("w") < 1000)
    return df.collect(root=0)


def test_a_pushed_filter_on_an_int32_file_among_int64_files(gang, tmp_path):
    """The filter is bound to each file's own types; the result has the unified ones."""
    for i in range(3):
        t = pa.table({"w": pa.array(np.arange(i * 800, (i + 1) * 800), pa.int32() if i == 1 else pa.int64())})
        pq.write_table(t, tmp_path / f"f{i}.parquet", row_group_size=200)
    out = gang.run(app_row_groups, str(tmp_path / "f*.parquet"))[0]
    assert out.schema.field("w").type == pa.int64()
    assert sorted(out["w"].to_pylist()) == list(range(1000))


def app_share_of_the_rows(env, path, where):
    df = px.read_parquet(path, env)
    df = df.filter((pc.field("w") >= 1000) & (pc.field("s") != "s3")) if where == "filter" else df
    df = df.select(["w", "s"]) if where == "filter" else df
    return df.to_arrow(), df.explain(file=open("/dev/null", "w"))


@pytest.mark.parametrize(
    "groups, where",
    [([10_000], None), ([10_000], "filter"), ([4_000, 4_000, 2_000], None), ([2_500] * 4, None)],
    ids=["one row group", "one row group, filtered", "uneven row groups", "even row groups"],
)
def test_each_rank_reads_an_equal_share_of_the_rows_whatever_the_row_groups(gang, tmp_path, groups, where):
    """A file of fewer row groups than ranks (or uneven ones) is split by rows: each rank its
    contiguous share, in order, a row group it shares with another cut (a pushed filter
    applied to its share); row groups that divide evenly are read whole.  The rows together
    are the file's, once each."""
    total = sum(groups)
    t = pa.table({"w": np.arange(total), "s": [f"s{i % 7}" for i in range(total)], "v": np.arange(total) / 2})
    writer = pq.ParquetWriter(tmp_path / "t.parquet", t.schema)
    at = 0
    for n in groups:
        writer.write_table(t.slice(at, n))
        at += n
    writer.close()
    results = gang.run(app_share_of_the_rows, str(tmp_path / "t.parquet"), where)
    parts = [r[0] for r in results]
    kept = (np.arange(total) >= 1000) & (np.arange(total) % 7 != 3)
    expected = t if where is None else t.filter(pa.array(kept)).select(["w", "s"])
    assert pa.concat_tables(parts).equals(expected)  # in order: each rank a contiguous range
    sizes = [p.num_rows for p in parts]
    assert max(sizes) - min(sizes) <= (2 if where is None else 1000 + total // 7), sizes
    even = len(groups) % gang.world_size == 0 and len(set(groups)) == 1
    assert (", filter " in results[0][1]) is (where is not None)  # pushed into the scan
    assert ("in part" in results[0][1]) is (gang.world_size > 1 and not even), results[0][1]


def app_lazy_errors(env):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env)
    said = []
    for bad in (
        lambda: df.filter(pc.field("nope") > 1),
        lambda: df.assign(x=pc.field("s") * 2),
        lambda: df.select(["v", "nope"]),
        lambda: df.rename({"nope": "x"}),
    ):
        try:
            bad()
            said.append(None)
        except (KeyError, TypeError, pa.ArrowException) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def test_a_bad_column_or_expression_fails_at_the_call_not_later(gang):
    said = gang.run(app_lazy_errors)[0]
    assert None not in said, said
    assert "filter" in said[0] and "nope" in said[0]
    assert "assign(x=...)" in said[1]
    assert "nope" in said[2] and "nope" in said[3]


def app_chain(env):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env)
    q = (df + 1).filter(pc.field("v") > 3).assign(v2=pc.field("v") * pc.field("w"), c=7).drop(["b"]).truediv(2, "w")
    before = q._pipe.pending
    out = q.collect(root=0)
    return before, q._pipe.pending, out


def test_a_chain_of_local_steps_runs_once_when_rows_are_needed_and_matches_pandas(gang):
    before, after, out = gang.run(app_chain)[0]
    assert before and not after  # pending until collect, materialized once after
    p = whole(gang.world_size).to_pandas()
    num = [c for c in p.columns if p[c].dtype.kind in "if"]
    p[num] = p[num] + 1
    p = p[p["v"] > 3].assign(v2=lambda d: d["v"] * d["w"], c=7).drop(columns=["b"])
    p["w"] = p["w"] / 2
    assert_same_rows(out, pa.Table.from_pandas(p, preserve_index=False).cast(out.schema))


def app_explain_shared(env):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env)
    g = df.groupby("key").agg(n=("v", "size"))  # made: two operators read it
    both = g.merge(g.rename({"n": "m"}), on="key", broadcast=False)
    return both.explain(file=open("/dev/null", "w"))


def test_explain_shows_a_frame_several_operators_read_once():
    """A frame two operators read (a group-by merged with itself) is shown in full under the
    first, and by its first line and "(shown above)" under the second."""
    with px.Gang(ranks=2) as gang:
        plan = gang.run(app_explain_shared)[0]
    lines = [line.strip() for line in plan.splitlines() if line.strip().startswith("GroupBy ['key']")]
    assert len(lines) == 2 and not lines[0].endswith("(shown above)") and lines[1].endswith("(shown above)"), plan
    assert plan.count("Exchange hash by ['key']") == 1, plan  # the group-by's, once (the merge moves nothing)


def app_explain_exchanges(env):
    left = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, seed=1), env).select(["key", "v"])
    right = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, seed=2), env).select(["key", "w"])
    shuffled = left.shuffle("key").merge(right.shuffle("key"), on="key", broadcast=False)
    plain = left.merge(right, on="key", broadcast=False)
    return shuffled.explain(file=open("/dev/null", "w")), plain.explain(file=open("/dev/null", "w"))


def test_explain_marks_exchanges_and_the_ones_skipped(gang):
    co, plain = gang.run(app_explain_exchanges)[0]
    if gang.world_size == 1:
        assert "Exchange" not in co and "Exchange" not in plain
        return
    # co-partitioned inputs: the merge moves nothing (the two shuffles before it did)
    merge_part = co.split("Merge", 1)[1].split("Shuffle", 1)[0]
    assert "no exchange: both sides already partitioned by ['key']" in merge_part
    assert co.count("Exchange hash by ['key']") == 2
    assert plain.count("Exchange hash by ['key']") == 2 and "no exchange" not in plain


def app_explain_times(env):
    left = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, seed=1), env)
    out = left.filter(pc.field("v") > 0).groupby("key").agg(n=("v", "size"))
    pending = out.filter(pc.field("n") > 1)
    quiet = open("/dev/null", "w")
    return (
        pending.explain(file=quiet),
        pending.explain(file=quiet, times=True),
        pending.compute().explain(file=quiet, times=True),
    )


def test_explain_with_times_says_how_long_each_operator_took_on_this_rank():
    import re

    with px.Gang(ranks=2) as gang:
        plain, before, after = gang.run(app_explain_times)[0]
    took = re.compile(r"  \[\d+\.\d ms\]$")
    assert not any(took.search(line) for line in plain.splitlines())
    # the group-by and the filter that made its input ran: timed; the filter after it is pending
    assert [line.strip().split()[0] for line in before.splitlines() if took.search(line)] == ["GroupBy", "Filter"]
    assert before.splitlines()[0].startswith("Filter") and not took.search(before.splitlines()[0])
    assert took.search(after.splitlines()[0])  # computed: the filter's pass timed too
    assert plain == re.sub(r"  \[\d+\.\d ms\]", "", before)


# ---- the group-by's choice: pre-aggregate or shuffle raw rows ---------------------------------
@pytest.mark.parametrize(
    "groups, rows",
    [(100, 400_000), (20_000, 400_000), (100_000, 400_000), (400_000, 400_000)],
)
def test_the_distinct_key_estimate_is_close_where_a_samples_share_misleads(groups, rows):
    """20k keys over 400k rows: a 100k-row sample shows ~99% of its keys distinct (pre-
    aggregating looked useless), yet the rows shrink 20x.  Chao's estimate is within 15% (it
    estimates the keys the rows are drawn from: a little high when a sample holds a quarter of
    the rows), and on the right side of the 50%-distinct line the group-by decides by."""
    from phalanx.operators.kernels import estimate_distinct

    rng = np.random.default_rng(5)
    k = rng.integers(0, groups, rows) if groups < rows else rng.permutation(rows)
    table = pa.table({"s": pa.array(np.char.add("key-", k.astype(str))), "i": k % 3})
    true = len(np.unique(k))
    estimate = estimate_distinct(table, ["s", "i"])
    assert abs(estimate - true) <= 0.15 * true
    assert (estimate / rows < 0.5) == (true / rows < 0.5)
    # the group-by asks a 2000-row sample first and pre-aggregates at once when it shows the
    # groups under a twentieth of the rows: never where the keys are mostly distinct
    quick = estimate_distinct(table, ["s", "i"], 2_000) / rows < 0.05
    assert quick == (groups == 100) or (quick and true / rows < 0.5), (groups, quick)


@pytest.mark.parametrize("sample", [2_000, 14_000, 100_000])
def test_the_distinct_key_estimate_holds_where_a_keys_rows_lie_together(sample):
    """Rows of one key side by side (an order's lines after a join: TPC-H Q10's group-by input,
    115k rows, 39k customers): a sample taken at a fixed stride stepped over every run and saw
    no key twice, so the estimate read "all distinct" and the group-by shuffled raw rows."""
    from phalanx.operators.kernels import estimate_distinct

    rng = np.random.default_rng(7)
    runs = rng.integers(1, 6, 40_000)  # 1-5 rows a key, each key's rows together
    k = np.repeat(rng.permutation(len(runs)), runs)
    table = pa.table({"s": pa.array(np.char.add("customer-", k.astype(str))), "i": k % 7})
    true = len(runs)
    estimate = estimate_distinct(table, ["s", "i"], sample)
    assert abs(estimate - true) <= 0.2 * true, (estimate, true, len(k))


@pytest.mark.parametrize(
    "kind, keys_kind", [("int64", "int64"), ("int32", "int32"), ("int32", "int64"), ("string", "string")]
)
def test_a_join_s_sampled_share_of_matching_rows_is_the_share_among_the_sampled_rows(kind, keys_kind):
    """The share of rows an inner join keeps (it decides whether the membership filter runs
    first and which of two joins runs first) is counted exactly over every n-th row, whatever
    the chunks (uneven ones, a sample's stride crossing them), nulls (a null matches where a key
    is null, as in the joins) and types that differ (int32 rows, int64 keys: the hash path)."""
    from phalanx.operators.plan import SAMPLE_ROWS, selectivity

    rng = np.random.default_rng(11)
    n = 50_003
    values = rng.integers(0, 5_000, n)
    nulls = rng.random(n) < 0.05
    wanted = np.unique(rng.integers(0, 5_000, 700))

    def arrow(v, mask, t):
        a = pa.array(v, mask=mask).cast(pa.int64())
        return a.cast(pa.string()) if t == "string" else a.cast(t)

    column = arrow(values, nulls, kind)
    cuts = [0, 7, 3_000, 3_001, 20_000, 44_444, n]  # uneven chunks, one of a single row
    table = pa.table({"k": pa.chunked_array([column.slice(a, b - a) for a, b in zip(cuts, cuts[1:])])})
    every = max(1, n // SAMPLE_ROWS)
    rows = np.arange(0, n, every)
    for null_key in (False, True):  # the joins match a null key with a null
        keys = pa.chunked_array(
            [arrow(np.append(wanted, 0), np.append(np.zeros(len(wanted), bool), null_key), keys_kind)]
        )
        kept = (np.isin(values[rows], np.append(wanted, [] if null_key else [0])) & ~nulls[rows]) | (
            nulls[rows] & null_key
        )
        memo: dict = {}
        assert selectivity(table, "k", keys, memo) == pytest.approx(kept.mean(), abs=1e-12)
        assert selectivity(table, "k", keys, memo) == pytest.approx(kept.mean(), abs=1e-12)  # from the memo
        assert len(memo) == 1
    assert selectivity(table, "k", pc.drop_null(keys).slice(0, 0)) == 0.0  # no key: no match
    assert selectivity(table.slice(0, 0), "k", keys) == 1.0  # no rows: nothing to filter


@pytest.mark.parametrize("engine", ["arrow", "duckdb"])
def test_key_frequencies_count_null_and_nan_keys_as_groups_of_their_own(engine, monkeypatch):
    """The sample's (distinct, seen once, seen twice): Arrow counts small samples, DuckDB
    large ones; both against Python's count of the key tuples (null and NaN are two groups)."""
    from collections import Counter

    from phalanx.operators import kernels

    monkeypatch.setattr(kernels, "_ARROW_COUNTS_ROWS", 10**9 if engine == "arrow" else -1)
    rng = np.random.default_rng(3)
    n = 3000
    s = rng.choice(np.array(["a", "", "long string key", "x"], dtype=object), n)
    s[rng.random(n) < 0.1] = None
    x = rng.integers(0, 400, n).astype(float)
    x[rng.random(n) < 0.05] = np.nan
    x_nulls = rng.random(n) < 0.05
    table = pa.table(
        {"s": pa.array(s, pa.string()), "x": pa.array(x, mask=x_nulls, from_pandas=False), "i": rng.integers(0, 3, n)}
    )

    def key(row: dict) -> tuple:
        return row["s"], "nan" if row["x"] is not None and row["x"] != row["x"] else row["x"], row["i"]

    sizes = Counter(key(r) for r in table.to_pylist())
    want = (len(sizes), sum(v == 1 for v in sizes.values()), sum(v == 2 for v in sizes.values()))
    assert table["x"].null_count and pc.sum(pc.is_nan(table["x"])).as_py()
    assert kernels._key_frequencies(table, ["s", "x", "i"]) == want


# ---- exchanges the plan proves unnecessary ------------------------------------------------------
def app_merge_on_more_keys_than_partitioned(env, how):
    left = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, seed=1, hot=0.02), env)
    right = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, rows=1500, seed=2, hot=0.02), env)
    left = left.select(["key", "s", "v"]).shuffle("key")
    right = right.select(["key", "s", "w"]).shuffle("key")
    out = left.merge(right, on=["key", "s"], how=how, broadcast=False)
    return out.explain(file=open("/dev/null", "w")), out.partitioned_by, out.collect(root=0)


@pytest.mark.parametrize("how", ["inner", "left", "semi"])
def test_a_merge_on_keys_both_sides_are_partitioned_by_part_of_moves_nothing(gang, how):
    """Both sides hash-partitioned by key, joined on (key, s): matching rows share key, so a
    rank; the merge moves no row, and the answer is DuckDB's (null keys matching)."""
    import duckdb

    plan, placed, out = gang.run(app_merge_on_more_keys_than_partitioned, how)[0]
    n = gang.world_size
    if n > 1:
        merge_part = plan.split("Merge", 1)[1].split("Shuffle", 1)[0]
        assert "no exchange" in merge_part and "Exchange" not in merge_part, plan
        assert placed == ("key",)
    L = whole(n, seed=1, hot=0.02).select(["key", "s", "v"])
    R = whole(n, rows=1500, seed=2, hot=0.02).select(["key", "s", "w"])
    on = "l.key IS NOT DISTINCT FROM r.key AND l.s IS NOT DISTINCT FROM r.s"
    query = {
        "inner": f"SELECT l.key, l.s, l.v, r.w FROM L l JOIN R r ON {on}",
        "left": f"SELECT l.key, l.s, l.v, r.w FROM L l LEFT JOIN R r ON {on}",
        "semi": f"SELECT l.key, l.s, l.v FROM L l WHERE EXISTS (SELECT 1 FROM R r WHERE {on})",
    }[how]
    con = duckdb.connect()
    con.register("L", L)
    con.register("R", R)
    assert_same_rows(out, con.sql(query).to_arrow_table())


def app_groupby_on_more_keys_than_partitioned(env):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env).shuffle("key")
    out = df.groupby(["key", "s"]).agg(v=("v", "sum"), n=("w", "count"), m=("v", "median"))
    distinct = df.drop_duplicates(["key", "s"])
    return out.explain(file=open("/dev/null", "w")), out.partitioned_by, out.collect(root=0), distinct.num_rows


def test_a_groupby_on_keys_the_frame_is_partitioned_by_part_of_moves_nothing(gang):
    import duckdb

    plan, placed, out, ndistinct = gang.run(app_groupby_on_more_keys_than_partitioned)[0]
    if gang.world_size > 1:
        group_part = plan.split("GroupBy", 1)[1].split("Shuffle", 1)[0]
        assert "no exchange" in group_part and "Exchange" not in group_part, plan
        assert placed == ("key",)
    con = duckdb.connect()
    con.register("t", whole(gang.world_size))
    expected = con.sql(
        "SELECT key, s, coalesce(sum(v), 0) AS v, count(w) AS n, median(v) AS m FROM t "
        "WHERE key IS NOT NULL AND s IS NOT NULL GROUP BY key, s"
    ).to_arrow_table()
    assert_same_rows(out, expected.cast(out.schema))
    assert ndistinct == con.sql("SELECT count(*) FROM (SELECT DISTINCT key, s FROM t)").fetchall()[0][0]


def app_fused_aggregations(env, path, fuse):
    import os

    os.environ["PHALANX_PIPELINE_ENGINE"] = "polars" if fuse else "acero"
    try:
        return _fused_aggregations(env, path)
    finally:  # the gang's ranks serve the next tests
        os.environ.pop("PHALANX_PIPELINE_ENGINE")


def _fused_aggregations(env, path):
    df = px.read_parquet(path, env).compute()  # in memory: the pipeline below is pending
    q = df.filter((pc.field("w") > 3000) & pc.match_like(pc.field("s"), "name-1%")).assign(
        z=pc.multiply(pc.field("v"), pc.subtract(pc.scalar(1.0), pc.divide(pc.field("v"), 1e5)))
    )
    g = q.rename({"s": "name"}).groupby(["name"]).agg(total=("z", "sum"), n=("z", "size"), sd=("v", "std"))
    a = q.agg(total=("z", "sum"), mean=("v", "mean"), sd=("v", "std"))  # std: DuckDB's (not Arrow's)
    plan = g.explain(file=open("/dev/null", "w"))
    return g.collect(root=0), a.collect(root=0), plan, q._pipe.pending


@pytest.mark.parametrize("fuse", [True, False], ids=["fused into DuckDB", "Acero first"])
def test_a_pending_pipeline_fuses_into_the_aggregation_s_query_with_the_same_answer(gang, tmp_path, fuse):
    """The group-by and agg read the filtered, computed rows inside their own DuckDB query
    (no copy first); the answers are DuckDB's own over the same data, fused or not."""
    import duckdb

    t = write_table(tmp_path / "t.parquet")
    g, a, plan, pending = gang.run(app_fused_aggregations, str(tmp_path / "t.parquet"), fuse)[0]
    con = duckdb.connect()
    con.register("t", t)
    rows = "SELECT s AS name, v, v * (1.0 - v / 1e5) AS z FROM t WHERE w > 3000 AND s LIKE 'name-1%'"
    want_g = con.sql(
        f"SELECT name, sum(z) AS total, count(*) AS n, stddev_samp(v) AS sd FROM ({rows}) GROUP BY name"
    ).to_arrow_table()
    want_a = con.sql(f"SELECT sum(z) AS total, avg(v) AS mean, stddev_samp(v) AS sd FROM ({rows})").to_arrow_table()
    assert_same_rows(g, want_g.cast(g.schema))
    assert a.num_rows == 1 and a["total"][0].as_py() == pytest.approx(want_a["total"][0].as_py(), rel=1e-12)
    assert a["mean"][0].as_py() == pytest.approx(want_a["mean"][0].as_py(), rel=1e-12)
    assert a["sd"][0].as_py() == pytest.approx(want_a["sd"][0].as_py(), rel=1e-9)
    assert pending is fuse  # fused: the frame's own rows were never made
    assert ('WITH "__px_t" AS (SELECT' in plan) is fuse, plan


def app_pending_joins(env, path, engine):
    import os

    os.environ["PHALANX_PIPELINE_ENGINE"] = engine
    quiet = open("/dev/null", "w")
    try:
        df = px.read_parquet(path, env).compute()  # in memory: the pipelines below are pending

        def pending():  # some keys null: they meet the right's null key
            return df.filter((pc.field("w") > 3000) & pc.match_like(pc.field("s"), "name-1%")).assign(
                z=pc.multiply(pc.field("v"), 2),
                k=pc.if_else(pc.field("w") < 3100, pa.scalar(None, pa.int64()), pc.field("k")),
            )

        dim = pa.table({"dk": pa.array([None, *range(0, 200, 3)], pa.int64()), "label": [f"d{i}" for i in range(68)]})
        dim = px.DataFrame.from_arrow(dim if env.rank == 0 else dim.slice(0, 0), env)  # tiny: broadcast
        tags = pa.table({"label": [f"d{i}" for i in range(0, 68, 2)], "tag": [f"t{i % 5}" for i in range(34)]})
        tags = px.DataFrame.from_arrow(tags if env.rank == env.world_size - 1 else tags.slice(0, 0), env)
        out, still = {}, []
        for how in ("inner", "left", "semi", "anti"):
            q = pending()
            j = q.merge(dim, left_on="k", right_on="dk", how=how)
            out[how] = (j.collect(root=0), j.explain(file=quiet))
            still.append(q._pipe.pending)
        # a chain: join, a filter on the joined column, another join, a group-by over it all
        chain = (
            pending()
            .merge(dim, left_on="k", right_on="dk")
            .filter(pc.field("label") != "d3")
            .merge(tags, on="label", how="left")
            .groupby(["label", "tag"], dropna=False)
            .agg(n=("z", "count"), total=("z", "sum"))
        )
        out["chain"] = (chain.collect(root=0), chain.explain(file=quiet))
        # one frame holding a pending join, read by two group-bys: its rows are made once
        j = pending().merge(dim, left_on="k", right_on="dk")
        assert j.groupby("label").agg(n=("z", "count")).num_rows > 0
        still.append(j._pipe.pending)
        again = j.groupby("label").agg(n=("z", "count"))
        still.append(j._pipe.pending)
        out["again"] = (again.collect(root=0), again.explain(file=quiet))
        return out, still, dim.to_arrow() if env.rank == 0 else None, tags.to_arrow()
    finally:  # the gang's ranks serve the next tests
        os.environ.pop("PHALANX_PIPELINE_ENGINE")


@pytest.mark.parametrize(  # the default engine in the core lane, the other two in the slow lane
    "engine",
    ["polars", pytest.param("duckdb", marks=pytest.mark.slow), pytest.param("acero", marks=pytest.mark.slow)],
    ids=["steps apart in Polars", "one DuckDB query", "Acero first"],
)
def test_a_join_with_a_small_side_waits_in_the_pipeline(gang, tmp_path, engine):
    """A merge whose right side is small goes to every rank at the call and the join waits in
    the left's pipeline: the steps before and after it run apart in Polars (each join on its
    own), or as one DuckDB query (``PHALANX_PIPELINE_ENGINE=duckdb``), or apart in Acero;
    inner, left, semi and anti joins, a chain of two joins and a filter under a group-by, give
    DuckDB's rows (null keys matching each other)."""
    import duckdb

    t = write_table(tmp_path / "t.parquet")
    results = gang.run(app_pending_joins, str(tmp_path / "t.parquet"), engine)
    out, pending, dim = results[0][:3]
    con = duckdb.connect()
    con.register("t", t)
    con.register("d", dim)
    con.register("g", pa.concat_tables([r[3] for r in results]))
    rows = (
        "SELECT * REPLACE (CASE WHEN w < 3100 THEN NULL ELSE k END AS k), v * 2 AS z "
        "FROM t WHERE w > 3000 AND s LIKE 'name-1%'"
    )
    cond = "l.k IS NOT DISTINCT FROM d.dk"
    assert con.execute(f"SELECT count(*) FROM ({rows}) l JOIN d ON {cond} WHERE l.k IS NULL").fetchall()[0][0] > 0
    want = {
        "inner": f"SELECT l.*, d.dk, d.label FROM ({rows}) l JOIN d ON {cond}",
        "left": f"SELECT l.*, d.dk, d.label FROM ({rows}) l LEFT JOIN d ON {cond}",
        "semi": f"SELECT * FROM ({rows}) l WHERE EXISTS (SELECT 1 FROM d WHERE {cond})",
        "anti": f"SELECT * FROM ({rows}) l WHERE NOT EXISTS (SELECT 1 FROM d WHERE {cond})",
        "chain": f"SELECT d.label, g.tag, count(l.z) AS n, sum(l.z) AS total FROM ({rows}) l JOIN d ON {cond} "
        "LEFT JOIN g ON d.label = g.label WHERE d.label <> 'd3' GROUP BY d.label, g.tag",
        "again": f"SELECT d.label, count(l.z) AS n FROM ({rows}) l JOIN d ON {cond} GROUP BY d.label",
    }
    for how, sql in want.items():
        got, plan = out[how]
        expected = con.sql(sql).to_arrow_table()
        assert expected.num_rows > 0, how
        assert_same_rows(got, expected.cast(got.schema))
        assert "Join " in plan and "with a table on every rank" in plan, (how, plan)
        assert ("Exchange broadcast" in plan) is (gang.world_size > 1), (how, plan)
        if how not in ("chain", "again"):
            assert plan.splitlines()[0].endswith("[DuckDB]" if engine == "duckdb" else "[steps apart]"), plan
    assert "Merge" not in out["chain"][1]  # both joins waited in the pipeline: one query below the group-by
    assert " 0 x 0 rows" not in out["chain"][1]  # the engine's trial on empty tables notes nothing
    # the frames the joins read never made their rows; a frame holding a join makes its rows
    # at the first operator that reads it (a second would join again)
    assert pending == [True] * 4 + [False, False]


def app_filter_below_a_join(env, path):
    df = px.read_parquet(path, env)  # a scan: the filter can reach its row groups
    dim = pa.table({"dk": pa.array(range(0, 97, 2), pa.int64()), "tag": [f"t{i % 3}" for i in range(49)]})
    dim = px.DataFrame.from_arrow(dim if env.rank == 0 else dim.slice(0, 0), env)
    q = df.merge(dim, left_on="k", right_on="dk").filter(pc.field("w") >= 15_000).select(["k", "v", "dk"])
    # a left join: a filter on the right's columns (null where unmatched) must stay above it
    lq = (
        df.merge(dim, left_on="k", right_on="dk", how="left")
        .filter(pc.field("tag").is_null())
        .filter(pc.field("w") < 500)
    )
    lq = lq.select(["k", "w", "tag"])
    quiet = open("/dev/null", "w")
    return q.explain(file=quiet), q.collect(root=0), lq.explain(file=quiet), lq.collect(root=0)


def test_a_filter_after_a_join_with_a_small_side_reaches_the_scan(gang, tmp_path):
    """A filter on the left's columns after a join with a small side moves below it, into the
    Parquet scan (row groups skipped by their statistics); the columns no step reads are not
    read; the rows are DuckDB's."""
    import duckdb

    t = write_table(tmp_path / "t.parquet")
    plan, got, left_plan, left_got = gang.run(app_filter_below_a_join, str(tmp_path / "t.parquet"))[0]
    scan = next(line for line in plan.splitlines() if "Scan parquet" in line)
    assert "filter (w >= 15000)" in scan and "columns ['k', 'v']," in scan, plan  # w read by the scan's filter alone
    assert "Filter" not in plan.split("Scan parquet")[0], plan  # no filter step left above the scan
    con = duckdb.connect()
    con.register("t", t)
    expected = con.sql("SELECT k, v, k AS dk FROM t WHERE w >= 15000 AND k % 2 = 0").to_arrow_table()
    assert_same_rows(got, expected.cast(got.schema))
    # the left join's filter on its right column stays above the join; the one on w goes down
    lines = left_plan.splitlines()
    join_at = next(i for i, line in enumerate(lines) if "Join left" in line)
    assert any("Filter" in line and "tag" in line for line in lines[:join_at]), left_plan
    assert "filter (w < 500)" in next(line for line in lines if "Scan parquet" in line), left_plan
    expected = con.sql("SELECT k, w, NULL::VARCHAR AS tag FROM t WHERE w < 500 AND k % 2 = 1").to_arrow_table()
    assert expected.num_rows > 0
    assert_same_rows(left_got, expected.cast(left_got.schema))


def app_groupby_on_the_right_key_of_an_inner_join(env):
    left = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env)
    right = px.DataFrame.from_arrow(make_part(env.rank, env.world_size, seed=1).select(["key", "w"]), env)
    right = right.rename({"key": "rkey", "w": "rw"}).drop_duplicates(["rkey"])
    j = left.merge(right, left_on="key", right_on="rkey", broadcast=False)
    j = j.drop("key")  # the left key gone: the rows are still placed by rkey (equal values)
    out = j.groupby(["rkey"]).agg(v=("v", "sum"), n=("rw", "count"))
    return out.explain(file=open("/dev/null", "w")), j.partitioned_by, out.collect(root=0)


def test_after_an_inner_join_the_rows_are_placed_by_the_right_keys_too(gang):
    """An inner join on key = rkey puts equal rkey values on one rank, as it does key's: a
    group-by on rkey moves nothing, even once key is dropped, and sums what DuckDB sums."""
    import duckdb

    plan, placed, out = gang.run(app_groupby_on_the_right_key_of_an_inner_join)[0]
    if gang.world_size > 1:
        assert placed == ("rkey",)
        group_part = plan.split("GroupBy", 1)[1].split("Merge", 1)[0]
        assert "no exchange" in group_part and "Exchange" not in group_part, plan
    con = duckdb.connect()
    con.register("l", whole(gang.world_size))
    con.register("r", whole(gang.world_size, seed=1))
    expected = con.sql(
        "SELECT r.rkey, coalesce(sum(l.v), 0) AS v, count(r.rw) AS n FROM l JOIN "
        "(SELECT DISTINCT ON (key) key AS rkey, w AS rw FROM r WHERE key IS NOT NULL) r ON l.key = r.rkey "
        "GROUP BY r.rkey"
    ).to_arrow_table()
    assert_same_rows(out, expected.cast(out.schema))


def _sides_in_duckdb(results: list, left: int, right: int):
    """A DuckDB connection with tables ``l`` and ``r``: every rank's ``results[left]`` and
    ``results[right]`` tables, concatenated."""
    import duckdb

    con = duckdb.connect()
    con.register("l", pa.concat_tables([r[left] for r in results]))
    con.register("r", pa.concat_tables([r[right] for r in results]))
    return con


def app_broadcast_or_shuffle(env, right_rows):
    import numpy as np

    rng = np.random.default_rng(env.rank)
    left = pa.table({"k": rng.integers(0, 500, 1000), "a": rng.random(1000)})
    right = pa.table(
        {"k": rng.integers(0, 500, right_rows), "b": rng.random(right_rows), "pad": ["x" * 40] * right_rows}
    )
    lf = px.DataFrame.from_arrow(left, env)
    rf = px.DataFrame.from_arrow(right, env)
    out = lf.merge(rf, on="k", how="left")
    return out.explain(file=open("/dev/null", "w")), out.partitioned_by, out.collect(root=0), left, right


@pytest.mark.parametrize(  # the shuffle case (40k rows at 4 ranks: 5 s) runs in the slow lane
    "right_rows",
    [2_000, pytest.param(40_000, marks=pytest.mark.slow)],
    ids=["small right: broadcast", "right >> left: shuffle"],
)
def test_a_join_broadcasts_a_side_only_where_that_is_cheaper_than_a_shuffle(gang, right_rows):
    """A left join may only broadcast its right side: it does when that side is small (under
    1 MB), and shuffles both sides when every rank receiving the right side would move more
    than a shuffle (P × right > left) — then the result is placed by the key.  Either way the
    rows are DuckDB's."""

    results = gang.run(app_broadcast_or_shuffle, right_rows)
    plan, placed = results[0][0], results[0][1]
    con = _sides_in_duckdb(results, 3, 4)
    expected = con.sql("SELECT l.k, l.a, r.b, r.pad FROM l LEFT JOIN r ON l.k = r.k").to_arrow_table()
    assert_same_rows(results[0][2], expected)
    if gang.world_size == 1:
        return
    if right_rows == 2_000:  # 2000 × P rows of ~60 bytes: under 1 MB
        assert "Exchange broadcast the right side" in plan and placed is None, plan
    else:
        assert "broadcast" not in plan and plan.count("Exchange hash by ['k']") == 2, plan
        assert placed == ("k",)


def app_join_into_the_right(env, on):
    import numpy as np

    rng = np.random.default_rng(env.rank)
    n = 20_000
    keys = pa.array([None if i % 97 == 5 else int(x) for i, x in enumerate(rng.integers(0, 5000, n))], pa.int64())
    big = pa.table({"rk": keys, "d": rng.integers(0, 100, n), "s": [f"s{i % 13}" for i in range(n)]})
    small_keys = pa.array([None, *rng.integers(0, 5000, 300).tolist()], pa.int64())
    small = pa.table({"lk": small_keys, "a": pa.array(range(301), pa.int64())})
    if on:  # one key name: it appears once, in the left's place
        big, small = big.rename_columns(["k", "d", "s"]), small.rename_columns(["k", "a"])
    lf = px.DataFrame.from_arrow(small, env).compute()  # made: its size is known
    rf = px.DataFrame.from_arrow(big, env).filter(pc.field("d") < 40)  # pending: a filter over a table
    joined = lf.merge(rf, on="k") if on else lf.merge(rf, left_on="lk", right_on="rk")
    pending = joined._pipe.pending
    return joined.explain(file=open("/dev/null", "w")), pending, joined.columns, joined.collect(root=0), small, big


@pytest.mark.parametrize("on", [False, True], ids=["left_on/right_on", "on: one key name"])
def test_a_small_left_side_joins_in_the_right_s_pipeline(gang, on):
    """An inner merge whose left side is small and made, and whose right side has pending
    steps over a table, sends the left to every rank and waits in the right's pipeline (its
    filter keeps only rows whose key the left holds); columns in the merge's order (the
    left's, then the right's), null keys matching each other, rows DuckDB's."""

    results = gang.run(app_join_into_the_right, on)
    plan, pending, columns, out = results[0][:4]
    con = _sides_in_duckdb(results, 4, 5)
    if on:
        sql = "SELECT l.k, l.a, r.d, r.s FROM l JOIN r ON l.k IS NOT DISTINCT FROM r.k WHERE r.d < 40"
    else:
        sql = "SELECT l.lk, l.a, r.rk, r.d, r.s FROM l JOIN r ON l.lk IS NOT DISTINCT FROM r.rk WHERE r.d < 40"
    expected = con.sql(sql).to_arrow_table()
    assert columns == expected.column_names
    assert out.num_rows > 100 and out.column("a").null_count == 0
    assert_same_rows(out, expected.cast(out.schema))
    assert pending and "with a table on every rank" in plan, plan
    if gang.world_size > 1:
        assert "Exchange broadcast the left side" in plan and "Exchange hash" not in plan, plan


def app_join_into_right_ranges(env, case):
    rng = np.random.default_rng(env.rank + 31)
    r, n, span = env.rank, 200_000, 1_000_000
    # the right: each rank's keys a range of their own (an edge key on two ranks for "touching")
    rk = np.sort(rng.integers(r * span, (r + 1) * span + (case == "touching"), n))
    if case == "touching" and r > 0:
        rk[0] = r * span  # the key the rank before ends with
    mask = (np.arange(n) == 5) if case == "nulls" and r == 0 else None
    pad = pa.array(np.full(n, "x" * 40))
    big = pa.table({"rk": pa.array(rk, pa.int64(), mask=mask), "d": rng.integers(0, 100, n), "pad": pad})
    # the left: over 2 MB in all (smaller goes to every rank anyway), keys of every rank's range
    m = 80_000
    small = pa.table({"lk": pa.array(rng.integers(0, env.world_size * span, m), pa.int64()), "a": np.arange(m) + r * m})
    lf = px.DataFrame.from_arrow(small, env).compute()
    rf = px.DataFrame.from_arrow(big, env).filter(pc.field("d") < 60)
    joined = lf.merge(rf, left_on="lk", right_on="rk")
    # a third side on the same key, its rows anywhere: not to be filtered by this rank's share
    third = pa.table({"yk": pa.array(rng.integers(0, env.world_size * span, 300_000), pa.int64())})
    again = joined.merge(px.DataFrame.from_arrow(third, env), left_on="rk", right_on="yk")
    explain = joined.explain(file=open("/dev/null", "w"))
    return explain, joined.collect(root=0), small, big, again.collect(root=0), third


@pytest.mark.parametrize("case", ["apart", "touching", "nulls"])
def test_a_small_left_side_goes_only_where_the_right_s_key_range_holds_its_keys(gang, case):
    """A left side joining in the right's pipeline (over 2 MB in all): where each rank's right
    keys lie in a range no other rank's touches, each left row goes only to the rank whose range
    holds its key (not to every rank); where two ranks share a key, or a key is null, it is sent
    to every rank as before.  DuckDB's rows either way, and a third side merged on the same key
    is not filtered by a rank's share of the left."""
    results = gang.run(app_join_into_right_ranges, case)
    plan, out = results[0][:2]
    con = _sides_in_duckdb(results, 2, 3)
    expected = con.sql(
        "SELECT l.*, r.* FROM l JOIN r ON l.lk IS NOT DISTINCT FROM r.rk WHERE r.d < 60"
    ).to_arrow_table()
    assert out.num_rows > 50
    assert_same_rows(out, expected.cast(out.schema))
    con.register("y", pa.concat_tables([res[5] for res in results]))
    again = results[0][4]
    sql = "SELECT l.*, r.*, y.* FROM l JOIN r ON l.lk IS NOT DISTINCT FROM r.rk JOIN y ON r.rk = y.yk WHERE r.d < 60"
    assert again.num_rows > 50
    assert_same_rows(again, con.sql(sql).to_arrow_table().cast(again.schema))
    if gang.world_size > 1:
        ranged = case == "apart"
        assert ("Exchange the left side by the right's key ranges" in plan) is ranged, plan
        assert ("Exchange broadcast the left side" in plan) is not ranged, plan


def app_semi_join_through_the_right(env, how):
    import numpy as np

    rng = np.random.default_rng(env.rank + 7)
    n = 30_000
    keys = pa.array([None if i % 101 == 3 else int(x) for i, x in enumerate(rng.integers(0, 20_000, n))], pa.int64())
    big = pa.table({"rk": keys, "status": pa.array(["F" if x % 3 else "O" for x in range(n)])})
    small_keys = pa.array([None, *rng.integers(0, 20_000, 500).tolist()], pa.int64())
    small = pa.table({"lk": small_keys, "a": pa.array(range(501), pa.int64())})
    lf = px.DataFrame.from_arrow(small, env).compute()
    rf = px.DataFrame.from_arrow(big, env).filter(pc.field("status") == "F")  # pending: a filter
    out = lf.merge(rf, left_on="lk", right_on="rk", how=how)
    return out.explain(file=open("/dev/null", "w")), out.columns, out.collect(root=0), small, big


@pytest.mark.parametrize("how", ["semi", "anti"])
def test_few_left_keys_meet_a_pending_right_side_through_its_filter(gang, how):
    """A semi or anti merge of a small, made left side with a right side whose filter is still
    pending: the left's distinct keys go to every rank, each rank's right steps keep the keys
    they match, and only those move back (a semi-join reduction); the left's rows, each once,
    null keys matching each other, as DuckDB's."""

    results = gang.run(app_semi_join_through_the_right, how)
    plan, columns, out = results[0][:3]
    con = _sides_in_duckdb(results, 3, 4)
    join = "SEMI JOIN" if how == "semi" else "ANTI JOIN"
    expected = con.sql(
        f"SELECT l.* FROM l {join} (SELECT * FROM r WHERE status = 'F') r ON l.lk IS NOT DISTINCT FROM r.rk"
    ).to_arrow_table()
    assert columns == ["lk", "a"] and 0 < out.num_rows < 501 * gang.world_size
    assert_same_rows(out, expected.cast(out.schema))
    if gang.world_size > 1:
        assert "semi-join reduction" in plan and "Exchange hash" not in plan, plan


def app_groupby_of_key_ranges(env, kind, overlap, dropna, rows=3000):
    import datetime as dt

    start = env.rank * rows - (rows // 2 if overlap and env.rank else 0)
    k = np.arange(start, start + rows) // 3  # sorted, 3 rows per key, the ranks' ranges apart
    keys = pa.array(k) if kind == "int" else pa.array([dt.date(2000, 1, 1) + dt.timedelta(days=int(x)) for x in k])
    mask = np.zeros(rows, dtype=bool)
    mask[::700] = True  # some null keys on every rank
    table = pa.table({"k": pa.array(keys.to_pylist(), keys.type, mask=mask), "v": np.arange(rows, dtype=np.float64)})
    # a string key first, the ranged key second: two groups for most k (the rows' parity)
    table = table.append_column("s", pa.array([None if i % 401 == 0 else f"p{i % 2}" for i in range(rows)]))
    df = px.DataFrame.from_arrow(table, env)
    out = df.groupby(["s", "k"] if kind == "int, string" else "k", dropna=dropna).agg(v=("v", "sum"), n=("v", "size"))
    return out.explain(file=open("/dev/null", "w")), out.partitioned_by, out.collect(root=0), table


@pytest.mark.parametrize(
    "kind, overlap, dropna, rows",
    [
        ("int", False, True, 3000),
        ("date", False, True, 3000),
        ("int", False, True, 3001),
        ("int", True, True, 3000),
        ("int", False, False, 3000),
        ("int, string", False, True, 3001),
        ("int, string", True, True, 3000),
        ("int, string", False, False, 3000),
    ],
    ids=[
        "int ranges apart",
        "date ranges apart",
        "ranges share edge keys",
        "ranges overlap",
        "nulls everywhere, dropna=False",
        "a string key and the int key, edges",
        "a string key and the int key, overlapping",
        "a string key and the int key, dropna=False",
    ],
)
def test_a_group_by_moves_nothing_where_each_rank_s_key_range_is_apart(gang, kind, overlap, dropna, rows):
    """Rows split by a sorted key (row groups of a sorted file): equal keys are on one rank
    already, so the group-by is one local pass — a key split across two ranks' edge (3001 rows
    per rank: key 1000 on ranks 0 and 1) moves to the lower rank first; where ranges overlap
    more, or null groups sit on several ranks and count (dropna=False), it exchanges as before.
    So with more keys, one of them the ranged one.  DuckDB's answer either way."""
    import duckdb

    results = gang.run(app_groupby_of_key_ranges, kind, overlap, dropna, rows)
    plan, placed, out = results[0][:3]
    con = duckdb.connect()
    con.register("t", pa.concat_tables([r[3] for r in results]))
    by = "s, k" if kind == "int, string" else "k"
    where = f"WHERE {' AND '.join(f'{c} IS NOT NULL' for c in by.split(', '))}" if dropna else ""
    expected = con.sql(f"SELECT {by}, sum(v) AS v, count(*) AS n FROM t {where} GROUP BY {by}").to_arrow_table()
    assert_same_rows(out, expected.cast(out.schema))
    if gang.world_size == 1:
        return
    apart = not overlap and dropna
    assert ("each rank's key range is apart" in plan) is apart, plan
    assert ("(edge keys moved)" in plan) is (apart and rows % 3 != 0), plan
    assert (f"Exchange hash by {by.split(', ')}" in plan) is not apart, plan
    assert placed == (None if apart else tuple(by.split(", ")))


def app_semi_join_reduction(env, how, n):
    import numpy as np

    rng = np.random.default_rng([11, env.rank])
    m = 150_000  # n left rows against many right keys
    lk = rng.integers(0, 1_000_000, n).astype(float)
    lk[rng.random(n) < 0.05] = np.nan  # null keys (as None below): they match right nulls
    left = pa.table(
        {
            "k": pa.array([None if np.isnan(x) else int(x) for x in lk], pa.int64()),
            "s": pa.array([None if i % 17 == 0 else f"s{i % 3}" for i in range(n)]),
            "payload": pa.array([f"row {env.rank}-{i}" for i in range(n)]),
        }
    )
    # half the left's keys are on some rank's right side; most right keys match nothing
    rk = np.concatenate([rng.integers(0, 1_000_000, m - n // 2), lk[: n // 2][~np.isnan(lk[: n // 2])]])
    right = pa.table(
        {
            "k": pa.array(rk.astype(np.int64)).cast(pa.int64()),
            "s": pa.array([f"s{int(x) % 3}" for x in range(len(rk))]),
        }
    )
    if env.rank == 0:  # a right null key pair, matching the left's null pairs
        right = pa.concat_tables(
            [right, pa.table({"k": pa.array([None], pa.int64()), "s": pa.array([None], pa.string())})]
        )
    lf = px.DataFrame.from_arrow(left, env).shuffle("payload")  # placed by a column that is not the key
    out = lf.merge(px.DataFrame.from_arrow(right, env), on=["k", "s"], how=how)
    plan = out.explain(file=open("/dev/null", "w"))
    return plan, out.partitioned_by, out.collect(root=0), left, right


@pytest.mark.parametrize("left_rows", [2_000, 120_000], ids=["few left keys", "many left keys"])
@pytest.mark.parametrize("how", ["semi", "anti"])
def test_a_semi_join_against_many_right_keys_moves_keys(gang, how, left_rows):
    """A semi or anti join against many right keys (too many to broadcast).  Where the left's
    keys are few, a semi-join reduction: the left's distinct keys go to every rank, the matched
    ones come back, and the left's rows never move (the result keeps their placement).  Where
    they are many, both sides are shuffled by key, only the right's distinct keys moving.  Null
    key pairs match each other, as the join's always do; the rows are DuckDB's."""

    results = gang.run(app_semi_join_reduction, how, left_rows)
    plan, placed = results[0][0], results[0][1]
    con = _sides_in_duckdb(results, 3, 4)
    exists = "EXISTS" if how == "semi" else "NOT EXISTS"
    expected = con.sql(
        f"SELECT * FROM l WHERE {exists} (SELECT 1 FROM r WHERE r.k IS NOT DISTINCT FROM l.k "
        "AND r.s IS NOT DISTINCT FROM l.s)"
    ).to_arrow_table()
    assert expected.num_rows > 0 and expected.num_rows < sum(r[3].num_rows for r in results)
    assert_same_rows(results[0][2], expected)
    if gang.world_size == 1:
        return
    assert "broadcast" not in plan, plan
    if left_rows == 2_000:
        assert "semi-join reduction" in plan and "Exchange hash by ['k', 's']" not in plan, plan
        assert placed == ("payload",)  # the left's rows stayed where the shuffle by payload put them
    else:
        assert "semi-join reduction" not in plan and plan.count("Exchange hash by ['k', 's']") == 2, plan
        assert placed == ("k", "s")


def app_merge_of_key_ranges(env, case, how):
    import datetime as dt

    r, rows = env.rank, 3000
    # the left: a sorted key, 3 rows a key, each rank's range apart (3001 rows: a key on two ranks)
    lk = np.arange(r * rows, (r + 1) * rows + (case == "edge")) // 3
    # the right: 2 rows a key, each rank's range 50 keys past the left's (a few rows move)
    rk = np.repeat(np.arange(r * 1000 + 50, (r + 1) * 1000 + 50), 2)
    if case == "overlap":  # every rank's keys all over: a hash shuffle
        rk = np.random.default_rng(r).integers(0, env.world_size * 1000, len(rk))
    if case == "skewed":  # apart, but all in rank 0's range: most rows would move
        rk = np.repeat(np.arange(r * 100, (r + 1) * 100), 20)
    if case == "swapped":  # apart and as many a rank, but each rank's in another's range
        q = env.world_size - 1 - r
        rk = np.repeat(np.arange(q * 1000 + 50, (q + 1) * 1000 + 50), 2)
    if case == "unsorted":  # apart, in no order within a rank
        rk = np.random.default_rng(r).permutation(rk)

    def keys(k, null=False):
        if case == "date":
            return pa.array([dt.date(2001, 1, 1) + dt.timedelta(days=int(x)) for x in k])
        return pa.array(k.tolist(), pa.int64(), mask=(np.arange(len(k)) == 7) if null else None)

    left = pa.table({"k": keys(lk), "a": np.arange(len(lk)) + r * 10_000, "s": [f"l{i % 7}" for i in range(len(lk))]})
    right = pa.table({"rk": keys(rk, case == "nulls" and r == 0), "b": np.arange(len(rk)), "t": ["x"] * len(rk)})
    lf, rf = px.DataFrame.from_arrow(left, env), px.DataFrame.from_arrow(right, env)
    out = lf.merge(rf, left_on="k", right_on="rk", how=how, broadcast=False)
    return out.explain(file=open("/dev/null", "w")), out.partitioned_by, out.collect(root=0), left, right


_RANGED = [
    (c, h) for c in ("sorted", "edge", "date", "unsorted") for h in ("inner", "left", "right", "outer", "semi", "anti")
]


@pytest.mark.parametrize("case, how", _RANGED + [(c, "inner") for c in ("overlap", "skewed", "swapped", "nulls")])
def test_a_merge_moves_only_edge_rows_where_each_rank_s_key_range_is_apart(gang, case, how):
    """Both sides split by a sorted key (row groups of lineitem and orders): rows with equal
    keys meet by the left's key ranges, only rows past a range's edge moving (a key on two
    ranks, the right's ranges offset from the left's, keys in no order within a rank); where
    the ranges overlap, most right rows would move or gather on one rank, or a null key could
    match another rank's, both sides are hash-shuffled as before.  DuckDB's answer either way."""
    results = gang.run(app_merge_of_key_ranges, case, how)
    plan, placed, out = results[0][:3]
    con = _sides_in_duckdb(results, 3, 4)
    join = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "outer": "FULL JOIN"}.get(how, f"{how} JOIN")
    expected = con.sql(f"SELECT * FROM l {join} r ON l.k IS NOT DISTINCT FROM r.rk").to_arrow_table()
    assert out.num_rows > 100
    assert_same_rows(out, expected.cast(out.schema))
    if gang.world_size == 1:
        return
    ranged = case in ("sorted", "edge", "date", "unsorted")
    assert ("each rank's key range is apart" in plan) is ranged, plan
    assert ("Exchange hash by ['k']" in plan) is not ranged, plan
    if how not in ("semi", "anti"):  # (those broadcast the right's distinct keys where not ranged)
        assert placed == (None if ranged or how in ("right", "outer") else ("k",))  # ranges: no hash placement


def app_key_set_into_the_right(env, how, most=False):
    rng = np.random.default_rng(env.rank + 3)
    n = 20_000
    lkeys = pa.array([None if i % 89 == 0 else int(x) for i, x in enumerate(rng.integers(0, 4000, n))], pa.int64())
    left = pa.table({"k": lkeys, "a": np.arange(n)})
    few = rng.integers(0, 4000, 150).tolist() if not most else list(range(8000))
    chosen = pa.table({"pk": pa.array([None, *few], pa.int64())})
    # a third of the left's keys on some rank's right side, the right's other keys past them
    rkeys = pa.array([None if i % 97 == 0 else int(x) for i, x in enumerate(rng.integers(0, 8000, 3000))], pa.int64())
    right = pa.table({"rk": rkeys, "b": rng.random(3000)})
    lf = px.DataFrame.from_arrow(left, env).merge(
        px.DataFrame.from_arrow(chosen, env), left_on="k", right_on="pk", how="semi"
    )
    out = lf.merge(px.DataFrame.from_arrow(right, env), left_on="k", right_on="rk", how=how)
    return out.explain(file=open("/dev/null", "w")), out.collect(root=0), left, right, chosen


@pytest.mark.parametrize("how", ["inner", "left", "semi", "anti", "right"])
def test_the_right_side_keeps_only_the_keys_the_left_was_already_filtered_to(gang, how):
    """A left side semi-joined with a few keys meets a right side on that key: the right's rows
    are filtered by the same keys first (none of the others can match), where the merge drops
    unmatched right rows (inner, left, semi, anti; not right); null keys matching each other.
    DuckDB's answer either way."""
    import duckdb

    results = gang.run(app_key_set_into_the_right, how)
    plan, out = results[0][:2]
    con = duckdb.connect()
    for name, at in (("l", 2), ("r", 3), ("p", 4)):
        con.register(name, pa.concat_tables([res[at] for res in results]))
    left = "(SELECT * FROM l SEMI JOIN p ON l.k IS NOT DISTINCT FROM p.pk)"
    join = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "semi": "SEMI JOIN", "anti": "ANTI JOIN"}
    expected = con.sql(f"SELECT * FROM {left} l {join[how]} r ON l.k IS NOT DISTINCT FROM r.rk").to_arrow_table()
    assert out.num_rows > 100
    assert_same_rows(out, expected.cast(out.schema))
    assert ("the keys the left's k was joined with" in plan) is (how != "right"), plan


def test_the_right_side_is_not_filtered_by_keys_that_would_keep_most_of_it(gang):
    """Where the left's keys would keep most of the right's rows (sampled on every rank), the
    test is not added: a pass for little; the merge's rows are the same."""
    import duckdb

    results = gang.run(app_key_set_into_the_right, "inner", True)
    plan, out = results[0][:2]
    con = duckdb.connect()
    for name, at in (("l", 2), ("r", 3), ("p", 4)):
        con.register(name, pa.concat_tables([res[at] for res in results]))
    sql = "SELECT * FROM (SELECT * FROM l SEMI JOIN p ON l.k IS NOT DISTINCT FROM p.pk) l JOIN r ON l.k IS NOT DISTINCT FROM r.rk"
    assert_same_rows(out, con.sql(sql).to_arrow_table().cast(out.schema))
    assert "the keys the left's k was joined with" not in plan, plan


def app_two_joins_in_a_pipeline(env, selective_second):
    rng = np.random.default_rng(env.rank + 21)
    n = 40_000
    nulls = np.arange(n) % 113 == 0
    big = pa.table(
        {"a": pa.array(rng.integers(0, 50_000, n), mask=nulls), "b": rng.integers(0, 20_000, n), "v": rng.random(n)}
    )
    # on rank 0 only: the first join's table holds half of a's keys (a quarter where the
    # second is not selective); the second's 1 in 40 of b's keys (or all of them)
    ak = np.arange(0, 50_000, 2 if selective_second else 4)[: None if env.rank == 0 else 0]
    bk = np.arange(0, 20_000, 40 if selective_second else 1)[: None if env.rank == 0 else 0]
    first = pa.table({"ak": ak, "x": ak * 10})
    second = pa.table({"bk": bk, "y": pa.array([f"y{k % 5}" for k in bk], pa.string())})
    one, two = px.DataFrame.from_arrow(first, env), px.DataFrame.from_arrow(second, env)
    df = px.DataFrame.from_arrow(big, env).merge(one, left_on="a", right_on="ak").select(["b", "v", "ak", "x"])
    out = df.merge(two, left_on="b", right_on="bk")
    g = out.groupby("y").agg(v=("v", "sum"), n=("v", "size"), x=("x", "max"))  # runs out's steps
    plan = g.explain(file=open("/dev/null", "w"))
    return plan, out.columns, out.collect(root=0), g.collect(root=0), big, first, second


@pytest.mark.parametrize("selective_second", [True, False], ids=["second keeps fewer rows", "first keeps fewer"])
def test_of_two_joins_in_a_pipeline_the_one_that_keeps_fewer_rows_runs_first(gang, selective_second):
    """Two joins with small tables in one pipeline, the second keeping far fewer rows (1 in
    40 keys against half): the second runs first, its key's membership filtering the rows
    before its join copies them; the columns in the merges' order, rows and the group-by
    over them DuckDB's.  Where the first keeps fewer, the order stays."""
    import duckdb

    results = gang.run(app_two_joins_in_a_pipeline, selective_second)
    plan, columns, rows, grouped = results[0][:4]
    con = duckdb.connect()
    for name, at in (("big", 4), ("one", 5), ("two", 6)):
        con.register(name, pa.concat_tables([res[at] for res in results]))
    joined = "SELECT b, v, ak, x, bk, y FROM big JOIN one ON a = ak JOIN two ON b = bk"
    assert columns == ["b", "v", "ak", "x", "bk", "y"]
    assert_same_rows(rows, con.sql(joined).to_arrow_table().cast(rows.schema))
    expected = con.sql(f"SELECT y, sum(v) AS v, count(*) AS n, max(x) AS x FROM ({joined}) GROUP BY y").to_arrow_table()
    assert_same_rows(grouped, expected.cast(grouped.schema))
    joins = [line for line in plan.splitlines() if "per-rank join (" in line and "): inner on" in line]
    assert len(joins) == 2, plan
    assert ("on b = bk" in joins[0]) is selective_second, plan


def _masked_part(rank: int, rows: int = 4000) -> pa.Table:
    """A rank's rows: one-byte flags and names as keys (some null), values with nulls and NaN,
    dates the filters cut by, and a text column that is a number only where ``d`` is late."""
    rng = np.random.default_rng([29, rank])
    day = rng.integers(0, 100, rows)
    v = rng.normal(10, 3, rows)
    v[rng.random(rows) < 0.05] = np.nan
    return pa.table(
        {
            "flag": pa.array([None if i % 53 == 0 else "ANR"[x] for i, x in enumerate(rng.integers(0, 3, rows))]),
            "name": pa.array([f"n{x}" for x in rng.integers(0, 40, rows)]),
            "k": pa.array([None if i % 61 == 0 else int(x) for i, x in enumerate(rng.integers(0, 50, rows))]),
            "o": pa.array(rank * 100 + np.arange(rows) * 101 // rows),  # sorted; ranks share edge keys
            "v": pa.array([None if i % 47 == 0 else x for i, x in enumerate(v)], pa.float64()),
            "q": pa.array(rng.integers(-1000, 1000, rows)),
            "d": pa.array(day.astype("int32")).cast(pa.date32()),
            "text": pa.array([f"{x / 4}" if d >= 10 else "n/a" for x, d in zip(rng.integers(0, 400, rows), day)]),
        }
    )


_MASKED_QUERIES = {  # (the phalanx query, the same in SQL over t), each after a filter on d
    "flag": (["flag"], "flag"),
    "flag, name": (["flag", "name"], "flag, name"),
    "k (an integer key)": (["k"], "k"),
    "o (sorted, ranks' ranges touch)": (["o"], "o"),
    "o, flag": (["o", "flag"], "o, flag"),
}


def app_masked_groupby(env, cut, keys, cast):
    import datetime
    import os

    os.environ["PHALANX_THREADS"] = "1"  # Arrow's one-thread pass: where the mask applies
    try:
        df = px.DataFrame.from_arrow(_masked_part(env.rank), env)
        q = df.filter(pc.field("d") >= pa.scalar(datetime.date(1970, 1, 1) + datetime.timedelta(days=cut)))
        q = q.assign(z=pc.field("v") * (pc.scalar(1.0) - pc.field("q") / pc.scalar(2000.0)))
        if cast:  # fails on a row the filter drops ("n/a"): must not run on them
            q = q.assign(num=pc.field("text").cast(pa.float64()))
        value = "num" if cast else "z"
        g = q.groupby(keys).agg(
            total=(value, "sum"),
            mean_v=("v", "mean"),
            sum_v=("v", "sum"),
            n_v=("v", "count"),
            n_q=("q", "count"),
            rows=("q", "size"),
            lo=("q", "min"),
            hi=("q", "max"),
        )
        return g.collect(root=0), g.explain(file=open("/dev/null", "w"))
    finally:
        os.environ.pop("PHALANX_THREADS")


@pytest.mark.parametrize("keys", list(_MASKED_QUERIES), ids=list(_MASKED_QUERIES))
@pytest.mark.parametrize(
    "cut, cast", [(5, False), (90, False), (10, True)], ids=["keeps most", "keeps few", "a cast after the filter"]
)
def test_a_filter_keeping_most_rows_reaches_the_aggregation_as_a_mask(gang, keys, cut, cast):
    """A filter that keeps most rows is not applied before Arrow's group-by: the rows it drops
    get a null key, a group dropped after (no copy of the rows kept).  Not where it keeps few
    rows, or where a step after it could fail on the rows it drops (a cast of text that is a
    number only on the rows kept).  Keys sorted on each rank with ranges apart but touching
    (edge rows move: only rows the filter keeps) aggregate in runs of the filtered rows.  Null
    keys are dropped as pandas does; NaN and null values counted as DuckDB counts them."""
    import duckdb

    results = gang.run(app_masked_groupby, cut, _MASKED_QUERIES[keys][0], cast)
    out, plan = results[0]
    con = duckdb.connect()
    con.register("t", pa.concat_tables([_masked_part(r) for r in range(gang.world_size)]))
    by = _MASKED_QUERIES[keys][1]
    value = "CAST(text AS DOUBLE)" if cast else "v * (1 - q / 2000.0)"
    not_null = " AND ".join(f"{c} IS NOT NULL" for c in by.split(", "))
    expected = con.sql(
        f"SELECT {by}, coalesce(sum({value}), 0) AS total, avg(v) AS mean_v, coalesce(sum(v), 0) AS sum_v, "
        "count(v) AS n_v, "
        f"count(q) AS n_q, count(*) AS rows, min(q) AS lo, max(q) AS hi "
        f"FROM t WHERE d >= DATE '1970-01-01' + INTERVAL {cut} DAY AND {not_null} GROUP BY {by}"
    ).to_arrow_table()
    assert_same_rows(out, expected.cast(out.schema))
    assert ("filter as a mask" in plan) is (cut == 5 and not cast), plan
    if keys.startswith("o") and gang.world_size > 1:
        assert "each rank's key range is apart from the others' (edge keys moved)" in plan, plan


def app_groupby_by_a_spreading_key(env, case):
    rng = np.random.default_rng(env.rank + 11)
    n = 30_000
    ids = rng.integers(0, 60_000, n)  # mostly distinct on a rank (raw rows move), shared across ranks
    k0, k1 = {
        "the first spreads": (pa.array(np.char.add("id-", ids.astype(str))), ids // 7),
        "the first repeats": (ids % 3, ids),
        "none alone spreads": (ids % 300, ids // 300),
        "the first repeats on rank 0": (ids % 3 if env.rank == 0 else ids, ids),
        "few rows: all keys": (pa.array(np.char.add("id-", ids.astype(str))), ids // 7),
    }[case]
    k1 = pa.array(k1, mask=np.arange(n) % 101 == 5)  # null keys: their rows dropped (dropna)
    table = pa.table({"k0": k0, "k1": k1, "v": rng.random(n), "w": rng.integers(0, 9, n)})
    from phalanx.operators import groupby

    was = groupby._SPREAD_MIN_ROWS
    groupby._SPREAD_MIN_ROWS = 0 if case != "few rows: all keys" else was  # test-sized frames
    try:
        out = px.DataFrame.from_arrow(table, env).groupby(["k0", "k1"]).agg(v=("v", "sum"), n=("w", "count"))
        plan = out.explain(file=open("/dev/null", "w"))
        again = out.groupby(["k0", "k1"]).agg(v=("v", "sum")).explain(file=open("/dev/null", "w"))
    finally:  # the gang's ranks serve the next tests
        groupby._SPREAD_MIN_ROWS = was
    return plan, out.partitioned_by, out.collect(root=0), table, again


@pytest.mark.parametrize(
    "case",
    [
        "the first spreads",
        "the first repeats",
        "none alone spreads",
        "the first repeats on rank 0",
        "few rows: all keys",
    ],
)
def test_raw_rows_of_a_group_by_move_by_one_key_where_it_alone_spreads_the_groups(gang, case):
    """Mostly distinct keys (no pre-aggregation): where one key alone tells apart about as many
    groups as all of them on every rank's sample, the rows are hashed by it alone (equal keys
    still meet); the result is placed by that key, and a group-by by the same keys after it
    moves nothing.  A key with few values (``ids % 3``), on any rank, is passed over.  DuckDB's
    answer."""
    import duckdb

    results = gang.run(app_groupby_by_a_spreading_key, case)
    plan, placed, out = results[0][:3]
    con = duckdb.connect()
    con.register("t", pa.concat_tables([r[3] for r in results]))
    expected = con.sql(
        "SELECT k0, k1, sum(v) AS v, count(w) AS n FROM t WHERE k0 IS NOT NULL AND k1 IS NOT NULL GROUP BY k0, k1"
    ).to_arrow_table()
    assert out.num_rows == expected.num_rows > 10_000
    assert_same_rows(out, expected.cast(out.schema))
    if gang.world_size == 1:
        return
    # the key all ranks name; under ``_SPREAD_MIN_ROWS`` rows a rank, all keys without a sample
    by = {"the first spreads": ["k0"], "none alone spreads": ["k0", "k1"], "few rows: all keys": ["k0", "k1"]}.get(
        case, ["k1"]
    )
    assert "raw rows exchanged" in plan and f"Exchange hash by {by}" in plan, plan
    assert placed == tuple(by)
    assert f"no exchange: already partitioned by {by}" in results[0][4], results[0][4]
