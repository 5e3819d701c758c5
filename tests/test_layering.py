"""phalanx's own layout check (issue 10, item 6): layers that only import downwards, no cycles.

Every module under ``phalanx/`` is parsed with ``ast`` (nothing is imported).  Its imports are
collected wherever they stand — at module level and inside functions, methods and ``try``
blocks — with relative imports resolved (``from . import x`` is an import of the submodule
``x`` where ``x`` is one), plus the two ways phalanx imports by name: registry targets
(``"phalanx.store.tiers:FileTier"``) and ``importlib.import_module`` with a literal name.
Imports under ``if TYPE_CHECKING:`` are exempt: they never run.

The layers, lowest first (a module may import its own layer and the ones below, never above):

    base          errors, _registry, paths, private, redact, procs, sqlite_wal (no phalanx imports but these)
    runtime       the rank side: worker, BSPEnv, communicators, rendezvous
    operators     the distributed DataFrame
    store         the intermediate store, env.store (attaches itself to BSPEnv)
    ml            px.ml: loader, ddp
    executors     where gangs run
    gang          px.Gang
    orchestrator  workflows, sites, scheduler, run DB, the stage runner
    entry points  phalanx/__init__ (px.*), cli, the workflow API, run handles, integrations, examples

A lower layer that needs something of a higher one gets it injected (the store attaches its
opener to BSPEnv; the scheduler hands the gang the stage runner as an app), it never imports it.
The checks:

- every module is in a layer (a new module must be placed in ``LAYERS``);
- no import goes from a lower layer to a higher one;
- no import cycle among the packages of the layers (the units of ``LAYERS``), counting every
  import; and none among single modules counting the imports that run when a module is
  imported (those are the cycles that break with a partly initialised module);
- default paths (log root, state dir, store root, spill dir) are decided in ``phalanx/paths.py``
  only: their variables and default places appear in no other module.

``PENDING`` (and ``PATHS_PENDING``) list the violations that are known and being fixed elsewhere: the test passes with
them and fails on any other, and on an allowance that no longer occurs (the list only shrinks).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "phalanx"

# Lowest first.  A unit is a module or a package (its submodules included); the most specific
# unit a module falls in decides its layer.  The root package ("phalanx", i.e. its __init__)
# is a unit of its own: it is not a catch-all for modules nobody placed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "phalanx.errors",
            "phalanx._registry",
            "phalanx.extras",
            "phalanx.paths",
            "phalanx.private",
            "phalanx.redact",
            "phalanx.procs",
            "phalanx.sqlite_wal",
        ),
    ),
    # observe.tracing: the exchange operators call it (observe's __init__ is a docstring only)
    ("runtime", ("phalanx.runtime", "phalanx.observe", "phalanx.observe.tracing")),
    ("operators", ("phalanx.operators",)),
    ("store", ("phalanx.store",)),
    ("ml", ("phalanx.ml",)),
    ("executors", ("phalanx.executors",)),
    ("gang", ("phalanx.gang",)),
    ("orchestrator", ("phalanx.orchestrator",)),
    (
        "entry points",
        (
            "phalanx",
            "phalanx.cli",
            "phalanx.api",
            "phalanx.handle",
            "phalanx.orchestrator.api",
            "phalanx.integrations",
            "phalanx.examples",
            "phalanx.observe.metrics",
            "phalanx.observe.serving",
            "phalanx.ui",
        ),
    ),
    # the contracts plug-ins run (pytest test classes): above everything they exercise
    ("testing", ("phalanx.testing",)),
]

# Violations being fixed by the executor refactor (issue 10; files the lead owns: gang.py,
# executors/**, orchestrator/scheduler.py, models.py, validate.py, api.py, cli.py, handle.py).
# Each entry is (file, imported module) → why it is there and what replaces it; keyed without
# line numbers so that edits around them do not break the test.  Each must still occur (the
# test fails on a stale entry), so the list only shrinks.  Emptied so far:
#   ("phalanx/executors/slurm/pilot.py", "phalanx.gang"): SlurmPilot took its log directory from
#       gang.default_log_root; it imports phalanx.paths.default_log_root now.
#   ("phalanx/gang.py", "phalanx.orchestrator.{models,scheduler,validate}"): px.Gang(site=...) asked
#       the scheduler for site_launcher; the orchestrator injects a site loader now.
PENDING: dict[tuple[str, str], str] = {}

# Default paths are decided in phalanx/paths.py only: the variables that override them and the
# places they default to appear nowhere else.  File → why it still does (the same rules as PENDING).
PATHS_PENDING: dict[str, str] = {}
PATH_WORDS = {
    "PHALANX_LOG_DIR",
    "PHALANX_STATE",
    "PHALANX_STORE",
    "PHALANX_STORE_SPILL",
    "XDG_STATE_HOME",
    "~/.local/state",
    "/dev/shm",
    "/var/tmp",
}


# ---- the scanner -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    file: str  # its path, relative to the scanned root
    line: int
    target: str  # imported module, dotted (always a module of the scanned package)
    at_import: bool  # an import statement that runs when the source is imported (module level)
    how: str  # "import", "registry target", "import_module"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name → file."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


_TARGET = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):[A-Za-z_][\w.]*$")  # "pkg.mod:Attr"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, modules: set[str], file: str, package: str):
        self.name, self.modules, self.file, self.package = name, modules, file, package
        self.here = name if is_package else name.rpartition(".")[0]  # what "." means
        self.depth = 0  # > 0 inside a function or lambda: runs only when called
        self.found: list[Import] = []

    def _add(self, node: ast.AST, target: str, how: str = "import") -> None:
        # the longest prefix that is a module of the package: "phalanx.store.tiers.FileTier" → tiers
        parts = target.split(".")
        while parts and ".".join(parts) not in self.modules:
            parts.pop()
        if parts:
            self.found.append(
                Import(self.name, self.file, node.lineno, ".".join(parts), self.depth == 0 and how == "import", how)
            )

    def _absolute(self, level: int, module: str | None) -> str:
        base = self.here.split(".")
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    # what is imported
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.level, node.module) if node.level else (node.module or "")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(node, sub if sub in self.modules else base)  # a submodule, or a name of base

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            m = _TARGET.match(node.value)
            if m and (m.group(1) == self.package or m.group(1).startswith(self.package + ".")):
                self._add(node, m.group(1), "registry target")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if (
            name in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            text = node.args[0].value
            dots = len(text) - len(text.lstrip("."))
            self._add(node, self._absolute(dots, text[dots:] or None) if dots else text, "import_module")
        self.generic_visit(node)

    # where it is imported
    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # never runs: only its else branch counts
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _in_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _in_function


def scan(root: Path = ROOT, package: str = PACKAGE) -> tuple[dict[str, Path], list[Import]]:
    files = module_files(root, package)
    names = set(files)
    imports = []
    for name, path in files.items():
        collector = _Collector(name, path.name == "__init__.py", names, path.relative_to(root).as_posix(), package)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        imports += [i for i in collector.found if i.target != name]
    return files, imports


# ---- the rules -------------------------------------------------------------------------------
def unit_of(module: str, layers=LAYERS, package: str = PACKAGE) -> tuple[int, str] | None:
    """(layer index, unit) of ``module``: its most specific unit; None if it is in no layer."""
    best = None
    for index, (_, units) in enumerate(layers):
        for unit in units:
            inside = module == unit or (unit != package and module.startswith(unit + "."))
            if inside and (best is None or len(unit) > len(best[1])):
                best = (index, unit)
    return best


def unplaced(files: dict[str, Path], layers=LAYERS) -> list[str]:
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({name}) is in no layer: "
        f"add it to LAYERS in tests/test_layering.py"
        for name, path in files.items()
        if unit_of(name, layers) is None
    ]


def upward(imports: list[Import], layers=LAYERS) -> list[tuple[Import, str]]:
    """Imports from a lower layer to a higher one, each with its message."""
    found = []
    for imp in imports:
        src, dst = unit_of(imp.source, layers), unit_of(imp.target, layers)
        if src is None or dst is None or dst[0] <= src[0]:
            continue
        where = "at import" if imp.at_import else "inside a function"
        kind = "" if imp.how == "import" else f" (a {imp.how})"
        found.append(
            (
                imp,
                f"{imp.file}:{imp.line} imports {imp.target}{kind} {where} "
                f"(layer {layers[src[0]][0]} may not import layer {layers[dst[0]][0]})",
            )
        )
    return found


def is_pending(imp: Import, pending=None) -> bool:
    return (imp.file, imp.target) in (PENDING if pending is None else pending)


def cycles(edges: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """One shortest cycle through every strongly connected component of more than one node
    (Tarjan's algorithm), as a node list whose last element is its first."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    nodes = sorted(set(edges) | {d for e in edges.values() for d in e})

    def connect(v: str) -> None:  # recursion depth: at most the number of units/modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in nodes:
        if v not in index:
            connect(v)
    found = []
    for comp in comps:  # breadth first from its smallest node, back to it: a shortest cycle
        start = min(comp)
        paths, queue, cycle = {start: [start]}, deque([start]), None
        while cycle is None:
            v = queue.popleft()
            for w in sorted(edges.get(v, ())):
                if w == start:
                    cycle = paths[v] + [start]
                    break
                if w in comp and w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        found.append(cycle)
    return sorted(found)


def graph(imports: list[Import], node) -> dict[str, dict[str, list[Import]]]:
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        a, b = node(imp.source), node(imp.target)
        if a is not None and b is not None and a != b:
            edges.setdefault(a, {}).setdefault(b, []).append(imp)
    return edges


def describe(cycle: list[str], edges: dict[str, dict[str, list[Import]]]) -> str:
    hops = "\n".join(
        f"    {a} → {b}: " + ", ".join(dict.fromkeys(f"{i.file}:{i.line}" for i in edges[a][b]))
        for a, b in zip(cycle, cycle[1:])
    )
    return " → ".join(cycle) + "\n" + hops


# ---- the tests -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scanned():
    return scan()


def test_every_module_is_in_a_layer(scanned):
    files, _ = scanned
    problems = unplaced(files)
    assert not problems, "\n".join(problems)


def test_no_import_reaches_up_a_layer(scanned):
    _, imports = scanned
    new = [message for imp, message in upward(imports) if not is_pending(imp)]
    assert not new, (
        "lower layers never import higher ones (tests/test_layering.py explains the "
        "layers; inject what a lower layer needs instead):\n" + "\n".join(new)
    )


def test_no_import_cycle_between_packages(scanned):
    _, imports = scanned
    edges = graph([i for i in imports if not is_pending(i)], lambda m: (unit_of(m) or (0, m))[1])
    found = cycles(edges)
    assert not found, "import cycles between phalanx's packages:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_import_time_cycle_between_modules(scanned):
    _, imports = scanned
    edges = graph([i for i in imports if i.at_import and not is_pending(i)], lambda m: m)
    found = cycles(edges)
    assert not found, "modules that import each other when imported:\n" + "\n".join(describe(c, edges) for c in found)


def test_pending_allowances_still_occur(scanned):
    """The allowance list only shrinks: an entry whose import is gone (fixed) must be removed."""
    _, imports = scanned
    violations = {(imp.file, imp.target) for imp, _ in upward(imports)}
    stale = [
        f"{file} no longer imports {target} from a higher layer: remove it from PENDING ({reason})"
        for (file, target), reason in PENDING.items()
        if (file, target) not in violations
    ]
    assert not stale, "\n".join(stale)


def path_decisions(files: dict[str, Path], root: Path = ROOT) -> dict[str, list[str]]:
    """File → "LINE: what" for each default-path word or ``tempfile.gettempdir`` outside paths.py."""
    found: dict[str, list[str]] = {}
    for name, path in files.items():
        if name == f"{PACKAGE}.paths":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            word = (
                node.value
                if isinstance(node, ast.Constant) and node.value in PATH_WORDS
                else "tempfile.gettempdir"
                if isinstance(node, ast.Attribute) and node.attr == "gettempdir"
                else None
            )
            if word:
                found.setdefault(path.relative_to(root).as_posix(), []).append((node.lineno, word))
    return {file: [f"{line}: {word}" for line, word in sorted(set(hits))] for file, hits in found.items()}


def test_default_paths_are_decided_in_one_module(scanned):
    files, _ = scanned
    found = path_decisions(files)
    new = [
        f"{file}:{where} (a default path decided outside phalanx/paths.py: use phalanx.paths)"
        for file, wheres in sorted(found.items())
        if file not in PATHS_PENDING
        for where in wheres
    ]
    stale = [
        f"{file} no longer decides a default path: remove it from PATHS_PENDING ({reason})"
        for file, reason in PATHS_PENDING.items()
        if file not in found
    ]
    assert not new + stale, "\n".join(new + stale)


# ---- the scanner, checked on a package made for it -------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_scanner_resolves_relative_function_level_and_by_name_imports(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .low import thing\n",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": """\
            from typing import TYPE_CHECKING
            from . import b                      # the submodule pkg.low.b
            from .. import high                  # the module pkg.high
            if TYPE_CHECKING:
                from ..high import Thing         # exempt
            else:
                import pkg.high.deep as deep     # counts
            def f():
                from ..high.deep import g        # inside a function
                importlib.import_module("..high", __package__)
            TARGET = "pkg.high.deep:Thing"       # a registry target
            """,
            "pkg/low/b.py": "from . import thing_in_init\n",  # a name of pkg.low's __init__
            "pkg/high/__init__.py": "",
            "pkg/high/deep.py": "from ..low.a import f\n",
        },
    )
    files, imports = scan(tmp_path, "pkg")
    got = sorted((i.source, i.line, i.target, i.at_import, i.how) for i in imports)
    assert got == [
        ("pkg", 1, "pkg.low", True, "import"),
        ("pkg.high.deep", 1, "pkg.low.a", True, "import"),
        ("pkg.low.a", 2, "pkg.low.b", True, "import"),
        ("pkg.low.a", 3, "pkg.high", True, "import"),
        ("pkg.low.a", 7, "pkg.high.deep", True, "import"),
        ("pkg.low.a", 9, "pkg.high.deep", False, "import"),
        ("pkg.low.a", 10, "pkg.high", False, "import_module"),
        ("pkg.low.a", 11, "pkg.high.deep", False, "registry target"),
        ("pkg.low.b", 1, "pkg.low", True, "import"),
    ]
    layers = [("low", ("pkg.low",)), ("high", ("pkg.high",)), ("top", ("pkg",))]
    messages = [m for _, m in upward(imports, layers)]
    assert (
        "pkg/low/a.py:9 imports pkg.high.deep inside a function (layer low may not import layer high)" in messages
        and len(messages) == 5
    )
    edges = graph(imports, lambda m: (unit_of(m, layers, "pkg") or (0, m))[1])
    assert cycles(edges) == [["pkg.high", "pkg.low", "pkg.high"]]
    assert describe(cycles(edges)[0], edges).splitlines()[0] == "pkg.high → pkg.low → pkg.high"
    module_edges = graph([i for i in imports if i.at_import], lambda m: m)
    assert cycles(module_edges) == [["pkg.high.deep", "pkg.low.a", "pkg.high.deep"]]


def test_a_module_outside_every_layer_is_named(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/known.py": "", "pkg/stray.py": ""})
    files, _ = scan(tmp_path, "pkg")
    layers = [("all", ("pkg", "pkg.known"))]
    assert [name for name in files if unit_of(name, layers, "pkg") is None] == ["pkg.stray"]


# ---- what the layers plug in from above, and the one module of default paths ------------------
def test_the_store_and_a_stage_plug_into_the_env_from_above():
    import types

    import phalanx.store  # noqa: F401  (attaches env.store; import phalanx does it too)
    from phalanx.orchestrator.stage import StageContext
    from phalanx.runtime.env import BSPEnv
    from phalanx.store.rank import RankStore

    env = BSPEnv(rank=0, world_size=1, comm=types.SimpleNamespace(name="fake"))
    assert isinstance(env.store, RankStore) and env.store is env.store  # opened once
    assert (env.stage, env.inputs, env.outputs) == ("", {}, [])
    with pytest.raises(RuntimeError, match=r"env.input\('x'\) is for the app of a workflow stage"):
        env.input("x")
    ctx = StageContext(env, "features", {"x": {"dataset": "tx"}}, ["out"])
    with env.in_stage(ctx):
        assert (env.stage, env.inputs, env.outputs) == ("features", {"x": {"dataset": "tx"}}, ["out"])
        with pytest.raises(KeyError, match="stage 'features' declares no output 'other'"):
            env.output("other", None)
    assert env.stage == ""  # the stage's runner lent it for the app's run only


def test_default_paths_come_from_one_module_with_their_overrides(tmp_path, monkeypatch):
    from phalanx import paths
    from phalanx.orchestrator.rundb import RunDB

    for var, fn in (
        ("PHALANX_LOG_DIR", paths.default_log_root),
        ("PHALANX_STATE", paths.default_state_dir),
        ("PHALANX_STORE", paths.default_store_root),
        ("PHALANX_STORE_SPILL", paths.default_spill_root),
    ):
        monkeypatch.setenv(var, str(tmp_path / var))
        assert fn() == tmp_path / var
    monkeypatch.delenv("PHALANX_STATE")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert paths.default_state_dir() == tmp_path / "xdg" / "phalanx"
    assert RunDB().state_dir == tmp_path / "xdg" / "phalanx"
    assert (tmp_path / "xdg" / "phalanx").stat().st_mode & 0o777 == 0o700
