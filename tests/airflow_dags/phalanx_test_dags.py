"""DAGs of tests/test_airflow.py (its AIRFLOW__CORE__DAGS_FOLDER holds this file and
workflows/airflow/etl_dag.py).  Paths and sizes come in as DAG-run conf (dag.test(run_conf=...))."""

from __future__ import annotations

import datetime
from pathlib import Path

import pyarrow as pa
from airflow.sdk import DAG, task

import phalanx as px
from phalanx.integrations.airflow import PhalanxStageOperator, PhalanxWorkflowOperator

HERE = Path(__file__).resolve().parent
START = datetime.datetime(2025, 1, 1)
NO_RETRY = {"retries": 0}
DIR = "{{ dag_run.conf['dir'] }}"


def _dag(dag_id: str, **kwargs) -> DAG:
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=NO_RETRY, **kwargs)


# a rank that raises: the task fails with the rank's traceback in its log (both modes)
with _dag("px_fail") as px_fail:
    for deferrable in (False, True):
        PhalanxStageOperator(
            task_id="boom_deferred" if deferrable else "boom",
            app="airflow_apps:fail_on_rank",
            ranks=2,
            stage_params={"rank": 1, "word": "tracebackword"},
            outputs=["never"],
            deferrable=deferrable,
            poll_interval=0.5,
        )

# execution_timeout while the ranks sleep: the run is cancelled, no rank is left (both modes)
with _dag("px_timeout") as px_timeout:
    for deferrable in (False, True):
        name = "sleep_deferred" if deferrable else "sleep_inline"
        PhalanxWorkflowOperator(
            task_id=name,
            workflow=str(HERE / "sleeper.yaml"),
            set={"stages.sleep.params.dir": DIR + "/" + name},
            execution_timeout=datetime.timedelta(seconds=12),
            deferrable=deferrable,
            poll_interval=0.5,
        )

# an Airflow retry resumes the task's phalanx run: "seal" is not run again (both modes)
with DAG(
    "px_retry",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 1, "retry_delay": datetime.timedelta(0)},
) as px_retry:
    for deferrable in (False, True):
        name = "retry_deferred" if deferrable else "retry_inline"
        PhalanxWorkflowOperator(
            task_id=name,
            workflow="retry.yaml",  # found beside this file
            set={"stages.seal.params.dir": DIR + "/" + name, "stages.flaky.params.dir": DIR + "/" + name},
            deferrable=deferrable,
            poll_interval=0.5,
        )

# deferred while the ranks wait for the test: what Airflow records meanwhile
with _dag("px_gated") as px_gated:
    PhalanxStageOperator(
        task_id="gated",
        app="airflow_apps:gated",
        ranks=1,
        outputs=["gated"],
        stage_params={"dir": DIR},
        deferrable=True,
        poll_interval=0.5,
    )

# Python all the way: @task.phalanx functions (by value to the ranks) and a px.Workflow object
wf = px.Workflow("px-python")


@wf.stage(ranks=2, outputs=["squares"], params={"n": 10})
def squares(env):
    n = env.params["n"]
    mine = [i * i for i in range(n) if i % env.world_size == env.rank]
    return {"squares": px.DataFrame.from_arrow(pa.table({"sq": pa.array(mine, pa.int64())}), env)}


with _dag("px_python") as px_python:

    @task.phalanx(ranks=2, poll_interval=0.5)
    def numbers(env, n):
        lo, hi = n * env.rank // env.world_size, n * (env.rank + 1) // env.world_size
        env.log.info("numbers %d..%d", lo, hi - 1)
        return px.DataFrame.from_arrow(pa.table({"x": pa.array(range(lo, hi), pa.int64())}), env)

    @task.phalanx(ranks=1, outputs=["total"], deferrable=True, poll_interval=0.5)
    def total(env, numbers, offset):
        s = sum(numbers.to_arrow().column("x").to_pylist()) + offset
        env.log.info("total %d", s)
        return {"total": px.DataFrame.from_arrow(pa.table({"total": [s]}), env)}

    total(numbers=numbers(n=100), offset=1)
    PhalanxWorkflowOperator(task_id="object", workflow=wf, deferrable=True, poll_interval=0.5)
    PhalanxWorkflowOperator(task_id="object_inline", workflow=wf, deferrable=False)

# the CLI test (`airflow dags test px_cli`): one small stage
with _dag("px_cli") as px_cli:
    PhalanxStageOperator(
        task_id="numbers", app="airflow_apps:numbers", ranks=1, outputs=["numbers"], stage_params={"n": 10}
    )
