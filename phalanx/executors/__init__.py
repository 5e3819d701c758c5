"""Where gangs run: one ``Executor`` per kind of place, picked by name from a registry.

A backend is one module with an ``Executor`` subclass (its typed config model, capabilities
and launcher factory), one ``executors.register`` line here — or, from another package, an
entry point in the group ``phalanx.executors`` — and a site file naming it.  The scheduler,
``px.Gang`` and the site model only ever ask this registry (see docs/executors.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._registry import Registry
from .base import AllocationHook, Capabilities, Executor, ExecutorConfig, Launcher

executors = Registry("executor", group="phalanx.executors")
# config=: the model of the site's section, importable without the backend's extra (so a
# site file can be validated where ray is not installed)
executors.register("local", "phalanx.executors.local:LocalExecutor", config="phalanx.executors.local:LocalConfig")
executors.register("mpirun", "phalanx.executors.mpirun:MPIRunExecutor", config="phalanx.executors.mpirun:MPIRunConfig")
executors.register(
    "slurm", "phalanx.executors.slurm:SlurmExecutor", config="phalanx.executors.slurm.config:SlurmConfig"
)
executors.register(
    "ray", "phalanx.executors.ray:RayExecutor", extra="ray", config="phalanx.executors.ray.config:RayConfig"
)
executors.register(
    "kubernetes",
    "phalanx.executors.kubernetes:KubernetesExecutor",
    extra="kubernetes",
    config="phalanx.executors.kubernetes.config:KubernetesConfig",
)
executors.register(
    "radical",
    "phalanx.executors.radical:RadicalExecutor",
    extra="radical",
    config="phalanx.executors.radical.config:RadicalConfig",
)

DEFAULT = "local"  # a gang or site that names no executor
DEFAULT_MPI = "mpirun"  # ... with communicator mpi: MPI ranks must be started by an MPI launcher


def config_model(name: str) -> type[ExecutorConfig]:
    """The model of executor ``name``'s site section (without importing its backend's extra)."""
    return executors.load(name, "config") or executors.load(name).config_model


def capabilities(name: str) -> Capabilities:
    return executors.load(name).capabilities


def create(name: str, config: ExecutorConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> Executor[Any]:
    """Executor ``name`` with the site section ``config`` (``kwargs``: site, cores, rank_memory)."""
    return executors.load(name)(config, **kwargs)


def release(record: dict) -> str:
    """Free an allocation a driver recorded (``base.held``); a human line such as
    "slurm: scancel job 42" or "slurm: job phalanx-... already gone"."""
    return executors.load(record["executor"]).release(record)


__all__ = [
    "AllocationHook",
    "Capabilities",
    "DEFAULT",
    "DEFAULT_MPI",
    "Executor",
    "ExecutorConfig",
    "Launcher",
    "capabilities",
    "config_model",
    "create",
    "executors",
    "release",
]
