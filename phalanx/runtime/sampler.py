"""Per-rank resource samples while a task runs: which rank is the straggler, and why.

While an app sent by the driver (``protocol.Run``) runs, a daemon thread reads the rank every
``PHALANX_SAMPLE_S`` seconds (default 2; ``0``: off, no samples at all) and sends a
``protocol.Sample`` over the rank's control connection; one more, the final one, goes with the
task's result, so even a task shorter than the interval leaves one.  A sample holds:

- ``cpu``: percent of one core over the last interval, the rank and its waited-for children
  (``os.times``); the final sample's: over the whole task;
- ``rss``: the rank's own resident memory (RssAnon, the number ``procinfo.memory`` gives the
  driver's memory watch) and ``peak_rss``, the resident high-water mark (VmHWM) since the task
  started (reset as it starts: a kept gang's or a warm pool's process has a past);
- ``sent`` / ``received`` / ``comm_s``: the payload bytes and seconds of the communicator's
  collectives since the task started (``comm.base.Communicator``'s accounting);
- ``elapsed``: seconds since the task started (compute time: ``elapsed - comm_s``).

No psutil: /proc and ``resource`` only.  The driver writes the samples to the run database
(``orchestrator.samples``); ``phalanx status`` and the HTML report show them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .envvars import ENV_SAMPLE

if TYPE_CHECKING:
    from . import protocol as P
    from .comm.base import Communicator

DEFAULT_S = 2.0
MIN_SPAN_S = 0.25  # a sample's CPU share over less than this is taken over the whole task


def interval_s(environ: Any = None) -> float:
    """Seconds between samples from ``PHALANX_SAMPLE_S`` (default 2; 0: off)."""
    raw = (os.environ if environ is None else environ).get(ENV_SAMPLE, "").strip()
    if not raw:
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ValueError(f"{ENV_SAMPLE} must be seconds between samples (0: off), got {raw!r}")
    return value


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _reset_peak() -> None:
    """Start the resident high-water mark (VmHWM) again from the current resident set, so a
    task's ``peak_rss`` is its own and not the process's whole life (a kept gang, a warm pool's
    process); Linux ≥ 4.0 (``clear_refs`` 5).  Where it cannot, the peak is the process's."""
    try:
        with open("/proc/self/clear_refs", "wb", buffering=0) as f:
            f.write(b"5")
    except OSError:
        pass


def _peak() -> int:
    """The resident high-water mark in bytes: VmHWM (what ``_reset_peak`` resets), else
    ``getrusage``'s maximum (no /proc: macOS)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


def _memory() -> tuple[int, int]:
    """(rss, peak) of this process in bytes: rss as ``procinfo.memory``'s ``private`` (RssAnon:
    resident minus file-backed and shared pages, from /proc/self/statm, cheaper to read than
    its status file), peak the resident high-water mark since the task started (``_peak``)."""
    peak = _peak()
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE, peak
    except (OSError, ValueError, IndexError):  # no /proc (macOS)
        return peak, peak


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class _Task:
    """The task being sampled: its start and what the last reading saw."""

    task: int
    base: tuple[int, int, float]  # the communicator's bytes sent, received and seconds at its start
    t0: float
    due: float  # when the next periodic sample is due (perf_counter)
    last_wall: float
    last_cpu: float
    cpu0: float  # CPU seconds at its start


class Sampler:
    """Samples this rank while each task runs: ``with sampler.running(task):`` around the app.

    One daemon thread per rank, started with the first task, sends the periodic samples; the
    final one, taken by ``running`` as the task ends (after any periodic one: both under one
    lock), is left in ``final`` for the worker to send with the task's result — one message
    per task, as without sampling.  ``send`` must be safe to call from another thread (the
    worker holds one lock around every send on the control connection).  A failed send ends
    the periodic sampling quietly: the main thread's next send reports the lost connection."""

    def __init__(self, send: Callable[[P.Sample], None], rank: int, comm: Communicator, every_s: float, host: str):
        self.send, self.rank, self.comm, self.every_s, self.host = send, rank, comm, every_s, host
        self._cond = threading.Condition()
        self._task: _Task | None = None
        self._thread: threading.Thread | None = None
        self._broken = False
        self.final: P.Sample | None = None  # the last task's final sample, for its Result or Failed

    @contextmanager
    def running(self, task: int) -> Iterator[None]:
        self.final = None
        if self.every_s <= 0:
            yield
            return
        _reset_peak()
        comm, now = self.comm, time.perf_counter()
        cpu = _cpu_seconds()
        state = _Task(
            task, (comm.bytes_sent, comm.bytes_received, comm.comm_time()), now, now + self.every_s, now, cpu, cpu
        )
        with self._cond:
            self._task = state
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="phalanx-sampler", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._cond:  # after any periodic sample of the task
                self._task = None
                self.final = self._reading(state, final=True)

    def _loop(self) -> None:
        with self._cond:
            while not self._broken:
                # no task wakes it (a task's start or end would cost the task the thread's
                # switch): idle, it looks again after an interval, which ends before a
                # task's first sample is due
                state = self._task
                if state is None:
                    self._cond.wait(self.every_s)
                    continue
                late = time.perf_counter() - state.due
                if late < 0:
                    self._cond.wait(-late)
                    continue
                state.due += self.every_s * (int(late / self.every_s) + 1)  # the next one still ahead
                try:
                    self.send(self._reading(state))
                except Exception:
                    self._broken = True

    def _reading(self, state: _Task, final: bool = False) -> P.Sample:
        from . import protocol as P

        now, cpu = time.perf_counter(), _cpu_seconds()
        span = now - state.last_wall
        if final or span < MIN_SPAN_S:
            # the final sample: over the whole task (what a finished stage shows); a span too
            # short for the clock's ticks (10 ms) to measure would read 0 % or 400 %
            since, used = now - state.t0, cpu - state.cpu0
        else:
            since, used = span, cpu - state.last_cpu
        busy = 100.0 * used / since if since > 0 else 0.0
        state.last_wall, state.last_cpu = now, cpu
        rss, peak = _memory()
        comm = self.comm
        sent0, received0, seconds0 = state.base
        return P.Sample(
            task=state.task,
            rank=self.rank,
            ts=time.time(),
            host=self.host,
            cpu=round(busy, 1),
            rss=rss,
            peak_rss=max(peak, rss),
            sent=comm.bytes_sent - sent0,
            received=comm.bytes_received - received0,
            comm_s=max(0.0, comm.comm_time() - seconds0),
            elapsed=now - state.t0,
            final=final,
        )


__all__ = ["DEFAULT_S", "Sampler", "interval_s"]
