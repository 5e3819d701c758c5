"""Fan-out (``foreach:``), fan-in (``gather:``) and conditions (``when:``): results against an
independent computation, what the run DB and the CLI say, and the failure paths.

One module-scoped run of a workflow that uses every feature at once (a matrix sweep gathered
into one frame, a fan-out over the rows of a dataset sealed upstream whose instances are
filtered by a condition and gathered as a list, a false condition skipping a branch) keeps the
lane short; the failure paths each run a small workflow of their own.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phalanx as px
from phalanx.orchestrator.loading import load_workflow
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.orchestrator.yamlio import ConfigError

HERE = Path(__file__).parent
ROWS = 50
MATRIX = {"scale": [1, 2], "offset": [0, 10]}

WORKFLOW = f"""\
name: fanout-all
stages:
  numbers:
    app: fanout_apps:numbers
    ranks: 2
    params: {{rows: {ROWS}}}
    outputs: [numbers]
  configs:
    app: fanout_apps:configs
    params: {{n: 3}}
    outputs: [configs]
  sweep:
    app: fanout_apps:scaled
    ranks: 2
    foreach: {{matrix: {{scale: {MATRIX["scale"]}, offset: {MATRIX["offset"]}}}}}
    inputs: {{numbers: numbers}}
    outputs: [scaled]
  dyn:
    app: fanout_apps:scaled
    foreach: {{rows: configs}}
    params: {{offset: 5}}
    inputs: {{numbers: numbers}}
    outputs: [dscaled]
    when: "params.scale != 2"
  fanin:
    app: fanout_apps:total
    inputs: {{parts: {{dataset: scaled, by: [x]}}}}
    outputs: [totals]
  fanin_list:
    app: fanout_apps:total
    inputs: {{parts: {{dataset: dscaled, gather: list}}}}
    outputs: [totals_list]
    when: "len(configs) == 3 and max(configs.scale) == 3"
  never:
    app: fanout_apps:marker
    when: "params.go"
    params: {{go: false}}
    outputs: [ran]
  after_never:
    app: fanout_apps:marker
    inputs: {{r: ran}}
    outputs: [ran2]
"""


def cli(*args: str, state: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "PHALANX_STATE": str(state)}
    env["PYTHONPATH"] = f"{HERE}:{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    """The workflow above, validated and run through the CLI once."""
    where = tmp_path_factory.mktemp("fanout")
    (where / "wf.yaml").write_text(WORKFLOW)
    validated = cli("validate", "wf.yaml", state=where / "state", cwd=where)
    ran = cli("run", "wf.yaml", "--plain", state=where / "state", cwd=where)
    db = RunDB(where / "state")
    run = db.runs()[0]
    return validated, ran, db, run


def expected_y(scale: int, offset: int) -> int:
    return sum(x * scale + offset for x in range(ROWS))


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_validate_says_how_many_instances_a_fan_out_makes(everything):
    validated = everything[0]
    assert validated.returncode == 0, validated.stderr
    assert "sweep: foreach makes 4 instances (sweep.0 … sweep.3)" in validated.stdout
    assert "dyn: foreach over the rows of 'configs': instances known at run time (at most 1,000)" in validated.stdout


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_a_run_with_fan_outs_and_conditions_succeeds(everything):
    _, ran, db, run = everything
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert run["state"] == "succeeded"
    states = {s["stage"]: s["state"] for s in db.stages(run["id"])}
    assert states == {
        "numbers": "succeeded",
        "configs": "succeeded",
        **{f"sweep.{i}": "succeeded" for i in range(4)},
        "fanin": "succeeded",
        "fanin_list": "succeeded",
        "never": "skipped",
        "after_never": "skipped",
        "dyn.0": "succeeded",
        "dyn.1": "skipped",  # scale 2: its when: is false
        "dyn.2": "succeeded",
    }  # the templates sweep and dyn are no stages of their own: their instances are


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_each_matrix_instance_gets_its_combination_and_the_fan_in_concatenates_them(everything):
    _, _, db, run = everything
    store = px.Store(session=run["session"])
    combos = list(itertools.product(MATRIX["scale"], MATRIX["offset"]))
    for i, (scale, offset) in enumerate(combos):  # instance i: the i-th combination, in order
        got = store.read(f"scaled.{i}").to_pandas()
        assert set(got["scale"]) == {scale} and set(got["offset"]) == {offset}
        assert got["y"].sum() == expected_y(scale, offset)
    totals = store.read("totals").to_pandas().sort_values(["scale", "offset"])
    assert [tuple(r) for r in totals[["scale", "offset"]].itertuples(index=False)] == sorted(combos)
    assert list(totals["sum_y"]) == [expected_y(s, o) for s, o in sorted(combos)]
    assert set(totals["frames"]) == {1}  # concat: one frame


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_a_fan_out_over_rows_filtered_by_its_condition_is_gathered_as_a_list(everything):
    _, _, db, run = everything
    store = px.Store(session=run["session"])
    got = store.read("totals_list").to_pandas().sort_values("scale")
    assert list(got["scale"]) == [1, 3]  # the rows of configs, less scale 2 (when: false)
    assert list(got["sum_y"]) == [expected_y(1, 5), expected_y(3, 5)]  # offset 5: the template's param
    assert set(got["frames"]) == {2}  # a list: one frame per instance that ran
    assert not store.exists("dscaled.1")


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_the_run_db_and_status_say_why_stages_were_skipped(everything, tmp_path):
    _, _, db, run = everything
    stages = {s["stage"]: s for s in db.stages(run["id"])}
    assert stages["never"]["error"] == "when: 'params.go' is false"
    assert stages["after_never"]["error"] == "upstream stage 'never' was skipped"
    assert stages["dyn.1"]["error"] == "when: 'params.scale != 2' is false"
    events = [(e["stage"], e["kind"], e["message"]) for e in db.events(run["id"])]
    assert ("dyn", "fan-out", "3 instances over the rows of 'configs'") in events
    assert {s for s, k, _ in events if k == "condition"} >= {"dyn.0", "dyn.2", "fanin_list"}
    status = cli("status", run["id"], state=db.path.parent, cwd=tmp_path)
    assert "when: 'params.scale != 2' is false" in status.stdout


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_an_instance_that_fails_fails_alone_and_its_fan_in_does_not_run(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="fo-fail",
        stages={
            "numbers": Stage(app="fanout_apps:numbers", params={"rows": 10}, outputs=["numbers"]),
            "sweep": Stage(
                app="fanout_apps:fail_on",
                foreach={"items": [{"scale": 1}, {"scale": 2}, {"scale": 3}]},
                params={"bad": 2},
                inputs={"numbers": "numbers"},
                outputs=["scaled"],
            ),
            "fanin": Stage(app="fanout_apps:total", inputs={"parts": "scaled"}, outputs=["totals"]),
        },
    )
    result = run_workflow(wf, Site(name="fo", cores=2), db=db)
    assert not result.ok
    assert list(result.failed) == ["sweep.1"]
    assert "instance with scale 2 fails on purpose" in result.failed["sweep.1"]
    states = {s["stage"]: s["state"] for s in db.stages(result.run_id)}
    assert states["sweep.0"] == states["sweep.2"] == "succeeded"
    assert states["fanin"] == "skipped"


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_a_condition_that_cannot_be_evaluated_fails_its_stage_naming_the_condition(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="fo-when",
        stages={
            "configs": Stage(app="fanout_apps:configs", outputs=["configs"]),
            "check": Stage(app="fanout_apps:marker", when="max(configs.accuracy) > 0.5", outputs=["ran"]),
            "after": Stage(app="fanout_apps:marker", inputs={"r": "ran"}, outputs=["ran2"]),
        },
    )
    result = run_workflow(wf, Site(name="fo", cores=2), db=db)
    assert not result.ok
    assert result.failed["check"] == (
        "when: 'max(configs.accuracy) > 0.5' could not be evaluated: KeyError: "
        "\"dataset 'configs' has no 'accuracy' (it has: scale, label)\""
    )
    assert result.skipped == ["after"]


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_a_fan_out_over_more_rows_than_its_max_fails_before_starting_any_instance(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="fo-max",
        stages={
            "configs": Stage(app="fanout_apps:configs", params={"n": 5}, outputs=["configs"]),
            "many": Stage(app="fanout_apps:marker", foreach={"rows": "configs", "max": 4}, outputs=["ran"]),
        },
    )
    result = run_workflow(wf, Site(name="fo", cores=2), db=db)
    assert result.failed == {
        "many": "foreach: ValueError: stage 'many': foreach over the rows of 'configs' would make 5 instances, "
        "more than foreach.max (4)"
    }


@pytest.mark.slow  # workflow runs (the core lane is at its 5-minute budget)
def test_a_python_workflow_fans_out_with_the_same_fields(tmp_path):
    import fanout_apps

    wf = px.Workflow("fo-python")
    wf.stage(fanout_apps.numbers, params={"rows": 20}, outputs=["numbers"])
    wf.stage(
        fanout_apps.scaled,
        name="sweep",
        foreach=[{"scale": 2}, {"scale": 3}],
        inputs={"numbers": "numbers"},
        outputs=["scaled"],
    )
    wf.stage(fanout_apps.total, name="fanin", inputs={"parts": "scaled"}, outputs=["totals"])
    result = px.run(wf, site=Site(name="fo", cores=2), state=tmp_path / "state")
    assert result.ok, result.failed
    got = px.Store(session=result.session).read("totals").to_pandas().sort_values("scale")
    assert list(got["sum_y"]) == [sum(2 * x for x in range(20)), sum(3 * x for x in range(20))]


# ---- an instance failing once: its retries, a --resume, the Python API's when= and retry= ----------
def flaky(env):
    """``fanout_apps.scaled`` that notes each call (``params.dir/calls-SCALE``, one line each);
    the instance whose scale is ``params.bad`` raises RuntimeError until ``params.dir/fixed``
    exists (its first attempt creates it where ``params.fix`` says so)."""
    import os

    import fanout_apps

    d, scale = Path(env.params["dir"]), env.params.get("scale")
    with open(d / f"calls-{scale}", "a") as f:
        f.write(f"{os.getpid()}\n")
    if scale == env.params.get("bad") and not (d / "fixed").exists():
        if env.params.get("fix"):
            (d / "fixed").write_text("")
        raise RuntimeError(f"instance with scale {scale} fails until fixed")
    fanout_apps.scaled(env)


def calls(d: Path) -> dict[int, int]:
    """How many times each scale's instance ran (the app's own count)."""
    return {int(p.name.split("-")[1]): len(p.read_text().splitlines()) for p in d.glob("calls-*")}


def flaky_workflow(d: Path, foreach: dict, fix: bool, **stage) -> Workflow:
    return Workflow(
        name="fo-flaky",
        stages={
            "numbers": Stage(app="fanout_apps:numbers", params={"rows": 20}, outputs=["numbers"]),
            "configs": Stage(app="fanout_apps:configs", params={"n": 3}, outputs=["configs"]),
            "sweep": Stage(
                app="test_fanout:flaky",
                foreach=foreach,
                params={"dir": str(d), "bad": 2, "fix": fix, "offset": 1},
                inputs={"numbers": "numbers"},
                outputs=["scaled"],
                **stage,
            ),
            "fanin": Stage(app="fanout_apps:total", inputs={"parts": "scaled"}, outputs=["totals"]),
        },
    )


def attempts_of(db: RunDB, run_id: str) -> dict[str, list[str]]:
    return {
        s["stage"]: [a["state"] for a in db.attempts(run_id, s["stage"])]
        for s in db.stages(run_id)
        if s["stage"].startswith("sweep.")
    }


def assert_totals(session: str, scales: list[int], rows: int = 20, offset: int = 1) -> None:
    got = px.Store(session=session).read("totals").to_pandas().sort_values("scale")
    assert list(got["scale"]) == scales
    assert list(got["sum_y"]) == [sum(x * s + offset for x in range(rows)) for s in scales]  # closed form


# The scheduler's loop used to end the run when no stage was running after a pass over the
# pending stages, though that pass had added a fan-out's instances or skipped a stage listed
# after one that needs it: the run "succeeded" with stages never run.  It now looks again.
@pytest.mark.slow  # a workflow run (the core lane is at its 5-minute budget)
@pytest.mark.parametrize(
    "stages, states",
    [
        (  # a fan-out over rows expanded while no other stage runs: its instances run
            {
                "configs": Stage(app="fanout_apps:configs", params={"n": 2}, outputs=["configs"]),
                "each": Stage(app="fanout_apps:marker", foreach={"rows": "configs"}, outputs=["ran"]),
            },
            {"configs": "succeeded", "each.0": "succeeded", "each.1": "succeeded"},
        ),
        (  # a stage listed before the skipped stage it needs: skipped too
            {
                "after": Stage(app="fanout_apps:marker", inputs={"r": "ran"}, outputs=["ran2"]),
                "never": Stage(app="fanout_apps:marker", when="params.go", params={"go": False}, outputs=["ran"]),
            },
            {"after": "skipped", "never": "skipped"},
        ),
    ],
    ids=["fan-out-alone", "skip-listed-after"],
)
def test_a_pass_that_changes_what_is_pending_is_followed_by_another(tmp_path, stages, states):
    db = RunDB(tmp_path / "state")
    result = run_workflow(Workflow(name="fo-pass", stages=stages), Site(name="fo", cores=2), db=db)
    assert result.ok and not result.failed, result.failed
    assert {s["stage"]: s["state"] for s in db.stages(result.run_id)} == states


@pytest.mark.slow  # two workflow runs (the core lane is at its 5-minute budget)
def test_a_resumed_fan_out_over_rows_is_expanded_again_and_runs_only_its_failed_instance(tmp_path):
    db, site = RunDB(tmp_path / "state"), Site(name="fo", cores=2)
    first = run_workflow(flaky_workflow(tmp_path, {"rows": "configs"}, fix=False), site, db=db)
    assert list(first.failed) == ["sweep.1"] and first.skipped == ["fanin"]
    assert calls(tmp_path) == {1: 1, 2: 1, 3: 1}
    (tmp_path / "fixed").write_text("")  # what the user fixed before resuming
    again = run_workflow(flaky_workflow(tmp_path, {"rows": "configs"}, fix=False), site, db=db, resume=first.run_id)
    assert again.ok and again.run_id == first.run_id, again.failed
    assert calls(tmp_path) == {1: 1, 2: 2, 3: 1}  # the instances that had succeeded did not run again
    assert attempts_of(db, first.run_id) == {
        "sweep.0": ["succeeded"],
        "sweep.1": ["failed", "succeeded"],  # attempt 2: the resume's
        "sweep.2": ["succeeded"],
    }
    fan_outs = [e["message"] for e in db.events(first.run_id) if e["kind"] == "fan-out"]
    assert fan_outs == ["3 instances over the rows of 'configs'"] * 2  # expanded again by the resume
    assert_totals(first.session, [1, 2, 3])


@pytest.mark.slow  # a workflow run (the core lane is at its 5-minute budget)
def test_a_failing_instance_is_retried_by_its_own_retries_and_succeeds_on_its_second_attempt(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = flaky_workflow(tmp_path, {"items": [{"scale": 1}, {"scale": 2}, {"scale": 3}]}, fix=True, retries=1)
    result = run_workflow(wf, Site(name="fo", cores=2), db=db)
    assert result.ok, result.failed
    assert calls(tmp_path) == {1: 1, 2: 2, 3: 1}
    assert attempts_of(db, result.run_id) == {
        "sweep.0": ["succeeded"],
        "sweep.1": ["failed", "succeeded"],
        "sweep.2": ["succeeded"],
    }
    assert "instance with scale 2 fails until fixed" in db.attempts(result.run_id, "sweep.1")[0]["error"]
    assert_totals(result.session, [1, 2, 3])


@pytest.mark.slow  # a workflow run (the core lane is at its 5-minute budget)
def test_when_and_retry_through_a_python_workflow(tmp_path):
    import fanout_apps

    wf = px.Workflow("fo-python-when")
    wf.stage(fanout_apps.numbers, params={"rows": 20}, outputs=["numbers"])
    wf.stage(
        flaky,
        name="sweep",
        foreach=[{"scale": 1}, {"scale": 2}],
        params={"dir": str(tmp_path), "bad": 2, "fix": True, "offset": 1},
        retry={"causes": {"RuntimeError": 1}, "backoff": {"first": 0}},
        when="params.scale < 3 and len(numbers) == 20",
        inputs={"numbers": "numbers"},
        outputs=["scaled"],
    )
    wf.stage(fanout_apps.total, name="fanin", inputs={"parts": "scaled"}, outputs=["totals"])
    wf.stage(fanout_apps.marker, name="never", when="params.go", params={"go": False}, outputs=["ran"])
    result = px.run(wf, site=Site(name="fo", cores=2), state=tmp_path / "state", progress=False)
    assert result.ok, result.failed
    assert result.skipped_when == {"never": "when: 'params.go' is false"}
    assert calls(tmp_path) == {1: 1, 2: 2}  # scale 2: its first attempt failed, its retry: ran it again
    db = RunDB(tmp_path / "state")
    assert [a["cause"] for a in db.attempts(result.run_id, "sweep.1")] == ["RuntimeError", None]
    assert {e["stage"] for e in db.events(result.run_id) if e["kind"] == "condition"} == {"sweep.0", "sweep.1"}
    assert_totals(result.session, [1, 2])


@pytest.mark.parametrize(
    "stage, message",
    [
        (
            "foreach: {items: [{a: 1}], matrix: {a: [1]}}",
            "stages.s.foreach: give one of items, matrix or rows (got ['items', 'matrix'])",
        ),
        ("foreach: {matrix: {a: []}}", "matrix.a: a list of at least one value"),
        ("foreach: {rows: nowhere}", "stages.s.foreach.rows: dataset 'nowhere' is produced by no stage"),
        ("when: \"__import__('os')\"", "a condition may call only len, min"),
        ("when: 'params.x ** 99'", "Pow is not allowed in a condition"),
        ("when: 'len(nowhere) > 0'", "stages.s.when: the condition reads 'nowhere', which is produced by no stage"),
        ("inputs: {a: {dataset: made, gather: list}}", "stages.s.inputs.a.gather: dataset 'made' is not the output"),
    ],
)
def test_bad_fan_outs_and_conditions_are_refused_with_file_line_and_field(tmp_path, stage, message):
    (tmp_path / "wf.yaml").write_text(
        textwrap.dedent(
            """\
            name: bad
            stages:
              m:
                app: fanout_apps:marker
                outputs: [made]
              s:
                app: fanout_apps:marker
                {stage}
            """
        ).format(stage=stage)
    )
    with pytest.raises(ConfigError) as err:
        load_workflow(tmp_path / "wf.yaml", check_imports=False)
    assert message in str(err.value)
    assert f"{tmp_path / 'wf.yaml'}:" in str(err.value)
