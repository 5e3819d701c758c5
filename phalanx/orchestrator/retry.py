"""Retries that know why: what made an attempt fail (``classify``) and whether, when and with
how much memory the stage runs again (``RetryState``), by the stage's ``retry:`` policy.

A cause is a short string, the key a policy names in ``retry.causes``:

- ``oom``: a rank over its memory limit or killed by the OOM killer (the launcher's
  ``end_cause``), or a rank that raised ``MemoryError`` / torch's CUDA ``OutOfMemoryError``;
- ``timeout``: the stage's ``timeout:`` (``StageTimeoutError``), or the resource manager's
  time limit (SLURM TIMEOUT);
- ``node_lost`` / ``preempted``: the resource manager took the rank's host away (SLURM
  NODE_FAIL, PREEMPTED); retried by ``retry.infrastructure``, never by the stage's counts;
- ``exit:N``: a rank exited with code N; ``signal:SIGNAME``: a rank killed by a signal;
- an exception type's name (``ConnectionError``) raised by a rank, or by the scheduler for the
  attempt (``GangError``: the gang could not start; ``ChecksumError``: an input did not verify);
  a policy naming a built-in or phalanx exception matches its subclasses too.

>>> from phalanx.orchestrator.models import RetryPolicy
>>> state = RetryState(RetryPolicy(causes={"oom": 1}, memory="x2"), memory=2**30)
>>> state.after("oom").describe()
'retrying in 1 s with 2 GiB per rank, was 1 GiB (retry 1 of 1 for oom)'
>>> state.after("oom").describe()
'not retried: its 1 retry for oom is used up'
"""

from __future__ import annotations

import builtins
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..errors import RankError, RankFailure, StageTimeoutError
from .models import INFRASTRUCTURE_CAUSES, RetryPolicy

_GIB = 2**30
# A rank's exception types that mean out of memory: Python's, torch's CUDA one
# (torch.cuda.OutOfMemoryError; runtime/gpu.py annotates it with the device's memory)
OOM_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})
# Where causes of one attempt differ between ranks, the one that explains the others first:
# the resource manager's doing, then memory, then time
_STRONGEST = ("preempted", "node_lost", "oom", "timeout")
_LABELS = {
    "oom": "out of memory",
    "timeout": "timeout",
    "node_lost": "node lost",
    "preempted": "preempted",
    "disconnected": "a rank lost its connection",
}


def classify(exc: BaseException) -> str:
    """The cause of a failed attempt, from what the scheduler caught (see the module's doc)."""
    if isinstance(exc, StageTimeoutError):
        return "timeout"
    if isinstance(exc, RankError):
        causes = [rank_cause(f) for f in exc.failures]
        return next((c for c in _STRONGEST if c in causes), rank_cause(exc.first))
    return type(exc).__name__


def rank_cause(failure: RankFailure) -> str:
    """Why one rank failed: its launcher's word, its exception, its exit code or signal."""
    if failure.cause:
        return failure.cause
    if failure.exc_type:
        return "oom" if failure.exc_type in OOM_TYPES else failure.exc_type
    code = failure.exitcode
    if code is None:
        return "disconnected"
    if code >= 0:
        return f"exit:{code}"
    try:
        return f"signal:{signal.Signals(-code).name}"
    except ValueError:  # a real-time signal: no name
        return f"signal:{-code}"


def label(cause: str | None) -> str:
    """A cause for people: "out of memory", "exit code 3", "killed by SIGKILL", "ValueError"."""
    if not cause:
        return "-"
    if cause.startswith("exit:"):
        return f"exit code {cause[5:]}"
    if cause.startswith("signal:"):
        return f"killed by {cause[7:]}"
    return _LABELS.get(cause, cause)


def policy_of(stage: Any, site: Any) -> RetryPolicy:
    """The policy a stage runs by: its ``retry:``; else its ``retries: N`` (any failure, N
    times) when it gives one or the site gives no ``retry:``; else the site's ``retry:``.
    ``retries: N`` keeps the site's backoff and infrastructure retries."""
    if stage.retry is not None:
        return stage.retry
    default = getattr(site, "retry", None)
    if default is not None and "retries" not in stage.model_fields_set:
        return default
    causes = {"any": stage.retries} if stage.retries else {}
    return (default or RetryPolicy()).model_copy(update={"causes": causes, "memory": None, "max_memory_gb": None})


@dataclass(frozen=True)
class Decision:
    """What follows a failed attempt: run again (after ``wait_s``, with ``memory`` bytes per
    rank where it changed) or not, and why (``reason``)."""

    retry: bool
    cause: str
    reason: str
    wait_s: float = 0.0
    memory: int | None = None  # bytes per rank of the next attempt; None: as the last one
    was: int | None = None  # the last attempt's, where ``memory`` changed it

    def describe(self) -> str:
        """ "retrying in 4 s with 2 GiB per rank, was 1 GiB (retry 1 of 2 for oom)", or
        "not retried: exit code 3 is not in retry.causes (oom, any)"."""
        if not self.retry:
            return f"not retried: {self.reason}"
        more = f" with {_gib(self.memory)} per rank, was {_gib(self.was)}" if self.memory and self.was else ""
        return f"retrying in {self.wait_s:g} s{more} ({self.reason})"


@dataclass
class RetryState:
    """The retries one stage has used, per cause key, and its ranks' memory (``memory``: bytes
    per rank, None where no limit is known).  ``pauses``: seconds before retry 1, 2, ... (the
    last repeats) where the policy gives no ``backoff`` (the scheduler's ``BACKOFF_S``)."""

    policy: RetryPolicy
    memory: int | None = None
    pauses: Sequence[float] = ()
    used: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # retries so far, of every cause (the backoff's exponent)

    def after(self, cause: str) -> Decision:
        """Whether the stage runs again after an attempt failed of ``cause``; counts it."""
        policy = self.policy
        key: str | None = "infrastructure" if cause in INFRASTRUCTURE_CAUSES else self.key(cause)
        limit = policy.infrastructure if key == "infrastructure" else policy.causes.get(key, 0) if key else 0
        used = self.used.get(key, 0) if key else 0
        if key is None or used >= limit:
            return Decision(False, cause, self._why_not(cause, key, limit))
        self.used[key] = used + 1
        wait = self.wait_s()
        self.retries += 1
        what = "preemption and node loss (retry.infrastructure)" if key == "infrastructure" else key
        reason = f"retry {used + 1} of {limit} for {what}"
        if cause != "oom" or policy.memory_factor() == 1:
            return Decision(True, cause, reason, wait)
        if self.memory is None:
            return Decision(True, cause, reason + "; no memory limit per rank to raise (site memory_gb)", wait)
        cap = int(policy.max_memory_gb * _GIB) if policy.max_memory_gb else None
        was = self.memory
        self.memory = int(was * policy.memory_factor())
        if cap is not None and self.memory >= cap:
            self.memory = max(cap, was)
            reason += f"; capped by max_memory_gb {policy.max_memory_gb:g}"
        return Decision(True, cause, reason, wait, self.memory, was)

    def wait_s(self) -> float:
        """Seconds before the next retry: ``backoff.first`` times ``factor`` per retry so far, at
        most ``backoff.max``."""
        if self.pauses and "backoff" not in self.policy.model_fields_set:
            return self.pauses[min(self.retries, len(self.pauses) - 1)]
        b = self.policy.backoff
        return min(b.max, b.first * b.factor**self.retries)

    def key(self, cause: str) -> str | None:
        """The key of ``retry.causes`` whose count a failure of ``cause`` uses: the cause itself,
        else the nearest listed base class of an exception type, else ``any``; None: no key."""
        causes = self.policy.causes
        if cause in causes:
            return cause
        named = {k.rsplit(".", 1)[-1]: k for k in causes}  # "requests.ConnectionError" → its class name
        for base in lineage(cause):
            if base in named:
                return named[base]
        return "any" if "any" in causes else None

    def _why_not(self, cause: str, key: str | None, limit: int) -> str:
        if key == "infrastructure":
            return f"its {_times(limit)} for preemption and node loss are used up (retry.infrastructure)"
        if key is not None:
            return f"its {_times(limit)} for {key} {'is' if limit == 1 else 'are'} used up"
        if not self.policy.causes:
            return "the stage has no retries"
        return f"{label(cause)} is not in retry.causes ({', '.join(self.policy.causes)})"


def lineage(cause: str) -> list[str]:
    """An exception type's name and its base classes' (most specific first) where Python or
    phalanx defines it: ``ConnectionResetError`` → ConnectionResetError, ConnectionError,
    OSError, Exception, BaseException; any other name: itself."""
    cls = getattr(builtins, cause, None) or getattr(errors, cause, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return [c.__name__ for c in cls.__mro__ if c is not object]
    return [cause]


def _times(n: int) -> str:
    return f"{n} retr{'y' if n == 1 else 'ies'}"


def _gib(nbytes: int | None) -> str:
    return f"{(nbytes or 0) / _GIB:.3g} GiB"
