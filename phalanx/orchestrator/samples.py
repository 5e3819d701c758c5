"""Per-rank resource samples of a run's stages: recorded while a stage runs, read by status and
the report.

The ranks send them (``runtime.sampler``: CPU, memory, bytes and seconds in collectives); the
driver's control server hands them to ``SampleRecorder``, which writes them to the run
database's ``samples`` table in batches: at most one transaction per stage attempt per sampling
interval, and a failed write never fails the stage.  ``rank_lines`` and ``straggler`` turn the
newest sample of each rank into what ``phalanx status`` prints and the report shows.
"""

from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runtime.sampler import interval_s

if TYPE_CHECKING:
    from ..runtime import protocol as P
    from .rundb import RunDB

log = logging.getLogger("phalanx.samples")

STRAGGLER_RATIO = 1.5  # a rank's compute time over the median of the others' ...
STRAGGLER_LEAD_S = 0.2  # ... and at least this many seconds more: the straggler
_MB = 1e6


class SampleRecorder:
    """Collects one stage attempt's samples (``add``, called from the control server's reader
    threads) and writes them to the run database every ``every_s`` seconds and on ``close``."""

    def __init__(self, db: RunDB, run_id: str, stage: str, attempt: int, every_s: float | None = None):
        self.db, self.run_id, self.stage, self.attempt = db, run_id, stage, attempt
        try:
            self.every_s = interval_s() if every_s is None else every_s
        except ValueError:  # the gang refuses to start and says why
            self.every_s = 0.0
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._warned = False
        self._thread: threading.Thread | None = None
        if self.every_s > 0:
            self._thread = threading.Thread(target=self._loop, name=f"phalanx-samples-{stage}", daemon=True)
            self._thread.start()

    def add(self, sample: P.Sample) -> None:
        with self._lock:
            self._rows.append(row_of(sample))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        try:
            self.db.add_samples(self.run_id, self.stage, self.attempt, rows)
        except Exception as exc:  # a busy or full database: the samples are lost, not the stage
            if not self._warned:
                self._warned = True
                log.warning("stage %s: could not record resource samples in %s: %s", self.stage, self.db.path, exc)

    def close(self) -> None:
        """Stop the writer and write what is left (the ranks' final samples)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()


def row_of(sample: P.Sample) -> dict:
    """A ``samples`` row (without run, stage and attempt) from a rank's sample."""
    return {
        "rank": sample.rank,
        "ts": sample.ts,
        "host": sample.host,
        "cpu": sample.cpu,
        "rss": sample.rss,
        "peak_rss": sample.peak_rss,
        "sent": sample.sent,
        "received": sample.received,
        "comm_s": sample.comm_s,
        "elapsed": sample.elapsed,
    }


# ---- what status and the report show ------------------------------------------------------
def latest_attempts(rows: list[dict]) -> dict[str, list[dict]]:
    """Per stage, the rows of its latest sampled attempt (``RunDB.samples`` rows), by rank."""
    newest: dict[str, int] = {}
    for r in rows:
        newest[r["stage"]] = max(newest.get(r["stage"], r["attempt"]), r["attempt"])
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["attempt"] == newest[r["stage"]]:
            out.setdefault(r["stage"], []).append(r)
    for stage_rows in out.values():
        stage_rows.sort(key=lambda r: (r["rank"], r["ts"]))
    return out


def compute_s(row: dict) -> float:
    """Seconds of the task outside collectives."""
    return max(0.0, (row["elapsed"] or 0.0) - (row["comm_s"] or 0.0))


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float  # its seconds outside collectives
    median_s: float  # the median of the other ranks'

    def __str__(self) -> str:
        return f"straggler: rank {self.rank} computed {self.compute_s:.2f}s, the others {self.median_s:.2f}s (median)"


def straggler(latest: list[dict]) -> Straggler | None:
    """The rank whose compute time (elapsed - time in collectives) is much larger than the
    others' median (``STRAGGLER_RATIO`` times and ``STRAGGLER_LEAD_S`` more): the rank the
    others waited for.  None with one rank or when no rank stands out."""
    if len(latest) < 2:
        return None
    slowest = max(latest, key=compute_s)
    median = statistics.median(compute_s(r) for r in latest if r is not slowest)
    mine = compute_s(slowest)
    if mine > STRAGGLER_RATIO * median and mine - median >= STRAGGLER_LEAD_S:
        return Straggler(slowest["rank"], mine, median)
    return None


def comm_share(row: dict) -> float:
    """Percent of the task's time spent in collectives."""
    elapsed = row["elapsed"] or 0.0
    return 100.0 * min(row["comm_s"] or 0.0, elapsed) / elapsed if elapsed > 0 else 0.0


def rank_line(row: dict) -> str:
    """One rank's newest sample, compactly: CPU, memory, traffic, share of time in collectives."""
    return (
        f"rank {row['rank']:<3} {row['host'] or '?'}  cpu {row['cpu'] or 0:5.0f}%  "
        f"rss {(row['rss'] or 0) / _MB:,.0f} MB (peak {(row['peak_rss'] or 0) / _MB:,.0f})  "
        f"sent {(row['sent'] or 0) / _MB:,.1f} MB  recv {(row['received'] or 0) / _MB:,.1f} MB  "
        f"comm {comm_share(row):.0f}% of {row['elapsed'] or 0:.1f}s"
    )


def rank_lines(latest: list[dict], most: int = 16) -> list[str]:
    """``rank_line`` for each rank (at most ``most``: the slowest first beyond that), the
    straggler marked, then a line naming it."""
    slow = straggler(latest)
    shown = latest if len(latest) <= most else sorted(latest, key=compute_s, reverse=True)[:most]
    lines = [rank_line(r) + ("  ← straggler" if slow and r["rank"] == slow.rank else "") for r in shown]
    if len(shown) < len(latest):
        lines.append(f"... {len(latest) - len(shown)} more ranks (the {most} with the most compute time shown)")
    if slow is not None:
        lines.append(str(slow))
    return lines


__all__ = ["SampleRecorder", "Straggler", "latest_attempts", "rank_line", "rank_lines", "row_of", "straggler"]
