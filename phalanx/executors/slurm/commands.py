"""Talking to SLURM: its commands (``squeue``, ``sacct``, ``sbatch``, ``scancel``...), what they
report (``JobInfo``), and freeing a recorded allocation from any process (``release``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import GangError, MissingDependencyError
from ...runtime import protocol as P

ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)
FAILED = frozenset(
    {
        "FAILED",
        "NODE_FAIL",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "CANCELLED",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
# PENDING reasons that no amount of waiting resolves
HOPELESS = {
    "PartitionConfig": "the job's request does not fit the configuration of partition {partition!r}",
    "PartitionNodeLimit": "the job asks for more nodes than partition {partition!r} allows or has",
    "PartitionTimeLimit": "the job's time limit exceeds partition {partition!r}'s MaxTime",
    "PartitionInactive": "partition {partition!r} is inactive",
    "BadConstraints": "no node can satisfy the job's constraints",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "AccountNotAllowed": "the account may not use partition {partition!r}",
    "QOSNotAllowed": "the QOS may not use partition {partition!r}",
    "DependencyNeverSatisfied": "a dependency can never be satisfied",
    "InvalidPartition": "partition {partition!r} does not exist",
}


@dataclass
class JobInfo:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, ... ; GONE: no longer known
    reason: str = ""  # SLURM's reason ("Resources", "PartitionNodeLimit", "None")
    nodes: str = ""
    exit_status: int | None = None  # raw wait status (squeue) or None
    partition: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self) -> str:
        text = f"job {self.job_id} {self.state}"
        if self.reason and self.reason != "None":
            text += f" ({self.reason})"
        if self.state == "RUNNING" and self.nodes:
            text += f" on {self.nodes}"
        return text


class SlurmCommands:
    """SLURM's command-line tools, run with one environment (``SLURM_CONF`` for a private cluster)."""

    def __init__(self, conf: str | None = None):
        self.conf = os.path.expandvars(os.path.expanduser(conf)) if conf else None
        self.calls: Counter[str] = Counter()  # commands run, by name (sbatch: 3, squeue: 40...)
        self._count = threading.Lock()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The driver's environment without its own SLURM job's variables (the driver may run
        inside a job: its SLURM_JOB_ID, SLURM_NTASKS... would steer sbatch and srun)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not (k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF")
        }
        env.pop(P.ENV_RANK, None)
        if self.conf:
            env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    def exe(self, name: str) -> str:
        path = shutil.which(name)
        if path is None:
            raise MissingDependencyError(
                f"executor 'slurm' needs {name!r} on PATH (SLURM's client commands; Debian: scripts/setup-slurm.sh)"
            )
        return path

    def run(
        self,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess:
        with self._count:
            self.calls[name] += 1
        return subprocess.run(
            [self.exe(name), *args], env=env or self.env(), input=stdin, capture_output=True, text=True, timeout=timeout
        )

    def job(self, job_id: str) -> JobInfo:
        """The job (or array task ``A_i``) as the controller sees it; after it aged out
        (MinJobAge), as sacct does."""
        return self.jobs([job_id])[job_id]

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """Several jobs and array tasks (``123``, ``124_7``) with one ``squeue`` (one ``sacct``
        for those it no longer lists): ``JobWatcher`` asks for all of an executor's at once."""
        ids = list(dict.fromkeys(job_ids))
        fields = "JobArrayID:|,State:|,Reason:|,NodeList:|,exit_code:|,Partition:|"  # JobID: an array's, not its task's
        try:
            r = self.run("squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids), "-O", fields, timeout=30)
        except subprocess.TimeoutExpired:
            return {j: JobInfo(j, "UNKNOWN", "squeue timed out") for j in ids}
        found: dict[str, JobInfo] = {}
        if r.returncode == 0:
            wanted = set(ids)
            for line in r.stdout.splitlines():
                parts = line.split("|")
                job = parts[0].strip()
                if len(parts) >= 6 and job in wanted:
                    code = parts[4].strip()
                    found[job] = JobInfo(
                        job,
                        parts[1].strip(),
                        parts[2].strip(),
                        parts[3].strip(),
                        int(code) if code.lstrip("-").isdigit() else None,
                        parts[5].strip(),
                    )
        elif "Invalid job id" not in r.stderr:  # the controller did not answer: nothing is known
            why = (r.stderr.strip().splitlines() or ["squeue failed"])[-1]
            return {j: JobInfo(j, "UNKNOWN", why) for j in ids}
        missing = [j for j in ids if j not in found]  # aged out (or, all of them, an invalid id)
        if missing:
            found.update(self._from_sacct(missing))
        return {j: found[j] for j in ids}

    def _from_sacct(self, job_ids: Sequence[str]) -> dict[str, JobInfo]:
        gone = {j: JobInfo(j, "GONE") for j in job_ids}  # neither squeue nor accounting knows them
        try:
            r = self.run(
                "sacct",
                "-X",
                "-n",
                "-P",
                "-j",
                ",".join(job_ids),
                "-o",
                "JobID,State,ExitCode,Reason,NodeList,Partition",
                timeout=30,
            )
        except (subprocess.TimeoutExpired, MissingDependencyError):
            return gone
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            parts = line.split("|")
            if len(parts) >= 6 and parts[0] in gone:
                code, _, sig = parts[2].partition(":")
                status = (
                    (int(sig) & 0x7F) if sig.isdigit() and int(sig) else (int(code) << 8 if code.isdigit() else None)
                )
                gone[parts[0]] = JobInfo(parts[0], parts[1].split()[0], parts[3], parts[4], status, parts[5])
        return gone

    def jobs_named(self, name: str) -> list[str]:
        """Active jobs called ``name`` (every task of an array: ``A_i``); an unreachable
        controller raises GangError."""
        r = self.run("squeue", "-h", "-r", "-n", name, "-o", "%i", timeout=30)
        if r.returncode != 0:
            raise GangError(f"slurm: squeue failed: {r.stderr.strip() or r.returncode}")
        return r.stdout.split()

    def step_ids(self, job_id: str, name: str) -> list[str]:
        r = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j", timeout=30)
        return (
            [line.split("|")[0] for line in r.stdout.splitlines() if line.split("|")[-1] == name]
            if r.returncode == 0
            else []
        )

    def partitions(self) -> list[str]:
        try:
            r = self.run("sinfo", "-h", "-o", "%R", timeout=30)
        except (subprocess.TimeoutExpired, MissingDependencyError):
            return []
        return sorted(set(r.stdout.split())) if r.returncode == 0 else []

    def submit(self, args: Sequence[str], env: Mapping[str, str], site: str, script: str | None = None) -> str:
        """``sbatch --parsable``; a rejected job raises GangError with sbatch's own words."""
        r = self.run("sbatch", "--parsable", *args, env=env, stdin=script)
        if r.returncode != 0:
            raise GangError(f"slurm: sbatch rejected the job{_site(site)}: {self._explain(r.stderr)}")
        return r.stdout.strip().split(";")[0]

    def _explain(self, stderr: str) -> str:
        lines = [re.sub(r"^sbatch: error: ", "", l).strip() for l in stderr.splitlines() if l.strip()]
        text = "; ".join(lines) or "no message"
        m = re.search(r"invalid partition specified: (\S+)", stderr)
        if m:
            known = self.partitions()
            text = (
                f"partition {m.group(1)!r} does not exist"
                + (f" (partitions: {', '.join(known)})" if known else "")
                + f" — sbatch: {text}"
            )
        return text

    def cancel(self, target: str, sig: str | None = None) -> None:
        args = (["--signal", sig, "--full"] if sig else []) + [target]
        try:
            self.run("scancel", *args, timeout=15)
        except subprocess.TimeoutExpired:
            pass


class JobWatcher:
    """SLURM's view of every live job of an executor, from one ``squeue`` for all of them (be
    kind to slurmctld): a launcher asking for its job's state gets the last answer while it is
    fresh, else asks anew — for every job watched.  N gangs polling every ``poll_interval``
    cost one squeue per interval, not N."""

    def __init__(self, slurm: SlurmCommands):
        self.slurm = slurm
        self._lock = threading.Lock()
        self._watched: dict[str, int] = {}  # job or array task → launchers watching it
        self._info: dict[str, JobInfo] = {}
        self._polled = 0.0  # monotonic time of the last squeue

    def watch(self, job_id: str) -> None:
        with self._lock:
            self._watched[job_id] = self._watched.get(job_id, 0) + 1

    def forget(self, job_id: str) -> None:
        with self._lock:
            left = self._watched.pop(job_id, 0) - 1
            if left > 0:
                self._watched[job_id] = left
            else:
                self._info.pop(job_id, None)

    def info(self, job_id: str, max_age: float) -> JobInfo:
        """``job_id``'s state no older than ``max_age`` seconds (0: ask now)."""
        with self._lock:
            known = self._info.get(job_id)
            if known is None or time.monotonic() - self._polled >= max_age:
                ids = [*self._watched, job_id] if job_id not in self._watched else list(self._watched)
                answers = self.slurm.jobs(ids)
                self._polled = time.monotonic()
                self._info = {j: i for j, i in answers.items() if j in self._watched}
                known = answers[job_id]
            return known


def allocation(kind: str, name: str, slurm: SlurmCommands, job: str | None = None) -> dict:
    """The record of a job, pilot or step (``base.held``): named before SLURM knows it, so
    ``release`` finds it by name even when the driver died before it learnt the job id."""
    return {"executor": "slurm", "kind": kind, "id": name, "job": job, "conf": slurm.conf}


def release(record: dict) -> str:
    """scancel an allocation recorded by ``allocation`` (from any process on a submit host);
    a gang that is one task of an array job (``array``: the array's job name, ``task``: its
    index) is found by the array's name and only its task is cancelled."""
    slurm = SlurmCommands(record.get("conf"))
    kind, name = record.get("kind", "job"), record["id"]
    if kind == "step":  # a step of a pilot: gone with it
        info = slurm.job(record["job"])
        if info.state == "UNKNOWN":
            raise GangError(f"slurm: cannot tell whether pilot job {record['job']} lives: {info.reason}")
        targets = slurm.step_ids(record["job"], name) if info.active else []
    elif record.get("array"):  # one task of an array job: that task only
        task = f"_{record['task']}"
        targets = [j for j in slurm.jobs_named(record["array"]) if j.endswith(task)]
    else:
        targets = slurm.jobs_named(name)
    for target in targets:
        slurm.cancel(target)
    if not targets:
        return f"slurm: {kind} {name} already gone"
    return f"slurm: scancel {kind} {', '.join(targets)} ({name})"


def _site(site: str) -> str:
    return f" (site {site!r})" if site and site != "slurm" else ""


def _option_args(options: Mapping[str, Any]) -> list[str]:
    out = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        out.append(f"--{key}" if value is True else f"--{key}={value}")
    return out


def _does_not_fit(ranks: int, ntasks: int, site: str) -> str:
    return (
        f"slurm: a gang of {ranks} ranks does not fit the pilot's {ntasks} tasks{_site(site)}: raise slurm.pilot.ntasks"
    )


def _hopeless(info: JobInfo, site: str, what: str = "") -> str:
    hint = HOPELESS.get(info.reason, "").format(partition=info.partition or "?")
    return f"slurm: {what}job {info.job_id} PENDING ({info.reason}): {hint}{_site(site)}"


def _wait_inactive(
    slurm: SlurmCommands, job: str, within_s: float, look: Callable[[str, float], JobInfo] | None = None
) -> JobInfo:
    """The job once it ended, or as it is after ``within_s``; ``look(job, max_age)``: where its
    state comes from (a ``JobWatcher``'s, shared by gangs that stop together), default squeue."""
    deadline = time.monotonic() + within_s
    wait = 0.05
    while True:
        info = look(job, wait) if look is not None else slurm.job(job)
        if not info.active or time.monotonic() > deadline:
            return info
        time.sleep(wait)
        wait = min(wait * 1.5, 0.5)
