"""A failed rank's traceback as the notebook's traceback of the cell.

IPython shows an exception through its ``_render_traceback_`` when it has one (ipyparallel's
remote errors do the same): ``attach`` gives a ``RankError`` one that shows the cause first —
the failing rank's own traceback, coloured as a notebook colours a local one — then the other
failed ranks (one line each when their traceback is the same).  The frames of phalanx's wrappers
are left out, and where the rank could not read a line of source (a function defined in a
notebook cell, a ``%%px`` cell) the driver's copy of the cell fills it in.
"""

from __future__ import annotations

import linecache
import os
import re

from ...errors import RankError

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.*)$')
_HIDDEN = (
    os.path.join("phalanx", "runtime", "worker.py"),
    os.path.join("phalanx", "integrations", "jupyter", "ranks.py"),
)
RED, BOLD, RESET = "\x1b[0;31m", "\x1b[1m", "\x1b[0m"


def attach(err: RankError, note: str | None = None) -> RankError:
    """Make IPython show ``err`` as the failing ranks' tracebacks."""
    err._render_traceback_ = lambda: render(err, note)  # type: ignore[attr-defined]
    return err


def attach_interrupt(exc: KeyboardInterrupt, message: str) -> KeyboardInterrupt:
    """Make IPython show an interrupted run as ``message`` alone: the driver's frames where the
    interrupt found it waiting (the gang's event queue, a lock) say nothing about the ranks."""
    exc._render_traceback_ = lambda: [f"{RED}KeyboardInterrupt{RESET}: {message}"]  # type: ignore[attr-defined]
    return exc


def render(err: RankError, note: str | None = None) -> list[str]:
    head = str(err).split("\n--- traceback of rank", 1)[0]
    stb = [f"{RED}RankError{RESET}: {head}"]
    if note:
        stb.append(note)
    ordered = sorted(err.failures, key=lambda f: (f is not err.first, f.collateral, f.rank))
    shown: dict[str, int] = {}
    for f in ordered:
        what = f"rank {f.rank}: {f.exc_type + ': ' if f.exc_type else ''}{f.message}" if f.rank >= 0 else f.message
        tb = clean(f.traceback)
        same = shown.get(tb)
        if same is not None:
            stb.append(f"{BOLD}--- {what}{RESET} (the same traceback as rank {same})")
            continue
        stb.append("")
        stb.append(f"{BOLD}--- {what}{RESET}")
        if tb:
            shown[tb] = f.rank
            stb.append(colour(tb))
    return stb


def clean(tb: str) -> str:
    """The traceback text without phalanx's wrapper frames, with the driver's source lines where
    the rank had none."""
    if not tb:
        return ""
    lines = tb.rstrip("\n").split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _FRAME.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        body = []
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):
            body.append(lines[j])
            j += 1
        if not any(m["file"].endswith(h) for h in _HIDDEN):
            if not body:
                source = linecache.getline(m["file"], int(m["line"])).strip()
                body = [f"    {source}"] if source else []
            out += [lines[i], *body]
        i = j
    return "\n".join(out)


def colour(tb: str) -> str:
    try:
        from pygments import highlight
        from pygments.formatters import TerminalFormatter
        from pygments.lexers import PythonTracebackLexer

        return highlight(tb, PythonTracebackLexer(), TerminalFormatter()).rstrip("\n")
    except Exception:  # no pygments: plain text
        return tb


def register_source(filename: str, code: str) -> None:
    """Keep a cell's code where ``clean`` (and the debugger) look for it."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


__all__ = ["attach", "attach_interrupt", "clean", "register_source", "render"]
