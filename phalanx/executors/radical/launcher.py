"""``RadicalLauncher``: one gang as one RADICAL-Pilot task with ``ranks = N`` on the run's pilot.

RP's agent places the task on the pilot's cores and starts its ranks (one process with FORK, N
through the resource's MPI launcher: mpiexec/mpirun here, srun on a SLURM machine); each rank
runs a small shell wrapper that takes its rank from ``RP_RANK``, writes its output to
``rank-R.out`` and its exit code to ``rank-R.exit`` in the task's sandbox (RP reports one exit
code per task), and runs the rank's program.  The launcher copies the spooled output into
``log_dir/rank-R.log`` as it comes (the next stage of a reused gang: another ``log_dir``), and
reports RP's view of the task: its state (``AGENT_SCHEDULING``, ``AGENT_EXECUTING``,
``FAILED``...) and, for a task RP failed, RP's exception (``task can never be scheduled``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import GangError
from ...runtime import protocol as P
from ...runtime.envvars import ENV_RP_ARG_PREFIX, ENV_RP_ARGC, ENV_RP_WRAPPER
from .. import exit_files
from ..base import Echo, Launcher, held, released, shared_env
from ..logs import RankOutput
from .config import RadicalConfig
from .pilot import FINAL, RadicalPilot, _site, processes_in, sweep, url_path

log = logging.getLogger("phalanx.executors.radical")

# Each rank runs this: its program's argv from PHALANX_RP_ARG_0..N-1, its rank from RP_RANK
# (exported as PHALANX_RANK for command stages), its output and exit code into the task's
# sandbox, where the driver reads them.  RP writes arguments and environment into its exec
# script inside double quotes (arguments through sh_quote, which leaves $ and ` alone), so
# what must arrive as it is travels in the environment, escaped for double quotes.
_WRAPPER = (
    """set --; i=0
while [ "$i" -lt "$PHALANX_RP_ARGC" ]; do eval "set -- \\"\\$@\\" \\"\\$PHALANX_RP_ARG_$i\\""; i=$((i+1)); done
d=$RP_TASK_SANDBOX; r=${RP_RANK:-0}; PHALANX_RANK=$r; export PHALANX_RANK
exec >>"$d/rank-$r.out" 2>&1 </dev/null
"$@"; rc=$?
"""
    + exit_files.record("$d", "$r")
    + "; exit $rc\n"
)


def dq(value: str) -> str:
    """``value`` escaped so that ``"..."`` in a POSIX shell gives it back as it is."""
    for char in ("\\", "$", "`", '"'):
        value = value.replace(char, "\\" + char)
    return value


# OpenMPI refuses root without these (mpiexec starts the ranks of a multi-rank task)
_ROOT_OMPI = "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
_FOLLOW_S = 0.1


class RadicalLauncher(Launcher):
    """Starts a gang as one task of ``pilot`` (waiting for the pilot within the gang's start
    timeout), follows the ranks' spooled output and exit codes, cancels the task on ``kill``."""

    name = "radical"

    def __init__(
        self,
        pilot: RadicalPilot,
        config: RadicalConfig,
        *,
        site: str = "radical",
        echo: Echo = False,
        rank_memory_mb: int | None = None,
    ):
        self.pilot = pilot
        self.config = config
        self.site = site
        self.echo = echo
        self.rank_memory_mb = rank_memory_mb
        self._lock = threading.RLock()
        self._launches = 0
        self._reset(0)

    def _reset(self, ranks: int) -> None:
        self.ranks = ranks
        self.task: Any = None
        self.uid: str | None = None
        self.sandbox: Path | None = None
        self._codes: list[int | None] = [None] * ranks
        self._files: dict[int, Any] = {}
        self._partial: dict[int, bytes] = {}
        self._output: RankOutput | None = None
        self._follower: threading.Thread | None = None
        self._stop = threading.Event()
        self._failed: str | None = None
        self._killing = False
        self._allocation: dict | None = None

    def placement(self, world_size: int) -> list[dict[str, str]]:
        # RP places the ranks on the pilot's cores; phalanx sizes their thread pools
        return [{P.ENV_THREADS: str(self.config.cores_per_rank)} for _ in range(world_size)]

    # ---- launch -------------------------------------------------------------------------------
    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        if self.task is not None:
            self.kill(grace_s=0.5)
        with self._lock:
            self._reset(len(rank_env))
            self._output = RankOutput(Path(log_dir), self.echo)
            for r in range(self.ranks):  # a rank that never starts still has a log to show
                (Path(log_dir) / f"rank-{r}.log").touch(mode=0o600)
        self._fits(len(rank_env))  # before waiting for the pilot: its size is known
        env = shared_env(rank_env, (P.ENV_RANK, P.ENV_CPUS, P.ENV_CPUS_BY_RANK), "radical")
        env["PYTHONUNBUFFERED"] = "1"
        # the pilot is the run's: its wait counts in this gang's start timeout
        self.pilot.wait_active(self.start_timeout)
        from .session import import_rp

        rp = import_rp()
        cfg = self.config
        self._launches += 1
        gang = env.get(P.ENV_GANG_ID) or f"{os.getpid()}-{time.time_ns()}"
        uid = f"{cfg.job_name}-{gang}" + (f"-{self._launches}" if self._launches > 1 else "")
        environment = {k: dq(v) for k, v in env.items()}
        environment.update(
            {
                ENV_RP_WRAPPER: dq(_WRAPPER),
                ENV_RP_ARGC: str(len(argv)),
                **{f"{ENV_RP_ARG_PREFIX}{i}": dq(str(a)) for i, a in enumerate(argv)},
            }
        )
        environment.update(cfg.env)  # the site's own: as written (RP's shell expands $VARS in them)
        td: dict[str, Any] = {
            "uid": uid,
            "name": uid,
            "executable": "/bin/sh",
            "arguments": ["-c", f"${ENV_RP_WRAPPER}", "phalanx-rank"],
            "ranks": self.ranks,
            "cores_per_rank": cfg.cores_per_rank,
            "environment": environment,
            "pre_launch": [_ROOT_OMPI, *cfg.pre_launch] if os.geteuid() == 0 else list(cfg.pre_launch),
            "pre_exec": list(cfg.pre_exec),
            "pilot": self.pilot.uid,
        }
        if cfg.gpus_per_rank:
            td["gpus_per_rank"] = cfg.gpus_per_rank
        memory = cfg.mem_per_rank or self.rank_memory_mb
        if memory:
            td["mem_per_rank"] = memory
        sandbox = (self.pilot.sandbox or Path(".")) / uid
        with self._lock:
            self.uid, self.sandbox = uid, sandbox
            self._allocation = {
                "executor": "radical",
                "kind": "task",
                "id": uid,
                "pilot": self.pilot.uid,
                "resource": cfg.resource,
                "host": (self.pilot._record or {}).get("host"),
                "sandbox": str(sandbox),
            }
            held(self.allocation_hook, self._allocation)  # before RP knows it: found by its sandbox
        session = self.pilot.session
        assert session is not None, "gangs are submitted to a pilot whose session is made"
        try:
            with session.api:
                task = self.pilot.tmgr.submit_tasks(rp.TaskDescription(td))
        except BaseException as exc:
            self._let_go()
            if isinstance(exc, Exception):
                raise GangError(
                    f"radical: task {uid} was refused{_site(self.site)}: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        with self._lock:
            self.task = task
            try:
                self.sandbox = url_path(task.sandbox) if task.sandbox else sandbox
            except Exception:
                pass
            self._follower = threading.Thread(target=self._follow, name=f"phalanx-radical-{uid}", daemon=True)
            self._follower.start()

    def _fits(self, ranks: int) -> None:
        """A gang the pilot can never hold fails now (as the SLURM pilot's steps do), not once
        the pilot is up and RP's agent says "task can never be scheduled"."""
        cores, gpus, cfg = self.pilot.cores, self.pilot.cfg.gpus, self.config
        if cores and ranks * cfg.cores_per_rank > cores:
            raise GangError(
                f"radical: a gang of {ranks} ranks x {cfg.cores_per_rank} cores does not fit the "
                f"pilot's {cores} cores ({cfg.resource}){_site(self.site)}: raise radical.cores"
            )
        if cfg.gpus_per_rank and not self.pilot.cfg.nodes and ranks * cfg.gpus_per_rank > gpus:
            raise GangError(
                f"radical: a gang of {ranks} ranks x {cfg.gpus_per_rank:g} GPUs does not fit the "
                f"pilot's {gpus} GPUs ({cfg.resource}){_site(self.site)}: raise radical.gpus"
            )

    # ---- output ---------------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.wait(_FOLLOW_S):
            with self._lock:
                self._drain()
        with self._lock:
            self._drain(final=True)

    def _drain(self, ranks: Sequence[int] | None = None, final: bool = False) -> None:
        """Copy what the ranks wrote to their spool files since last time (``_lock`` held)."""
        output, sandbox = self._output, self.sandbox
        if output is None or sandbox is None:
            return
        for rank in range(self.ranks) if ranks is None else ranks:
            f = self._files.get(rank)
            if f is None:
                try:
                    f = self._files[rank] = open(sandbox / f"rank-{rank}.out", "rb")
                except OSError:
                    continue
            data = self._partial.get(rank, b"") + f.read()
            *lines, rest = data.split(b"\n")
            for line in lines:
                output.write(rank, line + b"\n")
            if final and rest:
                output.write(rank, rest + b"\n")
                rest = b""
            self._partial[rank] = rest

    def _note(self, text: str, ranks: Sequence[int]) -> None:
        """RP's word on the gang, at the end of these ranks' logs (the gang shows their tails)."""
        if self._output is None:
            return
        for r in ranks:
            self._output.write(r, f"[phalanx radical] {text}\n".encode())

    def redirect(self, log_dir: Path) -> bool:
        with self._lock:
            if self._output is None:
                return False
            self._drain()
            self._output.move_to(Path(log_dir))
            return True

    # ---- state ----------------------------------------------------------------------------------
    def exitcodes(self) -> list[int | None]:
        with self._lock:
            if self.ranks == 0 or self.sandbox is None:
                return list(self._codes)
            fresh = []
            for r, code in enumerate(self._codes):
                if code is None:
                    self._codes[r] = exit_files.read(self.sandbox, r)
                    if self._codes[r] is not None:
                        fresh.append(r)
            if fresh:
                self._drain(fresh)  # the gang reads a failed rank's log tail next
            if any(c is None for c in self._codes) and self.task is not None:
                self._settle(self.sandbox)
            return list(self._codes)

    def _settle(self, sandbox: Path) -> None:
        """Ranks with no exit code of their own, once RP says the task (or its pilot) ended."""
        state = self.task.state
        pilot_state = self.pilot.state
        if state not in FINAL and pilot_state not in FINAL:
            return
        time.sleep(0.05)  # a rank's wrapper may be writing its file as the task ends
        open_ranks = [r for r, c in enumerate(self._codes) if c is None]
        for r in open_ranks:
            self._codes[r] = exit_files.read(sandbox, r)
        open_ranks = [r for r, c in enumerate(self._codes) if c is None]
        if not open_ranks:
            return
        self._drain()
        if state == "FAILED" or (state not in FINAL and pilot_state in FINAL):
            if state == "FAILED":
                why = self._exception() or f"exit code {self.task.exit_code}"
                self._failed = f"radical: task {self.uid} FAILED: {why}{_site(self.site)}"
            else:
                self._failed = (
                    f"radical: pilot {self.pilot.uid} {pilot_state} while task {self.uid} was {state}{_site(self.site)}"
                )
            if not self._killing:
                self._note(self._failed, open_ranks)
            code = (
                -int(signal.SIGKILL)
                if state != "FAILED" or self.task.exit_code is None
                else (exit_files.shell_code(int(self.task.exit_code)) or 1)
            )
        elif state == "CANCELED":
            code = -int(signal.SIGTERM)
        else:  # DONE, and a rank wrote no exit code: it never ran its program
            code = 0 if self.task.exit_code in (0, None) else 1
        for r in open_ranks:
            self._codes[r] = code

    def _exception(self) -> str:
        """RP's reason for a failed task: its exception, else the last lines of its stderr."""
        try:
            exc = self.task.exception
            if exc:
                return str(exc)
            err = (self.task.stderr or "").strip().splitlines()
            return " / ".join(err[-3:])
        except Exception:
            return ""

    def status(self) -> str | None:
        """RP's view: ``radical: task phalanx-... AGENT_EXECUTING on pilot phalanx-pilot-... (local.localhost)``."""
        with self._lock:
            if self.task is None:
                return self.pilot.status() if self.pilot.state != "PMGR_ACTIVE" else None
            text = f"radical: task {self.uid} {self.task.state} on pilot {self.pilot.uid} ({self.config.resource})"
            if self.task.state == "FAILED" and self._exception():
                text += f": {self._exception()}"
            return text

    def reason(self) -> str | None:
        with self._lock:
            return self._failed

    def memory_note(self, rank: int) -> str:
        return ""

    # ---- stopping -------------------------------------------------------------------------------
    def kill(self, grace_s: float = 2.0) -> None:
        """Cancel the task (RP's agent kills its process group) and make sure nothing of it runs."""
        with self._lock:
            task, uid, sandbox = self.task, self.uid, self.sandbox
            self._killing = True
        try:
            if task is not None and task.state not in FINAL and self.pilot.session is not None:
                try:
                    with self.pilot.session.api:
                        self.pilot.tmgr.cancel_tasks(uid)
                except Exception as exc:
                    log.warning("radical: cancelling task %s: %s", uid, exc)
                deadline = time.monotonic() + grace_s + 10.0
                while task.state not in FINAL and self.pilot.state not in FINAL and time.monotonic() < deadline:
                    time.sleep(0.02)
            if sandbox is not None and self.config.local:
                deadline = time.monotonic() + grace_s
                while processes_in(sandbox) and time.monotonic() < deadline:
                    time.sleep(0.02)
                sweep(sandbox, grace_s=grace_s)  # what RP did not end (an orphaned rank...)
        finally:
            self._stop.set()
            follower = self._follower
            if follower is not None and follower is not threading.current_thread():
                follower.join(timeout=2.0)
            with self._lock:
                if self.task is not None:
                    self._settle_killed()
                if self._output is not None:
                    self._output.close()
            self._let_go()

    def _settle_killed(self) -> None:
        self.exitcodes()
        for r, c in enumerate(self._codes):
            if c is None:
                self._codes[r] = -int(signal.SIGTERM)

    def _let_go(self) -> None:
        record, self._allocation = self._allocation, None
        if record is not None:
            released(self.allocation_hook, record)

    def __repr__(self) -> str:
        return f"<RadicalLauncher task={self.uid} pilot={self.pilot.uid}>"


__all__ = ["RadicalLauncher"]
