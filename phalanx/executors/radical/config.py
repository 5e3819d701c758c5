"""The ``radical:`` section of a site file (and of a stage, over the site's), as a typed model.

Light on purpose: pydantic and ``executors.base`` only — never ``radical.pilot`` — so ``phalanx
validate`` and the published JSON Schemas read it where the extra is not installed.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from ..base import ExecutorConfig

# keys of the pilot (the run's allocation): the site's; a stage cannot change them
PILOT_KEYS = (
    "resource",
    "access_schema",
    "queue",
    "project",
    "cores",
    "nodes",
    "gpus",
    "runtime",
    "sandbox",
    "resource_config",
    "interface",
    "venv",
    "pilot_timeout",
    "job_name",
)
_RESOURCE = re.compile(r"^[A-Za-z0-9_]+\.[A-Za-z0-9_.-]+$")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class RadicalConfig(ExecutorConfig):
    """The ``radical:`` section: which RADICAL-Pilot resource the run's pilot is submitted to and
    what it holds, and what every gang's task asks of it.  A stage's own ``radical:`` section
    overrides the per-gang keys (``cores_per_rank``, ``gpus_per_rank``, ``pre_exec``,
    ``pre_launch``, ``env``, ``mem_per_rank``) for its gangs; the pilot is the run's."""

    # ---- the pilot: one per run ---------------------------------------------------------
    resource: str = Field(
        "local.localhost",
        description="RADICAL-Pilot resource label of the pilot (`<site>.<machine>`, as in "
        "RP's resource_*.json): local.localhost runs the agent here by fork; e.g. tacc.frontera submits a "
        "batch job",
    )
    access_schema: Optional[str] = Field(
        None, description="RP access schema of the resource (local, ssh, batch...); default: the resource's own"
    )
    queue: Optional[str] = Field(None, description="batch queue (partition) of the pilot's job")
    project: Optional[str] = Field(None, description="project (account) the pilot's job is charged to")
    cores: Optional[int] = Field(
        None,
        ge=1,
        strict=True,
        description="cores the pilot holds; the site's rank slots are cores / "
        "cores_per_rank.  Default (without nodes): the site's cores x cores_per_rank, else this machine's "
        "cores on local.* resources (cores or nodes is required elsewhere)",
    )
    nodes: Optional[int] = Field(None, ge=1, strict=True, description="nodes of the pilot (instead of cores)")
    gpus: int = Field(0, ge=0, strict=True, description="GPUs the pilot holds")
    runtime: int = Field(
        60,
        ge=1,
        strict=True,
        description="the pilot's walltime in minutes: its agent ends after it, and with it every gang still on it",
    )
    sandbox: Optional[str] = Field(
        None,
        description="where RP puts the pilot's sandbox (agent files, task scripts, the ranks' spooled "
        "output): a directory the resource's nodes and the driver share; ~ and $VARS expanded.  Default: "
        "$PHALANX_STATE/radical (the state directory, private to you)",
    )
    resource_config: dict[str, Any] = Field(
        default_factory=dict,
        description="keys merged over RP's own config of `resource` (cores_per_node, "
        "gpus_per_node, launch_methods, task_pre_launch, pre_bootstrap_0, virtenv...).  On local.* resources "
        "cores_per_node defaults to this machine's cores (RP's 8 fake cores make OpenMPI bind to cores that do "
        "not exist) and gpus_per_node to 0",
    )
    interface: Optional[str] = Field(
        None,
        description="network interface RP's ZeroMQ endpoints are advertised on and bound to (lo: "
        "loopback only, the pilot's agent and the driver on one host; ib0, hsn0...: an HPC network).  Default: "
        "RP's own choice, bound on every interface",
    )
    venv: Union[Literal["auto", "none"], str] = Field(
        "auto",
        description="the Python environment RP's client components and a local agent start from "
        "(VIRTUAL_ENV and PATH for them): auto: the driver's own venv when it runs in one; none: the "
        "environment as it is; or a path",
    )
    pilot_timeout: Optional[float] = Field(
        None,
        gt=0,
        description="seconds the pilot may take to become active (bootstrap, batch queue); "
        "default: the gang's start timeout (the site's start_timeout)",
    )
    job_name: str = Field("phalanx", pattern=_NAME, max_length=40, description="prefix of pilot and task ids (RP uids)")

    # ---- every gang: one task with ranks = N ---------------------------------------------
    cores_per_rank: int = Field(1, ge=1, strict=True, description="cores of every rank (its thread count too)")
    gpus_per_rank: float = Field(0, ge=0, description="GPUs of every rank")
    mem_per_rank: Optional[int] = Field(
        None,
        ge=1,
        strict=True,
        description="MB of memory per rank the agent reserves; default: the site's memory_gb over its slots",
    )
    pre_launch: list[str] = Field(
        default_factory=list,
        description="shell lines the agent runs before it launches a gang's ranks (before mpiexec/srun: MPI settings)",
    )
    pre_exec: list[str] = Field(
        default_factory=list,
        description="shell lines every rank runs before its program (module load, conda activate...)",
    )
    env: dict[str, str] = Field(default_factory=dict, description="further environment of every rank")

    @field_validator("resource")
    @classmethod
    def _label(cls, value: str) -> str:
        if not _RESOURCE.match(value):
            raise ValueError(f"{value!r} is not an RP resource label: <site>.<machine>, e.g. local.localhost")
        return value

    @field_validator("interface")
    @classmethod
    def _iface(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", value):
            raise ValueError(f"{value!r} is not a network interface name (lo, eth0, ib0...)")
        return value

    # ---- derived -------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        """The pilot's agent runs on this machine (RP's ``local.*`` resources)."""
        return self.resource.split(".", 1)[0] == "local"

    def pilot_cores(self, site_cores: int | None = None) -> int | None:
        """Cores the pilot asks for: ``cores``, else the site's, else this machine's (local)."""
        if self.cores:
            return self.cores
        if self.nodes:
            return None  # nodes x RP's cores_per_node (the site's cores only cap what phalanx uses)
        if site_cores:
            return site_cores * self.cores_per_rank
        return (os.cpu_count() or 1) if self.local else None

    def slots(self) -> int | None:
        cores = self.pilot_cores()
        return cores // self.cores_per_rank if cores else None

    def pilot_section(self) -> dict[str, Any]:
        """The pilot's keys as the site gives them (a stage may not change these)."""
        return {k: getattr(self, k) for k in PILOT_KEYS}


SITE_KEYS = tuple(RadicalConfig.known_keys())

__all__ = ["PILOT_KEYS", "RadicalConfig", "SITE_KEYS"]
