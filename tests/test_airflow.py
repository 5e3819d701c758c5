"""The Airflow provider against a real Airflow 3 (marker ``airflow``).

One temporary AIRFLOW_HOME for the session (SQLite, ``airflow db migrate`` once, no examples);
its DAGs folder holds workflows/airflow/etl_dag.py and tests/airflow_dags/phalanx_test_dags.py.
DAGs run through ``dag.test()`` in this process (tasks, triggers and the execution API in
process, as Airflow's own DAG tests do) and once through ``airflow dags test``.  phalanx state
(run database, logs) goes to a directory of the session; the store to conftest's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.airflow
if importlib.util.find_spec("airflow") is None:  # never import it here: AIRFLOW_HOME first
    pytest.skip(
        "apache-airflow 3 is not installed (pip install 'phalanx[airflow]', or bash scripts/setup-airflow.sh)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ETL_DAG = ROOT / "workflows" / "airflow" / "etl_dag.py"
TEST_DAGS = TESTS / "airflow_dags" / "phalanx_test_dags.py"
ETL_CONF = {"rows": 20_000, "epochs": 1}


# ---- the session's Airflow ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def af(request):
    """A migrated Airflow home (SQLite) for the session; this process is configured for it.  When
    a collected test uses ``deployed``, the deployed Airflow starts now, on a copy of the freshly
    migrated database, and comes up while the other tests run."""
    if "airflow" in sys.modules and not os.environ.get("AIRFLOW_HOME", "").startswith(tempfile.gettempdir()):
        pytest.fail("airflow was imported before the test's AIRFLOW_HOME was set")
    home = Path(tempfile.mkdtemp(prefix="phalanx-airflow-"))
    dags = home / "dags"
    dags.mkdir()
    for f in (ETL_DAG, TEST_DAGS):
        (dags / f.name).symlink_to(f)
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "PHALANX_STATE": str(home / "phalanx-state"),
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    r = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert r.returncode == 0, f"airflow db migrate failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    migrated = home / "migrated"  # a copy before any test writes to it: the deployed Airflow's database
    migrated.mkdir()
    for name in ("airflow.db", "airflow.cfg"):
        if (home / name).exists():
            shutil.copy(home / name, migrated / name)
    sys.path.insert(0, str(dags))
    deployment = None
    try:
        if any("deployed" in getattr(item, "fixturenames", ()) for item in request.session.items):
            deployment = _deploy(home, migrated / "airflow.db")
        yield SimpleNamespace(
            home=home,
            dags=dags,
            state=Path(env["PHALANX_STATE"]),
            modules={},
            migrated=migrated / "airflow.db",
            deployment=deployment,
        )
    finally:
        if deployment is not None:
            deployment.stop()
        sys.path.remove(str(dags))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


def _module(af, path: Path):
    if path.stem not in af.modules:
        spec = importlib.util.spec_from_file_location(path.stem, af.dags / path.name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        af.modules[path.stem] = mod
    return af.modules[path.stem]


def run_dag(af, capfd, module: Path, dag_id: str, conf: dict | None = None):
    """``dag.test()`` of one DAG: (task id → final state, task id → XCom return value, the
    output: every task's log lines)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    dag = _module(af, module).__dict__
    dag = next(d for d in dag.values() if getattr(d, "dag_id", None) == dag_id and hasattr(d, "test"))
    import logging

    records: list[str] = []

    class Keep(logging.Handler):  # lines that go through stdlib logging rather than the task's stdout
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    keep = Keep(level=logging.INFO)
    logging.getLogger().addHandler(keep)
    capfd.readouterr()
    try:
        dr = dag.test(run_conf=conf)
    finally:
        logging.getLogger().removeHandler(keep)
    out, err = capfd.readouterr()
    err += "\n" + "\n".join(records)
    with create_session() as session:
        states = {ti.task_id: ti.state for ti in dr.get_task_instances(session=session)}
        rows = session.scalars(XComModel.get_many(run_id=dr.run_id, dag_ids=dag_id)).all()
        xcoms = {}
        for row in rows:
            xcoms.setdefault(row.task_id, {})[row.key] = XComModel.deserialize_value(row)
    sys.stdout.write(out[-20000:])  # shown by pytest when the test fails
    return states, xcoms, out + err


def rundb():
    from phalanx.orchestrator.rundb import RunDB

    return RunDB()


def our_processes(af) -> list[int]:
    """Processes (drivers, ranks) of this session's phalanx state, besides this one: their
    environment names its PHALANX_STATE (other sessions' test processes do not)."""
    marker = f"PHALANX_STATE={af.state}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:  # a zombie is gone, only not yet reaped
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def processes_left(af, within: float = 15.0) -> list[int]:
    """``our_processes`` once empty, or what is still there after ``within`` s: a detached
    driver marks its run ended before it exits (its gangs' teardown, exit handlers)."""
    deadline = time.monotonic() + within
    while (left := our_processes(af)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def alive(pid: int) -> bool:
    from phalanx.executors.base import pid_alive

    return pid_alive(pid)


def stored(session: str) -> dict[str, tuple]:
    """Every dataset of store session ``session``: name → (schema, partitioning, one (rows,
    bytes, checksum) per partition) as the store recorded them at the seal."""
    import phalanx as px

    store = px.Store(session=session)
    out = {}
    for name in store.list():
        info = store.info(name)
        out[name] = (info.schema, info.partitioning, [(p.rows, p.bytes, p.checksum) for p in info.partitions])
    return out


def same_outputs(reference: str, session: str) -> None:
    """Store session ``session`` holds the same datasets as ``reference``, byte for byte: the
    same names, schemas and partitioning, and partition i of each has the same rows, size and
    checksum.  The checksums are the store's own (xxh3 of each file, recorded at the seal), so
    the payload files are also compared directly, independently of them."""
    import phalanx as px

    want, got = stored(reference), stored(session)
    assert sorted(got) == sorted(want) == sorted(ETL_OUTPUTS)
    for name in ETL_OUTPUTS:
        assert got[name] == want[name], f"{name}: {got[name][1:]} != {want[name][1:]}"
        a, b = px.Store(session=reference).info(name), px.Store(session=session).info(name)
        for i in range(a.num_partitions):
            ref_bytes = px.Store(session=reference).tier.read_buffer(a.location, i)
            assert ref_bytes.equals(px.Store(session=session).tier.read_buffer(b.location, i)), f"{name} partition {i}"


# ---- the provider as Airflow sees it -------------------------------------------------------------
def test_provider_is_registered_and_phalanx_does_not_import_airflow(af):
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk import task

    pm = ProvidersManager()
    assert "phalanx" in pm.providers
    assert callable(task.phalanx)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, phalanx, phalanx.integrations.airflow as a; "
            "a.get_provider_info(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'airflow'))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_default_deferrable_comes_from_airflow_config(af, monkeypatch):
    from phalanx.integrations.airflow import PhalanxStageOperator

    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "True")
    assert PhalanxStageOperator(task_id="a", app="m:f").deferrable is True
    assert PhalanxStageOperator(task_id="b", app="m:f", deferrable=False).deferrable is False
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    assert PhalanxStageOperator(task_id="c", app="m:f").deferrable is False


def test_run_id_kept_in_state_dir_where_airflow_has_no_task_state_store(af):
    from phalanx.integrations.airflow._runs import TaskRunId

    db = rundb()
    ti = SimpleNamespace(dag_id="d", run_id="manual__x", task_id="t", map_index=-1)
    keep = TaskRunId({"ti": ti}, db)  # Airflow < 3.3: no context["task_state_store"]
    assert keep.get() is None
    keep.set("20250101-000000-abcdef")
    assert TaskRunId({"ti": ti}, db).get() == "20250101-000000-abcdef"  # the next try finds it
    other = SimpleNamespace(dag_id="d", run_id="manual__x", task_id="t", map_index=3)
    assert TaskRunId({"ti": other}, db).get() is None


# ---- the trigger -----------------------------------------------------------------------------
def test_trigger_serialises_polls_without_blocking_the_loop_and_is_idempotent(af, monkeypatch):
    import phalanx.orchestrator.handle as handle

    try:
        from airflow.sdk._shared.module_loading import import_string
    except ImportError:  # Airflow < 3.2
        from airflow.utils.module_loading import import_string

    from phalanx.integrations.airflow import PhalanxRunTrigger

    db = rundb()
    run_id, _ = db.new_run("trigger-test", "<python>", "local", None, {"s": 1})
    path, kwargs = PhalanxRunTrigger(run_id, state=str(db.state_dir), poll_interval=0.01).serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs  # what the triggerer stores
    trigger = import_string(path)(**kwargs)  # importable from the installed package

    real = handle.run_status
    reads = []
    released = threading.Event()

    def status_in_a_thread(db_, rid):
        # Blocks until a coroutine of the same loop releases it: were the read done on the loop's
        # thread, that coroutine could never run and this would time out.
        assert threading.current_thread() is not threading.main_thread()
        assert released.wait(20), "the trigger blocked the event loop"
        reads.append(rid)
        if len(reads) == 3:
            db.set_run(run_id, "succeeded")
        return real(db_, rid)

    monkeypatch.setattr(handle, "run_status", status_in_a_thread)

    async def main():
        async def release():
            await asyncio.sleep(0.05)
            released.set()

        async def first_event():
            async for event in trigger.run():
                return event.payload

        _, event = await asyncio.gather(release(), first_event())
        return event

    event = asyncio.run(main())
    assert event == {
        "run_id": run_id,
        "state": "succeeded",
        "polls": 3,
        "timed_out": False,
        "since": 0.0,
        "streamed": True,
    }
    again = asyncio.run(main())  # run twice (a triggerer restarted): the same answer
    assert again["state"] == "succeeded" and again["run_id"] == run_id


def test_trigger_on_kill_cancels_a_detached_run_and_leaves_no_rank(af, tmp_path):
    from phalanx.integrations.airflow import PhalanxRunTrigger

    db = rundb()
    run_id = detach(TESTS / "airflow_dags" / "sleeper.yaml", f"--set=stages.sleep.params.dir={tmp_path}")
    pids = _wait_for_pids(tmp_path, 2, db, run_id)
    trigger = PhalanxRunTrigger(run_id, state=str(db.state_dir))
    asyncio.run(trigger.on_kill())  # Airflow >= 3.3 calls it when a deferred task is marked failed or cleared
    assert db.run(run_id)["state"] == "cancelled"
    assert not [p for p in pids if alive(p)]
    assert processes_left(af) == []


def test_trigger_streams_the_ranks_lines_to_its_log_while_the_run_goes_on(af, tmp_path):
    """A real detached run whose two ranks say they wait, then wait for the test: the trigger
    (its async generator, as the triggerer drives it) logs both ranks' lines while the run is
    still running and no event has fired; after ``go``, every line of each rank's log file,
    once and in order, before the event (``streamed``: the task does not copy them again)."""
    import structlog

    from phalanx.integrations.airflow import PhalanxRunTrigger

    db = rundb()
    wf = tmp_path / "talk.yaml"
    wf.write_text(
        "name: px-talk\nsite: local\nstages:\n  talk:\n    app: airflow_apps:gated\n    ranks: 2\n"
        f"    params: {{dir: {json.dumps(str(tmp_path))}, wait_s: 120}}\n    outputs: [gated]\n"
    )
    run_id = detach(wf)
    trigger = PhalanxRunTrigger(run_id, state=str(db.state_dir), poll_interval=0.05)

    def said(logs: list[dict]) -> list[str]:
        return [e["event"] % tuple(e.get("positional_args", ())) for e in logs]

    async def main():
        with structlog.testing.capture_logs() as logs:
            events = trigger.run()
            fired = asyncio.ensure_future(events.__anext__())
            deadline = time.monotonic() + 120
            while sum("waiting for" in line for line in said(logs)) < 2:
                assert not fired.done() and time.monotonic() < deadline, said(logs)
                await asyncio.sleep(0.02)
            before = said(logs)
            state = db.run(run_id)["state"]
            (tmp_path / "go").touch()
            event = await asyncio.wait_for(fired, 120)
            await events.aclose()
        return before, state, said(logs), event.payload

    try:
        before, state, after, event = asyncio.run(main())
    finally:
        (tmp_path / "go").touch()
    assert state == "running"  # the lines came while the run went on
    for rank in (0, 1):
        assert f"[rank {rank}] talk: gated rank {rank}: waiting for {tmp_path / 'go'}" in before
    assert event["state"] == "succeeded" and event["streamed"] is True
    (attempt,) = db.attempts(run_id)
    for rank in (0, 1):  # each rank's file, every line once and in order, as the trigger logged them
        on_disk = (Path(attempt["log_dir"]) / f"rank-{rank}.log").read_text().splitlines()
        assert f"gated rank {rank}: go" in on_disk
        mine = [line for line in after if line.startswith(f"[rank {rank}] talk: ")]
        assert mine == [f"[rank {rank}] talk: {line.removeprefix(f'[rank {rank}] ')}" for line in on_disk]
    assert after[-1].endswith("polls of the run database)")  # the ranks' lines came before the event
    assert processes_left(af) == []


def detach(workflow: Path, *options: str) -> str:
    """``phalanx run WORKFLOW --detach OPTIONS`` (its ranks import tests/airflow_apps.py): the run id."""
    r = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "run", str(workflow), "--detach", *options],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def _wait_for_pids(d: Path, n: int, db, run_id: str, timeout: float = 120) -> list[int]:
    import time

    deadline = time.monotonic() + timeout
    while len([p for p in d.glob("pid.*") if p.read_text().strip()]) < n:
        run = db.run(run_id)
        assert run["state"] == "running", f"run {run_id} is {run['state']} before its ranks started"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    return [int(p.read_text()) for p in d.glob("pid.*")]


# ---- the example DAG, both modes, against `phalanx run` ---------------------------------------------
@pytest.fixture(scope="session")
def reference_run(af):
    """`phalanx run workflows/etl_to_training.yaml` with the DAG-run conf's sizes: its store session."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            str(ROOT / "workflows" / "etl_to_training.yaml"),
            "--plain",
            f"--set=stages.generate.params.rows={ETL_CONF['rows']}",
            f"--set=stages.train.params.epochs={ETL_CONF['epochs']}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split("(store session '")[1].split("'")[0]


ETL_OUTPUTS = ("transactions", "users", "features", "train_metrics")
STAGE_TASKS = ("generate", "features", "train", "report")


@pytest.mark.parametrize("dag_id", ["phalanx_etl", "phalanx_etl_deferrable"])
def test_example_dag_matches_phalanx_run_byte_for_byte(af, capfd, reference_run, dag_id):
    states, xcoms, log = run_dag(af, capfd, ETL_DAG, dag_id, ETL_CONF)
    assert states == dict.fromkeys((*STAGE_TASKS, "etl_to_training"), "success"), states
    deferred = dag_id.endswith("deferrable")
    # every task ran its own phalanx run; each manifest is small and names its run and outputs
    whole = xcoms["etl_to_training"]["return_value"]
    assert whole["state"] == "succeeded" and set(whole["outputs"]) == set(ETL_OUTPUTS)
    assert len(json.dumps(whole)) < 4000
    for name in ETL_OUTPUTS:
        entry = whole["outputs"][name]
        assert entry["dataset"] == f"{whole['session']}/{name}"
        assert entry["rows"] > 0 and entry["bytes"] > 0 and "kind" in entry["partitioning"]
    runs = {t: xcoms[t]["return_value"]["run_id"] for t in (*STAGE_TASKS, "etl_to_training")}
    assert len(set(runs.values())) == 5
    db = rundb()
    for run_id in runs.values():
        assert db.run(run_id)["state"] == "succeeded"
        assert f"phalanx status {run_id}" in log  # the task log names the run
    # the stage tasks shared one store session (the DAG run's); downstream read upstream outputs
    sessions = {xcoms[t]["return_value"]["session"] for t in STAGE_TASKS}
    assert len(sessions) == 1
    stage_outputs = {
        **xcoms["generate"]["return_value"]["outputs"],
        **xcoms["features"]["return_value"]["outputs"],
        **xcoms["train"]["return_value"]["outputs"],
    }
    assert xcoms["generate"]["transactions"] == stage_outputs["transactions"]  # one XCom key per output
    # the same outputs as `phalanx run` of the file, every dataset byte for byte (the features
    # stage sorts its partitions; train_metrics holds no wall-clock time)
    for session in (whole["session"], stage_outputs["transactions"]["dataset"].split("/")[0]):
        same_outputs(reference_run, session)
    # the ranks' lines are in the task log, with their [rank N] prefix
    assert "[rank 0] generate:" in log and "[rank 1] features:" in log and "[rank 0] train:" in log
    assert "[rank 0] report: done" in log
    if deferred:  # each task deferred to the trigger, which polled the run database
        assert log.count("Pausing task as DEFERRED") == 5
        assert "[DAG TEST] running trigger in line" in log
        assert log.count("polls of the run database)") >= 5  # the trigger's own line (stdout or logging)
        assert log.count("(the trigger polled the run database") == 5
    else:
        assert "Pausing task as DEFERRED" not in log


# ---- failures, kills, timeouts, retries -----------------------------------------------------------
def test_failing_rank_fails_the_task_with_its_traceback_in_the_log(af, capfd):
    states, xcoms, log = run_dag(af, capfd, TEST_DAGS, "px_fail", {})
    assert states == {"boom": "failed", "boom_deferred": "failed"}
    # both tasks' logs carry rank 1's traceback (streamed, or fetched after the trigger fired)
    assert log.count("ValueError: rank 1 refuses on purpose: tracebackword") >= 2
    assert log.count("--- traceback of rank 1 ---") >= 2
    assert log.count("in fail_on_rank") >= 2  # the frame of the app that raised
    assert "[rank 1] boom: " in log and "[rank 1] boom_deferred: " in log  # the rank's own lines
    assert "about to fail" in log
    assert "return_value" not in xcoms.get("boom", {})
    db = rundb()
    failed = [r for r in db.runs(50) if r["workflow"] in ("px_fail.boom", "px_fail.boom_deferred")]
    assert sorted(r["workflow"] for r in failed[:2]) == ["px_fail.boom", "px_fail.boom_deferred"]
    assert all(r["state"] == "failed" for r in failed[:2])
    assert processes_left(af) == []


def test_execution_timeout_cancels_the_run_and_leaves_no_rank(af, capfd, tmp_path):
    for name in ("sleep_inline", "sleep_deferred"):
        (tmp_path / name).mkdir()
    states, _, log = run_dag(af, capfd, TEST_DAGS, "px_timeout", {"dir": str(tmp_path)})
    assert states == {"sleep_inline": "failed", "sleep_deferred": "failed"}
    assert "AirflowTaskTimeout" in log
    assert "execution_timeout (0:00:12) passed while deferred; the run was cancelled" in log
    db = rundb()
    runs = [r for r in db.runs(50) if r["workflow"] == "px-sleeper"][:2]
    assert [r["state"] for r in runs] == ["cancelled", "cancelled"]
    started = [int(p.read_text()) for p in tmp_path.glob("*/pid.*") if p.read_text().strip()]
    assert not [p for p in started if alive(p)]
    assert processes_left(af) == []


def test_airflow_retry_resumes_the_run_and_reuses_sealed_outputs(af, capfd, tmp_path):
    for name in ("retry_inline", "retry_deferred"):
        (tmp_path / name).mkdir()
    states, xcoms, log = run_dag(af, capfd, TEST_DAGS, "px_retry", {"dir": str(tmp_path)})
    assert states == {"retry_inline": "success", "retry_deferred": "success"}
    db = rundb()
    for name in ("retry_inline", "retry_deferred"):
        manifest = xcoms[name]["return_value"]
        run_id = manifest["run_id"]
        # one phalanx run over both tries: the first try's `seal` attempt is its only one
        seal, flaky = db.attempts(run_id, "seal"), db.attempts(run_id, "flaky")
        assert [(a["attempt"], a["state"]) for a in seal] == [(1, "succeeded")]
        assert [(a["attempt"], a["state"]) for a in flaky] == [(1, "failed"), (2, "succeeded")]
        assert any(e["kind"] == "reused" and e["stage"] == "seal" for e in db.events(run_id))
        assert len((tmp_path / name / "seal.runs").read_text().splitlines()) == 1  # the app ran once
        import phalanx as px

        assert px.Store(session=manifest["session"]).read("second").column("total").to_pylist() == [6]
        assert f"phalanx run {run_id} resumed" in log
    assert log.count("not run again (outputs sealed by an earlier attempt): seal") == 2


def test_deferred_task_holds_no_worker_slot_while_its_run_goes_on(af, capfd, tmp_path, monkeypatch):
    """At the moment the worker hands the task to the triggerer, the phalanx run is still going
    (its rank waits for the test), the task instance is DEFERRED with a PhalanxRunTrigger row,
    and no task occupies a slot of any pool; then the trigger fires and the task completes."""
    import airflow.sdk.execution_time.supervisor as supervisor
    from airflow.models.pool import Pool
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session

    seen = {}
    real = supervisor.run_task_in_process

    def worker(ti, task):
        result = real(ti=ti, task=task)
        if result.ti.state == "deferred":  # the worker is done with the task: look before dag.test goes on
            with create_session() as session:
                row = (
                    session.query(TaskInstance)
                    .filter_by(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=ti.map_index)
                    .one()
                )
                trigger = session.get(Trigger, row.trigger_id)
                seen.update(
                    state=row.state,
                    trigger=trigger.classpath,
                    kwargs=trigger.kwargs,
                    occupied={p.pool: p.occupied_slots(session=session) for p in session.query(Pool)},
                    pids=[int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text().strip()],
                )
            run_id = seen["kwargs"]["run_id"]
            seen["run_state"] = rundb().run(run_id)["state"]
            (tmp_path / "go").write_text("go")  # now the rank may finish
        return result

    monkeypatch.setattr(supervisor, "run_task_in_process", worker)
    states, xcoms, log = run_dag(af, capfd, TEST_DAGS, "px_gated", {"dir": str(tmp_path)})
    assert states == {"gated": "success"}
    assert seen["state"] == "deferred"
    assert seen["trigger"] == "phalanx.integrations.airflow.triggers.PhalanxRunTrigger"
    assert seen["run_state"] == "running"  # the run went on while the task was deferred
    assert seen["occupied"] and all(n == 0 for n in seen["occupied"].values()), seen["occupied"]
    assert xcoms["gated"]["return_value"]["outputs"]["gated"]["rows"] == 1
    assert "polls of the run database)" in log  # the trigger's own line


# ---- Python workflows, the decorator, the CLI ----------------------------------------------------------
def test_task_decorator_and_python_workflow_objects(af, capfd):
    import phalanx as px

    states, xcoms, log = run_dag(af, capfd, TEST_DAGS, "px_python", {})
    assert states == dict.fromkeys(("numbers", "total", "object", "object_inline"), "success"), states
    total = xcoms["total"]["return_value"]
    assert total["outputs"]["total"]["rows"] == 1
    assert px.Store(session=total["session"]).read("total").column("total").to_pylist() == [sum(range(100)) + 1]
    assert xcoms["numbers"]["return_value"]["session"] == total["session"]  # the DAG run's session
    assert "[rank 1] numbers: " in log and "numbers 50..99" in log and "[rank 0] total: " in log
    for task in ("object", "object_inline"):
        squares = xcoms[task]["return_value"]
        got = px.Store(session=squares["session"]).read("squares").column("sq").to_pylist()
        assert sorted(got) == [i * i for i in range(10)]


def test_airflow_dags_test_cli(af):
    r = subprocess.run(
        [sys.executable, "-m", "airflow", "dags", "test", "px_cli"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "DagRun Finished: dag_id=px_cli" in out and "state=success" in out
    assert "[rank 0] numbers: " in out
    run_id = out.split("phalanx run ")[1].split()[0]
    assert rundb().run(run_id)["state"] == "succeeded"


def test_workflow_operator_set_takes_values_as_they_are_and_strings_as_yaml(af, tmp_path):
    """``set=`` of a workflow file: a string is read as ``--set`` reads it (YAML: "250" is 250),
    anything else is taken as given — a command list with a multi-line program in it stays one."""
    from phalanx.integrations.airflow.operators import PhalanxWorkflowOperator

    program = "import sys\nprint(2)"  # str() of the list quotes it '...': YAML keeps a literal \\n
    op = PhalanxWorkflowOperator(
        task_id="set_values",
        workflow=str(ROOT / "workflows" / "etl_to_training.yaml"),
        site="local",
        set={"stages.generate.params.rows": "250", "stages.report.command": ["python", "-c", program]},
    )
    launch = op._prepare({})
    assert launch.wf.stages["generate"].params["rows"] == 250
    assert launch.wf.stages["report"].command == ["python", "-c", program]


# ---- the provider's pieces for kills, re-attaching and the report link ------------------------------
def test_reattach_message_names_the_run(af):
    from phalanx.integrations.airflow.operators import announcement

    how = "deferred to the triggerer: no worker slot is held"
    line = announcement("20250101-000000-abcdef", "/state", None, True, how)
    assert line.startswith(
        "phalanx run 20250101-000000-abcdef is still running (started by an earlier try): re-attached to it; "
        "deferred to the triggerer: no worker slot is held.  See: phalanx status 20250101-000000-abcdef"
    ), line
    assert "still running," not in line
    assert announcement("R", "/s", None, False, how).startswith("phalanx run R started; deferred")
    assert announcement("R", "/s", "R", False, how).startswith("phalanx run R resumed (stages whose outputs")


def test_report_link_is_never_a_file_url(af, monkeypatch):
    from phalanx.integrations.airflow import PhalanxRunLink

    op = SimpleNamespace(_report="/somewhere/state/reports/20250101-000000-abcdef.html")
    monkeypatch.delenv("AIRFLOW__PHALANX__REPORT_BASE_URL", raising=False)
    assert PhalanxRunLink().get_link(op, ti_key=None) == ""  # not file:///...: no browser follows it from http
    monkeypatch.setenv("AIRFLOW__PHALANX__REPORT_BASE_URL", "https://reports.example/phalanx/")
    assert PhalanxRunLink().get_link(op, ti_key=None) == "https://reports.example/phalanx/20250101-000000-abcdef.html"
    monkeypatch.setenv("AIRFLOW__PHALANX__REPORT_BASE_URL", "file:///somewhere/state/reports")
    assert PhalanxRunLink().get_link(op, ti_key=None) == ""
    assert PhalanxRunLink().get_link(SimpleNamespace(), ti_key=None) == ""


def test_run_owner_a_kill_of_an_older_try_leaves_a_newer_tries_run(af, monkeypatch):
    from phalanx.integrations.airflow import _runs

    db = rundb()
    run_id, _ = db.new_run("owner-test", "<python>", "local", None, {"s": 1})
    cancelled = []
    monkeypatch.setattr(_runs, "cancel_run", lambda rid, state, wait=30.0: cancelled.append(rid) or "cancelled")
    owner = _runs.RunOwner(db.state_dir, run_id)
    assert owner.claim(1, {"try_number": 1})
    assert owner.claim(2, {"try_number": 2})  # the cleared task's next try re-attached
    assert owner.cancel(1, str(db.state_dir)) == ("running", 2)  # try 1's kill: not its run any more
    assert cancelled == []
    assert owner.cancel(2, str(db.state_dir)) == ("cancelled", None)  # the owner's own kill cancels
    assert cancelled == [run_id]
    assert owner.read() == {"try": 2, "task": {"try_number": 2}, "cancelling": False}
    assert owner.cancel(None, str(db.state_dir))[1] is None  # an older trigger (no try known): as before


def test_run_owner_a_newer_try_waits_while_an_older_kill_cancels(af, monkeypatch):
    from phalanx.integrations.airflow import _runs

    db = rundb()
    run_id, _ = db.new_run("owner-test", "<python>", "local", None, {"s": 1})
    owner = _runs.RunOwner(db.state_dir, run_id)
    owner.claim(1)
    inside, release = threading.Event(), threading.Event()

    def slow_cancel(rid, state, wait=30.0):
        inside.set()
        assert release.wait(20)
        return "cancelled"

    monkeypatch.setattr(_runs, "cancel_run", slow_cancel)
    killer = threading.Thread(target=owner.cancel, args=(1, str(db.state_dir)))
    killer.start()
    assert inside.wait(20)
    assert not owner.claim(2)  # try 1's kill is cancelling: try 2 waits for the run to end, then resumes
    release.set()
    killer.join(20)
    assert owner.claim(2)


def test_trigger_kill_is_told_in_the_log_of_its_try(af, monkeypatch, tmp_path):
    from phalanx.integrations.airflow.triggers import attempt_log, tell_task_log

    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path))
    task = {"dag_id": "d", "run_id": "manual__x", "task_id": "t", "map_index": -1, "try_number": 3}
    assert attempt_log(task) is None and not tell_task_log(task, "nothing here")  # never creates a file
    log = tmp_path / "dag_id=d" / "run_id=manual__x" / "task_id=t" / "attempt=3.log"
    log.parent.mkdir(parents=True)
    log.write_text('{"event": "Pausing task as DEFERRED. "}\n')
    assert attempt_log(task) == log
    assert tell_task_log(task, "phalanx run R cancelled: the task was stopped while deferred")
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["event"] == "phalanx run R cancelled: the task was stopped while deferred"
    assert last["level"] == "warning" and last["timestamp"].endswith("Z")
    assert attempt_log({**task, "map_index": 2}) is None  # a mapped instance's file is elsewhere


# ---- Airflow deployed as users run it: scheduler, dag-processor, triggerer, api-server ----------------
def _deploy(home: Path, migrated_db: Path):
    """Airflow deployed under ``home/deployed`` (its processes started), one DAG in its folder."""
    from infra.airflow_deploy import deploy

    base = home / "deployed"
    dags = base / "dags"
    dags.mkdir(parents=True)
    (dags / "phalanx_deployed_dags.py").symlink_to(TESTS / "airflow_dags" / "phalanx_deployed_dags.py")
    env = {**os.environ, "PHALANX_STATE": str(base / "phalanx-state"), "PYTHONPATH": str(TESTS)}
    return deploy(base / "home", dags, migrated_db, env)


@pytest.fixture(scope="session")
def deployed(af):
    """Airflow started as a user starts it (tests/infra/airflow_deploy.py: LocalExecutor, SQLite,
    everything on 127.0.0.1, ended by PID at teardown) with one DAG, ``px_deployed``, whose task
    defers while its rank waits for a file.  Two DAG runs are started at once and awaited until
    both tasks are DEFERRED: ``clear`` and ``fail``, each ``[dag run id, its directory, the
    phalanx run id]``."""
    from infra.airflow_deploy import wait_for

    d = af.deployment or _deploy(af.home, af.migrated)
    base = d.home.parent
    try:
        d.wait_up()
        d.wait_dag("px_deployed")
        runs = {}
        for name in ("clear", "fail"):
            folder = base / name
            folder.mkdir()
            runs[name] = [d.trigger("px_deployed", {"dir": str(folder)}), folder]
        for name, (run, _) in runs.items():
            d.wait_ti("px_deployed", run, "gated", {"deferred"}, 1, timeout=180)
            # and its trigger running in the triggerer (only a running trigger gets on_kill)
            wait_for(
                f"the trigger of {name}'s try 1 to start",
                lambda run=run: _containing(d.log("px_deployed", run, "gated", 1), "/gated/-1/1 (ID "),
                120,
                0.3,
                d.tails,
            )
            first = d.log("px_deployed", run, "gated", 1)
            runs[name].append(first.split("phalanx run ")[1].split()[0])
            assert f"phalanx run {runs[name][2]} started" in first, first
        yield SimpleNamespace(d=d, state=base / "phalanx-state", runs=runs)
    finally:
        d.stop()


def _deployed_run(deployed, run_id: str) -> dict:
    from phalanx.orchestrator.rundb import RunDB

    return RunDB(deployed.state).run(run_id) or {}


def test_deployed_a_deferred_tasks_log_shows_its_ranks_lines_while_deferred(deployed):
    """The rank's line (it waits for the test) in the try's log as the UI reads it (REST API,
    every source merged: the trigger's file beside the task's) while the task is deferred."""
    from infra.airflow_deploy import wait_for

    d, (dag_run, folder, run_id) = deployed.d, deployed.runs["fail"]
    line = f"[rank 0] gated: gated rank 0: waiting for {folder / 'go'}"
    log = wait_for(
        "the rank's line in the deferred try's log",
        lambda: _containing(d.log("px_deployed", dag_run, "gated", 1), line),
        60,
        0.3,
        lambda: "\n" + d.log("px_deployed", dag_run, "gated", 1),
    )
    assert d.ti("px_deployed", dag_run, "gated")["state"] == "deferred"  # the task has not resumed
    assert _deployed_run(deployed, run_id)["state"] == "running"
    assert log.index("Pausing task as DEFERRED") < log.index(line) and log.count(line) == 1
    trigger_files = list(
        (d.logs / "dag_id=px_deployed" / f"run_id={dag_run}" / "task_id=gated").glob("attempt=1.log.trigger.*.log")
    )
    assert any(line in f.read_text() for f in trigger_files), trigger_files  # written by the triggerer


def test_deployed_clearing_a_deferred_task_resumes_its_run_in_the_next_try(deployed):
    """Item 1 of issue 22: the task cleared while deferred.  As users saw it, the scheduler starts
    try 2 — which re-attaches to the run still going — before the triggerer runs try 1's
    on_kill; the test makes that order certain by pausing the triggerer (SIGSTOP to its process
    group, by PID) until try 2 has deferred.  try 1's kill must then leave the run to try 2,
    which succeeds on the same phalanx run."""
    from infra.airflow_deploy import wait_for

    d, (dag_run, folder, run_id) = deployed.d, deployed.runs["clear"]
    d.pause("triggerer")
    try:
        d.clear("px_deployed", dag_run, "gated")
        d.wait_ti("px_deployed", dag_run, "gated", {"deferred"}, 2, timeout=120)  # try 2 took the run over
    finally:
        d.resume("triggerer")
    assert _deployed_run(deployed, run_id)["state"] == "running"

    def try1_killed():  # the triggerer ran try 1's on_kill, and said what it did in try 1's log
        first = d.log("px_deployed", dag_run, "gated", 1)
        if f"phalanx run {run_id} was not cancelled: try 2 of this task owns it now" in first:
            return True
        if _deployed_run(deployed, run_id).get("state") != "running":
            second = d.log("px_deployed", dag_run, "gated", 2)
            raise AssertionError(f"try 1's kill cancelled the run try 2 owns:\n{first}\n---\n{second}")
        return False

    def what_happened() -> str:
        owners = deployed.state / "airflow" / "owners" / f"{run_id}.json"
        return (
            f"\n--- try 1's log ---\n{d.log('px_deployed', dag_run, 'gated', 1)}\n--- owner: "
            f"{owners.read_text() if owners.exists() else None}{d.tails(6000)}"
        )

    wait_for("try 1's on_kill", try1_killed, 90, 0.3, what_happened)
    (folder / "go").write_text("go")  # the rank may finish now
    ti = d.wait_ti("px_deployed", dag_run, "gated", {"success"}, 2, timeout=120)
    assert ti["try_number"] == 2
    second = d.log("px_deployed", dag_run, "gated", 2)
    # item 2: the re-attach line names the run
    assert f"phalanx run {run_id} is still running (started by an earlier try): re-attached to it; " in second
    assert f"phalanx run {run_id} succeeded" in second
    assert _deployed_run(deployed, run_id)["state"] == "succeeded"
    # item 3: the report is named with its host in the log, and the extra link is no file:// URL
    assert f"phalanx report of run {run_id}: {deployed.state}/reports/" in second
    import socket

    assert f"on host {socket.gethostname()}" in second
    links = d.api("GET", f"dags/px_deployed/dagRuns/{_quote(dag_run)}/taskInstances/gated/links")
    assert "file:" not in json.dumps(links), links


def test_deployed_marking_a_deferred_task_failed_says_so_in_its_log(deployed):
    """Item 4 of issue 22: marked failed while deferred, the run is cancelled (no rank left) and
    the try's own log — the one the UI shows — says so, not only the trigger's."""
    from infra.airflow_deploy import wait_for

    d, (dag_run, folder, run_id) = deployed.d, deployed.runs["fail"]
    pids = [int(p.read_text()) for p in folder.glob("pid.*") if p.read_text().strip()]
    d.mark("px_deployed", dag_run, "gated", "failed")
    wait_for("the run cancelled", lambda: _deployed_run(deployed, run_id).get("state") == "cancelled", 60, 0.3)
    message = f"phalanx run {run_id} cancelled: the task was stopped while deferred"
    log = wait_for(
        "the cancellation in the try's log",
        lambda: _containing(d.log("px_deployed", dag_run, "gated", 1), message),
        30,
        0.5,
        lambda: "\n" + d.log("px_deployed", dag_run, "gated", 1),
    )
    assert log.index("Pausing task as DEFERRED") < log.index(message) and log.count(message) == 1
    # in the try's own log file, after the deferral (not only in the trigger's file, which the UI
    # reads from the triggerer only while the task is deferred, and which lost this line at times)
    own = d.logs / "dag_id=px_deployed" / f"run_id={dag_run}" / "task_id=gated" / "attempt=1.log"
    events = [json.loads(line).get("event", "") for line in own.read_text().splitlines() if line.startswith("{")]
    assert any(e.startswith("Pausing task as DEFERRED") for e in events)
    assert events[-1].startswith(message), events[-3:]
    assert "every gang stopped and no rank process is left" in log
    assert d.ti("px_deployed", dag_run, "gated")["state"] == "failed"
    assert pids and not [p for p in pids if alive(p)]


def _containing(text: str, part: str) -> str | None:
    return text if part in text else None


def _quote(text: str) -> str:
    import urllib.parse

    return urllib.parse.quote(text, safe="")
