"""A detached driver for a workflow given as a model (``px.Workflow``, ``@task.phalanx``).

``phalanx run FILE --detach`` drives workflow files; a Python workflow (functions sent by value)
has no file, so the deferrable operators start this instead::

    python -m phalanx.integrations.airflow._driver SPEC.pkl FD

SPEC is a cloudpickled ``{"workflow", "site", "file", "resume", "state"}`` (read, then deleted);
the run id is written to file descriptor FD once the run is in the run database.  As the CLI's
driver: its own session, output to ``STATE/drivers/RUN.log``, SIGTERM (``phalanx cancel``)
stops every gang, exit 0 when the run succeeded.  It never imports Airflow.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    import cloudpickle

    from ...orchestrator.detached import announce
    from ...orchestrator.handle import RunHandle
    from ...orchestrator.progress import RunProgress
    from ...orchestrator.rundb import RunDB, RunLockedError

    spec_path, fd = Path(argv[0]), int(argv[1])
    try:
        spec = cloudpickle.loads(spec_path.read_bytes())
    finally:
        spec_path.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    db = RunDB(spec["state"])
    progress = RunProgress(spec["workflow"], live=False)
    handle = None
    try:
        handle = RunHandle.start(
            spec["workflow"], spec["site"], db=db, file=spec["file"], resume=spec["resume"], on_event=progress
        )
        announce(fd, handle.run_id)  # the operator's start_driver returns
        result = handle.result()
    except RunLockedError as exc:
        print(f"phalanx driver: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        for sig in (signal.SIGTERM, signal.SIGINT):  # one cancel: a second signal must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        if handle is not None:
            handle.cancel()
        print(f"run {handle.run_id if handle else '?'} cancelled: every gang was stopped", flush=True)
        return 130
    print(
        f"run {result.run_id} {'succeeded' if result.ok else 'FAILED'} (store session {result.session!r})", flush=True
    )
    for stage, error in result.failed.items():
        print(f"  stage {stage!r} failed: {error}", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
