"""Nothing a rank starts outlives its stage.

A rank process makes itself a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a process
its app started that loses its parent — a daemon that double-forks, a child of a child that
exited, one in a session of its own (``setsid``) — is adopted by the rank instead of by init,
so the rank's descendants are all it ever started.  At the end of each app the rank kills those
(``end_descendants``), and the launcher that stops a rank kills the tree it saw under it
(``tree`` before, ``kill_tree`` after), for a rank killed in the middle of an app.

Processes are named by pid and start time (``/proc/<pid>/stat`` field 22), so a pid that was
reused meanwhile is left alone.  On other systems (no /proc, no subreaper) it all does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping

from ..procs import descendants

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def tree(pid: int) -> dict[int, int]:
    """The descendants of ``pid``: pid → start time."""
    out = {}
    for child in descendants(pid):
        stat = _stat(child)
        if stat is not None:
            out[child] = stat[1]
    return out


def kill_tree(procs: Mapping[int, int], sig: int = signal.SIGKILL) -> None:
    """``sig`` to each process of ``procs`` (pid → start time, from ``tree``) that still runs
    and is still the process that was seen (not a reused pid)."""
    for pid, started in procs.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == started and stat[0] != "Z":
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def keep_alive() -> set[int]:
    """Helpers of this interpreter that live as long as it does and end with it (multiprocessing's
    resource tracker and fork server): an app's later use would only start them again."""
    keep = set()
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    if tracker is not None:
        keep.add(getattr(getattr(tracker, "_resource_tracker", None), "_pid", None))
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is not None:
        keep.add(getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None))
    return {pid for pid in keep if isinstance(pid, int)}


def end_descendants(keep: Iterable[int] = (), within_s: float = 5.0) -> list[int]:
    """SIGKILL every descendant of this process but ``keep`` (and ``keep_alive()``), again while
    new ones appear (one that forked meanwhile), until none is left running; reaps those that
    were this process's children.  Returns the pids it killed."""
    me = os.getpid()
    spare = set(keep) | keep_alive()
    killed: dict[int, int] = {}
    deadline = time.monotonic() + within_s
    while True:
        running = False
        for pid, started in tree(me).items():
            if pid in spare:
                continue
            stat = _stat(pid)
            if stat is None or stat[1] != started:
                continue
            if stat[0] == "Z":  # dead: reap it if it is ours (adopted orphans are)
                if pid in killed:
                    _reap(pid)
                continue
            running = True
            if pid not in killed:
                killed[pid] = started
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if not running or time.monotonic() > deadline:
            return list(killed)
        time.sleep(0.005)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (a grandchild's zombie: its parent reaps it)
        pass
