"""Nothing a rank starts outlives its stage.

A rank process makes itself a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a process
its app started that loses its parent — a daemon that double-forks, a child of a child that
exited, one in a session of its own (``setsid``) — is adopted by the rank instead of by init,
so the rank's descendants are all it ever started.  At the end of each app the rank kills those
(``end_descendants``), and the launcher that stops a rank kills the tree it saw under it
(``tree`` before, ``kill_tree`` after), for a rank killed in the middle of an app.

Processes are named by pid and start time and signalled through ``procs.signal_same_process``,
so a pid that was reused meanwhile is left alone.  On other systems (no /proc, no subreaper) it all does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping

from ..procs import boot_id, descendants, pid_alive, signal_same_process, start_time

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


def tree(pid: int) -> dict[int, int]:
    """The descendants of ``pid``: pid → start time."""
    out = {}
    for child in descendants(pid):
        started = start_time(child)
        if started is not None:
            out[child] = started
    return out


def kill_tree(procs: Mapping[int, int], sig: int = signal.SIGKILL) -> None:
    """``sig`` to each process of ``procs`` (pid → start time, from ``tree``) that still runs
    and is still the process that was seen (not a reused pid)."""
    boot = boot_id()
    for pid, started in procs.items():
        try:
            signal_same_process(pid, started, boot, sig)
        except PermissionError:  # not ours to signal (a setuid program)
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
    boot = boot_id()
    killed: set[int] = set()
    deadline = time.monotonic() + within_s
    while True:
        running = False
        for pid, started in tree(me).items():
            if pid in spare:
                continue
            if not pid_alive(pid):  # dead: reap it if it is ours (adopted orphans are)
                if pid in killed:
                    _reap(pid)
                continue
            if pid not in killed:
                try:
                    if signal_same_process(pid, started, boot, signal.SIGKILL):
                        killed.add(pid)
                except PermissionError:  # not ours to kill (a setuid program): leave it be
                    spare.add(pid)
                    continue
            running = True
        if not running or time.monotonic() > deadline:
            return sorted(killed)
        time.sleep(0.005)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (a grandchild's zombie: its parent reaps it)
        pass
