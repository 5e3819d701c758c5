"""mpirun executor: one ``mpirun`` (Open MPI) starts every rank of the gang on this host.

Needed for ``communicator="mpi"``: MPI_COMM_WORLD only exists among processes one mpirun
started.  Ranks learn their rank from ``OMPI_COMM_WORLD_RANK``; the rest of their environment
is common to all ranks and exported with ``-x``; per-rank CPU sets travel in one variable,
``PHALANX_CPUS_BY_RANK`` ("0|1|2,3"), which the worker indexes by its rank.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from ..errors import MissingDependencyError
from ..procs import descendants, leads_group, pid_alive, signal_group, signal_pid
from ..runtime import protocol as P
from . import exit_files
from .base import Capabilities, Echo, Executor, ExecutorConfig, Launcher, shared_env
from .local import WORKER_ARGV, cpu_placement, slot_cpus, usable_cpus
from .logs import RankOutput, start_pump

ENV_CPUS_BY_RANK = P.ENV_CPUS_BY_RANK
# Rank variables read before OMPI_COMM_WORLD_RANK (protocol._RANK_VARS): inherited from the
# driver (e.g. SLURM_PROCID=0 inside sbatch) they would give every rank the same number.
_SHADOWING_RANK_VARS = (P.ENV_RANK, "SLURM_PROCID")
_PER_RANK = (P.ENV_RANK, P.ENV_CPUS)

# mpirun runs in its own session (Ctrl-C reaches only the driver), so nothing would stop it,
# nor ranks busy in an app, if the driver died.  The kernel's PR_SET_PDEATHSIG can, but fires
# once per exiting thread of a multi-threaded parent, and a second SIGTERM makes mpirun quit
# without removing its /tmp/ompi.* session dir and /dev/shm segments.  So this single-threaded
# shim, which dies with the driver, is mpirun's parent, and passes on one SIGTERM only.
_SHIM = """\
import ctypes, os, signal, sys
prctl = ctypes.CDLL("libc.so.6").prctl
prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("phalanx: the driver died before mpirun started")
shim = os.getpid()
pid = os.fork()
if pid == 0:
    prctl(1, signal.SIGTERM)
    if os.getppid() != shim:
        os._exit(1)
    os.execv(sys.argv[2], sys.argv[2:])
stopping = []
def stop(signum, frame):
    if not stopping:
        stopping.append(signum)
        os.kill(pid, signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os._exit(code if code >= 0 else 128 - code)
"""

DEFAULT_MCA = {
    # one host: shared memory (vader) is the fastest transport (COMMS.md §3)
    "btl": "self,vader",
    # a rank that exits non-zero ends the whole job (Open MPI's default, made explicit)
    "orte_abort_on_non_zero_status": "1",
    # on SIGTERM mpirun waited 1 s before SIGKILLing the ranks; with 0 it exits in ~30 ms, so
    # fail-fast need not SIGKILL mpirun, which leaks /tmp/ompi.* and 4 MB /dev/shm segments
    "odls_base_sigkill_timeout": "0",
}


# A command stage's program learns its rank as PHALANX_RANK, and leaves its exit code where the
# driver reads it (mpirun reports one code for the whole job).
_COMMAND_WRAPPER = (
    'd=$1; shift; PHALANX_RANK=$OMPI_COMM_WORLD_RANK; export PHALANX_RANK; "$@"; rc=$?; '
    + exit_files.record("$d", "$PHALANX_RANK")
    + "; exit $rc"
)


class MPIRunConfig(ExecutorConfig):
    """The ``mpirun:`` section of a site file (all optional)."""

    mpirun: str = Field("mpirun", description="the mpirun program (Open MPI)")
    mca: dict[str, str] = Field(default_factory=dict, description="--mca KEY VALUE pairs over phalanx's defaults")
    args: list[str] = Field(default_factory=list, description="further mpirun arguments, verbatim")
    pin: bool = Field(
        True, strict=True, description="pin each rank to its own CPUs when the site's slots fit this machine's cores"
    )


class MPIRunExecutor(Executor[MPIRunConfig]):
    """Every gang is one ``mpirun`` on this machine: its ranks are one MPI_COMM_WORLD."""

    name = "mpirun"
    config_model = MPIRunConfig
    capabilities = Capabilities(pins_cpus=True, mpi_world=True, runs_commands=True)

    def capacity(self) -> int:
        return self.cores or len(usable_cpus())

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: MPIRunConfig | None = None, echo: Echo = False
    ) -> MPIRunLauncher:
        cfg = self.effective_config(config)
        pin, cpus = slot_cpus(self.capacity(), cfg.pin, slots)
        launcher = MPIRunLauncher(echo=echo, pin=pin, cpus=cpus, mpirun=cfg.mpirun, mca=cfg.mca, extra_args=cfg.args)
        launcher.allocation_hook = self.hook
        return launcher


class MPIRunLauncher(Launcher):
    name = "mpirun"

    def __init__(
        self,
        echo: Echo = True,
        pin: bool = True,
        mpirun: str = "mpirun",
        mca: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cpus: Sequence[int] | None = None,
    ):
        """``cpus``: the CPUs this gang may use (a scheduler's share); default all usable."""
        self.echo = echo
        self.pin = pin
        self.cpus = cpus
        self.mpirun = mpirun
        self.mca = {**DEFAULT_MCA, **(mca or {})}
        self.extra_args = list(extra_args)
        self.world_size = 0
        self.log_dir: Path | None = None
        self.command_stage = False  # argv is a program of a command stage, not the rank worker
        self.proc: subprocess.Popen | None = None  # mpirun, or on Linux its shim
        self._pump: threading.Thread | None = None
        self._router: TagOutputRouter | None = None
        self._output: RankOutput | None = None

    def placement(self, world_size: int) -> list[dict[str, str]]:
        return [_common_env(cpu_placement(world_size, self.pin, self.cpus))] * world_size

    def command(self, argv: Sequence[str], common: dict[str, str], world_size: int) -> list[str]:
        exe = shutil.which(self.mpirun)
        if exe is None:
            raise MissingDependencyError(
                f"executor 'mpirun' needs {self.mpirun!r} on PATH (e.g. apt-get install openmpi-bin)"
            )
        cmd = [
            exe,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(world_size),
            "--tag-output",
            "--bind-to",
            "none",
        ]  # phalanx pins ranks itself (PHALANX_CPUS_BY_RANK)
        for key, value in self.mca.items():
            cmd += ["--mca", key, str(value)]
        for var in sorted(common):  # names only: values (the authkey) stay out of `ps`
            cmd += ["-x", var]
        cmd += self.extra_args + list(argv)
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-S", "-c", _SHIM, str(os.getpid())] + cmd
        return cmd

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        self.world_size, self.log_dir = len(rank_env), Path(log_dir)
        self.command_stage = tuple(argv) != WORKER_ARGV
        if self.command_stage:
            argv = ["/bin/sh", "-c", _COMMAND_WRAPPER, "phalanx-rank", str(self.log_dir), *argv]
        common = _common_env(rank_env)
        common["PYTHONUNBUFFERED"] = "1"
        env = {**os.environ, **common}
        for var in _SHADOWING_RANK_VARS + (P.ENV_CPUS,):
            env.pop(var, None)
        cmd = self.command(argv, common, self.world_size)
        self._output = RankOutput(log_dir, self.echo)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the driver, which stops the gang
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        self._router = TagOutputRouter()
        self._pump = start_pump(self.proc.stdout, self._output, self._router, "phalanx-log-mpirun")

    def first_failed(self) -> int | None:
        """The rank mpirun noticed ending first: the one that was killed or exited non-zero,
        the others it ended after it.  Waits a moment for mpirun to exit and say so."""
        router, proc = self._router, self.proc
        if router is None or proc is None:
            return None
        try:
            proc.wait(timeout=self.exit_latency)
        except subprocess.TimeoutExpired:
            return router.noticed
        if self._pump is not None:
            self._pump.join(timeout=self.exit_latency)  # its last lines: mpirun's notice
        return router.noticed

    def exitcodes(self) -> list[int | None]:
        code = self.proc.poll() if self.proc is not None else None
        codes: list[int | None] = [code] * self.world_size
        if not self.command_stage or self.log_dir is None:
            return codes
        own: dict[int, int] = {}  # each rank's own code, where it wrote one
        for r in range(self.world_size):
            code = exit_files.read(self.log_dir, r)
            if code is not None:
                own[r] = code
        # A rank that failed makes mpirun end the others: those were stopped, not failed (None
        # until the gang stops them), so the failed rank alone is named
        failed = any(c != 0 for c in own.values())
        return [own.get(r, None if failed else codes[r]) for r in range(self.world_size)]

    def kill(self, grace_s: float = 2.0) -> None:
        proc = self.proc
        if proc is None:
            return
        # Open MPI puts each rank in its own process group, out of reach of killpg: remember
        # their PIDs in case mpirun dies before it can stop them.
        below = descendants(proc.pid)
        if proc.poll() is None:
            signal_pid(proc.pid, signal.SIGTERM)  # one SIGTERM: mpirun stops the ranks, cleans up
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)  # the shim and mpirun
                proc.wait()
        deadline = time.monotonic() + 0.5  # PDEATHSIG normally ends the ranks with mpirun
        while (below := [pid for pid in below if pid_alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in below:  # with what the rank started
            (signal_group if leads_group(pid) else signal_pid)(pid, signal.SIGKILL)
        if self._pump is not None:
            self._pump.join(timeout=1.0)
            if not self._pump.is_alive() and self._output is not None:
                self._output.close()


class TagOutputRouter:
    """Reassembles ranks' lines from ``mpirun --tag-output``.

    Open MPI tags every write fragment, not every line: with unbuffered Python one ``print``
    arrives as ``[1,0]<stdout>:a[1,0]<stdout>: [1,0]<stdout>:b[1,0]<stdout>:\\n``, and other
    ranks' fragments can interleave.  Fragments are collected per (rank, stream); the newline
    that ends a physical line belongs to its last fragment.  Untagged text is mpirun's own.
    """

    TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:")
    # Open MPI's help-orterun.txt: proc-aborted(-strsignal), proc-exit-no-sync... name the rank
    NOTICE = re.compile(rb"noticed that process rank (\d+) with PID")

    def __init__(self) -> None:
        self.partial: dict[tuple[int | None, bytes], bytearray] = {}
        self.noticed: int | None = None  # the rank mpirun says ended the job

    def __call__(self, line: bytes) -> list[tuple[int | None, bytes]]:
        if not line:  # end of stream: flush unterminated lines
            out = [(key[0], bytes(buf)) for key, buf in self.partial.items() if buf]
            self.partial.clear()
            return out
        parts = self.TAG.split(line)  # [untagged, rank, stream, text, rank, stream, text, ...]
        key: tuple[int | None, bytes] = (None, b"")
        self._add(key, parts[0])
        for i in range(1, len(parts), 3):
            key = (int(parts[i]), parts[i + 1])
            self._add(key, parts[i + 2])
        buf = self.partial.get(key)
        if buf and buf.endswith(b"\n"):
            del self.partial[key]
            if key[0] is None and self.noticed is None and (m := self.NOTICE.search(buf)):
                self.noticed = int(m.group(1))
            return [(key[0], bytes(buf))]
        return []

    def _add(self, key: tuple[int | None, bytes], text: bytes) -> None:
        if text:
            self.partial.setdefault(key, bytearray()).extend(text)


def _common_env(rank_env: list[dict[str, str]]) -> dict[str, str]:
    """The environment of all ranks, with per-rank CPU sets folded into one variable."""
    common = shared_env(rank_env, _PER_RANK, "mpirun")
    if any(P.ENV_CPUS in env for env in rank_env):
        common[ENV_CPUS_BY_RANK] = "|".join(env.get(P.ENV_CPUS, "") for env in rank_env)
    return common
