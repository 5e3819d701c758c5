"""The pilot allocation: one SLURM allocation held for many gangs (``allocation: pilot``)."""

from __future__ import annotations

import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ...errors import GangError
from .commands import (HOPELESS, JobInfo, SlurmCommands, _hopeless, _norm, _option_args, _site,
                       _split_section, _wait_inactive)


class SlurmPilot:
    """One allocation held for many gangs: a batch job that only sleeps, whose nodes the gangs
    use as job steps (``srun --jobid=J --exact``).

    >>> with SlurmPilot({"nodes": 2, "ntasks": 8, "time": "1:00:00"}) as pilot:
    ...     gang = px.Gang(4, executor=SlurmLauncher(pilot=pilot, allocation="pilot"))
    """

    def __init__(self, options: Mapping[str, Any] | None = None, *, conf: str | None = None,
                 site: str = "slurm", sbatch_args: Sequence[str] = (), prologue: Sequence[str] = (),
                 job_name: str = "phalanx-pilot", poll_interval: float = 0.5,
                 start_timeout: float | None = None):
        opts, own = _split_section(options or {})
        self.ntasks = own.get("ntasks")
        self.options = opts
        self.slurm = SlurmCommands(conf)
        self.site = site
        self.sbatch_args = list(sbatch_args)
        self.prologue = list(prologue)
        self.job_name = job_name
        self.poll_interval = poll_interval
        self.start_timeout = start_timeout
        self.job_id: str | None = None
        self.info: JobInfo | None = None
        self.log_dir: Path | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_site(cls, slurm_section: Mapping[str, Any], site: str = "slurm") -> "SlurmPilot":
        """The pilot a site's ``slurm:`` section describes (its ``pilot:`` keys over the top-level
        partition/account/qos/time...)."""
        options, own = _split_section(slurm_section)
        pilot = dict(own.get("pilot") or {})
        for key in ("cpus-per-task", "nodes", "ntasks-per-node"):  # these are per gang up top
            options.pop(key, None)
        merged = {**options, **{_norm(k): v for k, v in pilot.items()}}
        return cls(merged, conf=own.get("conf"), site=site,
                   sbatch_args=own.get("sbatch-args") or (), prologue=own.get("prologue") or (),
                   job_name=f"{own.get('job-name') or 'phalanx'}-pilot",
                   poll_interval=float(own.get("poll-interval") or 0.5),
                   start_timeout=own.get("pending-timeout"))

    _shared: dict[str, "SlurmPilot"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, slurm_section: Mapping[str, Any], site: str = "slurm") -> "SlurmPilot":
        """One pilot per distinct site section in this process (a workflow run), cancelled
        when the process exits."""
        key = json.dumps([site, slurm_section], sort_keys=True, default=str)
        with cls._shared_lock:
            pilot = cls._shared.get(key)
            if pilot is None:
                pilot = cls._shared[key] = cls.from_site(slurm_section, site)
            return pilot

    @property
    def running(self) -> bool:
        return self.job_id is not None and self.info is not None and self.info.state == "RUNNING"

    def start(self, timeout: float | None = None) -> "SlurmPilot":
        """Submit the holder job and wait until it is RUNNING; a pilot that ended (its time
        limit, a node failure) is replaced by a fresh one."""
        with self._lock:
            if self.job_id is not None:
                self.info = self.slurm.job(self.job_id)
                if self.info.state == "RUNNING":
                    return self
            if self.job_id is None or not (self.info.active or self.info.state == "UNKNOWN"):
                self._submit()
            timeout = timeout if timeout is not None else self.start_timeout
            deadline = time.monotonic() + timeout if timeout else None
            wait = 0.05
            while True:
                self.info = self.slurm.job(self.job_id)
                if self.info.state == "RUNNING":
                    return self
                if self.info.state == "PENDING" and self.info.reason in HOPELESS:
                    self.slurm.cancel(self.job_id)
                    raise GangError(_hopeless(self.info, self.site, "pilot "))
                if not self.info.active and self.info.state != "UNKNOWN":
                    raise GangError(f"slurm: pilot {self.info.describe()}{_site(self.site)}; "
                                    f"its log: {self.log_dir}/pilot-{self.job_id}.log")
                if deadline is not None and time.monotonic() > deadline:
                    self.slurm.cancel(self.job_id)
                    raise GangError(f"slurm: pilot {self.info.describe()} for more than "
                                    f"{timeout:.0f} s{_site(self.site)}")
                time.sleep(wait)
                wait = min(wait * 2, self.poll_interval)

    def _submit(self) -> None:
        from ...gang import default_log_root

        self.log_dir = default_log_root().parent / "slurm-pilots"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        args = [f"--job-name={self.job_name}", f"--output={self.log_dir}/pilot-%j.log",
                "--no-requeue", *_option_args(self.options)]
        if self.ntasks:
            args.append(f"--ntasks={self.ntasks}")
        elif "ntasks-per-node" not in self.options:
            args.append("--exclusive")  # no size given: whole nodes
        body = "\n".join(["#!/bin/sh", "# phalanx pilot: holds the allocation; gangs run as its job steps",
                          *self.prologue, "exec sleep infinity", ""])
        # no script file: sbatch reads the script from its stdin
        self.job_id = self.slurm.submit(args + self.sbatch_args, self.slurm.env(), self.site, body)
        self.info = None

    def status(self) -> str:
        if self.job_id is None:
            return "slurm: pilot not started"
        self.info = self.slurm.job(self.job_id)
        return f"slurm: pilot {self.info.describe()}"

    def close(self) -> None:
        """Cancel the allocation (every gang still on it ends) and wait until it is gone."""
        with self._lock:
            job, self.job_id = self.job_id, None
        if job is None:
            return
        self.slurm.cancel(job)
        _wait_inactive(self.slurm, job, 15.0)

    def __enter__(self) -> "SlurmPilot":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SlurmPilot job={self.job_id} {self.info.state if self.info else '-'}>"

    @classmethod
    def close_shared(cls) -> None:
        """Cancel the pilots ``shared`` made (at the end of a workflow run; also at exit)."""
        with cls._shared_lock:
            pilots = list(cls._shared.values())
            cls._shared.clear()
        for pilot in pilots:
            try:
                pilot.close()
            except Exception:  # the controller may be gone already
                pass


atexit.register(SlurmPilot.close_shared)
