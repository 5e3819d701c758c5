"""The executor interface: start, watch and stop the processes of one gang.

An executor only launches processes; the control plane (connecting ranks, sending apps,
fail-fast) is shared by every executor in ``control`` and ``phalanx.gang``.

Allocations: what a launcher holds on a resource manager (a SLURM job, step or pilot, a Ray
placement group) is announced the moment it exists — ``held(hook, record)`` before or as it
is submitted, ``released(hook, record)`` once it is gone — to the launcher's
``allocation_hook`` (the scheduler's writes the run DB, so a driver killed without a word
leaves enough for ``phalanx status``/``cancel``/``--resume`` to free it with
``phalanx.executors.release(record)``), and to this process's own list, which an exit
handler frees should the driver end (an exception, Ctrl-C, SIGTERM) with some still held.
A record is a JSON-able dict: ``executor``, ``id`` (unique for that executor) and what
``release`` needs from another process (SLURM_CONF, the Ray address and namespace...).
"""

from __future__ import annotations

import atexit
import os
import logging
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol, Sequence

log = logging.getLogger("phalanx.executors")


class AllocationHook(Protocol):
    def held(self, record: dict) -> None: ...

    def released(self, record: dict) -> None: ...


_held_here: dict[tuple[str, str], dict] = {}   # (executor, id) → record: held by this process
_held_lock = threading.Lock()


def held(hook: AllocationHook | None, record: dict) -> None:
    """An allocation exists (or is about to: submitted under its ``id``)."""
    with _held_lock:
        if not _held_here:  # registered late: runs before Ray's own exit handler disconnects
            atexit.register(_release_all)
        _held_here[(record["executor"], str(record["id"]))] = record
    if hook is not None:
        hook.held(record)


def released(hook: AllocationHook | None, record: dict) -> None:
    """The allocation is gone."""
    with _held_lock:
        _held_here.pop((record["executor"], str(record["id"])), None)
        if not _held_here:
            atexit.unregister(_release_all)
    if hook is not None:
        hook.released(record)


def _release_all() -> None:
    """At exit: free what this driver still holds (a gang whose start raced a Ctrl-C...)."""
    from . import release

    with _held_lock:
        records = list(_held_here.values())
        _held_here.clear()
    for record in records:
        try:
            log.warning("released at exit: %s", release(record))
        except Exception as exc:  # the resource manager is unreachable: the run DB still has it
            log.warning("could not release %s %s at exit: %s", record["executor"], record["id"], exc)


class Launcher(ABC):
    """Starts ``world_size`` copies of ``argv``, rank r with ``rank_env[r]`` added to its env."""

    name = "abstract"
    allocation_hook: AllocationHook | None = None  # told of every allocation (see above)

    @abstractmethod
    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None: ...

    @abstractmethod
    def exitcodes(self) -> list[int | None]:
        """Per rank: None while running, else the exit code (negative: killed by that signal)."""

    @abstractmethod
    def kill(self, grace_s: float = 2.0) -> None:
        """Stop every rank: SIGTERM, then SIGKILL after ``grace_s``; reap them."""

    def placement(self, world_size: int) -> list[dict[str, str]]:
        """Extra per-rank environment for placement (CPU affinity, threads)."""
        return [{} for _ in range(world_size)]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def shared_env(rank_env: list[dict[str, str]], per_rank: Sequence[str], launcher: str) -> dict[str, str]:
    """The one environment a launcher that starts all ranks at once (mpirun, srun) gives them:
    ``rank_env`` without the ``per_rank`` keys, which must then be the same for every rank."""
    common = {k: v for k, v in rank_env[0].items() if k not in per_rank}
    for r, env in enumerate(rank_env):
        rest = {k: v for k, v in env.items() if k not in per_rank}
        if rest != common:
            diff = sorted(set(rest.items()) ^ set(common.items()))
            raise ValueError(f"{launcher} gives every rank the same environment; rank {r} differs in {diff}")
    return common
