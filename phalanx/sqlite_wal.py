"""Switching a SQLite database to WAL mode when several processes open it first at once."""

from __future__ import annotations

import sqlite3
import time


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
