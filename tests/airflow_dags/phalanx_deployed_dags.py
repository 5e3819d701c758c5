"""The DAG of tests/test_airflow.py's deployed Airflow (scheduler, triggerer, dag-processor,
api-server: tests/infra/airflow_deploy.py), alone in its DAG folder so that the dag-processor
parses one small file.  ``dir`` comes in as DAG-run conf; the rank waits there for ``go``."""

from __future__ import annotations

import datetime

from airflow.sdk import DAG

from phalanx.integrations.airflow import PhalanxStageOperator

with DAG(
    "px_deployed",
    schedule=None,
    start_date=datetime.datetime(2025, 1, 1),
    catchup=False,
    default_args={"retries": 0},
) as px_deployed:
    PhalanxStageOperator(
        task_id="gated",
        app="airflow_apps:gated",
        ranks=1,
        outputs=["gated"],
        stage_params={"dir": "{{ dag_run.conf['dir'] }}", "wait_s": 240},
        deferrable=True,
        poll_interval=0.5,
    )
