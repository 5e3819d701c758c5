"""Workflow and site models: what YAML files and the Python API compile to.

Unknown keys are rejected everywhere (``extra="forbid"``) so a typo is an error, not a silently
ignored setting.  The JSON Schema of both models is published in docs/ for editors.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSpec(_Strict):
    """How a stage reads one store dataset (see ``env.store.get``)."""

    dataset: str = Field(description="name of a dataset in the store")
    by: Optional[list[str]] = Field(None, description="hash-partition by these columns for the stage's ranks")
    shuffle: Optional[Literal["random", "global"]] = Field(
        None, description="random: a seeded permutation of all rows; global: for the ML loader, per epoch")
    seed: int = 0
    columns: Optional[list[str]] = None

    @model_validator(mode="after")
    def _by_or_shuffle(self) -> "InputSpec":
        if self.by and self.shuffle:
            raise ValueError("give by or shuffle, not both")
        return self


class Stage(_Strict):
    """One BSP application on a gang of its own size."""

    kind: Literal["bsp", "torch", "command"] = "bsp"
    app: Optional[str] = Field(None, description='"package.module:function(env)"; for bsp and torch stages')
    command: Optional[list[str]] = Field(None, description="program and arguments run on every rank (kind: command)")
    ranks: int = Field(1, ge=1, description="gang size: all ranks start together or not at all")
    needs: list[str] = Field(default_factory=list, description="stages that must finish first")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="local name → dataset name, or a dataset with a repartition mode")
    outputs: list[str] = Field(default_factory=list, description="datasets this stage seals in the store")
    params: dict[str, Any] = Field(default_factory=dict, description="env.params of the app")
    retries: int = Field(0, ge=0, description="reruns on a fresh gang after a failure")
    timeout: Optional[float] = Field(None, gt=0, description="seconds before the stage is stopped")
    slurm: Optional[dict[str, Any]] = Field(
        None, description="this stage's SLURM options over the site's slurm: section (time, partition...)")
    ray: Optional[dict[str, Any]] = Field(
        None, description="this stage's Ray options over the site's ray: section (strategy, resources...)")

    @field_validator("inputs", mode="before")
    @classmethod
    def _dataset_names(cls, value: Any) -> Any:
        """``tx: transactions`` is short for ``tx: {dataset: transactions}``."""
        if isinstance(value, dict):
            return {k: {"dataset": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _kind_needs_its_entry(self) -> "Stage":
        if self.kind == "command":
            if not self.command:
                raise ValueError("a command stage needs command: [program, args...]")
            if self.app:
                raise ValueError("a command stage takes command, not app")
        elif not self.app:
            raise ValueError(f"a {self.kind} stage needs app: 'package.module:function'")
        elif ":" not in self.app:
            raise ValueError(f"app must look like 'package.module:function', got {self.app!r}")
        return self



class Workflow(_Strict):
    """A DAG of stages, run on one site."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="letters, digits, '_', '.', '-' (names the store session)")
    site: str = Field("local", description="a name from site-configs/ or a path to a site file")
    stages: dict[str, Stage] = Field(min_length=1)
    # Python workflows (px.Workflow): stage → the function itself, sent to ranks by value, so
    # functions from a notebook or a script's __main__ work.  Not part of the file format.
    _apps: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def apps(self) -> dict[str, Any]:
        return self._apps

    def app_of(self, stage: str) -> Any:
        """What a rank runs for ``stage``: the Python function, else its "module:function"."""
        return self._apps.get(stage) or self.stages[stage].app


class StoreConfig(_Strict):
    root: Optional[str] = Field(None, description="store directory (default: /dev/shm/phalanx-$USER/store)")
    session: Optional[str] = Field(None, description="namespace; default: the workflow's name")


class Site(_Strict):
    """Where gangs run.  Executor-specific settings live in their own section (slurm:, ray:...)
    so the orchestrator needs to know only ``executor`` and the capacity."""

    name: str
    executor: str = Field("local", description="local | mpirun | slurm | ray | kubernetes")
    cores: Optional[int] = Field(None, ge=1, description="slots for ranks; default: this machine's cores")
    memory_gb: Optional[float] = Field(None, gt=0)
    communicator: Literal["gloo", "mpi"] = "gloo"
    rendezvous: str = Field("tcp", description="tcp | file | file:///dir | redis://host:port/db")
    store: StoreConfig = Field(default_factory=StoreConfig)
    driver_host: str = Field(
        "127.0.0.1", description="address ranks use to reach the driver; 'auto': this host's address "
        "(ranks on other machines: SLURM compute nodes, a Ray cluster)")
    start_timeout: float = Field(
        300, gt=0, description="seconds a gang may take to start, queue wait included (batch sites: raise it)")
    reuse_gangs: bool = Field(
        True, description="local and ray executors: a succeeded stage's gang (processes + communicator) runs the "
        "next stage of the same size; retries always get a fresh gang")
    warm_ranks: Optional[int] = Field(
        None, ge=0, description="local executor: rank processes kept started, imports done, so a stage's "
        "gang starts in a fraction of a second; 0 turns it off; default: the site's slots")
    slurm: Optional[dict[str, Any]] = None
    ray: Optional[dict[str, Any]] = None
    kubernetes: Optional[dict[str, Any]] = None

    @field_validator("store", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value  # "store:" with only comments under it

    def capacity(self) -> int:
        """Rank slots the site can ever give at once."""
        if self.cores:
            return self.cores
        from ..executors.local import usable_cpus

        return len(usable_cpus())
