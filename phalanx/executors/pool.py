"""Warm rank processes: started ahead of need, heavy imports done, waiting for a gang.

Most of a local gang's start is each rank importing torch (1–4 s of CPU a process on this
class of machine) — longer than a trivial stage's work.  A workflow run keeps a few worker
processes that have already imported what ranks need; a gang that starts takes them and sends
each its rank environment on stdin (``python -m phalanx.runtime.worker --warm``), and the pool
starts replacements in the background.  Stages still get fresh processes: a warm worker
serves exactly one gang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from ..runtime.envvars import ENV_PDEATHSIG, ENV_PRELOAD

WARM_ARGV = (sys.executable, "-m", "phalanx.runtime.worker", "--warm")


class WarmPool:
    """Keeps up to ``size`` idle warm workers (``preload``: modules they import while waiting).

    ``demand()`` says how many rank processes are still to be asked for (the ranks of stages
    not started yet): the pool never warms more than that, so no import is wasted at the end.
    """

    def __init__(
        self,
        size: int,
        demand: Callable[[], int] | None = None,
        preload: Sequence[str] = ("pyarrow", "polars", "phalanx.runtime.comm.tcp"),
    ):
        self.size = size
        self.demand = demand or (lambda: size)
        self.preload = list(preload)
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self._fill()

    def _spawn(self) -> subprocess.Popen:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            ENV_PDEATHSIG: "1",
            ENV_PRELOAD: ",".join(self.preload),
        }
        return subprocess.Popen(
            list(WARM_ARGV),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _fill(self) -> None:
        with self._lock:
            self._idle = [p for p in self._idle if p.poll() is None]
            target = min(self.size, self.demand())
            while not self._closed and len(self._idle) < target:
                self._idle.append(self._spawn())

    def take(self, n: int) -> list[subprocess.Popen]:
        """Up to ``n`` idle workers (fewer if the pool has fewer); replacements start at once."""
        with self._lock:
            live = [p for p in self._idle if p.poll() is None]
            taken, self._idle = live[:n], live[n:]
        if taken:
            threading.Thread(target=self._fill, name="phalanx-warm-pool", daemon=True).start()
        return taken

    def close(self) -> None:
        """Idle workers exit when their stdin closes; kill any that linger."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for p in idle:
            try:
                if p.stdin is not None:  # (always: workers start with stdin=PIPE)
                    p.stdin.close()
            except OSError:
                pass
        for p in idle:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def hand_over(proc: subprocess.Popen, env: dict[str, str]) -> None:
    """Give a warm worker its rank environment; it then runs as any started rank does."""
    assert proc.stdin is not None, "a warm worker starts with stdin=PIPE (WarmPool._spawn)"
    proc.stdin.write(json.dumps(env).encode() + b"\n")
    proc.stdin.close()
