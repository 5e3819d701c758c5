"""``phalanx``: validate workflows, look into the store, publish the config schemas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value, e.g. stages.gen.params.rows=1000")
        out[key] = value
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from .orchestrator.validate import load_workflow
    from .orchestrator.yamlio import ConfigError

    try:
        wf, site = load_workflow(args.workflow, site=args.site, overrides=_overrides(args.set),
                                 check_imports=not args.no_imports)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    ranks = max(st.ranks for st in wf.stages.values())
    print(f"{args.workflow}: ok — workflow {wf.name!r}, {len(wf.stages)} stages, "
          f"largest gang {ranks} ranks, site {site.name!r} ({site.executor}, {site.capacity()} slots)")
    return 0


def _store(args: argparse.Namespace):
    from .store import Store

    return Store(args.root, args.session)


def cmd_store(args: argparse.Namespace) -> int:
    from .errors import StoreError

    store = _store(args)
    try:
        if args.store_cmd == "ls":
            infos = [store.info(n) for n in store.list()]
            if not infos:
                print(f"no datasets in session {store.session!r} of {store.root}")
            for info in infos:
                print(f"{info.name:30} {info.num_rows:>14,} rows {info.nbytes / 1e6:>10.1f} MB "
                      f"{info.num_partitions:>4} parts  {info.partitioning.get('kind')}  {info.producer}")
        elif args.store_cmd == "show":
            print(json.dumps(store.info(args.name).summary(), indent=2, default=str))
        elif args.store_cmd == "rm":
            for name in args.names:
                store.delete(name)
                print(f"removed {name}")
    except StoreError as exc:
        print(f"phalanx store: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    for path, text in schema_files(Path(args.out)).items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def schema_files(out: Path) -> dict[Path, str]:
    """The published JSON Schemas (docs/*.schema.json), generated from the models."""
    from .orchestrator.models import Site, Workflow

    return {out / f"{name}.schema.json": json.dumps(model.model_json_schema(), indent=2) + "\n"
            for name, model in (("workflow", Workflow), ("site", Site))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phalanx", description="Gang-scheduled BSP dataframe workflows.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    v = sub.add_parser("validate", help="check a workflow file without running it")
    v.add_argument("workflow")
    v.add_argument("--site", help="site name (site-configs/NAME.yaml) or site file")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. stages.gen.params.rows=1000")
    v.add_argument("--no-imports", action="store_true", help="do not import the stages' apps")
    v.set_defaults(fn=cmd_validate)

    s = sub.add_parser("store", help="list, show or remove datasets")
    s.add_argument("--root", help="store directory (default: $PHALANX_STORE or /dev/shm/phalanx-$USER/store)")
    s.add_argument("--session", default="default")
    ssub = s.add_subparsers(dest="store_cmd", required=True)
    ssub.add_parser("ls")
    show = ssub.add_parser("show")
    show.add_argument("name")
    rm = ssub.add_parser("rm")
    rm.add_argument("names", nargs="+")
    s.set_defaults(fn=cmd_store)

    sc = sub.add_parser("schema", help="write the JSON Schemas of workflow and site files")
    sc.add_argument("--out", default="docs")
    sc.set_defaults(fn=cmd_schema)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
