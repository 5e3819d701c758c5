"""DAGs of tests/multisite/test_entry_points.py: one workflow's stages on two sites, "hpc" and
"cloud" (site files the test writes, found by name through $PHALANX_SITE_PATH; each its own
store root), from Airflow — a task per stage, and the whole workflow as one task."""

from __future__ import annotations

import datetime

import apps
from airflow.sdk import DAG

import phalanx as px
from phalanx.integrations.airflow import PhalanxStageOperator, PhalanxWorkflowOperator

START = datetime.datetime(2025, 1, 1)
ROWS, SEED = 4000, 5


def _dag(dag_id: str) -> DAG:
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args={"retries": 0})


# a task per stage: tx sealed on hpc; two tasks on cloud read it (it crosses once)
with _dag("px_multisite_tasks") as px_multisite_tasks:
    generate = PhalanxStageOperator(
        task_id="generate",
        site="hpc",
        app="apps:wf_generate",
        ranks=2,
        outputs=["tx"],
        stage_params={"rows": ROWS, "seed": SEED},
    )
    totals = PhalanxStageOperator(
        task_id="totals",
        site="cloud",
        app="apps:wf_totals",
        ranks=3,
        inputs={"tx": {"dataset": generate.output["tx"], "by": ["user"]}},
        outputs=["totals"],
    )
    again = PhalanxStageOperator(
        task_id="again",
        site="cloud",
        app="apps:wf_totals",
        ranks=1,
        inputs={"tx": generate.output["tx"]},
        outputs=["totals_again"],
        stage_params={"output": "totals_again"},
    )
    generate >> totals >> again

# the whole workflow as one task: a workflow file (its stages' sites beside it) and a px.Workflow
across = px.Workflow("py-across", site="hpc")
across.add(px.stage(apps.wf_generate, name="generate", ranks=2, params={"rows": ROWS, "seed": SEED}, outputs=["tx"]))
across.add(
    px.stage(
        apps.wf_totals,
        name="totals",
        ranks=3,
        site="cloud",
        inputs={"tx": {"dataset": "tx", "by": ["user"]}},
        outputs=["totals"],
    )
)

with _dag("px_multisite_workflow") as px_multisite_workflow:
    PhalanxWorkflowOperator(task_id="file", workflow="{{ dag_run.conf['workflow'] }}", deferrable=False)
    PhalanxWorkflowOperator(task_id="object", workflow=across, deferrable=False)
