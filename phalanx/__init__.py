"""phalanx: gang-scheduled BSP dataframe stages over Arrow, Gloo and MPI."""

from .errors import GangError, MissingDependencyError, PhalanxError, RankError, RankFailure
from .gang import Gang, set_site_loader
from .operators import DataFrame, GroupBy, read_csv, read_parquet
from .runtime.env import BSPEnv
from .store import DatasetInfo, Store

__version__ = "0.1.0"


def _load_site(name: str):
    """px.Gang(site=NAME): site files are the orchestrator's, imported on first use."""
    from .orchestrator.validate import load_site

    return load_site(name)


set_site_loader(_load_site)

__all__ = [
    "BSPEnv", "DataFrame", "DatasetInfo", "Store", "Gang", "GroupBy", "read_csv", "read_parquet", "GangError", "MissingDependencyError", "PhalanxError", "RankError",
    "RankFailure", "RunHandle", "Workflow", "run", "stage", "submit", "__version__",
]


_LAZY = {"Workflow": ".orchestrator.api", "run": ".orchestrator.api", "stage": ".orchestrator.api",
         "submit": ".orchestrator.api", "RunHandle": ".orchestrator.handle"}


def __getattr__(name: str):
    # px.ml imports torch, the workflow API pydantic: load them on first use so that
    # ``import phalanx`` (every rank does) stays light
    import importlib

    if name == "ml":
        return importlib.import_module(".ml", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
