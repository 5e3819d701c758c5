"""Retries that know why (``retry:``): each failed attempt's cause (a rank's exit code, an
exception type, out of memory, a timeout, a lost node), retried only as the stage's policy says,
counted per cause; memory per rank raised after out of memory; the causes in the run DB, in
``phalanx status`` and in the report.  Real rank processes on the local executor (the SLURM
test at the end: a real node failure on the test cluster)."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.errors import RankError, RankFailure, StageTimeoutError
from phalanx.orchestrator.models import RetryPolicy, Site, Stage, Workflow
from phalanx.orchestrator.retry import RetryState, classify, label, lineage, policy_of
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

ROOT = Path(__file__).resolve().parents[1]
NOW = {"first": 0.0}  # no backoff: these tests retry at once
_MIB = 2**20


# ---- the app: attempt k does what params.plan[k-1] says -----------------------------------------
def planned(env):
    """Attempt k (the k-th file in params.dir) acts as ``plan[k-1]``: ok, exit:N, raise:TYPE,
    sleep (past the stage's timeout) or grow:BYTES (private memory up to BYTES, then ok)."""
    import builtins

    done = Path(env.params["dir"])
    if env.rank == 0:
        k = len(list(done.iterdir()))
        (done / f"attempt-{k + 1}").write_text(str(os.getpid()))
    else:
        k = len(list(done.iterdir())) - 1
    plan = env.params["plan"]
    action = plan[min(k, len(plan) - 1)]
    if env.rank != 0 or action == "ok":
        return None
    what, _, arg = action.partition(":")
    if what == "exit":
        os._exit(int(arg))
    if what == "raise":
        raise getattr(builtins, arg)(f"planned {arg}")
    if what == "sleep":
        time.sleep(60)
    if what == "grow":  # touch every page: resident, private memory
        blocks = []
        while private_bytes() < int(arg):
            blocks.append(bytearray(b"x" * (16 * _MIB)))
        return len(blocks)
    raise AssertionError(f"unknown action {action!r}")


def private_bytes() -> int:
    """This process's private resident memory (RssAnon), as the local executor's watch reads it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def run(tmp_path, plan, *, retry=None, site=None, **stage):
    """One stage of ``planned`` with ``plan``; the result and the stage's attempts."""
    marks = tmp_path / "attempts"
    marks.mkdir(parents=True, exist_ok=True)
    kw = {"retry": retry} if retry is not None else {}
    wf = Workflow(
        name="retry",
        stages={"s": Stage(app="test_retry_policy:planned", params={"dir": str(marks), "plan": plan}, **kw, **stage)},
    )
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf, site or Site(name="one", cores=2), db=db)
    return result, db.attempts(result.run_id, "s"), db


def causes(attempts):
    return [(a["state"], a["cause"]) for a in attempts]


# ---- exit codes ---------------------------------------------------------------------------------
@pytest.mark.slow  # workflow runs of several attempts (the core lane is at its 5-minute budget)
def test_an_exit_code_is_retried_only_when_the_policy_names_it(tmp_path):
    result, attempts, _ = run(tmp_path / "a", ["exit:3", "ok"], retry={"causes": {"exit:3": 1}, "backoff": NOW})
    assert result.ok, result.failed
    assert causes(attempts) == [("failed", "exit:3"), ("succeeded", None)]

    result, attempts, db = run(tmp_path / "b", ["exit:3", "ok"], retry={"causes": {"exit:4": 2}, "backoff": NOW})
    assert not result.ok and causes(attempts) == [("failed", "exit:3")]
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert said == ["attempt 1: exit code 3 — not retried: exit code 3 is not in retry.causes (exit:4)"]


# ---- exception types ----------------------------------------------------------------------------
@pytest.mark.slow  # workflow runs of several attempts (the core lane is at its 5-minute budget)
def test_an_exception_type_is_retried_by_name_its_subclasses_too_and_another_is_not(tmp_path):
    policy = {"causes": {"ConnectionError": 1}, "backoff": NOW}
    result, attempts, db = run(tmp_path / "a", ["raise:ConnectionResetError", "ok"], retry=policy)
    assert result.ok, result.failed  # ConnectionResetError is a ConnectionError
    assert causes(attempts) == [("failed", "ConnectionResetError"), ("succeeded", None)]
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert said == ["attempt 1: ConnectionResetError — retrying in 0 s (retry 1 of 1 for ConnectionError)"]

    result, attempts, _ = run(tmp_path / "b", ["raise:ValueError", "ok"], retry=policy)
    assert not result.ok and "planned ValueError" in result.failed["s"]
    assert causes(attempts) == [("failed", "ValueError")]


@pytest.mark.slow  # workflow runs of several attempts (the core lane is at its 5-minute budget)
def test_each_cause_uses_its_own_count_and_any_takes_the_rest(tmp_path):
    plan = ["exit:3", "raise:KeyError", "exit:3", "ok"]
    result, attempts, db = run(tmp_path, plan, retry={"causes": {"exit:3": 1, "any": 1}, "backoff": NOW})
    # exit:3 once (its 1), KeyError once (any's 1), exit:3 again: its count is used up (not any's)
    assert not result.ok
    assert causes(attempts) == [("failed", "exit:3"), ("failed", "KeyError"), ("failed", "exit:3")]
    said = [e["message"].split(" — ")[1] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert said == [
        "retrying in 0 s (retry 1 of 1 for exit:3)",
        "retrying in 0 s (retry 1 of 1 for any)",
        "not retried: its 1 retry for exit:3 is used up",
    ]


@pytest.mark.slow  # two runs of two attempts
def test_the_site_retry_is_the_default_and_a_stage_retries_overrides_it(tmp_path):
    site = Site(name="one", cores=2, retry={"causes": {"exit:3": 1}, "backoff": NOW})
    result, attempts, _ = run(tmp_path / "a", ["exit:3", "ok"], site=site)
    assert result.ok and causes(attempts) == [("failed", "exit:3"), ("succeeded", None)]
    result, attempts, _ = run(tmp_path / "b", ["exit:3", "ok"], site=site, retries=0)
    assert not result.ok and causes(attempts) == [("failed", "exit:3")]


# ---- the stage's timeout ------------------------------------------------------------------------
@pytest.mark.slow  # the first attempt runs for its whole timeout (long enough for a loaded machine's retry)
def test_a_timeout_is_retried(tmp_path):
    result, attempts, _ = run(tmp_path, ["sleep", "ok"], retry={"causes": {"timeout": 1}, "backoff": NOW}, timeout=5)
    assert result.ok, result.failed
    assert causes(attempts) == [("failed", "timeout"), ("succeeded", None)]
    assert "within the stage timeout (timeout=5s)" in attempts[0]["error"]


# ---- out of memory: retried with more memory per rank -------------------------------------------
@pytest.mark.slow  # a rank grows its memory past 0.6 GiB: first touch of fresh pages takes ~1-2 s here
def test_out_of_memory_retries_with_twice_the_memory_per_rank(tmp_path):
    limit = 0.5  # GiB per rank (the site's 1 GiB over its 2 slots); the rank needs 0.625
    site = Site(name="mem", cores=2, memory_gb=2 * limit)
    policy = {"causes": {"oom": 2}, "memory": "x2", "max_memory_gb": 4, "backoff": NOW}
    need = int(limit * 1.25 * 2**30)
    result, attempts, db = run(tmp_path, [f"grow:{need}"], retry=policy, site=site)
    assert result.ok, result.failed
    assert causes(attempts) == [("failed", "oom"), ("succeeded", None)]
    assert "over its memory limit of 0.5 GiB" in attempts[0]["error"]
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "retry"]
    assert said == [
        "attempt 1: out of memory — retrying in 0 s with 1 GiB per rank, was 0.5 GiB (retry 1 of 2 for oom)"
    ]


def test_memory_grows_by_the_factor_up_to_the_cap():
    state = RetryState(RetryPolicy(causes={"oom": 3}, memory="x3", max_memory_gb=4), memory=2**30)
    grown = [state.after("oom").memory for _ in range(3)]
    assert grown == [3 * 2**30, 4 * 2**30, 4 * 2**30]  # 1 → 3 → 9 capped at 4 GiB → 4
    assert state.after("oom").retry is False
    # no limit known (no site memory_gb): retried, memory unchanged, and the event says so
    unknown = RetryState(RetryPolicy(causes={"oom": 1}, memory="x2")).after("oom")
    assert unknown.retry and unknown.memory is None and "no memory limit per rank" in unknown.describe()


# ---- preemption and node loss: never the user's retries -----------------------------------------
def test_preemption_and_node_loss_use_the_infrastructure_budget_not_the_stages():
    state = RetryState(RetryPolicy(causes={"any": 1}, infrastructure=2))
    assert [state.after(c).retry for c in ("preempted", "node_lost", "preempted")] == [True, True, False]
    assert state.used == {"infrastructure": 2}  # the stage's any: 1 is untouched
    assert state.after("exit:1").describe().endswith("(retry 1 of 1 for any)")
    # retries: 0 and no policy: a preemption still retries (the default infrastructure: 3)
    legacy = RetryState(policy_of(Stage(app="a:b"), Site(name="x")))
    assert legacy.after("node_lost").retry and not legacy.after("exit:1").retry


def test_classify_reads_what_the_ranks_reported():
    def failed(*failures):
        return classify(RankError(list(failures)))

    assert failed(RankFailure(0, "", "rank process exited with code 3", exitcode=3)) == "exit:3"
    assert failed(RankFailure(0, "", "rank process killed by signal SIGSEGV", exitcode=-11)) == "signal:SIGSEGV"
    assert failed(RankFailure(0, "MemoryError", "")) == "oom"
    assert failed(RankFailure(0, "OutOfMemoryError", "rank 0: CUDA out of memory on cuda:0")) == "oom"
    # the resource manager's word on a rank (SLURM NODE_FAIL) explains a peer's lost connection
    peer = RankFailure(1, "ConnectionError", "rank 1 lost its connection to rank 0")
    lost = RankFailure(0, "", "rank process killed by signal SIGKILL", exitcode=-9, cause="node_lost")
    assert failed(peer, lost) == "node_lost"
    assert classify(StageTimeoutError("late")) == "timeout"
    assert lineage("ConnectionResetError")[:3] == ["ConnectionResetError", "ConnectionError", "OSError"]
    assert lineage("ServiceUnreachableError")[:2] == ["ServiceUnreachableError", "RemoteStoreError"]
    assert "ConnectionError" in lineage("ServiceUnreachableError")
    assert [label(c) for c in ("oom", "exit:3", "signal:SIGKILL", "node_lost", None)] == [
        "out of memory",
        "exit code 3",
        "killed by SIGKILL",
        "node lost",
        "-",
    ]


def test_the_default_backoff_and_a_configured_one():
    state = RetryState(RetryPolicy(causes={"any": 5}, backoff={"first": 2, "factor": 3, "max": 10}))
    assert [state.after("exit:1").wait_s for _ in range(4)] == [2, 6, 10, 10]
    default = RetryState(RetryPolicy(causes={"any": 4}))
    assert [default.after("exit:1").wait_s for _ in range(4)] == [1, 4, 15, 15]


# ---- the policy in files: errors with file and line --------------------------------------------
WF = """\
name: r
stages:
  s:
    app: apps:rank_info
    ranks: 1
    retry:
      causes: {oom: 2, "exit:3": 1}
      memory: x2
"""


def validate(tmp_path: Path, text: str, capsys) -> tuple[int, str]:
    """``phalanx validate`` of ``text``: its exit code and what it wrote on stderr."""
    from phalanx.cli import main

    path = tmp_path / "wf.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["validate", str(path)])
    return code, capsys.readouterr().err.replace(str(path), "wf.yaml")


@pytest.mark.parametrize(
    "edit,expected",
    [
        (("causes:", "on:"), "wf.yaml:6: stages.s.retry: `on:` reads as true in YAML: name the causes under causes:"),
        (("oom: 2", "oon: 2"), "wf.yaml:7: stages.s.retry.causes: unknown cause 'oon' (did you mean 'oom'?)"),
        (("oom: 2", "preempted: 2"), "wf.yaml:7: stages.s.retry.causes: preempted: preemption and node loss never"),
        (("memory: x2", "memory: 2x"), "wf.yaml:8: stages.s.retry.memory: '2x': a factor above 1 such as 'x2'"),
        (("oom: 2, ", ""), "stages.s.retry: memory: applies to retries after out of memory: add oom: N to causes"),
        (("    ranks: 1\n", "    ranks: 1\n    retries: 2\n"), "give retries or retry, not both"),
        (("memory: x2", "memory: x2\n      backof: {first: 1}"), "wf.yaml:9: stages.s.retry.backof: unknown key"),
    ],
)
def test_bad_policies_are_rejected_with_file_and_line(tmp_path, capsys, edit, expected):
    code, err = validate(tmp_path, WF.replace(*edit), capsys)
    assert code != 0 and expected in err, err


def test_a_sound_policy_validates(tmp_path, capsys):
    code, err = validate(tmp_path, WF, capsys)
    assert code == 0, err


# ---- what a run shows: the run DB, phalanx status, the report -----------------------------------
@pytest.mark.slow  # workflow runs of several attempts (the core lane is at its 5-minute budget)
def test_retries_n_keeps_meaning_any_failure_and_status_and_report_show_each_cause(tmp_path, monkeypatch, capsys):
    from phalanx.cli import main
    from phalanx.orchestrator import scheduler
    from phalanx.orchestrator.report import write_report

    monkeypatch.setattr(scheduler, "BACKOFF_S", (0.0,))  # the pauses of a stage that gives no backoff
    result, attempts, db = run(tmp_path, ["exit:3", "raise:KeyError", "ok"], retries=2)
    assert result.ok, result.failed
    assert causes(attempts) == [("failed", "exit:3"), ("failed", "KeyError"), ("succeeded", None)]
    monkeypatch.setenv("PHALANX_STATE", str(tmp_path / "state"))
    assert main(["status", result.run_id]) == 0
    assert "attempt 1 failed: exit code 3; attempt 2 failed: KeyError; attempt 3 succeeded" in capsys.readouterr().out
    html = write_report(db, result.run_id, tmp_path / "report.html").read_text()
    assert '<td class="cause">exit code 3</td>' in html and '<td class="cause">KeyError</td>' in html
    assert "attempt 1 · failed (exit code 3)" in html


@pytest.mark.slow  # a workflow run of three attempts, through the CLI
def test_a_retry_policy_in_a_workflow_file_through_phalanx_run(tmp_path, monkeypatch, capsys):
    """``retry:`` in a file run by ``phalanx run``: each cause uses its own count, the plain
    progress lines and the run DB say each attempt's cause and the policy's decision."""
    from phalanx.cli import main

    marks = tmp_path / "attempts"
    marks.mkdir()
    (tmp_path / "wf.yaml").write_text(
        textwrap.dedent(
            f"""\
            name: retry-cli
            stages:
              s:
                app: test_retry_policy:planned
                ranks: 2
                params: {{dir: {str(marks)!r}, plan: ["exit:3", "raise:KeyError", "ok"]}}
                retry:
                  causes: {{"exit:3": 1, KeyError: 1}}
                  backoff: {{first: 0}}
            """
        )
    )
    monkeypatch.setenv("PHALANX_STATE", str(tmp_path / "state"))
    assert main(["run", str(tmp_path / "wf.yaml"), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "attempt 1: exit code 3 — retrying in 0 s (retry 1 of 1 for exit:3)" in out
    assert "attempt 2: KeyError — retrying in 0 s (retry 1 of 1 for KeyError)" in out
    db = RunDB(tmp_path / "state")
    run_id = db.runs()[0]["id"]
    assert db.runs()[0]["state"] == "succeeded"
    assert causes(db.attempts(run_id, "s")) == [("failed", "exit:3"), ("failed", "KeyError"), ("succeeded", None)]
    assert sorted(p.name for p in marks.iterdir()) == ["attempt-1", "attempt-2", "attempt-3"]  # the app's own count


@pytest.mark.slow  # a gang start, its failure, and a cancel
def test_a_cancel_ends_a_retry_s_backoff_at_once(tmp_path):
    """A stage waiting out its policy's backoff (300 s) before a retry: cancelling the run ends
    the wait at once (the scheduler waits on the run's cancel event, not in a sleep), the
    retry never starts, and the run is cancelled."""
    import phalanx as px

    marks = tmp_path / "attempts"
    marks.mkdir()
    policy = {"causes": {"exit:3": 1}, "backoff": {"first": 300, "max": 300}}
    wf = Workflow(
        name="backoff",
        stages={
            "s": Stage(
                app="test_retry_policy:planned", params={"dir": str(marks), "plan": ["exit:3", "ok"]}, retry=policy
            )
        },
    )
    handle = px.submit(wf, site=Site(name="one", cores=2), state=tmp_path / "state")
    db = RunDB(tmp_path / "state")
    deadline = time.monotonic() + 120
    while not [e for e in db.events(handle.run_id) if e["kind"] == "retry"]:  # until its backoff began
        assert time.monotonic() < deadline and not handle.done(), "the first attempt never failed into its backoff"
        time.sleep(0.05)
    said = [e["message"] for e in db.events(handle.run_id) if e["kind"] == "retry"]
    assert said == ["attempt 1: exit code 3 — retrying in 300 s (retry 1 of 1 for exit:3)"]
    t0 = time.monotonic()
    assert handle.cancel(timeout=60) is True
    assert time.monotonic() - t0 < 10  # not the 300 s backoff (nor cancel's own 60 s timeout)
    result = handle.result(timeout=0)
    assert result.state == "cancelled" and result.failed == {"s": "cancelled"}
    assert causes(db.attempts(handle.run_id, "s")) == [("failed", "exit:3")]  # no second attempt
    assert [p.name for p in marks.iterdir()] == ["attempt-1"]
    assert {s["stage"]: s["state"] for s in db.stages(handle.run_id)} == {"s": "cancelled"}


# ---- SLURM: the job's final state says why its ranks ended ----------------------------------------
@pytest.mark.parametrize(
    "state,cause", [("PREEMPTED", "preempted"), ("NODE_FAIL", "node_lost"), ("OUT_OF_MEMORY", "oom"), ("FAILED", None)]
)
def test_a_slurm_jobs_final_state_is_its_ranks_cause(tmp_path, state, cause):
    """What SlurmLauncher makes of a job that ended in ``state`` (as squeue reports it): the ranks
    without an exit file get its signal, and ``end_cause`` its cause (no cluster needed: a real
    NODE_FAIL retried without the stage's retries is test_slurm's node failure test, a real
    PREEMPTED test_slurm_preemption's, on a cluster of its own with preemption enabled)."""
    from phalanx.executors.slurm.commands import JobInfo, SlurmCommands
    from phalanx.executors.slurm.launcher import SlurmJobLauncher

    launcher = SlurmJobLauncher(slurm=SlurmCommands())
    launcher._reset(tmp_path, 2)  # a launched gang of 2 ranks, as launch() leaves it
    launcher.job_id = "42"
    launcher._settle(JobInfo("42", state), state, None)
    assert all(c is not None and c != 0 for c in launcher.exitcodes())
    assert launcher.end_cause(0) == cause
    failure = RankFailure(0, "", "rank process killed", exitcode=launcher.exitcodes()[0], cause=cause or "")
    expected = {"PREEMPTED": "preempted", "NODE_FAIL": "node_lost", "OUT_OF_MEMORY": "oom"}.get(state, "exit:1")
    assert classify(RankError([failure])) == expected


def test_a_retry_with_more_memory_asks_slurm_for_it():
    """The retried gang's executor (``Executor.sized``) asks SLURM for the new memory per rank
    (--mem-per-cpu), and the site's executor keeps its own for other stages."""
    from phalanx.executors.slurm import SlurmExecutor

    site = SlurmExecutor({"partition": "debug"}, site="s", rank_memory=2**30)
    assert site.sized(2 * 2**30).launcher(2).options["mem-per-cpu"] == "2048M"
    assert site.launcher(2).options["mem-per-cpu"] == "1024M" and site.rank_memory == 2**30


def test_a_per_stage_slurm_job_s_own_mem_per_cpu_is_what_an_oom_retry_multiplies():
    """Per-stage SLURM jobs have no site share of memory: the stage's section's mem_per_cpu (times
    its cpus_per_task) is the memory per rank, and the retried gang's --mem-per-cpu replaces it
    (a per-node --mem too)."""
    from phalanx.executors.slurm import SlurmExecutor

    site = SlurmExecutor({"partition": "debug"}, site="s")
    stage = site.stage_config({"mem_per_cpu": "1G", "cpus_per_task": 2})
    assert site.rank_memory_for(stage) == 2 * 2**30
    assert site.rank_memory_for(site.stage_config({"mem_per_cpu": "1536"})) == 1536 * 2**20  # MB without a unit
    assert site.rank_memory_for(None) is None  # SLURM's default: nothing to multiply
    state = RetryState(RetryPolicy(causes={"oom": 1}, memory="x2"), site.rank_memory_for(stage))
    decision = state.after("oom")
    assert decision.memory == 4 * 2**30
    retried = site.sized(decision.memory).launcher(1, config=stage)
    assert retried.options["mem-per-cpu"] == "2048M"  # 4 GiB over 2 CPUs per rank
    assert "mem-per-cpu" in site.launcher(1, config=stage).options
    assert site.launcher(1, config=stage).options["mem-per-cpu"] == "1G"  # the site's executor: as it was
    per_node = site.stage_config({"mem": "8G"})
    assert "mem" not in site.sized(2**30).launcher(1, config=per_node).options


def test_the_python_api_takes_a_policy_and_leaves_the_default_to_the_site():
    import phalanx as px

    @px.stage(retry={"causes": {"exit:3": 1}})
    def a(env):
        return None

    @px.stage()
    def b(env):
        return None

    model = px.Workflow("w", [a, b]).model()
    assert model.stages["a"].retry == RetryPolicy(causes={"exit:3": 1})
    site = Site(name="x", retry={"causes": {"oom": 1}})
    assert policy_of(model.stages["b"], site).causes == {"oom": 1}  # no retries given: the site's
    assert policy_of(model.stages["a"], site).causes == {"exit:3": 1}
