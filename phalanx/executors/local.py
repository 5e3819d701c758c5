"""Local executor: the ranks of a gang are processes on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ..procs import signal_group
from ..runtime import reaper
from ..runtime.envvars import ENV_CPUS, ENV_THREADS
from ..runtime.procinfo import memory
from .base import Capabilities, Echo, Executor, ExecutorConfig, Launcher
from .logs import Pump, RankOutput, start_pump, sync_pumps, whole_lines

if TYPE_CHECKING:
    from .pool import WarmPool

WORKER_ARGV = (sys.executable, "-m", "phalanx.runtime.worker")  # what gangs start on every rank
_SAMPLE_S = 0.1  # how often the driver reads each rank's memory (≈30 µs a rank)
_GIB = 1 << 30


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_placement(world_size: int, pin: bool, cpus: Sequence[int] | None = None) -> list[dict[str, str]]:
    """Disjoint CPU sets when the gang fits its cores (``cpus``: the share a scheduler gave
    this gang; default all usable ones); threads split evenly either way."""
    cpus = list(cpus) if cpus else usable_cpus()
    threads = max(1, len(cpus) // world_size)
    out = []
    for r in range(world_size):
        env = {ENV_THREADS: str(threads)}
        if pin and world_size <= len(cpus):
            env[ENV_CPUS] = ",".join(map(str, cpus[r * threads : (r + 1) * threads]))
        out.append(env)
    return out


ENV_GPUS = "PHALANX_GPUS"  # this machine's GPU count, over discovery (tests pretend to have GPUs)
_discovered: list[int] = []  # discover_gpus's answer, once a process


def discover_gpus() -> int:
    """This machine's GPUs: ``$PHALANX_GPUS`` if set, else ``nvidia-smi -L``'s list, else
    ``torch.cuda.device_count()`` in a child process (CUDA never initialised in the driver)
    where a GPU device node exists (/dev/nvidia0, /dev/kfd), else 0.  Read once a process."""
    override = os.environ.get(ENV_GPUS)
    if override is not None:
        if not override.strip().isdigit():
            raise ValueError(f"${ENV_GPUS} must be a whole number of GPUs, not {override!r}")
        return int(override)
    if not _discovered:
        _discovered.append(_probe_gpus())
    return _discovered[0]


def _probe_gpus() -> int:
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            pass
    if not (Path("/dev/nvidia0").exists() or Path("/dev/kfd").exists()):
        return 0  # no GPU driver here: not worth importing torch to hear it
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def gpu_devices(slots: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a rank holding these GPU slots: slot i is the driver's i-th
    visible device (its own ``CUDA_VISIBLE_DEVICES`` when set, else device i); "" for none."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(visible[s] if s < len(visible) else str(s) for s in slots)


def slot_cpus(capacity: int, pin: bool, slots: Sequence[int]) -> tuple[bool, list[int] | None]:
    """Whether to pin, and the CPUs of a gang's ``slots`` (a scheduler's share; None: all usable):
    slots are this machine's CPUs only when the site has no more of them than it has cores."""
    cpus = usable_cpus()
    pin = pin and capacity <= len(cpus)  # more slots than cores: oversubscribed, no pinning
    return pin, ([cpus[s] for s in slots] if pin and slots else None)


class LocalConfig(ExecutorConfig):
    """The ``local:`` section of a site file (all optional)."""

    pin: bool = Field(
        True,
        strict=True,
        description="pin each rank to its own CPUs when the site's slots fit "
        "this machine's cores (gangs side by side get disjoint CPUs)",
    )


class LocalExecutor(Executor[LocalConfig]):
    """Ranks are processes of this machine; the site's slots are its CPUs."""

    name = "local"
    config_model = LocalConfig
    capabilities = Capabilities(reuse_gangs=True, pins_cpus=True, warm_pool=True, runs_commands=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: WarmPool | None = None

    def capacity(self) -> int:
        return self.cores or len(usable_cpus())

    def gpu_capacity(self) -> int:
        """The site's ``gpus``, else this machine's (``discover_gpus``)."""
        return self.gpus if self.gpus is not None else discover_gpus()

    def open_run(self, hook=None, demand=None, warm: int = 0) -> None:
        super().open_run(hook, demand, warm)
        if warm:
            from .pool import WarmPool

            self._pool = WarmPool(warm, demand=demand)

    def close_run(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: LocalConfig | None = None, echo: Echo = False
    ) -> LocalLauncher:
        pin, mine = slot_cpus(self.capacity(), self.effective_config(config).pin, slots)
        launcher = LocalLauncher(echo=echo, pin=pin, cpus=mine, pool=self._pool, mem_limit_bytes=self.rank_memory)
        launcher.allocation_hook = self.hook
        return launcher


class LocalLauncher(Launcher):
    name = "local"

    def __init__(
        self,
        echo: Echo = True,
        pin: bool = True,
        cpus: Sequence[int] | None = None,
        pool: WarmPool | None = None,
        mem_limit_bytes: int | None = None,
    ):
        """``mem_limit_bytes``: each rank's share of memory; a rank whose private resident
        memory (RssAnon) goes over it is killed by the driver (see ``MemoryWatch``)."""
        self.echo = echo
        self.pin = pin
        self.cpus = cpus
        self.pool = pool  # warm rank processes to take before starting new ones
        self.mem_limit_bytes = mem_limit_bytes
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[Pump] = []
        self._output: RankOutput | None = None
        self._watch: MemoryWatch | None = None
        self.gpus: list[list[int]] | None = None  # GPU slots per rank (assign_gpus); None: env as it is

    def placement(self, world_size: int) -> list[dict[str, str]]:
        envs = cpu_placement(world_size, self.pin, self.cpus)
        if self.gpus is not None:  # a rank without GPUs sees none ("") rather than all of them
            for r, env in enumerate(envs):
                env["CUDA_VISIBLE_DEVICES"] = gpu_devices(self.gpus[r] if r < len(self.gpus) else ())
        return envs

    def assign_gpus(self, per_rank: Sequence[Sequence[int]]) -> bool:
        self.gpus = [list(g) for g in per_rank]
        return True

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        self._output = RankOutput(log_dir, self.echo)
        self.procs, self._pumps = [], []  # a gang restarting after a failure launches again
        from .pool import hand_over

        warm = self.pool.take(len(rank_env)) if self.pool and tuple(argv) == WORKER_ARGV else []
        for rank, extra in enumerate(rank_env):
            if rank < len(warm):
                proc = warm[rank]
                hand_over(proc, extra)
            else:
                proc = subprocess.Popen(
                    list(argv),
                    env={**os.environ, **extra, "PYTHONUNBUFFERED": "1"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the driver, which stops the gang
                )
            self.procs.append(proc)
            assert proc.stdout is not None  # stdout=PIPE, here and in WarmPool._spawn
            self._pumps.append(start_pump(proc.stdout, self._output, whole_lines(rank), name=f"phalanx-log-rank{rank}"))
        self._watch = MemoryWatch(self.procs, self.mem_limit_bytes)

    def memory_note(self, rank: int) -> str:
        """What memory says about a rank killed by SIGKILL (see ``MemoryWatch.note``)."""
        return self._watch.note(rank) if self._watch else ""

    def end_cause(self, rank: int) -> str | None:
        killed = rank < len(self.procs) and self.procs[rank].returncode == -signal.SIGKILL  # as the OOM killer does
        return "oom" if killed and self._watch is not None and self._watch.oom(rank) else None

    def redirect(self, log_dir: Path) -> bool:
        """Write the ranks' output to ``log_dir`` from now on (a gang reused by the next stage)."""
        if self._output is None:
            return False
        sync_pumps(self._pumps)  # what the ranks wrote so far belongs to the stage that ended
        self._output.move_to(log_dir)
        return True

    def exitcodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self, grace_s: float = 2.0) -> None:
        if self._watch is not None:
            self._watch.stop()
        live = [p for p in self.procs if p.poll() is None]
        # what the ranks started, seen while they live (a rank adopts its orphans, those in a
        # session of their own too): once a rank is gone, its orphans are init's
        started = {pid: t for p in live for pid, t in reaper.tree(p.pid).items()}
        for p in live:
            signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p.pid, signal.SIGKILL)
                p.wait()
        reaper.kill_tree(started)
        for p in self.procs:  # what is left in a rank's process group (a command's background jobs)
            signal_group(p.pid, signal.SIGKILL)  # (a group outlives its leader: its id is not reused)
        for t in self._pumps:
            t.join(timeout=1.0)
        if self._output is not None and not any(t.is_alive() for t in self._pumps):
            self._output.close()  # else a pump still drains a pipe (a grandchild holds it)


class MemoryWatch:
    """A driver thread reading every rank's memory from /proc each ``_SAMPLE_S``: it keeps each
    rank's peak resident set (VmHWM) for failure reports and, given ``limit`` bytes, kills a rank
    whose private resident memory (RssAnon) is over it.

    Resident, not virtual: RLIMIT_AS and RLIMIT_DATA count address space a rank reserves but
    never touches (an idle rank: 3.7 GiB of VmSize, 0.84 GiB of VmData, 0.31 GiB RssAnon) and
    fail allocations in Rust (SIGABRT) or DuckDB long before real memory runs out.  Zero-copy
    reads of the store (shared memory) are the store's memory, not the rank's: not counted.
    A rank can overshoot by what it allocates in one sample period.
    """

    def __init__(self, procs: Sequence[subprocess.Popen], limit: int | None):
        self.procs, self.limit = list(procs), limit
        self.peak = [0] * len(self.procs)
        self.over: dict[int, int] = {}  # rank → its RssAnon when the watch killed it
        self.cgroups = [memory_cgroup_file(p.pid) for p in self.procs]
        self.oom_before = [oom_kills(c) for c in self.cgroups]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-memory-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            for rank, p in enumerate(self.procs):
                if p.returncode is not None or rank in self.over:
                    continue
                mem = memory(p.pid)
                if mem is None:  # it has just exited
                    continue
                self.peak[rank] = max(self.peak[rank], mem.peak)
                if self.limit and mem.private > self.limit:
                    self.over[rank] = mem.private
                    started = reaper.tree(p.pid)
                    signal_group(p.pid, signal.SIGKILL)
                    reaper.kill_tree(started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def oom(self, rank: int) -> bool:
        """The rank went over its limit (this watch killed it) or the kernel's OOM killer ran in
        its cgroup since launch (on the machine, where it has no cgroup of its own to say)."""
        if rank in self.over:
            return True
        before, after = self.oom_before[rank], oom_kills(self.cgroups[rank])
        counted = 0 if before[0] is not None else 1  # its cgroup's count where it has one
        b, a = before[counted], after[counted]
        return b is not None and a is not None and a > b

    def note(self, rank: int) -> str:
        """Why a rank killed by SIGKILL died, as far as memory tells: over its limit (this
        watch killed it), the kernel's OOM killer (its cgroup's or the kernel's oom_kill count
        grew since launch), or neither."""
        peak = f"peak RSS {self.peak[rank] / _GIB:.2f} GiB of {_mem_total() / _GIB:.1f} GiB"
        if rank in self.over:
            assert self.limit is not None  # the watch kills only over a limit (_run)
            return (
                f" — over its memory limit of {self.limit / _GIB:g} GiB (private resident "
                f"memory {self.over[rank] / _GIB:.2f} GiB; {peak})"
            )
        before, after = self.oom_before[rank], oom_kills(self.cgroups[rank])
        grown = [
            where
            for where, b, a in zip((f"its cgroup ({self.cgroups[rank]})", "this machine"), before, after)
            if b is not None and a is not None and a > b
        ]
        if grown:
            return f" — out of memory: the kernel's OOM killer ran in {grown[0]} ({peak})"
        if before[1] is None:  # no record to read (not Linux)
            return f" — likely out of memory ({peak})"
        return f" (not out of memory: the kernel recorded no OOM kill; {peak})"


def memory_cgroup_file(pid: int) -> str | None:
    """The file holding the oom_kill count of the process's memory cgroup (v2 memory.events,
    v1 memory.oom_control), if it has one."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [f"/sys/fs/cgroup{path}/memory.events", f"/sys/fs/cgroup/unified{path}/memory.events"]
        elif "memory" in controllers.split(","):
            files = [f"/sys/fs/cgroup/memory{path}/memory.oom_control"]
        else:
            continue
        found = next((f for f in files if _counter(f, "oom_kill") is not None), None)
        if found:
            return found
    return None


def oom_kills(cgroup_file: str | None) -> tuple[int | None, int | None]:
    """OOM kills so far in the cgroup and on the whole machine (/proc/vmstat); None: unknown."""
    return (_counter(cgroup_file, "oom_kill") if cgroup_file else None), _counter("/proc/vmstat", "oom_kill")


def _counter(path: str, name: str) -> int | None:
    """N of the line ``name N ...`` in ``path``."""
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == name:
                    return int(fields[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_total() -> int:
    return (_counter("/proc/meminfo", "MemTotal:") or 0) * 1024
