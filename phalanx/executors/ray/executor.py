"""``RayExecutor``: the Ray backend as the registry sees it — its config model, capabilities,
capacity, and a ``RayLauncher`` per gang."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import PhalanxError
from ..base import Capabilities, Echo, Executor, same_number
from .config import RayConfig, ray_config
from .connection import connect, connected
from .launcher import RayLauncher
from .release import release
from .services import StoreServices

log = logging.getLogger("phalanx.executors.ray")


class RayExecutor(Executor[RayConfig]):
    """Gangs are placement groups of a Ray cluster, one actor per rank.

    Run scope: ``open_run`` connects to the cluster when the site gives no ``cores`` (the
    capacity is then the cluster's CPUs; a failure to connect is left to the first gang, whose
    stage fails with it), else the first gang connects.  The connection is the process's and
    stays (Ray has one per process, other runs may use it); ``close_run`` ends only what this
    executor's gangs still hold — their placement groups and actors.
    """

    name = "ray"
    config_model = RayConfig
    capabilities = Capabilities(reuse_gangs=True, runs_commands=True, remote_ranks=True)
    release = staticmethod(release)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._launchers: weakref.WeakSet[RayLauncher] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.services = StoreServices(self.site)  # one store service per node, for this run

    def open_run(self, hook=None, demand=None, warm: int = 0) -> None:
        super().open_run(hook, demand, warm)
        if not self.cores:  # the capacity is the cluster's: know it before the first stage
            c = self.config
            try:
                connect(c.address, c.namespace, c.init, site=self.site)
            except Exception as exc:  # the first gang tries again and fails its stage with this
                log.warning("%s", exc)

    def serves_store(self) -> bool:
        """Each node of a run gets a store service (``self.services``)."""
        return True

    def close_run(self) -> None:
        with self._lock:
            holding = [launcher for launcher in self._launchers if launcher.holds]
        for launcher in holding:  # gangs nobody closed (a driver error between start and close)
            launcher.kill(grace_s=0)
        self.services.close()

    def capacity(self) -> int | None:
        """The site's ``cores``, else — once this process is connected — the cluster's CPUs
        over ``cpus_per_rank``; None before (or where the cluster has none yet: an autoscaling
        one starting from zero workers; give such a site ``cores``)."""
        if self.cores:
            return self.cores
        ray = connected()
        if ray is None:
            return None
        try:
            cpus = float(ray.cluster_resources().get("CPU", 0))
        except Exception:
            return None
        return int(cpus // self.config.cpus_per_rank) or None

    def with_gpus(self, config: RayConfig, gpus_per_rank: int | None) -> RayConfig:
        """``GPU`` in every rank's bundle: its actor's ``num_gpus``."""
        if gpus_per_rank is None:
            return config
        bundles = config.resources if isinstance(config.resources, list) else [config.resources]
        for bundle in bundles:
            if "GPU" in bundle and not same_number(bundle["GPU"], gpus_per_rank):
                raise ValueError(
                    f"gpus_per_rank: {gpus_per_rank}, but ray.resources gives GPU: {bundle['GPU']}; "
                    "they disagree: give gpus_per_rank only"
                )
        if not gpus_per_rank or all("GPU" in b for b in bundles):
            return config
        with_gpu = [{**b, "GPU": gpus_per_rank} for b in bundles]
        resources = with_gpu if isinstance(config.resources, list) else with_gpu[0]
        return self._validate({**config.model_dump(exclude_unset=True), "resources": resources})

    def check(self, ranks: int, config: RayConfig | Mapping[str, Any] | None = None) -> None:
        """A resources list that does not give one bundle per rank (nothing is asked of Ray)."""
        cfg = ray_config(config if config is not None else self.config, self.site)
        try:
            cfg.bundles(ranks)
        except ValueError as exc:
            raise PhalanxError(f"site {self.site!r} (ray): {exc}") from None

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: RayConfig | None = None, echo: Echo = False
    ) -> RayLauncher:
        """A launcher for one gang of ``ranks`` (``slots`` mean nothing to Ray: it places the
        bundles), telling the run's allocation hook of its placement group."""
        cfg = ray_config(self.effective_config(config), self.site)
        self.check(ranks, cfg)
        launcher = RayLauncher(cfg, echo=echo, site=self.site)
        launcher.allocation_hook = self.hook
        launcher.services = self.services
        with self._lock:
            self._launchers.add(launcher)
        return launcher
