"""``JobWatcher``: one ``squeue`` per poll for every SLURM job an executor watches (issue 26:
be kind to slurmctld — many gangs and array tasks, one query).

SLURM here is a stand-in (``CountingSlurm``) that answers ``squeue`` and ``sacct`` as the real
commands print them and counts each call: what is under test is how many calls the watcher
makes and what it asks for, which a real cluster cannot count for us (its other clients poll
too).  That arrays really go as one array job and are watched end to end on a real cluster is
tests/test_slurm_arrays.py's (marked slurm)."""

from __future__ import annotations

import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from phalanx.executors.slurm import commands
from phalanx.executors.slurm.commands import JobWatcher, SlurmCommands

POLL = 2.0  # seconds: a launcher's poll interval


class CountingSlurm(SlurmCommands):
    """SLURM's commands answered from ``jobs`` (job or array task → state); a job not in
    ``jobs`` but in ``finished`` has aged out of squeue and only sacct knows it."""

    def __init__(self, jobs: dict[str, str], finished: dict[str, str] | None = None, down: bool = False):
        super().__init__()
        self.jobs_state, self.finished, self.down = jobs, finished or {}, down
        self.asked: list[tuple[str, list[str]]] = []  # (command, the job ids it was asked for)

    def run(self, name, *args, env=None, timeout=60.0, stdin=None) -> subprocess.CompletedProcess:
        with self._count:
            self.calls[name] += 1
        ids = args[args.index("-j") + 1].split(",")
        self.asked.append((name, ids))
        if self.down:
            return subprocess.CompletedProcess(
                [name], 1, "", "slurm_load_jobs error: Unable to contact slurm controller"
            )
        if name == "squeue":  # -O JobArrayID:|,State:|,Reason:|,NodeList:|,exit_code:|,Partition:|
            lines = [f"{j}|{self.jobs_state[j]}|None|node{j[-1]}|0|debug|" for j in ids if j in self.jobs_state]
        else:  # sacct -X -n -P -o JobID,State,ExitCode,Reason,NodeList,Partition
            lines = [f"{j}|{self.finished[j]}|0:0|None|node1|debug" for j in ids if j in self.finished]
        return subprocess.CompletedProcess([name], 0, "\n".join(lines) + "\n", "")


@pytest.fixture
def clock(monkeypatch):
    """The watcher's clock, moved by the test (no sleeping): ``clock.now += POLL``."""
    fake = SimpleNamespace(now=1000.0, sleep=time.sleep)
    fake.monotonic = lambda: fake.now
    monkeypatch.setattr(commands, "time", fake)
    return fake


# 10 jobs of one gang each and an array of 40 one-rank instances (its tasks A_i, as sbatch --array makes)
JOBS = {**{str(100 + i): "RUNNING" for i in range(10)}, **{f"200_{i}": "PENDING" for i in range(40)}}


def poll_all(watcher: JobWatcher, ids: list[str]) -> dict[str, str]:
    """Every launcher asks for its job's state at once (one thread each, as gangs do)."""
    got: dict[str, str] = {}
    start = threading.Barrier(len(ids))

    def launcher(job: str) -> None:
        start.wait()
        got[job] = watcher.info(job, POLL).state

    threads = [threading.Thread(target=launcher, args=(j,)) for j in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return got


def test_one_squeue_per_poll_serves_every_watched_job_and_array_task(clock):
    slurm = CountingSlurm(dict(JOBS))
    watcher = JobWatcher(slurm)
    for job in JOBS:
        watcher.watch(job)
    assert poll_all(watcher, list(JOBS)) == JOBS  # each launcher gets its own job's state
    assert slurm.calls == {"squeue": 1}  # 50 launchers, one squeue
    assert sorted(slurm.asked[0][1]) == sorted(JOBS)  # asked for all of them at once
    clock.now += POLL / 2  # within the interval: the last answer serves
    assert poll_all(watcher, list(JOBS)) == JOBS and slurm.calls == {"squeue": 1}
    slurm.jobs_state.update({j: "COMPLETED" for j in JOBS if j.startswith("200_")})
    clock.now += POLL  # the next interval: one squeue again, and what it says now
    assert poll_all(watcher, list(JOBS)) == {j: "COMPLETED" if j.startswith("200_") else s for j, s in JOBS.items()}
    assert slurm.calls == {"squeue": 2}
    assert watcher.info("100", 0.0).state == "RUNNING" and slurm.calls == {"squeue": 3}  # 0: ask now


def test_a_forgotten_job_is_no_longer_asked_for_unless_another_launcher_still_watches_it(clock):
    slurm = CountingSlurm(dict(JOBS))
    watcher = JobWatcher(slurm)
    for job in JOBS:
        watcher.watch(job)
    watcher.watch("100")  # two launchers watch job 100 (a gang and its retry's, say)
    for job in [j for j in JOBS if not j.startswith("200_")]:
        watcher.forget(job)
    assert watcher.info("200_0", 0.0).state == "PENDING"
    assert sorted(slurm.asked[-1][1]) == sorted(["100", *[f"200_{i}" for i in range(40)]])
    watcher.forget("100")
    watcher.info("200_0", 0.0)
    assert sorted(slurm.asked[-1][1]) == sorted(f"200_{i}" for i in range(40))
    assert slurm.calls == {"squeue": 2}


def test_jobs_that_left_squeue_are_asked_of_sacct_in_one_call(clock):
    """Finished jobs age out of squeue (MinJobAge): the accounting answers for all of them at once."""
    running = {j: s for j, s in JOBS.items() if not j.startswith("200_")}
    done = {f"200_{i}": "FAILED" if i == 7 else "COMPLETED" for i in range(40)}
    slurm = CountingSlurm(running, finished=done)
    watcher = JobWatcher(slurm)
    for job in JOBS:
        watcher.watch(job)
    assert poll_all(watcher, list(JOBS)) == {**running, **done}
    assert slurm.calls == {"squeue": 1, "sacct": 1}
    assert sorted(slurm.asked[1][1]) == sorted(done)  # sacct: only those squeue no longer lists


def test_an_unreachable_controller_makes_every_watched_job_unknown_from_one_call(clock):
    slurm = CountingSlurm(dict(JOBS), down=True)
    watcher = JobWatcher(slurm)
    for job in JOBS:
        watcher.watch(job)
    infos = {j: watcher.info(j, POLL) for j in JOBS}
    assert {i.state for i in infos.values()} == {"UNKNOWN"}
    assert infos["200_3"].reason == "slurm_load_jobs error: Unable to contact slurm controller"
    assert slurm.calls == {"squeue": 1}  # the others read that answer: no storm of retries
