"""Driver killed (SIGKILL) mid-stage: no rank, job, step, actor or placement group survives
30 s, no rank seals anything after the kill, the run is "lost" and resumes to the right data.

Each backend runs the same workflow through the real CLI (``phalanx run --plain``): ``gen``
seals ``tx``, then ``totals`` computes until a file appears.  The test SIGKILLs the driver once
every ``totals`` rank runs and creates that file at once: a rank that outlived its driver would
now seal ``totals`` into the lost run's session.  Ranks end by their control connection's end
(``runtime.worker.DriverWatch``); allocations end with them or are freed from the run DB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from fault_apps import write_whole

import phalanx as px
from phalanx.orchestrator.rundb import RunDB, pid_alive

TESTS = Path(__file__).resolve().parents[1]
SITES = TESTS.parent / "site-configs"
PHALANX = [sys.executable, "-m", "phalanx.cli"]
ROWS, SEED, GEN_RANKS = 6000, 7, 2
WITHIN_S = 30.0  # the contract: nothing of the run survives this long after the kill


# ---- the stage app (imported by the ranks as "test_driver_death:totals_when_told") -------------
def totals_when_told(env):
    """Writes its pid, computes until params.go exists, then seals per-user totals of ``tx``."""
    import apps

    write_whole(Path(env.params["dir"], f"rank-{env.rank}.pid"), str(os.getpid()))
    go = Path(env.params["go"])
    while not go.exists():  # "computing": busy half the time, polling the file between bursts
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            sum(range(1000))
        time.sleep(0.05)
    return apps.wf_totals(env)


def expected_totals() -> dict[int, int]:
    """What ``totals`` must hold, computed here from apps.wf_generate's recipe (not the store)."""
    users, amounts = [], []
    for rank in range(GEN_RANKS):
        rng = np.random.default_rng([SEED, rank])
        users.append(rng.integers(0, 50, ROWS // GEN_RANKS))
        amounts.append(rng.integers(1, 100, ROWS // GEN_RANKS))
    u, a = np.concatenate(users), np.concatenate(amounts)
    return {int(k): int(a[u == k].sum()) for k in np.unique(u)}


# ---- helpers ---------------------------------------------------------------------------------------
def wait_for(what: str, cond, within: float, poll: float = 0.02):
    deadline = time.monotonic() + within
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(poll)
    return got


def slurm_left(conf: str, names: set[str]) -> list[str]:
    """Jobs and steps SLURM still runs under any of ``names``."""
    env = {**os.environ, "SLURM_CONF": conf}
    out = [
        subprocess.run(
            ["squeue", "-h", *flag, "-o", "%i %j"], env=env, capture_output=True, text=True, timeout=30, check=True
        ).stdout
        for flag in ([], ["-s"])
    ]
    return [line for text in out for line in text.splitlines() if line.split()[-1] in names]


def ray_left(records: list[dict]) -> list[str]:
    """Placement groups and rank actors of ``records`` Ray still keeps."""
    import ray
    from ray.util.placement_group import placement_group_table

    left = [
        f"placement group {t['name']} {t['state']}"
        for t in placement_group_table().values()
        if t["name"] in {r["id"] for r in records} and t["state"] != "REMOVED"
    ]
    for r in records:
        for rank in range(r["ranks"]):
            try:
                ray.get_actor(f"{r['id']}-rank{rank}", namespace=r["namespace"])
                left.append(f"actor {r['id']}-rank{rank}")
            except ValueError:
                pass
    return left


class Run:
    """One workflow run through the CLI, in ``tmp``; ``backend`` names what the test checks."""

    def __init__(self, tmp: Path, site: str | None, backend: str, extra_env: dict | None = None):
        self.tmp, self.backend = tmp, backend
        self.dir, self.go = tmp / "ranks", tmp / "go"
        self.dir.mkdir()
        self.wf = tmp / "wf.yaml"
        self.wf.write_text(
            textwrap.dedent(f"""\
            name: driverkill
            stages:
              gen:
                app: apps:wf_generate
                ranks: {GEN_RANKS}
                params: {{rows: {ROWS}, seed: {SEED}}}
                outputs: [tx]
              totals:
                app: test_driver_death:totals_when_told
                ranks: 2
                inputs: {{tx: {{dataset: tx, by: [user]}}}}
                params: {{dir: {self.dir}, go: {self.go}}}
                outputs: [totals]
            """)
        )
        self.site = ["--site", str(SITES / f"{site}.yaml")] if site else []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS / "faults")]),
            "PHALANX_STATE": str(tmp / "state"),
            **(extra_env or {}),
        }
        self.db = RunDB(tmp / "state")
        self.proc: subprocess.Popen | None = None
        self.log = None

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*PHALANX, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        self.log = open(self.tmp / "driver.log", "w")
        self.proc = subprocess.Popen(
            [*PHALANX, "run", str(self.wf), *self.site, "--plain"],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def rank_pids(self) -> list[int]:
        files = sorted(self.dir.glob("rank-*.pid"))
        return [int(f.read_text()) for f in files] if len(files) == 2 else []

    @property
    def run_id(self) -> str:
        return self.db.runs()[0]["id"]

    def records(self, run_id: str) -> list[dict]:
        """Every allocation the run recorded (this read does not free a lost run's)."""
        return [a["record"] for a in self.db.allocations(run_id, live=False)]

    def cleanup(self) -> None:
        """Whatever a failed test left: the driver, live allocations, ranks (by PID)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.log is not None:
            self.log.close()
        from phalanx.executors import release

        runs = self.db.runs()
        for a in self.db.allocations(runs[0]["id"]) if runs else []:
            release(a["record"])
        for pid in self.rank_pids():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if runs:
            px.Store(session=runs[0]["session"]).delete_session()


def kill_driver_then_resume(run: Run, fault, left=None) -> str:
    """The fault and every check; ``left()``: what the resource manager still runs of the run."""
    fault.describe("driver killed (SIGKILL)", backend=run.backend)
    run.start()
    pids = wait_for("every totals rank running", run.rank_pids, 180, poll=0.1)
    assert run.proc.poll() is None
    run_id = run.run_id  # read while the driver lives: a read of a lost run frees its leftovers
    t_kill = time.monotonic()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(timeout=10)
    run.go.touch()  # a rank that outlived its driver would seal "totals" now

    wait_for("the ranks to end", lambda: not any(pid_alive(p) for p in pids), WITHIN_S, poll=0.01)
    detect_s = time.monotonic() - t_kill
    fault.detected(detect_s)
    if left is not None:  # ended by themselves: no command needed
        assert run.records(run_id), "the driver recorded no allocation in the run DB"
        wait_for(
            "the run's jobs, steps, actors and groups to go",
            lambda: not left(run.records(run_id)),
            max(0.5, WITHIN_S - (time.monotonic() - t_kill)),
            poll=0.1,
        )
    gone_s = time.monotonic() - t_kill
    live = run.db.allocations(run_id)

    status = run.cli("status", run_id, timeout=120)
    assert status.returncode == 0 and f"run {run_id}: driverkill — lost" in status.stdout, status
    assert run.db.allocations(run_id) == [], "status left allocations of the lost run live"
    released = [e["message"] for e in run.db.events(run_id) if e["kind"] == "release"]
    assert len(released) == len(live) and all("already gone" in m for m in released), released
    session = run.db.run(run_id)["session"]
    store = px.Store(session=session)
    assert store.exists("tx") and not store.exists("totals"), "a rank sealed after its driver died"

    resumed = run.cli("run", str(run.wf), *run.site, "--plain", "--resume", run_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert run.db.allocations(run_id) == [], "the resumed run ended holding allocations"
    if left is not None:
        wait_for("the resumed run's allocations to end", lambda: not left(run.records(run_id)), 10, poll=0.1)
    reused = [e["stage"] for e in run.db.events(run_id) if e["kind"] == "reused"]
    assert reused == ["gen"], reused
    got = store.read("totals").to_pandas()
    assert dict(zip(got["user"].tolist(), got["amount"].tolist())) == expected_totals()
    ended = f", {run.backend}'s allocations {gone_s:.1f} s" if left is not None else ""
    fault.outcome(f"ranks gone {detect_s:.2f} s after the kill{ended}; run lost, resumed reusing gen: right totals")
    fault.data_lost("none")
    return run_id


# ---- the tests -------------------------------------------------------------------------------------
def test_driver_killed_local(tmp_path, fault):
    run = Run(tmp_path, None, "local")
    try:
        kill_driver_then_resume(run, fault)
    finally:
        run.cleanup()


@pytest.mark.slurm
@pytest.mark.parametrize("site,backend", [("slurm-local", "slurm-per-stage"), ("slurm-pilot-local", "slurm-pilot")])
def test_driver_killed_slurm(slurm_cluster, tmp_path, fault, site, backend):
    run = Run(tmp_path, site, backend)
    try:
        run_id = kill_driver_then_resume(
            run, fault, lambda records: slurm_left(slurm_cluster, {r["id"] for r in records})
        )
        kinds = sorted({r["kind"] for r in run.records(run_id)})
        assert kinds == (["pilot", "step"] if backend == "slurm-pilot" else ["job"]), kinds
    finally:
        run.cleanup()


@pytest.mark.slurm
def test_status_of_a_lost_run_cancels_the_slurm_job_its_driver_left(slurm_cluster, tmp_path):
    """A command stage has no control connection: its job outlives the killed driver until the
    next ``phalanx status`` of the run finds the job in the run DB and cancels it."""
    run = Run(tmp_path, "slurm-local", "slurm-per-stage")
    run.wf.write_text(
        "name: leftover\nstages:\n  hold:\n    kind: command\n    command: [sleep, '600']\n    ranks: 2\n"
    )
    try:
        run.start()
        run_id = wait_for("the run", lambda: run.db.runs() and run.run_id, 60, poll=0.1)
        names = wait_for(
            "the job's record", lambda: {r["id"] for r in run.records(run_id) if r.get("job")}, 120, poll=0.1
        )
        wait_for("the job to run", lambda: slurm_left(slurm_cluster, names), 60, poll=0.2)
        run.proc.kill()
        run.proc.wait(timeout=10)
        assert slurm_left(slurm_cluster, names), "the job ended with the driver: nothing to test"
        status = run.cli("status", run_id, timeout=120)
        assert "leftover — lost" in status.stdout, status
        released = [e["message"] for e in run.db.events(run_id) if e["kind"] == "release"]
        assert len(released) == 1 and released[0].startswith("left by the driver: slurm: scancel job "), released
        wait_for("scancel to end the job", lambda: not slurm_left(slurm_cluster, names), 30, poll=0.2)
    finally:
        run.cleanup()


@pytest.mark.ray
def test_driver_killed_ray(ray_cluster, tmp_path, fault):
    run = Run(tmp_path, "ray-local", "ray", {"RAY_ADDRESS": ray_cluster.address})
    try:
        run_id = kill_driver_then_resume(run, fault, ray_left)
        assert {r["kind"] for r in run.records(run_id)} == {"placement_group"}
    finally:
        run.cleanup()


@pytest.mark.parametrize(
    "site",
    [pytest.param("slurm-pilot-local", marks=pytest.mark.slurm), pytest.param("ray-local", marks=pytest.mark.ray)],
)
def test_a_cancelled_driver_frees_every_allocation_itself(request, tmp_path, site):
    """``phalanx cancel`` (SIGTERM: the driver's KeyboardInterrupt path): the driver releases its
    job steps and pilot, or placement groups, before it exits — nothing is left for the next
    ``phalanx status`` to free (it would say so with "release" events)."""
    if site.startswith("slurm"):
        conf = request.getfixturevalue("slurm_cluster")
        run = Run(tmp_path, site, site)
        left = lambda records: slurm_left(conf, {r["id"] for r in records})  # noqa: E731
    else:
        cluster = request.getfixturevalue("ray_cluster")
        run = Run(tmp_path, site, site, {"RAY_ADDRESS": cluster.address})
        left = ray_left
    try:
        run.start()
        pids = wait_for("every totals rank running", run.rank_pids, 180, poll=0.1)
        run_id = run.run_id
        out = run.cli("cancel", run_id, timeout=120)
        assert out.returncode == 0 and run.proc.wait(timeout=60) == 130, out
        assert not any(pid_alive(p) for p in pids)
        assert run.records(run_id) and run.db.allocations(run_id) == []
        assert [e for e in run.db.events(run_id) if e["kind"] == "release"] == []
        wait_for("SLURM or Ray to finish ending them", lambda: not left(run.records(run_id)), 10, poll=0.1)
    finally:
        run.cleanup()


# ---- the heartbeat alone: no parent-death signal reaches a grandchild rank -------------------------
def test_the_heartbeat_alone_ends_grandchild_ranks_of_a_killed_driver(tmp_path, fault):
    """Ranks started through a shell (the driver's grandchildren) with PDEATHSIG off, each with
    a child of its own: the driver's SIGKILL ends ranks and children through the heartbeat
    connection alone."""
    fault.describe("driver killed (SIGKILL), ranks out of PDEATHSIG's reach", backend="local")
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / "faults")!r}]
        import phalanx as px
        from phalanx.executors.local import LocalLauncher
        from test_driver_death import spawn_child_and_wait

        class ThroughAShell(LocalLauncher):
            def launch(self, argv, rank_env, log_dir):
                argv = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]
                super().launch(argv, [{{**e, "PHALANX_PDEATHSIG": "0"}} for e in rank_env], log_dir)

        with px.Gang(2, executor=ThroughAShell(echo=False), echo=False) as g:
            g.run(spawn_child_and_wait, {str(tmp_path)!r})
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = wait_for("ranks and their children", lambda: _pids(tmp_path), 120, poll=0.05)
        for rank, child in pids:
            assert _parent(_parent(rank)) == proc.pid and _parent(child) == rank
        t_kill = time.monotonic()
        proc.kill()
        proc.wait(timeout=10)
        everything = [p for pair in pids for p in pair]
        wait_for("ranks and children to end", lambda: not any(pid_alive(p) for p in everything), WITHIN_S, 0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [p for pair in _pids(tmp_path) for p in pair]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    fault.detected(time.monotonic() - t_kill)
    fault.outcome("ranks and their children ended by the heartbeat connection alone")
    fault.data_lost("none")


def spawn_child_and_wait(env, out: str) -> None:
    child = subprocess.Popen(["sleep", "600"])
    write_whole(Path(out, f"rank-{env.rank}.pids"), f"{os.getpid()} {child.pid}")
    while True:
        time.sleep(0.1)


def _pids(tmp: Path) -> list[tuple[int, int]]:
    files = sorted(tmp.glob("rank-*.pids"))
    return [tuple(map(int, f.read_text().split())) for f in files] if len(files) == 2 else []


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])
