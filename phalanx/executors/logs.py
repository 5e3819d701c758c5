"""Rank output: one place that writes ranks' lines to their log files and echoes them.

Two sources, one format: ``RankOutput`` + ``start_pump`` copy the pipes of processes this
driver started (local, mpirun) to ``log_dir/rank-R.log``; ``FileFollower`` tails log files
the ranks write themselves on other hosts (srun's ``--output``, a Ray actor's redirected
stdout).  Both echo through ``echo_line``: ``[rank R] text`` to stderr, or to a callable.
``tail`` reads the last lines of a log back, for the message of a rank or driver that failed.

A pump holds at most ``MAX_LINE`` bytes of one line (it reads in chunks of ``_CHUNK``): the
rest of a longer line is not kept, and the line ends with a note of how much was cut.  A log
that cannot be written (a full disk) does not stop the pump: it goes on draining the pipe, so
the rank never blocks on its output; the lines are counted, a warning names the file and the
error, and the log says how many lines are missing once it can be written again.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from ..private import makedirs, opener
from .base import Echo

log = logging.getLogger("phalanx.executors")

MAX_LINE = 1 << 20  # bytes of one output line a log keeps (and a pump holds)
_CHUNK = 1 << 16  # bytes a pump reads at a time
_SYNC_S = 10.0  # the most a stage's end waits for the pumps to write what its ranks wrote


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
        self._lost: dict[int | None, list[int]] = {}  # rank → [lines, bytes] its log could not take
        self._lock = threading.Lock()  # several pump threads may open files at once

    def move_to(self, log_dir: Path) -> None:
        makedirs(log_dir)
        with self._lock:
            self._close_files()
            self.log_dir = log_dir

    def path(self, rank: int | None) -> Path:
        return self.log_dir / (f"rank-{rank}.log" if rank is not None else "launcher.log")

    def write(self, rank: int | None, line: bytes) -> None:
        try:
            f = self._files.get(rank)
            if f is None:
                with self._lock:
                    f = self._files.get(rank)
                    if f is None:
                        # unbuffered: the gang reads a failed rank's log tail at once
                        f = self._files[rank] = open(self.path(rank), "ab", buffering=0, opener=opener)
            if rank in self._lost:
                self._note_lost(rank, f)
            f.write(line)
        except OSError as exc:  # a full disk, a log directory removed...: count the line, go on
            self._lose(rank, line, exc)
        if self.echo:
            echo_line(self.echo, rank, line)

    def _lose(self, rank: int | None, line: bytes, exc: OSError) -> None:
        counts = self._lost.setdefault(rank, [0, 0])
        if counts == [0, 0]:
            why = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
            log.warning(
                "cannot write %s's output to %s: %s (%s); its lines are dropped, and counted, "
                "until the log can be written again",
                f"rank {rank}" if rank is not None else "the launcher",
                self.path(rank),
                why,
                errno.errorcode.get(exc.errno or 0, "error"),
            )
        counts[0] += 1
        counts[1] += len(line)

    def _note_lost(self, rank: int | None, f: IO[bytes]) -> None:
        lines, size = self._lost[rank]
        f.write(
            f"[phalanx: {lines} line(s), {size} bytes, of output were lost here: the log could not be written]\n".encode()
        )
        del self._lost[rank]

    def _close_files(self) -> None:
        for rank, f in self._files.items():
            try:
                if rank in self._lost:
                    self._note_lost(rank, f)
            except OSError:
                pass
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()
        self._lost.clear()

    def close(self) -> None:
        with self._lock:
            self._close_files()


# Turns one raw output line (b"" at end of stream) into complete (rank, line) pairs.
LineRouter = Callable[[bytes], Iterable[tuple[int | None, bytes]]]


class Pump(threading.Thread):
    """A daemon thread copying ``stream`` to ``output`` line by line until end of stream.

    It reads in chunks and holds at most ``MAX_LINE`` bytes of a line: the rest of a longer
    line is dropped and the line ends with a note of how many bytes were.  ``sync`` waits until
    what the process has written so far is in its log (the line it has begun too): the output
    of a stage is in that stage's log before the next stage's begins."""

    def __init__(self, stream: IO[bytes], output: RankOutput, route: LineRouter, name: str):
        super().__init__(name=name, daemon=True)
        self.stream, self.output, self.route = stream, output, route
        self._fd = stream.fileno()
        self._wake_r, self._wake_w = os.pipe()
        self._line = bytearray()
        self._cut = 0  # bytes of the current line not kept
        self._syncs: list[threading.Event] = []
        self._lock = threading.Lock()
        self._ended = False

    def run(self) -> None:
        poller = select.poll()  # (not select: a driver may hold descriptors numbered over 1023)
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if ready.get(self._fd) and not self._read(_CHUNK):
                    break  # end of stream (POLLHUP with nothing left to read)
                if ready.get(self._wake_r):
                    os.read(self._wake_r, 4096)
                    self._sync()
        finally:
            with self._lock:
                self._ended = True
                os.close(self._wake_w)
            self._flush()
            self.stream.close()
            self._release()
            os.close(self._wake_r)

    def sync(self, timeout: float = _SYNC_S) -> bool:
        """Wait until all the stream holds now is written to the output; False if the pump
        did not get there within ``timeout`` seconds."""
        return self.request_sync().wait(timeout)

    def request_sync(self) -> threading.Event:
        """An event set once all the stream holds now is written to the output."""
        done = threading.Event()
        with self._lock:
            if self._ended:
                done.set()
            else:
                self._syncs.append(done)
                os.write(self._wake_w, b"x")
        return done

    def _sync(self) -> None:
        buf = bytearray(4)
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, buf)
            waiting = int.from_bytes(buf, sys.byteorder)
        except OSError:
            waiting = 0
        while waiting > 0:  # what was in the pipe when asked, not what comes after
            got = self._read(min(waiting, _CHUNK))
            if not got:
                break
            waiting -= got
        self._flush()
        self._release()

    def _release(self) -> None:
        with self._lock:
            syncs, self._syncs = self._syncs, []
        for done in syncs:
            done.set()

    def _read(self, size: int) -> int:
        chunk = os.read(self._fd, size)
        *lines, rest = chunk.split(b"\n")
        for line in lines:
            self._add(line)
            self._emit(b"\n")
        self._add(rest)
        return len(chunk)

    def _add(self, piece: bytes) -> None:
        keep = max(0, min(len(piece), MAX_LINE - len(self._line)))
        self._line += piece[:keep]
        self._cut += len(piece) - keep

    def _emit(self, end: bytes) -> None:
        line = bytes(self._line)
        if self._cut:
            line += f" [phalanx: {self._cut} more bytes of this line not kept: a log line keeps {MAX_LINE}]".encode()
        self._line.clear()
        self._cut = 0
        if line or end:
            for rank, text in self.route(line + end):
                self.output.write(rank, text)

    def _flush(self) -> None:
        """The line begun (unterminated) and what the router still holds."""
        if self._line or self._cut:
            self._emit(b"")
        for rank, text in self.route(b""):
            self.output.write(rank, text)


def sync_pumps(pumps: Sequence[Pump], timeout: float = _SYNC_S) -> bool:
    """``Pump.sync`` on all of ``pumps`` at once; False if one did not get there in time."""
    waits = [pump.request_sync() for pump in pumps]
    deadline = time.monotonic() + timeout
    return all(done.wait(max(0.0, deadline - time.monotonic())) for done in waits)


def start_pump(stream: IO[bytes], output: RankOutput, route: LineRouter, name: str) -> Pump:
    """A started ``Pump`` copying ``stream`` to ``output``."""
    pump = Pump(stream, output, route, name)
    pump.start()
    return pump


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
