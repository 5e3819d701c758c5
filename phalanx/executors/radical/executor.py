"""``RadicalExecutor``: the ``radical`` executor — one RADICAL-Pilot pilot per run, every gang a
task with ``ranks = N`` on it (see the package docstring)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import GangError
from ..base import AllocationHook, Capabilities, Echo, Executor, gpu_key
from .config import PILOT_KEYS, RadicalConfig
from .launcher import RadicalLauncher
from .pilot import RadicalPilot, release


class RadicalExecutor(Executor[RadicalConfig]):
    """Gangs as tasks of the run's RADICAL-Pilot pilot.

    The pilot is run-scoped: submitted by ``open_run`` (in the background: an RP session takes
    seconds, a pilot more to become active — the first gang waits for it within its start
    timeout), shared by the run's gangs only, cancelled by ``close_run``.  Two runs in one
    process hold two pilots on the process's one RP session and never close each other's.
    A gang that outlives its stage serves the next one of its size (``reuse_gangs``): its
    task keeps running and its ranks' output goes to the next stage's logs.
    """

    name = "radical"
    config_model = RadicalConfig
    capabilities = Capabilities(
        reuse_gangs=True, pins_cpus=False, warm_pool=False, runs_commands=True, mpi_world=False, remote_ranks=True
    )
    release = staticmethod(release)

    def __init__(
        self,
        config: RadicalConfig | Mapping[str, Any] | None = None,
        *,
        site: str | None = None,
        cores: int | None = None,
        rank_memory: int | None = None,
    ):
        super().__init__(config, site=site, cores=cores, rank_memory=rank_memory)
        self._pilot: RadicalPilot | None = None
        self._lock = threading.Lock()
        if cores and self.config.cores and cores * self.config.cores_per_rank > self.config.cores:
            raise ValueError(
                f"cores: {cores} ranks of {self.config.cores_per_rank} cores are more than the "
                f"{self.config.cores} cores the pilot holds (radical.cores): leave cores out or "
                "raise radical.cores"
            )

    # ---- run scope --------------------------------------------------------------------------
    def open_run(self, hook: AllocationHook | None = None, demand: Any = None, warm: int = 0) -> None:
        """Submit the run's pilot (in the background)."""
        super().open_run(hook, demand, warm)
        with self._lock:
            if self._pilot is None or self._pilot.closed:
                self._pilot = RadicalPilot(self.config, self.site, self.cores, hook=hook)
            self._pilot.submit()

    def pilot(self) -> RadicalPilot:
        """The run's pilot (submitted on first use when ``open_run`` was not called)."""
        with self._lock:
            if self._pilot is None or self._pilot.closed:
                self._pilot = RadicalPilot(self.config, self.site, self.cores, hook=self.hook)
            return self._pilot.submit()

    def close_run(self) -> None:
        """Cancel the run's pilot and end what still runs on it."""
        with self._lock:
            pilot, self._pilot = self._pilot, None
        if pilot is not None:
            pilot.close()

    # ---- gangs ------------------------------------------------------------------------------
    def capacity(self) -> int | None:
        """The site's cores, else the pilot's cores over ``cores_per_rank``."""
        return self.cores or self.config.slots()

    def with_gpus(self, config: RadicalConfig, gpus_per_rank: int | None) -> RadicalConfig:
        """``gpus_per_rank`` of the gang's task description."""
        return gpu_key(config, "gpus_per_rank", gpus_per_rank, "radical.gpus_per_rank")

    def check(self, ranks: int, config: RadicalConfig | None = None) -> None:
        cfg = self.effective_config(config)
        changed = [k for k in PILOT_KEYS if getattr(cfg, k) != getattr(self.config, k)]
        if changed:
            raise ValueError(
                f"radical.{changed[0]}: the pilot is the run's (the site's radical section); a stage cannot change it"
            )
        cores = cfg.pilot_cores(self.cores)
        if cores and ranks * cfg.cores_per_rank > cores:
            raise GangError(
                f"radical: a gang of {ranks} ranks of {cfg.cores_per_rank} cores does not fit the "
                f"pilot's {cores} cores (site {self.site!r}): raise radical.cores"
            )

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: RadicalConfig | None = None, echo: Echo = False
    ) -> RadicalLauncher:
        """A launcher for one gang on the run's pilot; ``slots`` are not used (RP's agent places
        the ranks on the pilot's cores)."""
        cfg = self.effective_config(config)
        memory = max(1, self.rank_memory >> 20) if self.rank_memory else None
        launcher = RadicalLauncher(self.pilot(), cfg, site=self.site, echo=echo, rank_memory_mb=memory)
        launcher.allocation_hook = self.hook
        return launcher


__all__ = ["RadicalExecutor"]
