"""Workflow and site models: what YAML files and the Python API compile to.

Unknown keys are rejected everywhere (``extra="forbid"``) so a typo is an error, not a silently
ignored setting; so are values a run would fail on later (a bool as a count, an infinite
timeout, a path as a name, an executor or rendezvous nobody provides).  The JSON Schema of both
models is published in docs/ for editors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Optional
from urllib.parse import urlparse

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)

from ..executors.base import Executor, suggest
from ..runtime.envvars import ENV_PARAM_PREFIX
from .yamlio import Located

MAX_NAME = 100  # a workflow's name names its store session and directories
MAX_SESSION = 128  # a run's session is "<workflow>-<run id>"
MAX_SLOTS = 1_000_000  # ranks of a gang, slots of a site
MAX_RETRIES = 100
MAX_SECONDS = 366 * 86400  # a year: timeouts beyond that are typos (and overflow timers)
MAX_MEMORY_GB = 1e9
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Int = Annotated[int, Strict()]  # YAML's true/false and 2.5 are not counts
Seconds = Annotated[float, Strict(), Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]


def _short(value: str, limit: int = 32) -> str:
    return repr(value if len(value) <= limit else value[: limit - 1] + "…")


def check_name(value: str, what: str = "name", limit: int = MAX_NAME) -> str:
    """A stage, dataset or workflow name: safe as a file name, a key and a session."""
    if len(value) > limit or not _NAME.fullmatch(value):
        raise ValueError(
            f"{_short(value)} is not a {what}: 1 to {limit} letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return value


def _check_dataset(value: str) -> str:
    session, _, name = value.rpartition("/")
    if session:  # another run's dataset
        check_name(session, "store session", MAX_SESSION)
    check_name(name)
    return value


def _schema(pattern: str, limit: int) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "pattern": pattern, "maxLength": limit})


Name = Annotated[str, AfterValidator(check_name), _schema(f"^{_NAME.pattern}$", MAX_NAME)]
Session = Annotated[
    str,
    AfterValidator(lambda v: check_name(v, "store session", MAX_SESSION)),
    _schema(f"^{_NAME.pattern}$", MAX_SESSION),
]
Dataset = Annotated[
    str, AfterValidator(_check_dataset), _schema(f"^({_NAME.pattern}/)?{_NAME.pattern}$", MAX_SESSION + 1 + MAX_NAME)
]


def _one_of(kind: str, value: str, known: Sequence[str]) -> None:
    if value not in known:
        raise ValueError(f"unknown {kind} {value!r}{suggest(value, known)}")


def _executor_sections(what: str) -> dict[str, Any]:
    """One optional field per registered executor, typed by its config model: a site's (or a
    stage's) ``slurm:``, ``ray:``... section.  Built from the registry, so a plug-in's section
    is validated — and in the JSON Schema — like a built-in's."""
    from ..executors import config_model, executors

    return {
        name: (Optional[config_model(name)], Field(None, description=f"{what} ({name} executor)"))
        for name in executors.names()
    }


class _Strict(BaseModel):
    # bytes (YAML's !!binary in params) dump to JSON as base64, as run records and fingerprints need
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64")


class InputSpec(_Strict):
    """How a stage reads one store dataset (see ``env.store.get``)."""

    dataset: Dataset = Field(description="name of a dataset in the store; SESSION/NAME: another run's")
    by: Optional[list[str]] = Field(None, description="hash-partition by these columns for the stage's ranks")
    shuffle: Optional[Literal["random", "global"]] = Field(
        None, description="random: a seeded permutation of all rows; global: for the ML loader, per epoch"
    )
    seed: Int = Field(0, ge=0, le=2**63 - 1)
    columns: Optional[list[str]] = None
    gather: Optional[Literal["concat", "list"]] = Field(
        None,
        description="an output of a fan-out stage (foreach): its instances' datasets read as one "
        "(concat, the default) or as a list of frames, one per instance that ran",
    )

    @model_validator(mode="after")
    def _by_or_shuffle(self) -> InputSpec:
        if self.by and self.shuffle:
            raise ValueError("give by or shuffle, not both")
        return self


MAX_INSTANCES = 10_000  # instances one fan-out may make


class ForEach(_Strict):
    """A stage run once per item: ``items`` (each a mapping merged into the params, or a value
    given as ``params.item``), a ``matrix`` (every combination of the listed values), or the
    ``rows`` of a small dataset an upstream stage seals (known only at run time)."""

    items: Optional[list[Any]] = Field(None, min_length=1, description="one instance per item")
    matrix: Optional[dict[str, list[Any]]] = Field(
        None, description="param → values: one instance per combination (a sweep)"
    )
    rows: Optional[Dataset] = Field(
        None, description="a dataset (sealed by an upstream stage): one instance per row, its columns as params"
    )
    max: Int = Field(1000, ge=1, le=MAX_INSTANCES, description="most instances a fan-out over rows may make")

    @model_validator(mode="after")
    def _one_source(self) -> ForEach:
        given = [k for k in ("items", "matrix", "rows") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give one of items, matrix or rows{f' (got {given})' if given else ''}")
        for key, values in (self.matrix or {}).items():
            if not values:
                raise ValueError(f"matrix.{key}: a list of at least one value")
        return self


class Backoff(_Strict):
    """Seconds between a failed attempt and the next: ``first``, then times ``factor`` each
    retry, at most ``max`` (the default: 1, 4, 15, 15... s)."""

    first: float = Field(1.0, ge=0, le=MAX_SECONDS, allow_inf_nan=False, strict=True)
    factor: float = Field(4.0, ge=1, le=1000, allow_inf_nan=False, strict=True)
    max: float = Field(15.0, ge=0, le=MAX_SECONDS, allow_inf_nan=False, strict=True)


# Causes a retry policy names (phalanx.orchestrator.retry.classify): the resource manager's,
# and an exception type by name (e.g. ConnectionError: its subclasses too, where Python knows it)
RETRY_CAUSES = ("any", "oom", "timeout")
INFRASTRUCTURE_CAUSES = ("node_lost", "preempted")
_CAUSE = re.compile(r"exit:[0-9]{1,3}|signal:(SIG)?[A-Z0-9]{1,8}|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_FACTOR = re.compile(r"x([0-9]+(\.[0-9]+)?)")


class RetryPolicy(_Strict):
    """Which failures of a stage retry, how many times each, after how long, and with how much
    memory (``retry:`` of a stage, or of a site: the default of its stages)."""

    causes: dict[str, Int] = Field(
        default_factory=dict,
        description="cause → retries it may use: oom, timeout, exit:N (a rank's exit code), signal:NAME (a "
        "rank killed by a signal), an exception type raised by a rank (ConnectionError: its subclasses too), "
        "any (a failure no other key names)",
    )
    memory: Optional[str] = Field(
        None, description="on oom: each retry's memory per rank is the last one's times this ('x2')"
    )
    max_memory_gb: Optional[float] = Field(
        None, gt=0, le=MAX_MEMORY_GB, allow_inf_nan=False, strict=True, description="cap of memory: per rank"
    )
    backoff: Backoff = Field(default_factory=Backoff)
    infrastructure: Int = Field(
        3,
        ge=0,
        le=MAX_RETRIES,
        description="retries after a preemption or a node lost (node_lost, preempted), which never use the "
        "counts of causes",
    )

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, data: Any) -> Any:
        if isinstance(data, dict) and True in data:  # YAML 1.1 reads the key on: as true
            raise ValueError("`on:` reads as true in YAML: name the causes under causes:")
        return data

    @field_validator("causes")
    @classmethod
    def _known_causes(cls, value: dict[str, int]) -> dict[str, int]:
        for cause, count in value.items():
            if cause in INFRASTRUCTURE_CAUSES:
                raise ValueError(
                    f"{cause}: preemption and node loss never use the stage's retries; "
                    "retry.infrastructure says how often they retry"
                )
            if not _CAUSE.fullmatch(cause) or (cause.isidentifier() and cause.islower() and cause not in RETRY_CAUSES):
                known = (*RETRY_CAUSES, "exit:N", "signal:NAME", "an exception type (ConnectionError)")
                raise ValueError(f"unknown cause {_short(cause)}{suggest(cause, known)}")
            if not 0 <= count <= MAX_RETRIES:
                raise ValueError(f"{cause}: {count} retries; give 0 to {MAX_RETRIES}")
        return value

    @field_validator("memory")
    @classmethod
    def _factor(cls, value: Optional[str]) -> Optional[str]:
        found = _FACTOR.fullmatch(value or "x2")
        if not found or not 1 < float(found[1]) <= 1000:
            raise ValueError(f"{_short(str(value))}: a factor above 1 such as 'x2' or 'x1.5'")
        return value

    @model_validator(mode="after")
    def _memory_needs_oom(self) -> RetryPolicy:
        if self.memory and not any(self.causes.get(k) for k in ("oom", "any")):
            raise ValueError("memory: applies to retries after out of memory: add oom: N to causes")
        if self.max_memory_gb and not self.memory:
            raise ValueError("max_memory_gb caps memory: give memory: x2 (or another factor) too")
        return self

    def memory_factor(self) -> float:
        """What an out-of-memory retry multiplies the memory per rank by (1: unchanged)."""
        found = _FACTOR.fullmatch(self.memory or "")
        return float(found[1]) if found else 1.0


class _StageFields(_Strict):
    """One BSP application on a gang of its own size."""

    kind: Literal["bsp", "torch", "command"] = "bsp"
    app: Optional[str] = Field(None, description='"package.module:function(env)"; for bsp and torch stages')
    command: Optional[list[str]] = Field(None, description="program and arguments run on every rank (kind: command)")
    ranks: Int = Field(1, ge=1, le=MAX_SLOTS, description="gang size: all ranks start together or not at all")
    needs: list[str] = Field(default_factory=list, description="stages that must finish first")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="local name → dataset name, or a dataset with a repartition mode"
    )
    outputs: list[Name] = Field(default_factory=list, description="datasets this stage seals in the store")
    params: dict[str, Any] = Field(default_factory=dict, description="env.params of the app")
    retries: Int = Field(
        0, ge=0, le=MAX_RETRIES, description=f"reruns on a fresh gang after a failure (at most {MAX_RETRIES})"
    )
    retry: Optional[RetryPolicy] = Field(
        None,
        description="which failures retry, how often each, backoff, memory (default: the site's retry); "
        "give retries or retry, not both",
    )
    timeout: Optional[Seconds] = Field(None, description="seconds before the stage is stopped")
    cache: Optional[bool] = Field(
        None,
        description="reuse the sealed, verified outputs of an earlier run (any workflow) whose stage had the same "
        "fingerprint and read the same data, instead of running (default: the workflow's cache, else the site's, "
        "else false)",
    )
    site: Optional[str] = Field(
        None,
        description="the site this stage runs on: a name from site-configs/ or a path to a site file "
        "(default: the workflow's); its inputs sealed on another site cross into this site's store",
    )
    gpus_per_rank: Optional[Int] = Field(
        None,
        ge=0,
        le=MAX_SLOTS,
        description="GPUs of every rank (default: the site's gpus_per_rank): the local executor gives each "
        "rank its own (CUDA_VISIBLE_DEVICES), all or nothing with the gang; SLURM --gpus-per-task, "
        "Kubernetes the nvidia.com/gpu limit, Ray num_gpus, RADICAL-Pilot gpus_per_rank",
    )

    foreach: Optional[ForEach] = Field(
        None,
        description="run the stage once per item (instances NAME.0, NAME.1...; each its own gang, "
        "outputs OUT.0, OUT.1..., retries and status line); a list is short for {items: [...]}",
    )
    when: Optional[str] = Field(
        None,
        description="a condition (a Python expression over params and small upstream results, e.g. "
        "\"params.mode == 'full' and max(metrics.accuracy) > 0.9\"); false: the stage and what needs it "
        "are skipped (the run still succeeds)",
    )

    @field_validator("foreach", mode="before")
    @classmethod
    def _items_list(cls, value: Any) -> Any:
        return {"items": value} if isinstance(value, list) else value

    @field_validator("when")
    @classmethod
    def _condition_parses(cls, value: Optional[str]) -> Optional[str]:
        from .conditions import parse_condition

        if value is not None:
            parse_condition(value)  # ValueError naming what is not allowed
        return value

    @field_validator("inputs", mode="before")
    @classmethod
    def _dataset_names(cls, value: Any) -> Any:
        """``tx: transactions`` is short for ``tx: {dataset: transactions}``."""
        if isinstance(value, dict):
            return {k: {"dataset": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _retries_or_retry(self) -> _StageFields:
        if self.retry is not None and "retries" in self.model_fields_set:
            raise ValueError(
                f"give retries or retry, not both: retries: {self.retries} is retry: {{causes: {{any: {self.retries}}}}}"
            )
        return self

    @model_validator(mode="after")
    def _kind_needs_its_entry(self) -> _StageFields:
        if self.kind == "command":
            if not self.command:
                raise ValueError("a command stage needs command: [program, args...]")
            if self.app:
                raise ValueError("a command stage takes command, not app")
        elif not self.app:
            raise ValueError(f"a {self.kind} stage needs app: 'package.module:function'")
        elif ":" not in self.app:
            raise ValueError(f"app must look like 'package.module:function', got {self.app!r}")
        for key in self.params if self.kind == "command" else ():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(
                    f"param {key!r} cannot be an environment variable "
                    f"({ENV_PARAM_PREFIX}{key.upper()}): use letters, digits and '_'"
                )
        return self

    def executor_section(self, executor: str) -> Any:
        """This stage's own section for ``executor`` (None: the site's applies as it is)."""
        return getattr(self, executor, None)

    def gpus_on(self, site: Any) -> int | None:
        """GPUs each rank asks for on ``site``: this stage's ``gpus_per_rank``, else the site's;
        None where neither gives it (the executor's own section decides)."""
        return self.gpus_per_rank if self.gpus_per_rank is not None else site.gpus_per_rank


# A stage's executor sections override keys of the site's section of the same name for it
Stage = create_model(
    "Stage",
    __base__=_StageFields,
    __module__=__name__,
    **_executor_sections("this stage's keys over the site's section"),
)


class Workflow(_Strict, Located):
    """A DAG of stages, run on its site (each stage on its own ``site:`` where it names one)."""

    name: Name = Field(description=f"letters, digits, '_', '.', '-', at most {MAX_NAME} (names the store session)")
    site: str = Field("local", description="a name from site-configs/ or a path to a site file")
    cache: Optional[bool] = Field(
        None, description="the cache setting of every stage that does not give one (default: the site's, else false)"
    )
    stages: dict[Name, Stage] = Field(min_length=1)
    # Python workflows (px.Workflow): stage → the function itself, sent to ranks by value, so
    # functions from a notebook or a script's __main__ work.  Not part of the file format.
    _apps: dict[str, Any] = PrivateAttr(default_factory=dict)
    # Fan-out instances (fanout.expand): instance → its stage; instance → {output: its dataset};
    # fan-in stage → {input: (concat|list, [the instances' part inputs])}
    _instance_of: dict[str, str] = PrivateAttr(default_factory=dict)
    _aliases: dict[str, dict[str, str]] = PrivateAttr(default_factory=dict)
    _gathers: dict[str, dict[str, tuple[str, list[str]]]] = PrivateAttr(default_factory=dict)
    _fanned: dict[str, list[str]] = PrivateAttr(default_factory=dict)  # a fan-out's output → its instances'
    _items: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)  # instance → its item (params)

    @property
    def apps(self) -> dict[str, Any]:
        return self._apps

    def app_of(self, stage: str) -> Any:
        """What a rank runs for ``stage``: the Python function, else its "module:function"."""
        template = self._instance_of.get(stage, stage)
        return self._apps.get(stage) or self._apps.get(template) or self.stages[stage].app

    def template_of(self, stage: str) -> str:
        """The fan-out stage ``stage`` is an instance of (itself when it is none)."""
        return self._instance_of.get(stage, stage)


class StoreConfig(_Strict):
    root: Optional[str] = Field(None, description="store directory (default: /dev/shm/phalanx-$USER/store)")
    session: Optional[Session] = Field(None, description="namespace; default: the workflow's name and the run id")
    metadata: Optional[str] = Field(
        None,
        description="where the store's catalogue lives: sqlite:///path or redis://host:port/db (ranks on "
        "several hosts); default: $PHALANX_STORE_METADATA, else SQLite beside the store root",
    )
    durability: Literal["memory", "write-through"] = Field(
        "memory",
        description="memory: a partition lives in the memory of the host that wrote it, as long as that "
        "host's allocation (a pilot's node, the driver's host); write-through: also copied to `durable` as it "
        "is written, so it outlives the host and its allocation (SLURM per-stage jobs on hosts that share no "
        "store root need this)",
    )
    durable: Optional[str] = Field(
        None, description="write-through target: a directory every host mounts or s3://bucket/prefix"
    )
    exchange: Optional[str] = Field(
        None,
        description="an object store (s3://bucket/prefix?endpoint_override=...) this site shares with other "
        "sites: a dataset crossing between two sites that name the same exchange goes through it; otherwise "
        "the consumer's site reads it from the producer's store directly (its store services must be reachable)",
    )

    @model_validator(mode="after")
    def _durable_given(self) -> StoreConfig:
        if self.durability == "write-through" and not self.durable:
            raise ValueError("durability: write-through needs durable: a shared directory or s3://bucket/prefix")
        return self

    @field_validator("root", "metadata", "durable")
    @classmethod
    def _known_scheme(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        """``s3://`` needs a store tier of that name, ``redis://`` a metadata backend."""
        from ..store.metadata import metadata_backends
        from ..store.tiers import tiers

        kind, registry = (
            ("store tier", tiers)
            if info.field_name in ("root", "durable")
            else ("store metadata backend", metadata_backends)
        )
        if value and "://" in value:
            _one_of(kind, value.split("://", 1)[0], registry.names())
        return value


class _SiteFields(_Strict, Located):
    """Where gangs run.  Executor-specific settings live in their own section (slurm:, ray:...)
    so the orchestrator needs to know only ``executor`` and the capacity."""

    name: str
    executor: str = Field(
        "local", description="local | mpirun | slurm | ray, or a plug-in's name (the executors registry)"
    )
    cores: Optional[Int] = Field(
        None,
        ge=1,
        le=MAX_SLOTS,
        description="slots for ranks; default: what the "
        "executor holds (this machine's cores, a SLURM pilot's ntasks, a Ray "
        "cluster's CPUs)",
    )
    memory_gb: Optional[float] = Field(None, gt=0, le=MAX_MEMORY_GB, allow_inf_nan=False, strict=True)
    gpus: Optional[Int] = Field(
        None,
        ge=0,
        le=MAX_SLOTS,
        description="GPU slots of the site, handed out all or nothing with a gang's rank slots; default: "
        "local: this machine's GPUs ($PHALANX_GPUS, else nvidia-smi -L, else torch), other executors: "
        "unknown (the resource manager counts them)",
    )
    gpus_per_rank: Optional[Int] = Field(
        None, ge=0, le=MAX_SLOTS, description="GPUs of every rank of a stage that does not say (default 0)"
    )
    communicator: str = Field(
        "tcp",
        description="tcp (the default: no torch in the ranks) | shm | gloo | mpi | "
        "ucx, or a plug-in's name (the communicators registry)",
    )
    rendezvous: str = Field("tcp", description="tcp | file | file:///dir | redis://host:port/db")
    store: StoreConfig = Field(default_factory=StoreConfig)
    driver_host: str = Field(
        "127.0.0.1",
        description="address ranks use to reach the driver; 'auto': this host's address "
        "(ranks on other machines: SLURM compute nodes, a Ray cluster)",
    )
    start_timeout: Seconds = Field(
        300, description="seconds a gang may take to start, queue wait included (batch sites: raise it)"
    )
    cache: bool = Field(
        False,
        description="the cache setting of the stages of workflows that give none (stage over workflow over site)",
    )
    reuse_gangs: bool = Field(
        True,
        description="executors that can (local, ray): a succeeded stage's gang (processes + communicator) "
        "runs the next stage of the same size; retries always get a fresh gang",
    )
    retry: Optional[RetryPolicy] = Field(
        None, description="the retry policy of every stage that gives neither retry nor retries"
    )
    warm_ranks: Optional[Int] = Field(
        None,
        ge=0,
        le=MAX_SLOTS,
        description="executors that can (local): rank processes kept started, imports "
        "done, so a stage's gang starts in a fraction of a second; 0 turns it off; default: the site's slots",
    )

    @field_validator("store", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value  # "store:" with only comments under it

    @field_validator("executor")
    @classmethod
    def _known_executor(cls, value: str) -> str:
        from ..executors import executors

        _one_of("executor", value, executors.names())
        return value

    @field_validator("communicator")
    @classmethod
    def _mpi_needs_an_mpi_launcher(cls, value: str, info: ValidationInfo) -> str:
        from ..executors import capabilities, executors
        from ..runtime.comm import communicators

        _one_of("communicator", value, communicators.names())
        executor = info.data.get("executor")  # absent when it was invalid itself
        if value == "mpi" and executor and not capabilities(executor).mpi_world:
            mpi = [n for n in executors.names() if capabilities(n).mpi_world]
            raise ValueError(
                f"'mpi' needs executor {' or '.join(map(repr, mpi))} (MPI ranks must be "
                f"started by an MPI launcher), not {executor!r}"
            )
        return value

    @field_validator("rendezvous")
    @classmethod
    def _known_rendezvous(cls, value: str) -> str:
        from ..runtime.rendezvous import rendezvous_backends

        _one_of("rendezvous", value.split("://", 1)[0] if "://" in value else value, rendezvous_backends.names())
        try:
            _ = urlparse(value).port  # raises on a port that is no number
        except ValueError as exc:  # a port that is no number, or out of range
            raise ValueError(f"{value!r}: {exc}") from None
        return value

    def section(self) -> Any:
        """The executor's own section of this site (None: its defaults)."""
        return getattr(self, self.executor, None)

    def create_executor(self) -> Executor:
        """The site's executor, configured by its section (not started: ``open_run``)."""
        from ..executors import create

        executor = create(self.executor, self.section(), site=self.name, cores=self.cores)
        executor.gpus = self.gpus
        slots = executor.capacity()
        if self.memory_gb and slots:  # shared over the slots like the cores, so side-by-side stages fit
            executor.rank_memory = int(self.memory_gb * 2**30 / slots)
        return executor

    def capacity(self) -> int | None:
        """Rank slots the site can ever give at once; None where the resource manager decides
        (gangs queue there)."""
        return self.create_executor().capacity()


# The site's executor sections: slurm:, ray:..., one per registered executor
Site = create_model(
    "Site", __base__=_SiteFields, __module__=__name__, **_executor_sections("settings of the executor of this name")
)
