"""``merge_asof`` against pandas' at 1-4 ranks: by keys with nulls and skew, strings, timestamps
with ties, an empty rank, every direction, tolerances, each plan (broadcast, shuffle, ranges)."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from reference import assert_same_rows, make_part

import phalanx as px
from phalanx.operators.asof import merge_asof

# 1-4 ranks against DuckDB/pandas: the slow lane (two workers), outside the core lane's 5 minutes
pytestmark = pytest.mark.slow

ROWS = 500


def _part(rank: int, world: int, seed: int) -> pa.Table:
    t = make_part(rank, world, ROWS, seed, hot=0.3)
    # whole minutes: many equal timestamps on both sides (ties), and keys with few values
    ts = pc.cast(pc.divide(pc.cast(t["ts"], pa.int64()), 60 * 10**6), pa.int64())
    ts = pc.cast(pc.multiply(ts, 60 * 10**6), pa.timestamp("us"))
    key = pc.bit_wise_and(t["key"], 7)
    return t.set_column(t.schema.get_field_index("ts"), "ts", ts).set_column(0, "key", key)


def left_part(rank, world):
    return _part(rank, world, 0).select(["key", "ts", "v", "s"])


def right_part(rank, world):
    return _part(rank, world, 1).select(["ts", "key", "w", "s"]).rename_columns(["ts", "key", "price", "s"])


def whole(fn, world):
    return pa.concat_tables([fn(r, world) for r in range(world)])


CASES = [  # (by, direction, tolerance, broadcast)
    ("key", "backward", None, None),
    ("key", "forward", None, False),
    ("key", "nearest", dt.timedelta(minutes=90), False),
    (["key", "s"], "backward", dt.timedelta(hours=3), False),
    (None, "backward", None, False),
    (None, "nearest", dt.timedelta(minutes=30), False),
    (None, "forward", None, None),
]


def app_cases(env, sorted_left, cases):
    left = px.DataFrame.from_arrow(left_part(env.rank, env.world_size), env)
    right = px.DataFrame.from_arrow(right_part(env.rank, env.world_size), env)
    if sorted_left:
        left = left.sort_values("ts")
    out = []
    for by, direction, tol, broadcast in cases:
        df = merge_asof(left, right, on="ts", by=by, tolerance=tol, direction=direction, broadcast=broadcast)
        out.append((df.collect(root=0), df.to_arrow(), df.partitioned_by))
    return out, left.collect(root=0)


def expected(left: pa.Table, right: pa.Table, by, direction, tol) -> pa.Table:
    lp = left.to_pandas().assign(__gid=np.arange(left.num_rows))
    rp = right.to_pandas()
    res = pd.merge_asof(
        lp.sort_values("ts", kind="stable"),
        rp.sort_values("ts", kind="stable"),
        on="ts",
        by=by,
        tolerance=pd.Timedelta(tol) if tol is not None else None,
        direction=direction,
    )
    res = res.sort_values("__gid").drop(columns="__gid").reset_index(drop=True)
    return pa.Table.from_pandas(res, preserve_index=False)


@pytest.mark.parametrize(
    "sorted_left, cases", [(False, CASES[:4]), (False, CASES[4:]), (True, CASES[4:])], ids=["by", "ranges", "sorted"]
)
def test_merge_asof_matches_pandas(gang, sorted_left, cases):
    n = gang.world_size
    results = gang.run(app_cases, sorted_left, cases)
    answers, left = results[0]
    right = whole(right_part, n)
    for i, ((by, direction, tol, broadcast), (got, _, placed)) in enumerate(zip(cases, answers)):
        want = expected(left, right, by, direction, tol).cast(got.schema)
        moved = by is not None and broadcast is False and n > 1
        where = f"case {i}: by={by} {direction} tolerance={tol} broadcast={broadcast}"
        if moved:  # shuffled by `by`: the same rows; each rank's in the left's order
            assert_same_rows(got, want), where
            assert placed == tuple([by] if isinstance(by, str) else by), where
        else:  # the left did not move: pandas' order exactly
            assert got.equals(want), where
        names = {
            "key": ["key", "ts", "v", "s_x", "price", "s_y"],
            None: ["key_x", "ts", "v", "s_x", "key_y", "price", "s_y"],
        }
        assert got.column_names == names.get(by if isinstance(by, str) or by is None else "both", want.column_names)
    for rank_answers, _ in results:  # every rank's rows keep the left's order (by ts when sorted)
        for _, local, _ in rank_answers:
            if sorted_left:
                ts = local["ts"].to_numpy()
                assert (np.diff(ts.astype("int64")) >= 0).all()


def app_edge(env):
    """Ints and floats on `on`, null on values, an empty right side, suffix clashes."""
    rng = np.random.default_rng(env.rank)
    k = 0 if env.world_size >= 3 and env.rank == 1 else 50
    on = rng.integers(0, 100, k)
    left = pa.table({"t": pa.array(on, pa.int32(), mask=rng.random(k) < 0.1), "a": rng.integers(0, 9, k)})
    right = pa.table({"t": pa.array(rng.normal(50, 30, k)), "a": rng.integers(0, 9, k)})
    lf, rf = px.DataFrame.from_arrow(left, env), px.DataFrame.from_arrow(right, env)
    empty = px.DataFrame.from_arrow(right.slice(0, 0), env)
    out = [
        merge_asof(lf, rf, on="t", tolerance=3, direction="nearest", suffixes=("_l", "_r"), broadcast=b).collect(root=0)
        for b in (None, False)
    ]
    out.append(lf.merge_asof(empty, on="t").collect(root=0))
    return out, lf.collect(root=0), rf.collect(root=0)


def test_merge_asof_numbers_nulls_and_an_empty_side(gang):
    (bcast, ranged, nothing), left, right = gang.run(app_edge)[0]
    lp = left.to_pandas().assign(gid=np.arange(left.num_rows))
    known = lp[lp.t.notna()].astype({"t": "float64"}).sort_values("t", kind="stable")
    res = pd.merge_asof(
        known, right.to_pandas().sort_values("t"), on="t", direction="nearest", tolerance=3, suffixes=("_l", "_r")
    )
    res = res.set_index("gid").reindex(range(left.num_rows))  # a null `on` matches nothing
    assert bcast.column_names == ["t", "a_l", "a_r"] and bcast["t"].type == pa.float64()
    assert bcast.equals(ranged)
    assert bcast["a_r"].to_pylist() == [None if np.isnan(x) else int(x) for x in res.a_r]
    assert bcast["a_l"].to_pylist() == left["a"].to_pylist()
    assert nothing.num_rows == left.num_rows and nothing["a_y"].null_count == left.num_rows


def app_errors(env):
    df = px.DataFrame.from_arrow(left_part(env.rank, env.world_size), env)
    right = px.DataFrame.from_arrow(right_part(env.rank, env.world_size), env)
    named = right.rename({"key": "rkey"})
    errors = []
    calls = [
        lambda: df.merge_asof(right, on="ts", direction="sideways"),
        lambda: df.merge_asof(right, on="nope"),
        lambda: df.merge_asof(right, on="s"),
        lambda: df.merge_asof(right, on="ts", tolerance=5),
        lambda: df.merge_asof(right, on="ts", tolerance=dt.timedelta(seconds=-1)),
        lambda: df.merge_asof(right.rename({"key": "k2"}).assign(key="x"), on="ts", by="key"),
        lambda: df.merge_asof(right, on="ts", by="key", suffixes=("", "")),
        # left_by / right_by, allow_exact_matches
        lambda: df.merge_asof(named, on="ts", by="key", left_by="key", right_by="rkey"),
        lambda: df.merge_asof(named, on="ts", left_by="key"),
        lambda: df.merge_asof(named, on="ts", left_by=["key", "s"], right_by="rkey"),
        lambda: df.merge_asof(named, on="ts", left_by="key", right_by="s"),
        lambda: df.merge_asof(named, on="ts", left_by="key", right_by="nope"),
        lambda: df.merge_asof(named, on="ts", allow_exact_matches="no"),
    ]
    for call in calls:
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError, KeyError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def test_merge_asof_bad_inputs(gang):
    every = gang.run(app_errors)
    assert all(e == every[0] for e in every)  # every rank raised the same, none hung
    errors = every[0]
    assert "direction must be one of" in errors[0]
    assert "KeyError" in errors[1] and "'nope'" in errors[1]
    assert "numeric or temporal" in errors[2]
    assert "must be a datetime.timedelta" in errors[3]
    assert "tolerance must be >= 0" in errors[4]
    assert "key 'key' is int64 on the left but string on the right" in errors[5]
    assert "suffixes" in errors[6]
    both, alone, lengths, types, missing, exact = errors[7:]
    assert "give by, or left_by and right_by, not both" in both
    assert "left_by and right_by go together" in alone
    assert "must name as many columns each" in lengths
    assert "key/s" in types and "int64 on the left but string on the right" in types
    assert "KeyError" in missing and "'nope'" in missing
    assert "allow_exact_matches must be True or False" in exact


# (left_by, right_by, direction, tolerance, allow_exact_matches, broadcast): keys of different
# names (the right's kept in the output), exact matches excluded, through every plan
NAMED_CASES = [
    (["key", "s"], ["rkey", "s"], "backward", None, False, False),  # shuffle by key pairs
    ("key", "rkey", "nearest", dt.timedelta(minutes=90), False, None),  # broadcast right
    ("key", "rkey", "forward", None, True, False),
    (None, None, "forward", None, False, False),  # ranges
    (None, None, "nearest", None, False, False),
    (None, None, "backward", dt.timedelta(hours=2), False, None),
]


def app_named(env, cases):
    left = px.DataFrame.from_arrow(left_part(env.rank, env.world_size), env)
    right = px.DataFrame.from_arrow(right_part(env.rank, env.world_size), env).rename({"key": "rkey"})
    out = []
    for lby, rby, direction, tol, exact, broadcast in cases:
        df = left.merge_asof(
            right,
            on="ts",
            left_by=lby,
            right_by=rby,
            tolerance=tol,
            direction=direction,
            allow_exact_matches=exact,
            broadcast=broadcast,
        )
        out.append((df.collect(root=0), df.partitioned_by))
    return out, left.collect(root=0)


def test_merge_asof_left_by_right_by_and_no_exact_matches_match_pandas(gang):
    n = gang.world_size
    answers, left = gang.run(app_named, NAMED_CASES)[0]
    right = whole(right_part, n).rename_columns(["ts", "rkey", "price", "s"])
    lp = left.to_pandas().assign(__gid=np.arange(left.num_rows)).sort_values("ts", kind="stable")
    rp = right.to_pandas().sort_values("ts", kind="stable")
    for (lby, rby, direction, tol, exact, broadcast), (got, placed) in zip(NAMED_CASES, answers):
        options = dict(on="ts", left_by=lby, right_by=rby, direction=direction)
        options["tolerance"] = pd.Timedelta(tol) if tol is not None else None
        res = pd.merge_asof(lp, rp, allow_exact_matches=exact, **options)
        res = res.sort_values("__gid").drop(columns="__gid").reset_index(drop=True)
        want = pa.Table.from_pandas(res, preserve_index=False)
        if not exact:  # the data has exact matches: excluding them changes the answer
            with_exact = pd.merge_asof(lp, rp, **options).sort_values("__gid").reset_index(drop=True)
            assert not with_exact["price"].equals(res["price"])
        where = f"left_by={lby} right_by={rby} {direction} tolerance={tol} exact={exact}"
        assert got.column_names == want.column_names, (where, got.column_names)
        want = want.cast(got.schema)
        if lby is not None and broadcast is False and n > 1:  # shuffled by the key pairs
            assert_same_rows(got, want), where
            assert placed == tuple([lby] if isinstance(lby, str) else lby), where
        else:
            assert got.equals(want), where
        if lby is not None:  # a matched row's right key equals its left key
            lk = got["key"].to_pylist()
            assert all(r is None or r == k for k, r in zip(lk, got["rkey"].to_pylist())), where
