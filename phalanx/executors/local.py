"""Local executor: the ranks of a gang are processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from .base import Launcher


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, echo: bool | Callable[[str], None] = True, pin: bool = True):
        self.echo = echo
        self.pin = pin
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []

    def placement(self, world_size: int) -> list[dict[str, str]]:
        """Disjoint CPU sets when the gang fits the cores; threads split evenly either way."""
        cpus = usable_cpus()
        threads = max(1, len(cpus) // world_size)
        out = []
        for r in range(world_size):
            env = {"PHALANX_THREADS": str(threads)}
            if self.pin and world_size <= len(cpus):
                env["PHALANX_CPUS"] = ",".join(map(str, cpus[r * threads:(r + 1) * threads]))
            out.append(env)
        return out

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        for rank, extra in enumerate(rank_env):
            env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the driver, which stops the gang
            )
            self.procs.append(proc)
            pump = threading.Thread(target=_pump, name=f"phalanx-log-rank{rank}", daemon=True,
                                    args=(proc.stdout, rank, log_dir / f"rank-{rank}.log", self.echo))
            pump.start()
            self._pumps.append(pump)

    def exitcodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

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


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the rank and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _pump(stream: IO[bytes], rank: int, log_path: Path,
          echo: bool | Callable[[str], None]) -> None:
    """Copy a rank's output to its log file and, prefixed with its rank, to the console."""
    prefix = f"[rank {rank}] "
    with open(log_path, "ab", buffering=0) as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            if echo:
                text = line.decode(errors="replace").rstrip("\n")
                if not text.startswith(prefix):
                    text = prefix + text
                if callable(echo):
                    echo(text)
                else:
                    print(text, file=sys.stderr, flush=True)
    stream.close()
