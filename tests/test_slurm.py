"""The SLURM executor against a real Slurm on this machine (tests/infra/slurm-up.sh: slurmctld,
3 slurmd "nodes" n1-n3 with 2 CPUs each, munged; all on 127.0.0.1).

Per-stage gangs (one sbatch job each) and pilot gangs (job steps of one held allocation) run
apps that use the communicator across several slurmd nodes; failures, cancellation and
SLURM's own reasons (PENDING (Resources), PartitionNodeLimit, a bad partition) are checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import apps
import pytest
import yaml

import phalanx as px
from phalanx.executors.slurm import SlurmExecutor, SlurmLauncher, SlurmPilot, SlurmStepLauncher

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "tests" / "infra"
from conftest import SLURM_CONF as CONF  # noqa: E402


def site_section(name: str) -> dict:
    """The slurm: section of a site file, pointed at this session's cluster."""
    site = yaml.safe_load((REPO / "site-configs" / f"{name}.yaml").read_text())
    return {**site["slurm"], "conf": CONF}


def executor(name: str, **keys) -> SlurmExecutor:
    """The executor of site file ``name`` (``keys`` over its slurm: section)."""
    return SlurmExecutor({**site_section(name), **keys}, site=name)


def load_site(name: str):
    from phalanx.orchestrator.models import Site
    from phalanx.orchestrator.yamlio import load_model

    return load_model(Site, REPO / "site-configs" / f"{name}.yaml")


def slurm(*args: str, check: bool = True) -> str:
    r = subprocess.run(list(args), env={**os.environ, "SLURM_CONF": CONF}, capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr}")
    return r.stdout


def active_jobs(job: str | None = None) -> list[str]:
    """Jobs squeue lists as pending, running, completing or suspended."""
    args = ["squeue", "-h", "-t", "PD,R,CG,S,CF", "-o", "%i %T"]
    return [l for l in slurm(*args).splitlines() if job is None or l.split()[0] == job]


def run_beside(run, act, within: float = 240):
    """Run a prepared workflow (``scheduler.prepare_run``) in a thread while ``act()`` does
    something to it from outside (cancel a job, preempt it); its RunResult.  A run still
    going after ``within`` seconds is cancelled and fails the test."""
    import threading

    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=run.run()))
    runner.start()
    try:
        act()
        runner.join(timeout=within)
        assert not runner.is_alive(), "the workflow did not finish"
    finally:
        if runner.is_alive():
            run.cancel()
            runner.join(timeout=60)
    return outcome["result"]


def wait_until(pred, within: float, what: str):
    deadline = time.monotonic() + within
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(0.1)


# ---- apps run on the ranks ---------------------------------------------------------------
def where(env):
    import socket

    return {
        "rank": env.rank,
        "node": os.environ.get("SLURMD_NODENAME"),
        "nodeid": os.environ.get("SLURM_NODEID"),
        "job": os.environ.get("SLURM_JOB_ID"),
        "procid": os.environ.get("SLURM_PROCID"),
        "host": socket.gethostname(),
        "rank_var": os.environ.get("PHALANX_RANK"),
        "ranks": env.comm.allgather_obj(env.rank),
    }


def alltoallv(env):
    import numpy as np

    # rank r sends (d + 1) * (r + 1) bytes of value r to rank d
    counts = [(d + 1) * (env.rank + 1) for d in range(env.world_size)]
    recv, recv_counts = env.comm.alltoallv(np.full(sum(counts), env.rank, dtype=np.uint8), counts)
    return recv_counts.tolist(), recv.tolist()


def rank1_raises(env):
    if env.rank == 1:
        raise ValueError("bad value on rank 1 under slurm")
    env.comm.barrier()


def rank0_exits(env):
    if env.rank == 0:
        os._exit(3)
    env.comm.barrier()


def check_spread_and_comm(gang: px.Gang, launcher: SlurmLauncher, ranks: int) -> list[dict]:
    info = gang.run(where)
    assert (
        [i["rank"] for i in info]
        == [i["rank_var"] and int(i["rank_var"]) for i in info]
        == [int(i["procid"]) for i in info]
        == list(range(ranks))
    )
    # one rank per slurmd node: distinct NodeNames and node ids (all on this one host)
    assert len({i["node"] for i in info}) == ranks, info
    assert len({i["nodeid"] for i in info}) == ranks, info
    assert {i["job"] for i in info} == {launcher.job_id}
    assert all(i["ranks"] == list(range(ranks)) for i in info)  # allgather
    got = gang.run(alltoallv)
    for d, (counts, data) in enumerate(got):
        assert counts == [(d + 1) * (r + 1) for r in range(ranks)]
        assert data == [r for r in range(ranks) for _ in range((d + 1) * (r + 1))]
    return info


# ---- per-stage: every gang is its own sbatch job ------------------------------------------
@pytest.fixture(scope="class")
def launcher():
    return executor("slurm-local").launcher(3)


@pytest.fixture(scope="class")
def gang(launcher):
    with px.Gang(3, executor=launcher, echo=False) as g:
        yield g


class TestPerStage:
    def test_ranks_spread_over_nodes_and_use_the_communicator(self, gang, launcher):
        check_spread_and_comm(gang, launcher, 3)
        assert re.fullmatch(r"slurm: job \d+ RUNNING on n\[1-3\]", launcher.status())
        assert launcher.exitcodes() == [None, None, None]
        log_dir = gang.log_dir
        assert (log_dir / "slurm-job.sh").read_text().count("srun") == 1
        assert "--ntasks=3" in (log_dir / "slurm-job.sh").read_text()

    def test_failing_rank_fails_the_gang_fast_with_its_traceback(self, gang, launcher):
        gang.run(where)
        job = launcher.job_id
        t0 = time.monotonic()
        with pytest.raises(px.RankError) as info:
            gang.run(rank1_raises)
        assert time.monotonic() - t0 < 10
        err = info.value
        assert err.ranks == [1] and sorted(err.stopped) == [0, 2]
        assert "bad value on rank 1 under slurm" in str(err) and "rank1_raises" in str(err)
        assert active_jobs(job) == []  # the gang's job was cancelled and is gone
        assert launcher.reason() is None  # a rank failed, not SLURM
        # the next run starts a fresh gang: a new job
        assert [i["rank"] for i in gang.run(where)] == [0, 1, 2]
        assert launcher.job_id != job

    def test_scancel_from_outside_fails_the_gang_with_slurms_word(self, gang, launcher):
        gang.run(where)
        job = launcher.job_id
        threading.Timer(1.0, slurm, args=("scancel", job)).start()
        with pytest.raises(px.RankError) as info:
            gang.run(apps.sleep_forever, timeout=60)
        assert launcher.reason() is not None and f"job {job} CANCELLED" in launcher.reason()
        assert f"slurm: job {job} CANCELLED" in str(info.value)  # in the failed rank's log tail
        assert active_jobs(job) == []

    def test_kill_cancels_the_job_and_leaves_nothing_in_squeue(self, gang, launcher):
        gang.run(where)
        job = launcher.job_id
        with pytest.raises(px.GangError, match="did not manage to finish"):
            gang.run(apps.sleep_forever, timeout=1.0)  # the gang kills its ranks: scancel
        assert active_jobs(job) == []
        assert slurm("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").split() == ["CANCELLED"]
        assert launcher.exitcodes() == [-15, -15, -15]


# ---- the launcher alone: commands, pending states, SLURM's reasons -----------------------
def rank_env(n: int, **extra: str) -> list[dict[str, str]]:
    return [{"PHALANX_RANK": str(r), "PHALANX_WORLD_SIZE": str(n), **extra} for r in range(n)]


def wait_codes(launcher: SlurmLauncher, within: float = 30.0) -> list[int]:
    return wait_until(
        lambda: (c := launcher.exitcodes()) and all(x is not None for x in c) and c, within, "the ranks to exit"
    )


def test_command_ranks_get_their_rank_log_and_exit_code(tmp_path):
    echoed: list[str] = []
    launcher = executor("slurm-local").launcher(3, echo=echoed.append)
    launcher.launch(
        [
            "sh",
            "-c",
            'echo "rank $PHALANX_RANK of $PHALANX_WORLD_SIZE on $SLURMD_NODENAME $GREETING"; '
            "echo oops >&2; exit $PHALANX_RANK",
        ],
        rank_env(3, GREETING="hi"),
        tmp_path,
    )
    assert wait_codes(launcher) == [0, 1, 2]
    nodes = set()
    for r in range(3):
        out = (tmp_path / f"rank-{r}.log").read_text().splitlines()
        assert out[0].startswith(f"rank {r} of 3 on n") and out[0].endswith(" hi") and "oops" in out
        nodes.add(out[0].split()[5])
    assert nodes == {"n1", "n2", "n3"}
    launcher.kill()
    for r in range(3):  # echo=: every rank's lines reach the console, prefixed
        assert any(l.startswith(f"[rank {r}] rank {r} of 3 on n") and l.endswith(" hi") for l in echoed)
        assert f"[rank {r}] oops" in echoed
    assert active_jobs(launcher.job_id) == []
    assert launcher.reason() is None


def test_status_while_pending_and_kill_leaves_no_job(tmp_path):
    blocker = slurm("sbatch", "--parsable", "-N3", "-n6", "-o", "/dev/null", "--wrap", "sleep 120").strip()
    try:
        wait_until(lambda: "RUNNING" in slurm("squeue", "-h", "-j", blocker, "-o", "%T"), 20, "the blocker")
        launcher = executor("slurm-local").launcher(2)
        launcher.launch(["sleep", "300"], rank_env(2), tmp_path)
        status = wait_until(
            lambda: re.fullmatch(r"slurm: job \d+ PENDING \((Resources|Priority)\)", s := launcher.status()) and s,
            20,
            "PENDING (Resources)",
        )
        assert status == f"slurm: job {launcher.job_id} PENDING (Resources)" or "Priority" in status
        assert launcher.exitcodes() == [None, None]
        t0 = time.monotonic()
        launcher.kill(grace_s=1.0)
        assert time.monotonic() - t0 < 10
        assert active_jobs(launcher.job_id) == []
        assert launcher.exitcodes() == [-15, -15]
    finally:
        slurm("scancel", blocker)
    wait_until(lambda: not active_jobs(blocker), 20, "the blocker to go")


def test_a_bad_partition_is_a_clear_error():
    launcher = executor("slurm-local", partition="gpu").launcher(2)
    with pytest.raises(px.GangError) as info:
        px.Gang(2, executor=launcher, echo=False).start()
    msg = str(info.value)
    assert msg.startswith("slurm: sbatch rejected the job (site 'slurm-local'): partition 'gpu' does not exist")
    assert "partitions: debug, small" in msg and "Invalid partition name" in msg


def test_a_stages_own_slurm_options_override_the_sites(tmp_path):
    """A workflow stage asking for a partition that does not exist fails with SLURM's word
    for it; its sibling with the site's options runs."""
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    site = load_site("slurm-local")
    site.store.root = str(tmp_path / "store")
    wf = Workflow(
        name="override",
        stages={
            "fine": Stage(app="apps:wf_generate", ranks=2, params={"rows": 100}, outputs=["tx"]),
            "gpu": Stage(app="apps:wf_generate", ranks=2, params={"rows": 100}, slurm={"partition": "gpu"}),
        },
    )
    result = run_workflow(wf, site, db=RunDB(tmp_path / "state"))
    assert list(result.failed) == ["gpu"]
    assert "partition 'gpu' does not exist" in result.failed["gpu"]
    assert px.Store(tmp_path / "store", result.session).read("tx").num_rows == 100


def test_a_job_that_can_never_start_fails_with_slurms_reason():
    # partition "small" has MaxNodes=1: sbatch accepts a 2-node job, which then waits forever
    ex = executor("slurm-local")
    launcher = ex.launcher(2, config=ex.stage_config({"partition": "small", "nodes": 2}))  # a stage's keys
    t0 = time.monotonic()
    with pytest.raises(px.GangError) as info:
        px.Gang(2, executor=launcher, echo=False).start()
    assert time.monotonic() - t0 < 20
    # SLURM says PartitionConfig or PartitionNodeLimit, depending on when it looks
    assert re.match(
        r"slurm: job \d+ PENDING \((PartitionNodeLimit|PartitionConfig)\): .*partition 'small'.* "
        r"\(site 'slurm-local'\)$",
        str(info.value),
    ), str(info.value)
    assert active_jobs(launcher.job_id) == []


def test_a_pilot_that_ended_is_replaced_and_a_gang_too_big_for_it_is_refused(tmp_path):
    pilot = SlurmPilot({"nodes": 1, "ntasks": 1}, conf=CONF).start(timeout=30)
    try:
        first = pilot.job_id
        slurm("scancel", first)  # e.g. its time limit: the next gang gets a fresh pilot
        wait_until(lambda: not active_jobs(first), 20, "the pilot to end")
        second = pilot.start(timeout=30).job_id
        assert second != first
        with pytest.raises(px.GangError, match="a gang of 2 ranks does not fit the pilot's 1 tasks"):
            SlurmStepLauncher(pilot).launch(["true"], rank_env(2), tmp_path)
        # the executor refuses it before anything starts (phalanx validate, the scheduler)
        ex = SlurmExecutor({"allocation": "pilot", "conf": CONF, "pilot": {"nodes": 1, "ntasks": 1}})
        with pytest.raises(px.GangError, match="a gang of 2 ranks does not fit the pilot's 1 tasks"):
            ex.check(2, ex.config)
        assert ex.capacity() == 1
    finally:
        pilot.close()
    assert active_jobs(second) == []


# ---- allocations: announced to the launcher's hook, freed from any process -----------------
class Hook(list):
    """An allocation hook that remembers what it was told."""

    def held(self, record: dict) -> None:
        self.append(("held", dict(record)))

    def released(self, record: dict) -> None:
        self.append(("released", dict(record)))


def release_elsewhere(record: dict) -> str:
    """``phalanx.executors.release`` in another process (as ``phalanx status`` of a lost run)."""
    code = "import json, sys; from phalanx.executors import release; print(release(json.loads(sys.argv[1])))"
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps(record)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()


def test_a_job_is_announced_before_sbatch_and_released_by_name_from_another_process(tmp_path):
    launcher = executor("slurm-local").launcher(2)
    launcher.allocation_hook = hook = Hook()
    launcher.launch(["sleep", "300"], rank_env(2), tmp_path)
    name = launcher.step_name
    record = {"executor": "slurm", "kind": "job", "id": name, "job": launcher.job_id, "conf": CONF}
    assert hook == [("held", {**record, "job": None}), ("held", record)]  # named before SLURM knew it
    wait_until(lambda: "RUNNING" in launcher.status(), 30, "the job to run")
    assert release_elsewhere({**record, "job": None}) == f"slurm: scancel job {launcher.job_id} ({name})"
    wait_until(lambda: not active_jobs(launcher.job_id), 30, "the job to go")
    assert release_elsewhere(record) == f"slurm: job {name} already gone"
    launcher.kill()
    assert hook[-1] == ("released", record)


def test_a_pilot_and_its_steps_are_announced_and_released_from_another_process(tmp_path):
    pilot = SlurmPilot({"nodes": 1, "ntasks": 2}, conf=CONF)
    launcher = SlurmStepLauncher(pilot)  # no run hook: the pilot is told to the gang's
    launcher.allocation_hook = hook = Hook()
    try:
        launcher.launch(["sleep", "300"], rank_env(2), tmp_path)
        records = [r for what, r in hook if what == "held"]
        assert [(r["kind"], r["job"]) for r in records] == [
            ("pilot", None),
            ("pilot", pilot.job_id),
            ("step", pilot.job_id),
        ]
        step = records[-1]
        wait_until(lambda: "RUNNING" in launcher.status(), 30, "the step to run")
        assert re.fullmatch(rf"slurm: scancel step {pilot.job_id}\.\d+ \({step['id']}\)", release_elsewhere(step))
        assert all(c < 0 for c in wait_codes(launcher))  # the step ended; the pilot lives on
        assert active_jobs(pilot.job_id)
        assert release_elsewhere(records[1]) == f"slurm: scancel pilot {pilot.job_id} ({records[1]['id']})"
        wait_until(lambda: not active_jobs(records[1]["job"]), 30, "the pilot to go")
        assert release_elsewhere(step) == f"slurm: step {step['id']} already gone"
        launcher.kill()
    finally:
        pilot.close()
    assert hook[-2:] == [("released", step), ("released", records[1])]


def test_a_driver_that_exits_holding_a_job_cancels_it_at_exit(tmp_path):
    """No gang, no scheduler: only the launcher knew the job; the exit handler frees it."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_slurm import executor, rank_env
        launcher = executor("slurm-local").launcher(2)
        launcher.launch(["sleep", "300"], rank_env(2), {str(tmp_path)!r})
        print(launcher.job_id, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    job = out.stdout.strip()
    assert out.returncode == 0 and job.isdigit(), out.stderr
    assert f"released at exit: slurm: scancel job {job}" in out.stderr
    wait_until(lambda: not active_jobs(job), 30, "the job to go")


# ---- pilot: one held allocation, every gang a job step ----------------------------------
@pytest.fixture(scope="class")
def pilot_executor():
    """The run scope of one executor: its pilot lives until close_run."""
    ex = executor("slurm-pilot-local")
    ex.open_run()
    yield ex
    job = ex.pilot().job_id
    ex.close_run()
    assert active_jobs(job) == []


@pytest.fixture(scope="class")
def pilot(pilot_executor):
    return pilot_executor.pilot().start(timeout=60)


@pytest.fixture(scope="class")
def pilot_launcher(pilot_executor, pilot):
    return pilot_executor.launcher(2)


@pytest.fixture(scope="class")
def pilot_gang(pilot_launcher):
    with px.Gang(2, executor=pilot_launcher, echo=False) as g:
        yield g


class TestPilot:
    def test_a_gang_is_a_step_of_the_pilot_spread_over_its_nodes(self, pilot, pilot_gang, pilot_launcher):
        assert re.fullmatch(r"slurm: pilot job \d+ RUNNING on n\[1-3\]", pilot.status())
        assert pilot_launcher.job_id == pilot.job_id
        check_spread_and_comm(pilot_gang, pilot_launcher, 2)
        assert re.fullmatch(
            rf"slurm: step {pilot.job_id}\.\d+ RUNNING \(pilot job {pilot.job_id} on n\[1-3\]\)",
            pilot_launcher.status(),
        ), pilot_launcher.status()

    def test_a_rank_that_exits_fails_the_gang_and_the_pilot_lives_on(self, pilot, pilot_gang):
        t0 = time.monotonic()
        with pytest.raises(px.RankError) as info:
            pilot_gang.run(rank0_exits)
        assert time.monotonic() - t0 < 10
        assert info.value.ranks[0] == 0 and "exited with code 3" in str(info.value)
        assert pilot.status().startswith(f"slurm: pilot job {pilot.job_id} RUNNING")
        # the gang's step is gone, the pilot's batch step (the holder) remains
        wait_until(
            lambda: slurm("squeue", "-h", "-s", "-j", pilot.job_id, "-o", "%i").split() == [f"{pilot.job_id}.batch"],
            10,
            "the step to go",
        )

    def test_steps_share_the_pilot_and_wait_for_a_free_share(self, pilot_executor, pilot, tmp_path):
        assert pilot_executor.capacity() == 6  # the pilot's ntasks
        full = pilot_executor.launcher(6)
        assert full.pilot is pilot
        full.launch(["sleep", "300"], rank_env(6), tmp_path / "full")  # all 6 slots
        wait_until(lambda: "RUNNING" in full.status(), 20, "the first step")
        late = pilot_executor.launcher(2)
        late.launch(["sh", "-c", "exit 0"], rank_env(2), tmp_path / "late")
        status = wait_until(lambda: "waiting for a share" in (s := late.status()) and s, 20, "the second step to wait")
        assert status.endswith(f"waiting for a share of pilot job {pilot.job_id}")
        assert late.exitcodes() == [None, None]
        full.kill(grace_s=1.0)
        assert all(c is not None and c < 0 for c in full.exitcodes()), full.exitcodes()
        assert wait_codes(late) == [0, 0]  # it got the freed share
        late.kill()
        assert slurm("squeue", "-h", "-s", "-j", pilot.job_id, "-o", "%i").split() == [f"{pilot.job_id}.batch"]


def test_two_runs_in_one_process_keep_their_own_pilots(tmp_path):
    """Two SlurmExecutors (two runs of the same site in one process, or a run and a px.Gang)
    each hold a pilot of their own, and ending one run leaves the other's gang running.

    Before issue 10 this failed twice over.  Pilots were process-global (``SlurmPilot.shared``,
    keyed by site and section), so both runs' gangs were steps of ONE pilot job: with these
    2-task pilots, b's gang waits for a share of a's pilot and fails its start timeout
    (checked by sharing the pilot in ``SlurmExecutor.pilot``: "ranks 0, 1 did not manage to
    start ... waiting for a share of pilot job J"); with a bigger pilot the job ids are equal.
    And the end of either run called ``SlurmPilot.close_shared()``, which scancelled every
    pilot of the process: b's gang would die with a's run (its step CANCELLED)."""
    small = {"pilot": {"nodes": 1, "ntasks": 2, "time": "00:10:00"}}  # two pilots fit the 3 nodes
    a, b = executor("slurm-pilot-local", **small), executor("slurm-pilot-local", **small)
    heard_a, heard_b = Hook(), Hook()
    a.open_run(hook=heard_a)
    b.open_run(hook=heard_b)
    gang_a = px.Gang(2, executor=a.launcher(2), echo=False, log_dir=tmp_path / "a", start_timeout=60)
    gang_b = px.Gang(2, executor=b.launcher(2), echo=False, log_dir=tmp_path / "b", start_timeout=60)
    try:
        gang_a.start()
        gang_b.start()
        job_a, job_b = a.pilot().job_id, b.pilot().job_id
        assert job_a != job_b
        assert {i["job"] for i in gang_a.run(where)} == {job_a}
        assert {i["job"] for i in gang_b.run(where)} == {job_b}
        # each run's hook heard of its own pilot only (its record has the job once submitted)
        pilots_a = [r for what, r in heard_a if r["kind"] == "pilot" and what == "held"]
        assert [r["job"] for r in pilots_a] == [None, job_a]
        assert [r["job"] for what, r in heard_b if r["kind"] == "pilot" and what == "held"] == [None, job_b]

        a.close_run()  # run a ends: its pilot, and the gang on it, go
        assert active_jobs(job_a) == []
        assert ("released", pilots_a[-1]) in heard_a
        assert active_jobs(job_b), "closing run a ended run b's pilot"
        assert [i["rank"] for i in gang_b.run(where)] == [0, 1]  # b's gang runs on, on its pilot
        assert b.pilot().job_id == job_b
    finally:
        gang_a.close()
        gang_b.close()
        a.close_run()
        b.close_run()
    assert active_jobs(job_b) == []


def wait_for_node_failure_then_finish(env):
    """Attempt 1: mark that the ranks run, then wait (a node will fail under them).
    Later attempts: finish at once."""
    from pathlib import Path

    marker = Path(env.params["dir"]) / "attempt-1-started"
    if not marker.exists():
        env.comm.barrier()
        if env.rank == 0:
            marker.write_text(os.environ.get("SLURM_JOB_ID", ""))
        time.sleep(300)


def test_a_node_failure_under_a_stage_retries_it_on_the_nodes_left(tmp_path):
    """A slurmd node going DOWN kills the stage's job (SLURM: NODE_FAIL); the stage is retried
    on the remaining nodes and the workflow succeeds — a stage without retries too: node loss is
    retried by retry.infrastructure (default 3), never by the stage's own retries."""
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    site = load_site("slurm-local")
    site.store.root = str(tmp_path / "store")
    wf = Workflow(
        name="nodefail",
        stages={
            "s": Stage(
                app="test_slurm:wait_for_node_failure_then_finish", ranks=3, retries=0, params={"dir": str(tmp_path)}
            )
        },
    )  # spread_job: the 3 ranks over the 3 nodes
    db = RunDB(tmp_path / "state")
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(r=run_workflow(wf, site, db=db)))
    runner.start()
    marker, node = tmp_path / "attempt-1-started", None
    try:
        wait_until(marker.exists, 120, "attempt 1's ranks to start")
        nodelist = slurm("squeue", "-h", "-j", marker.read_text(), "-o", "%N").strip()
        node = slurm("scontrol", "show", "hostnames", nodelist).split()[-1]
        slurm("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=phalanx-test")
        runner.join(timeout=240)
        assert not runner.is_alive(), "the workflow did not finish after the node failure"
    finally:
        if node:
            slurm("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        runner.join(timeout=60)
    result = outcome["r"]
    assert result.ok, result.failed
    first, second = db.attempts(result.run_id, "s")
    assert first["state"] == "failed" and "NODE_FAIL" in first["error"], first["error"]
    assert first["cause"] == "node_lost" and second["state"] == "succeeded"
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert said == [
        "attempt 1: node lost — retrying in 1 s (retry 1 of 3 for preemption and node loss (retry.infrastructure))"
    ]
