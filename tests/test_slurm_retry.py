"""Retry policies (``retry:``) on the real SLURM test cluster, run as a user runs them: a
workflow file and a site file through ``phalanx run``, each attempt a SLURM job of its own.

A stage whose first job's rank exits with code 3 is retried (its policy names ``exit:3``) and
its second job succeeds with the right answer; a stage whose rank exits with code 4 is not (its
policy names only ``exit:3``) and fails at once, its cause said; ``phalanx status`` says each
attempt's cause.  Out of memory is not tried here: the test cluster runs without cgroups
(``TaskPlugin=task/none``), so SLURM enforces no memory limit (the local executor's tests
cover ``memory: x2``; tests/test_retry_policy.py checks the --mem-per-cpu a retried SLURM job asks for)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import phalanx as px
from phalanx.orchestrator.rundb import RunDB

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

REPO = Path(__file__).resolve().parent.parent
from conftest import SLURM_CONF as CONF  # noqa: E402


def square_sum_after(env):
    """Rank 0's first job exits with code ``params.code`` (a file in ``params.dir`` remembers
    that it did); later jobs write sum(i² for i < n) as ``params.out``."""
    import pyarrow as pa

    marks = Path(env.params["dir"])
    first = not any(marks.iterdir())
    env.comm.barrier()  # every rank looked before rank 0 marks
    if env.rank == 0 and first:
        (marks / "failed-once").write_text(os.environ.get("SLURM_JOB_ID", ""))
        os._exit(env.params["code"])
    n = env.params["n"]
    rows = pa.table({"sum": [sum(i * i for i in range(n))]} if env.rank == 0 else {"sum": pa.array([], pa.int64())})
    env.output(env.params["out"], px.DataFrame.from_arrow(rows, env))


def test_a_retry_policy_on_slurm_retries_the_exit_code_it_names_and_no_other(tmp_path):
    site = yaml.safe_load((REPO / "site-configs" / "slurm-local.yaml").read_text())
    site["slurm"].update(conf=CONF, job_name="retry-policy")
    site["store"] = {"root": str(tmp_path / "store")}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    dirs = {name: tmp_path / name for name in ("flaky", "strict")}
    for d in dirs.values():
        d.mkdir()
    stages = {
        name: {
            "app": "test_slurm_retry:square_sum_after",
            "ranks": 2,
            "params": {"dir": str(dirs[name]), "code": code, "n": 10, "out": name},
            "outputs": [name],
            "retry": {"causes": {"exit:3": 2}, "backoff": {"first": 0.1}},
        }
        for name, code in (("flaky", 3), ("strict", 4))
    }
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump({"name": "retry-on-slurm", "stages": stages}))
    state = tmp_path / "state"
    cli = [sys.executable, "-m", "phalanx.cli"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [
            *cli,
            "run",
            str(tmp_path / "wf.yaml"),
            "--site",
            str(tmp_path / "site.yaml"),
            "--plain",
            "--state",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,  # the app's module, for the workflow's check and the ranks
    )
    assert out.returncode == 1, out.stdout + out.stderr  # strict failed
    db = RunDB(state)
    run = db.runs()[0]
    attempts = {s: [(a["state"], a["cause"]) for a in db.attempts(run["id"], s)] for s in stages}
    assert attempts == {
        "flaky": [("failed", "exit:3"), ("succeeded", None)],
        "strict": [("failed", "exit:4")],
    }, attempts
    jobs = [a["gang_id"] for a in db.attempts(run["id"], "flaky")]
    assert len(set(jobs)) == 2  # each attempt its own gang (its own SLURM job)
    assert (dirs["flaky"] / "failed-once").read_text().strip()  # the first attempt ran under SLURM
    stored = px.Store(tmp_path / "store", run["session"]).read("flaky")
    assert stored.column("sum").to_pylist() == [285]  # sum(i² for i < 10)
    status = subprocess.run([*cli, "status", run["id"], "--state", str(state)], capture_output=True, text=True, env=env)
    assert "attempt 1 failed: exit code 3; attempt 2 succeeded" in status.stdout, status.stdout
    assert "attempt 1 failed: exit code 4" in status.stdout, status.stdout
