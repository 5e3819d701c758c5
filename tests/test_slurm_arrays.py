"""One-rank gangs that start together go to SLURM as ONE job array (``slurm.array``), against
the real Slurm of tests/infra/slurm-up.sh (3 slurmd "nodes", 2 CPUs each, on 127.0.0.1).

A workflow of 12 independent one-rank stages is one ``sbatch --array=0-11``: SLURM's own
records (squeue, and the job-completion log ``sacct -c`` reads) show one array job whose 12
tasks are the stages; each stage's result is checked against a closed form.  One instance
that fails, and one whose array task is scancelled from outside, fail only their own stage.
Killing one gang, or releasing its recorded allocation from another process (``phalanx
cancel``), cancels only its array task.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import phalanx as px
from phalanx.executors.slurm import SlurmExecutor

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

REPO = Path(__file__).resolve().parent.parent
from conftest import SLURM_CONF as CONF  # noqa: E402
from test_slurm import run_beside, slurm, wait_until  # noqa: E402

WINDOW = 3.0  # s without a gang joining closes an array: wide enough for a loaded 2-core machine


def jobs_named(prefix: str) -> dict[str, tuple[str, str, str]]:
    """Every job and array task SLURM holds whose name starts with ``prefix`` (finished ones
    stay for MinJobAge): ``{"A_i": (array job id, state, name)}``."""
    out = {}
    for line in slurm("squeue", "-h", "-r", "-t", "all", "-o", "%i|%F|%T|%j").splitlines():
        job, array, state, name = line.split("|")
        if name.startswith(prefix):
            out[job] = (array, state, name)
    return out


def completion_records(array: str) -> list[dict[str, str]]:
    """SLURM's job-completion records (JobCompLoc: what ``sacct -c`` reads) of array job
    ``array``'s tasks.  Slurm 22.05's ``sacct -c`` cannot print the array fields
    ("Unknown type ArrayJobId"), so they are read from its file."""
    config = slurm("scontrol", "show", "config")
    loc = re.search(r"^JobCompLoc\s*=\s*(\S+)", config, re.M).group(1)
    records = []
    for line in Path(loc).read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("ArrayJobId") == array:
            records.append(fields)
    return records


def load_site(tmp_path: Path, job_name: str):
    from phalanx.orchestrator.models import Site

    site = yaml.safe_load((REPO / "site-configs" / "slurm-local.yaml").read_text())
    site["slurm"].update(conf=CONF, job_name=job_name, array_window=WINDOW)
    site["cores"] = None  # SLURM queues what does not fit: every stage starts at once
    site["store"] = {"root": str(tmp_path / "store")}
    return Site.model_validate(site)


# ---- the app of every instance ------------------------------------------------------------
def square_sum(env):
    """sum(i² for i < n), with where it ran; params: n, out, fail (raise), hold (wait to be
    cancelled, after telling the test its array task in ``hold``)."""
    import pyarrow as pa

    import phalanx as px

    if env.params.get("fail"):
        raise ValueError("this instance fails on purpose")
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID", ""), os.environ.get("SLURM_ARRAY_TASK_ID", "")
    if env.params.get("hold"):
        Path(env.params["hold"]).write_text(f"{array}_{task}")
        time.sleep(300)
    n = env.params["n"]
    table = pa.table({"n": [n], "sum": [sum(i * i for i in range(n))], "array": [array], "task": [task]})
    env.output(env.params["out"], px.DataFrame.from_arrow(table, env))


def test_twelve_one_rank_stages_are_one_array_job_and_a_failure_stays_its_own(tmp_path):
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import prepare_run

    name = f"arrays{os.getpid()}a"
    site = load_site(tmp_path, name)
    held = tmp_path / "held"
    stages = {
        f"s{k}": Stage(
            app="test_slurm_arrays:square_sum", ranks=1, params={"n": 1000 * k + 7, "out": f"sq{k}"}, outputs=[f"sq{k}"]
        )
        for k in range(10)
    }
    stages["bad"] = Stage(app="test_slurm_arrays:square_sum", ranks=1, params={"n": 1, "out": "x", "fail": True})
    stages["victim"] = Stage(
        app="test_slurm_arrays:square_sum", ranks=1, params={"n": 1, "out": "y", "hold": str(held)}
    )
    db = RunDB(tmp_path / "state")
    run = prepare_run(Workflow(name="fanout", stages=stages), site, db=db)
    seen: list[str] = []

    def cancel_the_victim() -> None:
        seen.append(wait_until(lambda: held.exists() and held.read_text(), 240, "the victim's rank to start"))
        slurm("scancel", seen[0])  # its array task only

    result = run_beside(run, cancel_the_victim)
    victim = seen[0]

    # only the failing instance and the cancelled one failed, each with its own reason
    assert sorted(result.failed) == ["bad", "victim"], result.failed
    assert "this instance fails on purpose" in result.failed["bad"]
    assert "killed by signal SIGTERM" in result.failed["victim"]
    (attempt,) = db.attempts(result.run_id, "victim")
    assert f"slurm: job {victim} CANCELLED" in attempt["error"], attempt["error"]  # SLURM's word, in its log tail

    # one submission: every job of this run is a task of ONE array job, tasks 0..11
    array = victim.split("_")[0]
    jobs = jobs_named(name)
    assert set(jobs) == {f"{array}_{i}" for i in range(12)}, jobs
    assert {a for a, _, _ in jobs.values()} == {array}
    assert len({n for _, _, n in jobs.values()}) == 1  # one job name: the array's
    assert jobs[victim][1] == "CANCELLED"
    # the others ended: COMPLETED, or CANCELLED by their gang's close while srun was tearing down
    assert {state for _, state, _ in jobs.values()} <= {"COMPLETED", "CANCELLED"}, jobs
    records = wait_until(lambda: len(r := completion_records(array)) == 12 and r, 30, "the completion records")
    assert sorted(int(r["ArrayTaskId"]) for r in records) == list(range(12))
    assert {r["JobState"] for r in records if f"{array}_{r['ArrayTaskId']}" == victim} == {"CANCELLED"}

    # results: each instance's sum against the closed form, each from a task of the array
    store = px.Store(tmp_path / "store", result.session)
    tasks = set()
    for k in range(10):
        row = store.read(f"sq{k}").to_pylist()
        n = 1000 * k + 7
        assert row == [{"n": n, "sum": (n - 1) * n * (2 * n - 1) // 6, "array": array, "task": row[0]["task"]}]
        tasks.add(row[0]["task"])
    assert len(tasks) == 10 and {f"{array}_{t}" for t in tasks} <= set(jobs) - {victim}


def test_killing_one_gang_or_releasing_its_record_cancels_only_its_array_task(tmp_path):
    """Three one-rank gangs of one executor launched together: one array.  kill() of one
    cancels its task only; ``release`` of another's run-DB record in another process (as
    ``phalanx cancel`` of a lost driver does) cancels that task only; the third runs on."""
    section = yaml.safe_load((REPO / "site-configs" / "slurm-local.yaml").read_text())["slurm"]
    ex = SlurmExecutor({**section, "conf": CONF, "array_window": WINDOW}, site="slurm-local")
    heard: list[tuple[str, dict]] = []

    class Hook:
        def held(self, record):
            heard.append(("held", dict(record)))

        def released(self, record):
            heard.append(("released", dict(record)))

    launchers = [ex.launcher(1) for _ in range(3)]
    for launcher in launchers:
        launcher.allocation_hook = Hook()
    env = [{"PHALANX_RANK": "0", "PHALANX_WORLD_SIZE": "1"}]
    threads = [
        threading.Thread(target=launcher.launch, args=(["sleep", "300"], env, tmp_path / f"g{i}"))
        for i, launcher in enumerate(launchers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def state(job: str) -> list[str]:
        return slurm("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").split()

    try:
        a, b, c = launchers
        array = a.job_id.split("_")[0]
        assert sorted(l.job_id for l in launchers) == [f"{array}_{i}" for i in range(3)]
        assert ex.per_stage(ex.config)[0].calls["sbatch"] == 1
        # each gang's record names the array and its task before sbatch, then the task's job id
        records = [r for what, r in heard if what == "held"]
        tasks = {int(l.job_id.split("_")[1]): l.job_id for l in launchers}
        assert sorted((r["task"], r["job"] or "") for r in records) == sorted(
            [(t, "") for t in tasks] + list(tasks.items())
        )
        assert len({r["array"] for r in records}) == 1
        wait_until(lambda: all("RUNNING" in l.status() for l in launchers), 180, "the three tasks to run")

        a.kill(grace_s=1.0)
        assert a.exitcodes() == [-15]
        assert state(a.job_id) == ["CANCELLED"]
        assert state(b.job_id) == state(c.job_id) == ["RUNNING"]

        record = next(r for what, r in heard if what == "held" and r["job"] == b.job_id)
        code = "import json, sys; from phalanx.executors import release; print(release(json.loads(sys.argv[1])))"
        lost = {**record, "job": None}  # as if the driver died before sbatch answered
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(lost)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.strip()
        assert out == f"slurm: scancel job {b.job_id} ({record['id']})"
        wait_until(lambda: state(b.job_id) == ["CANCELLED"], 30, "b's task to end")
        assert state(c.job_id) == ["RUNNING"]
        assert wait_until(lambda: None not in (e := b.exitcodes()) and e, 30, "b's exit code") == [-15]
        assert b.reason() == f"slurm: job {b.job_id} CANCELLED (site 'slurm-local')"
    finally:
        for launcher in launchers:
            launcher.kill(grace_s=1.0)
    assert state(c.job_id) == ["CANCELLED"]
    assert [what for what, r in heard if r.get("job") == c.job_id] == ["held", "released"]


def test_a_lone_one_rank_gang_and_a_wider_one_stay_jobs_of_their_own(tmp_path):
    """A window that holds one gang, and a gang of 2 ranks, go as ordinary jobs."""
    ex = SlurmExecutor(
        {"conf": CONF, "partition": "debug", "time": "00:10:00", "array_window": 0.1}, site="slurm-local"
    )
    one, two = ex.launcher(1), ex.launcher(2)
    env = lambda n: [{"PHALANX_RANK": str(r), "PHALANX_WORLD_SIZE": str(n)} for r in range(n)]  # noqa: E731
    one.launch(["sh", "-c", "exit 4"], env(1), tmp_path / "one")
    two.launch(["sh", "-c", "exit $PHALANX_RANK"], env(2), tmp_path / "two")
    try:
        assert one.job_id.isdigit() and two.job_id.isdigit()
        assert wait_until(lambda: None not in (e := one.exitcodes()) and e, 60, "one's exit") == [4]
        assert wait_until(lambda: None not in (e := two.exitcodes()) and e, 60, "two's exit") == [0, 1]
    finally:
        one.kill()
        two.kill()
    assert ex.batcher(ex.config).arrays == []


def fan_in_sums(env):
    """The fan-in of the foreach test: every instance's row, concatenated (gather: concat)."""
    import phalanx as px

    table = env.input("parts").collect()
    env.output("all", px.DataFrame.from_arrow(table if env.rank == 0 else table.slice(0, 0), env))


def test_a_foreach_of_one_rank_instances_is_one_array_job_and_its_fan_in_gathers_them(tmp_path):
    """``foreach: {matrix: ...}`` of 8 one-rank instances on a per-stage SLURM site: one
    ``sbatch --array=0-7``, each instance a task; the fan-in reads all 8 rows."""
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    name = f"arrays{os.getpid()}f"
    ns = [10 * k + 3 for k in range(8)]
    wf = Workflow(
        name="foreach",
        stages={
            "square": Stage(
                app="test_slurm_arrays:square_sum",
                foreach={"matrix": {"n": ns}},
                params={"out": "sq"},
                outputs=["sq"],
            ),
            "gather": Stage(app="test_slurm_arrays:fan_in_sums", inputs={"parts": "sq"}, outputs=["all"]),
        },
    )
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf, load_site(tmp_path, name), db=db)
    assert result.ok, result.failed
    rows = px.Store(tmp_path / "store", result.session).read("all").to_pylist()
    assert sorted((r["n"], r["sum"]) for r in rows) == [(n, (n - 1) * n * (2 * n - 1) // 6) for n in ns]
    arrays = {r["array"] for r in rows}
    assert len(arrays) == 1 and "" not in arrays  # every instance ran as a task of one array job
    (array,) = arrays
    assert sorted(int(r["task"]) for r in rows) == list(range(8))
    instances = [j for j in jobs_named(name) if j.startswith(f"{array}_")]
    assert len(instances) == 8


def test_conditions_and_the_cache_work_on_slurm_as_on_this_machine(tmp_path):
    """``when:`` (true and false) and ``cache: true`` on a per-stage SLURM site: the second run
    reuses the cached stage's output (no job for it), evaluates the conditions again, and every
    result is the closed form."""
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    site = load_site(tmp_path, f"arrays{os.getpid()}w")
    wf = Workflow(
        name="when-cache",
        stages={
            "gen": Stage(app="test_slurm_arrays:square_sum", params={"n": 10, "out": "sq"}, outputs=["sq"], cache=True),
            "then": Stage(
                app="test_slurm_arrays:square_sum",
                params={"n": 3, "out": "then"},
                outputs=["then"],
                when="sq.sum[0] == 285",  # sum(i² for i < 10)
            ),
            "never": Stage(
                app="test_slurm_arrays:square_sum", params={"n": 4, "out": "x"}, outputs=["x"], when="params.n > 100"
            ),
        },
    )
    db = RunDB(tmp_path / "state")
    runs = [run_workflow(wf, site, db=db) for _ in range(2)]
    for result in runs:
        assert result.ok, result.failed
        assert result.skipped_when == {"never": "when: 'params.n > 100' is false"}
        store = px.Store(tmp_path / "store", result.session)
        assert [r["sum"] for r in store.read("sq").to_pylist()] == [285]
        assert [r["sum"] for r in store.read("then").to_pylist()] == [5]
    second = {s["stage"]: s for s in db.stages(runs[1].run_id)}
    assert second["gen"]["attempts"] == 0 and db.attempts(runs[1].run_id, "gen") == []  # cached: no job
    kinds = {(e["stage"], e["kind"]) for e in db.events(runs[1].run_id)}
    assert ("gen", "cached") in kinds and ("then", "condition") in kinds
