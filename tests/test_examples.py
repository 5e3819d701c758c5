"""The example workflows (workflows/etl_to_training.yaml, workflows/tpch.yaml) end to end.

Each runs through the real scheduler at a small size, with its own run database and store
root; the results are then recomputed from the generated input datasets with pandas (the
features) or DuckDB (the TPC-H queries) and compared.  The ETL workflow also runs once through
the command line, as a user would, and must reproduce the same data.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
from reference import expected_features

import phalanx as px
from phalanx.examples import synthetic
from phalanx.orchestrator.loading import load_workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

ROOT = Path(__file__).resolve().parents[1]
ETL = ROOT / "workflows" / "etl_to_training.yaml"
TPCH = ROOT / "workflows" / "tpch.yaml"

ROWS, USERS, EPOCHS = 80_000, 4_000, 3
ETL_SMALL = {
    "stages.generate.params.rows": ROWS,
    "stages.generate.params.users": USERS,
    "stages.train.params.epochs": EPOCHS,
    "stages.train.params.batch_size": 64,
    "stages.train.params.lr": 0.01,
}
SCALE = 0.01
TPCH_SMALL = {"stages.dbgen.params.scale": SCALE}


def run_example(path: Path, overrides: dict, tmp: Path, site_name: str | None = None) -> tuple[RunDB, str, px.Store]:
    """Load with overrides, run with a private run database and store root — on this machine,
    or on the site ``site-configs/<site_name>.yaml``."""
    import yaml

    cores = max(2, os.cpu_count() or 1)  # the examples use 2-rank gangs
    data = {"name": "test-local", "executor": "local", "cores": cores}
    if site_name:
        data = yaml.safe_load((ROOT / "site-configs" / f"{site_name}.yaml").read_text())
    data["store"] = {"root": str(tmp / "store")}
    site = tmp / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    wf, st = load_workflow(path, site=str(site), overrides=overrides)
    db = RunDB(tmp / "state")
    result = run_workflow(wf, st, file=str(path), db=db)
    assert result.ok, (result.failed, result.skipped)
    return db, result.run_id, px.Store(tmp / "store", result.session)


@pytest.fixture(scope="module")
def etl(tmp_path_factory):
    # the report stage's `python` is the interpreter running phalanx, whatever PATH holds
    return run_example(ETL, ETL_SMALL, tmp_path_factory.mktemp("etl"))


@pytest.fixture(scope="module")
def tpch(tmp_path_factory):
    return run_example(TPCH, TPCH_SMALL, tmp_path_factory.mktemp("tpch"))


def query(con: duckdb.DuckDBPyConnection, sql: str) -> pd.DataFrame:
    """A DuckDB result through Arrow, so its types convert to pandas as the stored ones do."""
    rel = con.sql(sql)
    fetch = getattr(rel, "to_arrow_table", None) or rel.arrow  # duckdb 2 / 1
    return fetch().to_pandas()


def sorted_frame(table, keys) -> pd.DataFrame:
    return table.to_pandas().sort_values(keys).reset_index(drop=True)


# ---- validate ---------------------------------------------------------------------------------
def test_phalanx_validate_accepts_both_workflows():
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "validate", str(p)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (ETL, TPCH)
    ]
    for p, proc in zip((ETL, TPCH), procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert f"{p}: ok" in out and "4 stages" in out


# ---- etl_to_training ----------------------------------------------------------------------------
@pytest.mark.torch  # the example's train stage
def test_generate_makes_the_data_it_promises(etl):
    db, run_id, store = etl
    tx, users = store.read("transactions"), store.read("users")
    assert tx.num_rows == ROWS and users.num_rows == USERS
    assert sorted(tx["tx_id"].to_pylist()) == list(range(ROWS))
    assert sorted(users["user_id"].to_pylist()) == list(range(USERS))
    assert 0 <= min(tx["user_id"].to_pylist()) and max(tx["user_id"].to_pylist()) < USERS
    assert 0.01 < tx["amount"].null_count / ROWS < 0.05  # some missing amounts
    assert tx["category"].null_count > 0 and users["age"].null_count > 0
    assert 0.25 < np.mean(users["churned"].to_numpy(zero_copy_only=False)) < 0.75
    assert store.info("transactions").num_partitions == 2  # one partition per rank
    stages = {s["stage"]: s for s in db.stages(run_id)}
    assert {s: v["state"] for s, v in stages.items()} == dict.fromkeys(
        ["generate", "features", "train", "report"], "succeeded"
    )
    assert stages["generate"]["outputs"]["transactions"][0] == ROWS


@pytest.mark.torch  # the example's train stage
def test_features_match_pandas(etl):
    _, _, store = etl
    tx, users = store.read("transactions").to_pandas(), store.read("users").to_pandas()
    want = expected_features(tx, users)
    got = sorted_frame(store.read("features"), "user_id")
    assert len(got) == tx.user_id.nunique() < USERS + 1  # one row per user with purchases
    assert set(synthetic.FEATURES + [synthetic.LABEL]) <= set(got.columns)
    assert set(got.columns) <= set(want.columns)
    exact = [
        "user_id",
        "n_tx",
        "n_weekend",
        "n_online",
        "n_refund",
        "first_ts",
        "last_ts",
        "country",
        "signup_date",
        "churned",
    ]
    pd.testing.assert_frame_equal(got[exact], want[exact], check_dtype=False)
    floats = [c for c in got.columns if c not in exact and c != "age"]
    for c in floats:
        assert got[c].notna().all() or c in ("avg_amount", "max_amount"), c
        np.testing.assert_allclose(got[c].to_numpy(float), want[c].to_numpy(float), rtol=2e-6, atol=1e-6, err_msg=c)
    np.testing.assert_array_equal(got.age.to_numpy(float), want.age.to_numpy(float))
    assert (got[synthetic.FEATURES].dtypes == np.float32).all()


@pytest.mark.torch  # the example's train stage
def test_training_loss_goes_down(etl):
    db, run_id, store = etl
    m = store.read("train_metrics").to_pandas()
    assert m.epoch.tolist() == list(range(EPOCHS))
    n = store.info("features").num_rows
    assert (m.rows_seen == math.ceil(n / 2) * 2).all()  # every row each epoch, 2 ranks
    losses = m.loss.tolist()
    assert losses[0] < 0.75 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.03, losses
    assert m.accuracy.iloc[-1] > 0.65, m.accuracy.tolist()  # better than a coin
    logs = Path(db.attempts(run_id, "train")[-1]["log_dir"])
    assert "epoch 2: loss" in (logs / "rank-0.log").read_text()


@pytest.mark.torch  # the example's train stage
def test_cli_run_reproduces_the_same_data(etl, tmp_path):
    _, _, first = etl
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(
        PHALANX_STATE=str(tmp_path / "state"), PHALANX_STORE=str(tmp_path / "store"), PATH="/usr/bin:/bin"
    )  # no venv on PATH: the report stage's `python` still works
    sets = [a for k, v in ETL_SMALL.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "workflows/etl_to_training.yaml", *sets],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert " succeeded in " in last, out.stdout
    db = RunDB(tmp_path / "state")
    run = db.run(last.split()[1])
    assert run["state"] == "succeeded"
    assert {s["stage"]: s["state"] for s in db.stages(run["id"])} == dict.fromkeys(
        ["generate", "features", "train", "report"], "succeeded"
    )
    again = px.Store(tmp_path / "store", run["session"])
    # Every dataset is the same bytes: generate is seeded by (seed, rank), features sorts each
    # partition by user_id, train is seeded and its metrics hold no wall-clock time.
    assert sorted(again.list()) == sorted(first.list()) == ["features", "train_metrics", "transactions", "users"]
    for name in first.list():
        a, b = first.info(name), again.info(name)
        assert (b.schema, b.partitioning) == (a.schema, a.partitioning), name
        assert [(p.rows, p.bytes, p.checksum) for p in b.partitions] == [
            (p.rows, p.bytes, p.checksum) for p in a.partitions
        ], name
        assert again.read(name).equals(first.read(name)), name  # and the tables, independently
    for i in range(first.info("features").num_partitions):  # each partition sorted by user_id
        ids = first.partition(first.info("features"), i)["user_id"].to_numpy()
        assert (np.diff(ids) > 0).all()
    assert again.read("train_metrics").column_names == ["epoch", "loss", "accuracy", "rows_seen"]
    status = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", run["id"]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert run["id"] in status and f"train_metrics {EPOCHS} rows" in status, status


# ---- tpch ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tables(tpch):
    _, _, store = tpch
    con = duckdb.connect()
    for name in ("lineitem", "orders", "customer", "nation"):
        con.register(name, store.read(name))
    return con


@pytest.mark.slow  # kept out of the core lane's 5 minutes: the TPC-H example at SF 0.01 (dbgen + the workflow)
def test_dbgen_tables_follow_the_tpch_rules(tpch, tables):
    q = lambda sql: tables.execute(sql).fetchall()  # noqa: E731
    ((orders, customers),) = q("SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM customer)")
    assert orders == round(1_500_000 * SCALE) and customers == round(150_000 * SCALE)
    assert q("SELECT count(*) FROM nation") == [(25,)]
    ((with_lines, lo, hi, lines),) = q(
        "SELECT count(*), min(c), max(c), sum(c) FROM (SELECT l_orderkey, count(*) c FROM lineitem GROUP BY l_orderkey)"
    )
    assert with_lines == orders and (lo, hi) == (1, 7) and 3.5 * orders < lines < 4.5 * orders
    assert q("SELECT count(*) FROM lineitem l ANTI JOIN orders o ON l.l_orderkey = o.o_orderkey") == [(0,)]
    assert q("SELECT count(DISTINCT o_orderkey) = count(*) FROM orders") == [(True,)]
    assert q(f"SELECT count(*) FROM orders WHERE o_custkey % 3 = 0 OR o_custkey > {customers}") == [(0,)]
    bad = q("""SELECT count(*) FROM lineitem WHERE
               (l_returnflag = 'N') <> (l_receiptdate > DATE '1995-06-17')
               OR (l_linestatus = 'O') <> (l_shipdate > DATE '1995-06-17')
               OR l_shipdate <= (SELECT o_orderdate FROM orders WHERE o_orderkey = l_orderkey)
               OR l_receiptdate <= l_shipdate OR l_discount NOT BETWEEN 0 AND 0.1
               OR l_quantity NOT BETWEEN 1 AND 50""")
    assert bad == [(0,)]
    status = q("""SELECT count(*) FROM orders o JOIN (SELECT l_orderkey, bool_and(l_linestatus = 'F') f,
                  bool_and(l_linestatus = 'O') op FROM lineitem GROUP BY l_orderkey) s ON o_orderkey = l_orderkey
                  WHERE o_orderstatus <> CASE WHEN f THEN 'F' WHEN op THEN 'O' ELSE 'P' END""")
    assert status == [(0,)]


@pytest.mark.slow  # kept out of the core lane's 5 minutes: the TPC-H example at SF 0.01 (dbgen + the workflow)
def test_q1_matches_duckdb(tpch, tables):
    _, _, store = tpch
    want = query(
        tables,
        """
        SELECT l_returnflag, l_linestatus, sum(l_quantity) AS sum_qty, sum(l_extendedprice) AS sum_base_price,
               sum(l_extendedprice * (1 - l_discount)) AS sum_disc_price,
               sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS sum_charge,
               avg(l_quantity) AS avg_qty, avg(l_extendedprice) AS avg_price, avg(l_discount) AS avg_disc,
               count(*) AS count_order
        FROM lineitem WHERE l_shipdate <= DATE '1998-12-01' - INTERVAL 90 DAY
        GROUP BY l_returnflag, l_linestatus ORDER BY l_returnflag, l_linestatus""",
    )
    got = store.read("q1").to_pandas()  # in the order the stage sorted it
    assert list(got.columns) == list(want.columns)
    assert len(got) == 4  # AF, NF, NO, RF as in TPC-H
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


@pytest.mark.slow  # kept out of the core lane's 5 minutes: the TPC-H example at SF 0.01 (dbgen + the workflow)
def test_q3_matches_duckdb(tpch, tables):
    _, _, store = tpch
    want = query(
        tables,
        """
        SELECT l_orderkey, sum(l_extendedprice * (1 - l_discount)) AS revenue, o_orderdate, o_shippriority
        FROM customer, orders, lineitem
        WHERE c_mktsegment = 'BUILDING' AND c_custkey = o_custkey AND l_orderkey = o_orderkey
          AND o_orderdate < DATE '1995-03-15' AND l_shipdate > DATE '1995-03-15'
        GROUP BY l_orderkey, o_orderdate, o_shippriority
        ORDER BY revenue DESC, o_orderdate, l_orderkey LIMIT 10""",
    )
    got = store.read("q3").to_pandas()
    assert len(want) == 10
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


@pytest.mark.slow  # kept out of the core lane's 5 minutes: the TPC-H example at SF 0.01 (dbgen + the workflow)
def test_q10_matches_duckdb(tpch, tables):
    _, _, store = tpch
    want = query(
        tables,
        """
        SELECT c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) AS revenue, c_acctbal, n_name
        FROM customer, orders, lineitem, nation
        WHERE c_custkey = o_custkey AND l_orderkey = o_orderkey AND o_orderdate >= DATE '1993-10-01'
          AND o_orderdate < DATE '1994-01-01' AND l_returnflag = 'R' AND c_nationkey = n_nationkey
        GROUP BY c_custkey, c_name, c_acctbal, n_name
        ORDER BY revenue DESC, c_custkey LIMIT 20""",
    )
    got = store.read("q10").to_pandas()
    assert len(want) == 20
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


# ---- the same workflow on other sites gives the same results --------------------------------
def same_results_as_local(etl, tmp: Path, site_name: str) -> tuple[RunDB, str]:
    _, _, local = etl
    db, run_id, store = run_example(ETL, ETL_SMALL, tmp, site_name=site_name)
    for name, key in (("transactions", "tx_id"), ("users", "user_id"), ("features", "user_id")):
        pd.testing.assert_frame_equal(
            sorted_frame(store.read(name), key), sorted_frame(local.read(name), key), obj=f"{name} on {site_name}"
        )
    # Training is not bit-identical across sites (kernel thread counts differ, so do float
    # reduction orders): the loss must fall the same way, within a small margin.
    here, there = (s.read("train_metrics").to_pandas().loss.to_numpy() for s in (local, store))
    assert (np.diff(there) < 0).all() and abs(there[-1] - here[-1]) < 0.05, (here, there)
    return db, run_id


@pytest.mark.slurm
def test_the_etl_example_gives_the_same_results_on_slurm(etl, slurm_cluster, tmp_path):
    db, run_id = same_results_as_local(etl, tmp_path, "slurm-local")
    # one job per stage (generate, features, train, report), named after its gang; SLURM keeps
    # finished jobs for MinJobAge (counting all jobs before and after undercounts once old ones expire)
    names = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%j"],
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": slurm_cluster},
        check=True,
    ).stdout.split()
    gangs = {a["gang_id"] for a in db.attempts(run_id) if a["gang_id"]}
    assert len(gangs) >= 4 and all(any(n.endswith(g) for n in names) for g in gangs), (gangs, names)
    placed = [e for e in db.events(run_id) if e["kind"] == "placed"]  # what `phalanx status` shows
    assert placed and all(re.match(r"slurm: job \d+ RUNNING", e["message"]) for e in placed), placed
    status = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", run_id, "--state", str(db.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "succeeded" in status.stdout, status.stderr
    assert "RUNNING" not in status.stdout  # a finished stage shows no stale placement


@pytest.mark.ray
def test_the_etl_example_gives_the_same_results_on_ray(etl, ray_cluster, tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # what ray-local.yaml's "auto" finds
    before = len(ray.util.placement_group_table())
    same_results_as_local(etl, tmp_path, "ray-local")
    groups = ray.util.placement_group_table()
    assert len(groups) - before >= 1  # the stages' gangs were Ray placement groups
    assert all(g["state"] == "REMOVED" for g in list(groups.values())[before:])  # and are gone
