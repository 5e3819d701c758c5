"""``bsp_app``: a BSP function on a gang of ranks as one Parsl app.

The Parsl task (``BSPTask``, run by a Parsl worker) is the gang's driver.  Two placements:

- ``mpi``: the app runs on an ``MPIExecutor``; the worker starts the ranks with the launcher
  prefix Parsl composed for the task's nodes (``$PARSL_MPI_PREFIX``) running phalanx's rank
  entry point, and the task's ``parsl_resource_specification`` is derived from ``ranks=`` and
  checked before submission;
- ``site``: the app runs on any other executor (HTEX, threads); the worker starts a gang with
  phalanx's own executor for ``site`` (local processes, a SLURM job, Ray...), and with
  ``persistent=True`` keeps it warm for the next app of the same shape in that worker.

Only small things travel through Parsl: the pickled function, its arguments (dataset references,
parameters) and per-rank results; outputs stay in the store and come back as ``DatasetRef``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import PhalanxError, RankError
from ...runtime.envvars import ENV_PARSL_DRIVER_HOST, ENV_PARSL_RENDEZVOUS
from ._refs import BSPResult, DatasetRef, new_session, single_output

PLACEMENTS = ("auto", "mpi", "site")
# which of the prefixes Parsl composes for an MPI task starts the ranks (None: the executor's own)
PREFIXES = {
    None: "PARSL_MPI_PREFIX",
    "srun": "PARSL_SRUN_PREFIX",
    "mpiexec": "PARSL_MPIEXEC_PREFIX",
    "aprun": "PARSL_APRUN_PREFIX",
}
_SPEC_KEYS = ("num_nodes", "ranks_per_node", "num_ranks", "launcher_options")


class ResourceSpecError(PhalanxError, ValueError):
    """A ``parsl_resource_specification`` that Parsl's MPIExecutor would fail or hang on."""


class ParslRankError(RankError):
    """``px.RankError`` that survives Parsl's pickling (a ``RankError`` rebuilt from its message
    would not): the failing rank's traceback, every failure, the stopped ranks."""

    def __reduce__(self):
        return (ParslRankError, (self.failures, self.stopped))


# ---- resource specifications (MPIExecutor) -------------------------------------------------------
def resource_specification(ranks: int, ranks_per_node: int | None = None) -> dict[str, Any]:
    """``{"num_nodes", "ranks_per_node", "num_ranks"}`` for a gang of ``ranks`` with at most
    ``ranks_per_node`` on a node (default: all on one node)."""
    _count(ranks, "ranks")
    per_node = ranks if ranks_per_node is None else _count(ranks_per_node, "ranks_per_node")
    per_node = min(per_node, ranks)
    return {"num_nodes": math.ceil(ranks / per_node), "ranks_per_node": per_node, "num_ranks": ranks}


def check_resource_specification(
    spec: dict[str, Any], ranks: int, nodes_per_block: int | None = None, cores_per_node: int | None = None
) -> dict[str, Any]:
    """The spec as Parsl gets it, or ``ResourceSpecError`` saying what is wrong — before the
    task is submitted: Parsl's MPIExecutor hangs forever on a spec without ``num_nodes``
    (parsl issue 3427), writes ``-ppn 1.5`` when ``num_ranks`` does not divide by
    ``num_nodes``, and keeps a task asking more nodes than a block has waiting forever; more
    ranks on a node than the block holds CPUs there make srun refuse the step."""
    if not isinstance(spec, dict) or not spec:
        raise ResourceSpecError(f"parsl_resource_specification must be a non-empty dict, got {spec!r}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ResourceSpecError(
            f"parsl_resource_specification: unknown keys {unknown}; an MPIExecutor takes {', '.join(_SPEC_KEYS)}"
        )
    if "num_nodes" not in spec:
        raise ResourceSpecError(
            f"parsl_resource_specification {spec} has no 'num_nodes': Parsl's MPIExecutor accepts such a "
            "spec and then never returns the task (parsl issue 3427). Give num_nodes and ranks_per_node, "
            "or leave the spec to bsp_app(ranks=N, ranks_per_node=P)"
        )
    nodes = _count(spec["num_nodes"], "parsl_resource_specification num_nodes")
    num_ranks = _count(spec.get("num_ranks", ranks), "parsl_resource_specification num_ranks")
    per_node = spec.get("ranks_per_node")
    per_node = (
        math.ceil(num_ranks / nodes)
        if per_node is None
        else _count(per_node, "parsl_resource_specification ranks_per_node")
    )
    if "num_ranks" not in spec:
        num_ranks = nodes * per_node
    if num_ranks != ranks:
        raise ResourceSpecError(
            f"parsl_resource_specification asks {num_ranks} ranks ({spec}); the app has ranks={ranks}"
        )
    if num_ranks > nodes * per_node:
        raise ResourceSpecError(
            f"parsl_resource_specification: {num_ranks} ranks do not fit {nodes} node(s) x {per_node} ranks_per_node"
        )
    if nodes_per_block is not None and nodes > nodes_per_block:
        raise ResourceSpecError(
            f"parsl_resource_specification asks {nodes} nodes; the executor's blocks have "
            f"{nodes_per_block} (provider nodes_per_block): the task would wait forever"
        )
    if cores_per_node is not None and per_node > cores_per_node:
        raise ResourceSpecError(
            f"parsl_resource_specification asks {per_node} ranks per node; the executor's "
            f"blocks hold {cores_per_node} CPUs per node (provider cores_per_node): give "
            f"bsp_app(ranks_per_node={cores_per_node}) or a larger block"
        )
    out: dict[str, Any] = {"num_nodes": nodes, "ranks_per_node": per_node, "num_ranks": num_ranks}
    if spec.get("launcher_options"):
        out["launcher_options"] = str(spec["launcher_options"])
    return out


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < 1:
        raise ResourceSpecError(f"{what} must be an integer ≥ 1, got {value!r}")
    return int(value)


# ---- the task a Parsl worker runs --------------------------------------------------------------
class BSPTask:
    """What Parsl runs: drive one gang for one app call (picklable, small)."""

    def __init__(
        self,
        fn_pickle: bytes,
        name: str,
        ranks: int,
        placement: str,
        *,
        outputs: Sequence[str],
        communicator: str | None,
        site: Any,
        session: str | None,
        store: str | None,
        metadata: str | None,
        persistent: bool,
        timeout: float | None,
        echo: bool,
        driver_host: str | None,
        start_timeout: float | None,
        launcher: str | None = None,
    ):
        self.fn_pickle, self.name, self.ranks, self.placement = fn_pickle, name, ranks, placement
        self.outputs, self.communicator, self.site = list(outputs), communicator, site
        self.session, self.store, self.metadata = session, store, metadata
        self.persistent, self.timeout, self.echo = persistent, timeout, echo
        self.driver_host, self.start_timeout, self.launcher = driver_host, start_timeout, launcher
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, parsl_resource_specification: Any = {}, **kwargs: Any) -> BSPResult:  # noqa: B006
        from ._rank import RankApp

        t0 = time.perf_counter()
        args = tuple(single_output(a, f"{self.name} argument {i}") for i, a in enumerate(args))
        kwargs = {k: single_output(v, f"{self.name} argument {k!r}") for k, v in kwargs.items()}
        session = self.session or new_session(self.name)
        store = self._store(session)
        app = RankApp(self.fn_pickle, self.name, self.outputs, session)
        try:
            if self.placement == "mpi":
                per_rank, gang_id = self._run_mpi(app, store, args, kwargs)
            else:
                per_rank, gang_id = self._run_site(app, store, args, kwargs)
        except RankError as exc:
            raise ParslRankError(exc.failures, exc.stopped) from None
        outputs = {name: DatasetRef.of(store, name) for name in self.outputs}
        return BSPResult(per_rank, outputs, session, gang_id, self.placement, time.perf_counter() - t0)

    def _site_model(self) -> Any:
        if self.site is None or hasattr(self.site, "create_executor"):
            return self.site
        from ...orchestrator.loading import load_site

        return load_site(str(self.site))

    def _store(self, session: str):
        from ...store import Store

        root, metadata = self.store, self.metadata
        site = self._site_model()
        if site is not None:
            root = root or site.store.root
            metadata = metadata or site.store.metadata
        return Store(root, session, metadata=metadata)

    def _run_mpi(self, app: Any, store: Any, args: tuple, kwargs: dict) -> tuple[list, str]:
        from ...gang import Gang
        from ._launcher import PrefixLauncher

        prefix = os.environ.get(PREFIXES[self.launcher], "")
        given = os.environ.get("PARSL_NUM_RANKS")
        if given is not None and given.isdigit() and int(given) != self.ranks:
            raise PhalanxError(
                f"{self.name}: Parsl gave this task {given} ranks (PARSL_NUM_RANKS); the app has ranks={self.ranks}"
            )
        # no site here: config_from_site exported the site's driver host and rendezvous to the worker
        gang = Gang(
            self.ranks,
            executor=PrefixLauncher(prefix, echo=self.echo),
            communicator=self.communicator,
            store=store.for_session("parsl"),
            echo=self.echo,
            control_host=self.driver_host or os.environ.get(ENV_PARSL_DRIVER_HOST),
            rendezvous=os.environ.get(ENV_PARSL_RENDEZVOUS),
            start_timeout=self.start_timeout,
        )
        try:
            return gang.run(app, *args, timeout=self.timeout, **kwargs), gang.gang_id
        finally:
            gang.close()

    def _run_site(self, app: Any, store: Any, args: tuple, kwargs: dict) -> tuple[list, str]:
        if not self.persistent:
            gang = self._new_gang(store)
            try:
                return gang.run(app, *args, timeout=self.timeout, **kwargs), gang.gang_id
            finally:
                gang.close()
        with _warm_lock:  # one app at a time on the warm gang (thread executors share the process)
            gang = _warm_gang(self._key(store), lambda: self._new_gang(store))
            try:
                return gang.run(app, *args, timeout=self.timeout, **kwargs), gang.gang_id
            except BaseException:
                _drop_warm(gang)  # a failed run tore the gang down: the next app starts a fresh one
                raise

    def _new_gang(self, store: Any) -> Any:
        from ...gang import Gang

        site = self._site_model()
        return Gang(
            self.ranks,
            site=site,
            communicator=self.communicator,
            store=store.for_session("parsl"),
            echo=self.echo,
            control_host=self.driver_host,
            start_timeout=self.start_timeout,
        )

    def _key(self, store: Any) -> tuple:
        site = self.site
        site_id = getattr(site, "name", None) if hasattr(site, "create_executor") else site
        return (
            str(site_id),
            self.ranks,
            self.communicator,
            str(store.root),
            store.meta.url,
            self.driver_host,
            os.environ.get("PARSL_WORKER_BLOCK_ID", ""),
        )


# The warm gang of this process (a Parsl worker of one block): one at a time, so a worker never
# holds more ranks than its last app asked for.
_warm_lock = threading.RLock()
_warm: dict[str, Any] = {}


def _warm_gang(key: tuple, make: Callable[[], Any]) -> Any:
    current = _warm.get("gang")
    if current is not None:
        old_key, gang = current
        if old_key == key and gang.running and gang.health() is None:
            return gang
        _drop_warm(gang)
    gang = make()
    _warm["gang"] = (key, gang)
    return gang


def _drop_warm(gang: Any) -> None:
    current = _warm.get("gang")
    if current is not None and current[1] is gang:
        del _warm["gang"]
    gang.close()


def close_warm_gangs() -> int:
    """Close this process's warm gang (a Parsl worker's); how many were closed."""
    with _warm_lock:
        current = _warm.pop("gang", None)
        if current is None:
            return 0
        current[1].close()
        return 1


def warm_gang_info() -> dict[str, Any] | None:
    """The warm gang of this process: its id and rank pids (for tests and benchmarks)."""
    with _warm_lock:
        current = _warm.get("gang")
        if current is None or not current[1].running:
            return None
        gang = current[1]
        return {"gang_id": gang.gang_id, "pids": list(gang.pids), "ranks": gang.world_size}


# ---- the decorator -------------------------------------------------------------------------------
class BSPApp:
    """A BSP function as a Parsl app: calling it submits one gang run and returns an ``AppFuture``
    whose result is a ``BSPResult`` (per-rank results, ``outputs``: dataset references)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        ranks: int,
        site: Any = None,
        communicator: str | None = None,
        outputs: Sequence[str] = (),
        placement: str = "auto",
        persistent: bool = False,
        ranks_per_node: int | None = None,
        session: str | None = None,
        store: str | Path | None = None,
        metadata: str | None = None,
        executors: str | Sequence[str] = "all",
        timeout: float | None = None,
        echo: bool = False,
        driver_host: str | None = None,
        start_timeout: float | None = None,
        cache: bool = False,
        name: str | None = None,
        launcher: str | None = None,
    ):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        _count(ranks, "ranks")
        if ranks_per_node is not None:
            _count(ranks_per_node, "ranks_per_node")
        if launcher not in PREFIXES:
            raise ValueError(
                f"launcher must be one of srun, mpiexec, aprun (default: the MPIExecutor's "
                f"mpi_launcher), got {launcher!r}"
            )
        if placement == "mpi" and persistent:
            raise ValueError(
                "persistent=True keeps a gang of phalanx's site executor warm; on an MPIExecutor "
                "(placement='mpi') every task gets its nodes anew"
            )
        if placement == "mpi" and site is not None:
            raise ValueError(
                "site= places the ranks with phalanx's executor for that site (placement='site'); "
                "placement='mpi' starts them with the MPIExecutor's $PARSL_MPI_PREFIX"
            )
        if communicator is not None:
            from ...runtime.comm import communicators

            if communicator not in communicators.names():
                raise ValueError(
                    f"communicator must be one of {', '.join(communicators.names())}, got {communicator!r}"
                )
        for out in outputs:
            from ...orchestrator.models import check_name

            check_name(out, "dataset name")
        if session is not None:
            from ...store.store import _check_session

            _check_session(session)
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", "bsp_app"))
        self.ranks, self.site, self.communicator = ranks, site, communicator
        self.outputs, self.placement, self.persistent = list(outputs), placement, persistent
        self.ranks_per_node, self.session = ranks_per_node, session
        self.store = os.fspath(store) if store is not None else None
        self.metadata, self.timeout, self.echo = metadata, timeout, echo
        self.driver_host, self.start_timeout, self.cache = driver_host, start_timeout, cache
        self.executors, self.launcher = executors, launcher
        self._fn_pickle: bytes | None = None  # at the first call: the module's names all exist then
        self.__name__ = self.__qualname__ = self.name
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<phalanx bsp_app {self.name} ranks={self.ranks}>"

    def resource_specification(self, cores_per_node: int | None = None) -> dict[str, Any]:
        """The ``parsl_resource_specification`` an MPIExecutor task of this app gets: at most
        ``ranks_per_node`` (default: the block's ``cores_per_node``, else all) on a node."""
        return resource_specification(self.ranks, self.ranks_per_node or cores_per_node)

    def placement_on(self, dfk: Any = None) -> tuple[str, list[str]]:
        """(placement, executor labels) of a call on ``dfk`` (default: the loaded one)."""
        from parsl.dataflow.dflow import DataFlowKernelLoader

        dfk = dfk or DataFlowKernelLoader.dfk()
        known = [label for label in dfk.executors if label != "_parsl_internal"]
        labels = (
            known
            if self.executors == "all"
            else [self.executors]
            if isinstance(self.executors, str)
            else list(self.executors)
        )
        missing = [label for label in labels if label not in dfk.executors]
        if missing:
            raise ValueError(f"{self.name}: no executor {missing} in the loaded Parsl config (it has {known})")
        mpi = {label: _is_mpi(dfk.executors[label]) for label in labels}
        placement = self.placement
        if placement == "auto":
            if self.site is not None:
                placement = "site"
            elif all(mpi.values()):
                placement = "mpi"
            elif not any(mpi.values()):
                placement = "site"
            else:
                raise ValueError(
                    f"{self.name}: executors {labels} mix MPIExecutors "
                    f"({[k for k, v in mpi.items() if v]}) and others: name one kind with "
                    "bsp_app(executors=[LABEL]) or placement="
                )
        if placement == "mpi" and not all(mpi.values()):
            raise ValueError(
                f"{self.name}: placement 'mpi' needs MPIExecutors; {[k for k, v in mpi.items() if not v]} are not"
            )
        if placement == "site" and any(mpi.values()):
            raise ValueError(
                f"{self.name}: the ranks are placed by phalanx's executor for the site, which an "
                f"MPIExecutor's task ({[k for k, v in mpi.items() if v]}) does not do: give "
                "bsp_app(executors=[an HTEX or thread executor's label]) or placement='mpi'"
            )
        return placement, labels

    def __call__(self, *args: Any, parsl_resource_specification: dict | None = None, **kwargs: Any):
        from parsl.app.python import PythonApp
        from parsl.dataflow.dflow import DataFlowKernelLoader

        dfk = DataFlowKernelLoader.dfk()
        placement, labels = self.placement_on(dfk)
        extra: dict[str, Any] = {}
        if placement == "mpi":
            if self.persistent:
                raise ValueError(
                    f"{self.name}: persistent=True needs placement 'site' (an HTEX or thread "
                    "executor); an MPIExecutor task gets its nodes anew"
                )
            providers = [
                p for p in (getattr(dfk.executors[label], "provider", None) for label in labels) if p is not None
            ]
            nodes = min((p.nodes_per_block for p in providers if getattr(p, "nodes_per_block", None)), default=None)
            cores = min((p.cores_per_node for p in providers if getattr(p, "cores_per_node", None)), default=None)
            spec = (
                parsl_resource_specification
                if parsl_resource_specification is not None
                else resource_specification(self.ranks, self.ranks_per_node or cores)
            )
            extra["parsl_resource_specification"] = check_resource_specification(dict(spec), self.ranks, nodes, cores)
        elif parsl_resource_specification:
            extra["parsl_resource_specification"] = parsl_resource_specification
        if self._fn_pickle is None:
            from ...runtime.pickling import dumps

            # by value where the module's name is this app (the usual decorator): ranks need not
            # import the module that defines it, and globals it uses are the module's as of now
            self._fn_pickle = dumps(self.fn)  # keeping the app's file, lines and source for tracebacks
        task = BSPTask(
            self._fn_pickle,
            self.name,
            self.ranks,
            placement,
            outputs=self.outputs,
            communicator=self.communicator,
            site=self.site if placement == "site" else None,
            session=self.session,
            store=self.store,
            metadata=self.metadata,
            persistent=self.persistent,
            timeout=self.timeout,
            echo=self.echo,
            driver_host=self.driver_host,
            start_timeout=self.start_timeout,
            launcher=self.launcher,
        )
        if placement == "site" and task.site is None:
            task.site = "local"
        app = PythonApp(task, data_flow_kernel=dfk, executors=labels, cache=self.cache)
        return app(*args, **extra, **kwargs)


def _is_mpi(executor: Any) -> bool:
    return bool(getattr(executor, "enable_mpi_mode", False))


def _nodes_per_block(executor: Any) -> int | None:
    provider = getattr(executor, "provider", None)
    return getattr(provider, "nodes_per_block", None)


def bsp_app(
    fn: Callable[..., Any] | None = None,
    *,
    ranks: int,
    site: Any = None,
    communicator: str | None = None,
    outputs: Sequence[str] = (),
    placement: str = "auto",
    persistent: bool = False,
    ranks_per_node: int | None = None,
    session: str | None = None,
    store: str | Path | None = None,
    metadata: str | None = None,
    executors: str | Sequence[str] = "all",
    timeout: float | None = None,
    echo: bool = False,
    driver_host: str | None = None,
    start_timeout: float | None = None,
    cache: bool = False,
    launcher: str | None = None,
) -> Any:
    """Turn ``fn(env, *args, **kwargs)`` into a Parsl app that runs it on a gang of ``ranks``.

    ``app(*args, **kwargs)`` returns an ``AppFuture`` whose result is a ``BSPResult``: one value
    per rank (what ``fn`` returned, less the frames it sealed) and ``outputs`` — a
    ``DatasetRef`` per dataset in ``outputs``, sealed in a store session of the call's own
    (``session=`` fixes one).  ``fn`` seals them by returning ``{name: frame}`` (or the frame of
    its only output) or calling ``env.output(name, frame)``.  Arguments that are
    ``DatasetRef``s, or results/futures of other apps with one output, arrive on every rank as
    that rank's share of the dataset (a ``px.DataFrame``); nothing else of the data passes
    through Parsl.

    Placement (``placement="auto"``): on an ``MPIExecutor`` the ranks are started by
    ``$PARSL_MPI_PREFIX`` (``launcher="srun"``, ``"mpiexec"`` or ``"aprun"``: that prefix of the
    ones Parsl composes; the task's ``parsl_resource_specification`` is derived from
    ``ranks``/``ranks_per_node`` and checked before submission); on any other executor by
    phalanx's executor for ``site`` (default ``"local"``), and ``persistent=True`` keeps that gang
    warm in the Parsl worker for the next app of the same shape.  ``communicator``: ``gloo``
    (default) or ``mpi`` (mpi4py; an MPI launcher must start the ranks).  ``timeout``: seconds
    the gang may run the app; ``echo``: copy the ranks' lines to the worker's stderr.
    """

    def wrap(f: Callable[..., Any]) -> BSPApp:
        return BSPApp(
            f,
            ranks=ranks,
            site=site,
            communicator=communicator,
            outputs=outputs,
            placement=placement,
            persistent=persistent,
            ranks_per_node=ranks_per_node,
            session=session,
            store=store,
            metadata=metadata,
            executors=executors,
            timeout=timeout,
            echo=echo,
            driver_host=driver_host,
            start_timeout=start_timeout,
            cache=cache,
            launcher=launcher,
        )

    return wrap(fn) if fn is not None else wrap
