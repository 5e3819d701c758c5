"""A gang's ranks as the tasks of one ``srun``: ``SlurmJobLauncher`` (a batch job of its own,
``allocation: per-stage``) and ``SlurmStepLauncher`` (a job step of a pilot), on what they share
(``SlurmLauncher``: the srun, exit codes, SLURM's view, the echo of the ranks' logs)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ...errors import GangError
from ...procs import signal_group
from ...runtime import protocol as P
from ...runtime.envvars import ENV_STORE, ENV_STORE_SERVICE_KEY
from .. import exit_files
from ..base import Echo, Launcher, held, released, shared_env
from ..logs import FileFollower
from ..network import is_loopback
from .arrays import ArrayBatcher, ArrayRequest
from .commands import (
    FAILED,
    HOPELESS,
    JobInfo,
    JobWatcher,
    SlurmCommands,
    _does_not_fit,
    _hopeless,
    _option_args,
    _site,
    _wait_inactive,
    allocation,
)
from .config import STEP_OPTIONS
from .pilot import STORE_ENV, SlurmPilot, route_from

# How a rank whose wrapper never wrote an exit code ended, by the job's final state.
_STATE_SIGNAL = {
    "CANCELLED": signal.SIGTERM,
    "TIMEOUT": signal.SIGTERM,
    "PREEMPTED": signal.SIGTERM,
    "DEADLINE": signal.SIGTERM,
    "NODE_FAIL": signal.SIGKILL,
    "OUT_OF_MEMORY": signal.SIGKILL,
    "BOOT_FAIL": signal.SIGKILL,
}

# Why ranks ended, by their job's final state (Launcher.end_cause: what retry policies read)
_STATE_CAUSE = {
    "OUT_OF_MEMORY": "oom",
    "NODE_FAIL": "node_lost",
    "BOOT_FAIL": "node_lost",
    "PREEMPTED": "preempted",
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
}

# Runs each rank: exports the rank for programs that read PHALANX_RANK, records the exit code
# where the driver can read it (srun reports only the largest one).
_WRAPPER = (
    'd=$1; shift; PHALANX_RANK=$SLURM_PROCID; export PHALANX_RANK; "$@"; rc=$?; '
    + exit_files.record("$d", "$SLURM_PROCID")
    + "; exit $rc"
)


def _code_from_status(status: int) -> int:
    """A raw wait status (SLURM's exit_code) as a Popen-style return code."""
    if status & 0x7F:
        return -(status & 0x7F)
    return status >> 8


class SlurmLauncher(Launcher):
    """What the launchers of per-stage jobs and of pilot steps share: one ``srun`` of the
    gang's ranks (log and exit-code files in ``log_dir``), reading exit codes, SLURM's word on
    a failure, the echo of the ranks' logs.  ``SlurmExecutor.launcher`` picks the subclass.

    Ranks write their logs through srun's ``--output``, fixed at launch: ``redirect`` stays
    False (SLURM gangs are not reused).
    """

    name = "slurm"

    def __init__(
        self,
        echo: Echo = False,
        *,
        slurm: SlurmCommands,
        site: str = "slurm",
        options: Mapping[str, Any] | None = None,
        cpus_per_rank: int = 1,
        mpi: str | None = None,
        srun_args: Sequence[str] = (),
        poll_interval: float = 0.5,
        pending_timeout: float | None = None,
        job_name: str = "phalanx",
    ):
        """``options``: sbatch/srun options (``{"time": "1:00:00", "spread-job": True}``, as
        ``SlurmConfig.options``) for this gang."""
        self.echo = echo
        self.slurm = slurm
        self.site = site
        self.options = dict(options or {})
        self.cpus_per_rank = int(cpus_per_rank)
        self.mpi = mpi
        self.srun_args = list(srun_args)
        self.poll_interval = poll_interval
        self.pending_timeout = pending_timeout
        self.job_name = job_name
        self._lock = threading.RLock()
        self._follower: FileFollower | None = None
        self._reset(None, 0)

    @classmethod
    def from_site(
        cls,
        slurm_section: Mapping[str, Any] | None,
        ranks: int,
        *,
        site: str = "slurm",
        echo: Echo = False,
        pilot: SlurmPilot | None = None,
        **overrides: Any,
    ) -> SlurmLauncher:
        """The launcher ``SlurmExecutor(slurm_section).launcher(ranks)`` makes, ``overrides``
        (a stage's keys: ``time``, ``nodes``...) over the section.  Pilot mode needs ``pilot``:
        a run's own pilot belongs to its ``SlurmExecutor``, which closes it."""
        from .executor import SlurmExecutor

        executor = SlurmExecutor(slurm_section, site=site, pilot=pilot)
        config = executor.stage_config(overrides)
        if config.allocation == "pilot" and pilot is None:
            raise ValueError(
                "SlurmLauncher.from_site in pilot mode needs pilot= (or use SlurmExecutor, whose run owns its pilot)"
            )
        return executor.launcher(ranks, config=config, echo=echo)

    # ---- state ----------------------------------------------------------------------------
    def _reset(self, log_dir: Path | None, world_size: int) -> None:
        self.log_dir = log_dir
        self.world_size = world_size
        self.job_id: str | None = None  # per-stage: the gang's job; pilot: the pilot's job
        self.step_name = ""
        self.info: JobInfo | None = None
        self._codes: list[int | None] = [None] * world_size
        self._last_poll = 0.0
        self._submitted = 0.0
        self._failed: str | None = None  # SLURM's reason once the job failed
        self._failed_state = ""  # the failed job's state (NODE_FAIL, PREEMPTED...)
        self._raised = False
        self._killing = False
        self._allocation: dict | None = None  # this gang's job or step (base.held)

    @property
    def _logs(self) -> Path:
        """``log_dir`` of the launched gang (everything that reads it runs after ``launch``)."""
        assert self.log_dir is not None, "the gang was not launched"
        return self.log_dir

    def placement(self, world_size: int) -> list[dict[str, str]]:
        # SLURM places and binds the ranks; phalanx only sizes their thread pools
        return [{P.ENV_THREADS: str(self.cpus_per_rank)} for _ in range(world_size)]

    # ---- launch ---------------------------------------------------------------------------
    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        with self._lock:
            self._stop_follower()
            log_dir = Path(log_dir).absolute()
            self._reset(log_dir, len(rank_env))
            log_dir.mkdir(parents=True, exist_ok=True)
            exit_files.clear(log_dir)  # a gang restarted in the same dir
            common = _common_env(rank_env)
            common["PYTHONUNBUFFERED"] = "1"
            gang = common.get(P.ENV_GANG_ID) or f"{os.getpid()}-{time.time_ns()}"
            self.step_name = f"{self.job_name}-{gang}"
            env = self.slurm.env(common)
            self._submitted = time.monotonic()
            self._start(argv, env)
            if self.echo:
                self._follower = FileFollower(
                    [log_dir / f"rank-{r}.log" for r in range(self.world_size)],
                    self.echo,
                    name="phalanx-slurm-logs",
                )

    @abstractmethod
    def _start(self, argv: Sequence[str], env: dict[str, str]) -> None:
        """Submit the gang's srun (``self._lock`` held)."""

    def _srun_options(self) -> list[str]:
        out = [
            f"--ntasks={self.world_size}",
            f"--cpus-per-task={self.cpus_per_rank}",
            "--kill-on-bad-exit=0",  # phalanx fails the gang fast itself, with tracebacks
            f"--output={_pct(self._logs)}/rank-%t.log",
            "--open-mode=append",
            "--input=none",
        ]
        if self.mpi:
            out.append(f"--mpi={self.mpi}")
        return out

    def _rank_command(self, argv: Sequence[str]) -> list[str]:
        return ["/bin/sh", "-c", _WRAPPER, "phalanx-rank", str(self.log_dir), *argv]

    def _hold(self, record: dict) -> None:
        self._allocation = record
        held(self.allocation_hook, record)

    def _let_go(self) -> None:
        record, self._allocation = self._allocation, None
        if record is not None:
            released(self.allocation_hook, record)

    # ---- state and exit codes -------------------------------------------------------------
    def exitcodes(self) -> list[int | None]:
        with self._lock:
            if self.world_size == 0:
                return []
            before = list(self._codes)
            self._read_exit_files()
            if any(c is not None and c < 0 and before[r] is None for r, c in enumerate(self._codes)):
                self._rank_killed()
            if all(c is not None for c in self._codes):
                return list(self._codes)
            self._check()
            return list(self._codes)

    def _rank_killed(self) -> None:
        """A rank died of a signal (its exit file says so)."""

    @abstractmethod
    def _check(self) -> None:
        """Ranks without an exit code yet: settle them if their job or step ended."""

    def _read_exit_files(self) -> None:
        for r, code in enumerate(self._codes):
            if code is None:
                self._codes[r] = exit_files.read(self._logs, r)

    def _poll(self, force: bool = False) -> JobInfo | None:
        if self.job_id is None:
            return None
        now = time.monotonic()
        if force or self.info is None or now - self._last_poll >= self.poll_interval:
            self.info = self.slurm.job(self.job_id)
            self._last_poll = now
        return self.info

    def _settle(self, info: JobInfo | None, state: str, status: int | None, code: int | None = None) -> None:
        """The job (or step) ended: ranks that wrote no exit code get one from its state."""
        if code is None:
            if state in _STATE_SIGNAL:
                code = -int(_STATE_SIGNAL[state])
            elif status:
                code = _code_from_status(status) or 1
            else:
                code = 0 if state == "COMPLETED" else 1
        if state in FAILED:
            self._note_failure(info or JobInfo(self.job_id or "?", state))
        for r, c in enumerate(self._codes):
            if c is None:
                self._codes[r] = code

    def _note_failure(self, info: JobInfo) -> None:
        """Remember SLURM's word on a failed job for ``reason()``, and put it at the end of the
        logs of the ranks it ended: the gang shows a failed rank's log tail."""
        if self._failed is not None or self._killing:
            return
        self._failed = f"slurm: {info.describe()}{_site(self.site)}"
        self._failed_state = info.state
        for r, c in enumerate(self._codes):
            if c is None or c < 0:
                try:
                    with open(self._logs / f"rank-{r}.log", "a") as f:
                        f.write(f"[phalanx] {self._failed}\n")
                except OSError:
                    pass

    def _raise(self, message: str) -> None:
        self._raised = True
        self._failed = message
        raise GangError(message)

    def status(self) -> str:
        """SLURM's view of this gang: ``slurm: job 42 PENDING (Resources)``, ``slurm: step
        42.3 RUNNING (pilot job 42 on n[1-3])``..."""
        with self._lock:
            if self.job_id is None:
                return "slurm: not launched"
            info = self._poll(force=True)
            assert info is not None  # _poll polls SLURM whenever there is a job
            return self._status(info)

    @abstractmethod
    def _status(self, info: JobInfo) -> str: ...

    def reason(self) -> str | None:
        """Why the gang failed, in SLURM's words (``slurm: job 42 TIMEOUT``), or None."""
        with self._lock:
            return self._failed

    def memory_note(self, rank: int) -> str:
        """SLURM ended the job for its memory (OUT_OF_MEMORY: over --mem or --mem-per-cpu)."""
        with self._lock:
            failed = self._failed or ""
        return f" — out of memory ({failed})" if "OUT_OF_MEMORY" in failed else ""

    def end_cause(self, rank: int) -> str | None:
        """From the job's final state: OUT_OF_MEMORY, NODE_FAIL, PREEMPTED, TIMEOUT..."""
        with self._lock:
            return _STATE_CAUSE.get(self._failed_state)

    # ---- stopping -------------------------------------------------------------------------
    def kill(self, grace_s: float = 2.0) -> None:
        with self._lock:
            job = self.job_id
            self._killing = True  # what follows is our doing, not a SLURM failure to report
        if job is not None:
            self._stop(job, grace_s)
        self._stop_follower()

    @abstractmethod
    def _stop(self, job: str, grace_s: float) -> None:
        """End the gang's job or step (SIGTERM, SIGKILL after ``grace_s``) and settle its ranks."""

    def _stop_follower(self) -> None:
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} job={self.job_id} site={self.site!r}>"


class SlurmJobLauncher(SlurmLauncher):
    """``allocation: per-stage``: the gang is a batch job of its own (``sbatch`` of a script whose
    ``srun`` starts the ranks) — or, one rank with ``arrays``, a task of a job array shared with
    the one-rank gangs that start with it (``arrays.ArrayBatcher``)."""

    def __init__(
        self,
        echo: Echo = False,
        *,
        prologue: Sequence[str] = (),
        sbatch_args: Sequence[str] = (),
        arrays: ArrayBatcher | None = None,
        watcher: JobWatcher | None = None,
        **common: Any,
    ):
        """``prologue``: shell lines before srun in the job's script; ``arrays``: the
        executor's batcher of one-rank gangs (None: every gang is a job of its own);
        ``watcher``: the executor's one squeue for all its jobs (None: this gang polls its
        own); ``common``: see ``SlurmLauncher``."""
        super().__init__(echo, **common)
        self.prologue = list(prologue)
        self.sbatch_args = list(sbatch_args)
        self.arrays = arrays
        self.watcher = watcher

    def _start(self, argv: Sequence[str], env: dict[str, str]) -> None:
        srun = [self.slurm.exe("srun"), *self._srun_options(), *self.srun_args, *self._rank_command(argv)]
        script = self._logs / "slurm-job.sh"
        script.write_text(
            "\n".join(
                [
                    "#!/bin/sh",
                    f"# phalanx gang {self.step_name}: {self.world_size} ranks (phalanx.executors.slurm)",
                    *self.prologue,
                    "exec " + " ".join(shlex.quote(a) for a in srun),
                    "",
                ]
            )
        )
        shared = [  # what every gang of one array shares
            "--open-mode=append",
            "--no-requeue",  # a lost node fails the stage: phalanx retries
            "--export=ALL",
            f"--ntasks={self.world_size}",
            f"--cpus-per-task={self.cpus_per_rank}",
            *_option_args(self.options),
            *self.sbatch_args,
        ]
        record = allocation("job", self.step_name, self.slurm)
        if self.arrays is not None and self.world_size == 1:
            request = ArrayRequest(
                (self.slurm.conf, *shared),
                shared,
                env,
                script,
                self._logs,
                lambda task: self._hold({**record, **task}),  # before sbatch: see base.held
            )
            try:
                self.job_id = self.arrays.join(request, self.site)
            except BaseException:
                self._let_go()
                raise
            if self.job_id is not None:
                record = {**record, "array": request.array, "task": request.task}
        if self.job_id is None:  # more than one rank, or the window held this gang only
            self._hold(record)  # before sbatch: see base.held
            try:
                self.job_id = self.slurm.submit(
                    [f"--job-name={self.step_name}", f"--output={_pct(self._logs)}/launcher.log", *shared, str(script)],
                    env,
                    self.site,
                )
            except BaseException:
                self._let_go()
                raise
        self._hold({**record, "job": self.job_id})
        if self.watcher is not None:
            self.watcher.watch(self.job_id)

    def _poll(self, force: bool = False) -> JobInfo | None:
        """SLURM's view of the job: the executor's watcher's (one squeue for all its jobs)."""
        if self.job_id is None or self.watcher is None:
            return super()._poll(force)
        self.info = self.watcher.info(self.job_id, 0.0 if force else self.poll_interval)
        return self.info

    def _let_go(self) -> None:
        if self.watcher is not None and self._allocation is not None and self._allocation.get("job"):
            self.watcher.forget(self._allocation["job"])
        super()._let_go()

    def _rank_killed(self) -> None:
        """Was it SLURM (scancel, time limit, node failure...)?"""
        if self._failed is not None or self._killing:
            return
        info = self._poll(force=True)
        if info is not None and info.state in (
            "COMPLETING",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "PREEMPTED",
            "DEADLINE",
        ):
            if info.active:  # ending: its final state comes within moments
                assert self.job_id is not None  # _poll found the job
                self.info = info = _wait_inactive(self.slurm, self.job_id, 1.0)
            if not info.active:
                self._note_failure(info)

    def _check(self) -> None:
        info = self._poll()
        if info is None:
            return
        if info.state == "PENDING" and not self._raised and not self._killing:
            waited = time.monotonic() - self._submitted
            if info.reason in HOPELESS:
                self._raise(_hopeless(info, self.site))
            if self.pending_timeout and waited > self.pending_timeout:
                self._raise(f"slurm: {info.describe()} for more than {self.pending_timeout:.0f} s{_site(self.site)}")
        if info.active or info.state == "UNKNOWN":
            return
        # the job ended: ranks without an exit file never ran, or were killed with the job
        self._settle(info, info.state, info.exit_status)

    def _raise(self, message: str) -> None:
        if self.job_id is not None:
            self.slurm.cancel(self.job_id)
        super()._raise(message)

    def _status(self, info: JobInfo) -> str:
        return f"slurm: {info.describe()}"

    def _look(self, job: str, max_age: float) -> JobInfo:
        """``job``'s state no older than ``max_age`` s: the watcher's (gangs that stop together
        share its squeue), else this gang's own squeue."""
        return self.watcher.info(job, max_age) if self.watcher is not None else self.slurm.job(job)

    def _stop(self, job: str, grace_s: float) -> None:
        info = self._look(job, self.poll_interval)  # an ended job's state is final: a recent look will do
        if info.active and all(c is not None for c in self.exitcodes()):
            info = _wait_inactive(self.slurm, job, grace_s, self._look)  # srun and the script are ending
        cancelled = info.active
        if info.active:
            self.slurm.cancel(job)  # SIGTERM to every step, SIGKILL after KillWait
            info = _wait_inactive(self.slurm, job, grace_s, self._look)
        if info.active:
            self.slurm.cancel(job, "KILL")
            info = _wait_inactive(self.slurm, job, 10.0, self._look)
        if cancelled and info.state == "GONE":  # an array task cancelled while pending leaves no trace
            info = JobInfo(job, "CANCELLED")
        with self._lock:
            self.info = info
            if not info.active:
                self._settle(info, info.state, info.exit_status)
                self._let_go()


class SlurmStepLauncher(SlurmLauncher):
    """``allocation: pilot``: the gang is a job step ``srun --jobid=J --exact`` on a share of
    ``pilot`` (started by the first gang that needs it); a gang that does not fit the free
    share waits for one."""

    def __init__(self, pilot: SlurmPilot, echo: Echo = False, *, srun_via: Sequence[str] = (), **common: Any):
        """``srun_via``: argv the step's srun runs under (``slurm.srun_via``); ``common``: see
        ``SlurmLauncher`` (SLURM's commands are the pilot's)."""
        common.setdefault("site", pilot.site)
        super().__init__(echo, slurm=pilot.slurm, **common)
        self.pilot = pilot
        self.srun_via = list(srun_via)
        self.placed: list[str] = []  # node of each rank, as prefer_hosts chose them for the next launch

    def _reset(self, log_dir: Path | None, world_size: int) -> None:
        super()._reset(log_dir, world_size)
        self.step_id: str | None = None
        self._srun: subprocess.Popen | None = None
        self._srun_err: list[str] = []
        self._step_note = ""

    def _start(self, argv: Sequence[str], env: dict[str, str]) -> None:
        pilot = self.pilot
        if pilot.ntasks and self.world_size > int(pilot.ntasks):
            raise GangError(_does_not_fit(self.world_size, pilot.ntasks, self.site))
        # a pilot queued behind other jobs fails the gang within its start timeout, not never
        pilot.start(
            pilot.start_timeout or self.start_timeout,
            hook=self.allocation_hook,
            driver=env.get(P.ENV_CONTROL),
            store={k: env[k] for k in STORE_ENV if env.get(k)},
            log_dir=self._logs,  # on a filesystem the nodes share, as the ranks' logs must be
        )
        self.job_id = pilot.job_id
        self._check_reachable(env)
        if pilot.store_key and env.get(ENV_STORE) == pilot.store_root:  # its node's store service
            env[ENV_STORE_SERVICE_KEY] = pilot.store_key
        self._hold(allocation("step", self.step_name, self.slurm, pilot.job_id))
        step_options = {k: v for k, v in self.options.items() if k in STEP_OPTIONS}
        if len(self.placed) == self.world_size:  # rank r on placed[r]: SLURM's arbitrary distribution
            for key in ("nodes", "ntasks-per-node", "distribution", "nodelist", "spread-job"):
                step_options.pop(key, None)
            hostfile = self._logs / "slurm-hostfile"
            hostfile.write_text("\n".join(self.placed) + "\n")
            env["SLURM_HOSTFILE"] = str(hostfile)
            step_options.update({"distribution": "arbitrary", "nodes": len(set(self.placed))})
            self.placed = []  # this launch's
        cmd = [
            *self.srun_via,
            self.slurm.exe("srun"),
            f"--jobid={pilot.job_id}",
            "--exact",
            f"--job-name={self.step_name}",
            *_option_args(step_options),
            *self._srun_options(),
            *self.srun_args,
            *self._rank_command(argv),
        ]
        launcher_log = open(self._logs / "launcher.log", "ab", buffering=0)
        self._srun = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=launcher_log, stderr=subprocess.PIPE, start_new_session=True
        )
        launcher_log.close()
        threading.Thread(
            target=self._read_srun_stderr, args=(self._srun,), daemon=True, name="phalanx-slurm-srun"
        ).start()

    def prefer_hosts(self, hosts: Sequence[str]) -> bool:
        """Rank r on node ``hosts[r]`` (a node of the running pilot; "" or another host: the
        pilot's least loaded node), at most ``ranks_per_node`` (else the pilot's tasks per node)
        ranks a node; the next launch's step uses SLURM's arbitrary distribution.  False when
        the pilot is not running yet or none of ``hosts`` is one of its nodes."""
        pilot = self.pilot
        if not pilot.running or pilot.info is None:
            return False
        nodes = pilot.node_names()
        if not nodes or not set(hosts) & set(nodes):
            return False
        per_node = self.options.get("ntasks-per-node")
        cap = int(per_node) if per_node else -(-int(pilot.ntasks) // len(nodes)) if pilot.ntasks else len(hosts)
        if cap * len(nodes) < len(hosts):
            return False
        load = dict.fromkeys(nodes, 0)
        placed = [h if h in load else "" for h in hosts]
        for r, h in enumerate(placed):  # the preferred nodes first, up to their cap
            if h and load[h] < cap:
                load[h] += 1
            else:
                placed[r] = ""
        for r, h in enumerate(placed):  # the rest on the least loaded
            if not h:
                placed[r] = min(nodes, key=lambda n: load[n])
                load[placed[r]] += 1
        self.placed = placed
        return True

    def _check_reachable(self, env: Mapping[str, str]) -> None:
        """GangError when the pilot's nodes are other hosts but the driver listens on loopback
        or the rendezvous is a loopback ``tcp://`` (rank 0 would host it on its own loopback):
        the ranks would wait out the start timeout."""
        control = env.get(P.ENV_CONTROL, "").rpartition(":")[0]
        rdzv = urlparse(env.get(P.ENV_RDZV, ""))
        loopback_rdzv = rdzv.scheme == "tcp" and is_loopback(rdzv.hostname)
        far = self.pilot.far_nodes() if is_loopback(control) or loopback_rdzv else {}
        if not far:
            return
        where = f"the nodes of pilot job {self.pilot.job_id} are other hosts ({', '.join(sorted(far))})"
        if is_loopback(control):
            node, addr = next(iter(far.items()))
            via = route_from(addr)
            raise GangError(
                f"slurm: {where} but the driver listens on {control} only{_site(self.site)}: set the site's "
                f"driver_host to an address they reach"
                + (f" (this host's route to {node} leaves from {via})" if via else "")
            )
        raise GangError(
            f"slurm: {where} but the rendezvous is tcp on {rdzv.hostname}{_site(self.site)}: rank 0 would host it "
            "where the others cannot reach it; use a rendezvous every node reaches (file:///a/shared/dir, redis://...)"
        )

    def _read_srun_stderr(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None  # stderr=PIPE (_start)
        with open(self._logs / "launcher.log", "ab", buffering=0) as out:
            for raw in iter(proc.stderr.readline, b""):
                out.write(raw)
                line = raw.decode(errors="replace").strip()
                with self._lock:
                    self._srun_err.append(line)
                    if "temporarily disabled" in line:
                        m = re.search(r"\((.*)\)", line)
                        self._step_note = f"waiting for a share of pilot job {self.job_id}" + (
                            f" ({m.group(1)})" if m else ""
                        )
                    elif "Step created" in line:
                        self._step_note = ""
        proc.stderr.close()

    def _check(self) -> None:
        proc = self._srun
        if proc is None:
            return
        rc = proc.poll()
        if rc is None:
            return
        self._read_exit_files()  # the last rank may have written its file just before srun ended
        if all(c is not None for c in self._codes):
            return
        info = self._poll(force=True)  # was the pilot lost (TIMEOUT, NODE_FAIL...)?
        errors = [l for l in self._srun_err if "error" in l.lower()]
        # a step cancelled from outside (scancel) ran and was killed: not a start failure
        killed = any(re.search(r"CANCELLED|: (Killed|Terminated)$", l.strip()) for l in errors)
        if (
            not any(c is not None for c in self._codes)
            and errors
            and not killed
            and not self._raised
            and not self._killing
            and (info is None or info.active)
        ):
            self._settle(None, "FAILED", None, exit_files.shell_code(rc) if rc > 0 else (rc or 1))
            self._raise(
                f"slurm: job step of pilot job {self.job_id} could not start"
                f"{_site(self.site)}: {'; '.join(errors[-3:])}"
            )
        if info is not None and not info.active:
            self._settle(info, info.state, info.exit_status)
        else:
            code = -int(signal.SIGKILL) if killed else (exit_files.shell_code(rc) if rc > 0 else rc)
            self._settle(None, "FAILED" if code else "COMPLETED", None, code or None)

    def _status(self, info: JobInfo) -> str:
        if info is not None and info.state != "RUNNING":
            return f"slurm: pilot {info.describe()}"
        if self._step_note:
            return f"slurm: step {self.step_name} {self._step_note}"
        assert self.job_id is not None  # status() asks SLURM only once there is a job
        step = self.step_id or next(iter(self.slurm.step_ids(self.job_id, self.step_name)), None)
        if step:
            self.step_id = step
            state = "RUNNING" if self._srun is not None and self._srun.poll() is None else "ENDED"
            return f"slurm: step {step} {state} (pilot job {self.job_id} on {info.nodes})"
        if self._srun is None or self._srun.poll() is not None:
            return f"slurm: step {self.step_name} of pilot job {self.job_id} ended"
        # srun tells "step creation temporarily disabled" only once it got its share, and
        # squeue does not list a step that waits: no step yet after a moment means waiting
        if time.monotonic() - self._submitted < 1.0:
            return f"slurm: step {self.step_name} of pilot job {self.job_id} starting"
        return f"slurm: step {self.step_name} waiting for a share of pilot job {self.job_id}"

    def _stop(self, job: str, grace_s: float) -> None:
        proc = self._srun
        if proc is None:  # srun never started
            self._let_go()
            return
        if proc.poll() is None and any(c is None for c in self.exitcodes()):
            steps = self.slurm.step_ids(job, self.step_name)
            for step in steps:
                self.slurm.cancel(step)
            if not steps:  # still waiting for its share: srun ends on SIGTERM
                signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            for step in self.slurm.step_ids(job, self.step_name):
                self.slurm.cancel(step, "KILL")
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        with self._lock:
            self._check()
            self._let_go()  # srun ended: so did its step


def _pct(path: Path) -> str:
    return str(path).replace("%", "%%")  # srun/sbatch expand %j, %t... in --output


def _common_env(rank_env: list[dict[str, str]]) -> dict[str, str]:
    """The environment all ranks share; the rank itself comes from SLURM_PROCID."""
    return shared_env(rank_env, (P.ENV_RANK, P.ENV_CPUS, P.ENV_CPUS_BY_RANK), "srun")
