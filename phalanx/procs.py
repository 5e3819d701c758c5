"""Process helpers every executor and the rank worker share: signals to a process or its
group, the parent-death signal, a process's descendants, whether a pid lives — and, for a
process recorded to be found again later (a run's driver), whether a pid is still that process.

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


# ---- a process recorded for later: pid, start time and boot ------------------------------------
# A pid alone names a process only while it lives: once it ended, the kernel may give the pid to
# any new process.  (pid, start time, boot id) names one process for good: the start time
# (/proc/PID/stat field 22, clock ticks since boot) tells the pid's owners of one boot apart,
# the boot id (/proc/sys/kernel/random/boot_id) the boots.


def boot_id() -> str | None:
    """This boot of this host's id (Linux); None elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux /proc; None when it is
    gone or elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22; fields 3.. follow ")"
    except (OSError, ValueError, IndexError):
        return None


def same_process(pid: int, started: int | None, boot: str | None) -> bool | None:
    """Whether ``pid`` still is the process recorded with start time ``started`` in boot
    ``boot`` (both as ``start_time`` and ``boot_id`` gave them), and runs: True it is; False it
    is gone (no such pid, a zombie, another boot, or a process started at another time owns the
    pid now); None when that cannot be told: the pid runs but the record has no start time or
    boot (an older record), or this system does not say.  A caller that would signal it must
    treat None as "not ours"."""
    if not pid_alive(pid):
        return False
    if started is None or not boot:
        return None
    now_boot = boot_id()
    if now_boot is not None and now_boot != boot:
        return False
    now = start_time(pid)
    if now is None or now_boot is None:
        return None
    return now == started


def signal_same_process(pid: int, started: int | None, boot: str | None, sig: int) -> bool:
    """``sig`` to ``pid`` only if it is still the process recorded (``same_process`` is True);
    True if sent.  On Linux the check and the signal go through one pidfd, so a pid that
    changes owner between them is not signalled either."""
    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:  # an older kernel: check, then signal by pid
            fd = None
    try:
        if same_process(pid, started, boot) is not True:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


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
