"""phalanx: gang-scheduled BSP dataframe stages over Arrow, Gloo and MPI."""

from .errors import GangError, MissingDependencyError, PhalanxError, RankError, RankFailure
from .gang import Gang
from .operators import DataFrame, GroupBy, read_csv, read_parquet
from .runtime.env import BSPEnv
from .store import DatasetInfo, Store

__version__ = "0.1.0"

__all__ = [
    "BSPEnv", "DataFrame", "DatasetInfo", "Store", "Gang", "GroupBy", "read_csv", "read_parquet", "GangError", "MissingDependencyError", "PhalanxError", "RankError",
    "RankFailure", "__version__",
]


def __getattr__(name: str):
    # px.ml imports torch: load it on first use so that ``import phalanx`` stays light
    if name == "ml":
        import importlib

        return importlib.import_module(".ml", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
