"""Workflow and site files: every check, with the exact message, file and line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phalanx.cli import schema_files
from phalanx.orchestrator.loading import load_workflow
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.validate import check
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


@pytest.mark.parametrize(
    "edit,expected",
    [
        (("ranks: 2\n    params", "ranks: 0\n    params"), "wf.yaml:5: stages.generate.ranks: must be ≥ 1"),
        (("retries: 1", "retries: -1"), "wf.yaml:14: stages.features.retries: must be ≥ 0"),
        (("retries: 1", "retries: 1\n    colour: red"), "wf.yaml:15: stages.features.colour: unknown key"),
        (
            ("kind: command", "kind: shell"),
            "wf.yaml:16: stages.report.kind: must be one of 'bsp', 'torch' or 'command'",
        ),
        (
            ("ranks: 2\n    needs: [generate]", "ranks: two\n    needs: [generate]"),
            "wf.yaml:10: stages.features.ranks: must be an integer",
        ),
        (
            ("{dataset: users, by: [user_id]}", "{dataset: users, by: [user_id], shuffle: random}"),
            "wf.yaml:12: stages.features.inputs.users: give by or shuffle, not both",
        ),
        (("name: demo\n", ""), "wf.yaml:1: name: required"),
    ],
)
def test_model_errors_name_file_line_and_field(tmp_path, edit, expected):
    assert problems(tmp_path, GOOD.replace(*edit)) == [expected]


def test_stage_kind_needs_its_entry_point(tmp_path):
    text = GOOD.replace("    command: [python, -c, \"print('done')\"]\n", "")
    assert problems(tmp_path, text) == ["wf.yaml:15: stages.report: a command stage needs command: [program, args...]"]
    text = GOOD.replace("    app: apps:rank_info\n    ranks: 2\n    params", "    ranks: 2\n    params")
    assert problems(tmp_path, text) == ["wf.yaml:3: stages.generate: a bsp stage needs app: 'package.module:function'"]


def test_dag_checks(tmp_path):
    text = GOOD.replace("needs: [generate]", "needs: [generat]").replace(
        "needs: [features]", "needs: [features]\n    inputs: {x: nowhere}"
    )
    assert problems(tmp_path, text) == [
        "wf.yaml:11: stages.features.needs.0: unknown stage 'generat' (stages: features, generate, report)",
        "wf.yaml:19: stages.report.inputs.x: dataset 'nowhere' is produced by no stage and is not in the store (another run's output: 'SESSION/NAME')",
    ]


def test_an_input_that_the_store_already_holds_is_fine(tmp_path):
    text = GOOD.replace("needs: [features]", "needs: [features]\n    inputs: {x: archived}")
    wf, _ = load_workflow(write(tmp_path, text), existing={"archived"})
    assert wf.stages["report"].inputs["x"].dataset == "archived"


def test_cycles_are_found_through_needs_and_inputs(tmp_path):
    text = GOOD.replace(
        "    ranks: 2\n    params: {rows: 1000}", "    ranks: 2\n    inputs: {f: features}\n    params: {rows: 1000}"
    )
    assert problems(tmp_path, text) == ["wf.yaml:12: stages.features.needs: cycle: features → generate → features"]


def test_apps_must_import_and_gangs_must_fit(tmp_path):
    text = GOOD.replace(
        "app: apps:rank_info\n    ranks: 2\n    params", "app: no_such_pkg.mod:main\n    ranks: 64\n    params"
    )
    assert problems(tmp_path, text) == [
        "wf.yaml:5: stages.generate.ranks: 64 ranks, but site 'local' can give at most "
        f"{Site(name='local').capacity()}",
        "wf.yaml:4: stages.generate.app: cannot import module 'no_such_pkg.mod': "
        "ModuleNotFoundError: No module named 'no_such_pkg'",
    ]


def test_duplicate_producers(tmp_path):
    text = GOOD.replace("outputs: [features]", "outputs: [features, users]")
    assert problems(tmp_path, text) == [
        "wf.yaml:13: stages.features.outputs: dataset 'users' is also produced by stage 'generate'"
    ]


def test_invalid_yaml_names_the_line(tmp_path):
    assert problems(tmp_path, "name: x\nstages:\n  a: [unclosed\n") == [
        "wf.yaml:4: not valid YAML: expected ',' or ']', but got '<stream end>'"
    ]


def test_set_overrides_are_typed_and_validated(tmp_path):
    wf, _ = load_workflow(
        write(tmp_path, GOOD), overrides={"stages.generate.params.rows": "5", "stages.features.ranks": "1"}
    )
    assert wf.stages["generate"].params["rows"] == 5 and wf.stages["features"].ranks == 1
    with pytest.raises(ConfigError, match="stages.features.ranks: must be ≥ 1"):
        load_workflow(write(tmp_path, GOOD), overrides={"stages.features.ranks": "0"})


def test_unknown_site_and_site_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="site 'mars': no such site file"):
        load_workflow(write(tmp_path, GOOD), site="mars")
    assert problems(tmp_path, GOOD.replace("name: demo\n", "name: demo\nsite: mars\n")) == [
        "wf.yaml:2: site: no such site file 'mars' (looked in $PHALANX_SITE_PATH, ./site-configs and beside the "
        "workflow)"
    ]
    site = tmp_path / "tiny.yaml"
    site.write_text("name: tiny\ncores: 1\nexecuter: local\n")
    assert problems(tmp_path, GOOD, site=str(site)) == [f"{site}:3: executer: unknown key"]
    site.write_text("name: tiny\ncores: 1\n")
    assert problems(tmp_path, GOOD, site=str(site), check_imports=False) == [
        "wf.yaml:5: stages.generate.ranks: 2 ranks, but site 'tiny' can give at most 1",
        "wf.yaml:10: stages.features.ranks: 2 ranks, but site 'tiny' can give at most 1",
    ]


def test_site_configs_in_the_repository_are_valid():
    from phalanx.orchestrator.loading import load_site

    for path in (ROOT / "site-configs").glob("*.yaml"):
        assert load_site(str(path)).name == path.stem


def test_published_json_schemas_match_the_models():
    for path, text in schema_files(ROOT / "docs").items():
        assert path.read_text() == text, f"{path} is stale: run `phalanx schema`"
    assert "stages" in json.loads((ROOT / "docs" / "workflow.schema.json").read_text())["properties"]


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_cli_validate_exit_codes(tmp_path):
    good = write(tmp_path, GOOD)
    env_path = str(Path(__file__).parent)
    ok = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "validate", str(good)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert ok.returncode == 0 and "ok — workflow 'demo', 3 stages" in ok.stdout, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("ranks: 2\n    params", "ranks: 0\n    params"))
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and f"{bad}:5: stages.generate.ranks: must be ≥ 1" in out.stderr


def test_check_accepts_models_built_in_python():
    from phalanx.orchestrator.models import Stage, Workflow

    wf = Workflow(
        name="py",
        stages={"a": Stage(app="apps:rank_info", outputs=["t"]), "b": Stage(app="apps:rank_info", inputs={"t": "t"})},
    )
    assert check(wf, Site(name="local")) == []


# ---- what validate used to accept and run then failed on ------------------------------------


@pytest.mark.parametrize(
    "edit,expected",
    [
        (("ranks: 2\n    params", "ranks: true\n    params"), "wf.yaml:5: stages.generate.ranks: must be an integer"),
        (("retries: 1", "timeout: .inf"), "wf.yaml:14: stages.features.timeout: must be a finite number"),
        (("retries: 1", "retries: 1000000000"), "wf.yaml:14: stages.features.retries: must be ≤ 100"),
        (
            ("outputs: [transactions, users]", "outputs: [a/../../b, users]"),
            "wf.yaml:7: stages.generate.outputs.0: 'a/../../b' is not a name: 1 to 100 letters, digits, '_', '.' "
            "or '-', starting with a letter or digit",
        ),
        (
            ("outputs: [transactions, users]", "outputs: ['', users]"),
            "wf.yaml:7: stages.generate.outputs.0: '' is not a name: 1 to 100 letters, digits, '_', '.' "
            "or '-', starting with a letter or digit",
        ),
        (
            ("  report:", "  ../x:"),
            "wf.yaml:15: stages.'../x': '../x' is not a name: 1 to 100 letters, digits, "
            "'_', '.' or '-', starting with a letter or digit",
        ),
        (
            ("{tx: transactions,", "{tx: a/b/transactions,"),
            "wf.yaml:12: stages.features.inputs.tx.dataset: 'a/b' is not a store session: 1 to 128 letters, "
            "digits, '_', '.' or '-', starting with a letter or digit",
        ),
        (
            ("name: demo", "name: " + "d" * 300),
            "wf.yaml:1: name: 'ddddddddddddddddddddddddddddddd…' is not a "
            "name: 1 to 100 letters, digits, '_', '.' or '-', starting with a letter or digit",
        ),
    ],
)
def test_values_that_failed_at_run_time_are_rejected(tmp_path, edit, expected):
    assert problems(tmp_path, GOOD.replace(*edit)) == [expected]


def site_problems(tmp_path: Path, text: str) -> list[str]:
    site = tmp_path / "site.yaml"
    site.write_text(textwrap.dedent(text))
    return [p.replace(str(site), "site.yaml") for p in problems(tmp_path, GOOD, site=str(site), check_imports=False)]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("name: s\nexecutor: lcoal\n", "site.yaml:2: executor: unknown executor 'lcoal' (did you mean 'local'?)"),
        (
            "name: s\nexecutor: nomad\n",
            "site.yaml:2: executor: unknown executor 'nomad'; known: kubernetes, local, mpirun, radical, ray, slurm",
        ),
        (
            "name: s\nrendezvous: bogus://x\n",
            "site.yaml:2: rendezvous: unknown rendezvous 'bogus'; known: file, redis, tcp",
        ),
        (
            "name: s\nrendezvous: tcp://127.0.0.1:99999\n",
            "site.yaml:2: rendezvous: 'tcp://127.0.0.1:99999': Port out of range 0-65535",
        ),
        (
            "name: s\ncommunicator: ucxx\n",
            "site.yaml:2: communicator: unknown communicator 'ucxx' (did you mean 'ucx'?)",
        ),
        (
            "name: s\nexecutor: local\ncommunicator: mpi\n",
            "site.yaml:3: communicator: 'mpi' needs executor 'mpirun' or 'slurm' (MPI ranks must be started by an "
            "MPI launcher), not 'local'",
        ),
        (
            "name: s\nexecutor: slurm\nslurm:\n  partition: debug\n  partiton: debug\n",
            "site.yaml:5: slurm.partiton: unknown key (did you mean 'partition'?)",
        ),
        (
            "name: s\nexecutor: slurm\nslurm:\n  pilot:\n    nodes: 2\n    nodez: 2\n",
            "site.yaml:6: slurm.pilot.nodez: unknown key (did you mean 'nodes'?)",
        ),
        (
            "name: s\nexecutor: ray\nray:\n  strategy: PACK\n  cpus: 2\n",
            "site.yaml:5: ray.cpus: unknown key; known: address, namespace, strategy, cpus_per_rank, resources, "
            "ready_timeout_s, runtime_env, init",
        ),
        ("name: s\nexecutor: slurm\nslurm:\n  mpi: {pmix: true}\n", "site.yaml:4: slurm.mpi: must be a string"),
        (
            "name: s\nexecutor: slurm\nslurm:\n  prologue: module load x\n",
            "site.yaml:4: slurm.prologue: must be a list",
        ),
        (
            "name: s\nexecutor: slurm\nslurm:\n  partition: [a, b]\n",
            "site.yaml:4: slurm.partition: must be a string, number or true/false (sbatch --partition=VALUE)",
        ),
        (
            "name: s\nexecutor: slurm\nslurm:\n  pilot:\n    time: {h: 1}\n",
            "site.yaml:5: slurm.pilot.time: must be a string, number or true/false (sbatch --time=VALUE)",
        ),
        ("name: s\nexecutor: ray\nray:\n  namespace: []\n", "site.yaml:4: ray.namespace: must be a string or null"),
        ("name: s\ncores: 1000000000\n", "site.yaml:2: cores: must be ≤ 1000000"),
        ("name: s\nstart_timeout: .nan\n", "site.yaml:2: start_timeout: must be a finite number"),
        (
            "name: s\nstore:\n  session: ../up\n",
            "site.yaml:3: store.session: '../up' is not a store session: 1 to 128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
        ),
        (
            "name: s\nstore:\n  root: ftp://host/x\n",
            "site.yaml:3: store.root: unknown store tier 'ftp'; known: file, s3",
        ),
    ],
)
def test_site_values_that_failed_at_run_time_are_rejected(tmp_path, text, expected):
    assert site_problems(tmp_path, text) == [expected]


def test_a_stages_executor_section_is_checked_like_the_sites(tmp_path):
    text = GOOD.replace("    retries: 1\n", "    retries: 1\n    slurm: {time: '1:00', tyme: '2:00'}\n")
    assert problems(tmp_path, text, check_imports=False) == [
        "wf.yaml:15: stages.features.slurm.tyme: unknown key (did you mean 'time'?)"
    ]
    text = GOOD.replace("    retries: 1\n", "    retries: 1\n    ray:\n      strategi: SPREAD\n")
    assert problems(tmp_path, text, check_imports=False) == [
        "wf.yaml:16: stages.features.ray.strategi: unknown key (did you mean 'strategy'?)"
    ]


def test_validate_checks_what_the_executor_checks_at_start(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("name: r\nexecutor: ray\ncores: 8\nray:\n  strategy: SIDEWAYS\n")
    text = GOOD.replace("kind: command\n    command: [python, -c, \"print('done')\"]\n", "app: apps:rank_info\n")
    assert problems(tmp_path, text, site=str(site), check_imports=False) == [
        f"{site}:5: ray.strategy: unknown strategy 'SIDEWAYS'; known: STRICT_PACK, PACK, SPREAD, STRICT_SPREAD"
    ]
    site.write_text("name: r\nexecutor: ray\ncores: 8\nray:\n  resources: [{CPU: 1}, {CPU: 1}]\n")
    assert problems(
        tmp_path, text.replace("ranks: 2\n    needs", "ranks: 1\n    needs"), site=str(site), check_imports=False
    ) == [f"{site}:4: ray: site 'r' (ray): resources lists 2 bundles for a gang of 1 ranks"]
    text = text.replace("    retries: 1\n", "    retries: 1\n    ray: {resources: [{CPU: 1}]}\n")
    assert problems(tmp_path, text, site=str(site), check_imports=False) == [
        "wf.yaml:15: stages.features.ray: site 'r' (ray): resources lists 1 bundles for a gang of 2 ranks",
        f"{site}:4: ray: site 'r' (ray): resources lists 2 bundles for a gang of 1 ranks",
    ]
    site.write_text("name: m\nexecutor: mpirun\ncommunicator: mpi\n")  # mpirun starts any program too
    wf, _ = load_workflow(write(tmp_path, GOOD), site=str(site), check_imports=False)
    assert wf.stages["report"].kind == "command"


def test_the_driver_must_be_able_to_listen_on_its_address(tmp_path):
    assert site_problems(tmp_path, "name: s\ndriver_host: 192.0.2.1\n") == [  # TEST-NET-1: no machine's
        "site.yaml:2: driver_host: cannot listen on '192.0.2.1' on this machine (Cannot assign requested address); "
        "ranks reach the driver there: give an address of this machine, or 'auto'"
    ]


def test_a_command_stage_gets_only_what_an_environment_can_hold(tmp_path):
    text = GOOD.replace("    needs: [features]\n", "    needs: [features]\n    params: {'a=b': 1}\n")
    assert problems(tmp_path, text) == [
        "wf.yaml:15: stages.report: param 'a=b' cannot be an environment variable (PHALANX_PARAM_A=B): "
        "use letters, digits and '_'"
    ]


@pytest.mark.parametrize(
    "content,expected",
    [
        (b"name: demo\nstages:\n  a: {app: \xff}\n", "wf.yaml:3: not UTF-8: byte 0xff at column 12"),
        (
            b"name: demo\nstages:\n  a: {app: \x01}\n",
            "wf.yaml:3: not valid YAML: character '\\x01' (#x1) is not allowed",
        ),
        (
            b"name: demo\nstages:\n\ta: 1\n",
            "wf.yaml:3: not valid YAML: found character '\\t' that cannot start any token",
        ),
        (
            b"name: demo\nstages:\n  a:\n    params: " + b"[" * 3000 + b"]" * 3000 + b"\n",
            "wf.yaml:4: not valid YAML: nested deeper than 100 levels",
        ),
        (
            b"name: demo\nstages:\n  a: {app: 'x:y', params: {day: 2024-13-45}}\n",
            "wf.yaml:3: not valid YAML: cannot read '2024-13-45' as !!timestamp: month must be in 1..12",
        ),
        (
            b"name: demo\nstages:\n  a: {app: 'x:y', params: {n: !!int 0x}}\n",
            "wf.yaml:3: not valid YAML: cannot read '0x' as !!int: invalid literal for int() with base 16: ''",
        ),
        (
            b"name: demo\nstages:\n  a: {app: 'x:y'}\n  a: {app: 'x:z'}\n",
            "wf.yaml:4: not valid YAML: duplicate key 'a' (first on line 3)",
        ),
        (b'name: demo\nstages:\n  a: {app: "x:y\\0"}\n', "wf.yaml:3: not valid YAML: a NUL character in a string"),
        (
            b"name: demo\nstages: &s\n  a: {app: 'x:y', params: *s}\n",
            "wf.yaml:3: not valid YAML: alias *s refers to a node that contains it",
        ),
        (
            b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((98 + i, 98 + i) + (97 + i,) * 10)
                for i in range(5)
            ),
            "wf.yaml:6: not valid YAML: expands to more than 1000000 values (aliases)",
        ),
        (b"- name: demo\n", "wf.yaml:1: (top level): must be a mapping, not a list"),
    ],
)
def test_every_yaml_error_names_the_line(tmp_path, content, expected):
    path = tmp_path / "wf.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_workflow(path, check_imports=False)
    assert [p.replace(str(path), "wf.yaml") for p in info.value.problems] == [expected]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({"k": "[a"}, "--set k: not valid YAML: expected ',' or ']', but got '<stream end>'"),
        ({"stages.features.ranks": "0"}, "--set stages.features.ranks: stages.features.ranks: must be ≥ 1"),
        (
            {"stages.generate": "{app: 'apps:rank_info', colour: red}"},
            "--set stages.generate: stages.generate.colour: unknown key",
        ),
        (
            {"stages.generate.ranks.x": "1"},
            "--set stages.generate.ranks.x: stages.generate.ranks: is not a mapping, so 'x' cannot be set in it",
        ),
        (
            {"stages.features.ranks": "64"},
            "--set stages.features.ranks: stages.features.ranks: 64 ranks, but site "
            f"'local' can give at most {Site(name='local').capacity()}",
        ),
    ],
)
def test_set_errors_name_the_override(tmp_path, overrides, expected):
    assert problems(tmp_path, GOOD, overrides=overrides, check_imports=False) == [expected]


def test_cli_validate_reports_a_bad_set_value_without_a_traceback(tmp_path):
    good = write(tmp_path, GOOD)
    for sets, expected in [
        (["k=[a"], ["--set k: not valid YAML: expected ',' or ']', but got '<stream end>'"]),
        (
            ["novalue", "a..b=1"],
            [
                "--set novalue: expected KEY=VALUE, e.g. stages.gen.params.rows=1000",
                "--set a..b=1: expected KEY=VALUE, e.g. stages.gen.params.rows=1000",
            ],
        ),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "validate", str(good), "--no-imports", *(f"--set={s}" for s in sets)],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 1 and out.stderr.splitlines() == expected, out.stderr


def test_an_input_may_name_another_runs_session():
    from phalanx.orchestrator.models import InputSpec

    assert InputSpec(dataset="etl-20240101-120000-abcdef/tx").dataset == "etl-20240101-120000-abcdef/tx"


def test_any_yaml_param_dumps_to_the_json_a_run_records(tmp_path):
    text = GOOD.replace("params: {rows: 1000}", "params: {rows: 1000, key: !!binary /w==, day: 2024-01-02}")
    wf, _ = load_workflow(write(tmp_path, text), check_imports=False)
    assert wf.stages["generate"].model_dump(mode="json")["params"] == {"rows": 1000, "key": "_w==", "day": "2024-01-02"}
