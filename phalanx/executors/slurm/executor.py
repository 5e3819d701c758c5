"""``SlurmExecutor``: the ``slurm`` executor — gangs as the tasks of one ``srun`` each, in a
batch job of their own or as job steps of the run's pilot (see the package docstring)."""

from __future__ import annotations

import logging
import math
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import GangError
from ..base import PROBE_S, AllocationHook, Capabilities, Echo, Executor, ExecutorConfig, gpu_key
from .arrays import ArrayBatcher
from .commands import JobWatcher, SlurmCommands, _does_not_fit, _site, release
from .config import Option, SlurmConfig, SlurmPilotConfig
from .launcher import SlurmJobLauncher, SlurmLauncher, SlurmStepLauncher
from .pilot import SlurmPilot

log = logging.getLogger("phalanx.executors.slurm")


class SlurmExecutor(Executor[SlurmConfig]):
    """Gangs on a SLURM cluster, through its commands.  ``allocation: per-stage``: every gang is
    a batch job; ``allocation: pilot``: every gang is a job step of the run's pilot.

    The pilot is run-scoped: made when this executor's first pilot gang needs it (its first
    gang starts it, so the pilot's holder can watch that driver), shared by this executor's
    gangs only, cancelled by ``close_run``.  Two executors (two runs in one process) hold two
    pilots and never close each other's.
    """

    name = "slurm"
    config_model = SlurmConfig
    capabilities = Capabilities(
        reuse_gangs=False, pins_cpus=False, warm_pool=False, runs_commands=True, mpi_world=True, remote_ranks=True
    )
    release = staticmethod(release)

    def __init__(
        self,
        config: SlurmConfig | Mapping[str, Any] | None = None,
        *,
        site: str | None = None,
        cores: int | None = None,
        rank_memory: int | None = None,
        pilot: SlurmPilot | None = None,
    ):
        """``pilot``: a pilot the caller started and closes (default: the run's own, made on
        first use).  Raises ValueError when the site's ``cores`` are more than the pilot holds."""
        super().__init__(config, site=site, cores=cores, rank_memory=rank_memory)
        self._pilot = pilot
        self._owns_pilot = pilot is None
        self._lock = threading.Lock()
        # per-stage jobs: SLURM's commands, one squeue for all live jobs, and the job arrays of
        # one-rank gangs — per cluster (a stage may name another slurm.conf)
        self._commands: dict[str | None, tuple[SlurmCommands, JobWatcher]] = {}
        self._batchers: dict[tuple, ArrayBatcher] = {}
        held = self._held_slots()
        if cores and held and cores > held:
            raise ValueError(
                f"cores: {cores} is more than the {held} tasks the pilot holds (slurm.pilot.ntasks): "
                "gangs would wait for slots it does not have; leave cores out (the pilot's ntasks "
                "are the site's slots) or raise slurm.pilot.ntasks"
            )

    # ---- run scope --------------------------------------------------------------------------
    def open_run(self, hook: AllocationHook | None = None, demand: Any = None, warm: int = 0) -> None:
        super().open_run(hook, demand, warm)
        with self._lock:
            if self._pilot is not None and self._owns_pilot:
                self._pilot.hook = hook

    def serves_store(self) -> bool:
        """A pilot runs a store service on each of its nodes; per-stage jobs run none."""
        return self.config.allocation == "pilot"

    def probe(self) -> None:
        """``scontrol ping``: the site's controller answers (UP), else a GangError in its words."""
        slurm = SlurmCommands(self.config.conf)
        try:
            r = slurm.run("scontrol", "ping", timeout=PROBE_S)
        except subprocess.TimeoutExpired:
            raise GangError(f"site {self.site!r} (slurm): 'scontrol ping' gave no answer in {PROBE_S:g} s") from None
        said = " ".join((r.stdout + r.stderr).split())
        if r.returncode != 0 or " is UP" not in r.stdout:
            where = f" (SLURM_CONF={slurm.conf})" if slurm.conf else ""
            raise GangError(f"site {self.site!r} (slurm): the controller does not answer{where}: {said}")

    def pilot(self) -> SlurmPilot:
        """The pilot this executor's gangs share: the run's own, made (not started) on first
        use, or the one given to ``__init__``."""
        with self._lock:
            if self._pilot is None:
                self._pilot = SlurmPilot.from_config(self.config, self.site, hook=self.hook)
            return self._pilot

    def close_run(self) -> None:
        """Cancel the run's pilot, if it made one (gangs still on it end with it)."""
        with self._lock:
            pilot = self._pilot if self._owns_pilot else None
            if self._owns_pilot:
                self._pilot = None
        if pilot is not None:
            try:
                pilot.close()
            except Exception as exc:  # the controller is gone: the run DB and the exit handler hold it
                log.warning("could not cancel the pilot %s%s: %s", pilot.job_id, _site(self.site), exc)

    # ---- gangs ------------------------------------------------------------------------------
    def _pilot_slots(self) -> int | None:
        """Rank slots the pilot holds (its ntasks), if known."""
        if not self._owns_pilot and self._pilot is not None:
            return self._pilot.ntasks
        return (self.config.pilot or SlurmPilotConfig()).slots()

    def _held_slots(self) -> int | None:
        """The pilot's slots in pilot mode; None per stage."""
        return self._pilot_slots() if self.config.allocation == "pilot" else None

    def capacity(self) -> int | None:
        """The site's cores, else the pilot's ntasks; per stage, None: SLURM queues the jobs."""
        return self.cores or self._held_slots()

    def stage_config(self, override: ExecutorConfig | Mapping[str, Any] | None = None) -> SlurmConfig:
        # a mapping is read as a section first: its keys in SLURM's spellings (ranks-per-node)
        # then meet the site's by field name
        if override and not isinstance(override, ExecutorConfig):
            override = self.config_model.model_validate(dict(override))
        return super().stage_config(override)

    def with_gpus(self, config: SlurmConfig, gpus_per_rank: int | None) -> SlurmConfig:
        """``--gpus-per-task`` of the gang's job, or of its pilot step."""
        return gpu_key(config, "gpus_per_task", gpus_per_rank, "slurm.gpus_per_task")

    def check(self, ranks: int, config: SlurmConfig | None = None) -> None:
        cfg = self.effective_config(config)
        if cfg.allocation == "pilot":
            if cfg.pilot != self.config.pilot:
                raise ValueError(
                    "slurm.pilot: the pilot is the run's (the site's slurm.pilot); a stage cannot change it"
                )
            if cfg.conf != self.config.conf:
                raise ValueError("slurm.conf: a pilot stage runs on the run's pilot, on the site's cluster")
            slots = self._pilot_slots()
            if slots and ranks > slots:
                raise GangError(_does_not_fit(ranks, slots, self.site))
        self._gang_options(ranks, cfg)

    def per_stage(self, cfg: SlurmConfig) -> tuple[SlurmCommands, JobWatcher]:
        """SLURM's commands for ``cfg``'s cluster and the watcher all per-stage jobs there share."""
        with self._lock:
            key = SlurmCommands(cfg.conf).conf
            if key not in self._commands:
                slurm = SlurmCommands(cfg.conf)
                self._commands[key] = (slurm, JobWatcher(slurm))
            return self._commands[key]

    def batcher(self, cfg: SlurmConfig) -> ArrayBatcher:
        """The batcher gathering this executor's one-rank gangs into job arrays (``cfg``'s
        cluster, window and size)."""
        slurm, _ = self.per_stage(cfg)
        key = (slurm.conf, cfg.array_window, cfg.array_max, cfg.job_name)
        with self._lock:
            if key not in self._batchers:
                self._batchers[key] = ArrayBatcher(
                    slurm, window=cfg.array_window, max_size=cfg.array_max, job_name=cfg.job_name
                )
            return self._batchers[key]

    def _gang_options(self, ranks: int, cfg: SlurmConfig) -> tuple[dict[str, Option], int]:
        """(sbatch/srun options, CPUs per rank) of one gang: nodes from ranks_per_node, and
        the site's memory per rank as --mem-per-cpu unless the section sets mem or mem_per_cpu."""
        options = cfg.options()
        cpus = _whole(options.pop("cpus-per-task", 1) or 1, "cpus_per_task")
        per_node = options.get("ntasks-per-node")
        if per_node and "nodes" not in options:
            options["nodes"] = max(1, math.ceil(ranks / _whole(per_node, "ntasks_per_node")))
        if self.rank_memory and (self.resized or not {"mem", "mem-per-cpu"} & set(options)):  # SLURM enforces it
            options.pop("mem", None)  # a retry after out of memory: its memory per rank wins
            options["mem-per-cpu"] = f"{max(1, self.rank_memory // cpus >> 20)}M"
        return options, cpus

    def rank_memory_for(self, config: SlurmConfig | None = None) -> int | None:
        """The memory per rank a gang gets: the section's mem_per_cpu × cpus_per_task where it
        sets one, else the site's share (``rank_memory``); None where neither says (SLURM's
        default, or a per-node --mem)."""
        options, cpus = self._gang_options(1, self.effective_config(config))
        given = options.get("mem-per-cpu")
        return _megabytes(str(given)) * cpus << 20 if given is not None else self.rank_memory

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: SlurmConfig | None = None, echo: Echo = False
    ) -> SlurmLauncher:
        """A per-stage job's launcher, or a pilot step's on ``pilot()``; ``slots`` are not used
        (SLURM places the ranks)."""
        cfg = self.effective_config(config)
        options, cpus = self._gang_options(ranks, cfg)
        common = dict(
            site=self.site,
            options=options,
            cpus_per_rank=cpus,
            mpi=cfg.mpi,
            srun_args=cfg.srun_args,
            poll_interval=cfg.poll_interval,
            pending_timeout=cfg.pending_timeout,
            job_name=cfg.job_name,
        )
        launcher: SlurmLauncher
        if cfg.allocation == "pilot":
            launcher = SlurmStepLauncher(self.pilot(), echo, srun_via=cfg.srun_via, **common)
        else:
            slurm, watcher = self.per_stage(cfg)
            launcher = SlurmJobLauncher(
                echo,
                slurm=slurm,
                prologue=cfg.prologue,
                sbatch_args=cfg.sbatch_args,
                arrays=self.batcher(cfg) if cfg.array and ranks == 1 else None,
                watcher=watcher,
                **common,
            )
        launcher.allocation_hook = self.hook
        return launcher


def _whole(value: Option, key: str) -> int:
    """A count sbatch takes (``cpus_per_task: 2``) as an int; ValueError naming the key."""
    text = str(value)
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"slurm.{key}: must be a whole number ≥ 1, not {value!r}")
    return int(text)


def _megabytes(value: str) -> int:
    """SLURM's memory size ("512", "512M", "2G", "1T"; MB without a unit) in MB."""
    number, unit = value.strip().upper(), "M"
    if number and number[-1] in "KMGT":
        number, unit = number[:-1], number[-1]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"slurm mem_per_cpu {value!r} is not a memory size (512M, 2G...)") from None
    return max(1, int(amount * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[unit]))
