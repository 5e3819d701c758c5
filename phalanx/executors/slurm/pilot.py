"""The pilot allocation: one SLURM allocation held for many gangs (``allocation: pilot``).

A run's pilot belongs to its ``SlurmExecutor``: made when the run's first gang needs it,
shared by that executor's gangs only, cancelled by its ``close_run`` — never by another run
in the same process.

A pilot started for a driver's gangs ends with that driver: its batch script holds a TCP
connection to a listener of the driver (``network.Beacon``, on the address the ranks reach the
driver at) and exits when it closes — the driver exited or was killed — so SLURM ends the
job and every step on it.  The run DB has its record too (``commands.allocation``).
"""

from __future__ import annotations

import shlex
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import GangError
from ...paths import default_log_root
from ..base import AllocationHook, held, released
from ..network import Beacon
from .commands import HOPELESS, JobInfo, SlurmCommands, _hopeless, _option_args, _site, _wait_inactive, allocation
from .config import SlurmConfig, SlurmPilotConfig

# The pilot's holder: connected to the driver's beacon, it ends when the driver does.
_HOLDER = """import socket, sys, time
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
except OSError as e:
    print(f"phalanx pilot: cannot reach the driver at {sys.argv[1]}:{sys.argv[2]} ({e}); "
          "holding the allocation until cancelled", flush=True)
    while True:
        time.sleep(3600)
s.settimeout(None)
s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a driver host that vanishes: ~1 min
for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
    if hasattr(socket, opt):
        s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
try:
    while s.recv(1):
        pass
except OSError:  # keepalive gave up
    pass
print("phalanx pilot: the driver is gone; ending the allocation", flush=True)
"""


class SlurmPilot:
    """One allocation held for many gangs: a batch job that only sleeps, whose nodes the gangs
    use as job steps (``srun --jobid=J --exact``).

    >>> with SlurmPilot({"nodes": 2, "ntasks": 8, "time": "1:00:00"}) as pilot:
    ...     gang = px.Gang(4, executor=SlurmStepLauncher(pilot))

    A run's pilot is made by its ``SlurmExecutor`` (``from_config``), which also closes it.
    """

    def __init__(
        self,
        options: SlurmPilotConfig | Mapping[str, Any] | None = None,
        *,
        conf: str | None = None,
        site: str = "slurm",
        sbatch_args: Sequence[str] = (),
        prologue: Sequence[str] = (),
        job_name: str = "phalanx-pilot",
        poll_interval: float = 0.5,
        start_timeout: float | None = None,
        hook: AllocationHook | None = None,
    ):
        """``options``: the pilot's sbatch options and ``ntasks`` (a ``slurm.pilot`` section);
        ``hook``: told when the pilot is submitted and gone (a run's; without one, the hook
        of the gang that starts it)."""
        config = (
            options if isinstance(options, SlurmPilotConfig) else SlurmPilotConfig.model_validate(dict(options or {}))
        )
        self.ntasks = config.ntasks
        self.options = config.options()
        self.slurm = SlurmCommands(conf)
        self.site = site
        self.sbatch_args = list(sbatch_args)
        self.prologue = list(prologue)
        self.job_name = job_name
        self.poll_interval = poll_interval
        self.start_timeout = start_timeout
        self.hook = hook
        self.job_id: str | None = None
        self.info: JobInfo | None = None
        self.log_dir: Path | None = None
        self._lock = threading.Lock()
        self._closing = False  # close() waits for the lock: a start() waiting in the queue gives up
        self._hook: AllocationHook | None = None  # the hook told of the current job
        self._record: dict | None = None
        self._beacon: Beacon | None = None

    @classmethod
    def from_config(cls, config: SlurmConfig, site: str = "slurm", hook: AllocationHook | None = None) -> SlurmPilot:
        """The pilot a ``slurm:`` section describes: its ``pilot:`` keys over the section's
        partition/account/qos/time... (see ``SlurmConfig.pilot_config``)."""
        return cls(
            config.pilot_config(),
            conf=config.conf,
            site=site,
            sbatch_args=config.sbatch_args,
            prologue=config.prologue,
            job_name=f"{config.job_name}-pilot",
            poll_interval=config.poll_interval,
            start_timeout=config.pending_timeout,
            hook=hook,
        )

    @classmethod
    def from_site(cls, slurm_section: Mapping[str, Any], site: str = "slurm") -> SlurmPilot:
        """``from_config`` of a section given as a mapping."""
        return cls.from_config(SlurmConfig.model_validate(dict(slurm_section)), site)

    @property
    def running(self) -> bool:
        return self.job_id is not None and self.info is not None and self.info.state == "RUNNING"

    def start(
        self, timeout: float | None = None, *, hook: AllocationHook | None = None, driver: str | None = None
    ) -> SlurmPilot:
        """Submit the holder job and wait until it is RUNNING; a pilot that ended (its time
        limit, a node failure) is replaced by a fresh one.  ``hook``: told of the job unless
        the pilot has its own (a gang's allocation hook); ``driver``: "host:port" the nodes
        reach this driver at (a gang's control address) — the pilot then ends when this
        process does.  ``close`` from another thread ends the wait (GangError)."""
        with self._lock:
            job_id = self.job_id
            if job_id is not None:
                self.info = info = self.slurm.job(job_id)
                if info.state == "RUNNING":
                    return self
                if not (info.active or info.state == "UNKNOWN"):  # it ended: a fresh pilot
                    job_id = None
            if job_id is None:
                self._forget()
                job_id = self._submit(self.hook if self.hook is not None else hook, driver)
            timeout = timeout if timeout is not None else self.start_timeout
            deadline = time.monotonic() + timeout if timeout else None
            wait = 0.05
            while True:
                self.info = info = self.slurm.job(job_id)
                if info.state == "RUNNING":
                    return self
                if info.state == "PENDING" and info.reason in HOPELESS:
                    self.slurm.cancel(job_id)
                    raise GangError(_hopeless(info, self.site, "pilot "))
                if not info.active and info.state != "UNKNOWN":
                    raise GangError(
                        f"slurm: pilot {info.describe()}{_site(self.site)}; its log: {self.log_dir}/pilot-{job_id}.log"
                    )
                if self._closing:  # the run ended while the pilot queued
                    raise GangError(f"slurm: pilot {info.describe()} closed before it started{_site(self.site)}")
                if deadline is not None and time.monotonic() > deadline:
                    self.slurm.cancel(job_id)
                    raise GangError(f"slurm: pilot {info.describe()} for more than {timeout:.0f} s{_site(self.site)}")
                time.sleep(wait)
                wait = min(wait * 2, self.poll_interval)

    def _submit(self, hook: AllocationHook | None, driver: str | None) -> str:
        """Submit the holder job; its id (also ``self.job_id``)."""
        self.log_dir = default_log_root().parent / "slurm-pilots"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.job_name}-{uuid.uuid4().hex[:12]}"  # unique: released by name
        args = [
            f"--job-name={name}",
            f"--output={self.log_dir}/pilot-%j.log",
            "--no-requeue",
            *_option_args(self.options),
        ]
        if self.ntasks:
            args.append(f"--ntasks={self.ntasks}")
        elif "ntasks-per-node" not in self.options:
            args.append("--exclusive")  # no size given: whole nodes
        hold = "exec sleep infinity"
        if driver:
            self._beacon = Beacon(driver.rpartition(":")[0])
            hold = "exec " + shlex.join([sys.executable, "-c", _HOLDER, *map(str, self._beacon.address)])
        body = "\n".join(
            ["#!/bin/sh", "# phalanx pilot: holds the allocation; gangs run as its job steps", *self.prologue, hold, ""]
        )
        self._hook, self._record = hook, allocation("pilot", name, self.slurm)
        held(hook, self._record)  # before sbatch: see base.held
        try:
            # no script file: sbatch reads the script from its stdin
            self.job_id = job_id = self.slurm.submit(args + self.sbatch_args, self.slurm.env(), self.site, body)
        except BaseException:
            self._forget()
            raise
        self._record = {**self._record, "job": job_id}
        held(hook, self._record)
        self.info = None
        return job_id

    def _forget(self) -> None:
        """The pilot's job is gone: tell the hook, close the beacon."""
        record, self._record = self._record, None
        if record is not None:
            released(self._hook, record)
        beacon, self._beacon = self._beacon, None
        if beacon is not None:
            beacon.close()

    def status(self) -> str:
        if self.job_id is None:
            return "slurm: pilot not started"
        self.info = self.slurm.job(self.job_id)
        return f"slurm: pilot {self.info.describe()}"

    def close(self) -> None:
        """Cancel the allocation (every gang still on it ends) and wait until it is gone."""
        self._closing = True
        try:
            with self._lock:
                job, self.job_id = self.job_id, None
        finally:
            self._closing = False
        if job is None:
            return
        self.slurm.cancel(job)
        if not _wait_inactive(self.slurm, job, 15.0).active:
            with self._lock:
                self._forget()

    def __enter__(self) -> SlurmPilot:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SlurmPilot job={self.job_id} {self.info.state if self.info else '-'}>"
