"""The ETL → features → training example (workflows/etl_to_training.yaml) as Airflow DAGs.

Two DAGs of the same pipeline, each run two ways side by side:

- one Airflow task per phalanx stage (``PhalanxStageOperator``): generate → features → train →
  report, each a one-stage phalanx run reading the previous task's datasets through its XCom
  manifest (``generate.output["transactions"]``);
- the whole workflow file as one task (``PhalanxWorkflowOperator``).

``phalanx_etl`` waits for its runs in the worker (``deferrable`` defaults to Airflow's
``[operators] default_deferrable``); ``phalanx_etl_deferrable`` starts them with detached
drivers and defers to ``PhalanxRunTrigger`` (needs a triggerer; no worker slot is held).
DAG params ``rows`` and ``epochs`` size the run::

    export AIRFLOW_HOME=~/airflow-phalanx AIRFLOW__CORE__DAGS_FOLDER=$PWD/workflows/airflow
    airflow db migrate
    airflow dags test phalanx_etl -c '{"rows": 20000, "epochs": 1}'
    phalanx status RUN_ID                      # each task's log names its run
"""

from __future__ import annotations

import datetime
from pathlib import Path

from airflow.sdk import DAG, Param

from phalanx.integrations.airflow import PhalanxStageOperator, PhalanxWorkflowOperator

WORKFLOW = Path(__file__).resolve().parent.parent / "etl_to_training.yaml"
APPS = "phalanx.examples.synthetic"


def make_dag(dag_id: str, deferrable: bool | None = None) -> DAG:
    with DAG(
        dag_id,
        schedule=None,
        start_date=datetime.datetime(2025, 1, 1),
        catchup=False,
        tags=["phalanx", "example"],
        params={"rows": Param(200_000, type="integer", minimum=1), "epochs": Param(3, type="integer", minimum=1)},
        # an Airflow retry resumes the task's phalanx run: sealed outputs are reused
        default_args={"retries": 1, "retry_delay": datetime.timedelta(seconds=10)},
        doc_md=__doc__,
    ) as dag:
        mode = {"deferrable": deferrable, "poll_interval": 1.0}

        # one task per stage ----------------------------------------------------------------
        generate = PhalanxStageOperator(
            task_id="generate",
            app=f"{APPS}:generate",
            ranks=2,
            stage_params={"rows": "{{ params.rows }}", "seed": 7},
            outputs=["transactions", "users"],
            **mode,
        )
        features = PhalanxStageOperator(
            task_id="features",
            app=f"{APPS}:features",
            ranks=2,
            inputs={
                "tx": generate.output["transactions"],  # rows balanced over the ranks
                "users": {"dataset": generate.output["users"], "by": ["user_id"]},
            },
            outputs=["features"],
            retries_in_run=1,
            **mode,
        )
        train = PhalanxStageOperator(
            task_id="train",
            kind="torch",
            app=f"{APPS}:train",
            ranks=2,
            inputs={"data": {"dataset": features.output["features"], "shuffle": "global"}},
            stage_params={"epochs": "{{ params.epochs }}", "batch_size": 1024},
            outputs=["train_metrics"],
            **mode,
        )
        report = PhalanxStageOperator(task_id="report", command=["python", "-c", "print('done')"], ranks=1, **mode)
        train >> report

        # the same pipeline as one task -------------------------------------------------------
        PhalanxWorkflowOperator(
            task_id="etl_to_training",
            workflow=str(WORKFLOW),
            set={
                "stages.generate.params.rows": "{{ params.rows }}",
                "stages.train.params.epochs": "{{ params.epochs }}",
            },
            **mode,
        )
    return dag


etl = make_dag("phalanx_etl")
etl_deferrable = make_dag("phalanx_etl_deferrable", deferrable=True)
