"""Checks before anything starts: the DAG, the data it needs, the apps, the site's capacity.

Every problem names the file, line and field; all problems are reported at once.
"""

from __future__ import annotations

import importlib
from typing import Any

import yaml

from ..errors import PhalanxError
from ..extras import install_hint, installed, missing
from .models import Site, Workflow
from .yamlio import locate


def dependencies(wf: Workflow) -> dict[str, set[str]]:
    """Stage → stages it waits for: its ``needs``, the producers of its inputs, and of the
    datasets its ``when:`` and ``foreach: {rows:}`` read."""
    from .conditions import datasets_named

    producer = {out: name for name, st in wf.stages.items() for out in st.outputs}
    deps = {}
    for name, st in wf.stages.items():
        reads = {i.dataset for i in st.inputs.values()}
        if st.when:
            reads |= datasets_named(st.when)
        if st.foreach is not None and st.foreach.rows:
            reads.add(st.foreach.rows)
        deps[name] = set(st.needs) | {producer[d] for d in reads if d in producer and producer[d] != name}
    return deps


def _find_cycle(deps: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(deps.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep in deps and state.get(dep) is None:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(deps):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def _import_problem(app: str) -> str | None:
    module_name, _, attr = app.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module raising while it imports
        hint = ""
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "torch":
            hint = f" (PyTorch comes with the torch extra: {install_hint('torch')})"
        return f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}{hint}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"module {module_name!r} has no {attr!r}"
        obj = getattr(obj, part)
    return None if callable(obj) else f"{app!r} is not callable"


def check(
    wf: Workflow,
    site: Site,
    *,
    source: str | None = None,
    root: yaml.Node | None = None,
    existing: set[str] | None = None,
    check_imports: bool = True,
    sites: dict[str, Site] | None = None,
) -> list[str]:
    """Every problem found, as "file:line: field: message" (empty when the workflow is sound).
    Fields are located in the file ``wf`` was read from, unless ``source`` says otherwise.
    ``site``: the workflow's; ``sites``: stage → the site it names (``loading.stage_sites``),
    each stage checked against its own site's capacity and executor."""
    problems: list[str] = []

    def report(loc: tuple, message: str) -> None:
        where = wf.where(loc) if source is None else locate(loc, source, root)
        problems.append(f"{where}: {message}")

    names = list(wf.stages)  # file order: problems read top to bottom
    producers: dict[str, str] = {}
    for name in names:
        for out in wf.stages[name].outputs:
            if out in producers:
                report(("stages", name, "outputs"), f"dataset {out!r} is also produced by stage {producers[out]!r}")
            producers.setdefault(out, name)
    site_of = {name: (sites or {}).get(name, site) for name in names}
    used = {s.name: s for s in [site, *site_of.values()]}  # the workflow's site first
    made = {}
    for here in used.values():
        try:
            made[here.name] = here.create_executor()
        except Exception as exc:  # what the executor refuses of the site as a whole (cores over a pilot's ntasks)
            problems.append(f"{here.where((here.executor,))}: {exc}")
    if len(made) < len(used):
        return problems
    has_torch = installed("torch")
    for here in used.values():
        if here.communicator == "gloo" and not has_torch:
            problems.append(f"{here.where(('communicator',))}: {missing('communicator gloo', 'torch', 'torch')}")
    for name in names:
        st, here = wf.stages[name], site_of[name]
        executor = made[here.name]
        capacity = executor.capacity()
        for i, need in enumerate(st.needs):
            if need not in wf.stages:
                report(("stages", name, "needs", i), f"unknown stage {need!r} (stages: {', '.join(sorted(names))})")
            elif need == name:
                report(("stages", name, "needs", i), "a stage cannot need itself")
        for local, spec in st.inputs.items():
            session, _, short = spec.dataset.rpartition("/")
            if session:  # another session's dataset (e.g. an earlier run's): must be sealed now
                problem = _not_sealed_in(here, session, short)
                if problem:
                    report(("stages", name, "inputs", local), problem)
            elif spec.dataset not in producers and spec.dataset not in (existing or set()):
                report(
                    ("stages", name, "inputs", local),
                    f"dataset {spec.dataset!r} is produced by no stage and is not in the store "
                    "(another run's output: 'SESSION/NAME')",
                )
        for problem_at, problem in _flow_problems(wf, name, producers, existing or set()):
            report(("stages", name, *problem_at), problem)
        if capacity and st.ranks > capacity:
            report(("stages", name, "ranks"), f"{st.ranks} ranks, but site {here.name!r} can give at most {capacity}")
        problem = _gpu_problem(st, here, executor)
        if problem:  # at the stage's gpus_per_rank, else at the site's
            if st.gpus_per_rank is not None:
                report(("stages", name, "gpus_per_rank"), problem)
            else:
                problems.append(f"{here.where(('gpus_per_rank',))}: stage {name!r}: {problem}")
        if check_imports and st.app:
            problem = _import_problem(st.app)
            if problem:
                report(("stages", name, "app"), problem)
        if st.kind == "torch" and not has_torch:
            report(("stages", name, "kind"), missing("a torch stage", "torch", "torch"))
        if st.kind == "command" and not executor.capabilities.runs_commands:
            from ..executors import capabilities, executors

            runners = [n for n in executors.names() if capabilities(n).runs_commands]
            report(
                ("stages", name, "kind"),
                f"command stages need an executor that starts programs ({', '.join(runners)}), not {here.executor!r}",
            )
    for here in used.values():
        stages = [n for n in names if site_of[n].name == here.name]
        problems += _executor_problems(wf, stages, here, made[here.name], report)
        problem = _listen_problem(here.driver_host)
        if problem:
            problems.append(f"{here.where(('driver_host',))}: {problem}")
    cycle = _find_cycle({n: {d for d in deps if d in wf.stages} for n, deps in dependencies(wf).items()})
    if cycle:
        report(("stages", cycle[0], "needs"), "cycle: " + " → ".join(cycle))
    return problems


def _flow_problems(wf: Workflow, name: str, producers: dict[str, str], existing: set[str]) -> list[tuple[tuple, str]]:
    """What is wrong with a stage's ``foreach:``, ``when:`` and ``gather:`` (field path, message)."""
    from .conditions import datasets_named
    from .fanout import longest_name, static_items

    st, out = wf.stages[name], list[tuple[tuple, str]]()

    def unknown(dataset: str) -> bool:
        return "/" not in dataset and dataset not in producers and dataset not in existing

    if st.foreach is not None:
        items = static_items(st.foreach)
        if items is not None:
            too_long = longest_name(name, st.outputs, len(items))
            if too_long:
                out.append((("foreach",), too_long))
        elif st.foreach.rows and unknown(st.foreach.rows):
            out.append(
                (("foreach", "rows"), f"dataset {st.foreach.rows!r} is produced by no stage and is not in the store")
            )
        elif st.foreach.rows and producers.get(st.foreach.rows) == name:
            out.append((("foreach", "rows"), "a stage cannot fan out over its own output"))
    if st.when:
        for dataset in sorted(datasets_named(st.when)):
            if unknown(dataset):
                out.append(
                    (
                        ("when",),
                        f"the condition reads {dataset!r}, which is produced by no stage and is not in the store",
                    )
                )
    for local, spec in st.inputs.items():
        made_by = producers.get(spec.dataset)
        if spec.gather and (made_by is None or wf.stages[made_by].foreach is None):
            out.append(
                (
                    ("inputs", local, "gather"),
                    f"dataset {spec.dataset!r} is not the output of a fan-out (foreach) stage",
                )
            )
    return out


def _executor_problems(wf: Workflow, stages: list[str], site: Site, executor, report) -> list[str]:
    """What the executor refuses of a stage's gang (a resources list that does not match it, a
    gang bigger than a pilot), checked without starting anything: reported at the stage's own
    section, else at the site's (once)."""
    at_site: dict[str, str] = {}
    for name in stages:
        st = wf.stages[name]
        section = st.executor_section(site.executor)
        try:
            executor.check(st.ranks, executor.stage_config(section))
        except Exception as exc:  # whatever the executor rejects (PhalanxError, ValueError, ValidationError)
            if section:
                report(("stages", name, site.executor), str(exc))
            else:
                at_site.setdefault(str(exc), f"{site.where((site.executor,))}: {exc}")
    return list(at_site.values())


def _gpu_problem(st: Any, site: Site, executor: Any) -> str | None:
    """Why the stage's GPUs cannot be had on ``site``: more than it has (where its GPU count is
    known), or the executor's own section asking for other GPUs (``Executor.with_gpus``)."""
    per = st.gpus_on(site)
    try:
        config = executor.stage_config(st.executor_section(site.executor))
    except Exception:  # a bad section: _executor_problems says so
        return None
    try:
        executor.with_gpus(config, per)
    except Exception as exc:  # the section disagrees, the executor gives no GPUs
        return str(exc).removeprefix("gpus_per_rank: ")
    have = executor.gpu_capacity()
    if per and have is not None and st.ranks * per > have:
        return gpu_shortfall(st.ranks, per, site.name, have)
    return None


def gpu_shortfall(ranks: int, per: int, site: str, have: int) -> str:
    """ "2 ranks × 1 GPU = 2 GPUs, but site 'local' has 0 (...)"."""
    return (
        f"{ranks} rank{'s' if ranks != 1 else ''} × {per} GPU{'s' if per != 1 else ''} = "
        f"{ranks * per} GPUs, but site {site!r} has {have} (PHALANX_GPUS or site gpus:)"
    )


def _listen_problem(host: str) -> str | None:
    """Why the driver could not listen where its ranks will connect (``ControlServer``), if so."""
    import socket

    try:
        address = socket.gethostbyname(socket.getfqdn()) if host == "auto" else host
        with socket.socket() as sock:
            sock.bind((address, 0))
    except (OSError, ValueError) as exc:  # not this machine's address, no such name, bad text
        return (
            f"cannot listen on {host!r} on this machine ({getattr(exc, 'strerror', None) or exc}); "
            "ranks reach the driver there: give an address of this machine, or 'auto'"
        )
    return None


def _not_sealed_in(site: Site, session: str, name: str) -> str | None:
    """None when store session ``session`` holds ``name`` sealed, else why it does not."""
    from ..store import Store

    try:
        store = Store(site.store.root, session)
        if store.exists(name):
            return None
    except (PhalanxError, ValueError, OSError) as exc:  # the store cannot be opened
        return f"cannot read store session {session!r}: {exc}"
    return f"dataset {name!r} is not in store session {session!r} of {store.root}"
