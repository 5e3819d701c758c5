"""One-rank gangs that start together as ONE job array (``allocation: per-stage``, ``array: true``).

Fan-out (``foreach:``) and wide workflows start many one-rank gangs within milliseconds, each
on its own thread; one ``sbatch`` each would hammer slurmctld.  ``ArrayBatcher.join`` holds the
first such gang until ``array_window`` seconds pass without another one joining (at most
``WINDOW_CAP`` windows, or until ``array_max`` joined): every gang of the same executor with
the same sbatch options that arrives meanwhile joins it, and they go as one
``sbatch --array=0-(N-1)`` — gang i is array task ``A_i``, with a job of its own in SLURM's
eyes (its own state, exit code and ``scancel A_i``).  A window that holds one gang gives it
back to the ordinary per-job path.

The array's batch script (``dispatch.sh``, in ``<first gang's log_dir>/<array name>/``) runs,
in task i, gang i's own ``slurm-job.sh`` (its prologue and srun) with gang i's environment:
sbatch exports the first gang's, the dispatcher exports what differs (the gang's id, its
driver's address...).  Each task's output goes to its gang's ``launcher.log`` through the link
``<array dir>/i`` → gang i's log_dir (``--output=<array dir>/%a/launcher.log``).
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .commands import SlurmCommands

WINDOW_CAP = 10  # the first gang of an array waits at most this many windows for the rest


@dataclass
class ArrayRequest:
    """One gang asking to go as a task of an array."""

    key: Hashable  # gangs with equal keys may share an array: same cluster, same sbatch options
    args: list[str]  # sbatch options (not --job-name, --output, --array, the script)
    env: dict[str, str]  # the gang's environment (as its own sbatch would get it)
    script: Path  # the gang's slurm-job.sh (its prologue and srun)
    log_dir: Path
    hold: Callable[[dict], None]  # told the gang's allocation record before sbatch (base.held)
    # filled in by the batch
    task: int = -1
    array: str = ""  # the array's job name
    job_id: str | None = None  # "A_i" once submitted
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Batch:
    def __init__(self, key: Hashable):
        self.key = key
        self.members: list[ArrayRequest] = []
        self.last = time.monotonic()  # when the latest gang joined
        self.full = threading.Event()


class ArrayBatcher:
    """Gathers the one-rank gangs of one executor that arrive less than ``window`` seconds apart
    into job arrays of up to ``max_size`` tasks (see the module docstring)."""

    def __init__(self, slurm: SlurmCommands, *, window: float = 0.2, max_size: int = 1000, job_name: str = "phalanx"):
        self.slurm = slurm
        self.window = window
        self.max_size = max_size
        self.job_name = job_name
        self._lock = threading.Lock()
        self._open: dict[Hashable, _Batch] = {}
        self.arrays: list[str] = []  # job ids of the arrays submitted (tests, bench)

    def join(self, request: ArrayRequest, site: str) -> str | None:
        """Submit ``request``'s gang as a task of an array; blocks for the window.  Returns its
        job id ``A_i``, or None when it came alone (the caller submits it as a job of its own);
        raises what sbatch raised (GangError) for every gang of the array."""
        with self._lock:
            batch = self._open.get(request.key)
            leader = batch is None
            if batch is None:
                batch = self._open[request.key] = _Batch(request.key)
            batch.members.append(request)
            batch.last = time.monotonic()
            if len(batch.members) >= self.max_size:
                self._open.pop(request.key, None)
                batch.full.set()
        if not leader:
            request.done.wait()
            if request.error is not None:
                raise request.error
            return request.job_id
        cap = time.monotonic() + WINDOW_CAP * self.window
        while not batch.full.is_set():  # until a window passes with no gang joining
            with self._lock:
                left = min(batch.last + self.window, cap) - time.monotonic()
            if left <= 0:
                break
            batch.full.wait(left)
        with self._lock:
            if self._open.get(request.key) is batch:
                del self._open[request.key]
            members = list(batch.members)
        if len(members) == 1:
            return None
        try:
            self._submit(members, site)
        except BaseException as exc:
            for m in members:
                m.error = exc
        finally:
            for m in members:
                m.done.set()
        if request.error is not None:
            raise request.error
        return request.job_id

    def _submit(self, members: Sequence[ArrayRequest], site: str) -> None:
        """One ``sbatch --array``: the dispatcher, the links to each gang's log_dir, each gang's
        allocation record (before sbatch), then the task ids."""
        first = members[0]
        name = f"{self.job_name}-array-{time.time_ns()}"
        home = first.log_dir / name
        home.mkdir(parents=True)
        base = first.env
        cases = []
        for i, m in enumerate(members):
            m.task, m.array = i, name
            (home / str(i)).symlink_to(m.log_dir, target_is_directory=True)
            cases.append(f"{i}) exec {_env_words(base, m.env)}/bin/sh {shlex.quote(str(m.script))} ;;")
        dispatch = home / "dispatch.sh"
        dispatch.write_text(
            "\n".join(
                [
                    "#!/bin/sh",
                    f"# phalanx job array {name}: {len(members)} one-rank gangs (phalanx.executors.slurm.arrays)",
                    'case "$SLURM_ARRAY_TASK_ID" in',
                    *cases,
                    "esac",
                    'echo "phalanx: no gang for array task $SLURM_ARRAY_TASK_ID" >&2',
                    "exit 1",
                    "",
                ]
            )
        )
        for m in members:
            m.hold({"array": name, "task": m.task})
        array_id = self.slurm.submit(
            [
                f"--job-name={name}",
                f"--array=0-{len(members) - 1}",
                f"--output={_pct(home)}/%a/launcher.log",
                *first.args,
                str(dispatch),
            ],
            base,
            site,
        )
        self.arrays.append(array_id)
        for m in members:
            m.job_id = f"{array_id}_{m.task}"


def _env_words(base: Mapping[str, str], env: Mapping[str, str]) -> str:
    """``env -u X K=V `` turning environment ``base`` into ``env`` ("" when they are equal);
    ``env`` takes any variable name, ``export`` only a shell identifier."""
    words = [f"-u {shlex.quote(k)}" for k in base if k not in env]
    words += [shlex.quote(f"{k}={v}") for k, v in env.items() if base.get(k) != v]
    return f"env {' '.join(words)} " if words else ""


def _pct(path: Path) -> str:
    return str(path).replace("%", "%%")  # sbatch expands %A, %a, %j... in --output
