"""A stage preempted by SLURM for real is retried without using up its retries (issue 26).

A cluster of its own (tests/infra/slurm-up.sh with PHALANX_SLURM_PREEMPT=1: one node of 2 CPUs
and a partition "urgent" whose jobs cancel the other partitions' jobs), so preempting never
touches the jobs of the other SLURM tests: a stage's one-rank job runs on the node; an urgent
job asks for both CPUs; SLURM preempts the stage's job (state PREEMPTED); the attempt's cause
is ``preempted`` and the stage, with ``retries: 0``, runs again once the urgent job is done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from test_slurm import run_beside, wait_until

import phalanx as px

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "tests" / "infra"
DIR = "/tmp/phalanx-slurm-preempt"
CONF = f"{DIR}/slurm.conf"
ENV = {"PHALANX_SLURM_DIR": DIR, "PHALANX_SLURM_PORT": "7417", "PHALANX_SLURM_NODES": "1", "PHALANX_SLURM_PREEMPT": "1"}


def slurm(*argv: str) -> str:
    out = subprocess.run(argv, env={**os.environ, "SLURM_CONF": CONF}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{argv}: {out.stderr}"
    return out.stdout.strip()


@pytest.fixture(scope="module")
def preemptible():
    if shutil.which("slurmctld") is None:
        pytest.skip("slurmctld is not installed (scripts/setup-slurm.sh installs Debian's slurm-wlm and munge)")
    env = {**os.environ, **ENV}
    up = subprocess.run([str(INFRA / "slurm-up.sh")], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode:
        pytest.fail(f"slurm-up.sh (preemption) failed ({up.returncode}):\n{up.stderr}\n{up.stdout}")
    try:
        yield CONF
    finally:
        subprocess.run([str(INFRA / "slurm-down.sh"), "--purge"], env=env, capture_output=True, timeout=120)


def hold_once(env):
    """The first attempt tells the test its job id and waits (to be preempted); a later one
    seals the job it ran in."""
    import pyarrow as pa

    marker = Path(env.params["marker"])
    job = os.environ.get("SLURM_JOB_ID", "")
    if not marker.exists():
        marker.write_text(job)
        time.sleep(300)
    env.output("ran", px.DataFrame.from_arrow(pa.table({"job": [job]}), env))


def test_a_preempted_stage_runs_again_without_using_its_retries(preemptible, tmp_path):
    from phalanx.orchestrator.models import Site, Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import prepare_run

    site = yaml.safe_load((REPO / "site-configs" / "slurm-local.yaml").read_text())
    site["slurm"].update(conf=CONF, job_name=f"preempt{os.getpid()}")
    site["cores"], site["store"] = None, {"root": str(tmp_path / "store")}
    marker = tmp_path / "first-job"
    wf = Workflow(
        name="preempt",
        stages={"hold": Stage(app="test_slurm_preemption:hold_once", params={"marker": str(marker)}, outputs=["ran"])},
    )
    db = RunDB(tmp_path / "state")
    run = prepare_run(wf, Site.model_validate(site), db=db)
    jobs: list[str] = []

    def preempt() -> None:
        jobs.append(wait_until(lambda: marker.exists() and marker.read_text(), 180, "the first attempt's rank"))
        jobs.append(slurm("sbatch", "--parsable", "-p", "urgent", "-n", "2", "-o", "/dev/null", "--wrap", "sleep 3"))

    result = run_beside(run, preempt)
    first, urgent = jobs
    assert result.ok, result.failed
    assert slurm("squeue", "-h", "-t", "all", "-j", first, "-o", "%T") == "PREEMPTED"  # SLURM's own word
    assert slurm("squeue", "-h", "-t", "all", "-j", urgent, "-o", "%T") == "COMPLETED"
    attempts = db.attempts(result.run_id, "hold")
    assert [(a["state"], a["cause"]) for a in attempts] == [("failed", "preempted"), ("succeeded", None)]
    retry = [e["message"] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert len(retry) == 1 and "preempted" in retry[0], retry
    second = px.Store(tmp_path / "store", result.session).read("ran").column("job").to_pylist()
    assert second != [first] and second[0]  # the retry ran in a job of its own
