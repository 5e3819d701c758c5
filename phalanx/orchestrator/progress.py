"""Live progress of a run: one line per stage with its state, ranks, attempt, elapsed time and
rows produced — a rich table on a terminal, plain timestamped event lines otherwise (CI logs,
files, pipes), so that both read well."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from ..redact import redact
from .models import Workflow

if TYPE_CHECKING:
    from rich.live import Live

_STYLE = {
    "pending": "dim",
    "running": "bold yellow",
    "succeeded": "green",
    "reused": "cyan",
    "cached": "cyan",
    "failed": "bold red",
    "retrying": "yellow",
    "skipped": "dim red",
    "cancelled": "red",
}


@dataclass
class _Row:
    ranks: int
    state: str = "pending"
    attempt: int = 0
    started: float | None = None
    ended: float | None = None
    note: str = ""


@dataclass
class RunProgress:
    """Callable as the scheduler's ``on_event(stage, kind, message)``; use as a context manager."""

    wf: Workflow
    out: TextIO = field(default_factory=lambda: sys.stdout)
    live: bool | None = None  # None: a rich table when ``out`` is a terminal
    run_id: str = ""

    def __post_init__(self) -> None:
        self.t0 = time.monotonic()
        self.rows = {name: _Row(st.ranks) for name, st in self.wf.stages.items()}
        if self.live is None:
            self.live = self.out.isatty()
        self._live: Live | None = None

    def __enter__(self) -> RunProgress:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                get_renderable=self._table, console=Console(file=self.out), refresh_per_second=4, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def __call__(self, stage: str, kind: str, message: str) -> None:
        now, message = time.monotonic(), redact(message)
        if kind == "run":
            self.run_id = message
        row = self.rows.get(stage)
        if row is not None:
            if kind == "start":
                row.state, row.attempt, row.started, row.ended = "running", row.attempt + 1, now, None
                row.note = ""
            elif kind in ("succeeded", "failed", "skipped", "reused", "cached", "cancelled"):
                row.state, row.ended, row.note = kind, now, message
                if kind == "failed" and "attempt" in message and row.attempt <= self.wf.stages[stage].retries:
                    row.state = "retrying"
        if not self.live:
            print(f"[{now - self.t0:7.1f}s] {stage:<16} {kind:<9} {message}", file=self.out, flush=True)

    def _table(self):
        from rich.table import Table

        title = f"run {self.run_id}  ·  {time.monotonic() - self.t0:.1f}s" if self.run_id else self.wf.name
        table = Table(title=title, title_justify="left", expand=False)
        for col in ("stage", "state", "ranks", "attempt", "elapsed", ""):
            table.add_column(col, justify="right" if col in ("ranks", "attempt", "elapsed") else "left")
        now = time.monotonic()
        for name, row in self.rows.items():
            took = ""
            if row.started is not None:
                took = f"{(row.ended or now) - row.started:.1f}s"
            table.add_row(
                name,
                f"[{_STYLE.get(row.state, '')}]{row.state}[/]",
                str(row.ranks),
                str(row.attempt or ""),
                took,
                row.note[:80],
            )
        return table
