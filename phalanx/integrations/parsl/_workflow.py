"""A whole phalanx workflow as one node of a Parsl DAG (``px.Workflow.as_parsl_app()``).

A Parsl join app: it runs in the DataFlowKernel's own thread pool, starts the run with
``px.submit`` (phalanx's scheduler places the stages' gangs on the site, as ``phalanx run``
would) and hands Parsl a future that completes when the run ends — with a ``WorkflowResult``
(run id, session, a ``DatasetRef`` per output) or the run's failure.  Keyword arguments bind the
workflow's external inputs (datasets no stage produces) to dataset references from other apps.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...errors import PhalanxError
from ._refs import DatasetRef, WorkflowResult, single_output


class WorkflowFailed(PhalanxError):
    """The workflow run behind a Parsl app failed or was cancelled."""


class RunFuture(Future):
    """The future a workflow's join app hands Parsl: done when the run ends.  Parsl names it in
    the ``JoinError`` of a failed run, so its ``repr`` says which run failed and why."""

    def __init__(self, workflow: str, run_id: str):
        super().__init__()
        self.workflow, self.run_id = workflow, run_id

    def __repr__(self) -> str:
        if not self.done():
            return f"<phalanx workflow {self.workflow!r} run {self.run_id}: running>"
        exc = self.exception()
        if exc is None:
            return f"<phalanx workflow {self.workflow!r} run {self.run_id}: succeeded>"
        return f"<phalanx workflow {self.workflow!r} run {self.run_id}: {type(exc).__name__}: {exc}>"


def workflow_app(workflow: Any, site: Any = None, *, state: str | Path | None = None, resume: str | None = None) -> Any:
    """A Parsl join app running ``workflow`` (a ``px.Workflow``, a workflow model or a YAML
    file) on ``site`` (default: the workflow's).  ``app(**bindings)`` returns an ``AppFuture``;
    each binding ``NAME=ref`` (a ``DatasetRef``, an app's single-output result, or a future of
    one) is read wherever a stage's input names dataset ``NAME`` that no stage produces."""
    from parsl.app.app import join_app

    def run_workflow(**bindings: Any) -> Future:
        return _start(workflow, site, state, resume, bindings)

    name = getattr(workflow, "name", None) or Path(str(workflow)).stem
    run_workflow.__name__ = run_workflow.__qualname__ = f"workflow_{name}".replace("-", "_")
    return join_app(run_workflow)


def _model(workflow: Any, site: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The workflow's model, its site, and each stage's site (a stage's ``site:``: a name, or a
    file found beside a workflow file too)."""
    from ...orchestrator.loading import load_site, load_workflow, stage_sites

    if isinstance(workflow, (str, Path)):
        # a site file's path as a str: find_site reads it as text (a Path failed in its endswith)
        wf, site_model = load_workflow(workflow, site=str(site) if isinstance(site, (str, Path)) else None)
        if site is not None and hasattr(site, "create_executor"):
            site_model = site
        return wf, site_model, stage_sites(wf, site_model, Path(workflow).resolve().parent)
    # a px.Workflow (its model() is the DAG; this package builds on the layers below the Python API)
    wf = workflow.model() if callable(getattr(workflow, "model", None)) else workflow.model_copy(deep=True)
    if site is None or not hasattr(site, "create_executor"):
        site = load_site(str(site or wf.site))
    return wf, site, stage_sites(wf, site)


def _bind(wf: Any, site: Any, bindings: dict[str, Any]) -> None:
    """Point the inputs named by ``bindings`` at the referenced datasets (``SESSION/NAME``)."""
    from ...store import Store

    produced = {out for st in wf.stages.values() for out in st.outputs}
    external = {spec.dataset for st in wf.stages.values() for spec in st.inputs.values()} - produced
    unknown = sorted(set(bindings) - external)
    if unknown:
        raise TypeError(
            f"workflow {wf.name!r} has no external input {unknown} to bind; its inputs that no "
            f"stage produces: {sorted(external) or 'none'}"
        )
    root = str(Store(site.store.root, metadata=site.store.metadata).root)
    for name, value in bindings.items():
        ref = single_output(value, f"workflow {wf.name!r} input {name!r}")
        if not isinstance(ref, DatasetRef):
            raise TypeError(
                f"workflow {wf.name!r} input {name!r}: a DatasetRef (or an app result with one "
                f"output) binds a dataset, not {type(ref).__name__}"
            )
        if ref.root != root:
            raise ValueError(
                f"workflow {wf.name!r} input {name!r}: {ref} is in the store at {ref.root}; the site "
                f"{site.name!r} reads the store at {root}"
            )
        for st in wf.stages.values():
            for spec in st.inputs.values():
                if spec.dataset == name:
                    spec.dataset = str(ref)
                    if ref.by and not spec.by and not spec.shuffle:
                        spec.by = list(ref.by)


def _start(workflow: Any, site: Any, state: Any, resume: str | None, bindings: dict[str, Any]) -> Future:
    from ...orchestrator.handle import RunHandle
    from ...orchestrator.rundb import RunDB
    from ...orchestrator.validate import check
    from ...orchestrator.yamlio import ConfigError
    from ...store import Store

    wf, site_model, sites = _model(workflow, site)
    _bind(wf, site_model, bindings)
    problems = check(wf, site_model, source=f"workflow {wf.name!r}", check_imports=False, sites=sites)
    if problems:  # as px.submit does, before anything starts
        raise ConfigError(problems)
    handle = RunHandle.start(wf, site_model, db=RunDB(state), file="<parsl>", resume=resume, sites=sites)
    done = RunFuture(wf.name, handle.run_id)

    def wait() -> None:
        try:
            result = handle.result()
            if not result.ok:
                status = handle.status()
                bad = {n: s for n, s in status.stages.items() if s.state in ("failed", "cancelled")}
                text = "; ".join(f"stage {n} {s.state}: {s.error or ''}".strip() for n, s in bad.items())
                raise WorkflowFailed(f"{status.state}: {text or 'no stage succeeded'} (phalanx status {handle.run_id})")
            stores: dict[str, Store] = {}  # an output is in the store of the site its stage ran on
            outputs = {}
            # what the stages that ran sealed (a fan-out's instances: OUT.0, OUT.1...; a stage
            # skipped by its when: nothing), each in the store of the site its stage ran on
            for rec in RunDB(state).stages(handle.run_id):
                if rec["state"] != "succeeded":
                    continue
                name = rec["stage"] if rec["stage"] in wf.stages else rec["stage"].rpartition(".")[0]
                here = sites.get(name, site_model)
                if here.name not in stores:
                    stores[here.name] = Store(here.store.root, handle.session, metadata=here.store.metadata)
                outputs.update({out: DatasetRef.of(stores[here.name], out) for out in rec["outputs"] or {}})
            done.set_result(WorkflowResult(handle.run_id, handle.session, outputs))
        except BaseException as exc:  # the run's own error, or the failure above
            done.set_exception(exc)

    threading.Thread(target=wait, name=f"phalanx-parsl-{handle.run_id}", daemon=True).start()
    return done
