"""A run that goes on while its caller does something else: ``px.submit`` returns a ``RunHandle``.

The run's scheduler (``scheduler.prepare_run``) runs in a thread of this process; the handle
reads the run's progress from the run database, as ``phalanx status`` does, so what it shows
is what any other reader sees::

    h = px.submit(wf, site="local")
    h.run_id, h.session          # known at once: the run is in the run DB
    h.status()                   # RunStatus: the run's state, each stage's state and rows
    h.wait(timeout=5)            # True once the run finished (never raises for a failed run)
    h.cancel()                   # stops every gang; returns when no rank process is left
    h.result()                   # the RunResult; re-raises what the run raised

A run started by a handle ends with its process: runs still going when the interpreter exits
are cancelled then (``phalanx run --detach`` starts a run that outlives its terminal).
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..procs import pid_alive
from .rundb import FINAL, RunDB

if TYPE_CHECKING:
    from .models import Site, Workflow
    from .scheduler import RunResult, Scheduler

CANCEL_TIMEOUT_S = 60.0
_SLICE_S = 0.2
_live: weakref.WeakSet[RunHandle] = weakref.WeakSet()
# How a run shows in Jupyter — ``_repr_html_``, a stage table updating while it runs, its timeline
# at the end: phalanx.integrations.jupyter's hooks, injected by ``phalanx/__init__`` so that this
# layer imports neither the integration nor IPython.
_notebook: Any = None


def set_notebook(hooks: Any) -> None:
    global _notebook
    _notebook = hooks


@dataclass
class StageStatus:
    state: str  # pending, running, succeeded, failed, skipped, cancelled, lost
    ranks: int | None
    attempts: int
    rows: dict[str, int] = field(default_factory=dict)  # output dataset → rows sealed
    error: str | None = None
    started: float | None = None
    ended: float | None = None


@dataclass
class RunStatus:
    run_id: str
    workflow: str
    state: str  # running, succeeded, failed, cancelled, lost
    session: str
    stages: dict[str, StageStatus] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in FINAL


def run_status(db: RunDB, run_id: str) -> RunStatus | None:
    """A run as its database records it (a run whose driver died unannounced reads "lost")."""
    run = db.run(run_id)
    if run is None:
        return None
    stages = {
        s["stage"]: StageStatus(
            s["state"],
            s["ranks"],
            s["attempts"],
            {name: out[0] for name, out in s["outputs"].items()},
            s["error"],
            s["started"],
            s["ended"],
        )
        for s in db.stages(run_id)
    }
    return RunStatus(run["id"], run["workflow"], run["state"], run["session"], stages)


class RunHandle:
    """A run driven by a thread of this process (made by ``px.submit`` or ``RunHandle.start``)."""

    def __init__(self, scheduler: Scheduler, db: RunDB, cancelled: threading.Event):
        self._sched, self._db, self._cancelled = scheduler, db, cancelled
        self.run_id: str = scheduler.run_id
        self.session: str = scheduler.store.session
        self._started = time.time()
        self._finished = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drive, name=f"phalanx-run-{self.run_id}", daemon=True)
        _live.add(self)
        self._thread.start()
        self._view = _notebook.handle_view(self) if _notebook is not None else None  # live in a notebook

    @classmethod
    def start(
        cls,
        wf: Workflow,
        site: Site,
        *,
        db: RunDB | None = None,
        file: str = "<python>",
        resume: str | None = None,
        on_event: Callable[[str, str, str], None] | None = None,
        sites: dict[str, Site] | None = None,
    ) -> RunHandle:
        """Start running ``wf`` (a checked model) on ``site``; returns once the run is in the run
        DB.  Raises ``RunLockedError`` when ``resume`` names a run another driver holds.
        ``sites``: stage → its site (default: loaded from the stages' ``site:``)."""
        from .scheduler import prepare_run

        db = db or RunDB()
        if _notebook is not None and _notebook.live_runs():
            from .progress import RunProgress

            if isinstance(on_event, RunProgress):  # in a notebook the live stage table replaces its lines
                on_event = None
        cancelled = threading.Event()
        scheduler = prepare_run(wf, site, file=file, db=db, resume=resume, on_event=on_event, sites=sites)
        return cls(scheduler, db, cancelled)

    def _drive(self) -> None:
        try:
            self._result = self._sched.run()
        except BaseException as exc:  # re-raised by result()
            self._error = exc
            try:
                run = self._db.run(self.run_id)
                if run is not None and run["state"] == "running":  # failed before its stages ran
                    self._db.event(self.run_id, "failed", f"{type(exc).__name__}: {exc}")
                    self._db.set_run(self.run_id, "cancelled" if self._cancelled.is_set() else "failed")
            except Exception:  # the run DB itself failing: result() still raises what the run did
                pass
        finally:
            self._finished.set()
            _live.discard(self)

    # ---- reading ---------------------------------------------------------------------------
    def status(self) -> RunStatus:
        """The run's state and each stage's state, attempts and rows per output (run DB)."""
        status = run_status(self._db, self.run_id)
        assert status is not None  # prepare_run recorded it
        return status

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until it ends); True when the run has finished,
        whatever its outcome.  A Ctrl-C here stops the waiting, not the run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # in slices: a Ctrl-C taken by another thread runs its handler here only once this
            # thread is back in Python (a lock wait with no timeout would never come back)
            self._finished.wait(_SLICE_S if left is None else min(_SLICE_S, left))
        if self._view is not None:  # a notebook's final table and timeline are out before we return
            self._view.join(timeout=10.0)
        return True

    def result(self, timeout: float | None = None) -> RunResult:
        """The ``RunResult`` once the run finished (``state``: succeeded, failed or cancelled, as
        the run DB has it; ``ok`` only for succeeded);
        re-raises an exception the run raised; ``TimeoutError`` if still running after ``timeout``."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still running after {timeout:g}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # ---- stopping --------------------------------------------------------------------------
    def cancel(self, timeout: float = CANCEL_TIMEOUT_S) -> bool:
        """Stop every gang of the run (sealed outputs stay) and wait until the run has ended and
        no rank process of it is left on this host; the run is then "cancelled" (or what it
        ended as, when it had finished already).  False if that took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        self._cancelled.set()
        # Again until the run ends: a gang that started while the first call stopped the others
        # was not among them (cancel() is a no-op on a gang already stopped).
        while not self._finished.is_set() and time.monotonic() < deadline:
            self._sched.cancel()
            self._finished.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        # Gangs kept for reuse close in threads of their own: wait for their processes too.
        pids = self._rank_pids()
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._finished.is_set() and not any(pid_alive(p) for p in pids)

    def _rank_pids(self) -> list[int]:
        """Rank processes on this host of the attempts this handle ran (their records)."""
        here = socket.gethostname()
        return [
            r["pid"]
            for a in self._db.attempts(self.run_id)
            if (a["started"] or 0) >= self._started - 1
            for r in a["rank_info"]
            if r.get("pid") and r.get("host", here) in (here, "", None)
        ]

    def __repr__(self) -> str:
        state = "finished" if self.done() else "running"
        return f"<phalanx RunHandle {self.run_id} {state}>"

    def _repr_html_(self) -> str | None:  # a notebook's view: stages, ranks, timeline (integrations.jupyter)
        return _notebook.handle_html(self) if _notebook is not None else None

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text view of the same
        p.text(_notebook.handle_text(self) if _notebook is not None else repr(self))


def _cancel_live_runs() -> None:
    """The interpreter is exiting: runs it still drives end as cancelled, with their gangs,
    rather than be cut off and found "lost"."""
    for handle in list(_live):
        try:
            handle.cancel(timeout=20.0)
        except Exception:  # exiting anyway: the run DB will call it lost
            pass


def _register_exit_hook() -> None:
    # At exit Python first joins every ThreadPoolExecutor's threads (a hook of
    # concurrent.futures), so a stage thread waiting on its ranks would hold the exit for as
    # long as the stage runs; atexit handlers come only after.  Threading's own exit hooks run
    # last-registered first: registered after concurrent.futures', ours stops the gangs first.
    import concurrent.futures.thread  # noqa: F401  (registers its hook before ours)

    register = getattr(threading, "_register_atexit", None)
    (register or atexit.register)(_cancel_live_runs)


_register_exit_hook()
