"""radical.utils' id counters: where their files go, and closing each file once.

``radical.utils.ids`` reads ``RADICAL_BASE`` once, when it is imported, so the counters of the
sessions this process makes went to ``~/.radical/utils`` whatever the session's environment
said; ``in_session_base()`` points them at the session's own base while RP makes its ids.

radical.utils' id counters close their file twice; here the second close closes nothing.

``radical.utils.generate_id`` keeps the counters of ids such as ``tmgr.%(item_counter)04d``
(a TaskManager's) and RP's session ids in files, and its ``_read_file_counter`` closes each
one twice: ``os.close(fd)`` in a ``try`` and again in its ``finally`` (radical.utils 1.103,
still so upstream).  Between the two, another thread of the process may open a file and get
the same descriptor number; the second close then closes that file under it, and its next
write fails with ``OSError: [Errno 9] Bad file descriptor`` (RP's profiles and logs, written by
its threads), or goes to whatever file takes the number next.  phalanx makes a TaskManager per
pilot while other runs' pilots and RP's threads are busy, so it hit this now and then.

``install()`` gives ``radical.utils.ids`` an ``os`` whose ``close`` of a descriptor this thread
closed already (and has not opened again) fails with EBADF — what ``os.close`` does when no
other thread took the number, and what radical.utils ignores there — instead of closing it.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _ClosesOnce:
    """``os`` as ``radical.utils.ids`` uses it, with a ``close`` that never closes twice."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _closed(self) -> set[int]:
        closed = getattr(self._local, "closed", None)
        if closed is None:
            closed = self._local.closed = set()
        return closed

    def open(self, *args: Any, **kwargs: Any) -> int:
        fd = os.open(*args, **kwargs)
        self._closed().discard(fd)
        return fd

    def close(self, fd: int) -> None:
        closed = self._closed()
        if fd in closed:  # the number may be another thread's file by now
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        os.close(fd)
        closed.add(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def install() -> None:
    """Patch ``radical.utils.ids`` (once; it is imported with ``radical.pilot``)."""
    ids = sys.modules.get("radical.utils.ids")
    if ids is not None and not isinstance(getattr(ids, "os", None), _ClosesOnce):
        setattr(ids, "os", _ClosesOnce())  # noqa: B010 (a module attribute mypy cannot see)


__all__ = ["install"]


@contextmanager
def in_session_base() -> Iterator[None]:
    """Within the block, ids' counter files go under ``$RADICAL_BASE`` as it is now (the
    session's environment), not where it was when radical.utils was imported."""
    ids = sys.modules.get("radical.utils.ids")
    if ids is None:
        yield
        return
    from radical.utils.misc import get_radical_base

    names = vars(ids)  # the module's globals: what generate_id reads
    saved = names["_BASE"]
    names["_BASE"] = get_radical_base("utils")
    try:
        yield
    finally:
        names["_BASE"] = saved
