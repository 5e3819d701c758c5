"""Faults around what a run reuses: a corrupted store, resume after a change, two drivers on
one run, a kept gang that lost a rank, a backend that cannot even start a gang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from test_scheduler import generated  # what apps:wf_generate writes, computed independently

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

TESTS = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


@pytest.fixture
def db(tmp_path):
    return RunDB(tmp_path / "state")


def pipeline(rows: int = 4000, **count_params) -> Workflow:
    return Workflow(
        name="fp",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": rows, "seed": 3}, outputs=["tx"]),
            "totals": Stage(
                app="apps:wf_totals",
                ranks=2,
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                outputs=["totals"],
                params=count_params,
            ),
        },
    )


def totals_of(session: str) -> pd.DataFrame:
    got = px.Store(session=session).read("totals").to_pandas()
    return got.sort_values("user").reset_index(drop=True)


def expected_totals(rows: int) -> pd.DataFrame:
    return generated(rows, 2, seed=3).groupby("user", as_index=False)["amount"].sum()


def damage(store: px.Store, name: str, how: str) -> Path:
    """Flip one byte in the middle of partition 1's file, or cut the file in half."""
    from phalanx.store.tiers import part_file

    path = Path(store.info(name).location) / part_file(1)
    data = bytearray(path.read_bytes())
    if how == "bit-flipped":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["bit-flipped", "truncated"])
def test_resume_recomputes_a_producer_whose_output_is_corrupted(db, tmp_path, how, fault):
    fault.describe(f"sealed partition {how}, then --resume", backend="local")
    first = run_workflow(pipeline(fail_marker=str(tmp_path / "m"), fail_times=9), Site(name="t", cores=4), db=db)
    assert not first.ok
    store = px.Store(session=first.session)
    damage(store, "tx", how)

    t0 = time.time()
    second = run_workflow(pipeline(), Site(name="t", cores=4), db=db, resume=first.run_id)
    assert second.ok, second.failed
    pd.testing.assert_frame_equal(totals_of(first.session), expected_totals(4000), check_dtype=False)
    assert len(db.attempts(first.run_id, "generate")) == 2  # recomputed, not reused
    rerun = [e for e in db.events(first.run_id) if e["kind"] == "rerun" and e["stage"] == "generate"]
    assert rerun and "'tx' failed verification" in rerun[0]["message"] and "partition 1" in rerun[0]["message"]
    fault.detected(rerun[0]["ts"] - t0)  # resume started → the damage found
    fault.outcome("resume found it by checksum, recomputed the producer; result equals pandas")
    fault.data_lost("none")
    store.delete_session()


def test_a_corrupted_stage_input_fails_the_stage_naming_dataset_and_partition(db, fault):
    fault.describe("stage input bit-flipped before it is read", backend="local")
    made = run_workflow(
        Workflow(name="src", stages={"generate": pipeline().stages["generate"]}), Site(name="t", cores=4), db=db
    )
    assert made.ok
    damage(px.Store(session=made.session), "tx", "bit-flipped")
    reader = Workflow(
        name="rd",
        stages={
            "totals": Stage(app="apps:wf_totals", ranks=3, inputs={"tx": f"{made.session}/tx"}, outputs=["totals"])
        },
    )
    result = run_workflow(reader, Site(name="t", cores=4), db=db)
    assert not result.ok
    error = result.failed["totals"]
    assert "ChecksumError" in error and "'tx' partition 1" in error, error
    fault.outcome("the stage fails: ChecksumError naming dataset and partition; no result sealed")
    fault.data_lost("none (the input must be recomputed by its producer)")
    assert not px.Store(session=result.session).exists("totals")
    px.Store(session=made.session).delete_session()


def cli_env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(HERE)]),
        "PHALANX_STATE": str(tmp_path / "state"),
    }


def phalanx(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


WORKFLOW = """
    name: fp-cli
    stages:
      generate:
        app: apps:wf_generate
        ranks: 2
        params: {{rows: {rows}, seed: 3}}
        outputs: [tx]
      totals:
        app: apps:wf_totals
        ranks: 2
        inputs: {{tx: {{dataset: tx, by: [user]}}}}
        outputs: [totals]
        params: {{fail_marker: {marker}, fail_times: {fail}}}
"""


def test_resume_with_changed_params_or_an_edited_file_reruns_the_stage_and_downstream(tmp_path, fault):
    fault.describe("resume with changed --set params / edited workflow file", backend="local")
    wf, env = tmp_path / "wf.yaml", cli_env(tmp_path)
    wf.write_text(textwrap.dedent(WORKFLOW.format(rows=246, marker=tmp_path / "m", fail=1)))
    first = phalanx("run", "--plain", str(wf), env=env)
    assert first.returncode == 1 and "planned failure" in first.stderr
    run_id = next(line.split()[1] for line in first.stdout.splitlines() if line.startswith("run "))

    # --set changes generate's rows: generate and everything downstream run again
    second = phalanx(
        "run", "--plain", str(wf), "--resume", run_id, "--set", "stages.generate.params.rows=2000", env=env
    )
    assert second.returncode == 0, second.stderr
    db = RunDB(tmp_path / "state")
    session = db.run(run_id)["session"]
    pd.testing.assert_frame_equal(totals_of(session), expected_totals(2000), check_dtype=False)
    said = [e["message"] for e in db.events(run_id) if e["kind"] == "rerun"]
    assert any("params.rows: 246 → 2000" in m for m in said), said
    assert {s["stage"]: (s["state"], s["error"]) for s in db.stages(run_id)} == {
        "generate": ("succeeded", None),
        "totals": ("succeeded", None),
    }  # the first failure's text is gone

    # the file edited between runs (rows 2000 → 3000): the same again, without --set
    wf.write_text(textwrap.dedent(WORKFLOW.format(rows=3000, marker=tmp_path / "m", fail=1)))
    third = phalanx("run", "--plain", str(wf), "--resume", run_id, env=env)
    assert third.returncode == 0, third.stderr
    pd.testing.assert_frame_equal(totals_of(session), expected_totals(3000), check_dtype=False)
    # nothing changed: nothing runs again
    fourth = phalanx("run", "--plain", str(wf), "--resume", run_id, env=env)
    assert fourth.returncode == 0, fourth.stderr
    assert len(db.attempts(run_id, "generate")) == 3 and len(db.attempts(run_id, "totals")) == 3
    fault.outcome(
        "the changed stage and its downstream ran again (event says what changed); "
        "unchanged stages reused; result equals pandas"
    )
    fault.data_lost("none")
    px.Store(session=session).delete_session()


def test_two_drivers_of_one_run_the_second_is_refused_a_dead_ones_hold_is_taken_over(tmp_path, fault):
    fault.describe("two drivers on one run (--resume twice)", backend="local")
    go, env = tmp_path / "go", cli_env(tmp_path)
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        f"name: locked\nstages:\n  hold:\n    app: fault_apps:wait_for_file\n    ranks: 2\n    params: {{file: {go}}}\n"
    )
    a = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "run", "--plain", str(wf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        db, deadline = RunDB(tmp_path / "state"), time.monotonic() + 60
        while not db.runs() or not db.attempts(db.runs()[0]["id"]):
            assert time.monotonic() < deadline and a.poll() is None
            time.sleep(0.05)
        run_id = db.runs()[0]["id"]
        t0 = time.monotonic()
        b = phalanx("run", "--plain", str(wf), "--resume", run_id, env=env)
        fault.detected(time.monotonic() - t0)
        assert b.returncode == 1
        assert f"being driven by process {a.pid}" in b.stderr and "one driver per run" in b.stderr, b.stderr
        assert len(db.attempts(run_id, "hold")) == 1  # the refused driver ran nothing
        a.send_signal(signal.SIGKILL)  # the holder dies without a word: its hold is stale
        a.wait(timeout=10)
        go.touch()
        c = phalanx("run", "--plain", str(wf), "--resume", run_id, env=env)
        assert c.returncode == 0, c.stderr
        assert db.run(run_id)["state"] == "succeeded"
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    fault.outcome("second driver refused naming the holder's pid and host; a dead holder's run is taken over")
    fault.data_lost("none")


def test_a_kept_gang_that_lost_a_rank_while_idle_is_not_handed_to_the_next_stage(db, tmp_path, fault):
    fault.describe("a rank of an idle kept gang dies before reuse", backend="local")
    common = {"dir": str(tmp_path)}
    wf = Workflow(
        name="idle",
        stages={
            "a": Stage(app="fault_apps:write_pid", ranks=2, params=common),
            "killer": Stage(
                app="fault_apps:kill_idle_rank",
                ranks=1,
                params={**common, "state": str(tmp_path / "state"), "victim": "a"},
            ),
            "c": Stage(app="fault_apps:write_pid", ranks=2, needs=["a", "killer"], params=common),
        },
    )
    result = run_workflow(wf, Site(name="t", cores=3), db=db)
    assert result.ok, result.failed
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "gang" and e["stage"] == "c"]
    assert said and "not reused: rank 1" in said[0], said
    assert len(db.attempts(result.run_id, "c")) == 1  # no failed attempt first
    a_pids = {Path(tmp_path, f"a.{r}.pid").read_text() for r in (0, 1)}
    c_pids = {Path(tmp_path, f"c.{r}.pid").read_text() for r in (0, 1)}
    assert not a_pids & c_pids  # a fresh gang
    fault.outcome("liveness checked before reuse: the dead gang closed, a fresh one ran the stage")
    fault.data_lost("none")


def test_a_backend_that_cannot_start_fails_its_stages_without_cancelling_the_run(db, fault):
    fault.describe("unusable rendezvous on the site (bypassing validate)", backend="local")
    wf = Workflow(
        name="bad", stages={"x": Stage(app="apps:rank_info", ranks=1), "y": Stage(app="apps:rank_info", ranks=1)}
    )
    unchecked = Site.model_construct(name="t", cores=2, rendezvous="bogus://nowhere")  # as a bug would
    result = run_workflow(wf, unchecked, db=db)
    assert not result.ok and set(result.failed) == {"x", "y"}
    assert all("bogus" in e for e in result.failed.values()), result.failed
    assert db.run(result.run_id)["state"] == "failed"
    assert {s["state"] for s in db.stages(result.run_id)} == {"failed"}
    assert {a["state"] for a in db.attempts(result.run_id)} == {"failed"}
    fault.outcome("each stage fails with the reason; run 'failed', no stage left 'running'")
    fault.data_lost("none")


def test_a_sites_memory_gb_is_enforced_per_rank(db, fault):
    fault.describe("a rank over the site's memory_gb (its share: 1 GiB)", backend="local")
    wf = Workflow(name="mem", stages={"eat": Stage(app="fault_apps:eat_memory", ranks=2, params={"gib": 3})})
    result = run_workflow(wf, Site(name="t", cores=2, memory_gb=2), db=db)
    assert not result.ok
    assert "rank 1" in result.failed["eat"] and "over its memory limit of 1 GiB" in result.failed["eat"], result.failed
    fault.outcome("the rank is killed at its share of memory_gb and named; the machine never ran short")
    fault.data_lost("none")


def test_a_retry_recomputes_an_input_lost_since_it_was_sealed(db, tmp_path, fault):
    """A stage's input is lost after its producer succeeded (here a partition file removed: on
    a store spread over hosts, the host holding it went away): the stage's retry runs the
    producer again from its lineage first, then reads; the result equals pandas."""
    fault.describe("a stage input lost between its producer and the stage's retry", backend="local")
    wf = pipeline()
    wf.stages["totals"] = Stage(
        app="apps:wf_totals_losing_input",
        ranks=2,
        retries=1,
        inputs={"tx": {"dataset": "tx", "by": ["user"]}},
        outputs=["totals"],
        params={"lost_marker": str(tmp_path / "lost")},
    )
    t0 = time.time()
    result = run_workflow(wf, Site(name="t", cores=4), db=db)
    assert result.ok, result.failed
    pd.testing.assert_frame_equal(totals_of(result.session), expected_totals(4000), check_dtype=False)
    assert len(db.attempts(result.run_id, "generate")) == 2 and len(db.attempts(result.run_id, "totals")) == 2
    lost = [e for e in db.events(result.run_id) if e["kind"] == "lost input"]
    assert lost and "'tx'" in lost[0]["message"] and "stage 'generate' runs again first" in lost[0]["message"]
    fault.detected(lost[0]["ts"] - t0)
    fault.outcome("the retry ran the producer again from its lineage, then read; result equals pandas")
    fault.data_lost("none")
    px.Store(session=result.session).delete_session()
