"""SQLite in WAL mode: switching to it when several processes open a database first at once, and
connections kept per thread."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def set_wal(con: sqlite3.Connection, within_s: float = 60.0) -> None:
    """``PRAGMA journal_mode=WAL`` (a setting of the file: once is enough), tried again while
    SQLite says "database is locked": switching needs the exclusive lock, and of two connections
    that switch at once (the first openers of a new run DB or store catalogue) SQLite fails one
    at once instead of waiting for the busy timeout (waiting could deadlock)."""
    deadline = time.monotonic() + within_s
    delay = 0.001
    while True:
        try:
            con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


# connections a forked child found open in its parent's thread: kept from the garbage collector,
# whose close would act on the parent's database state from the child
_INHERITED: list[sqlite3.Connection] = []


class ThreadConnections:
    """One SQLite connection per thread, kept open between calls (``connection()``): closing the
    last connection of a WAL database checkpoints it, ~1 ms — most of a fully cached
    200-instance rerun's time when every call opened and closed its own.  A call made inside
    another on the same thread gets a connection of its own (closed after); one that failed
    (any exception through it) is rolled back and closed, not kept; after a fork, or once the
    file at ``path`` is another one (removed, replaced), a new connection is opened.

    The run DB uses it.  The store catalogue (``store.metadata``) does not yet: with it, gang
    tests of tests/test_store.py read a replaced dataset's old version and others failed with
    SQLite's "disk I/O error" — not understood yet (a catalogue lives in a store root that tests
    remove and make again under the same path while rank processes keep their Store)."""

    def __init__(self, path: str | os.PathLike[str], opener: Callable[[], sqlite3.Connection]):
        self.path, self.opener = path, opener
        self._local = threading.local()

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        here = self._local
        held: sqlite3.Connection | None = getattr(here, "con", None)
        if held is not None and here.pid != os.getpid():  # made before a fork: never touched here
            _INHERITED.append(held)
            held = here.con = None
        if held is not None and not here.busy and here.identity != self._identity():
            held.close()  # its file was removed or replaced: that database is gone for us
            held = here.con = None
        if held is None:  # the thread's first (or first after a failure, a fork, a new file)
            held = self.opener()
            here.con, here.pid, here.identity, here.busy = held, os.getpid(), self._identity(), False
        if here.busy:  # a call this one is inside of uses it
            con, mine = self.opener(), True
        else:
            con, mine = held, False
            here.busy = True
        failed = False
        try:
            yield con
        except BaseException:
            failed = True
            raise
        finally:
            if not mine:
                here.busy = False
            if failed or mine:
                try:
                    if con.in_transaction:
                        con.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # closing rolls back what is left
                finally:
                    con.close()
                if not mine:
                    here.con = None
