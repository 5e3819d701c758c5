"""A gang whose ranks an MPI launcher prefix starts: Parsl's ``$PARSL_MPI_PREFIX``.

On an ``MPIExecutor`` the Parsl worker that runs the app is the gang's driver: it starts
``<prefix> python -m phalanx.integrations.parsl._rank`` (``mpiexec -n 2 -ppn 2 -hosts h``,
``srun --ntasks 2 --ntasks-per-node 1 --nodelist n1,n2 --nodes 2``...), the ranks connect back to
it, and everything else — the control plane, fail-fast, the communicator — is phalanx's own.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ...errors import GangError
from ...executors.base import Echo, Launcher, shared_env
from ...executors.local import WORKER_ARGV
from ...executors.logs import FileFollower, RankOutput, start_pump
from ...procs import descendants, leads_group, pid_alive, signal_group, signal_pid
from ...runtime import protocol as P
from ...runtime.envvars import ENV_RANK_LOG_DIR, ENV_RANK_VARS

RANK_ARGV = (sys.executable, "-m", "phalanx.integrations.parsl._rank")

# Where each kind of launcher puts the rank, most specific first.  srun's own variable wins under
# srun; under mpiexec a SLURM_PROCID inherited from the Parsl worker's batch job would be stale.
RANK_VARS = {
    "srun": ("SLURM_PROCID",),
    "mpiexec": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"),
    "mpirun": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"),
    "aprun": ("ALPS_APP_PE", "PMI_RANK"),
}
# variables of the driver that would give every rank one number
_STALE = (P.ENV_RANK, "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "ALPS_APP_PE")


def rank_vars(prefix: str) -> tuple[str, ...]:
    words = shlex.split(prefix)
    exe = os.path.basename(words[0]) if words else ""
    for kind, names in RANK_VARS.items():
        if exe == kind or exe.startswith(kind + "."):
            return names
    return ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


class PrefixLauncher(Launcher):
    """All ranks of a gang through one launcher command (``prefix``), like ``mpirun`` but any
    MPI launcher Parsl composes.  Ranks write their own logs (``log_dir/rank-R.log``); the
    launcher's own output goes to ``log_dir/launcher.log``."""

    name = "parsl-mpi"

    def __init__(self, prefix: str, echo: Echo = False):
        if not prefix.strip():
            raise GangError(
                "no MPI launcher prefix: $PARSL_MPI_PREFIX is empty (is this app running on "
                "a Parsl MPIExecutor, with a parsl_resource_specification?)"
            )
        self.prefix = prefix
        self.echo = echo
        self.world_size = 0
        self.proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None
        self._output: RankOutput | None = None
        self._follower: FileFollower | None = None

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        if tuple(argv) != WORKER_ARGV:
            raise GangError("a Parsl MPI gang runs BSP apps only (no command stages)")
        self.world_size = len(rank_env)
        common = shared_env(rank_env, (P.ENV_RANK, P.ENV_CPUS), "$PARSL_MPI_PREFIX")
        env = {k: v for k, v in os.environ.items() if k not in _STALE}
        env.update(common)
        words = shlex.split(self.prefix)
        kind = os.path.basename(words[0]) if words else ""
        if not kind.startswith("srun"):
            env.pop("SLURM_PROCID", None)
        env.update(
            {ENV_RANK_VARS: ",".join(rank_vars(self.prefix)), ENV_RANK_LOG_DIR: str(log_dir), "PYTHONUNBUFFERED": "1"}
        )
        self._output = RankOutput(Path(log_dir), False)  # makes the directory (0700)
        for r in range(self.world_size):  # a rank that never starts still has a (empty) log
            (Path(log_dir) / f"rank-{r}.log").touch(mode=0o600)
        self.proc = subprocess.Popen(
            words + list(RANK_ARGV),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # its own group: kill() reaches the launcher and what it forked
        output = self._output
        world = self.world_size

        def route(line: bytes) -> list[tuple[int | None, bytes]]:
            # the launcher's own words (srun: "error: Unable to create step...") in launcher.log
            # and in every rank's log, whose tail a failed gang shows
            if not line:
                return []
            return [(None, line)] + [(r, b"[launcher] " + line) for r in range(world)]

        assert self.proc.stdout is not None  # stdout=PIPE
        self._pump = start_pump(self.proc.stdout, output, route, "phalanx-log-parsl-mpi")
        if self.echo:
            self._follower = FileFollower([Path(log_dir) / f"rank-{r}.log" for r in range(self.world_size)], self.echo)

    def exitcodes(self) -> list[int | None]:
        code = self.proc.poll() if self.proc is not None else None
        return [code] * self.world_size

    def kill(self, grace_s: float = 2.0) -> None:
        proc = self.proc
        if proc is None:
            return
        below = descendants(proc.pid)  # Open MPI puts each rank in a group of its own
        if proc.poll() is None:
            signal_pid(proc.pid, signal.SIGTERM)  # mpiexec and srun pass it on to the ranks
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        signal_group(proc.pid, signal.SIGKILL)  # what the launcher left in its group
        deadline = time.monotonic() + 1.0
        while (below := [p for p in below if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in below:
            (signal_group if leads_group(pid) else signal_pid)(pid, signal.SIGKILL)
        if self._pump is not None:
            self._pump.join(timeout=1.0)
        if self._output is not None:
            self._output.close()
        if self._follower is not None:
            self._follower.stop()
