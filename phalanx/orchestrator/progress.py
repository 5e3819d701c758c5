"""Live progress of a run: one line per stage with its state, ranks, attempt, elapsed time and
rows produced — a rich table on a terminal, plain timestamped event lines otherwise (CI logs,
files, pipes), so that both read well.

A fan-out's instances (``sweep.0``, ``sweep.1``...) are rows of their own, right under their
template's row, which says how many instances it was expanded into: a static fan-out's from
the start (the scheduler expands it before the run), one over rows when the scheduler says
so (its ``fan-out`` event)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from ..redact import redact
from .fanout import expand_static, instance_name
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
    "expanded": "dim cyan",
}


# events that say what one stage does (the others: the run's, a site's, a crossing's...)
_STAGE_EVENTS = ("start", "succeeded", "failed", "skipped", "reused", "cached", "cancelled", "retry")


@dataclass
class _Row:
    ranks: int | None  # None: not known (a stage the workflow did not name)
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
        self.rows: dict[str, _Row] = {name: _Row(st.ranks) for name, st in self.wf.stages.items()}
        expanded = expand_static(self.wf)  # as the scheduler runs it: static fan-outs' instances
        for name in self.wf.stages:
            made = [s for s in expanded.stages if expanded.template_of(s) == name and s != name]
            if made:
                self._expand(name, made, {s: expanded.stages[s].ranks for s in made})
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
        if kind == "fan-out" and stage in self.rows:  # "3 instances over the rows of 'configs'"
            count = message.split(" ", 1)[0]
            if count.isdigit():
                self._expand(stage, [instance_name(stage, i) for i in range(int(count))], {}, message)
        row = self._row(stage) if stage and kind in _STAGE_EVENTS else self.rows.get(stage)
        if row is not None:
            if kind == "start":
                row.state, row.attempt, row.started, row.ended = "running", row.attempt + 1, now, None
                row.note = ""
            elif kind in ("succeeded", "failed", "skipped", "reused", "cached", "cancelled"):
                row.state, row.ended, row.note = kind, now, message
            elif kind == "retry" and " — retrying in " in message:  # by its retry policy (retry.py)
                row.state, row.note = "retrying", message
        if not self.live:
            print(f"[{now - self.t0:7.1f}s] {stage:<16} {kind:<9} {message}", file=self.out, flush=True)

    def _expand(self, template: str, made: list[str], ranks: dict[str, int], note: str = "") -> None:
        """``template``'s row says it was expanded; its instances' rows follow it, in order."""
        row = self.rows[template]
        row.state = "expanded"
        row.note = note or f"{len(made)} instance{'' if len(made) == 1 else 's'}"
        new = {n: self.rows.get(n) or _Row(ranks.get(n, row.ranks)) for n in made}
        rows: dict[str, _Row] = {}
        for name, r in self.rows.items():
            if name not in new:
                rows[name] = r
            if name == template:
                rows.update(new)
        self.rows = rows

    def _row(self, stage: str) -> _Row:
        """``stage``'s row; a stage no row names (an instance the table was not told of) gets
        one, after its template's instances (``sweep.7`` after ``sweep.6``), else at the end."""
        row = self.rows.get(stage)
        if row is not None:
            return row
        template = stage.rpartition(".")[0]
        parent = self.rows.get(template) if template else None
        row = _Row(parent.ranks if parent is not None else None)
        if parent is None:
            self.rows[stage] = row
            return row
        names = list(self.rows)
        at = names.index(template) + 1
        while at < len(names) and names[at].startswith(template + "."):
            at += 1
        items = list(self.rows.items())
        self.rows = dict([*items[:at], (stage, row), *items[at:]])
        return row

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
                "" if row.ranks is None else str(row.ranks),
                str(row.attempt or ""),
                took,
                row.note[:80],
            )
        return table
