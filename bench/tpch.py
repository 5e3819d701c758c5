#!/usr/bin/env python
"""TPC-H, all 22 queries: phalanx's distributed DataFrame against DuckDB, Polars, Spark and
Dask on the same generated data; every answer checked against DuckDB's.

    .venv/bin/python bench/tpch.py                       # SF 1, phalanx 1 and 2 ranks, all peers
    .venv/bin/python bench/tpch.py --quick               # SF 0.1, 1 rep, duckdb + polars
    .venv/bin/python bench/tpch.py --sf 1,3 --peers duckdb,polars,spark,dask --reps 3
    .venv/bin/python bench/tpch.py --sf 1 --ranks 2 --reps 3 --peers duckdb   # the table + geomean
    .venv/bin/python bench/tpch.py --check               # answers only: SF 0.05, 1 and 2 ranks
    .venv/bin/python bench/tpch.py --queries q2,q21 --check --ranks 3

The queries (SQL and phalanx plans) are in bench/tpch_queries.py; ``--check`` runs each once
per rank count and compares with DuckDB in this process (exit 1 on a difference); the full run
prints one table per query, a summary table with the ratio phalanx ÷ peer per query and its
geometric mean, and writes bench/out/tpch-<stamp>.json.

Data.  DuckDB's ``tpch`` extension (``CALL dbgen``) cannot be installed offline here (DuckDB
2.0 downloads it; the duckdb pip wheel does not bundle it, and the ``duckdb-extension-tpch``
wheels on PyPI are built for DuckDB 1.4/1.5), so ``gen_tables`` is a small vectorised
generator that follows the TPC-H specification (clause 4.2.3) for the eight tables:
cardinalities (SF×150k customers, SF×1.5M orders with sparse keys, 1–7 lines per order,
SF×10k suppliers, SF×200k parts with 4 suppliers each, the 25 nations and 5 regions), key
relations (o_custkey never ≡ 0 mod 3, l_suppkey from the part's four suppliers = partsupp's),
value distributions (dates, quantity, discount, tax, extended price from the part's
retail-price formula, return flag and line status from the dates, order status and total price
from its lines), segments, priorities, ship modes and instructions, part names (5 of the 92
colours), brands, types, sizes and containers, and 5 in 10,000 supplier comments with
"Customer ... Complaints".  Other text columns (comments, addresses) are drawn from a pool of
random words (Q13's '%special%requests%' matches some).  Decimal columns are float64.  Files:
bench/out/tpch-sf<SF>/<table>.parquet (generated once, reused; SF 1: 10-20 s).

Engines, each given R cores:
    phalanx   a gang of R ranks, one kernel thread per rank; tables read with px.read_parquet
              (row groups split over the ranks) before timing; queries use only the DataFrame
              API (filter/assign with Arrow expressions, merge incl. multi-key, left, semi and
              anti, groupby.agg, agg, drop_duplicates, sort_values incl. limit (top-k),
              nlargest, collect); scalar subqueries are a one-row agg collected to a literal
    duckdb    SET threads = R; tables loaded into DuckDB before timing; the SQL
    polars    POLARS_MAX_THREADS = R; DataFrames in memory; the same SQL through pl.SQLContext
    spark     local[R], 4g driver heap, shuffle partitions = R; cached temp views; the same SQL
    dask      LocalCluster of R single-threaded worker processes; persisted frames; pandas-style
              code for Q1, Q3, Q5, Q6, Q10, Q18 (the others are reported as not run)
Timing: a query from the in-memory tables to its (small) result on the driver or rank 0; min
over repetitions.  Peak RSS: as in bench/operators.py (VmHWM reset per repetition; largest
process or rank, and the sum over the engine's processes).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # at the end: bench/ holds airflow.py, parsl.py... (shadowing them)
    sys.path.append(str(HERE))
import _peers  # noqa: E402
from tpch_queries import QUERIES, SQL  # noqa: E402

PEERS = ("duckdb", "polars", "spark", "dask")
TABLES = ("lineitem", "orders", "customer", "supplier", "nation", "region", "part", "partsupp")
RESULT_TAG = "@@RESULT@@ "
GEN_VERSION = "2"

# ---- data -----------------------------------------------------------------------------------
NATIONS = [
    ("ALGERIA", 0),
    ("ARGENTINA", 1),
    ("BRAZIL", 1),
    ("CANADA", 1),
    ("EGYPT", 4),
    ("ETHIOPIA", 0),
    ("FRANCE", 3),
    ("GERMANY", 3),
    ("INDIA", 2),
    ("INDONESIA", 2),
    ("IRAN", 4),
    ("IRAQ", 4),
    ("JAPAN", 2),
    ("JORDAN", 4),
    ("KENYA", 0),
    ("MOROCCO", 0),
    ("MOZAMBIQUE", 0),
    ("PERU", 1),
    ("CHINA", 2),
    ("ROMANIA", 3),
    ("SAUDI ARABIA", 4),
    ("VIETNAM", 2),
    ("RUSSIA", 3),
    ("UNITED KINGDOM", 3),
    ("UNITED STATES", 1),
]
REGIONS = ["AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST"]
SEGMENTS = ["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"]
PRIORITIES = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"]
INSTRUCT = ["DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN"]
MODES = ["REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB"]
WORDS = (
    "furiously carefully quickly slyly blithely final regular special express pending ironic "
    "bold even silent unusual idle busy ruthless packages requests accounts deposits foxes "
    "theodolites instructions pinto beans dependencies asymptotes courts dolphins"
).split()
COLORS = (
    "almond antique aquamarine azure beige bisque black blanched blue blush brown burlywood burnished "
    "chartreuse chiffon chocolate coral cornflower cornsilk cream cyan dark deep dim dodger drab firebrick "
    "floral forest frosted gainsboro ghost goldenrod green grey honeydew hot indian ivory khaki lace "
    "lavender lawn lemon light lime linen magenta maroon medium metallic midnight mint misty moccasin "
    "navajo navy olive orange orchid pale papaya peach peru pink plum powder puff purple red rose rosy "
    "royal saddle salmon sandy seashell sienna sky slate smoke snow spring steel tan thistle tomato "
    "turquoise violet wheat white yellow"
).split()
TYPE_WORDS = (
    ["STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO"],
    ["ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED"],
    ["TIN", "NICKEL", "BRASS", "STEEL", "COPPER"],
)
CONTAINERS = (["SM", "LG", "MED", "JUMBO", "WRAP"], ["CASE", "BOX", "BAG", "JAR", "PKG", "PACK", "CAN", "DRUM"])
START, CURRENT, END = np.datetime64("1992-01-01"), np.datetime64("1995-06-17"), np.datetime64("1998-12-31")


def _text_pool(rng, n: int, words: int) -> list[str]:
    idx = rng.integers(0, len(WORDS), (n, words))
    return [" ".join(WORDS[j] for j in row) for row in idx]


def _pick(rng, values, n):
    import pyarrow as pa

    return pa.array(values).take(pa.array(rng.integers(0, len(values), n)))


def _phone(rng, nationkey):
    r = rng.integers(0, 10_000_000_000, len(nationkey))
    return [
        f"{nk + 10}-{x // 10_000_000 % 900 + 100}-{x // 10_000 % 900 + 100}-{x % 10_000:04d}"
        for nk, x in zip(nationkey.tolist(), r.tolist())
    ]


def _combos(rng, n: int, *word_lists) -> pa.Array:
    """n strings, each one word from every list joined by spaces (p_type, p_container)."""
    import itertools

    import pyarrow as pa

    combos = [" ".join(ws) for ws in itertools.product(*word_lists)]
    return pa.array(combos).take(pa.array(rng.integers(0, len(combos), n)))


def gen_part(rng, P: int, S: int, text) -> dict:
    """part and partsupp (clause 4.2.3): p_name five distinct colours, brand from the
    manufacturer, type and container from the syllable lists, four suppliers per part at the
    keys lineitem's l_suppkey uses."""
    import pyarrow as pa

    pk = np.arange(1, P + 1, dtype=np.int64)
    names = np.argsort(rng.random((P, len(COLORS))), axis=1)[:, :5]  # 5 distinct colours
    colors = np.array(COLORS, dtype=object)
    mfgr = rng.integers(1, 6, P)
    brand = mfgr * 10 + rng.integers(1, 6, P)
    part = pa.table(
        {
            "p_partkey": pk,
            "p_name": [" ".join(row) for row in colors[names].tolist()],
            "p_mfgr": [f"Manufacturer#{m}" for m in mfgr.tolist()],
            "p_brand": [f"Brand#{b}" for b in brand.tolist()],
            "p_type": _combos(rng, P, *TYPE_WORDS),
            "p_size": rng.integers(1, 51, P),
            "p_container": _combos(rng, P, *CONTAINERS),
            "p_retailprice": (90000 + ((pk // 10) % 20001) + 100 * (pk % 1000)) / 100.0,
            "p_comment": text(P),
        }
    )
    ps_pk = np.repeat(pk, 4)
    i = np.tile(np.arange(4, dtype=np.int64), P)
    partsupp = pa.table(
        {
            "ps_partkey": ps_pk,
            "ps_suppkey": (ps_pk + i * (S // 4 + (ps_pk - 1) // S)) % S + 1,
            "ps_availqty": rng.integers(1, 10_000, 4 * P),
            "ps_supplycost": np.round(rng.uniform(1.0, 1000.0, 4 * P), 2),
            "ps_comment": text(4 * P),
        }
    )
    return {"part": part, "partsupp": partsupp}


def _complaints(rng, comments: pa.Array) -> pa.Array:
    """s_comment: 5 in 10,000 suppliers (at least one) carry 'Customer ... Complaints' (Q16)."""
    import pyarrow as pa

    out = comments.to_pylist()
    for j in rng.choice(len(out), max(1, len(out) * 5 // 10_000), replace=False).tolist():
        out[j] = f"{out[j]} Customer slyly Complaints"
    return pa.array(out, pa.string())


def gen_tables(sf: float, seed: int = 14) -> dict:
    """The six tables as Arrow tables (TPC-H clause 4.2.3, see the module docstring)."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    pool = pa.array(_text_pool(rng, 4096, 6))
    text = lambda n: pool.take(pa.array(rng.integers(0, len(pool), n)))  # noqa: E731
    S, C, O, P = int(sf * 10_000), int(sf * 150_000), int(sf * 1_500_000), int(sf * 200_000)
    r2 = lambda a: np.round(a, 2)  # noqa: E731
    out = {}
    out["region"] = pa.table({"r_regionkey": np.arange(5, dtype=np.int64), "r_name": REGIONS, "r_comment": text(5)})
    out["nation"] = pa.table(
        {
            "n_nationkey": np.arange(25, dtype=np.int64),
            "n_name": [n for n, _ in NATIONS],
            "n_regionkey": np.array([r for _, r in NATIONS], dtype=np.int64),
            "n_comment": text(25),
        }
    )
    snk = rng.integers(0, 25, S)
    out["supplier"] = pa.table(
        {
            "s_suppkey": np.arange(1, S + 1, dtype=np.int64),
            "s_name": [f"Supplier#{i:09d}" for i in range(1, S + 1)],
            "s_address": text(S),
            "s_nationkey": snk,
            "s_phone": _phone(rng, snk),
            "s_acctbal": r2(rng.uniform(-999.99, 9999.99, S)),
            "s_comment": _complaints(rng, text(S)),
        }
    )
    cnk = rng.integers(0, 25, C)
    out["customer"] = pa.table(
        {
            "c_custkey": np.arange(1, C + 1, dtype=np.int64),
            "c_name": [f"Customer#{i:09d}" for i in range(1, C + 1)],
            "c_address": text(C),
            "c_nationkey": cnk,
            "c_phone": _phone(rng, cnk),
            "c_acctbal": r2(rng.uniform(-999.99, 9999.99, C)),
            "c_mktsegment": _pick(rng, SEGMENTS, C),
            "c_comment": text(C),
        }
    )
    # orders: sparse keys (the first 8 of every 32), customers whose key is not a multiple of 3
    i = np.arange(O, dtype=np.int64)
    okey = (i // 8) * 32 + (i % 8) + 1
    valid = np.arange(1, C + 1, dtype=np.int64)
    valid = valid[valid % 3 != 0]
    ocust = valid[rng.integers(0, len(valid), O)]
    odate = START + rng.integers(0, int((END - np.timedelta64(151, "D") - START).astype(int)) + 1, O)
    # lineitem: 1..7 lines per order
    nl = rng.integers(1, 8, O)
    L = int(nl.sum())
    first = np.concatenate([[0], np.cumsum(nl)[:-1]])
    lok = np.repeat(okey, nl)
    lnum = np.arange(L, dtype=np.int64) - np.repeat(first, nl) + 1
    ldate = np.repeat(odate, nl)
    pk = rng.integers(1, P + 1, L)
    sup_i = rng.integers(0, 4, L)
    sk = (pk + sup_i * (S // 4 + (pk - 1) // S)) % S + 1
    qty = rng.integers(1, 51, L).astype(np.float64)
    retail = (90000 + ((pk // 10) % 20001) + 100 * (pk % 1000)) / 100.0
    ext = r2(qty * retail)
    disc = rng.integers(0, 11, L) / 100.0
    tax = rng.integers(0, 9, L) / 100.0
    ship = ldate + rng.integers(1, 122, L).astype("timedelta64[D]")
    commit = ldate + rng.integers(30, 91, L).astype("timedelta64[D]")
    receipt = ship + rng.integers(1, 31, L).astype("timedelta64[D]")
    rflag = np.where(receipt <= CURRENT, np.where(rng.integers(0, 2, L) == 0, "R", "A"), "N")
    lstatus = np.where(ship > CURRENT, "O", "F")
    out["lineitem"] = pa.table(
        {
            "l_orderkey": lok,
            "l_partkey": pk,
            "l_suppkey": sk,
            "l_linenumber": lnum,
            "l_quantity": qty,
            "l_extendedprice": ext,
            "l_discount": disc,
            "l_tax": tax,
            "l_returnflag": rflag.astype(object),
            "l_linestatus": lstatus.astype(object),
            "l_shipdate": ship,
            "l_commitdate": commit,
            "l_receiptdate": receipt,
            "l_shipinstruct": _pick(rng, INSTRUCT, L),
            "l_shipmode": _pick(rng, MODES, L),
            "l_comment": text(L),
        }
    )
    total = r2(np.add.reduceat(ext * (1 + tax) * (1 - disc), first))
    n_f = np.add.reduceat((lstatus == "F").astype(np.int64), first)
    ostatus = np.where(n_f == nl, "F", np.where(n_f == 0, "O", "P"))
    out["orders"] = pa.table(
        {
            "o_orderkey": okey,
            "o_custkey": ocust,
            "o_orderstatus": ostatus.astype(object),
            "o_totalprice": total,
            "o_orderdate": odate,
            "o_orderpriority": _pick(rng, PRIORITIES, O),
            "o_clerk": [f"Clerk#{k:09d}" for k in rng.integers(1, max(2, int(sf * 1000)) + 1, O).tolist()],
            "o_shippriority": np.zeros(O, dtype=np.int64),
            "o_comment": text(O),
        }
    )
    out.update(gen_part(rng, P, S, text))
    for name, t in out.items():  # dates as date32, strings as string
        fields = []
        for f in t.schema:
            typ = pa.date32() if pa.types.is_timestamp(f.type) or pa.types.is_date(f.type) else f.type
            fields.append(pa.field(f.name, typ))
        out[name] = t.cast(pa.schema(fields))
    return out


def ensure_data(sf: float, root: Path, log) -> Path:
    import pyarrow.parquet as pq

    d = root / f"tpch-sf{sf:g}"
    marker = d / f".complete-v{GEN_VERSION}"
    if marker.exists():
        return d
    t = time.perf_counter()
    d.mkdir(parents=True, exist_ok=True)
    tables = gen_tables(sf)
    for name, tab in tables.items():
        pq.write_table(tab, d / f"{name}.parquet", row_group_size=500_000)
    marker.write_text(json.dumps({n: t.num_rows for n, t in tables.items()}))
    log(
        f"generated TPC-H SF {sf:g} in {time.perf_counter() - t:.1f}s: "
        + "  ".join(f"{n} {t.num_rows:,}" for n, t in tables.items())
    )
    return d


def px_tpch_app(env, data_dir, queries, reps):
    import sys
    import time

    import phalanx as px

    if str(HERE) not in sys.path:
        sys.path.append(str(HERE))
    import _peers
    import tpch_queries

    t0 = time.perf_counter()
    # in memory before timing, as every peer's tables are (a lazy scan would decode Parquet
    # inside each query)
    tables = {n: px.read_parquet(f"{data_dir}/{n}.parquet", env).compute() for n in TABLES}
    out = {
        "load_s": time.perf_counter() - t0,
        "threads": env.threads,
        "local_rows": {n: t.local_num_rows for n, t in tables.items()},
    }
    qs = tpch_queries.px_queries()
    for q in queries:
        times, peaks, result = [], [], None
        for _ in range(reps):
            env.comm.barrier()
            _peers.own_peak_reset()
            t = time.perf_counter()
            res = qs[q](tables).collect(root=0)
            env.comm.barrier()
            times.append(time.perf_counter() - t)
            peaks.append(_peers.own_peak())
            result = res
        out[q] = {"times": times, "rss_peak": max(peaks), "result": table_json(result) if result is not None else None}
    return out


# ---- results: JSON-able and compared -----------------------------------------------------------
def table_json(t) -> dict:
    """An Arrow table or pandas frame as {"columns", "rows"}; dates as ISO strings."""
    import pandas as pd
    import pyarrow as pa

    if isinstance(t, pd.DataFrame):
        t = pa.Table.from_pandas(t, preserve_index=False)
    rows = []
    for rec in zip(*[t.column(i).to_pylist() for i in range(t.num_columns)]):
        rows.append(
            [
                x.isoformat()[:10]
                if isinstance(x, (_dt.date, _dt.datetime))
                else (float(x) if hasattr(x, "as_tuple") else x)
                for x in rec
            ]
        )  # Decimal -> float
    return {"columns": t.column_names, "rows": rows}


def compare(got: dict | None, ref: dict | None) -> str:
    """'ok' when ``got`` has ``ref``'s rows: numbers within 1e-6 relative, rows matched in
    order of ``ref`` (ORDER BY ... LIMIT) or, where floating sums tie-break differently, as a
    set keyed by the non-float columns whose float columns agree at every place (rows swapped
    only among equal floats)."""
    if got is None or ref is None:
        return "-"
    a, b = got["rows"], ref["rows"]
    if len(a) != len(b):
        return f"DIFF rows {len(a)} vs {len(b)}"
    if a and len(a[0]) != len(b[0]):
        return f"DIFF columns {len(a[0])} vs {len(b[0])}"

    def same(x, y):
        if isinstance(y, (int, float)) and isinstance(x, (int, float)) and not isinstance(x, bool):
            return abs(x - y) <= 1e-6 * max(1.0, abs(y))
        return str(x) == str(y)

    if all(same(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)):
        return "ok"
    keyed = [i for i, v in enumerate(b[0]) if not isinstance(v, float)] if b else []
    if keyed:
        ka = sorted(a, key=lambda r: [str(r[i]) for i in keyed])
        kb = sorted(b, key=lambda r: [str(r[i]) for i in keyed])
        floats = [i for i in range(len(b[0])) if i not in keyed]
        near_ties = all(same(ra[i], rb[i]) for ra, rb in zip(a, b) for i in floats)  # each place
        if near_ties and all(same(x, y) for ra, rb in zip(ka, kb) for x, y in zip(ra, rb)):
            return "ok (order of near-ties differs)"
    bad = next(i for i, (ra, rb) in enumerate(zip(a, b)) if not all(same(x, y) for x, y in zip(ra, rb)))
    return f"DIFF at row {bad}: {a[bad]} vs {b[bad]}"


# ---- peers (subprocesses: --peer ENGINE) ---------------------------------------------------------
def _timed(fn, reps, roots=()):
    """One query's times, peak RSS and answer; a query the engine cannot run (Polars' SQL has
    no correlated subqueries; the Dask code covers six queries) gives {"error": ...}."""
    try:
        times, rss, res = _peers.time_reps(fn, reps, roots)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
    return {"times": times, "rss": rss, "result": table_json(res)}


def best(e) -> float | None:
    """The fastest repetition of a query's entry, None where it did not run."""
    return min(e["times"]) if e and e.get("times") else None


def duckdb_reference(d, queries, threads: int = 1) -> dict:
    """{query: table_json} of DuckDB running the SQL on the tables in ``d`` (in this process)."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    for n in TABLES:
        con.execute(f"CREATE TABLE {n} AS SELECT * FROM read_parquet('{d}/{n}.parquet')")
    out = {}
    for q in queries:
        rel = con.sql(SQL[q])
        out[q] = table_json(rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.fetch_arrow_table())
    con.close()
    return out


def check(sf: float, ranks, queries, data_root: Path, log, gang=None) -> list[str]:
    """``--check``: every query once with phalanx at each rank count in ``ranks``, its answer
    compared with DuckDB's (same rows; numbers within 1e-6 relative; order where the query
    orders).  ``gang``: a started gang to use (its size is the one rank count), for the tests.
    The failures, as lines."""
    import phalanx as px

    d = ensure_data(sf, data_root, log)
    ref = duckdb_reference(d, queries)
    failures = []
    for R in ranks:
        g = gang
        if g is None:
            from operators import one_thread_launcher

            g = px.Gang(ranks=R, echo=False, executor=one_thread_launcher())
            g.start()
        try:
            per_rank = g.run(px_tpch_app, str(d), list(queries), 1, timeout=600)
        finally:
            if gang is None:
                g.close()
        cells = []
        for q in queries:
            verdict = compare(per_rank[0][q]["result"], ref[q])
            secs = max(p[q]["times"][0] for p in per_rank)
            cells.append(f"{q:<4} {len(ref[q]['rows']):>5} rows {secs:7.3f}s  {verdict}")
            if verdict.startswith("DIFF") or verdict == "-":
                failures.append(f"SF {sf:g} {q} phalanx/{R}: {verdict}")
        log(f"[check SF {sf:g}] phalanx {R} rank(s) vs DuckDB ({len(ref)} queries):")
        for c in cells:
            log(f"  {c}")
    return failures


def peer_duckdb(d, R, queries, reps):
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {R}")
    for n in TABLES:
        con.execute(f"CREATE TABLE {n} AS SELECT * FROM read_parquet('{d}/{n}.parquet')")
    settings = {
        "version": duckdb.__version__,
        "threads": con.execute("SELECT current_setting('threads')").fetchall()[0][0],
    }

    def run(q):
        rel = con.sql(SQL[q])
        return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.fetch_arrow_table()

    return settings, {q: _timed(lambda q=q: run(q), reps) for q in queries}


def peer_polars(d, R, queries, reps):
    import polars as pl

    assert os.environ.get("POLARS_MAX_THREADS") == str(R)
    ctx = pl.SQLContext({n: pl.read_parquet(f"{d}/{n}.parquet") for n in TABLES}, eager=False)
    settings = {"version": pl.__version__, "thread_pool_size": pl.thread_pool_size(), "api": "pl.SQLContext"}
    return settings, {q: _timed(lambda q=q: ctx.execute(SQL[q]).collect().to_arrow(), reps) for q in queries}


def peer_spark(d, R, queries, reps):
    sp = _peers.Spark("local", R)
    try:
        s = sp.start()
        for n in TABLES:
            df = s.read.parquet(f"{d}/{n}.parquet").cache()
            df.count()
            df.createOrReplaceTempView(n)
        out = {q: _timed(lambda q=q: s.sql(SQL[q]).toArrow(), reps, sp.pids()) for q in queries}
        return sp.settings, out
    finally:
        sp.stop()


def dask_queries(t):
    """The queries in pandas style on Dask DataFrames (``t``: persisted frames)."""
    import pandas as pd

    def D(s):
        return pd.Timestamp(s)

    def rev(df):
        return df.l_extendedprice * (1 - df.l_discount)

    def q1():
        li = t["lineitem"]
        li = li[li.l_shipdate <= D("1998-09-02")]
        li = li.assign(disc_price=rev(li))
        li = li.assign(charge=li.disc_price * (1 + li.l_tax))
        g = (
            li.groupby(["l_returnflag", "l_linestatus"])
            .agg(
                sum_qty=("l_quantity", "sum"),
                sum_base_price=("l_extendedprice", "sum"),
                sum_disc_price=("disc_price", "sum"),
                sum_charge=("charge", "sum"),
                avg_qty=("l_quantity", "mean"),
                avg_price=("l_extendedprice", "mean"),
                avg_disc=("l_discount", "mean"),
                count_order=("l_quantity", "count"),
            )
            .compute()
        )
        return g.reset_index().sort_values(["l_returnflag", "l_linestatus"])

    def q3():
        c = t["customer"]
        c = c[c.c_mktsegment == "BUILDING"][["c_custkey"]]
        o = t["orders"]
        o = o[o.o_orderdate < D("1995-03-15")][["o_orderkey", "o_custkey", "o_orderdate", "o_shippriority"]]
        li = t["lineitem"]
        li = li[li.l_shipdate > D("1995-03-15")][["l_orderkey", "l_extendedprice", "l_discount"]]
        x = c.merge(o, left_on="c_custkey", right_on="o_custkey").merge(li, left_on="o_orderkey", right_on="l_orderkey")
        x = x.assign(revenue=rev(x))
        g = x.groupby(["l_orderkey", "o_orderdate", "o_shippriority"]).revenue.sum().reset_index()
        top = g.compute().sort_values(["revenue", "o_orderdate"], ascending=[False, True]).head(10)
        return top[["l_orderkey", "revenue", "o_orderdate", "o_shippriority"]]

    def q5():
        r = t["region"]
        n = t["nation"].merge(r[r.r_name == "ASIA"], left_on="n_regionkey", right_on="r_regionkey")
        c = t["customer"][["c_custkey", "c_nationkey"]].merge(
            n[["n_nationkey", "n_name"]], left_on="c_nationkey", right_on="n_nationkey"
        )
        o = t["orders"]
        o = o[(o.o_orderdate >= D("1994-01-01")) & (o.o_orderdate < D("1995-01-01"))][["o_orderkey", "o_custkey"]]
        li = t["lineitem"][["l_orderkey", "l_suppkey", "l_extendedprice", "l_discount"]]
        x = c.merge(o, left_on="c_custkey", right_on="o_custkey").merge(li, left_on="o_orderkey", right_on="l_orderkey")
        x = x.merge(
            t["supplier"][["s_suppkey", "s_nationkey"]],
            left_on=["l_suppkey", "c_nationkey"],
            right_on=["s_suppkey", "s_nationkey"],
        )
        x = x.assign(revenue=rev(x))
        g = x.groupby("n_name").revenue.sum().compute().reset_index()
        return g.sort_values("revenue", ascending=False)

    def q6():
        li = t["lineitem"]
        li = li[
            (li.l_shipdate >= D("1994-01-01"))
            & (li.l_shipdate < D("1995-01-01"))
            & (li.l_discount >= 0.05)
            & (li.l_discount <= 0.07)
            & (li.l_quantity < 24)
        ]
        return pd.DataFrame({"revenue": [float((li.l_extendedprice * li.l_discount).sum().compute())]})

    def q10():
        o = t["orders"]
        o = o[(o.o_orderdate >= D("1993-10-01")) & (o.o_orderdate < D("1994-01-01"))][["o_orderkey", "o_custkey"]]
        li = t["lineitem"]
        li = li[li.l_returnflag == "R"][["l_orderkey", "l_extendedprice", "l_discount"]]
        x = o.merge(li, left_on="o_orderkey", right_on="l_orderkey")
        x = x.merge(t["customer"], left_on="o_custkey", right_on="c_custkey")
        x = x.merge(t["nation"][["n_nationkey", "n_name"]], left_on="c_nationkey", right_on="n_nationkey")
        x = x.assign(revenue=rev(x))
        keys = ["c_custkey", "c_name", "c_acctbal", "c_phone", "n_name", "c_address", "c_comment"]
        g = x.groupby(keys).revenue.sum().reset_index()
        top = g.compute().sort_values("revenue", ascending=False).head(20)
        return top[["c_custkey", "c_name", "revenue", "c_acctbal", "n_name", "c_address", "c_phone", "c_comment"]]

    def q18():
        li = t["lineitem"][["l_orderkey", "l_quantity"]]
        q = li.groupby("l_orderkey").l_quantity.sum()
        big = q[q > 300].reset_index()[["l_orderkey"]].rename(columns={"l_orderkey": "b_orderkey"})
        o = t["orders"][["o_orderkey", "o_custkey", "o_orderdate", "o_totalprice"]]
        o = o.merge(big, left_on="o_orderkey", right_on="b_orderkey")
        x = o.merge(t["customer"][["c_custkey", "c_name"]], left_on="o_custkey", right_on="c_custkey")
        x = x.merge(li, left_on="o_orderkey", right_on="l_orderkey")
        g = x.groupby(["c_name", "c_custkey", "o_orderkey", "o_orderdate", "o_totalprice"]).l_quantity.sum()
        g = g.compute().reset_index().rename(columns={"l_quantity": "sum_qty"})
        return g.sort_values(["o_totalprice", "o_orderdate"], ascending=[False, True]).head(100)

    return {"q1": q1, "q3": q3, "q5": q5, "q6": q6, "q10": q10, "q18": q18}


def peer_dask(d, R, queries, reps):
    import logging
    import warnings

    import dask
    import dask.dataframe as dd
    from distributed import Client, LocalCluster, wait

    warnings.filterwarnings("ignore")
    with (
        LocalCluster(
            n_workers=R,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster),
    ):
        t = {}
        for n in TABLES:
            df = dd.read_parquet(f"{d}/{n}.parquet")
            for c, typ in df.dtypes.items():  # date32 arrives as object/date: datetime64 for comparisons
                if "date" in c and str(typ) != "datetime64[ns]":
                    df[c] = dd.to_datetime(df[c])
            if n in ("lineitem", "orders"):
                df = df.repartition(npartitions=max(R, df.npartitions))
            t[n] = df.persist()
        wait(list(t.values()))
        qs = dask_queries(t)
        settings = {
            "version": dask.__version__,
            "workers": R,
            "threads_per_worker": 1,
            "partitions": {n: t[n].npartitions for n in ("lineitem", "orders")},
        }
        missing = {"error": "not written for Dask"}
        return settings, {q: _timed(qs[q], reps) if q in qs else missing for q in queries}


PEER_FNS = {"duckdb": peer_duckdb, "polars": peer_polars, "spark": peer_spark, "dask": peer_dask}


def peer_main(args) -> None:
    settings, res = PEER_FNS[args.peer](args.data, args.threads, args.queries.split(","), args.reps)
    print(RESULT_TAG + json.dumps({"settings": settings, "queries": res}, default=str), flush=True)


def run_peer(engine, data, R, args, log):
    cmd = [
        sys.executable,
        __file__,
        "--peer",
        engine,
        "--data",
        str(data),
        "--threads",
        str(R),
        "--queries",
        ",".join(args.queries),
        "--reps",
        str(args.reps),
    ]
    env = {**os.environ, "POLARS_MAX_THREADS": str(R), "OMP_NUM_THREADS": str(R), "PYTHONUNBUFFERED": "1"}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        log(f"WARNING: {engine} ({R} cores) timed out after {args.peer_timeout:g}s")
        return None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    log(
        f"WARNING: {engine} ({R} cores) failed, rc={p.returncode}:\n"
        + "\n".join((p.stdout + p.stderr).splitlines()[-20:])
    )
    return None


# ---- driver ---------------------------------------------------------------------------------------
def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sf",
        default=None,
        help="scale factors, comma-separated (default 1) (an SF above 1 is skipped "
        "unless 6 GiB per SF unit of memory is available)",
    )
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--queries", default=",".join(QUERIES))
    ap.add_argument("--peers", default=",".join(PEERS), help=f"from {','.join(PEERS)}, or 'none'")
    ap.add_argument("--quick", action="store_true", help="SF 0.1, 1 rep, duckdb and polars only")
    ap.add_argument(
        "--check",
        action="store_true",
        help="correctness only: every query once at each rank count against DuckDB in this "
        "process, at SF 0.05 unless --sf is given; exit 1 on a difference",
    )
    ap.add_argument("--communicator", default="tcp", help="phalanx's communicator (tcp, shm, gloo, ...)")
    ap.add_argument("--peer-timeout", type=float, default=1800.0)
    ap.add_argument("--data-root", default=str(HERE / "out"))
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        return args
    if args.quick:
        args.sf, args.reps, args.peers = args.sf or "0.1", 1, "duckdb,polars"
    args.sf = args.sf or ("0.05" if args.check else "1")
    args.sf = [float(x) for x in args.sf.split(",") if x]
    args.ranks = [int(x) for x in args.ranks.split(",") if x]
    args.queries = [q for q in args.queries.split(",") if q]
    args.peers = [p for p in args.peers.split(",") if p and p != "none"]
    for q in args.queries:
        if q not in QUERIES:
            ap.error(f"unknown query {q!r}; choose from {QUERIES}")
    for p in args.peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p!r}; choose from {PEERS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.peer:
        peer_main(args)
        return 0
    if args.check:
        log = _peers.Tee()
        failures = []
        for sf in args.sf:
            failures += check(sf, args.ranks, args.queries, Path(args.data_root), log)
        log("\n".join("CHECK FAILED: " + f for f in failures) if failures else "checks: every answer equals DuckDB's")
        return 1 if failures else 0
    from operators import one_thread_launcher

    import phalanx as px

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    log = _peers.Tee()

    t_start = time.perf_counter()
    versions = {m: _peers.version(m) for m in ("phalanx", "pyarrow", "polars", "duckdb", "dask", "pyspark")}
    log(f"# TPC-H benchmark  {stamp}")
    log(f"host {platform.node()}  cpus {os.cpu_count()}  " + "  ".join(f"{k} {v}" for k, v in versions.items() if v))
    log(
        f"sf {args.sf}  ranks {args.ranks}  reps {args.reps}  queries {args.queries}  peers {args.peers}  "
        f"communicator {args.communicator}"
    )
    log(f"start: loadavg {_peers.loadavg()}  MemAvailable {mem_available_gib():.1f} GiB")
    results: dict = {}
    for sf in args.sf:
        if sf > 1 and mem_available_gib() < 3 * sf * 2:
            log(f"SF {sf:g} skipped: {mem_available_gib():.1f} GiB available, want {6 * sf:g}")
            continue
        d = ensure_data(sf, Path(args.data_root), log)
        res = results[f"{sf:g}"] = {"phalanx": {}, "peers": {}, "settings": {}, "loadavg": {}}
        for R in args.ranks:
            g = px.Gang(ranks=R, echo=False, executor=one_thread_launcher(), communicator=args.communicator)
            g.start()
            try:
                load = _peers.loadavg()
                per_rank = g.run(px_tpch_app, str(d), args.queries, args.reps, timeout=3600)
            finally:
                g.close()
            e = {"load_s": max(p["load_s"] for p in per_rank), "loadavg": load}
            for q in args.queries:
                times = [max(p[q]["times"][i] for p in per_rank) for i in range(args.reps)]
                peaks = [p[q]["rss_peak"] for p in per_rank]
                e[q] = {
                    "times": times,
                    "rss": {"max_bytes": max(peaks), "sum_bytes": sum(peaks), "procs": R},
                    "result": per_rank[0][q]["result"],
                }
            res["phalanx"][str(R)] = e
            log(
                f"[SF {sf:g}] phalanx {R} rank(s) (loadavg {load}, tables read in {e['load_s']:.1f}s): "
                + "  ".join(f"{q} {min(e[q]['times']):.3f}s" for q in args.queries)
            )
        for eng in args.peers:
            for R in args.ranks:
                load = _peers.loadavg()
                t = time.perf_counter()
                r = run_peer(eng, d, R, args, log)
                res["loadavg"][f"{eng}/{R}"] = load
                if r is None:
                    continue
                res["settings"][f"{eng}/{R}"] = r["settings"]
                res["peers"][f"{eng}/{R}"] = r["queries"]
                log(
                    f"[SF {sf:g}] {eng} {R} core(s) in {time.perf_counter() - t:.0f}s (loadavg {load}): "
                    + "  ".join(f"{q} {_fmt_s(best(r['queries'].get(q)))}" for q in args.queries)
                )
    report = make_report(args, results, log)
    log("")
    log(f"end: loadavg {_peers.loadavg()}  total {time.perf_counter() - t_start:.0f}s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tpch-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "stamp": stamp,
                "args": vars(args),
                "versions": versions,
                "host": platform.node(),
                **report,
                "raw": results,
                "printed": log.lines,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {path}")
    return 1 if report["check_failures"] else 0


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def summary(args, res: dict, sf: str, log) -> None:
    """One table of every query: phalanx at each rank count, each peer at the most cores, the
    ratio phalanx (most ranks) / peer (>1: phalanx slower), and the geometric mean of each ratio
    over the queries both ran."""
    Rmax = max(args.ranks)
    cols = [(f"phalanx {R}r", res["phalanx"].get(str(R), {})) for R in args.ranks]
    peers = [(f"{e} {Rmax}t", res["peers"].get(f"{e}/{Rmax}", {})) for e in args.peers]
    log("")
    log(f"## summary SF {sf}: seconds, min of {args.reps}; ratio = phalanx {Rmax}r ÷ peer (>1: phalanx slower)")
    head = ["query"] + [n for n, _ in cols + peers] + [f"px{Rmax}r÷{n.split()[0]}" for n, _ in peers]
    log("| " + " | ".join(head) + " |")
    log("|" + "---|" * len(head))
    ratios: dict[str, list[float]] = {n: [] for n, _ in peers}
    for q in args.queries:
        px = best(res["phalanx"].get(str(Rmax), {}).get(q))
        cells = [q] + [_fmt_s(best(c.get(q)))[:-1] if best(c.get(q)) else "-" for _, c in cols + peers]
        for n, c in peers:
            p = best(c.get(q))
            if px and p:
                ratios[n].append(px / p)
                cells.append(f"{px / p:.2f}")
            else:
                cells.append("-")
        log("| " + " | ".join(cells) + " |")
    for n, rs in ratios.items():
        if rs:
            g = float(np.exp(np.mean(np.log(rs))))
            log(f"geometric mean of phalanx {Rmax}r ÷ {n} over {len(rs)} queries: {g:.2f}")


def make_report(args, results, log) -> dict:
    Rmax = max(args.ranks)
    rows, failures = [], []
    for sf, res in results.items():
        _peers.log_settings(log, res["settings"], width=10)
        log(
            f"## TPC-H SF {sf} (seconds, min of {args.reps}; x{Rmax}r = engine s / phalanx {Rmax}-rank s, "
            f">1: phalanx faster; RSS MiB: largest process or rank / sum; check = answer vs DuckDB's)"
        )
        ref_key = next((f"duckdb/{R}" for R in args.ranks if f"duckdb/{R}" in res["peers"]), None)
        for q in args.queries:
            ref = (res["peers"][ref_key].get(q) or {}).get("result") if ref_key else None
            px_max = min(res["phalanx"].get(str(Rmax), {}).get(q, {}).get("times") or [float("nan")])
            log("")
            log(f"### {q}" + (f"  ({len(ref['rows'])} result rows)" if ref else ""))
            log(f"{'engine':<8} {'cores':>5} {'seconds':>9} {f'x{Rmax}r':>8} {'RSS max':>8} {'RSS sum':>8}  check")
            entries = [("phalanx", R, res["phalanx"].get(str(R), {}).get(q)) for R in args.ranks]
            entries += [(e, R, res["peers"].get(f"{e}/{R}", {}).get(q)) for e in args.peers for R in args.ranks]
            for eng, R, e in entries:
                if not e or not e.get("times"):
                    log(f"{eng:<8} {R:>5} {'-':>9}" + (f"  {e['error']}" if e and e.get("error") else ""))
                    continue
                s = min(e["times"])
                check = compare(e.get("result"), ref)
                if check.startswith("DIFF"):
                    failures.append(f"SF {sf} {q} {eng}/{R}: {check}")
                rss = e.get("rss") or {}
                ratio = s / px_max if px_max == px_max and px_max else None
                log(
                    f"{eng:<8} {R:>5} {s:>9.3f} {('-' if ratio is None else f'{ratio:.2f}x'):>8} "
                    f"{_peers.fmt_mib(rss.get('max_bytes')):>8} {_peers.fmt_mib(rss.get('sum_bytes')):>8}  {check}"
                )
                rows.append(
                    {
                        "sf": sf,
                        "query": q,
                        "engine": eng,
                        "cores": R,
                        "seconds": s,
                        f"ratio_vs_phalanx_{Rmax}r": ratio,
                        "rss_max_bytes": rss.get("max_bytes"),
                        "rss_sum_bytes": rss.get("sum_bytes"),
                        "check": check,
                    }
                )
        summary(args, res, sf, log)
        # targets: every query at Rmax ranks within 1.2x of DuckDB (Rmax threads), the geometric
        # mean at least DuckDB's (issue 27); >= 4x Spark (issue 14)
        log("")
        log(
            f"## targets at {Rmax} ranks/cores: within 1.2x of DuckDB (ratio >= 0.83x) and the geometric mean "
            "at least DuckDB's (issue 27); >= 4x Spark (issue 14)"
        )
        for q in args.queries:
            px_s = min(res["phalanx"].get(str(Rmax), {}).get(q, {}).get("times") or [0]) or None
            cells = []
            for eng, goal in (("duckdb", 1 / 1.2), ("spark", 4.0)):
                e = res["peers"].get(f"{eng}/{Rmax}", {}).get(q)
                if best(e) and px_s:
                    r = best(e) / px_s
                    cells.append(f"{eng} {r:.2f}x/{goal:.2g}x {'PASS' if r >= goal else 'MISS'}")
            log(f"{q:<4} " + "  ".join(cells))
    log("")
    log(
        "\n".join("CHECK FAILED: " + f for f in failures)
        if failures
        else "checks: every engine's answer equals DuckDB's"
    )
    return {"table": rows, "check_failures": failures}


if __name__ == "__main__":
    sys.exit(main())
