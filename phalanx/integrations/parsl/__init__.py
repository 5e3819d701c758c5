"""phalanx from Parsl (``pip install 'phalanx[parsl]'``): BSP apps on gangs as Parsl apps.

```python
import parsl
from phalanx.integrations.parsl import bsp_app, config_from_site

parsl.load(config_from_site("local"))             # HTEX on 127.0.0.1: apps drive local gangs

@bsp_app(ranks=2, outputs=["totals"])
def totals(env, tx):                              # tx: this rank's share of a dataset
    return {"totals": tx.groupby("user").agg({"amount": "sum"})}

fut = totals(tx_ref)                              # an AppFuture
fut.result().outputs["totals"].read()             # a DatasetRef: the data stayed in the store
```

- ``bsp_app(ranks=N, site=None, communicator=..., outputs=[...], persistent=False)``;
- ``config_from_site(site, mode="site" | "mpi")``: a Parsl ``Config`` (HTEX, or an
  ``MPIExecutor`` on SLURM or this machine);
- ``workflow_app(wf, site)`` / ``px.Workflow.as_parsl_app(site)``: a whole workflow as one app;
- ``DatasetRef``, ``BSPResult``, ``WorkflowResult``, ``output(future, name)``.

Ranks import only ``_rank`` and ``_refs`` of this package, never Parsl: this module's names are
loaded on first use.  See docs/parsl.md.
"""

from __future__ import annotations

import importlib
from concurrent.futures import Future
from typing import Any

from ._refs import BSPResult, DatasetRef, WorkflowResult

_LAZY = {
    "bsp_app": "._apps",
    "BSPApp": "._apps",
    "BSPTask": "._apps",
    "ParslRankError": "._apps",
    "ResourceSpecError": "._apps",
    "resource_specification": "._apps",
    "check_resource_specification": "._apps",
    "close_warm_gangs": "._apps",
    "warm_gang_info": "._apps",
    "config_from_site": "._config",
    "mpiexec_dir": "._config",
    "slurm_provider": "._config",
    "workflow_app": "._workflow",
    "WorkflowFailed": "._workflow",
    "PrefixLauncher": "._launcher",
}

__all__ = [
    "BSPApp",
    "BSPResult",
    "DatasetRef",
    "ParslRankError",
    "ResourceSpecError",
    "WorkflowFailed",
    "WorkflowResult",
    "bsp_app",
    "check_resource_specification",
    "close_warm_gangs",
    "config_from_site",
    "output",
    "resource_specification",
    "workflow_app",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def output(result: Any, name: str) -> Any:
    """Output ``name`` of an app: a ``DatasetRef`` for a result, a future of one for a future
    (another app's argument: Parsl waits for it)."""
    if isinstance(result, (BSPResult, WorkflowResult)):
        return _pick(result, name)
    if not isinstance(result, Future):
        raise TypeError(f"output(): a bsp_app/workflow result or its future, not {type(result).__name__}")
    picked: Future = Future()

    def done(fut: Future) -> None:
        try:
            picked.set_result(_pick(fut.result(), name))
        except BaseException as exc:
            picked.set_exception(exc)

    result.add_done_callback(done)
    return picked


def _pick(result: Any, name: str) -> DatasetRef:
    if not isinstance(result, (BSPResult, WorkflowResult)):
        raise TypeError(f"output({name!r}): the app gave {type(result).__name__}, not a bsp_app/workflow result")
    if name not in result.outputs:
        raise KeyError(f"output {name!r}: the app's outputs are {sorted(result.outputs)}")
    return result.outputs[name]
