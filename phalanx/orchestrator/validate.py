"""Checks before anything starts: the DAG, the data it needs, the apps, the site's capacity.

Every problem names the file, line and field; all problems are reported at once.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

from .models import Site, Workflow
from .yamlio import ConfigError, _line_of, load_model, load_yaml, parse


def dependencies(wf: Workflow) -> dict[str, set[str]]:
    """Stage → stages it waits for: its ``needs`` plus the producers of its inputs."""
    producer = {out: name for name, st in wf.stages.items() for out in st.outputs}
    deps = {}
    for name, st in wf.stages.items():
        deps[name] = set(st.needs) | {producer[i.dataset] for i in st.inputs.values()
                                      if i.dataset in producer and producer[i.dataset] != name}
    return deps


def _find_cycle(deps: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(deps.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
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
        return f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"module {module_name!r} has no {attr!r}"
        obj = getattr(obj, part)
    return None if callable(obj) else f"{app!r} is not callable"


def check(wf: Workflow, site: Site, *, source: str = "<python>", root: yaml.Node | None = None,
          existing: set[str] | None = None, check_imports: bool = True) -> list[str]:
    """Every problem found, as "file:line: field: message" (empty when the workflow is sound)."""
    problems: list[str] = []

    def report(loc: tuple, message: str) -> None:
        line = _line_of(root, loc) if root is not None else None
        where = f"{source}:{line}" if line else source
        problems.append(f"{where}: {'.'.join(map(str, loc))}: {message}")

    names = list(wf.stages)  # file order: problems read top to bottom
    producers: dict[str, str] = {}
    for name in names:
        for out in wf.stages[name].outputs:
            if out in producers:
                report(("stages", name, "outputs"), f"dataset {out!r} is also produced by stage {producers[out]!r}")
            producers.setdefault(out, name)
    capacity = site.capacity()
    for name in names:
        st = wf.stages[name]
        for i, need in enumerate(st.needs):
            if need not in wf.stages:
                report(("stages", name, "needs", i), f"unknown stage {need!r} (stages: {', '.join(sorted(names))})")
            elif need == name:
                report(("stages", name, "needs", i), "a stage cannot need itself")
        for local, spec in st.inputs.items():
            session, _, short = spec.dataset.rpartition("/")
            if session:  # another session's dataset (e.g. an earlier run's): must be sealed now
                if not _sealed_elsewhere(site, session, short):
                    report(("stages", name, "inputs", local),
                           f"dataset {short!r} is not in store session {session!r} of {_store_root(site)}")
            elif spec.dataset not in producers and spec.dataset not in (existing or set()):
                report(("stages", name, "inputs", local),
                       f"dataset {spec.dataset!r} is produced by no stage and is not in the store "
                       "(another run's output: 'SESSION/NAME')")
        if st.ranks > capacity:
            report(("stages", name, "ranks"),
                   f"{st.ranks} ranks, but site {site.name!r} can give at most {capacity}")
        if check_imports and st.app:
            problem = _import_problem(st.app)
            if problem:
                report(("stages", name, "app"), problem)
    cycle = _find_cycle({n: {d for d in deps if d in wf.stages} for n, deps in dependencies(wf).items()})
    if cycle:
        report(("stages", cycle[0], "needs"), "cycle: " + " → ".join(cycle))
    return problems


def _store_root(site: Site) -> str:
    from ..store import Store

    return str(Store(site.store.root).root)


def _sealed_elsewhere(site: Site, session: str, name: str) -> bool:
    from ..store import Store

    try:
        return Store(site.store.root, session).exists(name)
    except ValueError:  # a malformed name
        return False


SITE_DIRS_ENV = "PHALANX_SITE_PATH"


def find_site(name_or_path: str, near: Path | None = None) -> Path | None:
    """A site file by path, or ``<name>.yaml`` in $PHALANX_SITE_PATH, ./site-configs,
    or the site-configs directory beside the workflow's directory."""
    import os

    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        p = Path(name_or_path)
        return p if p.exists() else None
    dirs = [Path(d) for d in os.environ.get(SITE_DIRS_ENV, "").split(os.pathsep) if d]
    dirs.append(Path.cwd() / "site-configs")
    if near is not None:
        dirs += [near / "site-configs", near.parent / "site-configs"]
    for d in dirs:
        for ext in (".yaml", ".yml"):
            if (d / f"{name_or_path}{ext}").exists():
                return d / f"{name_or_path}{ext}"
    return None


def load_site(name_or_path: str, near: Path | None = None) -> Site:
    path = find_site(name_or_path, near)
    if path is None:
        if name_or_path == "local":
            return Site(name="local")  # this machine with defaults: no file needed
        raise ConfigError([f"site {name_or_path!r}: no such site file (looked in ${SITE_DIRS_ENV}, "
                           "./site-configs and beside the workflow)"])
    return load_model(Site, path)


def load_workflow(path: str | Path, site: str | None = None, overrides: dict[str, Any] | None = None,
                  existing: set[str] | None = None, check_imports: bool = True) -> tuple[Workflow, Site]:
    """Parse and check a workflow file; raises ConfigError listing every problem."""
    data, root, source = load_yaml(path)
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    wf = parse(Workflow, data, source, root)
    st = load_site(site or wf.site, Path(path).resolve().parent)
    problems = check(wf, st, source=source, root=root, existing=existing, check_imports=check_imports)
    if problems:
        raise ConfigError(problems)
    return wf, st


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    """``--set stages.x.params.rows=10``: YAML-typed value at a dotted path."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError([f"--set {dotted}: {key!r} is not a mapping"])
    node[keys[-1]] = yaml.safe_load(value) if isinstance(value, str) else value
