"""``PhalanxRunTrigger``: waits in Airflow's triggerer for a phalanx run to end.

The deferrable operators start a run with a detached driver and defer to this trigger, so no
worker slot is held while the run goes on.  ``run()`` reads the run database in a thread
(``asyncio.to_thread``: never blocking the triggerer's event loop) every ``poll_interval``
seconds and yields one event when the run has finished — succeeded, failed, cancelled, or lost
(its driver died) — or when ``end_time`` (the task's ``execution_timeout``) passed, after
cancelling the run.  Meanwhile it streams the ranks' output into the task's log: each poll
logs the lines the ranks wrote since the last (``[rank N] stage: line``, at most
``STREAM_BYTES`` of them a poll; the rest once the run has ended), through the trigger's own
logger, whose lines Airflow 3 writes to the try's log (``attempt=N.log.trigger.ID.log``, which
the UI shows with it, while the task is deferred and after).  Reading is all it does, so running
it twice (a triggerer restarted, the trigger moved) is harmless: a restarted trigger streams
the lines again from the start.  ``on_kill`` (Airflow >= 3.3: the task marked failed or success,
or cleared, while deferred) cancels the run — every gang stops and no rank process is left —
unless a newer try of the task owns the run by then (a cleared task's next try re-attached to
it: ``_runs.RunOwner``), and says what it did in the log of the try it belongs to, where the
user looks, not only in the trigger's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

try:  # Airflow 3.x
    from airflow.triggers.base import BaseTrigger, TriggerEvent
except ImportError as exc:  # pragma: no cover - without the extra
    from ...errors import MissingDependencyError

    raise MissingDependencyError("the Airflow provider needs apache-airflow 3: pip install 'phalanx[airflow]'") from exc

if TYPE_CHECKING:
    from ._runs import RankLogs

STREAM_BYTES = 1 << 20  # the most of the ranks' output one poll copies to the task's log


class PhalanxRunTrigger(BaseTrigger):
    """Fires once when phalanx run ``run_id`` (in the run database of ``state``, default
    ``$PHALANX_STATE``) has ended; the event is ``{"run_id", "state", "polls", "timed_out",
    "since", "streamed"}`` (``since``: when the deferring try submitted the run, handed back as
    given; ``streamed``: the ranks' lines are in the task's log already, ``stream_logs``).
    ``end_time``: a Unix time after which the run is cancelled (the task's execution_timeout).
    ``attempt``: the deferring try, ``{"dag_id", "run_id", "task_id", "map_index", "try_number"}``:
    a kill cancels the run only while no newer try owns it, and is told in that try's log."""

    def __init__(
        self,
        run_id: str,
        state: str | None = None,
        poll_interval: float = 2.0,
        end_time: float | None = None,
        cancel_on_kill: bool = True,
        since: float = 0.0,
        attempt: dict[str, Any] | None = None,
        stream_logs: bool = True,
    ):
        super().__init__()
        self.run_id, self.state, self.poll_interval = run_id, state, float(poll_interval)
        self.end_time, self.cancel_on_kill, self.since = end_time, cancel_on_kill, since
        self.attempt = dict(attempt) if attempt else None
        self.stream_logs = stream_logs

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "phalanx.integrations.airflow.triggers.PhalanxRunTrigger",
            {
                "run_id": self.run_id,
                "state": self.state,
                "poll_interval": self.poll_interval,
                "end_time": self.end_time,
                "cancel_on_kill": self.cancel_on_kill,
                "since": self.since,
                "attempt": self.attempt,
                "stream_logs": self.stream_logs,
            },
        )

    @property
    def try_number(self) -> int | None:
        """The deferring try's number (from ``attempt``, else the triggerer's task instance)."""
        number = (self.attempt or {}).get("try_number")
        if number is None:
            number = getattr(getattr(self, "task_instance", None), "try_number", None)
        return int(number) if number is not None else None

    def _event(self, state: str, polls: int, timed_out: bool = False) -> TriggerEvent:
        return TriggerEvent(
            {
                "run_id": self.run_id,
                "state": state,
                "polls": polls,
                "timed_out": timed_out,
                "since": self.since,
                "streamed": self.stream_logs and state != "unknown",
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from ...orchestrator.handle import run_status
        from ...orchestrator.rundb import RunDB
        from ._runs import RankLogs

        db = await asyncio.to_thread(RunDB, self.state)
        logs = RankLogs(db, self.run_id, self.since, max_bytes=STREAM_BYTES) if self.stream_logs else None
        polls = 0
        while True:
            status = await asyncio.to_thread(run_status, db, self.run_id)
            polls += 1
            if status is None:
                self.log.error("phalanx run %s is not in %s", self.run_id, db.path)
                yield self._event("unknown", polls)
                return
            if status.finished:
                await self._stream(logs, final=True)
                self.log.info("phalanx run %s %s (%d polls of the run database)", self.run_id, status.state, polls)
                yield self._event(status.state, polls)
                return
            if self.end_time is not None and time.time() >= self.end_time:
                self.log.error("phalanx run %s: the task's execution_timeout passed; cancelling the run", self.run_id)
                state, _ = await asyncio.to_thread(self._cancel)
                await self._stream(logs, final=True)
                yield self._event(state, polls, timed_out=True)
                return
            await self._stream(logs)
            wait = self.poll_interval
            if self.end_time is not None:
                wait = max(0.0, min(wait, self.end_time - time.time()))
            await asyncio.sleep(wait)

    async def _stream(self, logs: RankLogs | None, final: bool = False) -> None:
        """The ranks' new lines to the task's log: one read of at most ``STREAM_BYTES`` (in a
        thread), or, ``final`` (the run has ended), every line left, ``STREAM_BYTES`` at a time."""
        while logs is not None:
            lines, more = await asyncio.to_thread(logs.read, final)
            for line in lines:
                self.log.info("%s", line)
            if not (final and more):
                return

    def _cancel(self) -> tuple[str, int | None]:
        """Cancel the run unless a newer try owns it: (its state after, the newer try or None)."""
        from ...orchestrator.rundb import RunDB
        from ._runs import RunOwner

        return RunOwner(RunDB(self.state).state_dir, self.run_id).cancel(self.try_number, self.state)

    async def on_kill(self) -> None:
        """The deferred task was stopped by a user (Airflow >= 3.3: marked failed or success, or
        cleared): stop the run's gangs, unless a newer try of the task owns the run now."""
        if not self.cancel_on_kill:
            return
        state, newer = await asyncio.to_thread(self._cancel)
        if newer is not None:
            message = (
                f"phalanx run {self.run_id} was not cancelled: try {newer} of this task owns it now "
                f"(the task was cleared while deferred and try {newer} re-attached to the run, which goes on)"
            )
        elif state == "cancelled":
            message = (
                f"phalanx run {self.run_id} cancelled: the task was stopped while deferred (marked failed "
                "or success, or cleared); every gang stopped and no rank process is left. Outputs already "
                f"sealed stay, so a later try resumes the run (phalanx status {self.run_id})"
            )
        else:
            message = (
                f"phalanx run {self.run_id}: the task was stopped while deferred; the run had already ended: {state}"
            )
        # in the try's own log (what the UI shows for it), else in the trigger's (the UI merges it
        # while the triggerer's log server answers): once either way
        if not await asyncio.to_thread(tell_task_log, self.attempt, message):
            self.log.warning("%s", message)


def attempt_log(task: dict[str, Any] | None) -> Path | None:
    """The local log file of one try of a task (``[logging] base_log_folder`` and
    ``log_filename_template``, as the worker wrote it), or None where there is none here
    (another host's worker, remote logging only, a task not given)."""
    if not task or task.get("try_number") is None:
        return None
    try:
        import jinja2
        from airflow.configuration import conf  # the triggerer's: Airflow core is there

        base = conf.get("logging", "base_log_folder", fallback="")
        template = conf.get("logging", "log_filename_template", fallback="")
        if not base or "{{" not in template:
            return None
        ti = SimpleNamespace(**{"map_index": -1, **task})
        relative = jinja2.Template(template).render({**task, "ti": ti})
    except Exception:  # a template naming what a trigger does not know: no such file
        return None
    path = Path(base) / relative
    return path if path.is_file() else None


def tell_task_log(task: dict[str, Any] | None, message: str, level: str = "warning") -> bool:
    """Append ``message`` to the log of the try ``task`` names, as Airflow's own lines (one
    JSON object a line), so that the UI shows it in that try's log; False where the file is
    not on this host."""
    path = attempt_log(task)
    if path is None:
        return False
    line = {
        "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        "level": level,
        "event": message,
        "logger": "phalanx.integrations.airflow.triggers",
    }
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        return False
    return True
