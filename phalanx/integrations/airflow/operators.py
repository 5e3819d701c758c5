"""Airflow operators that run phalanx workflows and stages.

``PhalanxWorkflowOperator`` runs a whole workflow (a YAML file or a ``px.Workflow``) as one task;
``PhalanxStageOperator`` runs one BSP stage (an app on a gang of ``ranks``) as one task, reading
its inputs from upstream tasks' manifests.  Both:

- run the workflow through phalanx's own scheduler, in the worker (a run handle, its ranks'
  lines streamed to the task log as ``[rank N] stage: ...``) or — ``deferrable=True``, default
  ``[operators] default_deferrable`` — with a detached driver while the task waits in the
  triggerer (``PhalanxRunTrigger``), holding no worker slot; the trigger streams the ranks'
  lines to the task log as they are written;
- keep the task's run id across tries, so that an Airflow retry resumes the same phalanx run
  (stages whose outputs are sealed are not run again: ``phalanx run --resume``);
- cancel the run when the task is killed or times out (``cancel_on_kill``), leaving no rank
  process;
- return a small manifest (XCom ``return_value``: run id, state, store session, each output with
  rows, bytes and partitioning) and push each output's entry under its own XCom key, so that
  ``inputs={"tx": generate.output["transactions"]}`` reads an upstream task's dataset.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

try:  # Airflow 3.x: operators from the Task SDK
    from airflow.sdk import BaseOperator, BaseOperatorLink
except ImportError as exc:  # pragma: no cover - without the extra
    from ...errors import MissingDependencyError

    raise MissingDependencyError("the Airflow provider needs apache-airflow 3: pip install 'phalanx[airflow]'") from exc
try:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowTaskTimeout
except ImportError:  # pragma: no cover - Airflow 3.0 kept them in airflow.exceptions
    from airflow.exceptions import AirflowException, AirflowFailException, AirflowTaskTimeout  # type: ignore[no-redef]  # the same names where Airflow 3.0 kept them

from ...orchestrator.rundb import FINAL, RunDB
from . import _runs
from .triggers import PhalanxRunTrigger

TRIGGER_GRACE_S = 60.0  # Airflow's own deferral timeout: after the trigger's (it cancels the run first)
_INPUT_KEYS = ("dataset", "by", "shuffle", "seed", "columns")


def default_deferrable() -> bool:
    """``[operators] default_deferrable`` of this Airflow (False when unset)."""
    try:
        from airflow.sdk import conf
    except ImportError:  # pragma: no cover
        from airflow.configuration import conf  # type: ignore[assignment]  # core's parser where the SDK has none (Airflow 3.0): the same getboolean
    return conf.getboolean("operators", "default_deferrable", fallback=False)


def report_url(report: str | Path | None) -> str:
    """An http(s) address of a run's HTML report, or "" where nothing serves it: a browser does
    not follow a ``file://`` link from the Airflow UI, and the file exists on one host only.
    ``[phalanx] report_base_url`` (``AIRFLOW__PHALANX__REPORT_BASE_URL``): where a web server
    serves ``$PHALANX_STATE/reports/``; the link is that URL plus the report's file name."""
    if not report:
        return ""
    try:
        from airflow.sdk import conf
    except ImportError:  # pragma: no cover
        from airflow.configuration import conf  # type: ignore[assignment]  # core's parser where the SDK has none (Airflow 3.0): the same get
    base = (conf.get("phalanx", "report_base_url", fallback="") or "").strip()
    if not base.lower().startswith(("http://", "https://")):
        return ""
    return f"{base.rstrip('/')}/{Path(report).name}"


class PhalanxRunLink(BaseOperatorLink):
    """The run's HTML report (``phalanx report RUN``: timeline of stages and ranks, rows, bytes),
    where ``[phalanx] report_base_url`` serves it over http; no link otherwise (the task log
    says where the file is: path and host)."""

    name = "phalanx report"

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        return report_url(getattr(operator, "_report", None))


def announcement(run_id: str, state_dir: Any, resume: str | None, attach: bool, how: str) -> str:
    """The task log's line saying which phalanx run this try drives and how."""
    if attach:
        what = f"phalanx run {run_id} is still running (started by an earlier try): re-attached to it"
    elif resume:
        what = f"phalanx run {run_id} resumed (stages whose outputs are sealed are reused)"
    else:
        what = f"phalanx run {run_id} started"
    return (
        f"{what}; {how}.  See: phalanx status {run_id} · phalanx logs {run_id} · "
        f"phalanx report {run_id} (state {state_dir})"
    )


def _task_of(context: Any) -> dict[str, Any]:
    """This try of the task: ``{"dag_id", "run_id", "task_id", "map_index", "try_number"}``."""
    ti = context["ti"]
    number = getattr(ti, "try_number", None)
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": getattr(ti, "map_index", -1),
        "try_number": int(number) if number is not None else None,
    }


@dataclass
class _Launch:
    """A checked workflow, the site it runs on, and the file it came from (or "<python>")."""

    wf: Any  # orchestrator.models.Workflow
    site: Any  # orchestrator.models.Site
    file: str
    sites: dict[str, Any] = field(default_factory=dict)  # stage → its site, where a stage names its own
    crossed: dict[str, dict[str, Any]] = field(default_factory=dict)  # input → how it crossed to this site

    def start(self, db: RunDB, resume: str | None, on_event: Callable[[str, str, str], None]):
        from ...orchestrator.handle import RunHandle

        _runs.pickle_functions_by_value(self.wf.apps.values())
        return RunHandle.start(
            self.wf, self.site, db=db, file=self.file, resume=resume, on_event=on_event, sites=self.sites or None
        )

    def detach(self, db: RunDB, resume: str | None) -> str:
        """A driver process of its own (as ``phalanx run --detach``'s) for the checked model."""
        return _runs.submit_model(self.wf, self.site, db, file=self.file, resume=resume)

    def store(self):
        from ...store import Store

        return Store(self.site.store.root, metadata=self.site.store.metadata)

    def by_name(self) -> dict[str, Any]:
        """Site name → site, of every site the run uses (the manifest says where each output is)."""
        return {s.name: s for s in (self.site, *self.sites.values())}


class _PhalanxRunOperator(BaseOperator):
    """What both operators share: start or resume the task's run, wait (here or deferred), report."""

    ui_color = "#d9e8f5"
    operator_extra_links = (PhalanxRunLink(),)

    def __init__(
        self,
        *,
        site: str | None = None,
        state: str | None = None,
        deferrable: bool | None = None,
        poll_interval: float = 2.0,
        cancel_on_kill: bool = True,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.site, self.state = site, state
        self.deferrable = default_deferrable() if deferrable is None else bool(deferrable)
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        self.poll_interval, self.cancel_on_kill = float(poll_interval), bool(cancel_on_kill)
        self._handle = None
        self._run_id: str | None = None
        self._report: str | None = None
        self._task: dict[str, Any] = {}

    # ---- what to run (the subclasses) --------------------------------------------------------
    def _prepare(self, context: Any) -> _Launch:
        raise NotImplementedError

    def _checked(self, context: Any) -> _Launch:
        from ...orchestrator.yamlio import ConfigError

        try:
            return self._prepare(context)
        except ConfigError as exc:  # the same problems on every try: no retry
            raise AirflowFailException(f"phalanx: the workflow has problems:\n{exc}") from None

    # ---- running -------------------------------------------------------------------------
    def execute(self, context: Any) -> Any:
        launch = self._checked(context)
        db = RunDB(self.state)
        keep = _runs.TaskRunId(context, db)
        self._task = _task_of(context)
        prior = keep.get()
        run = db.run(prior) if prior else None  # a dead driver's run reads "lost" here
        if prior and run is None:
            self.log.warning("phalanx run %s of an earlier try is not in %s: starting a new run", prior, db.path)
        if prior and run is not None:  # this try owns the run from now: an older try's kill leaves it be
            run = self._claim(db, prior)
        # the run of an earlier try whose detached driver still drives it
        attach_to = prior if run is not None and run["state"] not in FINAL else None
        attach = attach_to is not None
        resume = prior if run is not None and not attach else None
        since = 0.0 if attach else time.time()
        if self.deferrable:
            run_id = attach_to if attach_to is not None else self._submit(launch, db, resume)
            keep.set(run_id)
            if run_id != prior:
                _runs.RunOwner(db.state_dir, run_id).claim(self._task.get("try_number"), self._task)
            self._announce(db, run_id, resume, attach, "deferred to the triggerer: no worker slot is held", launch)
            end_time, timeout = None, None
            if self.execution_timeout is not None:
                end_time = time.time() + self.execution_timeout.total_seconds()
                timeout = self.execution_timeout + timedelta(seconds=max(TRIGGER_GRACE_S, 3 * self.poll_interval))
            self.defer(
                trigger=PhalanxRunTrigger(
                    run_id,
                    state=str(db.state_dir),
                    poll_interval=self.poll_interval,
                    end_time=end_time,
                    cancel_on_kill=self.cancel_on_kill,
                    since=since,
                    attempt=self._task,
                ),
                method_name="execute_complete",
                timeout=timeout,
            )
        logs_every = min(self.poll_interval, 0.5)
        if attach or not self.cancel_on_kill:  # a driver of its own, which a killed task leaves running
            run_id = attach_to if attach_to is not None else self._submit(launch, db, resume)
            keep.set(run_id)
            if run_id != prior:
                _runs.RunOwner(db.state_dir, run_id).claim(self._task.get("try_number"), self._task)
            self._run_id = run_id
            self._announce(db, run_id, resume, attach, "detached driver (cancel_on_kill=False)", launch)
            logs = _runs.RankLogs(db, run_id, since)
            _runs.wait_polling(db, run_id, logs_every, lambda: self._emit(logs.poll()))
            self._emit(logs.poll(final=True))
        else:
            try:
                handle = launch.start(db, resume, self._on_event)
            except Exception as exc:  # e.g. RunLockedError: another driver holds the run
                raise AirflowException(f"phalanx: the run did not start: {exc}") from exc
            self._handle, self._run_id = handle, handle.run_id
            keep.set(handle.run_id)
            if handle.run_id != prior:
                _runs.RunOwner(db.state_dir, handle.run_id).claim(self._task.get("try_number"), self._task)
            self._announce(db, handle.run_id, resume, False, "driven by this task", launch)
            logs = _runs.RankLogs(db, handle.run_id, since)
            while not handle.wait(logs_every):
                self._emit(logs.poll())
            self._emit(logs.poll(final=True))
            try:
                handle.result()
            except Exception as exc:  # the run itself raised (not a failed stage: that is a result)
                raise AirflowException(f"phalanx run {handle.run_id} raised {type(exc).__name__}: {exc}") from exc
            run_id = handle.run_id
        return self._finish(context, launch, db, run_id)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        """Back from the trigger: the run's events go to the task log, and the ranks' lines
        unless the trigger streamed them there while the task was deferred."""
        event = event or {}
        since = float(event.get("since") or 0.0)
        db = RunDB(self.state)
        run_id = event.get("run_id") or _runs.TaskRunId(context, db).get()
        if not run_id:
            raise AirflowException("phalanx: the trigger's event names no run, and no earlier try recorded one")
        self._run_id = run_id
        self.log.info(
            "phalanx run %s %s (the trigger polled the run database %s times)",
            run_id,
            event.get("state"),
            event.get("polls", "?"),
        )
        for e in db.events(run_id):
            if (
                e["ts"] >= since - 1
                and e["stage"]
                and e["kind"] in ("start", "succeeded", "failed", "reused", "rerun", "skipped", "cancelled")
            ):
                self.log.info("phalanx %s %s: %s", e["stage"], e["kind"], e["message"])
        if event.get("streamed"):  # the trigger wrote them to this log while the task was deferred
            self.log.info("phalanx run %s: the ranks' lines were streamed to this log while deferred", run_id)
        else:
            self._emit(_runs.RankLogs(db, run_id, since).poll(final=True))
        if event.get("timed_out"):
            self._write_report(db, run_id)
            raise AirflowTaskTimeout(
                f"phalanx run {run_id}: execution_timeout ({self.execution_timeout}) passed "
                f"while deferred; the run was cancelled ({event.get('state')})"
            )
        return self._finish(context, self._checked(context), db, run_id)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any):
        """Airflow failing the deferred task itself (its deferral timed out — a triggerer that
        was down — or the trigger crashed): cancel the run before the task fails."""
        if next_method == "__fail__" and self.cancel_on_kill:
            db = RunDB(self.state)
            run_id = _runs.TaskRunId(context, db).get()
            if run_id:
                self._run_id, self._task = run_id, _task_of(context)
                self._cancel_owned(db.state_dir, run_id, error=True)
        return super().resume_execution(next_method, next_kwargs, context)

    def on_kill(self) -> None:
        """The task is being killed (marked failed, cleared, execution_timeout): stop every gang."""
        if not self.cancel_on_kill:
            return
        if self._handle is not None:
            self.log.info("phalanx run %s: cancelling (the task is being stopped)", self._handle.run_id)
            stopped = self._handle.cancel()
            self.log.info(
                "phalanx run %s: %s", self._handle.run_id, "every rank stopped" if stopped else "ranks still stopping"
            )
        elif self._run_id:
            self._cancel_owned(RunDB(self.state).state_dir, self._run_id)

    # ---- helpers ---------------------------------------------------------------------------
    def _claim(self, db: RunDB, run_id: str) -> dict[str, Any] | None:
        """Make this try the owner of the run of an earlier try (before it attaches to or resumes
        it); while an older try's kill is cancelling it, wait for that first.  The run as it is
        after."""
        owner = _runs.RunOwner(db.state_dir, run_id)
        try_number = self._task.get("try_number")
        if not owner.claim(try_number, self._task):
            self.log.info(
                "phalanx run %s: an earlier try of this task is being stopped and is cancelling the run; "
                "waiting for that, then resuming the run",
                run_id,
            )
            _runs.wait_ended(db, run_id, timeout=90.0)
            owner.claim(try_number, self._task, force=True)
        return db.run(run_id)

    def _cancel_owned(self, state_dir: Path, run_id: str, error: bool = False) -> None:
        """Cancel the run this try drives, unless a newer try of the task owns it now."""
        state, newer = _runs.RunOwner(state_dir, run_id).cancel(self._task.get("try_number"), self.state)
        if newer is not None:
            self.log.info("phalanx run %s was not cancelled: try %s of this task owns it now", run_id, newer)
        else:
            (self.log.error if error else self.log.info)("phalanx run %s: cancelled (%s)", run_id, state)

    def _submit(self, launch: _Launch, db: RunDB, resume: str | None) -> str:
        try:
            return launch.detach(db, resume)
        except _runs.SubmitError as exc:
            raise AirflowException(str(exc)) from None

    def _announce(self, db: RunDB, run_id: str, resume: str | None, attach: bool, how: str, launch: _Launch) -> None:
        self.log.info("%s", announcement(run_id, db.state_dir, resume, attach, how))
        from ...orchestrator.crossings import crossing_message

        for record in launch.crossed.values():  # the run's record says how its inputs got here
            if not record["already"]:
                db.event(run_id, "crossed", crossing_message(record["dataset"], record), _name(self.task_id))

    def _on_event(self, stage: str, kind: str, message: str) -> None:
        if stage:
            self.log.info("phalanx %s %s: %s", stage, kind, message)

    def _emit(self, lines: list[str]) -> None:
        for line in lines:
            self.log.info("%s", line)

    def _write_report(self, db: RunDB, run_id: str) -> None:
        from ...orchestrator.report import write_report

        try:
            self._report = str(write_report(db, run_id))
            url = report_url(self._report)
            self.log.info(
                "phalanx report of run %s: %s on host %s%s",
                run_id,
                self._report,
                socket.gethostname(),
                f" (the task's 'phalanx report' link: {url})"
                if url
                else " (an HTML file there: open it on that host or copy it; set [phalanx] report_base_url "
                "to link it from the task)",
            )
        except Exception as exc:  # a report is a convenience: never the task's failure
            self.log.warning("phalanx report of run %s not written: %s", run_id, exc)

    def _finish(self, context: Any, launch: _Launch, db: RunDB, run_id: str) -> dict[str, Any]:
        self._write_report(db, run_id)
        run = db.run(run_id) or {"state": "unknown"}
        reused = [e["stage"] for e in db.events(run_id) if e["kind"] == "reused"]
        if reused:
            self.log.info(
                "phalanx run %s: not run again (outputs sealed by an earlier attempt): %s",
                run_id,
                ", ".join(dict.fromkeys(reused)),
            )
        if run["state"] != "succeeded":
            line, full = _runs.failure_report(db, run_id)
            self.log.error("%s", full)
            raise AirflowException(f"{line}\n(phalanx status {run_id} · phalanx logs {run_id})")
        result = _runs.manifest(db, run_id, launch.store(), launch.by_name())
        if launch.crossed:
            result["crossed"] = launch.crossed
        ti = context["ti"]
        for name, entry in result["outputs"].items():
            if name != "return_value":
                ti.xcom_push(key=name, value=entry)
        outs = ", ".join(f"{n}: {o['rows']:,} rows" for n, o in result["outputs"].items()) or "no outputs"
        self.log.info("phalanx run %s succeeded (store session %r): %s", run_id, result["session"], outs)
        return result


class PhalanxWorkflowOperator(_PhalanxRunOperator):
    """Run a phalanx workflow as one Airflow task.

    :param workflow: a workflow file (YAML; relative paths are tried from the working directory,
        then beside the DAG file) or a ``px.Workflow`` (its functions travel by value).
    :param site: a site name or file, instead of the workflow's ``site:``.
    :param set: ``{"stages.generate.params.rows": 1000}``, as ``phalanx run --set`` (workflow files);
        templated — a rendered value is read as YAML, as ``--set`` values are.
    :param deferrable: run with a detached driver and wait in the triggerer (no worker slot held);
        default ``[operators] default_deferrable``.
    :param poll_interval: seconds between reads of the run database while deferred.
    :param cancel_on_kill: stop the run's gangs when the task is killed or times out (default);
        False leaves the run going (non-deferrable mode then uses a detached driver too) and the
        next try re-attaches to it.
    :param state: phalanx's state directory (run database, logs); default ``$PHALANX_STATE``.
    """

    template_fields: Sequence[str] = ("workflow", "site", "set", "state")
    template_fields_renderers = {"set": "json"}

    def __init__(self, *, workflow: Any, set: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.workflow, self.set = workflow, dict(set or {})

    def _prepare(self, context: Any) -> _Launch:
        from ...orchestrator.loading import load_site, load_workflow, stage_sites
        from ...orchestrator.models import Workflow as WorkflowModel
        from ...orchestrator.validate import check
        from ...orchestrator.yamlio import ConfigError

        if isinstance(self.workflow, (str, Path)):
            path = self._find(Path(self.workflow))
            # as --set reads them: a string as YAML, anything else as it is (str() of a list
            # with a multi-line string in it read back as YAML came out with literal \n's)
            overrides = dict(self.set)
            wf, site = load_workflow(path, site=self.site, overrides=overrides)
            return _Launch(wf, site, str(path), stage_sites(wf, site, path.parent))
        built = callable(getattr(self.workflow, "model", None))  # a px.Workflow: its model() is the DAG
        if not (built or isinstance(self.workflow, WorkflowModel)):
            raise AirflowFailException(f"workflow must be a file or a px.Workflow, not {type(self.workflow).__name__}")
        if self.set:
            raise AirflowFailException("set= changes workflow files; change the px.Workflow itself instead")
        wf = self.workflow.model() if built else self.workflow
        site = load_site(str(self.site or wf.site))
        sites = stage_sites(wf, site)  # stages naming their own site: each checked against it
        problems = check(wf, site, source=f"workflow {wf.name!r}", check_imports=False, sites=sites)
        if problems:
            raise ConfigError(problems)
        return _Launch(wf, site, "<python>", sites)

    def _find(self, path: Path) -> Path:
        """A relative path: from the working directory, else beside the DAG file (the file a
        symbolic link in the DAGs folder points to, too)."""
        if path.is_absolute() or path.exists():
            return path.resolve()
        if self.has_dag() and self.dag.fileloc:
            dag_file = Path(self.dag.fileloc)
            for folder in (dag_file.parent, dag_file.resolve().parent):
                if (folder / path).exists():
                    return (folder / path).resolve()
        return path


class PhalanxStageOperator(_PhalanxRunOperator):
    """Run one phalanx stage — a BSP app on a gang of ``ranks`` — as one Airflow task.

    :param app: ``"package.module:function"``, called as ``function(env)`` on every rank.
    :param command: instead of ``app``: a program run on every rank (``kind: command``).
    :param ranks: the gang's size (all ranks start together or none does).
    :param inputs: local name → an upstream task's output (``generate.output["transactions"]``,
        an XComArg of its manifest, or ``"SESSION/NAME"`` — e.g. a templated
        ``"{{ ti.xcom_pull(task_ids='generate')['outputs']['transactions']['dataset'] }}"``),
        or ``{"dataset": <one of those>, "by": [...] | "shuffle": "random" | "global", ...}``.
    :param outputs: the datasets the app seals (``env.output(name, df)`` or ``return {name: df}``).
    :param stage_params: the app's ``env.params`` (templated; a templated value is read as YAML).
        (``params`` is Airflow's own — DAG params for templates — so it is not used for the app.)
    :param session: the store session the stage writes to (templated).  Default: one session per
        DAG run, ``<dag id>-<run id>``, shared by the DAG run's stage tasks as a workflow run's
        stages share theirs — so an upstream task's output is an input by its bare name (a mapped
        task instance writes to ``<dag id>-<run id>-<map index>``).
    :param kind: ``bsp`` (default) or ``torch``.  ``retries_in_run``/``stage_timeout``: phalanx's
        own, per attempt on a fresh gang inside the task (Airflow's ``retries`` resume the run).
    Other arguments as ``PhalanxWorkflowOperator`` (site, deferrable, poll_interval, cancel_on_kill, state).
    """

    template_fields: Sequence[str] = ("app", "command", "inputs", "outputs", "stage_params", "session", "site", "state")
    template_fields_renderers = {"inputs": "json", "stage_params": "json"}

    def __init__(
        self,
        *,
        app: str | None = None,
        command: Sequence[str] | None = None,
        ranks: int = 1,
        inputs: dict[str, Any] | None = None,
        outputs: Sequence[str] | None = None,
        stage_params: dict[str, Any] | None = None,
        session: str | None = None,
        kind: str | None = None,
        retries_in_run: int = 0,
        stage_timeout: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if app is not None and command is not None:
            raise ValueError("give app or command, not both")
        self.app, self.command, self.ranks = app, (list(command) if command is not None else None), ranks
        self.inputs, self.outputs = dict(inputs or {}), (list(outputs) if outputs is not None else None)
        self.stage_params, self.session = dict(stage_params or {}), session
        # values written as templates are read as YAML once rendered ("{{ params.rows }}" → 1000)
        self._typed = sorted(k for k, v in self.stage_params.items() if isinstance(v, str) and "{{" in v)
        self.kind, self.retries_in_run, self.stage_timeout = kind, retries_in_run, stage_timeout

    # the stage as a one-stage workflow --------------------------------------------------------
    def _stage_spec(self, context: Any, session: str) -> tuple[dict[str, Any], Any]:
        """(the stage's fields, a function to send by value or None)."""
        import yaml

        params = dict(self.stage_params)
        for key in self._typed:
            if isinstance(params.get(key), str):
                params[key] = yaml.safe_load(params[key])
        spec: dict[str, Any] = {"ranks": self.ranks, "params": params, "retries": self.retries_in_run}
        if self.stage_timeout is not None:
            spec["timeout"] = self.stage_timeout
        if self.command is not None:
            spec.update(kind="command", command=self.command)
            return spec, None
        if not self.app:
            raise AirflowFailException(f"task {self.task_id}: app= or command= is needed")
        spec.update(
            kind=self.kind or "bsp",
            app=self.app,
            outputs=list(self.outputs or []),
            inputs={name: dataset_input(name, v, session) for name, v in self.inputs.items()},
        )
        return spec, None

    def _session(self, context: Any) -> str:
        """The given session, else the DAG run's (a mapped task instance: one of its own, so that
        the instances' outputs of one name do not replace each other)."""
        ti = context["ti"]
        if self.session:
            return session_name(self.session)
        index = getattr(ti, "map_index", -1)
        return session_name(f"{ti.dag_id}-{ti.run_id}" + (f"-{index}" if index is not None and index >= 0 else ""))

    def _prepare(self, context: Any) -> _Launch:
        from ...orchestrator.loading import load_site
        from ...orchestrator.models import Workflow as WorkflowModel
        from ...orchestrator.validate import check
        from ...orchestrator.yamlio import ConfigError, parse
        from ...store import Store

        session = self._session(context)
        spec, fn = self._stage_spec(context, session)
        ti = context["ti"]
        workflow, stage = _name(f"{ti.dag_id}.{ti.task_id}"), _name(ti.task_id)
        data = {"name": workflow, "site": self.site or "local", "stages": {stage: spec}}
        wf = parse(WorkflowModel, data, source=f"task {self.task_id!r}")
        if fn is not None:  # a Python function (@task.phalanx): sent by value
            wf.apps[stage] = fn
        site = load_site(str(self.site or "local"))
        site = site.model_copy(update={"store": site.store.model_copy(update={"session": session})})
        crossed = self._cross_inputs(site, session)  # upstream outputs sealed in another site's store
        existing = set(Store(site.store.root, session, metadata=site.store.metadata).list())
        problems = check(wf, site, source=f"task {self.task_id!r}", existing=existing, check_imports=fn is None)
        if problems:
            raise ConfigError(problems)
        file = str(self._write_workflow(context, data, session)) if fn is None else "<python>"
        return _Launch(wf, site, file, crossed=crossed)

    def _cross_inputs(self, site: Any, session: str) -> dict[str, dict[str, Any]]:
        """Inputs that an upstream task sealed in another site's store (its manifest says where),
        brought into this site's store first, in the dataset's own session
        (``orchestrator.crossings``, as a workflow run's stages on several sites get theirs: once,
        verified, resumable; through the object store both sites name as their exchange, else
        directly).  Input → the crossing's record; an input of this site's store is left as is."""
        from ...orchestrator.crossings import cross_dataset, crossing_message, shared_exchange
        from ...store import Store

        crossed: dict[str, dict[str, Any]] = {}
        here = Store(site.store.root, session, metadata=site.store.metadata)
        for local, value in self.inputs.items():
            entry = output_entry(local, value)
            if entry is None or "store" not in entry or same_location(entry["store"], _runs.location(here)):
                continue
            dataset = str(entry["dataset"])
            own, _, short = dataset.rpartition("/")
            there = source_store(entry, own or session)
            record = cross_dataset(
                short,
                there,
                here.for_session(own or session),
                shared_exchange(entry["store"].get("exchange"), site.store.exchange),
                src_site=str(entry.get("site", "?")),
                dst_site=site.name,
            )
            self.log.info("phalanx input %s crossed: %s", local, crossing_message(dataset, record, "before"))
            crossed[local] = {"dataset": dataset, **record}
        return crossed

    def _write_workflow(self, context: Any, data: dict[str, Any], session: str) -> Path:
        """The one-stage workflow as a file under STATE/airflow/workflows/, for the record: the
        run's file, so that ``phalanx run FILE --resume RUN`` works on it by hand too."""
        import hashlib
        import json
        import os

        import yaml

        from ...private import create_private, private_dir

        ti = context["ti"]
        key = json.dumps([ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1)])
        folder = private_dir(
            RunDB(self.state).state_dir / "airflow" / "workflows",
            "workflows of Airflow tasks",
            "set PHALANX_STATE to a directory of your own",
        )
        path = folder / f"{data['name']}.{hashlib.sha256(key.encode()).hexdigest()[:12]}.yaml"
        text = (
            f"# Airflow task {ti.dag_id}.{ti.task_id} (run {ti.run_id}) as a phalanx workflow, written by "
            f"PhalanxStageOperator; it writes to store session {session!r}\n" + yaml.safe_dump(data, sort_keys=False)
        )
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        create_private(tmp, truncate=True).write_text(text)
        os.replace(tmp, path)
        return path


def _name(text: str) -> str:
    """A phalanx name (letters, digits, '_', '.', '-'; ≤ 100) from a DAG or task id."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip("_.-") or "task"
    return name[:100]


def session_name(text: str) -> str:
    """A store session name (≤ 128 of letters, digits, '_', '.', '-') from e.g. ``dag-run id``."""
    import hashlib

    name = re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip("_.-") or "airflow"
    if len(name) > 128:
        name = f"{name[:110]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return name


def dataset_input(name: str, value: Any, session: str | None = None) -> Any:
    """A stage input from what a DAG passes: ``"SESSION/NAME"``; an upstream task's manifest
    (its output called ``name``, or its only output); one output's entry of a manifest
    (``task.output["transactions"]``); or ``{"dataset": <any of those>, "by": ...}``.  A
    dataset of ``session`` (the consumer's own) is named by its bare name."""
    if isinstance(value, str):
        own, _, short = value.rpartition("/")
        return short if session and own == session else value
    if isinstance(value, dict) and "outputs" in value and "session" in value:  # a whole manifest
        outputs = value["outputs"]
        if name in outputs:
            return dataset_input(name, outputs[name]["dataset"], session)
        if len(outputs) == 1:
            return dataset_input(name, next(iter(outputs.values()))["dataset"], session)
        raise AirflowFailException(
            f"input {name!r}: run {value.get('run_id')} has outputs {sorted(outputs)}; "
            f"pick one: task.output[{sorted(outputs)[0]!r}]"
        )
    if isinstance(value, dict) and "dataset" in value:
        dataset = dataset_input(name, value["dataset"], session)
        extra = {k: value[k] for k in _INPUT_KEYS[1:] if value.get(k) is not None}
        return {"dataset": dataset, **extra} if extra else dataset
    raise AirflowFailException(
        f'input {name!r}: expected a dataset ("SESSION/NAME", an upstream task\'s '
        f"manifest or output), got {type(value).__name__}: {value!r:.80}"
    )


def output_entry(name: str, value: Any) -> dict[str, Any] | None:
    """The upstream output entry (``{"dataset", "site", "store", ...}``) an input names — as
    ``dataset_input`` reads it — or None where it is a bare ``"SESSION/NAME"``."""
    if isinstance(value, dict) and "outputs" in value and "session" in value:
        outputs = value["outputs"]
        if name in outputs:
            return outputs[name]
        return next(iter(outputs.values())) if len(outputs) == 1 else None
    if isinstance(value, dict) and "dataset" in value:
        return value if isinstance(value["dataset"], str) else output_entry(name, value["dataset"])
    return None


def same_location(a: dict[str, str], b: dict[str, str]) -> bool:
    """Both name one store (its root and its catalogue): nothing crosses."""
    return (a.get("root"), a.get("metadata")) == (b.get("root"), b.get("metadata"))


def source_store(entry: dict[str, Any], session: str) -> Any:
    """The store an upstream output lives in, opened here: from the manifest's URLs where they
    hold nothing masked, else from the producing site's file (found by its name, as any site)."""
    from ...orchestrator.loading import load_site
    from ...redact import MASK
    from ...store import Store

    where = entry["store"]
    if MASK not in where["root"] and MASK not in where["metadata"]:
        return Store(where["root"], session, metadata=where["metadata"] or None)
    site_name = str(entry.get("site", ""))
    site = load_site(site_name)
    store = Store(site.store.root, session, metadata=site.store.metadata)
    if not same_location(_runs.location(store), where):
        raise AirflowException(
            f"input {entry['dataset']!r}: its store ({where['root']}) needs credentials; the site file "
            f"named {site_name!r} found here names another store ({_runs.location(store)['root']})"
        )
    return store


def is_dataset(value: Any) -> bool:
    """Whether a decorated function's argument names a store dataset (a manifest or an output entry)."""
    return isinstance(value, dict) and ("dataset" in value or ("outputs" in value and "session" in value))
