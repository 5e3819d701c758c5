"""phalanx as an Airflow 3 provider (``pip install 'phalanx[airflow]'``; docs/airflow.md).

- ``PhalanxWorkflowOperator``: a workflow (YAML file or ``px.Workflow``) as one task;
- ``PhalanxStageOperator``: one BSP stage (an app on a gang) as one task, inputs from upstream
  tasks' manifests;
- ``@task.phalanx``: a TaskFlow function run on every rank;
- ``PhalanxRunTrigger``: what the deferrable operators wait on in the triggerer.

Registered through the ``apache_airflow_provider`` entry point (``get_provider_info``).  This
module imports nothing from Airflow until one of those names is used, so Airflow can read the
provider's description cheaply and ``import phalanx`` never imports Airflow.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PhalanxRunLink",
    "PhalanxRunTrigger",
    "PhalanxStageOperator",
    "PhalanxWorkflowOperator",
    "get_provider_info",
    "phalanx_task",
]

_LAZY = {
    "PhalanxWorkflowOperator": ".operators",
    "PhalanxStageOperator": ".operators",
    "PhalanxRunLink": ".operators",
    "PhalanxRunTrigger": ".triggers",
    "phalanx_task": ".decorators",
}


def get_provider_info() -> dict[str, Any]:
    """What Airflow's providers manager reads (the ``apache_airflow_provider`` entry point)."""
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed distribution's, not `phalanx.__version__`: integrations never import the root
        __version__ = version("phalanx")
    except PackageNotFoundError:
        __version__ = "0+unknown"

    return {
        "package-name": "phalanx",
        "name": "phalanx",
        "description": "Gang-scheduled BSP dataframe workflows (phalanx) as Airflow tasks: workflow and "
        "stage operators, a deferrable run trigger and the @task.phalanx decorator.",
        "versions": [__version__],
        "integrations": [{"integration-name": "phalanx", "tags": ["software"]}],
        "operators": [{"integration-name": "phalanx", "python-modules": ["phalanx.integrations.airflow.operators"]}],
        "triggers": [{"integration-name": "phalanx", "python-modules": ["phalanx.integrations.airflow.triggers"]}],
        "extra-links": ["phalanx.integrations.airflow.operators.PhalanxRunLink"],
        "task-decorators": [{"name": "phalanx", "class-name": "phalanx.integrations.airflow.decorators.phalanx_task"}],
    }


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
