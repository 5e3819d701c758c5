"""Running workflows: concurrency on disjoint slots, waiting for room, retries, resume, results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from apps import wf_generate_reference as generated

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

HERE = Path(__file__).parent


@pytest.fixture
def db(tmp_path):
    return RunDB(tmp_path / "state")


def site(cores: int) -> Site:
    return Site(name=f"test{cores}", cores=cores)


def pipeline(**totals_params) -> Workflow:
    return Workflow(
        name="tot",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 4000, "seed": 3}, outputs=["tx"]),
            "totals": Stage(
                app="apps:wf_totals",
                ranks=3,
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                outputs=["totals"],
                params=totals_params,
            ),
        },
    )


def test_pipeline_results_match_pandas(db):
    result = run_workflow(pipeline(), site(4), db=db)
    assert result.ok, result.failed
    got = px.Store(session=result.session).read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    expected = generated(4000, 2, seed=3).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    assert stages["totals"]["outputs"]["totals"][0] == len(expected)
    assert [s["state"] for s in stages.values()] == ["succeeded", "succeeded"]


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_independent_stages_run_at_the_same_time_and_a_big_one_waits(db, tmp_path):
    params = lambda peer: {"dir": str(tmp_path), "peer": peer}  # noqa: E731
    wf = Workflow(
        name="conc",
        stages={
            "a": Stage(app="apps:wf_meet", ranks=2, params=params("b")),
            "b": Stage(app="apps:wf_meet", ranks=2, params=params("a")),
            "c": Stage(app="apps:wf_mark", ranks=3, params={"dir": str(tmp_path)}),
        },
    )
    result = run_workflow(wf, site(4), db=db)
    assert result.ok, result.failed  # a and b each waited for the other: they overlapped
    att = {a["stage"]: a for a in db.attempts(result.run_id)}
    # c needs 3 of the 4 slots: it cannot start while a and b hold 2 each
    assert att["c"]["started"] >= min(att["a"]["ended"], att["b"]["ended"])


def test_a_failing_stage_is_retried_on_a_fresh_gang(db, tmp_path):
    wf = pipeline(fail_marker=str(tmp_path / "m"), fail_times=1)
    wf.stages["totals"].retries = 1
    result = run_workflow(wf, site(4), db=db)
    assert result.ok, result.failed
    attempts = db.attempts(result.run_id, "totals")
    assert [a["state"] for a in attempts] == ["failed", "succeeded"]
    assert attempts[0]["gang_id"] != attempts[1]["gang_id"]
    assert "planned failure 1" in attempts[0]["error"]
    ranks = attempts[0]["rank_info"]  # per rank: pid and how it ended
    assert [r["rank"] for r in ranks] == [0, 1, 2] and all(r["pid"] for r in ranks)
    failed = [r for r in ranks if r.get("outcome") == "failed"]
    assert failed and all("RuntimeError: planned failure 1" in r["error"] for r in failed)
    assert all(r.get("outcome") in ("failed", "stopped") for r in ranks)


def test_resume_reuses_sealed_outputs_and_reruns_the_rest(db, tmp_path):
    failing = pipeline(fail_marker=str(tmp_path / "m"), fail_times=5)
    first = run_workflow(failing, site(4), db=db)
    assert not first.ok and "planned failure" in first.failed["totals"]
    store = px.Store(session=first.session)
    before = store.info("tx")
    files = {p.name: p.read_bytes() for p in Path(before.location).iterdir()}

    second = run_workflow(pipeline(), site(4), db=db, resume=first.run_id)
    assert second.ok and second.run_id == first.run_id
    after = store.info("tx")
    assert after.version == before.version  # not recomputed
    assert {p.name: p.read_bytes() for p in Path(after.location).iterdir()} == files
    assert len(db.attempts(first.run_id, "generate")) == 1
    assert store.exists("totals")
    # said as it resumes: the live table and the report show generate as reused, not pending
    reused = [(e["stage"], e["message"]) for e in db.events(first.run_id) if e["kind"] == "reused"]
    assert reused == [
        ("generate", "outputs sealed by an earlier attempt, fingerprint and checksums match: not run again")
    ]


def test_downstream_of_a_failed_stage_is_skipped(db):
    wf = Workflow(
        name="skip",
        stages={
            "bad": Stage(app="apps:no_such_function_here", ranks=1, outputs=["x"]),
            "after": Stage(app="apps:wf_mark", ranks=1, inputs={"x": "x"}, params={"dir": "/tmp"}),
        },
    )
    result = run_workflow(wf, site(2), db=db)
    assert not result.ok and result.skipped == ["after"] and result.state == "failed"
    assert "no_such_function_here" in result.failed["bad"]
    assert {s["stage"]: s["error"] for s in db.stages(result.run_id)}["after"] == "an upstream stage failed"
    starts = [e["message"] for e in db.events(result.run_id) if e["kind"] == "start"]
    assert starts[0].startswith("attempt 1: 1 rank on slots [0], ") and "1 ranks" not in starts[0], starts


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
def test_cli_run_and_status(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        textwrap.dedent("""
        name: cli-demo
        stages:
          generate:
            app: apps:wf_generate
            ranks: 2
            params: {rows: 1000}
            outputs: [tx]
          totals:
            app: apps:wf_totals
            ranks: 2
            inputs: {tx: tx}
            outputs: [totals]
    """)
    )
    env = {
        "PYTHONPATH": str(HERE),
        "PHALANX_STATE": str(tmp_path / "state"),
        "PATH": "/usr/bin:/bin",
        **{k: v for k, v in os.environ.items() if k.startswith("PHALANX_STORE")},
    }
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", str(wf), "--set", "stages.generate.params.rows=2000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip().splitlines()[-1].split()[1]
    status = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", run_id], capture_output=True, text=True, env=env, timeout=60
    )
    assert "succeeded" in status.stdout and "totals" in status.stdout
    assert "generate" in status.stdout and "tx 2,000 rows" in status.stdout
    assert "← tx: tx 2,000 rows" in status.stdout  # rows read over all ranks, with the plan
    report = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "report", run_id, "-o", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "r.html").read_text()
    assert "<svg" in page and "totals" in page and "balanced, zero-copy" in page
    bad = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "report", "no-such-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1 and "no run 'no-such-run'" in bad.stderr


@pytest.fixture
def driver():
    """Start a `phalanx run` process; stopped (by PID) if the test ends before it does."""
    procs = []

    def start(argv, **kwargs):
        procs.append(subprocess.Popen(argv, **kwargs))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=30)


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
@pytest.mark.parametrize("how", ["ctrl-c", "phalanx cancel"])
def test_cancel_stops_every_rank_and_keeps_sealed_outputs(tmp_path, how, driver):
    import signal

    wf = tmp_path / "wf.yaml"
    wf.write_text(
        "name: forever\nstages:\n  loop:\n    app: apps:wf_seal_then_sleep\n    ranks: 2\n    outputs: [early]\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE), "PHALANX_STATE": str(tmp_path / "state")}
    proc = driver(
        [sys.executable, "-m", "phalanx.cli", "run", str(wf)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    db = RunDB(tmp_path / "state")
    pids, deadline, store = [], time.monotonic() + 60, None
    while len(pids) < 2 or store is None or not store.exists("early"):  # ranks started, output sealed
        assert time.monotonic() < deadline and proc.poll() is None, "the stage never sealed its output"
        pids = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "phalanx.runtime.worker"], capture_output=True, text=True
        ).stdout.split()
        runs = db.runs()
        store = px.Store(session=runs[0]["session"]) if runs else None
        time.sleep(0.05)
    run_id = db.runs()[0]["id"]
    assert db.run(run_id)["state"] == "running"
    if how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        out = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "cancel", run_id], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert f"run {run_id} cancelled" in out.stdout
    assert proc.wait(timeout=30) == 130
    assert f"--resume {run_id}" in proc.stderr.read()
    assert db.run(run_id)["state"] == "cancelled"
    assert [(s["state"], s["error"]) for s in db.stages(run_id)] == [("cancelled", "cancelled")]
    assert [a["state"] for a in db.attempts(run_id)] == ["cancelled"]
    from test_gang import wait_dead

    assert wait_dead([int(p) for p in pids]) == []
    assert store.read("early").num_rows == 20  # sealed before the cancel: kept
    staging = Path(store.root) / store.session / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == []
    store.delete_session()


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_a_driver_killed_hard_leaves_no_rank_and_the_run_is_lost_then_resumable(tmp_path, driver):
    import signal

    wf = tmp_path / "wf.yaml"
    wf.write_text("name: crashy\nstages:\n  loop:\n    app: apps:sleep_forever\n    ranks: 2\n")
    env = {**os.environ, "PYTHONPATH": str(HERE), "PHALANX_STATE": str(tmp_path / "state")}
    proc = driver(
        [sys.executable, "-m", "phalanx.cli", "run", "--plain", str(wf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    db = RunDB(tmp_path / "state")
    pids, deadline = [], time.monotonic() + 60

    def gang_started() -> bool:
        runs = db.runs()
        return bool(runs) and any(a["gang_id"] for a in db.attempts(runs[0]["id"]))

    while len(pids) < 2 or not gang_started():  # (warm ranks are workers before any gang)
        assert time.monotonic() < deadline, "the stage's ranks never started"
        pids = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "phalanx.runtime.worker"], capture_output=True, text=True
        ).stdout.split()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    from test_gang import wait_dead

    assert wait_dead([int(p) for p in pids]) == []
    run = db.runs()[0]
    assert run["state"] == "lost"
    assert [s["state"] for s in db.stages(run["id"])] == ["lost"]
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "cancel", run["id"]], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "already lost" in out.stdout
    # what a put of the dead gang left unsealed goes on resume; the stage then runs again
    store = px.Store(session=run["session"])
    gang_id = db.attempts(run["id"])[0]["gang_id"]
    orphan = Path(store.tier.staging(store.session, "", f"{gang_id}-0123456789ab"))
    orphan.mkdir(parents=True)
    (orphan / "part-0.arrow").write_bytes(b"half a partition")
    wf.write_text(
        f"name: crashy\nstages:\n  loop:\n    app: apps:wf_mark\n    ranks: 2\n    params: {{dir: {tmp_path}}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "--plain", str(wf), "--resume", run["id"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert not orphan.exists()
    assert sorted(p.name for p in tmp_path.glob("loop.*")) == ["loop.0", "loop.1"]
    # the killed driver's attempt ended with it: lost, not "running" under a succeeded run
    attempts = db.attempts(run["id"], "loop")
    assert [(a["attempt"], a["state"]) for a in attempts] == [(1, "lost"), (2, "succeeded")]
    assert attempts[0]["ended"] is not None and "driver" in attempts[0]["error"]
    store.delete_session()


def test_command_stage_runs_a_program_on_every_rank(db, tmp_path):
    code = (
        "import os; d = os.environ['PHALANX_PARAM_DIR']; "
        "open(os.path.join(d, os.environ['PHALANX_RANK'] + '-of-' + os.environ['PHALANX_WORLD_SIZE']), 'w')"
        ".write(os.environ['PHALANX_RDZV'])"
    )
    wf = Workflow(
        name="cmd",
        stages={
            "native": Stage(
                kind="command", command=[sys.executable, "-c", code], ranks=2, params={"dir": str(tmp_path)}
            )
        },
    )
    result = run_workflow(wf, site(2), db=db)
    assert result.ok, result.failed
    assert sorted(p.name for p in tmp_path.glob("*-of-*")) == ["0-of-2", "1-of-2"]
    assert (tmp_path / "0-of-2").read_text() == (tmp_path / "1-of-2").read_text() != ""


def test_command_stage_fails_fast_when_a_rank_exits_non_zero(db, tmp_path):
    code = (
        "import os, sys, time; r = int(os.environ['PHALANX_RANK']); print('rank', r, 'says bye', flush=True); "
        "sys.exit(3) if r == 1 else time.sleep(600)"
    )
    wf = Workflow(
        name="cmdfail", stages={"native": Stage(kind="command", command=[sys.executable, "-c", code], ranks=2)}
    )
    t0 = time.monotonic()
    result = run_workflow(wf, site(2), db=db)
    assert time.monotonic() - t0 < 30  # rank 0's sleep was cut short
    # reported as a BSP stage's failed rank is: named, with its log tail; rank 0 stopped by fail-fast
    assert result.failed == {"native": "1 rank(s) failed (ranks 1); first: rank 1: rank process exited with code 3"}
    attempt = db.attempts(result.run_id, "native")[0]
    assert "rank 1 says bye" in attempt["error"]
    assert {r["rank"]: r["outcome"] for r in attempt["rank_info"]} == {0: "stopped", 1: "failed"}


def test_command_stage_timeout_names_the_ranks_that_did_not_finish(db):
    code = "import os, time; time.sleep(600) if os.environ['PHALANX_RANK'] == '1' else None"
    wf = Workflow(
        name="cmdslow",
        stages={"native": Stage(kind="command", command=[sys.executable, "-c", code], ranks=2, timeout=2)},
    )
    result = run_workflow(wf, site(2), db=db)
    assert re.fullmatch(
        r"gang \S+: rank 1 did not manage to finish within the stage timeout \(timeout=2s\); "
        r"rank 0 finished; logs in .*",
        result.failed["native"],
    ), result.failed


def test_command_stage_with_a_missing_program(db):
    wf = Workflow(name="cmdmissing", stages={"native": Stage(kind="command", command=["/no/such/program"], ranks=1)})
    result = run_workflow(wf, site(2), db=db)
    assert result.failed["native"].startswith("cannot start '/no/such/program'")
    starts = [e["message"] for e in db.events(result.run_id) if e["kind"] == "start"]
    assert starts == ["attempt 1: 1 rank of '/no/such/program' on slots [0]"]


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_cli_logs_shows_each_ranks_output(tmp_path):
    code = "import os; print('hello from', os.environ['PHALANX_RANK'])"
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        textwrap.dedent(f"""
        name: logs-demo
        stages:
          say:
            kind: command
            command: [{sys.executable!r}, -c, {code!r}]
            ranks: 2
    """)
    )
    env = {"PHALANX_STATE": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", str(wf)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip().splitlines()[-1].split()[1]
    logs = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "logs", run_id, "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    ).stdout.splitlines()
    assert "[say attempt 1 rank 0] hello from 0" in logs and "[say attempt 1 rank 1] hello from 1" in logs
    one = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "logs", run_id, "say", "--rank", "1", "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    assert one.strip() == "[say attempt 1 rank 1] hello from 1"


def chain(**site_options) -> tuple[Workflow, Site]:
    wf = Workflow(
        name="chain",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 1000}, outputs=["tx"]),
            "second": Stage(app="apps:wf_say", ranks=2, inputs={"tx": "tx"}, outputs=["tx2"]),
            "third": Stage(app="apps:wf_say", ranks=2, inputs={"tx": "tx2"}),
        },
    )
    return wf, Site(name="t2", cores=2, **site_options)


def test_stages_of_the_same_size_reuse_the_gang_with_their_own_logs(db):
    wf, st = chain()
    result = run_workflow(wf, st, db=db)
    assert result.ok, result.failed
    att = {a["stage"]: a for a in db.attempts(result.run_id)}
    pids = {s: [r["pid"] for r in a["rank_info"]] for s, a in att.items()}
    assert pids["generate"] == pids["second"] == pids["third"]  # one gang served the chain
    for stage in ("second", "third"):  # each stage's output in its own attempt's log dir
        logs = sorted(Path(att[stage]["log_dir"]).glob("rank-*.log"))
        assert [p.read_text().strip() for p in logs] == [f"stage {stage} on rank {r}" for r in (0, 1)]
    assert (
        not list(Path(att["generate"]["log_dir"]).glob("rank-*.log"))
        or "stage second" not in Path(att["generate"]["log_dir"], "rank-0.log").read_text()
    )
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    assert list(stages["third"]["inputs"]) == ["tx"] and stages["third"]["inputs"]["tx"]["dataset"] == "tx2"
    from test_gang import wait_dead

    assert wait_dead(pids["generate"]) == []  # the kept gang is stopped when the run ends


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_reuse_can_be_turned_off_and_a_retry_never_reuses(db, tmp_path):
    wf, st = chain(reuse_gangs=False)
    result = run_workflow(wf, st, db=db)
    assert result.ok, result.failed
    att = {a["stage"]: {r["pid"] for r in a["rank_info"]} for a in db.attempts(result.run_id)}
    assert not att["generate"] & att["second"] and not att["second"] & att["third"]

    retried = pipeline(fail_marker=str(tmp_path / "m"), fail_times=1)
    retried.stages["totals"].ranks, retried.stages["totals"].retries = 2, 1
    result = run_workflow(retried, site(2), db=db)
    assert result.ok, result.failed
    first, second = db.attempts(result.run_id, "totals")
    gen = {r["pid"] for r in db.attempts(result.run_id, "generate")[0]["rank_info"]}
    assert {r["pid"] for r in first["rank_info"]} == gen  # attempt 1 reused generate's gang
    assert not {r["pid"] for r in second["rank_info"]} & gen  # the retry got a fresh one


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_cli_run_failure_names_stage_rank_and_the_traceback(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: boom\nstages:\n  bad:\n    app: apps:wf_divide_by_zero\n    ranks: 2\n")
    env = {**os.environ, "PYTHONPATH": str(HERE), "PHALANX_STATE": str(tmp_path / "state")}
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "--plain", str(wf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "stage 'bad' failed: 1 rank(s) failed (ranks 1); first: rank 1: ZeroDivisionError" in out.stderr
    assert "rank 1, last lines of its traceback:" in out.stderr
    assert "in ratio" in out.stderr and "return 1 / x" in out.stderr
    assert "--resume" in out.stderr


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_a_site_names_where_the_store_catalogue_lives(db, tmp_path):
    from phalanx.orchestrator.models import StoreConfig

    url = f"sqlite://{tmp_path / 'catalogue.sqlite'}"
    s = Site(name="meta", cores=4, store=StoreConfig(metadata=url))
    result = run_workflow(pipeline(), s, db=db)
    assert result.ok, result.failed
    assert px.Store(session=result.session, metadata=url).list() == ["totals", "tx"]
    assert not px.Store(session=result.session).exists("tx")  # not in the default catalogue
    with pytest.raises(ValueError, match="unknown store metadata backend 'mongo'"):
        StoreConfig(metadata="mongo://x")


def test_a_stage_the_site_can_never_place_fails_at_once(db):
    """Bypassing validation (run_workflow directly), a gang larger than the site fails with the
    reason instead of the run returning ok with the stage never started."""
    wf = Workflow(
        name="toobig",
        stages={
            "big": Stage(app="apps:rank_info", ranks=5),
            "after": Stage(app="apps:rank_info", ranks=1, needs=["big"]),
        },
    )
    result = run_workflow(wf, site(2), db=db)
    assert not result.ok and result.skipped == ["after"]
    assert result.failed == {"big": "5 ranks, but site 'test2' (local) can give at most 2 at once"}
    assert {s["stage"]: s["state"] for s in db.stages(result.run_id)} == {"big": "failed", "after": "skipped"}


def test_cli_names_what_failed_and_why_a_downstream_stage_did_not_run(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        textwrap.dedent("""
        name: skip-demo
        stages:
          first:
            kind: command
            command: [/bin/false]
          after:
            kind: command
            command: [/bin/true]
            needs: [first]
    """)
    )
    env = {"PHALANX_STATE": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", "--plain", str(wf)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1
    assert " FAILED in " in out.stdout
    assert "stage 'first' failed" in out.stderr
    assert "stage 'after' did not run: an upstream stage failed" in out.stderr, out.stderr


def test_a_leftover_that_cannot_be_freed_is_tried_again_only_after_a_while(db, monkeypatch):
    """A reader that polls (the dashboard, `watch phalanx status`) neither hammers an unreachable
    resource manager nor fills the run's events with the same failure."""
    from phalanx.orchestrator import rundb

    run_id, _ = db.new_run("wf", "wf.yaml", "local", None, {"s": 1})
    db.add_allocation(run_id, "s", {"executor": "no-such-executor", "id": "42"})
    assert db.release_leftovers(run_id) == [] and db.release_leftovers(run_id) == []
    failures = [e for e in db.events(run_id) if e["kind"] == "release"]
    assert len(failures) == 1 and "could not release no-such-executor 42" in failures[0]["message"]
    monkeypatch.setattr(rundb, "RETRY_RELEASE_S", 0.0)  # the pause is over: tried (and reported) again
    db.release_leftovers(run_id)
    assert len([e for e in db.events(run_id) if e["kind"] == "release"]) == 2
    assert db.allocations(run_id)  # still recorded as held: a later reader tries again
