"""Reading a workflow and its site: find and parse the files, apply ``--set`` overrides, then
``validate.check`` it all; every problem names its file, line and field.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..runtime.envvars import ENV_SITE_PATH
from .models import Site, Workflow
from .validate import check
from .yamlio import ConfigError, field_path, load_model, load_yaml, parse, parse_yaml


def find_site(name_or_path: str, near: Path | None = None) -> Path | None:
    """A site file by path, or ``<name>.yaml`` in $PHALANX_SITE_PATH, ./site-configs,
    or the site-configs directory beside the workflow's directory."""

    def exists(p: Path) -> bool:
        try:
            return p.exists()
        except (OSError, ValueError):  # a name too long for a path
            return False

    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        p = Path(name_or_path)
        return p if exists(p) else None
    dirs = [Path(d) for d in os.environ.get(ENV_SITE_PATH, "").split(os.pathsep) if d]
    dirs.append(Path.cwd() / "site-configs")
    if near is not None:
        dirs += [near / "site-configs", near.parent / "site-configs"]
    for d in dirs:
        for ext in (".yaml", ".yml"):
            if exists(d / f"{name_or_path}{ext}"):
                return d / f"{name_or_path}{ext}"
    return None


def load_site(name_or_path: str, near: Path | None = None, where: str | None = None) -> Site:
    """``where``: the field that named the site ("wf.yaml:2: site"), for the error."""
    path = find_site(name_or_path, near)
    if path is None:
        if name_or_path == "local":
            return Site(name="local")  # this machine with defaults: no file needed
        what = f"{where}: no such site file {name_or_path!r}" if where else f"site {name_or_path!r}: no such site file"
        raise ConfigError([f"{what} (looked in ${ENV_SITE_PATH}, ./site-configs and beside the workflow)"])
    return load_model(Site, path)


def stage_sites(wf: Workflow, default: Site, near: Path | None = None) -> dict[str, Site]:
    """Stage → the site it runs on: the one its ``site:`` names (each file loaded once), else
    ``default`` (the workflow's).  A ConfigError names every stage whose site cannot be loaded
    (file:line of its ``site:``)."""
    loaded: dict[str, Site] = {default.name: default}
    out: dict[str, Site] = {}
    problems: list[str] = []
    for name, st in wf.stages.items():
        if not st.site:
            out[name] = default
            continue
        if st.site not in loaded:
            try:
                loaded[st.site] = load_site(st.site, near, where=wf.where(("stages", name, "site")))
            except ConfigError as exc:
                problems += exc.problems
                continue
        site = loaded[st.site]
        if loaded.setdefault(site.name, site) is not site and loaded[site.name].model_dump() != site.model_dump():
            problems.append(
                f"{wf.where(('stages', name, 'site'))}: site {st.site!r} is named {site.name!r}, "
                "as another site of this workflow is: give the sites different names"
            )
            continue
        out[name] = loaded[site.name]
    if problems:
        raise ConfigError(problems)
    return out


def store_reach_notes(sites: Iterable[Site]) -> list[str]:
    """A note per site whose store lives in each host's own memory (``paths.HOST_MEMORY``) while its
    executor may place ranks on several hosts and runs no store service there: a rank on
    another host could not read what one wrote (``PartitionLostError`` at the read).  What
    ``phalanx validate`` says, before any run finds out."""
    from ..paths import default_store_root
    from .driver_service import store_in_host_memory

    notes = []
    for site in {s.name: s for s in sites}.values():
        root = site.store.root or str(default_store_root())
        if not store_in_host_memory(site) or site.store.durability == "write-through":
            continue
        if site.create_executor().serves_store():
            continue
        notes.append(
            f"note: site {site.name!r}: store root {root} is each host's own memory, and executor "
            f"{site.executor!r} runs no store service on its hosts: where ranks land on several hosts, one "
            "cannot read what another wrote (PartitionLostError) — give the site a root every host mounts, "
            "an s3:// root, or store.durability: write-through (docs/store.md, 'Across hosts')"
        )
    return notes


def site_plan(wf: Workflow, sites: dict[str, Site]) -> list[str]:
    """Which stage runs where, and which datasets will cross between sites (by whom they are
    read) and by which path: through the object store both sites name as their exchange (named,
    credentials masked), else directly from the producer's store; or not at all where both
    sites name one store.  What ``phalanx validate`` prints for a workflow on several sites."""
    from .crossings import crossing_path, shared_exchange

    producers = {out: name for name, st in wf.stages.items() for out in st.outputs}
    lines = []
    for name, st in wf.stages.items():
        here = sites[name]
        lines.append(f"  {name}: site {here.name!r} ({here.executor}), {st.ranks} rank{'' if st.ranks == 1 else 's'}")
    crossing: dict[tuple[str, str, str], tuple[Site, Site, list[str]]] = {}
    for name, st in wf.stages.items():
        for spec in st.inputs.values():
            made = producers.get(spec.dataset)
            if made is not None and sites[made].name != sites[name].name:
                src, dst = sites[made], sites[name]
                crossing.setdefault((spec.dataset, src.name, dst.name), (src, dst, []))[2].append(name)
    for (dataset, src_name, dst_name), (src, dst, readers) in crossing.items():
        who = ", ".join(readers)
        if (src.store.root, src.store.metadata) == (dst.store.root, dst.store.metadata):
            lines.append(
                f"  shares: {dataset} of {src_name!r} with {dst_name!r}: one store, nothing crosses (read by {who})"
            )
        else:
            path = crossing_path(shared_exchange(src.store.exchange, dst.store.exchange))
            lines.append(f"  crosses: {dataset} from {src_name!r} to {dst_name!r}, {path} (read by {who})")
    return lines


def load_workflow(
    path: str | Path,
    site: str | None = None,
    overrides: dict[str, Any] | None = None,
    existing: set[str] | None = None,
    check_imports: bool = True,
) -> tuple[Workflow, Site]:
    """Parse and check a workflow file; raises ConfigError listing every problem."""
    data, root, source = load_yaml(path)
    overridden = _apply_overrides(data, overrides or {}) if isinstance(data, dict) else []
    wf = parse(Workflow, data, source, root, overridden)
    near = Path(path).resolve().parent
    st = load_site(site or wf.site, near, where=None if site else wf.where(("site",)))
    sites = stage_sites(wf, st, near)
    problems = check(wf, st, existing=existing, check_imports=check_imports, sites=sites)
    if problems:
        raise ConfigError(problems)
    return wf, st


def _apply_overrides(data: dict, overrides: dict[str, Any]) -> list[tuple[str, ...]]:
    """Set every override; the key paths set, or a ConfigError naming each bad one."""
    problems = []
    for dotted, value in overrides.items():
        try:
            _set_dotted(data, dotted, value)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return [tuple(dotted.split(".")) for dotted in overrides]


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    """``--set stages.x.params.rows=10``: YAML-typed value at a dotted path."""
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(
                [
                    f"--set {dotted}: {field_path(keys[: i + 1])}: is not a mapping, so "
                    f"{keys[i + 1]!r} cannot be set in it"
                ]
            )
    node[keys[-1]] = parse_yaml(value, f"--set {dotted}", lines=False)[0] if isinstance(value, str) else value
