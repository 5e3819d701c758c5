"""Executors are plug-ins: a new backend is one module, its config model, one registry line or
entry point, and a site file; the scheduler and gang never name an executor."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phalanx as px
from phalanx.executors import executors
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"


def _register_entry_point(tmp_path: Path) -> Path:
    """A distribution on sys.path whose entry point (group phalanx.executors) is the shell
    executor: what `pip install phalanx-shell` would leave."""
    dist = tmp_path / "site-packages"
    info = dist / "phalanx_shell-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: phalanx-shell\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[phalanx.executors]\nshell = shell_executor:ShellExecutor\n")
    return dist


def _python(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(_register_entry_point(tmp_path)), str(PLUGINS), str(ROOT / "tests"), str(ROOT)]
        ),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_the_shell_plugin_passes_the_executor_contract(tmp_path):
    """What the plug-in's own project runs: phalanx.testing's executor contract, subclassed in
    its test module (tests/plugins/shell_contract.py, known failures in shell_conftest.py), in a
    pytest of its own with only the plug-in installed (no phalanx test module on the path, no
    conftest of phalanx's)."""
    project = tmp_path / "phalanx-shell"
    (project / "tests").mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\n")  # its own rootdir
    (project / "tests" / "test_contract.py").write_text((PLUGINS / "shell_contract.py").read_text())
    (project / "tests" / "conftest.py").write_text((PLUGINS / "shell_conftest.py").read_text())
    # installed: the plug-in (its module and entry point) and phalanx (this checkout), not tests/
    path = [str(_register_entry_point(tmp_path)), str(PLUGINS), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    # its temporary directories under ours: its cleanup of old ones never meets this session's
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--basetemp={tmp_path / 'tmp'}"]
    out = subprocess.run(
        [*pytest, "tests"],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
        timeout=270,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    # every test of both mix-ins ran: passed, skipped where the site cannot have its point (no
    # resource manager to queue on, no gang reuse declared), or the plug-in's known failure
    summary = out.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and "xfailed" not in summary, summary
    assert not re.search(r"\b(failed|errors?|xpassed)\b", summary), summary


def test_scheduler_and_gang_name_no_executor():
    """The registry is the only place executors are named: no string constant in the scheduler
    or the gang is an executor's name."""
    names = set(executors.names())
    for path in (ROOT / "phalanx/orchestrator/scheduler.py", ROOT / "phalanx/gang.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        named = [
            (n.lineno, n.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and id(n) not in docstrings
            and any(w in names for w in n.value.replace(":", " ").replace("'", " ").split())
        ]
        assert named == [], f"{path.name} names executors: {named}"
        imports = [
            a.name
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
            if any(x in names for x in (a.name.split("."), [getattr(n, "module", "") or ""])[0])
        ]
        assert imports == [], f"{path.name} imports executor modules: {imports}"


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_an_entry_point_executor_runs_a_workflow_with_its_typed_section(tmp_path):
    """A plug-in installed as a distribution: its site section is validated by its own model,
    its stages (BSP and command) run, and the results are right."""
    site = tmp_path / "shell-site.yaml"
    site.write_text("name: sh\nexecutor: shell\nshell:\n  shell: /bin/bash\n  rank_slots: 3\n")
    out = _python(
        """
        import sys, tempfile
        import pyarrow as pa
        import phalanx as px
        from phalanx.orchestrator.rundb import RunDB
        from phalanx.orchestrator.scheduler import run_workflow
        from phalanx.orchestrator.loading import load_site

        wf = px.Workflow("plug")

        @wf.stage(ranks=3, outputs=["r"])
        def ranks(env):
            import os
            env.output("r", pa.table({"rank": [env.rank], "shell": [os.path.basename(os.readlink(f"/proc/{os.getppid()}/exe"))]}))

        wf.command("cmd", ["/bin/sh", "-c", "echo rank $PHALANX_RANK of $PHALANX_WORLD_SIZE"], ranks=2, needs=["ranks"])
        site = load_site(sys.argv[1])
        assert site.executor == "shell" and site.capacity() == 3, site
        result = run_workflow(wf.model(), site, db=RunDB(tempfile.mkdtemp()))
        assert result.ok, result.failed
        table = px.Store(site.store.root, result.session).read("r").sort_by("rank")
        print(table.column("rank").to_pylist(), sorted(set(table.column("shell").to_pylist())))
        """,
        tmp_path,
        str(site),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # every rank ran; a rank's parent is the driver itself (the shell exec'd the worker)
    assert out.stdout.split("\n")[-2].startswith("[0, 1, 2]"), out.stdout


def _load_site_error(site: Path, tmp_path: Path) -> str:
    """What loading ``site`` reports, where the shell plug-in is installed."""
    out = _python(
        """
        import sys
        from phalanx.orchestrator.loading import load_site
        try:
            load_site(sys.argv[1])
        except Exception as exc:
            print(exc)
        """,
        tmp_path,
        str(site),
    )
    return out.stdout + out.stderr


def test_a_plugin_section_typo_is_reported_at_its_line(tmp_path):
    site = tmp_path / "shell-site.yaml"
    site.write_text("name: sh\nexecutor: shell\nshell:\n  shel: /bin/bash\n")
    assert f"{site}:4: shell.shel: unknown key (did you mean 'shell'?)" in _load_site_error(site, tmp_path)


def test_unknown_executor_lists_the_registered_ones(tmp_path):
    site = tmp_path / "s.yaml"
    site.write_text("name: s\nexecutor: shel\n")
    assert "executor: unknown executor 'shel' (did you mean 'shell'?)" in _load_site_error(site, tmp_path)


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_what_an_executor_refuses_fails_that_stage_only(tmp_path):
    """A gang the executor refuses at launch (its check) fails that stage; an independent
    stage still runs and succeeds, and the run says failed (not cancelled)."""
    out = _python(
        """
        import sys
        import pyarrow as pa
        import phalanx as px
        from phalanx.orchestrator.models import Site
        from phalanx.orchestrator.rundb import RunDB
        from phalanx.orchestrator.scheduler import run_workflow

        site = Site(name="sh", executor="shell", shell={"max_ranks": 1, "rank_slots": 4})
        wf = px.Workflow("refuse")

        @wf.stage(ranks=2, outputs=["big"])
        def big(env):
            env.output("big", pa.table({"a": [1]}))

        @wf.stage(ranks=1, outputs=["small"])
        def small(env):
            env.output("small", pa.table({"a": [env.rank]}))

        db = RunDB(sys.argv[1])
        result = run_workflow(wf.model(), site, db=db)
        states = {s["stage"]: s["state"] for s in db.stages(result.run_id)}
        print(result.ok, sorted(result.failed), "over max_ranks 1" in result.failed.get("big", ""),
              sorted(states.items()), db.run(result.run_id)["state"])
        """,
        tmp_path,
        str(tmp_path / "state"),
    )
    assert out.stdout.strip().splitlines()[-1] == (
        "False ['big'] True [('big', 'failed'), ('small', 'succeeded')] failed"
    ), out.stdout + out.stderr[-3000:]


@pytest.mark.mpi
def test_concurrent_mpirun_stages_get_disjoint_cpus(tmp_path):
    """Two one-rank stages side by side on an mpirun site of 2 slots pin to different CPUs
    (the scheduler's slots reach mpirun: before, every gang pinned to the same cores)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    site = Site(name="m", executor="mpirun", cores=2, warm_ranks=0)
    wf = px.Workflow("pins")
    probe = ["python", "-c", "import os; print('cpus', os.environ['PHALANX_CPUS_BY_RANK'])"]
    wf.command("a", probe)
    wf.command("b", probe)
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf.model(), site, db=db)
    assert result.ok, result.failed
    seen = []
    for stage in ("a", "b"):
        log = Path(db.attempts(result.run_id, stage)[-1]["log_dir"]) / "rank-0.log"
        seen.append(log.read_text().split("cpus ")[1].split()[0])
    assert sorted(seen) == sorted(str(c) for c in sorted(os.sched_getaffinity(0))[:2]), seen
