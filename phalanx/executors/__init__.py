"""Gang backends behind one interface (``base.Launcher``), picked by name."""

from .._registry import Registry
from .base import Launcher

executors = Registry("executor")
executors.register("local", "phalanx.executors.local:LocalLauncher")
executors.register("mpirun", "phalanx.executors.mpirun:MPIRunLauncher")
executors.register("slurm", "phalanx.executors.slurm:SlurmLauncher")
executors.register("ray", "phalanx.executors.ray:RayLauncher", extra="ray")

__all__ = ["Launcher", "executors"]
