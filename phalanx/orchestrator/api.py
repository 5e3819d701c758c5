"""Workflows in Python: ``px.Workflow``, ``@px.stage`` and ``px.run``.

They compile to the same model as a YAML file (``models.Workflow``) and run on the same
scheduler.  Apps are the decorated functions themselves, so a function defined in a notebook
or a script's ``__main__`` works (it travels to the ranks by value with cloudpickle)::

    wf = px.Workflow("etl")

    @wf.stage(ranks=2, outputs=["tx"])
    def generate(env): ...

    @wf.stage(ranks=2, needs=[generate], inputs={"tx": {"dataset": "tx", "by": ["user"]}},
              outputs=["totals"])
    def totals(env): ...

    result = px.run(wf, site="local")          # or: h = px.submit(wf, site="local"), see handle.py
    px.run(wf, set={"stages.generate.params.rows": 1000})   # as `phalanx run --set`
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .models import Site
from .models import Workflow as WorkflowModel
from .yamlio import ConfigError, parse

if TYPE_CHECKING:
    from .handle import RunHandle


class StageFn:
    """A function marked as a workflow stage; calling it calls the function."""

    def __init__(self, fn: Callable | None, name: str, spec: dict[str, Any]):
        self.fn, self.name, self.spec = fn, name, spec

    def __call__(self, env: Any) -> Any:
        if self.fn is None:
            raise TypeError(f"stage {self.name!r} runs a command, not a Python function")
        return self.fn(env)

    def __repr__(self) -> str:
        return f"<phalanx stage {self.name!r} ranks={self.spec.get('ranks', 1)}>"


def stage(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    ranks: int = 1,
    kind: str = "bsp",
    needs: Iterable[StageFn | str] = (),
    inputs: dict[str, Any] | None = None,
    outputs: Sequence[str] = (),
    params: dict[str, Any] | None = None,
    retries: int | None = None,
    timeout: float | None = None,
    site: str | None = None,
    **fields: Any,
) -> Any:
    """Mark ``fn(env)`` as a stage: ``@px.stage(ranks=2, needs=[generate], outputs=["x"])``;
    ``site``: the site it runs on (a name or site file; default: the workflow's); ``fields``:
    any other field of a stage in a workflow file (``foreach=``, ``when=``...), checked as there."""

    def mark(f: Callable) -> StageFn:
        spec = {
            "kind": kind,
            "app": f"{f.__module__}:{f.__qualname__}",
            "ranks": ranks,
            "needs": [n.name if isinstance(n, StageFn) else n for n in needs],
            "inputs": dict(inputs or {}),
            "outputs": list(outputs),
            "params": dict(params or {}),
            **({"retries": retries} if retries is not None else {}),  # else retry= or the site's retry
            "timeout": timeout,
            **({"site": site} if site else {}),
            **fields,
        }
        return StageFn(f, name or f.__name__, spec)

    return mark(fn) if fn is not None else mark


class Workflow:
    """A workflow built in Python; ``model()`` is what a YAML file of the same DAG gives."""

    def __init__(self, name: str, stages: Iterable[StageFn] = (), site: str = "local", cache: bool | None = None):
        """``cache``: the workflow's default for its stages' ``cache`` (caching across runs)."""
        self.name, self.site, self.cache = name, site, cache
        self.stages: dict[str, StageFn] = {}
        for s in stages:
            self.add(s)

    def add(self, s: StageFn) -> StageFn:
        if s.name in self.stages:
            raise ValueError(f"workflow {self.name!r} already has a stage {s.name!r}")
        self.stages[s.name] = s
        return s

    def stage(self, fn: Callable | None = None, **options: Any) -> Any:
        """``@wf.stage(ranks=2, ...)``: ``px.stage`` that also adds the stage to this workflow."""
        if fn is not None:
            return self.add(stage(fn, **options))
        return lambda f: self.add(stage(f, **options))

    def command(
        self,
        name: str,
        command: Sequence[str],
        *,
        ranks: int = 1,
        needs: Iterable[StageFn | str] = (),
        params: dict[str, Any] | None = None,
        retries: int | None = None,
        timeout: float | None = None,
        site: str | None = None,
        retry: dict[str, Any] | None = None,
    ) -> StageFn:
        """An external program on every rank (kind: command)."""
        spec = {
            "kind": "command",
            "command": list(command),
            "ranks": ranks,
            "needs": [n.name if isinstance(n, StageFn) else n for n in needs],
            "params": dict(params or {}),
            **({"retries": retries} if retries is not None else {}),  # else retry or the site's retry
            **({"retry": retry} if retry is not None else {}),
            "timeout": timeout,
            **({"site": site} if site else {}),
        }
        return self.add(StageFn(None, name, spec))

    def model(self, overrides: Mapping[str, Any] | None = None) -> WorkflowModel:
        """``overrides``: ``{"stages.x.params.rows": "10"}`` set as ``phalanx run --set`` sets them
        in a file (``px.submit``'s ``set=``); this workflow itself is left as it is."""
        from .loading import _apply_overrides

        data = {
            "name": self.name,
            "site": self.site,
            **({"cache": self.cache} if self.cache is not None else {}),
            "stages": {n: {k: v for k, v in s.spec.items() if v is not None} for n, s in self.stages.items()},
        }
        overridden: list[tuple[str, ...]] = []
        if overrides:
            data = copy.deepcopy(data)  # the stages' own params and inputs stay as they are
            overridden = _apply_overrides(data, dict(overrides))
        wf = parse(WorkflowModel, data, source=f"workflow {self.name!r}", overridden=overridden)
        wf.apps.update({n: s.fn for n, s in self.stages.items() if s.fn is not None})
        return wf

    def run(self, site: str | Path | Site | None = None, **options: Any):
        return run(self, site=site, **options)

    def as_parsl_app(self, site: str | Path | Site | None = None, **options: Any) -> Any:
        """This workflow as one node of a Parsl DAG: a join app (``phalanx[parsl]``; see
        ``phalanx.integrations.parsl.workflow_app``)."""
        from ..integrations.parsl import workflow_app  # Parsl only when asked for

        return workflow_app(self, site=site, **options)


def submit(
    workflow: Workflow | WorkflowModel | str | Path,
    site: str | Path | Site | None = None,
    *,
    set: Mapping[str, Any] | None = None,
    resume: str | None = None,
    state: str | Path | None = None,
    progress: bool = False,
    existing: set[str] | None = None,
) -> RunHandle:
    """Start a workflow (a ``px.Workflow``, a model, or a YAML file) and return at once.

    ``set``: overrides, as ``phalanx run --set`` (``{"stages.gen.params.rows": 1000}``): a
    dotted key into the workflow; a string value is read as YAML as ``--set`` values are, any
    other value is taken as it is.  For a workflow file or a ``px.Workflow`` (itself unchanged).

    The ``RunHandle`` has ``run_id`` and ``session`` from the start, ``status()``, ``wait()``,
    ``cancel()``, ``done()`` and ``result()``; the run is in the run database like one started
    by ``phalanx run``.  Raises ``ConfigError`` listing every problem before anything starts.
    """
    from .handle import RunHandle
    from .progress import RunProgress
    from .rundb import RunDB

    wf, site_model, file = _checked(workflow, site, existing, _overrides(set))
    on_event = RunProgress(wf, live=False) if progress else None
    return RunHandle.start(wf, site_model, db=RunDB(state), file=file, resume=resume, on_event=on_event)


def run(
    workflow: Workflow | WorkflowModel | str | Path,
    site: str | Path | Site | None = None,
    *,
    set: Mapping[str, Any] | None = None,
    resume: str | None = None,
    state: str | Path | None = None,
    progress: bool = True,
    existing: set[str] | None = None,
):
    """Run a workflow (a ``px.Workflow``, a model, or a YAML file) and wait for it:
    ``submit(...).result()``; ``set``: overrides, as ``phalanx run --set`` (see ``submit``).

    Returns a ``RunResult`` (``ok``, ``state`` — succeeded, failed or cancelled, as the run
    database has it —, ``run_id``, ``session``, ``failed``, ``skipped``); the run
    is in the run database like one started by ``phalanx run`` (``phalanx status RUN``).
    Raises ``ConfigError`` listing every problem before anything starts.  Ctrl-C stops every
    gang (the run is "cancelled"; sealed outputs stay) and raises ``KeyboardInterrupt``.
    """
    handle = submit(workflow, site, set=set, resume=resume, state=state, progress=progress, existing=existing)
    try:
        return handle.result()
    except KeyboardInterrupt:
        handle.cancel()
        raise


def _overrides(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """``set=`` as the loader's overrides: its keys checked as ``phalanx run --set`` checks its
    KEYs (dotted, no empty part); the values go as they are (a string is read as YAML there)."""
    if not values:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError([f"set=: expected a mapping of dotted keys to values, not a {type(values).__name__}"])
    bad = [
        f"set= {key!r}: expected a dotted key, e.g. 'stages.gen.params.rows'"
        for key in values
        if not (isinstance(key, str) and all(key.split(".")))
    ]
    if bad:
        raise ConfigError(bad)
    return dict(values)


def _checked(
    workflow: Workflow | WorkflowModel | str | Path,
    site: str | Path | Site | None,
    existing: set[str] | None,
    overrides: dict[str, Any] | None = None,
) -> tuple[WorkflowModel, Site, str]:
    """The workflow's model (``overrides`` set in it), its site and the file it came from,
    checked (``ConfigError``)."""
    from .loading import load_site, load_workflow, stage_sites
    from .validate import check

    file = "<python>"
    if isinstance(workflow, (str, Path)):
        file = str(workflow)
        # a site file's path as a str: find_site reads it as text (a Path failed in its endswith)
        wf, site_model = load_workflow(
            workflow,
            site=str(site) if isinstance(site, (str, Path)) else None,
            overrides=overrides,
            existing=existing,
        )
        if isinstance(site, Site):
            site_model = site
    else:
        if overrides and not isinstance(workflow, Workflow):
            raise ConfigError(
                ["set= changes a workflow file or a px.Workflow; change this workflow model itself instead"]
            )
        wf = workflow.model(overrides) if isinstance(workflow, Workflow) else workflow
        site_model = site if isinstance(site, Site) else load_site(str(site or wf.site))
        sites = stage_sites(wf, site_model)
        problems = check(
            wf, site_model, source=f"workflow {wf.name!r}", existing=existing, check_imports=False, sites=sites
        )
        if problems:
            raise ConfigError(problems)
    return wf, site_model, file
