"""Process helpers every executor and the rank worker share: signals to a process or its
group, the parent-death signal, a process's descendants, whether a pid lives.

One copy of each: the local, mpirun and SLURM launchers, the Ray actor and the worker all stop
processes the same way, so a fix (a zombie that must count as dead, a group that is already
gone) lands everywhere at once.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (the process and what it started); a group
    that is gone, or not ours, is no error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pid(pid: int, sig: int) -> None:
    """``sig`` to one process; one that is gone, or not ours, is no error."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent thread exits (Linux
    PR_SET_PDEATHSIG; a no-op elsewhere).  False when the parent is already gone — the caller
    should exit."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    return os.getppid() == parent and parent != 1


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def descendants(pid: int) -> list[int]:
    """Children, grandchildren... of ``pid`` (Linux /proc; empty elsewhere)."""
    found, todo = [], [pid]
    while todo:
        kids = []
        try:  # every thread's children: a subprocess started from any thread counts
            for task in os.listdir(f"/proc/{todo[0]}/task"):
                with open(f"/proc/{todo[0]}/task/{task}/children") as f:
                    kids += [int(c) for c in f.read().split()]
        except OSError:  # gone already, or not Linux
            pass
        found += kids
        todo = todo[1:] + kids
    return found
