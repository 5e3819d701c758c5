"""``PhalanxRunTrigger``: waits in Airflow's triggerer for a phalanx run to end.

The deferrable operators start a run with a detached driver and defer to this trigger, so no
worker slot is held while the run goes on.  ``run()`` reads the run database in a thread
(``asyncio.to_thread``: never blocking the triggerer's event loop) every ``poll_interval``
seconds and yields one event when the run has finished — succeeded, failed, cancelled, or lost
(its driver died) — or when ``end_time`` (the task's ``execution_timeout``) passed, after
cancelling the run.  Reading is all it does, so running it twice (a triggerer restarted, the
trigger moved) is harmless.  ``on_kill`` (Airflow >= 3.3: the task marked failed or success,
or cleared, while deferred) cancels the run: every gang stops and no rank process is left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

try:  # Airflow 3.x
    from airflow.triggers.base import BaseTrigger, TriggerEvent
except ImportError as exc:  # pragma: no cover - without the extra
    from ...errors import MissingDependencyError

    raise MissingDependencyError("the Airflow provider needs apache-airflow 3: pip install 'phalanx[airflow]'") from exc


class PhalanxRunTrigger(BaseTrigger):
    """Fires once when phalanx run ``run_id`` (in the run database of ``state``, default
    ``$PHALANX_STATE``) has ended; the event is ``{"run_id", "state", "polls", "timed_out",
    "since"}`` (``since``: when the deferring try submitted the run, handed back as given).
    ``end_time``: a Unix time after which the run is cancelled (the task's execution_timeout)."""

    def __init__(
        self,
        run_id: str,
        state: str | None = None,
        poll_interval: float = 2.0,
        end_time: float | None = None,
        cancel_on_kill: bool = True,
        since: float = 0.0,
    ):
        super().__init__()
        self.run_id, self.state, self.poll_interval = run_id, state, float(poll_interval)
        self.end_time, self.cancel_on_kill, self.since = end_time, cancel_on_kill, since

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
            },
        )

    def _event(self, state: str, polls: int, timed_out: bool = False) -> TriggerEvent:
        return TriggerEvent(
            {"run_id": self.run_id, "state": state, "polls": polls, "timed_out": timed_out, "since": self.since}
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from ...orchestrator.handle import run_status
        from ...orchestrator.rundb import RunDB

        db = await asyncio.to_thread(RunDB, self.state)
        polls = 0
        while True:
            status = await asyncio.to_thread(run_status, db, self.run_id)
            polls += 1
            if status is None:
                self.log.error("phalanx run %s is not in %s", self.run_id, db.path)
                yield self._event("unknown", polls)
                return
            if status.finished:
                self.log.info("phalanx run %s %s (%d polls of the run database)", self.run_id, status.state, polls)
                yield self._event(status.state, polls)
                return
            if self.end_time is not None and time.time() >= self.end_time:
                self.log.error("phalanx run %s: the task's execution_timeout passed; cancelling the run", self.run_id)
                state = await asyncio.to_thread(self._cancel)
                yield self._event(state, polls, timed_out=True)
                return
            wait = self.poll_interval
            if self.end_time is not None:
                wait = max(0.0, min(wait, self.end_time - time.time()))
            await asyncio.sleep(wait)

    def _cancel(self) -> str:
        from ._runs import cancel_run

        return cancel_run(self.run_id, self.state)

    async def on_kill(self) -> None:
        """The deferred task was killed by a user (Airflow >= 3.3): stop the run's gangs."""
        if self.cancel_on_kill:
            state = await asyncio.to_thread(self._cancel)
            self.log.info("phalanx run %s cancelled with its task: %s", self.run_id, state)
