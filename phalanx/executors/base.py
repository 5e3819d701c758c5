"""The executor interface: start, watch and stop the processes of one gang.

An executor only launches processes; the control plane (connecting ranks, sending apps,
fail-fast) is shared by every executor in ``control`` and ``phalanx.gang``.

Allocations: what a launcher holds on a resource manager (a SLURM job, step or pilot, a Ray
placement group) is announced the moment it exists — ``held(hook, record)`` before or as it
is submitted, ``released(hook, record)`` once it is gone — to the launcher's
``allocation_hook`` (the scheduler's writes the run DB, so a driver killed without a word
leaves enough for ``phalanx status``/``cancel``/``--resume`` to free it with
``phalanx.executors.release(record)``), and to this process's own list, which an exit
handler frees should the driver end (an exception, Ctrl-C, SIGTERM) with some still held.
A record is a JSON-able dict: ``executor``, ``id`` (unique for that executor) and what
``release`` needs from another process (SLURM_CONF, the Ray address and namespace...).
"""

from __future__ import annotations

import atexit
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from ..procs import pid_alive  # noqa: F401  (re-exported: callers check driver and rank pids)

log = logging.getLogger("phalanx.executors")
Echo = bool | Callable[[str], None]  # True: rank lines to stderr; a callable gets each line


class AllocationHook(Protocol):
    def held(self, record: dict[str, Any]) -> None: ...

    def released(self, record: dict[str, Any]) -> None: ...


_held_here: dict[tuple[str, str], dict[str, Any]] = {}  # (executor, id) → record: held by this process
_held_lock = threading.Lock()


def held(hook: AllocationHook | None, record: dict[str, Any]) -> None:
    """An allocation exists (or is about to: submitted under its ``id``)."""
    with _held_lock:
        if not _held_here:  # registered late: runs before Ray's own exit handler disconnects
            atexit.register(_release_all)
        _held_here[(record["executor"], str(record["id"]))] = record
    if hook is not None:
        hook.held(record)


def released(hook: AllocationHook | None, record: dict[str, Any]) -> None:
    """The allocation is gone."""
    with _held_lock:
        _held_here.pop((record["executor"], str(record["id"])), None)
        if not _held_here:
            atexit.unregister(_release_all)
    if hook is not None:
        hook.released(record)


def _release_all() -> None:
    """At exit: free what this driver still holds (a gang whose start raced a Ctrl-C...)."""
    from . import release

    with _held_lock:
        records = list(_held_here.values())
        _held_here.clear()
    for record in records:
        try:
            log.warning("released at exit: %s", release(record))
        except Exception as exc:  # the resource manager is unreachable: the run DB still has it
            log.warning("could not release %s %s at exit: %s", record["executor"], record["id"], exc)


class Launcher(ABC):
    """Starts, watches and stops the processes of one gang: ``world_size`` copies of ``argv``,
    rank r with ``rank_env[r]`` added to its environment.  A launcher serves one gang at a time
    (a gang that restarts launches again on the same launcher)."""

    name = "abstract"
    allocation_hook: AllocationHook | None = None  # told of every allocation (see above)
    start_timeout: float | None = None  # the gang's: how long launch may wait for an allocation
    # how long after a rank's connection drops its exit code may take to be known (a resource
    # manager's API reports it later than a local waitpid): the gang waits this long for it
    exit_latency: float = 1.0

    @abstractmethod
    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None: ...

    @abstractmethod
    def exitcodes(self) -> list[int | None]:
        """Per rank: None while running, else the exit code (negative: killed by that signal)."""

    @abstractmethod
    def kill(self, grace_s: float = 2.0) -> None:
        """Stop every rank: SIGTERM, then SIGKILL after ``grace_s``; reap them; free what the
        gang held (its job, step, placement group)."""

    def placement(self, world_size: int) -> list[dict[str, str]]:
        """Extra per-rank environment for placement (CPU affinity, threads)."""
        return [{} for _ in range(world_size)]

    def prefer_hosts(self, hosts: Sequence[str]) -> bool:
        """Run rank r on ``hosts[r]`` where this launcher can choose (the host holding most of
        that rank's input, ``store.repartition.rank_hosts``; "" for no preference), before
        ``launch``.  False where it cannot (one host, or hosts the resource manager picks)."""
        return False

    def status(self) -> str | None:
        """The resource manager's view of the gang (``slurm: job 42 PENDING (Resources)``), or
        None where there is none to tell (processes of this machine)."""
        return None

    def reason(self) -> str | None:
        """Why the gang failed in the resource manager's words (``slurm: job 42 TIMEOUT``)."""
        return None

    def redirect(self, log_dir: Path) -> bool:
        """Write the ranks' output to ``log_dir`` from now on (a gang reused by the next stage);
        False where the executor cannot."""
        return False

    def memory_note(self, rank: int) -> str:
        """What memory says about a rank killed by SIGKILL (over its limit, the OOM killer)."""
        return ""

    def end_cause(self, rank: int) -> str | None:
        """Why rank ``rank``'s process ended, where the resource manager or a watch knows: "oom"
        (over its memory limit, the OOM killer), "node_lost" (its host went away), "preempted"
        (another job took its resources), "timeout" (a time limit); None where nothing says
        (what retry policies read: phalanx.orchestrator.retry)."""
        return None

    def first_failed(self) -> int | None:
        """The rank whose end made the launcher end the others (mpirun names it), or None
        where each rank's own exit says what happened to it."""
        return None

    def assign_gpus(self, per_rank: Sequence[Sequence[int]]) -> bool:
        """Give rank r the GPU slots ``per_rank[r]`` (indices below the executor's
        ``gpu_capacity``; empty: no GPU), before ``launch``.  False where the launcher cannot
        (the resource manager gives GPUs, from the config ``Executor.with_gpus`` made)."""
        return False


@dataclass(frozen=True)
class Capabilities:
    """What an executor can do; the scheduler asks these instead of naming executors."""

    reuse_gangs: bool = False  # a succeeded stage's gang (processes, communicator) may serve the next
    pins_cpus: bool = False  # the site's slots are this machine's CPUs: gangs get disjoint CPU sets
    warm_pool: bool = False  # takes pre-started rank processes (executors.pool.WarmPool)
    runs_commands: bool = True  # starts any program as a rank (command stages)
    mpi_world: bool = False  # the ranks of a gang are one MPI_COMM_WORLD (communicator: mpi)
    remote_ranks: bool = False  # ranks may run on other hosts: logs and the store must be shared


class ExecutorConfig(BaseModel):
    """The typed section of a site file named after its executor (``slurm:``, ``ray:``...); a
    stage's section of the same name overrides keys of it for that stage.  Every field has a
    default, so a stage's partial section validates on its own."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def known_keys(cls) -> list[str]:
        """The keys the section takes, in the order the docs list them."""
        return list(cls.model_fields)

    @classmethod
    def normalize_key(cls, key: str) -> str:
        """A key as the model knows it (SLURM's: ``-`` and ``_`` are the same)."""
        return key

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        """An unknown key is named with its nearest known one: ``slurm.partiton: unknown key
        (did you mean 'partition'?)`` (the "section" error type carries the key to its line)."""
        if isinstance(data, dict):
            known = cls.known_keys()
            for key in data:
                if cls.normalize_key(str(key)) not in known:
                    raise PydanticCustomError(
                        "section",
                        "{message}",
                        {"keys": (key,), "message": "unknown key" + suggest(cls.normalize_key(str(key)), known)},
                    )
        return data

    def slots(self) -> int | None:
        """Rank slots this configuration holds at once (a pilot's ntasks), if it says."""
        return None


ConfigT = TypeVar("ConfigT", bound=ExecutorConfig)  # an executor's section model
PROBE_S = 10.0  # the longest a probe of a site's resource manager waits for its answer


def suggest(value: str, known: Sequence[str]) -> str:
    """ " (did you mean 'x'?)" for a near miss, else "; known: a, b, c"."""
    import difflib

    close = difflib.get_close_matches(value, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"


class Executor(ABC, Generic[ConfigT]):
    """One kind of place gangs run: a typed config, capabilities, and a factory of launchers.

    Anything that lives as long as a run (a SLURM pilot allocation, warm rank processes, a
    connection to a Ray cluster) is made in ``open_run`` and ends in ``close_run``; nothing is
    process-global, so two runs in one process never end each other's allocations.  A new
    backend is one module holding its ``Executor`` subclass and config model, one registry line
    (``phalanx.executors``) or an entry point of the group ``phalanx.executors``.  A subclass
    names its config model twice: as the type parameter (``Executor[SlurmConfig]``, for the
    type checker) and as ``config_model`` (for validation at run time).
    """

    name: ClassVar[str] = "abstract"
    config_model: ClassVar[type[ExecutorConfig]] = ExecutorConfig  # ConfigT's class
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(
        self,
        config: ConfigT | Mapping[str, Any] | None = None,
        *,
        site: str | None = None,
        cores: int | None = None,
        rank_memory: int | None = None,
    ):
        """``config``: the site's section (validated here if a mapping); ``cores``: the site's
        rank slots when it caps them; ``rank_memory``: bytes each rank may hold, enforced
        where the executor can."""
        self.config: ConfigT = config if isinstance(config, ExecutorConfig) else self._validate(dict(config or {}))
        self.site = site or self.name
        self.cores = cores
        self.gpus: int | None = None  # the site's GPU count when it gives one (Site.create_executor)
        self.rank_memory = rank_memory
        self.resized = False  # True on a copy made by sized(): a retry after out of memory
        self.hook: AllocationHook | None = None  # the run's, set by open_run

    def sized(self, rank_memory: int) -> Executor[ConfigT]:
        """This executor giving each rank of the next gang ``rank_memory`` bytes (a retry after
        out of memory): a copy sharing the run's allocations, pool and hook."""
        import copy

        resized = copy.copy(self)
        resized.rank_memory = rank_memory
        resized.resized = True  # this memory wins over what a stage's section asks for
        return resized

    def rank_memory_for(self, config: ConfigT | None = None) -> int | None:
        """Bytes each rank of a gang with ``config`` (the stage's section over the site's) gets,
        where known: what a retry after out of memory multiplies.  Executors whose sections
        can set it themselves (SLURM's mem_per_cpu) say so."""
        return self.rank_memory

    # ---- run scope --------------------------------------------------------------------------
    def open_run(
        self, hook: AllocationHook | None = None, demand: Callable[[], int] | None = None, warm: int = 0
    ) -> None:
        """A run (or a standalone gang) begins: ``hook`` hears of every allocation the run
        holds; executors that can (``capabilities.warm_pool``) keep ``warm`` rank processes
        started, never more than ``demand()``: the ranks stages not yet started will ask for."""
        self.hook = hook

    def close_run(self) -> None:
        """The run ended: free what ``open_run`` or later gangs made for the whole run."""

    def serves_store(self) -> bool:
        """Whether a rank can read partitions another host's rank wrote into its own memory:
        true where all ranks share one host, or where the executor runs a store service on each
        host of the run (a SLURM pilot's nodes, a Ray run's nodes).  Otherwise only a store root
        every host mounts, an object store or write-through lets them (``store_reach_note``)."""
        return not self.capabilities.remote_ranks

    def probe(self) -> None:
        """Raise when the site's resource manager does not answer now (a SLURM controller, a
        Kubernetes API server, a Ray head), saying which and why.  A run over several sites
        probes each as it opens it, so a site that is down fails only its own stages, named,
        before any work starts.  This default: nothing to reach (this machine)."""

    def __enter__(self) -> Executor[ConfigT]:
        self.open_run()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close_run()

    # ---- gangs ------------------------------------------------------------------------------
    def capacity(self) -> int | None:
        """Rank slots the executor can give at once, if it knows: the site's ``cores``, else
        what its config holds.  None: the resource manager decides (gangs queue there)."""
        return self.cores or self.config.slots()

    def gpu_capacity(self) -> int | None:
        """GPU slots the site can give at once, if known: the site's ``gpus``, else what the
        executor finds (the local executor: this machine's GPUs).  The scheduler hands them out
        next to rank slots, all or nothing with the gang.  None: the resource manager counts
        them (a stage's ``gpus_per_rank`` goes into its request, ``with_gpus``)."""
        return self.gpus

    def with_gpus(self, config: ConfigT, gpus_per_rank: int | None) -> ConfigT:
        """``config`` asking the resource manager for ``gpus_per_rank`` GPUs of every rank (the
        stage's field, else the site's; None: neither gives it, ``config`` as it is).  This
        default: executors that count GPUs as slots (``gpu_capacity``) need nothing in their
        config; others cannot give GPUs.  Resource managers map it to their own key
        (``gpu_key``)."""
        if gpus_per_rank and self.gpu_capacity() is None:
            raise ValueError(
                f"gpus_per_rank: executor {self.name!r} cannot give GPUs (give the site gpus: N if its ranks have them)"
            )
        return config

    @staticmethod
    def release(record: dict[str, Any]) -> str:
        """Free an allocation this executor recorded (``held``) from any process — one a killed
        driver left; a human line saying what was done."""
        raise NotImplementedError(f"executor {record.get('executor')!r} records no allocations")

    def _validate(self, data: Mapping[str, Any]) -> ConfigT:
        # config_model is ConfigT's class (a ClassVar cannot name a type parameter)
        return cast(ConfigT, self.config_model.model_validate(data))

    def effective_config(self, config: ConfigT | None = None) -> ConfigT:
        """The config a gang runs with: ``config`` (a stage's, from ``stage_config``) if given,
        else the site's."""
        return config if config is not None else self.config

    def stage_config(self, override: ExecutorConfig | Mapping[str, Any] | None = None) -> ConfigT:
        """The site's config with a stage's own section of the same name over it."""
        if not override:
            return self.config
        over = override.model_dump(exclude_unset=True) if isinstance(override, ExecutorConfig) else dict(override)
        return self._validate({**self.config.model_dump(exclude_unset=True), **over})

    def check(self, ranks: int, config: ConfigT) -> None:
        """Raise what a gang of ``ranks`` with ``config`` would fail on at launch (a resources
        list of the wrong length...), without starting anything: ``phalanx validate`` and the
        scheduler call it before a stage starts."""

    @abstractmethod
    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: ConfigT | None = None, echo: Echo = False
    ) -> Launcher:
        """A launcher for one gang of ``ranks`` on the scheduler's ``slots`` (indices below
        ``capacity``), with ``config`` (default: the site's), telling ``self.hook``."""


def gpu_key(config: ConfigT, key: str, gpus_per_rank: int | None, label: str) -> ConfigT:
    """``config`` with its GPUs-per-rank key ``key`` set to ``gpus_per_rank`` (the stage
    field wins); ValueError when the section gives the key too and the two disagree."""
    if gpus_per_rank is None:
        return config
    if key in config.model_fields_set:
        value = getattr(config, key)
        if not same_number(value, gpus_per_rank):
            raise ValueError(
                f"gpus_per_rank: {gpus_per_rank}, but {label}: {value}; they disagree: give gpus_per_rank only"
            )
        return config
    if not gpus_per_rank:
        return config  # 0: the executor's default asks for none
    return type(config).model_validate({**config.model_dump(exclude_unset=True), key: gpus_per_rank})


def same_number(value: Any, n: int) -> bool:
    try:
        return not isinstance(value, bool) and float(value) == n
    except (TypeError, ValueError):
        return False


def shared_env(rank_env: list[dict[str, str]], per_rank: Sequence[str], launcher: str) -> dict[str, str]:
    """The one environment a launcher that starts all ranks at once (mpirun, srun) gives them:
    ``rank_env`` without the ``per_rank`` keys, which must then be the same for every rank."""
    common = {k: v for k, v in rank_env[0].items() if k not in per_rank}
    for r, env in enumerate(rank_env):
        rest = {k: v for k, v in env.items() if k not in per_rank}
        if rest != common:
            diff = sorted(set(rest.items()) ^ set(common.items()))
            raise ValueError(f"{launcher} gives every rank the same environment; rank {r} differs in {diff}")
    return common
