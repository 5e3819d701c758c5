"""Detached drivers: a run whose driver is a process of its own that outlives whoever started it.

One copy of the mechanism for its two starters, ``phalanx run --detach`` (``phalanx.cli``) and the
deferrable Airflow operators (``phalanx.integrations.airflow``):

- ``start_driver`` starts a driver program in its own session (no terminal, stdin /dev/null, its
  output to ``STATE/drivers/RUN.log``, readable by this user only) and returns once the driver has
  recorded its run in the run database and written the run id to the pipe it was given;
- ``announce`` is the driver's side of that pipe;
- ``wait_run`` polls the run database until a run driven from anywhere has finished;
- ``stop_driver`` stops a driver of this host as ``phalanx cancel`` does (SIGTERM, then SIGKILL);
  ``stop_run_driver`` the driver a run records, only if its pid is still that process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PhalanxError

if TYPE_CHECKING:
    from .handle import RunStatus
    from .rundb import RunDB

DETACH_START_S = 300.0  # how long a starter waits for its driver to record the run


DETACH_STOP_S = 30.0  # how long an interrupted starter waits for its driver to stop (then SIGKILL)


class DriverStartError(PhalanxError):
    """The detached driver ended (or was stopped) before its run was in the run database."""


class DriverInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM reached the starter before ``start_driver`` returned: the
    driver it started was stopped (SIGTERM, as ``phalanx cancel`` does; SIGKILL after
    ``DETACH_STOP_S``).  ``run_id``: the run it had recorded (now cancelled), None if none;
    ``log``: the driver's output (``STATE/drivers/RUN.log``), None if it made no run (its log
    removed)."""

    def __init__(self, run_id: str | None, log: Path | None):
        super().__init__(run_id)
        self.run_id, self.log = run_id, log


@dataclass(frozen=True)
class Detached:
    run_id: str
    pid: int  # the driver process
    log: Path  # its output


def driver_log(db: RunDB, run_id: str) -> Path:
    """Where a detached driver of ``run_id`` writes (every driver of the run, appended)."""
    return db.state_dir / "drivers" / f"{run_id}.log"


def start_driver(
    argv: Sequence[str],
    db: RunDB,
    *,
    resume: str | None = None,
    env: Mapping[str, str] | None = None,
    tail_lines: int = 20,
) -> Detached:
    """Start ``argv + [FD]`` as a detached driver; FD is the pipe it writes the run id to
    (``announce``).  Returns once the run id came; raises ``DriverStartError`` (with the last
    ``tail_lines`` of the driver's output) when the driver ended first or took longer than
    ``DETACH_START_S`` (then it is killed: nothing is left running without a run).

    Ctrl-C (or SIGTERM) before it returns stops the driver (SIGTERM: a run it had recorded is
    cancelled) and raises ``DriverInterrupted`` (a ``KeyboardInterrupt``) naming that run, if
    any; a driver that made no run leaves no log."""
    from ..executors.logs import tail
    from ..private import opener, private_dir

    drivers = private_dir(
        db.state_dir / "drivers", "the logs of detached drivers", "set PHALANX_STATE to a directory of your own"
    )
    # a new run's id is the driver's to make: its log is renamed once the id is known
    log = driver_log(db, resume) if resume else drivers / f".starting-{uuid.uuid4().hex}.log"
    read, write = os.pipe()
    try:  # a Ctrl-C inside Popen would lose the started driver: it waits until Popen returned
        with _signals_deferred() as caught, open(log, "ab", opener=opener) as out:
            proc = subprocess.Popen(
                [*argv, str(write)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                start_new_session=True,
                env=dict(env) if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"},
            )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    got = bytearray()
    with os.fdopen(read, "rb") as pipe:
        try:
            if caught:
                raise KeyboardInterrupt
            run_id = _read_run_id(pipe, got)
            if run_id and not resume:
                final = driver_log(db, run_id)
                os.replace(log, final)  # the driver keeps writing to it (its open file follows)
                log = final
        except KeyboardInterrupt:  # Ctrl-C before this returned: stop what it started
            with _signals_held():
                run_id = _stop_starting(proc, pipe, got)
                if run_id and not resume:
                    if log.exists() and log != driver_log(db, run_id):
                        os.replace(log, driver_log(db, run_id))
                    log = driver_log(db, run_id)
                elif not run_id and not resume:
                    log.unlink(missing_ok=True)  # no run: no log of it left behind
                if run_id:
                    db.event(run_id, "interrupted", f"`run --detach` interrupted: driver process {proc.pid} stopped")
            raise DriverInterrupted(run_id or None, log if run_id or resume else None) from None
    if not run_id:
        if proc.poll() is None:  # no run after DETACH_START_S: nothing to leave running
            proc.kill()
        code = proc.wait()
        raise DriverStartError(
            f"the detached driver ended before its run started (exit code {code}); "
            f"its output ({log}):\n{tail(log, tail_lines)}"
        )
    db.event(run_id, "detached", f"driver process {proc.pid}, log {log}")
    return Detached(run_id, proc.pid, log)


def _read_run_id(pipe, got: bytearray) -> str:
    """What the driver wrote to ``pipe`` (its run id); "" if it closed the pipe or took too
    long.  What came so far is in ``got`` (an interrupted read leaves it there)."""
    deadline = time.monotonic() + DETACH_START_S
    while not got.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([pipe], [], [], 0.5)[0]:
            chunk = os.read(pipe.fileno(), 256)
            if not chunk:
                break  # the driver ended (or closed the pipe) without a run
            got += chunk
    return got.decode().strip() if got.endswith(b"\n") else ""


def _stop_starting(proc: subprocess.Popen, pipe, got: bytearray) -> str:
    """Stop a driver whose starter was interrupted (SIGTERM: a driver with a run cancels it;
    SIGKILL after ``DETACH_STOP_S``); the run id it had written, "" if none."""
    proc.terminate()
    try:
        proc.wait(DETACH_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    while select.select([pipe], [], [], 0)[0]:  # what it wrote before it ended
        chunk = os.read(pipe.fileno(), 256)
        if not chunk:
            break
        got += chunk
    return got.decode().strip() if got.endswith(b"\n") else ""


@contextmanager
def _signals_held() -> Iterator[None]:
    """Further Ctrl-C or SIGTERM do not interrupt what runs inside (stopping a driver); only
    in the main thread (elsewhere signals do not arrive anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, _ignore) for s in held}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _ignore(signum, frame) -> None:
    pass


@contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM that arrive inside are noted in the list yielded, not raised (the
    caller acts on them after); only in the main thread."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield caught
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def announce(fd: int, run_id: str) -> None:
    """The driver's report to its starter: the run is in the run database (``start_driver``)."""
    try:
        os.write(fd, f"{run_id}\n".encode())
        os.close(fd)
    except OSError:  # the starter gave up waiting: the run goes on regardless
        pass
    print(f"run {run_id}: detached driver, pid {os.getpid()}", flush=True)


def wait_run(
    db: RunDB,
    run_id: str,
    *,
    timeout: float | None = None,
    interval: float = 0.5,
    on_poll: Callable[[], None] | None = None,
) -> RunStatus | None:
    """Poll the run database until the run has finished (a driver gone without a word makes it
    "lost") or ``timeout`` seconds passed; its last status (None: no such run).  ``on_poll`` is
    called before each look."""
    from .handle import run_status

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if on_poll is not None:
            on_poll()
        status = run_status(db, run_id)
        left = None if deadline is None else deadline - time.monotonic()
        if status is None or status.finished or (left is not None and left <= 0):
            return status
        time.sleep(interval if left is None else min(interval, left))


def stop_driver(pid: int, wait: float = 30.0, *, started: int | None = None, boot: str | None = None) -> bool:
    """Stop the driver ``pid`` of this host: SIGTERM (it stops every gang as on Ctrl-C), SIGKILL
    after ``wait`` seconds (its ranks then leave it: heartbeat, parent-death signal).  True if it
    stopped on SIGTERM (or was gone).

    With ``started`` and ``boot`` (the run DB's ``pid_started``, ``boot_id``; ``stop_run_driver``
    passes them) only that process is signalled: a process given the pid since is left alone."""
    from ..procs import signal_same_process
    from .rundb import wait_exit

    def send(sig: int) -> bool:
        if started is not None:
            return signal_same_process(pid, started, boot, sig)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    if not send(signal.SIGTERM):
        return True
    if wait_exit(pid, wait, started, boot):
        return True
    if not send(signal.SIGKILL):
        return True
    wait_exit(pid, 10, started, boot)
    return False


def stop_run_driver(run: dict, wait: float = 30.0) -> bool | None:
    """``stop_driver`` for a run's record (``RunDB.run``): its driver process only — identified
    by pid, start time and boot, never a process its pid was given to since.  None (nothing
    signalled) when the record cannot tell: a driver recorded by an older phalanx (pid without
    start time) whose pid runs now; the caller says so."""
    from .rundb import driver_alive

    alive = driver_alive(run)
    if alive is None:
        return None
    if alive is False:
        return True
    return stop_driver(run["pid"], wait, started=run["pid_started"], boot=run["boot_id"])
