"""The ``slurm:`` section of a site file (and of a stage, over the site's), as typed models.

Light on purpose: pydantic and ``executors.base`` only, so ``phalanx validate`` and the
published JSON Schemas read it without touching SLURM's commands.  Keys take ``-`` or ``_``
(``mem-per-cpu`` is ``mem_per_cpu``), ``ranks_per_node`` is ``ntasks_per_node``; the fields
are the ``_`` spellings.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from ..base import ExecutorConfig

# sbatch/srun options a section may set, passed as "--key=value" (true: "--key"; false: left out)
OPTIONS: dict[str, str] = {
    "nodes": "--nodes: nodes of a gang's job (default: what ntasks_per_node needs)",
    "ntasks-per-node": "--ntasks-per-node (alias ranks_per_node): nodes = ceil(ranks / this)",
    "cpus-per-task": "--cpus-per-task: CPUs of each rank, its thread pool's size (default 1)",
    "time": "--time: time limit of a gang's job (of the pilot, unless pilot: sets its own)",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "mem": "--mem: memory per node (default: the site's memory_gb as --mem-per-cpu)",
    "mem-per-cpu": "--mem-per-cpu (default: the site's memory_gb shared over its slots)",
    "constraint": "--constraint: node features",
    "reservation": "--reservation",
    "gres": "--gres",
    "gpus": "--gpus",
    "gpus-per-task": "--gpus-per-task",
    "gpus-per-node": "--gpus-per-node",
    "exclusive": "--exclusive: whole nodes (true, or user/mcs)",
    "nodelist": "--nodelist",
    "exclude": "--exclude: nodes not to use",
    "licenses": "--licenses",
    "wckey": "--wckey",
    "comment": "--comment",
    "hint": "--hint",
    "distribution": "--distribution",
    "network": "--network",
    "switches": "--switches",
    "time-min": "--time-min",
    "begin": "--begin",
    "deadline": "--deadline",
    "spread-job": "--spread-job: a gang over as many nodes as possible",
}
OPTION_KEYS = frozenset(OPTIONS)
# what a pilot's step (``srun --jobid``) takes of them; the rest are the allocation's
STEP_OPTIONS = (
    "nodes",
    "ntasks-per-node",
    "mem",
    "mem-per-cpu",
    "gres",
    "gpus-per-task",
    "distribution",
    "nodelist",
    "exclude",
    "hint",
    "spread-job",
)
_ALIASES = {"ranks_per_node": "ntasks_per_node"}
Option = Union[bool, int, float, str]  # bool first: true stays true, not 1
_OPTION_TYPES = (bool, int, float, str)


def _field(flag: str) -> str:
    return flag.replace("-", "_")


def _flag(field: str) -> str:
    return field.replace("_", "-")


def _section_error(key: Any, message: str) -> PydanticCustomError:
    """An error at ``key`` of the section (the "section" type carries the key to its line)."""
    return PydanticCustomError("section", "{message}", {"keys": (key,), "message": message})


class _OptionKeys(ExecutorConfig):
    """SLURM's key spelling and option values (the fields: ``_Options``)."""

    @classmethod
    def normalize_key(cls, key: str) -> str:
        key = key.replace("-", "_")
        return _ALIASES.get(key, key)

    @model_validator(mode="before")
    @classmethod
    def _spelling_and_options(cls, data: Any) -> Any:
        """Keys in their field spelling (a key given twice, as ``mem-per-cpu`` and
        ``mem_per_cpu``, is an error); an option's value is one sbatch takes after ``=``.
        Unknown keys pass as they are, for ``ExecutorConfig``'s did-you-mean error."""
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        for key, value in data.items():
            name = cls.normalize_key(str(key))
            if name == "ntasks" and name not in cls.model_fields:  # was accepted (and ignored) once
                raise _section_error(
                    key, "unknown key: a gang's tasks are its ranks (the stage's ranks:); a pilot's are pilot.ntasks"
                )
            if name not in cls.model_fields:
                name = key
            if name in out:
                raise _section_error(key, f"given twice (as {raw[name]!r} and {key!r})")
            if _flag(str(name)) in OPTION_KEYS and not isinstance(value, _OPTION_TYPES):
                raise _section_error(key, f"must be a string, number or true/false (sbatch --{_flag(str(name))}=VALUE)")
            out[name], raw[name] = value, key
        return out

    def options(self) -> dict[str, Option]:
        """The sbatch/srun options the section sets: ``{"mem-per-cpu": "4G", ...}``."""
        return {_flag(f): getattr(self, f) for f in self.model_fields_set if _flag(f) in OPTION_KEYS}


# one field per sbatch/srun option of OPTIONS
# not Optional: null is no value sbatch takes (false leaves a flag out)
_OPTION_FIELDS: dict[str, Any] = {
    _field(flag): (Option, Field(None, description=f"sbatch/srun {text}")) for flag, text in OPTIONS.items()
}
_Options = create_model("_Options", __base__=_OptionKeys, __module__=__name__, **_OPTION_FIELDS)


class SlurmPilotConfig(_Options):
    """``slurm.pilot``: the allocation held for a whole run (``allocation: pilot``); its sbatch
    options over the section's own (partition, account, qos, time...)."""

    ntasks: Optional[int] = Field(
        None,
        ge=1,
        strict=True,
        description="rank slots the pilot holds (--ntasks): the site's capacity; default: whole nodes (--exclusive)",
    )

    def slots(self) -> int | None:
        if self.ntasks:
            return self.ntasks
        nodes, per_node = self.nodes, self.ntasks_per_node  # type: ignore[attr-defined]  # _Options' fields, made by create_model
        if type(nodes) is int and type(per_node) is int:  # "2-4" nodes, or none: SLURM decides
            return nodes * per_node
        return None


class SlurmConfig(_Options):
    """The ``slurm:`` section: how gangs get their nodes, and sbatch/srun options for them."""

    allocation: Literal["per-stage", "pilot"] = Field(
        "per-stage",
        description="per-stage: every gang is a batch job of its own; pilot: one allocation held "
        "for the run (pilot:), every gang a job step on a share of it",
    )
    conf: Optional[str] = Field(
        None,
        description="SLURM_CONF for every SLURM command (a cluster other than "
        "the default one); ~ and $VARS are expanded",
    )
    mpi: Optional[str] = Field(None, description="srun --mpi=VALUE (communicator: mpi), e.g. pmix")
    prologue: list[str] = Field(
        default_factory=list,
        description="shell lines run before srun in every per-stage job's batch script (module load..., source a venv)",
    )
    sbatch_args: list[str] = Field(default_factory=list, description="further sbatch arguments, verbatim")
    srun_args: list[str] = Field(default_factory=list, description="further srun arguments, verbatim")
    srun_via: list[str] = Field(
        default_factory=list,
        description="a command the driver's srun of a pilot step runs under (argv before srun; it "
        "must pass the environment through), where the driver's own host is one the compute nodes "
        "cannot call back: srun listens for its tasks, e.g. the test bed's "
        "[tests/infra/multihost-exec, px-head]",
    )
    array: bool = Field(
        True,
        description="per-stage: one-rank gangs that start together (a fan-out's instances, "
        "independent stages; less than array_window apart) with the same sbatch options go as ONE "
        "job array (sbatch --array), each gang one array task; false: one job each",
    )
    array_window: float = Field(
        0.2,
        ge=0,
        allow_inf_nan=False,
        description="the job array is submitted once this many seconds pass without another "
        "one-rank gang joining (at most 10 windows); a gang that stays alone goes as a job of its own",
    )
    array_max: int = Field(
        1000,
        ge=1,
        strict=True,
        description="most tasks of one job array (keep it under the cluster's MaxArraySize, default 1001)",
    )
    poll_interval: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description="seconds between squeue calls (one call for all of the run's per-stage jobs: be kind to slurmctld)",
    )
    pending_timeout: Optional[float] = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="fail a gang (or the pilot) PENDING longer than this many "
        "seconds; default: wait (up to the site's start_timeout)",
    )
    job_name: str = Field(
        "phalanx",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="prefix of job and step names (the pilot's: JOB_NAME-pilot-...)",
    )
    pilot: Optional[SlurmPilotConfig] = Field(None, description="allocation: pilot — the held allocation")

    @classmethod
    def known_keys(cls) -> list[str]:
        fields = list(cls.model_fields)
        own = [f for f in fields if _flag(f) not in OPTION_KEYS]
        return own + [f for f in fields if f not in own] + list(_ALIASES)

    def slots(self) -> int | None:
        """The pilot's ntasks in pilot mode (the run's rank slots); None per stage."""
        if self.allocation != "pilot":
            return None
        return (self.pilot or SlurmPilotConfig()).slots()

    def pilot_config(self) -> SlurmPilotConfig:
        """The pilot's sbatch options and ntasks: the section's options, less those that size
        one gang, under the pilot's own keys."""
        per_gang = ("cpus-per-task", "nodes", "ntasks-per-node")
        base = {_field(k): v for k, v in self.options().items() if k not in per_gang}
        own = self.pilot.model_dump(exclude_unset=True) if self.pilot else {}
        return SlurmPilotConfig.model_validate({**base, **own})


__all__ = ["OPTIONS", "OPTION_KEYS", "STEP_OPTIONS", "SlurmConfig", "SlurmPilotConfig"]
