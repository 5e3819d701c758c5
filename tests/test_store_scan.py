"""A stored dataset read lazily (``env.store.get(..., lazy=True)``, and ``env.input``): the
rows come when the frame's plan needs them, only the columns it uses, and right."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from apps import wf_generate_reference

import phalanx as px
from phalanx.orchestrator import scheduler
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB


def _part(rank: int) -> pa.Table:
    rng = np.random.default_rng([5, rank])
    n = 300 + 200 * rank  # uneven partitions: a balanced share crosses partition bounds
    return pa.table(
        {
            "key": pa.array([f"k{k}" for k in rng.integers(0, 40, n)]),
            "v": pa.array(rng.integers(-50, 50, n), pa.int64()),
            "w": pa.array(np.where(rng.random(n) < 0.1, np.nan, rng.random(n))),
            "pad": pa.array(["x" * 40] * n),
        }
    )


def _reference(nranks: int) -> pd.DataFrame:
    return pa.concat_tables([_part(r) for r in range(nranks)]).to_pandas()


def lazy_reads(env):
    name = f"ds{env.world_size}"
    env.store.put(name, px.DataFrame.from_arrow(_part(env.rank), env), replace=True)
    df = env.store.get(name, lazy=True)
    scan = env.store.last_scan
    untouched = dict(scan.stats)  # nothing read before the rows are needed
    plan = df.filter(pc.field("v") > 0).select(["key", "v"]).explain(file=open("/dev/null", "w"))
    sums = df.filter(pc.field("v") > 0).groupby("key").agg(total=("v", "sum"), n=("v", "count")).collect(root=0)
    after_sums = dict(scan.stats)
    padded = df.select(["pad"]).to_arrow()  # one more column: read now, the others reused
    whole_nbytes = {c: env.store.get(name).to_arrow().column(c).nbytes for c in ("key", "v", "w", "pad")}
    return {
        "untouched": untouched,
        "after_sums": after_sums,
        "after_pad": dict(scan.stats),
        "nbytes": whole_nbytes,
        "plan": plan,
        "sums": sums,
        "pad_rows": padded.num_rows,
    }


@pytest.mark.parametrize("nranks", [1, 3])
def test_a_lazy_get_reads_only_the_columns_used_and_gives_the_right_rows(nranks):
    g = px.Gang(ranks=nranks, echo=False)
    g.start()
    try:
        results = g.run(lazy_reads)
    finally:
        g.close()
    want = _reference(nranks)
    ref = want[want.v > 0].groupby("key").agg(total=("v", "sum"), n=("v", "count")).reset_index()
    got = results[0]["sums"].to_pandas().sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, ref.sort_values("key").reset_index(drop=True), check_dtype=False)
    assert sum(r["pad_rows"] for r in results) == len(want)
    for r in results:
        assert r["untouched"]["bytes"] == 0 and r["untouched"]["rows"] == r["pad_rows"]
        nb = r["nbytes"]
        # the group-by read key and v, not w or pad; then select(["pad"]) read pad alone
        assert r["after_sums"]["bytes"] == nb["key"] + nb["v"], (r, nb)
        assert r["after_pad"]["bytes"] == nb["key"] + nb["v"] + nb["pad"], (r, nb)
        assert f"Scan store dataset 'ds{nranks}'" in r["plan"] and "columns ['key', 'v']" in r["plan"], r["plan"]


def test_a_stage_reads_only_the_input_columns_its_app_uses(tmp_path):
    """env.input is lazy: a stage that sums one column of a two-column input reports the bytes
    of that column alone, and its answer is pandas'."""
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="lazy-input",
        stages={
            "gen": Stage(app="apps:wf_generate", ranks=2, params={"rows": 4000, "seed": 2}, outputs=["tx"]),
            "sum": Stage(app="apps:wf_sum_amount", ranks=2, inputs={"tx": "tx"}, outputs=["total"]),
        },
    )
    result = scheduler.run_workflow(wf, Site(name="lazy", cores=4), db=db)
    assert result.ok, result.failed
    stats = {s["stage"]: s for s in db.stages(result.run_id)}["sum"]["inputs"]["tx"]
    want = wf_generate_reference(4000, 2, seed=2)
    assert stats["rows"] == 4000 and stats["read_here"] > 0 and stats["fetched"] == 0
    assert stats["bytes"] == 4000 * 8, stats  # amount (int64) only: user is never read
    store = px.Store(session=result.session)
    assert store.read("total").column("total").to_pylist() == [int(want.amount.sum())]


def spill_while_lazy(env, root: str, spill: str, meta: str, budget: int):
    """Dataset a read lazily, then spilled to disk (b is used after it, so a is the least
    recently used when c's put goes over the memory budget), then its rows used."""
    from phalanx.store.rank import RankStore

    store = RankStore(env, px.Store(root, session="lazy-spill", metadata=meta, memory_budget=budget, spill=spill))
    for name in "ab":  # equal sizes: two fit the budget, three do not
        store.put(name, px.DataFrame.from_arrow(_part(env.rank), env))
    lazy = store.get("a", lazy=True)
    store.get("b").to_arrow()  # b more recently used than a
    store.put("c", px.DataFrame.from_arrow(_part(env.rank), env))
    spilled = store.store.spilled("a")
    return spilled, lazy.select(["key", "v", "pad"]).collect(root=0)


def test_a_lazy_input_spilled_before_its_rows_are_used_still_reads_right(tmp_path):
    """The store spilling the dataset to disk (a put over the memory budget) between the call
    and the app's use of the rows takes nothing away: the rows are the put's."""
    from phalanx.store.tiers import serialize

    one = sum(serialize(_part(r)).size for r in range(2))  # a dataset's bytes in the store
    g = px.Gang(ranks=2, echo=False)
    g.start()
    try:
        results = g.run(
            spill_while_lazy, str(tmp_path / "shm"), str(tmp_path / "disk"), str(tmp_path / "m.sqlite"), int(2.5 * one)
        )
    finally:
        g.close()
    assert results[0][0], "dataset a was not spilled: the test proves nothing"
    want = pa.concat_tables([_part(r) for r in range(2)]).select(["key", "v", "pad"])
    assert results[0][1].equals(want)


def delete_while_lazy(env):
    name = f"gone{env.world_size}"
    env.store.put(name, px.DataFrame.from_arrow(_part(env.rank), env), replace=True)
    lazy = env.store.get(name, lazy=True)
    env.store.delete(name)
    return env.store.exists(name), lazy.select(["v", "key"]).collect(root=0)


def test_a_lazy_input_deleted_before_its_rows_are_used_still_reads_them():
    """As with an eager read, deleting the dataset after the call and before the app uses the
    rows leaves them readable (and the rows are the put's)."""
    g = px.Gang(ranks=2, echo=False)
    g.start()
    try:
        results = g.run(delete_while_lazy)
    finally:
        g.close()
    assert results[0][0] is False
    assert results[0][1].equals(pa.concat_tables([_part(r) for r in range(2)]).select(["v", "key"]))
