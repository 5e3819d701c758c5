"""Workflow and site files: every check, with the exact message, file and line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phalanx.cli import schema_files
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.validate import check, load_workflow
from phalanx.orchestrator.yamlio import ConfigError

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
name: demo
stages:
  generate:
    app: apps:rank_info
    ranks: 2
    params: {rows: 1000}
    outputs: [transactions, users]
  features:
    app: apps:rank_info
    ranks: 2
    needs: [generate]
    inputs: {tx: transactions, users: {dataset: users, by: [user_id]}}
    outputs: [features]
    retries: 1
  report:
    kind: command
    command: [python, -c, "print('done')"]
    needs: [features]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "wf.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def problems(tmp_path: Path, text: str, **kw) -> list[str]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_workflow(path, **kw)
    return [p.replace(str(path), "wf.yaml") for p in info.value.problems]


def test_a_sound_workflow_loads(tmp_path):
    wf, site = load_workflow(write(tmp_path, GOOD))
    assert list(wf.stages) == ["generate", "features", "report"]
    assert wf.stages["features"].inputs["tx"].dataset == "transactions"
    assert wf.stages["features"].inputs["users"].by == ["user_id"]
    assert site.name == "local" and site.capacity() >= 2


@pytest.mark.parametrize("edit,expected", [
    (("ranks: 2\n    params", "ranks: 0\n    params"), "wf.yaml:5: stages.generate.ranks: must be ≥ 1"),
    (("retries: 1", "retries: -1"), "wf.yaml:14: stages.features.retries: must be ≥ 0"),
    (("retries: 1", "retries: 1\n    colour: red"), "wf.yaml:15: stages.features.colour: unknown key"),
    (("kind: command", "kind: shell"), "wf.yaml:16: stages.report.kind: must be one of 'bsp', 'torch' or 'command'"),
    (("ranks: 2\n    needs: [generate]", "ranks: two\n    needs: [generate]"),
     "wf.yaml:10: stages.features.ranks: must be an integer"),
    (("{dataset: users, by: [user_id]}", "{dataset: users, by: [user_id], shuffle: random}"),
     "wf.yaml:12: stages.features.inputs.users: give by or shuffle, not both"),
    (("name: demo\n", ""), "wf.yaml:1: name: required"),
])
def test_model_errors_name_file_line_and_field(tmp_path, edit, expected):
    assert problems(tmp_path, GOOD.replace(*edit)) == [expected]


def test_stage_kind_needs_its_entry_point(tmp_path):
    text = GOOD.replace("    command: [python, -c, \"print('done')\"]\n", "")
    assert problems(tmp_path, text) == ["wf.yaml:15: stages.report: a command stage needs command: [program, args...]"]
    text = GOOD.replace("    app: apps:rank_info\n    ranks: 2\n    params", "    ranks: 2\n    params")
    assert problems(tmp_path, text) == ["wf.yaml:3: stages.generate: a bsp stage needs app: 'package.module:function'"]


def test_dag_checks(tmp_path):
    text = GOOD.replace("needs: [generate]", "needs: [generat]").replace(
        "needs: [features]", "needs: [features]\n    inputs: {x: nowhere}")
    assert problems(tmp_path, text) == [
        "wf.yaml:11: stages.features.needs.0: unknown stage 'generat' (stages: features, generate, report)",
        "wf.yaml:19: stages.report.inputs.x: dataset 'nowhere' is produced by no stage and is not in the store (another run's output: 'SESSION/NAME')",
    ]


def test_an_input_that_the_store_already_holds_is_fine(tmp_path):
    text = GOOD.replace("needs: [features]", "needs: [features]\n    inputs: {x: archived}")
    wf, _ = load_workflow(write(tmp_path, text), existing={"archived"})
    assert wf.stages["report"].inputs["x"].dataset == "archived"


def test_cycles_are_found_through_needs_and_inputs(tmp_path):
    text = GOOD.replace("    ranks: 2\n    params: {rows: 1000}", "    ranks: 2\n    inputs: {f: features}\n    params: {rows: 1000}")
    assert problems(tmp_path, text) == ["wf.yaml:12: stages.features.needs: cycle: features → generate → features"]


def test_apps_must_import_and_gangs_must_fit(tmp_path):
    text = GOOD.replace("app: apps:rank_info\n    ranks: 2\n    params", "app: no_such_pkg.mod:main\n    ranks: 64\n    params")
    assert problems(tmp_path, text) == [
        "wf.yaml:5: stages.generate.ranks: 64 ranks, but site 'local' can give at most "
        f"{Site(name='local').capacity()}",
        "wf.yaml:4: stages.generate.app: cannot import module 'no_such_pkg.mod': "
        "ModuleNotFoundError: No module named 'no_such_pkg'",
    ]


def test_duplicate_producers(tmp_path):
    text = GOOD.replace("outputs: [features]", "outputs: [features, users]")
    assert problems(tmp_path, text) == [
        "wf.yaml:13: stages.features.outputs: dataset 'users' is also produced by stage 'generate'"]


def test_invalid_yaml_names_the_line(tmp_path):
    assert problems(tmp_path, "name: x\nstages:\n  a: [unclosed\n") == [
        "wf.yaml:4: not valid YAML: expected ',' or ']', but got '<stream end>'"]


def test_set_overrides_are_typed_and_validated(tmp_path):
    wf, _ = load_workflow(write(tmp_path, GOOD), overrides={"stages.generate.params.rows": "5",
                                                            "stages.features.ranks": "1"})
    assert wf.stages["generate"].params["rows"] == 5 and wf.stages["features"].ranks == 1
    with pytest.raises(ConfigError, match="stages.features.ranks: must be ≥ 1"):
        load_workflow(write(tmp_path, GOOD), overrides={"stages.features.ranks": "0"})


def test_unknown_site_and_site_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="site 'mars': no such site file"):
        load_workflow(write(tmp_path, GOOD), site="mars")
    site = tmp_path / "tiny.yaml"
    site.write_text("name: tiny\ncores: 1\nexecuter: local\n")
    assert problems(tmp_path, GOOD, site=str(site)) == [f"{site}:3: executer: unknown key"]
    site.write_text("name: tiny\ncores: 1\n")
    assert problems(tmp_path, GOOD, site=str(site), check_imports=False) == [
        "wf.yaml:5: stages.generate.ranks: 2 ranks, but site 'tiny' can give at most 1",
        "wf.yaml:10: stages.features.ranks: 2 ranks, but site 'tiny' can give at most 1"]


def test_site_configs_in_the_repository_are_valid():
    from phalanx.orchestrator.validate import load_site

    for path in (ROOT / "site-configs").glob("*.yaml"):
        assert load_site(str(path)).name == path.stem


def test_published_json_schemas_match_the_models():
    for path, text in schema_files(ROOT / "docs").items():
        assert path.read_text() == text, f"{path} is stale: run `phalanx schema`"
    assert "stages" in json.loads((ROOT / "docs" / "workflow.schema.json").read_text())["properties"]


def test_cli_validate_exit_codes(tmp_path):
    good = write(tmp_path, GOOD)
    env_path = str(Path(__file__).parent)
    ok = subprocess.run([sys.executable, "-m", "phalanx.cli", "validate", str(good)], capture_output=True,
                        text=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0 and "ok — workflow 'demo', 3 stages" in ok.stdout, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("ranks: 2\n    params", "ranks: 0\n    params"))
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and f"{bad}:5: stages.generate.ranks: must be ≥ 1" in out.stderr


def test_check_accepts_models_built_in_python():
    from phalanx.orchestrator.models import Stage, Workflow

    wf = Workflow(name="py", stages={"a": Stage(app="apps:rank_info", outputs=["t"]),
                                     "b": Stage(app="apps:rank_info", inputs={"t": "t"})})
    assert check(wf, Site(name="local")) == []
