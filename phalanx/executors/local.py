"""Local executor: the ranks of a gang are processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Iterable, Sequence

from .base import Launcher

if TYPE_CHECKING:
    from .pool import WarmPool

WORKER_ARGV = (sys.executable, "-m", "phalanx.runtime.worker")  # what gangs start on every rank


Echo = bool | Callable[[str], None]


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_placement(world_size: int, pin: bool, cpus: Sequence[int] | None = None) -> list[dict[str, str]]:
    """Disjoint CPU sets when the gang fits its cores (``cpus``: the share a scheduler gave
    this gang; default all usable ones); threads split evenly either way."""
    cpus = list(cpus) if cpus else usable_cpus()
    threads = max(1, len(cpus) // world_size)
    out = []
    for r in range(world_size):
        env = {"PHALANX_THREADS": str(threads)}
        if pin and world_size <= len(cpus):
            env["PHALANX_CPUS"] = ",".join(map(str, cpus[r * threads:(r + 1) * threads]))
        out.append(env)
    return out


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, echo: Echo = True, pin: bool = True, cpus: Sequence[int] | None = None,
                 pool: "WarmPool | None" = None):
        self.echo = echo
        self.pin = pin
        self.cpus = cpus
        self.pool = pool  # warm rank processes to take before starting new ones
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._output: RankOutput | None = None

    def placement(self, world_size: int) -> list[dict[str, str]]:
        return cpu_placement(world_size, self.pin, self.cpus)

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        self._output = RankOutput(log_dir, self.echo)
        self.procs, self._pumps = [], []  # a gang restarting after a failure launches again
        from .pool import hand_over

        warm = self.pool.take(len(rank_env)) if self.pool and tuple(argv) == WORKER_ARGV else []
        for rank, extra in enumerate(rank_env):
            if rank < len(warm):
                proc = warm[rank]
                hand_over(proc, extra)
            else:
                proc = subprocess.Popen(
                    list(argv), env={**os.environ, **extra, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the driver, which stops the gang
                )
            self.procs.append(proc)
            self._pumps.append(start_pump(proc.stdout, self._output, _whole_lines(rank),
                                          name=f"phalanx-log-rank{rank}"))

    def exitcodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def redirect(self, log_dir: Path) -> None:
        """Write the ranks' output to ``log_dir`` from now on (a gang reused by the next stage)."""
        if self._output is not None:
            self._output.move_to(log_dir)

    def kill(self, grace_s: float = 2.0) -> None:
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in self._pumps:
            t.join(timeout=1.0)
        if self._output is not None and not any(t.is_alive() for t in self._pumps):
            self._output.close()  # else a pump still drains a pipe (a grandchild holds it)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the rank and anything it started
    except (ProcessLookupError, PermissionError):
        pass


class RankOutput:
    """Ranks' output lines to ``log_dir/rank-R.log`` and, prefixed ``[rank R]``, to the console.

    Lines from no rank (rank None: the launcher's own notices, e.g. mpirun's abort message)
    go to ``log_dir/launcher.log`` with the prefix ``[launcher]``.
    """

    def __init__(self, log_dir: Path, echo: Echo):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.echo = echo
        self._files: dict[int | None, IO[bytes]] = {}
        self._lock = threading.Lock()  # several pump threads may open files at once

    def move_to(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
            self.log_dir = log_dir

    def write(self, rank: int | None, line: bytes) -> None:
        log = self._files.get(rank)
        if log is None:
            with self._lock:
                log = self._files.get(rank)
                if log is None:
                    name = f"rank-{rank}.log" if rank is not None else "launcher.log"
                    # unbuffered: the gang reads a failed rank's log tail at once
                    fd = os.open(self.log_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    log = self._files[rank] = os.fdopen(fd, "ab", buffering=0)
        log.write(line)
        if self.echo:
            prefix = f"[rank {rank}] " if rank is not None else "[launcher] "
            text = line.decode(errors="replace").rstrip("\n")
            if not text.startswith(prefix):  # rank loggers already prefix their lines
                text = prefix + text
            if callable(self.echo):
                self.echo(text)
            else:
                print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


# Turns one raw output line (b"" at end of stream) into complete (rank, line) pairs.
LineRouter = Callable[[bytes], Iterable[tuple[int | None, bytes]]]


def start_pump(stream: IO[bytes], output: RankOutput, route: LineRouter, name: str) -> threading.Thread:
    """A daemon thread copying ``stream`` line by line to ``output`` until end of stream."""

    def pump() -> None:
        for line in iter(stream.readline, b""):
            for rank, text in route(line):
                output.write(rank, text)
        for rank, text in route(b""):  # what the router still held (an unterminated line)
            output.write(rank, text)
        stream.close()

    thread = threading.Thread(target=pump, name=name, daemon=True)
    thread.start()
    return thread


def _whole_lines(rank: int) -> LineRouter:
    """One process, one rank: every line is that rank's."""
    return lambda line: [(rank, line)] if line else []
