"""Stage apps of workflows/tpch.yaml: TPC-H-like tables made in the workflow, then queries.

    dbgen  lineitem, orders, customer and nation at ``scale`` (1.0 ≈ 6M lineitem rows), each
           rank making its own range of customers and orders (seeded by (seed, rank))
    q1     pricing summary report: lineitem shipped by a date, grouped by returnflag/linestatus
    q3     shipping priority: customer ⋈ orders ⋈ lineitem, revenue per order, top 10
    q10    returned items: customer ⋈ orders ⋈ lineitem ⋈ nation, lost revenue per customer, top 20

The generator follows the shape of TPC-H's dbgen (column names, value ranges, dates, the
returnflag/linestatus rules, 1–7 lines an order, customers whose key is a multiple of 3 place
no orders) but not its exact text fields or key sparsity: results are TPC-H-like, not the
official answers.  Money and quantities are float64 (TPC-H's decimals).
"""

from __future__ import annotations

import calendar
import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import phalanx as px

START = dt.date(1992, 1, 1)
END = dt.date(1998, 12, 31)
CURRENT = dt.date(1995, 6, 17)  # dbgen's CURRENTDATE: decides returnflag and linestatus
SEGMENTS = ["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"]
PRIORITIES = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"]
SHIPMODES = ["AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"]
NATIONS = [  # (name, regionkey), n_nationkey is the position
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


def sizes(scale: float) -> dict[str, int]:
    """Rows of each table at ``scale`` (lineitem is about 4 × orders)."""
    return {
        "customer": max(3, round(150_000 * scale)),
        "orders": max(1, round(1_500_000 * scale)),
        "part": max(1, round(200_000 * scale)),
        "supplier": max(1, round(10_000 * scale)),
    }


def _share(total: int, rank: int, world: int) -> tuple[int, int]:
    return total * rank // world, total * (rank + 1) // world


def _days(d: dt.date) -> int:
    return (d - dt.date(1970, 1, 1)).days


def _pick(rng: np.random.Generator, values: list[str], n: int) -> pa.Array:
    idx = rng.integers(0, len(values), n).astype(np.int32)
    return pa.DictionaryArray.from_arrays(idx, values).cast(pa.string())


def make_customers(scale: float, seed: int, rank: int, world: int) -> pa.Table:
    n_cust = sizes(scale)["customer"]
    lo, hi = _share(n_cust, rank, world)
    n = hi - lo
    rng = np.random.default_rng([seed, rank, 0])
    keys = np.arange(lo + 1, hi + 1, dtype=np.int64)
    return pa.table(
        {
            "c_custkey": keys,
            "c_name": pc.binary_join_element_wise(
                "Customer#", pc.utf8_lpad(pa.array(keys).cast(pa.string()), 9, "0"), ""
            ),
            "c_nationkey": rng.integers(0, len(NATIONS), n).astype(np.int64),
            "c_acctbal": np.round(rng.uniform(-999.99, 9999.99, n), 2),
            "c_mktsegment": _pick(rng, SEGMENTS, n),
        }
    )


def make_orders_and_lineitem(scale: float, seed: int, rank: int, world: int) -> tuple[pa.Table, pa.Table]:
    """This rank's orders (a contiguous range of order keys) and all of their lines."""
    sz = sizes(scale)
    lo, hi = _share(sz["orders"], rank, world)
    n = hi - lo
    rng = np.random.default_rng([seed, rank, 1])
    orderkey = np.arange(lo + 1, hi + 1, dtype=np.int64)
    custkey = rng.integers(1, sz["customer"] + 1, n)
    custkey = np.where(custkey % 3 == 0, custkey - 1, custkey).astype(np.int64)  # as dbgen: no orders
    orderdate = _days(START) + rng.integers(0, _days(END) - _days(START) - 151 + 1, n)

    lines = rng.integers(1, 8, n)  # 1–7 lines an order
    m = int(lines.sum())
    first = np.concatenate([[0], np.cumsum(lines)[:-1]])
    order_of = np.repeat(np.arange(n), lines)
    linenumber = np.arange(m) - np.repeat(first, lines) + 1
    partkey = rng.integers(1, sz["part"] + 1, m)
    quantity = rng.integers(1, 51, m).astype(np.float64)
    retail = (90000 + (partkey // 10) % 20001 + 100 * (partkey % 1000)) / 100.0
    extended = np.round(quantity * retail, 2)
    discount = rng.integers(0, 11, m) / 100.0
    tax = rng.integers(0, 9, m) / 100.0
    l_orderdate = orderdate[order_of]
    shipdate = l_orderdate + rng.integers(1, 122, m)
    commitdate = l_orderdate + rng.integers(30, 91, m)
    receiptdate = shipdate + rng.integers(1, 31, m)
    current = _days(CURRENT)
    returned = receiptdate <= current
    returnflag = np.where(returned, np.where(rng.random(m) < 0.5, "R", "A"), "N")
    shipped = shipdate <= current  # F(inished) lines, else O(pen)
    linestatus = np.where(shipped, "F", "O")

    n_shipped = np.add.reduceat(shipped.astype(np.int64), first) if n else np.zeros(0, np.int64)
    orderstatus = np.where(n_shipped == lines, "F", np.where(n_shipped == 0, "O", "P"))
    charge = extended * (1 + tax) * (1 - discount)
    totalprice = np.round(np.add.reduceat(charge, first), 2) if n else np.zeros(0)

    date32 = lambda days: pa.array(days.astype(np.int32), pa.int32()).cast(pa.date32())  # noqa: E731
    orders = pa.table(
        {
            "o_orderkey": orderkey,
            "o_custkey": custkey,
            "o_orderstatus": pa.array(orderstatus, pa.string()),
            "o_totalprice": totalprice,
            "o_orderdate": date32(orderdate),
            "o_orderpriority": _pick(rng, PRIORITIES, n),
            "o_shippriority": np.zeros(n, np.int32),
        }
    )
    lineitem = pa.table(
        {
            "l_orderkey": orderkey[order_of],
            "l_partkey": partkey.astype(np.int64),
            "l_suppkey": rng.integers(1, sz["supplier"] + 1, m).astype(np.int64),
            "l_linenumber": linenumber.astype(np.int32),
            "l_quantity": quantity,
            "l_extendedprice": extended,
            "l_discount": discount,
            "l_tax": tax,
            "l_returnflag": pa.array(returnflag, pa.string()),
            "l_linestatus": pa.array(linestatus, pa.string()),
            "l_shipdate": date32(shipdate),
            "l_commitdate": date32(commitdate),
            "l_receiptdate": date32(receiptdate),
            "l_shipmode": _pick(rng, SHIPMODES, m),
        }
    )
    return orders, lineitem


def make_nation(rank: int) -> pa.Table:
    """The 25 nations, all on rank 0 (the other ranks' partitions are empty)."""
    rows = NATIONS if rank == 0 else []
    return pa.table(
        {
            "n_nationkey": pa.array(range(len(rows)), pa.int64()),
            "n_name": pa.array([r[0] for r in rows], pa.string()),
            "n_regionkey": pa.array([r[1] for r in rows], pa.int64()),
        }
    )


def dbgen(env):
    """params: scale (1.0 ≈ 6M lineitem rows), seed."""
    scale = float(env.params.get("scale", 0.1))
    seed = int(env.params.get("seed", 0))
    orders, lineitem = make_orders_and_lineitem(scale, seed, env.rank, env.world_size)
    customer = make_customers(scale, seed, env.rank, env.world_size)
    env.log.info(
        "scale %g: %d lineitem, %d orders, %d customer rows here",
        scale,
        lineitem.num_rows,
        orders.num_rows,
        customer.num_rows,
    )
    tables = {"lineitem": lineitem, "orders": orders, "customer": customer, "nation": make_nation(env.rank)}
    return {name: px.DataFrame.from_arrow(t, env) for name, t in tables.items()}


def _date(value) -> pa.Scalar:
    """A date param: a datetime.date (YAML dates load as such) or 'YYYY-MM-DD'."""
    if isinstance(value, str):
        value = dt.date.fromisoformat(value)
    return pa.scalar(value, pa.date32())


def _revenue() -> pc.Expression:
    return pc.field("l_extendedprice") * (pc.scalar(1.0) - pc.field("l_discount"))


def q1(env):
    """TPC-H Q1, pricing summary report.  params: delta (days before 1998-12-01, default 90).

    SELECT l_returnflag, l_linestatus, sum(l_quantity) AS sum_qty, sum(l_extendedprice) AS
    sum_base_price, sum(l_extendedprice*(1-l_discount)) AS sum_disc_price,
    sum(l_extendedprice*(1-l_discount)*(1+l_tax)) AS sum_charge, avg(l_quantity) AS avg_qty,
    avg(l_extendedprice) AS avg_price, avg(l_discount) AS avg_disc, count(*) AS count_order
    FROM lineitem WHERE l_shipdate <= date '1998-12-01' - interval ':delta' day
    GROUP BY l_returnflag, l_linestatus ORDER BY l_returnflag, l_linestatus
    """
    cutoff = dt.date(1998, 12, 1) - dt.timedelta(days=int(env.params.get("delta", 90)))
    result = (
        env.input("lineitem")
        .filter(pc.field("l_shipdate") <= _date(cutoff))
        .assign(disc_price=_revenue())
        .assign(charge=pc.field("disc_price") * (pc.scalar(1.0) + pc.field("l_tax")))
        .groupby(["l_returnflag", "l_linestatus"])
        .agg(
            sum_qty=("l_quantity", "sum"),
            sum_base_price=("l_extendedprice", "sum"),
            sum_disc_price=("disc_price", "sum"),
            sum_charge=("charge", "sum"),
            avg_qty=("l_quantity", "mean"),
            avg_price=("l_extendedprice", "mean"),
            avg_disc=("l_discount", "mean"),
            count_order=("l_orderkey", "size"),
        )
        .sort_values(["l_returnflag", "l_linestatus"])
    )
    return {"q1": result}


def q3(env):
    """TPC-H Q3, shipping priority.  params: segment (BUILDING), date (1995-03-15), limit (10).

    SELECT l_orderkey, sum(l_extendedprice*(1-l_discount)) AS revenue, o_orderdate,
    o_shippriority FROM customer, orders, lineitem WHERE c_mktsegment = ':segment'
    AND c_custkey = o_custkey AND l_orderkey = o_orderkey AND o_orderdate < date ':date'
    AND l_shipdate > date ':date' GROUP BY l_orderkey, o_orderdate, o_shippriority
    ORDER BY revenue DESC, o_orderdate LIMIT 10   (then l_orderkey, to break exact ties)
    """
    segment = env.params.get("segment", "BUILDING")
    day = _date(env.params.get("date", "1995-03-15"))
    customer = env.input("customer").filter(pc.field("c_mktsegment") == segment).select(["c_custkey"])
    orders = (
        env.input("orders")
        .filter(pc.field("o_orderdate") < day)
        .select(["o_orderkey", "o_custkey", "o_orderdate", "o_shippriority"])
    )
    lineitem = (
        env.input("lineitem")
        .filter(pc.field("l_shipdate") > day)
        .assign(revenue=_revenue())
        .select(["l_orderkey", "revenue"])
    )
    result = (
        customer.merge(orders, left_on="c_custkey", right_on="o_custkey")
        .merge(lineitem, left_on="o_orderkey", right_on="l_orderkey")
        .groupby(["l_orderkey", "o_orderdate", "o_shippriority"])
        .agg(revenue=("revenue", "sum"))
        .sort_values(["revenue", "o_orderdate", "l_orderkey"], ascending=[False, True, True])
        .head(int(env.params.get("limit", 10)))
        .select(["l_orderkey", "revenue", "o_orderdate", "o_shippriority"])
    )
    return {"q3": result}


def q10(env):
    """TPC-H Q10, returned item reporting.  params: date (1993-10-01), limit (20).

    SELECT c_custkey, c_name, sum(l_extendedprice*(1-l_discount)) AS revenue, c_acctbal, n_name
    FROM customer, orders, lineitem, nation WHERE c_custkey = o_custkey
    AND l_orderkey = o_orderkey AND o_orderdate >= date ':date'
    AND o_orderdate < date ':date' + interval '3' month AND l_returnflag = 'R'
    AND c_nationkey = n_nationkey GROUP BY c_custkey, c_name, c_acctbal, n_name
    ORDER BY revenue DESC LIMIT 20   (then c_custkey, to break exact ties)
    """
    start = _date(env.params.get("date", "1993-10-01")).as_py()
    year, month = start.year + (start.month + 2) // 12, (start.month + 2) % 12 + 1  # + 3 months
    end = dt.date(year, month, min(start.day, calendar.monthrange(year, month)[1]))
    orders = (
        env.input("orders")
        .filter((pc.field("o_orderdate") >= _date(start)) & (pc.field("o_orderdate") < _date(end)))
        .select(["o_orderkey", "o_custkey"])
    )
    lineitem = (
        env.input("lineitem")
        .filter(pc.field("l_returnflag") == "R")
        .assign(revenue=_revenue())
        .select(["l_orderkey", "revenue"])
    )
    customer = env.input("customer").select(["c_custkey", "c_name", "c_acctbal", "c_nationkey"])
    nation = env.input("nation").select(["n_nationkey", "n_name"])
    result = (
        orders.merge(lineitem, left_on="o_orderkey", right_on="l_orderkey")
        .merge(customer, left_on="o_custkey", right_on="c_custkey")
        .merge(nation, left_on="c_nationkey", right_on="n_nationkey")
        .groupby(["c_custkey", "c_name", "c_acctbal", "n_name"])
        .agg(revenue=("revenue", "sum"))
        .sort_values(["revenue", "c_custkey"], ascending=[False, True])
        .head(int(env.params.get("limit", 20)))
        .select(["c_custkey", "c_name", "revenue", "c_acctbal", "n_name"])
    )
    return {"q10": result}
