"""Workflows built in Python (px.Workflow, @px.stage, px.run) and stage timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

import phalanx as px
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.yamlio import ConfigError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from apps import wf_generate_reference as generated  # noqa: E402


def build(name: str = "api") -> px.Workflow:
    import apps

    wf = px.Workflow(name)
    gen = wf.stage(apps.wf_generate, ranks=2, params={"rows": 3000, "seed": 5}, outputs=["tx"])
    wf.stage(apps.wf_totals, ranks=3, needs=[gen], inputs={"tx": {"dataset": "tx", "by": ["user"]}}, outputs=["totals"])
    return wf


def test_python_workflow_runs_and_matches_pandas(tmp_path):
    result = px.run(build(), site=Site(name="t4", cores=4), state=tmp_path / "state", progress=False)
    assert result.ok, result.failed
    got = px.Store(session=result.session).read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    expected = generated(3000, 2, seed=5).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    stages = RunDB(tmp_path / "state").stages(result.run_id)
    assert [s["stage"] for s in stages] == ["wf_generate", "wf_totals"]
    assert stages[1]["inputs"]["tx"]["rows"] == 3000  # every row read once over the 3 ranks


def test_python_and_yaml_compile_to_the_same_model(tmp_path):
    f = tmp_path / "api.yaml"
    f.write_text(
        textwrap.dedent("""
        name: api
        stages:
          wf_generate:
            app: apps:wf_generate
            ranks: 2
            params: {rows: 3000, seed: 5}
            outputs: [tx]
          wf_totals:
            app: apps:wf_totals
            ranks: 3
            needs: [wf_generate]
            inputs: {tx: {dataset: tx, by: [user]}}
            outputs: [totals]
    """)
    )
    from phalanx.orchestrator.models import Workflow
    from phalanx.orchestrator.yamlio import load_model

    from_yaml = load_model(Workflow, f)
    assert build().model().model_dump() == from_yaml.model_dump()


def test_decorator_form_and_errors_before_anything_starts(tmp_path):
    @px.stage(ranks=2, outputs=["x"])
    def make(env):
        return {}

    @px.stage(ranks=1, needs=[make], inputs={"x": "nowhere"})
    def use(env):
        return {}

    wf = px.Workflow("bad", [make, use])
    with pytest.raises(ConfigError, match="stages.use.inputs.x: dataset 'nowhere' is produced by no stage"):
        px.run(wf, site=Site(name="t2", cores=2), state=tmp_path / "state", progress=False)
    with pytest.raises(ValueError, match="already has a stage 'make'"):
        wf.add(make)
    too_big = px.Workflow("big", [px.stage(lambda env: None, name="huge", ranks=9)])
    with pytest.raises(ConfigError, match="9 ranks, but site 't2' can give at most 2"):
        px.run(too_big, site=Site(name="t2", cores=2), state=tmp_path / "state", progress=False)


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_a_function_from_a_scripts_main_runs_on_the_ranks(tmp_path):
    """Notebook and script functions are not importable by ranks: they travel by value."""
    script = tmp_path / "pipeline.py"
    script.write_text(
        textwrap.dedent("""
        import pyarrow as pa
        import phalanx as px

        wf = px.Workflow("script")

        @wf.stage(ranks=2, outputs=["squares"])
        def squares(env):
            xs = list(range(env.rank * 10, env.rank * 10 + 10))
            return {"squares": pa.table({"x": xs, "sq": [x * x for x in xs]})}

        @wf.stage(ranks=1, needs=[squares], inputs={"s": "squares"}, outputs=["total"])
        def total(env):
            t = env.input("s").to_arrow()
            return {"total": pa.table({"sum": [sum(t.column("sq").to_pylist())]})}

        if __name__ == "__main__":
            r = wf.run(site=px.orchestrator.models.Site(name="two", cores=2))
            print("RESULT", r.ok, px.Store(session=r.session).read("total").column("sum")[0].as_py())
    """)
    )
    env = {**os.environ, "PHALANX_STATE": str(tmp_path / "state")}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert f"RESULT True {sum(x * x for x in range(20))}" in out.stdout


@pytest.mark.slow  # kept out of the core lane's 5 minutes: it waits on a timeout
def test_stage_timeout_stops_the_gang_and_fails_the_stage(tmp_path):
    import apps

    wf = px.Workflow("slow", [px.stage(apps.sleep_forever, name="slow", ranks=2, timeout=3)])
    t0 = time.monotonic()
    result = px.run(wf, site=Site(name="t2", cores=2), state=tmp_path / "state", progress=False)
    assert not result.ok and "slow" in result.failed
    assert "timed out" in result.failed["slow"] or "timeout" in result.failed["slow"].lower()
    assert time.monotonic() - t0 < 30
    att = RunDB(tmp_path / "state").attempts(result.run_id, "slow")
    from test_gang import wait_dead

    assert wait_dead([r["pid"] for r in att[0]["rank_info"]]) == []


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_a_later_run_reads_an_earlier_runs_output_by_session(tmp_path):
    import apps

    site4 = Site(name="t4", cores=4)
    first = px.run(build("producer"), site=site4, state=tmp_path / "state", progress=False)
    assert first.ok, first.failed
    later = px.Workflow(
        "consumer",
        [px.stage(apps.wf_totals, name="again", ranks=2, inputs={"tx": f"{first.session}/tx"}, outputs=["totals"])],
    )
    second = px.run(later, site=site4, state=tmp_path / "state", progress=False)
    assert second.ok, second.failed
    a, b = (
        px.Store(session=r.session).read("totals").to_pandas().sort_values("user").reset_index(drop=True)
        for r in (first, second)
    )
    pd.testing.assert_frame_equal(a, b)
    missing = px.Workflow("c2", [px.stage(apps.wf_totals, name="x", inputs={"tx": f"{first.session}/nope"})])
    with pytest.raises(ConfigError, match=f"dataset 'nope' is not in store session '{first.session}'"):
        px.run(missing, site=site4, state=tmp_path / "state", progress=False)


def test_set_overrides_a_file_or_a_python_workflow_as_phalanx_run_set_does(tmp_path):
    """``set=`` is ``phalanx run --set``: dotted keys, a string read as YAML (other values as they
    are), every bad one named before anything starts; the px.Workflow itself is left as it was."""
    import apps

    f = tmp_path / "wf.yaml"
    f.write_text(
        "name: setme\nstages:\n  gen:\n    app: apps:wf_generate\n    ranks: 1\n"
        "    params: {rows: 3000, seed: 5}\n    outputs: [tx]\n"
    )
    wf = px.Workflow(
        "setme", [px.stage(apps.wf_generate, name="gen", params={"rows": 3000, "seed": 5}, outputs=["tx"])]
    )
    site, state = Site(name="t2", cores=2), tmp_path / "state"
    for workflow in (f, wf):
        for bad, problem in [
            ({"stages.gen.ranks": "0"}, "--set stages.gen.ranks: stages.gen.ranks: must be ≥ 1"),
            ({"name": "[x"}, "--set name: "),  # read as YAML, as --set values are
            ({"stages..rows": 1}, "set= 'stages..rows': expected a dotted key"),
        ]:
            with pytest.raises(ConfigError) as err:
                px.submit(workflow, site=site, state=state, set=bad)
            assert any(p.startswith(problem) for p in err.value.problems), (workflow, err.value.problems)
    with pytest.raises(ConfigError, match="set= changes a workflow file or a px.Workflow"):
        px.submit(wf.model(), site=site, state=state, set={"stages.gen.params.rows": 1})
    assert RunDB(state).runs() == []  # nothing started

    by_file = px.submit(f, site=site, state=state, set={"stages.gen.params.rows": "120"})
    by_python = px.submit(wf, site=site, state=state, set={"stages.gen.params.rows": 80})
    results = [h.result(timeout=120) for h in (by_file, by_python)]
    assert all(r.ok for r in results), [r.failed for r in results]
    assert [RunDB(state).stages(r.run_id)[0]["outputs"]["tx"][0] for r in results] == [120, 80]
    assert wf.stages["gen"].spec["params"] == {"rows": 3000, "seed": 5}


def test_dir_of_px_lists_the_lazily_loaded_api():
    """Tab completion asks ``dir(px)``: the names loaded on first use are there too."""
    names = dir(px)
    assert {"submit", "run", "stage", "Workflow", "RunHandle", "ml", "Gang", "Store", "__version__"} <= set(names)
    assert names == sorted(names)
