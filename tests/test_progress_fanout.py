"""The live progress table of ``phalanx run`` (``RunProgress``, rendered as on a terminal, not
``--plain``) with fan-outs and retry policies: each instance is a row of its own under its
template's row, which says into how many instances it was expanded; a stage retried by its
``retry:`` policy reads ``retrying`` until its next attempt, one not retried ``failed``.

The fast tests feed the scheduler's events (kinds and messages as ``scheduler.py`` words them);
the slow one renders the table of a real run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.progress import RunProgress
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow


def workflow(tmp_path: Path) -> Workflow:
    """test_fanout's flaky sweep (a static fan-out of two items, the second failing its first
    attempt, retried by its ``retry:`` policy) and its fan-in, with a fan-out over the rows of
    a dataset sealed upstream (instances known at run time) before the fan-in."""
    from test_fanout import flaky_workflow

    policy = {"causes": {"RuntimeError": 1}, "backoff": {"first": 0}}
    wf = flaky_workflow(tmp_path, {"items": [{"scale": 1}, {"scale": 2}]}, fix=True, retry=policy)
    stages = {name: st for name, st in wf.stages.items() if name != "fanin"}
    stages["dyn"] = Stage(
        app="fanout_apps:scaled", foreach={"rows": "configs"}, inputs={"numbers": "numbers"}, outputs=["dscaled"]
    )
    return Workflow(name="progress-fo", stages={**stages, "fanin": wf.stages["fanin"]})


def rendered(progress: RunProgress) -> list[tuple[str, ...]]:
    """The table as a terminal shows it: (stage, state, ranks, attempt, note) per row, in order."""
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=240, color_system=None).print(progress._table())
    return table_rows(out.getvalue())


def table_rows(text: str) -> list[tuple[str, ...]]:
    """The rows of rendered tables; a cell wrapped onto the next line is joined back."""
    rows: list[tuple[str, ...]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 6 or cells[0] == "stage":
            continue
        stage, state, ranks, attempt, _elapsed, note = cells
        if not stage and rows:  # the rest of the row above (a long note wrapped)
            rows[-1] = (*rows[-1][:4], f"{rows[-1][4]} {note}".strip())
        else:
            rows.append((stage, state, ranks, attempt, note))
    return rows


def feed(progress: RunProgress, events: list[tuple[str, str, str]]) -> None:
    for stage, kind, message in events:
        progress(stage, kind, message)


def test_a_static_fan_out_shows_its_instances_under_its_template_from_the_start(tmp_path):
    progress = RunProgress(workflow(tmp_path), out=io.StringIO(), live=False)
    assert rendered(progress) == [
        ("numbers", "pending", "1", "", ""),
        ("configs", "pending", "1", "", ""),
        ("sweep", "expanded", "1", "", "2 instances"),
        ("sweep.0", "pending", "1", "", ""),
        ("sweep.1", "pending", "1", "", ""),
        ("dyn", "pending", "1", "", ""),  # over rows: its instances are not known yet
        ("fanin", "pending", "1", "", ""),
    ]


def test_instances_of_a_fan_out_over_rows_are_added_when_it_is_expanded_and_keep_their_states(tmp_path):
    progress = RunProgress(workflow(tmp_path), out=io.StringIO(), live=False)
    feed(
        progress,
        [
            ("", "run", "r-1"),
            ("configs", "start", "gang of 1"),
            ("configs", "succeeded", "configs 3 rows"),
            ("dyn", "fan-out", "3 instances over the rows of 'configs'"),
            ("dyn.0", "start", "gang of 1"),
            ("dyn.1", "skipped", "when: 'params.scale != 2' is false"),
            ("dyn.2", "start", "gang of 1"),
            ("dyn.0", "succeeded", "dscaled.0 10 rows"),
            ("dyn.2", "failed", "attempt 1: RuntimeError: boom"),  # no policy: no retry event
        ],
    )
    rows = {r[0]: r for r in rendered(progress)}
    names = [r[0] for r in rendered(progress)]
    assert names == ["numbers", "configs", "sweep", "sweep.0", "sweep.1", "dyn", "dyn.0", "dyn.1", "dyn.2", "fanin"]
    assert rows["dyn"][1:] == ("expanded", "1", "", "3 instances over the rows of 'configs'")
    assert rows["dyn.0"][1:4] == ("succeeded", "1", "1")
    assert rows["dyn.1"][1] == "skipped" and rows["dyn.1"][4] == "when: 'params.scale != 2' is false"
    assert rows["dyn.2"][1:4] == ("failed", "1", "1")
    assert rows["configs"][1] == "succeeded"


def test_an_instance_the_table_was_not_told_of_gets_a_row_after_its_siblings(tmp_path):
    """A ``fan-out`` event worded otherwise than the table reads it must not lose instances."""
    progress = RunProgress(workflow(tmp_path), out=io.StringIO(), live=False)
    feed(progress, [("dyn.1", "start", "gang of 1"), ("dyn.0", "start", "gang of 1"), ("sweep.2", "start", "")])
    names = [r[0] for r in rendered(progress)]
    assert names == ["numbers", "configs", "sweep", "sweep.0", "sweep.1", "sweep.2", "dyn", "dyn.1", "dyn.0", "fanin"]
    assert progress.rows["dyn.0"].state == progress.rows["sweep.2"].state == "running"


@pytest.mark.parametrize(
    "decision, state",
    [
        ("retrying in 0 s (retry 1 of 1 for RuntimeError)", "retrying"),
        ("not retried: its 1 retry for RuntimeError is used up", "failed"),
        ("not retried: KeyError is not in retry.causes (RuntimeError)", "failed"),
    ],
)
def test_retrying_follows_the_retry_policys_decision(tmp_path, decision, state):
    """The stage gives ``retry:``, not ``retries``: its row says what the policy decided."""
    progress = RunProgress(workflow(tmp_path), out=io.StringIO(), live=False)
    feed(
        progress,
        [
            ("sweep.1", "start", "gang of 1"),
            ("sweep.1", "failed", "attempt 1: RuntimeError: instance with scale 2 fails until fixed"),
            ("sweep.1", "retry", f"attempt 1: RuntimeError — {decision}"),
        ],
    )
    row = {r[0]: r for r in rendered(progress)}["sweep.1"]
    assert row[1:4] == (state, "1", "1")
    if state == "retrying":
        assert row[4] == f"attempt 1: RuntimeError — {decision}"
        feed(progress, [("sweep.1", "start", "gang of 1"), ("sweep.1", "succeeded", "scaled.1 10 rows")])
        assert {r[0]: r for r in rendered(progress)}["sweep.1"][1:4] == ("succeeded", "1", "2")


@pytest.mark.slow  # a workflow run of 9 gangs
def test_the_table_of_a_real_fan_out_run(tmp_path):
    """The final table of a real run, rendered as on a terminal (``live``, not --plain), and the
    states the retried instance's row went through."""
    out = io.StringIO()
    progress = RunProgress(workflow(tmp_path), out=out, live=True)
    seen: dict[str, list[str]] = {}  # stage → each state its row took, in order

    def on_event(stage: str, kind: str, message: str) -> None:
        progress(stage, kind, message)
        states = seen.setdefault(stage, [])
        if stage in progress.rows and progress.rows[stage].state not in states[-1:]:
            states.append(progress.rows[stage].state)

    with progress:
        result = run_workflow(
            workflow(tmp_path), Site(name="fo", cores=2), db=RunDB(tmp_path / "state"), on_event=on_event
        )
    assert result.ok, result.failed
    final = table_rows(out.getvalue())[-10:]  # the last render: the table as the run ended
    assert [(stage, state, ranks, attempt) for stage, state, ranks, attempt, _ in final] == [
        ("numbers", "succeeded", "1", "1"),
        ("configs", "succeeded", "1", "1"),
        ("sweep", "expanded", "1", ""),
        ("sweep.0", "succeeded", "1", "1"),
        ("sweep.1", "succeeded", "1", "2"),  # its first attempt failed, retried by its retry: policy
        ("dyn", "expanded", "1", ""),
        ("dyn.0", "succeeded", "1", "1"),
        ("dyn.1", "succeeded", "1", "1"),
        ("dyn.2", "succeeded", "1", "1"),
        ("fanin", "succeeded", "1", "1"),
    ]
    notes = {r[0]: r[4] for r in final}
    assert notes["sweep"] == "2 instances" and notes["dyn"] == "3 instances over the rows of 'configs'"
    assert seen["sweep.1"] == ["running", "failed", "retrying", "running", "succeeded"]
