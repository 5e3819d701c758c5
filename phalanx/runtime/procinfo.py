"""A process's memory as /proc tells it: one reading for the driver's memory watch (the local
executor's ``MemoryWatch``) and for what a notebook shows of a gang's ranks, so that both speak
of the same number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Memory:
    """Bytes of one process's memory.

    ``private`` (RssAnon) is the number users see and the one a rank's memory limit counts:
    what the rank itself allocated and holds in RAM.  VmRSS would add pages shared with other
    processes — the store's shared memory a rank maps zero-copy, the Python and library code
    every rank maps — counted again in each rank and not freed by ending it.  The kernel keeps
    no peak of RssAnon: ``peak`` (VmHWM) is the resident set's, shared pages included.
    """

    private: int
    peak: int


def memory(pid: int | None) -> Memory | None:
    """The memory of a live process of this host; None once it has exited (or is unknown)."""
    if not pid:
        return None
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    if "RssAnon" not in found:  # Linux before 4.5, or not Linux
        return None
    return Memory(private=found["RssAnon"], peak=found.get("VmHWM", found["RssAnon"]))


__all__ = ["Memory", "memory"]
