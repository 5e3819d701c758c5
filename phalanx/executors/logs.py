"""Rank output: one place that writes ranks' lines to their log files and echoes them.

Two sources, one format: ``RankOutput`` + ``start_pump`` copy the pipes of processes this
driver started (local, mpirun) to ``log_dir/rank-R.log``; ``FileFollower`` tails log files
the ranks write themselves on other hosts (srun's ``--output``, a Ray actor's redirected
stdout).  Both echo through ``echo_line``: ``[rank R] text`` to stderr, or to a callable.
``tail`` reads the last lines of a log back, for the message of a rank or driver that failed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from ..private import makedirs, opener
from .base import Echo


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (a rank's, a driver's); "" if it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def echo_line(echo: Echo, rank: int | None, line: bytes | str) -> None:
    """Show one rank line, prefixed ``[rank R]`` (``[launcher]``: the launcher's own)."""
    prefix = f"[rank {rank}] " if rank is not None else "[launcher] "
    text = (line.decode(errors="replace") if isinstance(line, bytes) else line).rstrip("\n")
    if not text.startswith(prefix):  # rank loggers already prefix their lines
        text = prefix + text
    if callable(echo):
        echo(text)
    else:
        print(text, file=sys.stderr, flush=True)


class RankOutput:
    """Ranks' output lines to ``log_dir/rank-R.log`` and, prefixed ``[rank R]``, to the console.

    Lines from no rank (rank None: the launcher's own notices, e.g. mpirun's abort message)
    go to ``log_dir/launcher.log`` with the prefix ``[launcher]``.
    """

    def __init__(self, log_dir: Path, echo: Echo):
        makedirs(log_dir)  # logs are the user's only: 0700 directories, 0600 files
        self.log_dir = log_dir
        self.echo = echo
        self._files: dict[int | None, IO[bytes]] = {}
        self._lock = threading.Lock()  # several pump threads may open files at once

    def move_to(self, log_dir: Path) -> None:
        makedirs(log_dir)
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
                    log = self._files[rank] = open(self.log_dir / name, "ab", buffering=0, opener=opener)
        log.write(line)
        if self.echo:
            echo_line(self.echo, rank, line)

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


def whole_lines(rank: int) -> LineRouter:
    """One process, one rank: every line is that rank's."""
    return lambda line: [(rank, line)] if line else []


class FileFollower(threading.Thread):
    """Echoes whole new lines of the ranks' log files (``paths[r]``: rank r's) every 0.2 s;
    ``move_to`` follows another set (a reused gang writing to the next stage's logs)."""

    def __init__(self, paths: Sequence[Path], echo: Echo, name: str = "phalanx-rank-logs"):
        super().__init__(name=name, daemon=True)
        self.paths, self.echo = list(paths), echo
        self._stop_evt = threading.Event()
        self._files: dict[int, Any] = {}
        self._partial: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.start()

    def run(self) -> None:
        while not self._stop_evt.wait(0.2):
            self._poll()
        self._poll(final=True)
        self._close()

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(timeout=2.0)

    def move_to(self, paths: Sequence[Path]) -> None:
        with self._lock:
            self._poll_locked(final=True)
            self._close()
            self.paths = list(paths)

    def _close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _poll(self, final: bool = False) -> None:
        with self._lock:
            self._poll_locked(final)

    def _poll_locked(self, final: bool) -> None:
        for rank, path in enumerate(self.paths):
            f = self._files.get(rank)
            if f is None:
                try:
                    f = self._files[rank] = open(path, "rb")
                except OSError:
                    continue
            *lines, rest = (self._partial.get(rank, b"") + f.read()).split(b"\n")
            self._partial[rank] = b"" if final else rest
            if final and rest:
                lines.append(rest)
            for line in lines:
                echo_line(self.echo, rank, line)
