"""Gang backends behind one interface (``base.Launcher``), picked by name."""

from .._registry import Registry
from .base import AllocationHook, Launcher

executors = Registry("executor")
executors.register("local", "phalanx.executors.local:LocalLauncher")
executors.register("mpirun", "phalanx.executors.mpirun:MPIRunLauncher")
executors.register("slurm", "phalanx.executors.slurm:SlurmLauncher")
executors.register("ray", "phalanx.executors.ray:RayLauncher", extra="ray")

# Per executor that allocates on a resource manager: ``release(record) -> str``, which frees
# an allocation recorded by ``base.held`` from any process (one a killed driver left).
releasers = Registry("allocation owner")
releasers.register("slurm", "phalanx.executors.slurm:release")
releasers.register("ray", "phalanx.executors.ray:release", extra="ray")


def release(record: dict) -> str:
    """Free an allocation a driver recorded (``base.held``); a human line such as
    "slurm: scancel job 42" or "slurm: job phalanx-... already gone"."""
    return releasers.load(record["executor"])(record)


__all__ = ["AllocationHook", "Launcher", "executors", "release"]
