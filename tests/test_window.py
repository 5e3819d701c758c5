"""Window functions (``df.window``) against DuckDB's window SQL over the whole table, ties broken
by the global row position as phalanx breaks them, at 1-4 ranks: nulls in values, keys and
order columns, a rank with no rows, one hot key, string keys, timestamps and dates."""

from __future__ import annotations

import datetime as dt

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from reference import assert_same_rows, gid_table, make_part

import phalanx as px
from phalanx.operators.window import parse_duration

# 1-4 ranks against DuckDB/pandas: the slow lane (two workers), outside the core lane's 5 minutes
pytestmark = pytest.mark.slow

ALL = dict(
    n=("row_number",),
    r=("rank",),
    d=("dense_rank",),
    c=("v", "cumsum"),
    ci=("w", "cumsum"),
    m=("v", "cummax"),
    mi=("w", "cummin"),
    prev=("v", "lag", 1),
    prev_s=("s", "lag", 3),
    nxt=("v", "lead", 2),
    rs=("v", "rolling_sum", 3),
    rm=("w", "rolling_mean", 4),
    fs=("f", "cumsum"),
    fmax=("f", "cummax"),
    fmin=("f", "cummin"),
)
TIMED = dict(rt=("v", "rolling_sum", "1d"), rtm=("w", "rolling_mean", dt.timedelta(hours=36)))


def part(rank: int, world: int, rows: int, seed: int = 0, hot: float = 0.3) -> pa.Table:
    """``make_part`` plus ``day``: the timestamp's date (many ties), null on some rows."""
    t = make_part(rank, world, rows, seed, hot)
    mask = np.random.default_rng(seed + 7 * rank).random(t.num_rows) < 0.1
    day = pc.if_else(pa.array(mask, pa.bool_()), pa.scalar(None, pa.date32()), t["ts"].cast(pa.date32()))
    f = pc.if_else(pa.array(np.random.default_rng(seed + rank).random(t.num_rows) < 0.05), float("nan"), t["v"])
    return t.append_column("day", day).append_column("f", f)  # f: v with NaN (the largest float)


def whole_parts(world: int, rows: int, seed: int = 0, hot: float = 0.3) -> pa.Table:
    return gid_table(pa.concat_tables([part(r, world, rows, seed, hot) for r in range(world)]))


def sql(query: str, **tables) -> pa.Table:
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con.sql(query).to_arrow_table()


def reference(T: pa.Table, specs: dict, order: list[str], asc: list[bool], keys: list[str]) -> pa.Table:
    """The same windows written by hand in DuckDB SQL over the whole table ``T`` (with ``gid``)."""
    peers = ", ".join(f"{c} {'ASC' if a else 'DESC'} NULLS LAST" for c, a in zip(order, asc))
    by_rows = f"ORDER BY {peers + ', ' if peers else ''}gid"
    part_by = f"PARTITION BY {', '.join(keys)}" if keys else ""
    cum = "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW"
    cols = []
    for out, spec in specs.items():
        f = spec[0] if len(spec) == 1 else spec[1]
        col = spec[0]
        e = {
            "row_number": f"row_number() OVER ({part_by} {by_rows})",
            "rank": f"rank() OVER ({part_by} ORDER BY {peers})",
            "dense_rank": f"dense_rank() OVER ({part_by} ORDER BY {peers})",
            "cumsum": f"sum({col}) OVER ({part_by} {by_rows} {cum})",
            "cummax": f"max({col}) OVER ({part_by} {by_rows} {cum})",
            "cummin": f"min({col}) OVER ({part_by} {by_rows} {cum})",
        }.get(f)
        if f in ("lag", "lead"):
            e = f"{f}({col}, {spec[2]}) OVER ({part_by} {by_rows})"
        elif f.startswith("rolling"):
            agg = "sum" if f == "rolling_sum" else "avg"
            w = spec[2]
            if isinstance(w, int):
                e = f"{agg}({col}) OVER ({part_by} {by_rows} ROWS BETWEEN {w - 1} PRECEDING AND CURRENT ROW)"
            else:
                us = parse_duration(w, "test")
                e = (
                    f"{agg}({col}) OVER ({part_by} ORDER BY {peers} "
                    f"RANGE BETWEEN INTERVAL '{us} microseconds' PRECEDING AND CURRENT ROW)"
                )
        if f in ("cumsum", "rolling_sum") and col == "w":
            e = f"CAST({e} AS BIGINT)"
        cols.append(f"{e} AS {out}")
    return sql(f"SELECT *, {', '.join(cols)} FROM T", T=T).drop_columns(["gid"])


def app_window(env, rows, kwargs, specs, hot=0.3, shuffle_first=None):
    df = px.DataFrame.from_arrow(part(env.rank, env.world_size, rows, hot=hot), env)
    if shuffle_first:
        df = df.shuffle(shuffle_first)
    out = df.window(**kwargs, **specs)
    return out.collect(root=0), out.partitioned_by, out.local_num_rows, out.explain(file=open("/dev/null", "w"))


def check(gang, rows, order, asc, keys, specs, hot=0.3, shuffle_first=None):
    kwargs = dict(order_by=order or None, partition_by=keys or None, ascending=asc if len(asc) != 1 else asc[0])
    results = gang.run(app_window, rows, kwargs, specs, hot, shuffle_first)
    out = results[0][0]
    T = whole_parts(gang.world_size, rows, hot=hot)
    expected = reference(T, specs, order, asc, keys)
    assert out.num_rows == T.num_rows and sum(r[2] for r in results) == T.num_rows
    assert_same_rows(_nan_flags(out), _nan_flags(expected))
    return results


def _nan_flags(t: pa.Table) -> pa.Table:
    """A NaN column per float column: assert_same_rows takes a NaN for any number."""
    for f in list(t.schema):
        if pa.types.is_floating(f.type):
            t = t.append_column(f"{f.name}_nan", pc.fill_null(pc.is_nan(t[f.name]), False))
    return t


@pytest.mark.parametrize(
    "order,asc,keys",
    [
        (["ts"], [True], ["key"]),  # integer keys with nulls and one hot key
        (["w", "v"], [False, True], ["s"]),  # string keys (nulls), ties in w, nulls in v
        (["day"], [True], ["b", "key"]),  # a date order with ties and nulls, two keys
    ],
)
@pytest.mark.parametrize("peers", [True, False])  # with rank/time ranges: DuckDB; row frames only: polars
def test_partitioned_windows_match_duckdb(gang, order, asc, keys, peers):
    specs = {**ALL, **(TIMED if order in (["ts"], ["day"]) else {})}
    if not peers:
        specs = {k: v for k, v in specs.items() if k not in ("r", "d", *TIMED)}
    results = check(gang, 500, order, asc, keys, specs)
    assert all(r[1] == tuple(keys) for r in results)  # output is partitioned by the keys
    assert results[0][0].schema.field("prev_s").type == pa.string()
    assert results[0][0].schema.field("ci").type == pa.int64()


def test_windows_with_a_descending_time_range_and_no_order_tiebreak_needed(gang):
    specs = {"rt": ("v", "rolling_sum", "2d"), "rm": ("v", "rolling_mean", "12h"), "r": ("rank",)}
    check(gang, 300, ["day"], [False], ["s"], specs)


@pytest.mark.parametrize(
    "order,asc,rows",
    [
        (["ts"], [True], 25),  # distinct times: rolling ranges reach back over several ranks
        (["day"], [True], 25),  # dates with ties and nulls: peers and null windows span ranks
        (["b"], [False], 9),  # two values: every tie group spans ranks; lag/lead over tiny ranks
        (["w", "s"], [True, False], 12),
        (["f"], [False], 8),  # NaN (first descending), nulls last; ties only among NaN and nulls
    ],
)
def test_global_windows_carry_across_rank_boundaries(gang, order, asc, rows):
    specs = {**ALL, "far": ("v", "lag", 7), "ahead": ("w", "lead", 11), "wide": ("v", "rolling_sum", 10)}
    if order[0] in ("ts", "day"):
        specs.update(TIMED, wide_t=("w", "rolling_sum", "4d"))
    results = check(gang, rows, order, asc, [], specs)
    assert all(r[1] is None for r in results)
    if gang.world_size > 1:
        assert "Exchange halo rows" in results[0][3]


def test_global_windows_in_frame_order_without_order_by(gang):
    specs = {k: v for k, v in ALL.items() if k not in ("r", "d")}
    check(gang, 20, [], [], [], specs)


def test_a_frame_partitioned_by_the_keys_is_not_shuffled_again(gang):
    results = check(
        gang, 300, ["ts"], [True], ["key"], {"c": ("v", "cumsum"), "p": ("v", "lag", 1)}, shuffle_first="key"
    )
    plan = results[0][3]
    assert "no exchange: already partitioned by them" in plan
    if gang.world_size > 1:
        assert plan.count("Exchange hash by ['key']") == 1  # the user's shuffle only


def test_one_hot_key_holding_most_rows(gang):
    check(gang, 400, ["ts"], [True], ["key"], {"n": ("row_number",), "c": ("w", "cumsum"), "l": ("v", "lead", 1)}, 0.9)


def app_errors(env):
    df = px.DataFrame.from_arrow(part(env.rank, env.world_size, 50), env)
    calls = [
        dict(order_by="ts", x=("v", "cumprod")),
        dict(order_by="ts", x=("nope", "cumsum")),
        dict(order_by="nope", x=("row_number",)),
        dict(order_by="ts", partition_by="nope", x=("row_number",)),
        dict(order_by="ts", x=("s", "cumsum")),
        dict(order_by="ts", x=("s", "rolling_mean", 3)),
        dict(order_by="w", x=("v", "rolling_sum", "7d")),
        dict(order_by=["ts", "w"], x=("v", "rolling_sum", "7d")),
        dict(order_by="ts", x=("v", "lag", -1)),
        dict(order_by="ts", x=("v", "lead", 1.5)),
        dict(order_by="ts", x=("v", "rolling_sum", 0)),
        dict(order_by="ts", x=("v", "rolling_sum", "7 parsecs")),
        dict(order_by="ts", v=("row_number",)),
        dict(x=("rank",)),
        dict(order_by="ts"),
        dict(order_by=["ts", "w"], ascending=[True], x=("row_number",)),
    ]
    errors = []
    for kwargs in calls:
        try:
            df.window(**kwargs)
            errors.append("no error")
        except (KeyError, ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # still collective after the refusals: every rank raised before any communication
    errors.append(df.window(order_by="ts", x=("row_number",)).num_rows)
    return errors


def test_bad_windows_raise_clear_errors_on_every_rank(gang):
    results = gang.run(app_errors)
    assert all(r == results[0] for r in results)
    e = results[0]
    expected = [
        ("ValueError", "unknown window function 'cumprod'"),
        ("KeyError", "'nope'"),
        ("KeyError", "'nope'"),
        ("KeyError", "'nope'"),
        ("TypeError", "cumsum needs a numeric column; 's' is string"),
        ("TypeError", "rolling_mean needs a numeric column"),
        ("TypeError", "a time range needs a timestamp or date order_by; 'w' is int64"),
        ("ValueError", "a time range needs exactly one order_by column"),
        ("ValueError", "lag's offset must be an int >= 0, got -1"),
        ("ValueError", "lead's offset must be an int >= 0, got 1.5"),
        ("ValueError", "at least 1 row"),
        ("ValueError", "a time range is a duration like '7d'"),
        ("ValueError", "clash with existing columns"),
        ("ValueError", "rank needs order_by"),
        ("ValueError", "no outputs"),
        ("ValueError", "2 order_by columns but 1 ascending flags"),
    ]
    for got, (kind, text) in zip(e, expected):
        assert got.startswith(kind) and text in got, (got, kind, text)
    assert e[-1] == sum(part(r, gang.world_size, 50).num_rows for r in range(gang.world_size))


def test_durations_parse_to_microseconds():
    assert parse_duration("7d", "t") == 7 * 86400 * 10**6
    assert parse_duration("1h30m", "t") == 5400 * 10**6
    assert parse_duration("30s", "t") == 30 * 10**6
    assert parse_duration("500ms", "t") == 500_000
    assert parse_duration(dt.timedelta(days=1, microseconds=3), "t") == 86400 * 10**6 + 3
    for bad in ("", "7", "d7", "-1d", 7, dt.timedelta(0), "1y"):
        with pytest.raises(ValueError):
            parse_duration(bad, "t")
