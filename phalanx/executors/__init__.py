"""Gang backends behind one interface (``base.Launcher``), picked by name."""

from .._registry import Registry
from .base import Launcher

executors = Registry("executor")
executors.register("local", "phalanx.executors.local:LocalLauncher")

__all__ = ["Launcher", "executors"]
