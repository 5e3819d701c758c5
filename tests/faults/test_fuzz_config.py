"""Fuzzed workflow files, site files and ``--set`` values: each one validates, or is rejected
with a ConfigError whose every line names where (``file:line`` or ``--set KEY``) and what.

Inputs are mutations of the repository's own workflows/*.yaml and site-configs/*.yaml: values
of the wrong type, huge and non-finite numbers, path-like, empty, long and unicode names,
unknown keys, deep nesting, and bytes spliced into the text (bad UTF-8, control characters,
tabs, YAML syntax).  They go through ``load_workflow`` — what ``phalanx validate`` and
``phalanx run`` call — and a few through the real CLI.  Seeds are fixed (``derandomize``).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.cli import _overrides
from phalanx.orchestrator.loading import load_workflow
from phalanx.orchestrator.yamlio import ConfigError

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "workflows").glob("*.yaml"))}
SITES = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "site-configs").glob("*.yaml"))}
RAW = {
    p.name: p.read_bytes()
    for p in sorted((ROOT / "workflows").glob("*.yaml")) + sorted((ROOT / "site-configs").glob("*.yaml"))
}
FIXED = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def fuzz(examples: int) -> settings:
    return settings(FIXED, max_examples=examples)


NAMES = st.sampled_from(
    [
        "",
        ".",
        "..",
        "a/../../b",
        "a/b/c",
        "x" * 300,
        "é",
        "名前",
        "a b",
        "-x",
        "a\tb",
        "😀",
        "local",
        "lcoal",
        "mpi",
        "bogus://",
        "tcp://h:99999",
        "SESSION/NAME",
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**30, -1, 0, 2**63, 1000000000]),
    st.floats(),
    st.text(max_size=20),
    NAMES,
    st.binary(max_size=6),
    st.sampled_from([f"__DEEP_{n}__" for n in (99, 100, 101, 3000)]),
)  # nested lists, spliced in as text
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | NAMES, inner, max_size=3),
    max_leaves=8,
)
KEYS = st.one_of(
    NAMES,
    st.text(max_size=10),
    st.integers(-5, 5),
    st.sampled_from(["slurm", "ray", "partiton", "strategi", "ranks", "timeout", "retries", "executor", "pilot", "<<"]),
)
SPLICES = st.one_of(
    st.binary(min_size=1, max_size=4),
    st.sampled_from(
        [
            b"\t",
            b"\x00",
            b"\xff",
            b"\xef\xbb\xbf",
            b"\r",
            b"\x85",
            b"\xe2\x80\xa8",
            b": ",
            b"- ",
            b"{",
            b"[",
            b"&a ",
            b"*a",
            b"!!python/object:os.system ",
            b"<<: *x\n",
            "é".encode(),
            b"\x1b",
            b"\n  x: 1\n",
            b"'",
            b'"\\0"',
            b"!!int 0x",
            b"2024-13-45",
            b"? [a]\n",
        ]
    ),
)

tally: Counter = Counter()
LOCATED = re.compile(r"(?P<where>--set .+?|(?P<file>.+?):\d+): (?P<rest>.+)")


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    """Every path into a document: dict keys and list indices, the root included."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, at + (i,))
    return out


@st.composite
def mutated(draw, docs: dict[str, Any]) -> str:
    """One of ``docs`` with 1 to 3 keys set to odd values, deleted, renamed or added, as YAML text."""
    doc = copy.deepcopy(docs[draw(st.sampled_from(sorted(docs)))])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        op = draw(st.sampled_from(["set", "delete", "rename", "add"]))
        if not path or (op == "add" and not isinstance(parent[path[-1]], dict)):
            doc = draw(VALUES) if op == "set" else doc
        elif op == "add":
            parent[path[-1]][draw(KEYS)] = draw(VALUES)
        elif op == "set":
            parent[path[-1]] = draw(VALUES)
        elif isinstance(parent, dict):
            value = parent.pop(path[-1])
            if op == "rename":
                parent[draw(KEYS)] = value
        else:
            del parent[path[-1]]
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    return re.sub(r"'?__DEEP_(\d+)__'?", lambda m: "[" * int(m[1]) + "]" * int(m[1]), text)


@st.composite
def spliced(draw) -> bytes:
    """A real file's bytes with a few spliced in, cut out or the end cut off."""
    raw = RAW[draw(st.sampled_from(sorted(RAW)))]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["insert", "cut", "truncate"]))
        if op == "insert":
            raw = raw[:at] + draw(SPLICES) + raw[at:]
        elif op == "cut":
            raw = raw[:at] + raw[at + draw(st.integers(1, 40)) :]
        else:
            raw = raw[:at]
    return raw


def _outcome(run, sources: tuple[str, ...]) -> str:
    """ "valid" or "rejected"; fails on any other exception or an unlocated problem."""
    try:
        run()
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            m = LOCATED.fullmatch(problem)
            assert m, f"no file:line or --set in {problem!r}"
            assert m["file"] is None or m["file"] in sources, problem
            rest = m["rest"]
            assert rest.startswith(("not valid YAML: ", "not UTF-8: ", "expected KEY=VALUE")) or ": " in rest, (
                f"no field in {problem!r}"
            )
        tally["rejected"] += 1
        return "rejected"
    tally["valid"] += 1
    return "valid"


def _write(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A directory to write the inputs in; the cwd two levels below it, so that a fuzzed
    relative store root (``a/../../b``) the validator opens stays inside it."""
    cwd = tmp_path / "cwd" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("PHALANX_SITE_PATH", raising=False)
    yield tmp_path  # validating a site starts nothing: no pilot, no connection


def _fuzz_workflow_files(tmp: Path) -> None:
    @fuzz(120)
    @given(mutated(WORKFLOWS))
    def run(text: str) -> None:
        wf = _write(tmp, "wf.yaml", text)
        _outcome(lambda: load_workflow(wf, check_imports=False), (str(wf),))

    run()


def _fuzz_site_files(tmp: Path) -> None:
    @fuzz(120)
    @given(mutated(SITES), st.sampled_from(sorted(WORKFLOWS)))
    def run(text: str, workflow: str) -> None:
        site = _write(tmp, "site.yaml", text)
        _outcome(
            lambda: load_workflow(ROOT / "workflows" / workflow, site=str(site), check_imports=False),
            (str(site), str(ROOT / "workflows" / workflow)),
        )

    run()


def _fuzz_bytes(tmp: Path) -> None:
    @fuzz(120)
    @given(spliced(), st.booleans())
    def run(raw: bytes, as_site: bool) -> None:
        path = _write(tmp, "in.yaml", raw)
        wf = ROOT / "workflows" / "tpch.yaml"
        _outcome(
            lambda: (
                load_workflow(wf, site=str(path), check_imports=False)
                if as_site
                else load_workflow(path, check_imports=False)
            ),
            (str(path), str(wf)),
        )

    run()


def _fuzz_set_values(tmp: Path) -> None:
    real = [".".join(map(str, p)) for p in _paths(WORKFLOWS["tpch.yaml"]) if p]
    key = st.one_of(
        st.sampled_from(real), st.builds(lambda k, x: f"{k}.{x}", st.sampled_from(real), KEYS), st.text(max_size=12)
    )
    value = st.one_of(
        st.text(max_size=20),
        NAMES,
        st.sampled_from(
            [
                "[a",
                "{",
                "true",
                ".inf",
                ".nan",
                "1e999",
                "-1",
                "''",
                "!!binary x",
                "&a *a",
                "\t1",
                "2024-13-45",
                "!!python/object:os.system x",
                "[" * 3000,
                "{a: 1, a: 2}",
                "1000000000",
            ]
        ),
    )

    @fuzz(120)
    @given(st.lists(st.tuples(key, value), min_size=1, max_size=3))
    def run(sets: list[tuple[str, str]]) -> None:
        wf = ROOT / "workflows" / "tpch.yaml"
        _outcome(
            lambda: load_workflow(wf, overrides=_overrides([f"{k}={v}" for k, v in sets]), check_imports=False),
            (str(wf),),
        )

    run()


def _fuzz_cli(tmp: Path) -> None:
    """The real ``phalanx validate``: exit 0 with "ok", or 1 with located problems, no traceback."""

    @fuzz(6)
    @given(mutated(WORKFLOWS) | spliced().map(lambda b: b.decode("utf-8", "replace")), NAMES)
    def run(text: str, value: str) -> None:
        wf = _write(tmp, "cli.yaml", text)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "phalanx.cli",
                "validate",
                str(wf),
                "--no-imports",
                f"--set=stages.dbgen.params.x={value}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr

        def replay() -> None:
            if out.returncode:
                raise ConfigError(out.stderr.splitlines())

        assert _outcome(replay, (str(wf),)) == ("rejected" if out.returncode else "valid")

    run()


def test_fuzzed_workflow_site_and_set_inputs_validate_or_fail_cleanly(fault, work):
    fault.describe("fuzzed workflow/site/--set inputs", backend="local")
    tally.clear()
    for run in (_fuzz_workflow_files, _fuzz_site_files, _fuzz_bytes, _fuzz_set_values, _fuzz_cli):
        run(work)
    total = tally["valid"] + tally["rejected"]
    assert tally["rejected"] > total // 2 and tally["valid"] > 0, tally  # both kinds really occur
    fault.outcome(
        f"{total} of {total} rejected cleanly or valid ({tally['rejected']} rejected with "
        f"file:line: field, {tally['valid']} valid); no traceback"
    )
    fault.data_lost("none")
