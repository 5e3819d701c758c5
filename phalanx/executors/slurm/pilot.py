"""The pilot allocation: one SLURM allocation held for many gangs (``allocation: pilot``).

A run's pilot belongs to its ``SlurmExecutor``: made when the run's first gang needs it,
shared by that executor's gangs only, cancelled by its ``close_run`` — never by another run
in the same process.

A pilot started for a driver's gangs ends with that driver: its batch script holds a TCP
connection to a listener of the driver (``network.Beacon``, on the address the ranks reach the
driver at) and exits when it closes — the driver exited or was killed — so SLURM ends the
job and every step on it.  The run DB has its record too (``commands.allocation``).

A pilot started for a gang whose store is a directory (``PHALANX_STORE`` in the gang's
environment, not ``s3://``) runs one store service per node for the life of the allocation:
its batch script starts, before the holder, a job step ``srun --overlap --ntasks-per-node=1``
of ``python -m phalanx.store.service --root R --host auto --key slurm-JOB`` (token from
``PHALANX_STORE_TOKEN_FILE`` or the per-user default file, never the command line).  Each
service publishes its endpoint in its own node's ``R/.services/slurm-JOB.json``; the ranks of
every gang on the pilot get ``PHALANX_STORE_SERVICE_KEY=slurm-JOB`` (``store_key``) and find
their node's service there.  ``start`` waits (up to ``SERVICE_WAIT_S``) until every node's
service is serving: each also writes its endpoint to ``store-JOB-NODE.endpoint`` in the pilot's
log directory (the starting gang's: the nodes share it).
"""

from __future__ import annotations

import logging
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import GangError
from ...paths import ENV_SPILL, ENV_STORE, default_log_root
from ...runtime.envvars import ENV_STORE_TOKEN_FILE
from ..base import AllocationHook, held, released
from ..network import Beacon
from .commands import HOPELESS, JobInfo, SlurmCommands, _hopeless, _option_args, _site, _wait_inactive, allocation
from .config import SlurmConfig, SlurmPilotConfig

log = logging.getLogger("phalanx.executors.slurm")

# what a pilot's store services take from the environment of the gang that starts the pilot
STORE_ENV = (ENV_STORE, ENV_SPILL, ENV_STORE_TOKEN_FILE)
SERVICE_WAIT_S = 60.0  # start() waits this long for every node's store service, then goes on
# one store service per node, run by the pilot's batch script before its holder: $0 python, $1
# the store root, $2 the pilot's log dir
_SERVICE = (
    'exec "$0" -m phalanx.store.service --root "$1" --host auto --key "slurm-$SLURM_JOB_ID" '
    '--endpoint-file "$2/store-$SLURM_JOB_ID-$SLURMD_NODENAME.endpoint"'
)

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
        self.store_root: str | None = None  # the root the pilot's store services serve, if any
        self.store_services: dict[str, str] = {}  # node → endpoint of its store service
        self._far: tuple[str | None, dict[str, str]] = (None, {})  # (job, far_nodes())

    @property
    def store_key(self) -> str | None:
        """``PHALANX_STORE_SERVICE_KEY`` of the ranks on this pilot: its store services' key
        (``slurm-JOB``), or None when the pilot runs none."""
        return f"slurm-{self.job_id}" if self.job_id and self.store_root else None

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
        self,
        timeout: float | None = None,
        *,
        hook: AllocationHook | None = None,
        driver: str | None = None,
        store: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
    ) -> SlurmPilot:
        """Submit the holder job and wait until it is RUNNING; a pilot that ended (its time
        limit, a node failure) is replaced by a fresh one.  ``hook``: told of the job unless
        the pilot has its own (a gang's allocation hook); ``driver``: "host:port" the nodes
        reach this driver at (a gang's control address) — the pilot then ends when this
        process does; ``store``: the environment of the gang's store (``STORE_ENV``): a fresh
        pilot runs a store service per node for a directory root; ``log_dir``: where a fresh
        pilot writes its log and its services' (the starting gang's log dir, which the nodes
        share; default: ``slurm-pilots`` beside the gang log root).  ``close`` from another
        thread ends the wait (GangError)."""
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
                job_id = self._submit(self.hook if self.hook is not None else hook, driver, store, log_dir)
            timeout = timeout if timeout is not None else self.start_timeout
            deadline = time.monotonic() + timeout if timeout else None
            wait = 0.05
            while True:
                self.info = info = self.slurm.job(job_id)
                if info.state == "RUNNING":
                    if self.store_root and not self.store_services and not self._await_services(info):
                        continue  # it ended while its services started (e.g. its batch script failed)
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

    def _submit(
        self,
        hook: AllocationHook | None,
        driver: str | None,
        store: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
    ) -> str:
        """Submit the holder job (and the store services: ``start``); its id (also ``self.job_id``)."""
        self.log_dir = Path(log_dir) if log_dir else default_log_root().parent / "slurm-pilots"
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
        env = self.slurm.env()
        services: list[str] = []
        root = (store or {}).get(ENV_STORE, "")
        if root and "://" not in root:  # a directory on each node, not an object store
            self.store_root = root
            env.update({k: v for k, v in (store or {}).items() if k in STORE_ENV and v})
            srun = [
                self.slurm.exe("srun"),
                "--overlap",  # shares the CPUs of the gangs' --exact steps (docs/multihost.md)
                "--ntasks-per-node=1",
                "--kill-on-bad-exit=0",
                "--input=none",
                f"--job-name={name}-store",
                f"--output={str(self.log_dir).replace('%', '%%')}/store-%j-%N.log",
            ]
            service = [sys.executable, root, str(self.log_dir)]
            services = [
                "# one store service per node while the allocation lives (phalanx.store.service)",
                shlex.join(srun)
                + ' --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
                + shlex.join(["/bin/sh", "-c", _SERVICE, *service])
                + " &",
            ]
        else:
            self.store_root = None
        self.store_services = {}
        body = "\n".join(
            [
                "#!/bin/sh",
                "# phalanx pilot: holds the allocation; gangs run as its job steps",
                *self.prologue,
                *services,
                hold,
                "",
            ]
        )
        self._hook, self._record = hook, allocation("pilot", name, self.slurm)
        held(hook, self._record)  # before sbatch: see base.held
        try:
            # no script file: sbatch reads the script from its stdin
            self.job_id = job_id = self.slurm.submit(args + self.sbatch_args, env, self.site, body)
        except BaseException:
            self._forget()
            raise
        self._record = {**self._record, "job": job_id}
        held(hook, self._record)
        self.info = None
        return job_id

    def _await_services(self, info: JobInfo) -> bool:
        """Wait until every node's store service writes its endpoint (up to ``SERVICE_WAIT_S``);
        a node whose service did not start is logged, and its ranks run without one.  False
        when the pilot stopped running meanwhile."""
        assert self.log_dir is not None and self.job_id is not None  # submitted
        nodes = self.node_names()
        files = {n: self.log_dir / f"store-{self.job_id}-{n}.endpoint" for n in nodes}
        deadline = time.monotonic() + SERVICE_WAIT_S
        wait = 0.05
        last_poll = time.monotonic()
        while True:
            found = {n: f.read_text().strip() for n, f in files.items() if f.exists()}
            if len(found) == len(files) or time.monotonic() > deadline or self._closing:
                break
            time.sleep(wait)
            wait = min(wait * 2, self.poll_interval)
            if time.monotonic() - last_poll >= max(self.poll_interval, 1.0):  # still running?
                last_poll = time.monotonic()
                if self.slurm.job(self.job_id).state not in ("RUNNING", "UNKNOWN"):
                    return False
        self.store_services = found
        missing = sorted(set(files) - set(found))
        if missing:
            log.warning(
                "slurm: pilot job %s: no store service on %s after %.0f s%s; see %s/store-%s-NODE.log",
                self.job_id,
                ", ".join(missing),
                SERVICE_WAIT_S,
                _site(self.site),
                self.log_dir,
                self.job_id,
            )
        return True

    def node_names(self) -> list[str]:
        """The running pilot's nodes, by name (``scontrol show hostnames``)."""
        if self.info is None or not self.info.nodes:
            return []
        r = self.slurm.run("scontrol", "show", "hostnames", self.info.nodes, timeout=30)
        return r.stdout.split() if r.returncode == 0 else []

    def far_nodes(self) -> dict[str, str]:
        """The running pilot's nodes whose address (``NodeAddr``) is not one of this host's:
        ``{node: address}``; their ranks cannot reach a driver on loopback."""
        job, far = self._far
        if job == self.job_id or self.info is None or not self.info.nodes:
            return far
        r = self.slurm.run("scontrol", "show", "node", "-o", self.info.nodes, timeout=30)
        far = {}
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            fields = {k: v for k, _, v in (f.partition("=") for f in line.split())}
            addr = fields.get("NodeAddr", "")
            if addr and not _is_here(addr):
                far[fields.get("NodeName", addr)] = addr
        self._far = (self.job_id, far)
        return far

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
        if self.store_root and self.log_dir is not None:  # the services' endpoints, for start()
            for f in self.log_dir.glob(f"store-{job}-*.endpoint"):
                f.unlink(missing_ok=True)

    def __enter__(self) -> SlurmPilot:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SlurmPilot job={self.job_id} {self.info.state if self.info else '-'}>"


def _is_here(host: str) -> bool:
    """``host`` (a name or address) is an address of this host: one it can bind."""
    try:
        with socket.socket(socket.AF_INET) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def route_from(host: str) -> str | None:
    """The address of this host that packets to ``host`` leave from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return str(s.getsockname()[0])
    except OSError:
        return None
