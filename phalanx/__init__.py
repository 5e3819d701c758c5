"""phalanx: gang-scheduled BSP dataframe stages exchanging Arrow data, a store between stages, PyTorch training."""

import sys

from .runtime import threads as _threads

if _threads.is_rank():  # before polars is imported below: it sizes its pool at import
    _threads.apply()

from .errors import GangError, MissingDependencyError, PhalanxError, RankError, RankFailure
from .gang import Gang, set_notebook, set_site_loader
from .operators import DataFrame, GroupBy, concat, read_csv, read_parquet
from .runtime.env import BSPEnv
from .store import DatasetInfo, Store

__version__ = "0.1.0"


def _load_site(name: str):
    """px.Gang(site=NAME): site files are the orchestrator's, imported on first use."""
    from .orchestrator.loading import load_site

    return load_site(name)


set_site_loader(_load_site)


class _Notebook:
    """What px.Gang and run handles ask of Jupyter (``_repr_html_``, live views of runs, rank
    output grouped by rank): phalanx.integrations.jupyter's ``hooks``, imported on first use.
    The live ones do nothing outside a Jupyter kernel, without importing anything: ``import
    phalanx`` (every rank does) never imports IPython or ipywidgets."""

    _KERNEL_ONLY = {"echo", "run_view", "handle_view", "live_runs"}

    def __getattr__(self, name: str):
        if name in self._KERNEL_ONLY and "ipykernel" not in sys.modules:
            return _nothing
        from .integrations.jupyter import hooks

        return getattr(hooks, name)


def _nothing(*args, **kwargs) -> None:
    return None


_NOTEBOOK = _Notebook()
set_notebook(_NOTEBOOK)  # run handles get it with the workflow API (``__getattr__`` below)


def load_ipython_extension(ipython) -> None:
    """``%load_ext phalanx``: the ``%%px`` and ``%px_gang`` magics (phalanx.integrations.jupyter,
    imported only now)."""
    from .integrations.jupyter import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .integrations.jupyter import unload_ipython_extension as unload

    unload(ipython)


__all__ = [
    "BSPEnv",
    "DataFrame",
    "DatasetInfo",
    "Store",
    "Gang",
    "GroupBy",
    "concat",
    "read_csv",
    "read_parquet",
    "GangError",
    "MissingDependencyError",
    "PhalanxError",
    "RankError",
    "RankFailure",
    "RunHandle",
    "Workflow",
    "run",
    "stage",
    "submit",
    "__version__",
]


_LAZY = {
    "Workflow": ".orchestrator.api",
    "run": ".orchestrator.api",
    "stage": ".orchestrator.api",
    "submit": ".orchestrator.api",
    "RunHandle": ".orchestrator.handle",
}


def __getattr__(name: str):
    # px.ml imports torch, the workflow API pydantic: load them on first use so that
    # ``import phalanx`` (every rank does) stays light
    import importlib

    if name == "ml":
        return importlib.import_module(".ml", __name__)
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        # run handles render in notebooks too (the workflow API makes them)
        importlib.import_module(".orchestrator.handle", __name__).set_notebook(_NOTEBOOK)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """What is here plus what ``__getattr__`` loads on first use (``dir(px)``, tab completion),
    without loading it."""
    return sorted({*globals(), *_LAZY, "ml"})
