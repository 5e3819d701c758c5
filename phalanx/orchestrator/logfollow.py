"""Following a run's rank logs as they grow: ``phalanx logs --follow``, the Airflow trigger, the dashboard.

A rank's output is in ``attempts.log_dir/rank-R.log`` (``phalanx/executors/logs.py`` writes it,
or the rank itself on another host); ``LogCursor`` reads what was added to every such file of a
run since its previous read, without blocking:

    >>> cursor = LogCursor(RunDB(), run_id)            # doctest: +SKIP
    >>> for line in cursor.read():                     # doctest: +SKIP
    ...     print(f"[{line.stage} attempt {line.attempt} rank {line.rank}] {line.text}")

- it picks up the attempts and stages the run starts after it was made (the run database's
  ``attempts`` table, read on every ``read``), and a rank's file that does not exist yet;
- it keeps a byte offset per file and returns complete lines only: a last line without its
  newline waits for it, unless its attempt has ended (then it is whole) or ``read(final=True)``;
- one ``read`` takes at most ``max_bytes`` of the files (``behind`` says there was more: read
  again), in chunks, and holds at most ``MAX_LINE`` bytes of one line (the rest of a longer
  line is dropped, with a note of how much), so a huge log never sits in memory at once.

``follow`` yields the lines of a run until it has ended, then what is left; ``follow_file``
does the same for one file (a detached driver's log).  The module imports nothing heavy, so
that a web dashboard can stream per-rank logs through ``LogCursor`` too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..executors.logs import MAX_LINE
from .rundb import FINAL, RunDB

READ_BYTES = 1 << 20  # the most one ``read`` takes of the files (default)
_CHUNK = 1 << 16  # bytes read from a file at a time
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line a rank wrote (``text``: without its newline); ``rank`` None: the launcher's own
    (``launcher.log``: mpirun's or srun's notices, read with ``LogCursor(..., launcher=True)``)."""

    stage: str
    attempt: int
    rank: int | None
    text: str


class FileTail:
    """The complete lines added to one file since the last ``read``, from a byte offset.

    The file may not exist yet (nothing to read) and may be truncated (read again from its
    start).  ``read`` takes at most ``max_bytes`` and returns ``(lines, more)``: ``more`` when
    the file holds more than was taken."""

    def __init__(self, path: str | Path, offset: int = 0):
        self.path, self.offset = Path(path), offset
        self._line = bytearray()  # the line begun: its newline has not come yet
        self._cut = 0  # bytes of that line not kept (over MAX_LINE)
        self._ino: int | None = None  # the file read so far (another one under its name is new)

    @property
    def pending(self) -> bool:
        """A line begun whose newline has not been read yet."""
        return bool(self._line or self._cut)

    def read(self, max_bytes: int = READ_BYTES, final: bool = False) -> tuple[list[str], bool]:
        """New complete lines (at most ``max_bytes`` read) and whether there is more; ``final``:
        the file is complete, so a last line without its newline is returned too."""
        lines, _, more = self.take(max_bytes, final)
        return lines, more

    def take(self, max_bytes: int, final: bool = False) -> tuple[list[str], int, bool]:
        """``read``, and how many bytes it took."""
        lines: list[str] = []
        taken, more = 0, False
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if size < self.offset or (self._ino is not None and st.st_ino != self._ino):
                    self.offset, self._cut = 0, 0  # truncated, or another file: read it from its start
                    self._line.clear()
                self._ino = st.st_ino
                f.seek(self.offset)
                left = max_bytes
                while left > 0:
                    chunk = f.read(min(_CHUNK, left))
                    if not chunk:
                        break
                    self.offset += len(chunk)
                    taken += len(chunk)
                    left -= len(chunk)
                    self._take(chunk, lines)
                more = self.offset < max(size, os.fstat(f.fileno()).st_size)
        except FileNotFoundError:
            pass
        if final and not more and self.pending:
            lines.append(self._end())
        return lines, taken, more

    def _take(self, chunk: bytes, lines: list[str]) -> None:
        first = chunk.find(b"\n")
        if first < 0:
            self._add(chunk)
            return
        self._add(chunk[:first])  # the end of the line begun
        lines.append(self._end())
        last = chunk.rfind(b"\n")
        if last > first:  # whole lines, each shorter than a chunk (< MAX_LINE): decoded at once
            lines += chunk[first + 1 : last].decode(errors="replace").split("\n")
        self._add(chunk[last + 1 :])

    def _add(self, piece: bytes) -> None:
        keep = max(0, min(len(piece), MAX_LINE - len(self._line)))
        self._line += piece[:keep]
        self._cut += len(piece) - keep

    def _end(self) -> str:
        line = self._line.decode(errors="replace")
        if self._cut:
            line += f" [phalanx: {self._cut} more bytes of this line not shown: a line keeps {MAX_LINE}]"
        self._line.clear()
        self._cut = 0
        return line


@dataclass
class _Attempt:
    stage: str
    attempt: int
    log_dir: Path
    ended: bool = False
    done: bool = False  # ended and every file read to its end: never looked at again
    tails: dict[int | None, FileTail] = field(default_factory=dict)


class LogCursor:
    """A non-blocking cursor over the rank logs of run ``run_id``: each ``read()`` returns the
    complete lines written since the previous one, in the order of the attempts' starts, rank
    by rank (the launcher's lines last).  ``stage``, ``rank``, ``attempt``: only those;
    ``since``: leave out attempts started before this Unix time (an earlier try's);
    ``launcher``: the attempts' ``launcher.log`` too (as rank None)."""

    def __init__(
        self,
        db: RunDB,
        run_id: str,
        stage: str | None = None,
        rank: int | None = None,
        attempt: int | None = None,
        *,
        since: float = 0.0,
        launcher: bool = False,
        max_bytes: int = READ_BYTES,
    ):
        self.db, self.run_id = db, run_id
        self.stage, self.rank, self.attempt = stage, rank, attempt
        self.since, self.launcher, self.max_bytes = since, launcher, max_bytes
        self.behind = False  # the last read stopped at max_bytes with more to read
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._resume: tuple[str, int, int | None] | None = None  # the file a read that ran out stopped in

    def read(self, final: bool = False) -> list[LogLine]:
        """The complete lines written since the last read (at most ``max_bytes`` of the files:
        ``behind`` is then True).  ``final``: the run has ended, every file is complete."""
        self._discover()
        files = [(a, r, t) for a in self._attempts.values() if not a.done for r, t in self._files(a)]
        if self._resume is not None:  # a read that ran out of bytes: start where it stopped
            keys = [(a.stage, a.attempt, r) for a, r, _ in files]
            if self._resume in keys:
                i = keys.index(self._resume)
                files = files[i:] + files[:i]
        out: list[LogLine] = []
        left, self.behind, self._resume = self.max_bytes, False, None
        for a, rank, tail in files:
            if left <= 0:
                self.behind, self._resume = True, (a.stage, a.attempt, rank)
                break
            lines, taken, more = tail.take(left, final=final or a.ended)
            left -= taken
            out += [LogLine(a.stage, a.attempt, rank, text) for text in lines]
            if more:
                self.behind, self._resume = True, (a.stage, a.attempt, rank)
                break
        for a in self._attempts.values():
            if a.ended and not self.behind and not any(t.pending for t in a.tails.values()):
                a.done = True
        return out

    def _discover(self) -> None:
        """The run's attempts (new ones, and which have ended since)."""
        for row in self.db.attempts(self.run_id, self.stage):
            if self.attempt is not None and row["attempt"] != self.attempt:
                continue
            if not row.get("log_dir") or (row.get("started") or 0) < self.since - 1:
                continue
            key = (row["stage"], int(row["attempt"]))
            a = self._attempts.get(key)
            if a is None:
                a = self._attempts[key] = _Attempt(key[0], key[1], Path(row["log_dir"]))
            if row["state"] != "running" and not a.ended:
                a.ended = True  # its files are complete: no more globbing once they are read

    def _files(self, a: _Attempt) -> list[tuple[int | None, FileTail]]:
        if self.rank is not None:
            names: list[tuple[int | None, str]] = [(self.rank, f"rank-{self.rank}.log")]
        else:
            names = []
            try:
                for entry in os.scandir(a.log_dir):
                    stem = entry.name[:-4] if entry.name.endswith(".log") else ""
                    if stem.startswith("rank-") and stem[5:].isdigit():
                        names.append((int(stem[5:]), entry.name))
                    elif self.launcher and stem == "launcher":
                        names.append((None, entry.name))
            except OSError:  # its directory is not there yet
                pass
        for rank, name in names:
            if rank not in a.tails:
                a.tails[rank] = FileTail(a.log_dir / name)
        return sorted(a.tails.items(), key=lambda item: (item[0] is None, item[0] or 0))


def follow(
    db: RunDB,
    run_id: str,
    stage: str | None = None,
    rank: int | None = None,
    attempt: int | None = None,
    *,
    poll_s: float = 0.5,
    until_done: bool = True,
    since: float = 0.0,
    launcher: bool = False,
    on_wait: Callable[[], None] | None = None,
) -> Iterator[LogLine]:
    """The lines of run ``run_id``'s rank logs as they are written, every attempt of every
    stage (``stage``, ``rank``, ``attempt``: only those), read every ``poll_s`` seconds; once
    the run has reached a final state (``rundb.FINAL``), what is left, and then it ends
    (``until_done=False``: never).  ``on_wait`` is called when all there is was yielded, before
    waiting (a printer flushes its output then, not after every line).  Raises ``KeyError`` for
    a run the database does not hold."""
    cursor = LogCursor(db, run_id, stage, rank, attempt, since=since, launcher=launcher)

    def ended() -> bool:
        run = db.run(run_id)
        if run is None:
            raise KeyError(run_id)
        return until_done and run["state"] in FINAL

    yield from _until(lambda final: (cursor.read(final), cursor.behind), ended, poll_s, on_wait)


def follow_file(
    path: str | Path, ended: Callable[[], bool], poll_s: float = 0.5, on_wait: Callable[[], None] | None = None
) -> Iterator[str]:
    """The lines of one growing file (a detached driver's log) until ``ended()`` says its
    writer is done, then the rest of it (``on_wait``: as ``follow``'s)."""
    tail = FileTail(path)
    yield from _until(lambda final: tail.read(READ_BYTES, final), ended, poll_s, on_wait)


def _until(
    read: Callable[[bool], tuple[list[T], bool]],
    ended: Callable[[], bool],
    poll_s: float,
    on_wait: Callable[[], None] | None,
) -> Iterator[T]:
    """What ``read(final)`` returns, every ``poll_s`` s, until ``ended()``; then the rest."""
    while True:
        done = ended()  # asked before reading: what was written before the end is read after it
        while True:
            lines, more = read(done)
            yield from lines
            if not more:
                break
        if on_wait is not None:
            on_wait()
        if done:
            return
        time.sleep(poll_s)
