#!/usr/bin/env python
"""What running a workflow as an Airflow task costs over ``phalanx run`` of the same workflow.

The example workflow (workflows/etl_to_training.yaml, sized by --rows/--epochs) is run

- with ``phalanx run FILE`` (the command line, as a user runs it: interpreter start included);
- as one ``PhalanxWorkflowOperator`` task through ``dag.test()`` of a real Airflow 3 (a
  temporary AIRFLOW_HOME, SQLite), waiting in the worker, and deferrable (detached driver +
  ``PhalanxRunTrigger``, the trigger run in line by ``dag.test``).

Printed per mode: the task's duration as Airflow records it (first start to end, deferral
included), ``phalanx run``'s wall time, the overhead (task − phalanx run; target ≤ 3 s) and
the ratio; and, for both, the time beyond the run's own (driver start to end, from the run
database): the command's interpreter start, the operator's checks, submission, polling and
manifest.  Medians over --repeat runs, in alternating order.  Airflow's own per-DAG-run
cost (``dag.test`` parsing the DAGs folder, scheduling) is printed apart: it is not the
operator's.

    .venv/bin/python bench/airflow.py [--rows 200000] [--epochs 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this file is bench/airflow.py: its directory, first on sys.path, would shadow the airflow package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "workflows" / "etl_to_training.yaml"

DAG_FILE = """
import datetime
from airflow.sdk import DAG
from phalanx.integrations.airflow import PhalanxWorkflowOperator

with DAG("bench_phalanx", schedule=None, start_date=datetime.datetime(2025, 1, 1), catchup=False,
         default_args={"retries": 0}) as dag:
    for deferrable in (False, True):
        PhalanxWorkflowOperator(task_id="deferrable" if deferrable else "in_worker", workflow=%(workflow)r,
                                set={"stages.generate.params.rows": "{{ dag_run.conf['rows'] }}",
                                     "stages.train.params.epochs": "{{ dag_run.conf['epochs'] }}"},
                                deferrable=deferrable, poll_interval=0.2)
"""


def phalanx_run(rows: int, epochs: int) -> tuple[float, float]:
    """(wall seconds of `phalanx run`, seconds of its run as the run database records them)."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            str(WORKFLOW),
            "--plain",
            f"--set=stages.generate.params.rows={rows}",
            f"--set=stages.train.params.epochs={epochs}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    took = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"phalanx run failed:\n{r.stdout}\n{r.stderr}")
    import re

    run_id = re.search(r"^run (\S+) succeeded", r.stdout, re.M).group(1)
    return took, run_seconds(run_id)


def run_seconds(run_id: str) -> float:
    """How long the phalanx run itself took (its driver's record in the run database)."""
    from phalanx.orchestrator.rundb import RunDB

    run = RunDB().run(run_id)
    return run["ended"] - run["started"]


def airflow_run(dag, rows: int, epochs: int) -> tuple[dict[str, tuple[float, float]], float]:
    """Per task: (seconds from its first start to its end as Airflow records them, seconds of
    its phalanx run); dag.test's wall time."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    t0 = time.perf_counter()
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        dr = dag.test(run_conf={"rows": rows, "epochs": epochs})
    wall = time.perf_counter() - t0
    took = {}
    with create_session() as session:
        for ti in dr.get_task_instances(session=session):
            if ti.state != "success":
                sys.exit(f"task {ti.task_id} {ti.state}")
            starts = [
                h.start_date
                for h in session.query(TaskInstanceHistory).filter_by(
                    dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id
                )
                if h.start_date
            ]
            first = min([ti.start_date, *starts])  # a deferred task starts again when it resumes
            row = session.scalars(
                XComModel.get_many(run_id=ti.run_id, dag_ids=ti.dag_id, task_ids=ti.task_id, key="return_value")
            ).one()
            manifest = XComModel.deserialize_value(row)
            took[ti.task_id] = ((ti.end_date - first).total_seconds(), run_seconds(manifest["run_id"]))
    return took, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="phalanx-bench-airflow-"))
    (home / "dags").mkdir()
    (home / "dags" / "bench_phalanx.py").write_text(DAG_FILE % {"workflow": str(WORKFLOW)})
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "PHALANX_STATE": str(home / "state"),
        }
    )
    try:
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
        sys.path.insert(0, str(home / "dags"))
        import bench_phalanx

        phalanx_run(args.rows, args.epochs)  # warm-up: page cache, store, imports
        airflow_run(bench_phalanx.dag, args.rows, args.epochs)
        cli, tasks, walls = [], {"in_worker": [], "deferrable": []}, []
        for i in range(args.repeat):
            order = (True, False) if i % 2 else (False, True)
            for cli_first in order:
                if cli_first:
                    cli.append(phalanx_run(args.rows, args.epochs))
                else:
                    took, wall = airflow_run(bench_phalanx.dag, args.rows, args.epochs)
                    walls.append(wall)
                    for task, seconds in took.items():
                        tasks[task].append(seconds)
        base = statistics.median(w for w, _ in cli)
        inner = statistics.median(w - r for w, r in cli)
        print(
            f"workflow {WORKFLOW.relative_to(ROOT)}, rows={args.rows:,} epochs={args.epochs}, "
            f"median of {args.repeat} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
        )
        print(
            f"  phalanx run (command line, wall)          {base:7.2f} s   (beyond its run's own time: {inner:+.2f} s)"
        )
        for task, label in (
            ("in_worker", "operator, waiting in the worker"),
            ("deferrable", "operator, deferrable (trigger)"),
        ):
            t = statistics.median(t for t, _ in tasks[task])
            own = statistics.median(t - r for t, r in tasks[task])
            print(
                f"  {label:<41} {t:7.2f} s   overhead {t - base:+6.2f} s   ratio {t / base:5.2f}   "
                f"(beyond its run's own time: {own:+.2f} s)"
            )
        print(
            f"  dag.test of the 2-task DAG (wall, Airflow's own scheduling and parsing included) "
            f"{statistics.median(walls):.2f} s"
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
