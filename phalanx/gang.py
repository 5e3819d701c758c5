"""``px.Gang``: a set of rank processes that lives across many BSP apps.

The gang starts its ranks once (processes, rendezvous, communicator), runs any number of
apps on them, and stops them all on exit, on error and on Ctrl-C.  If one rank fails the
others are stopped within about a second and the caller gets the failing rank's traceback;
the next ``run`` starts a fresh gang.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import GangError, PhalanxError, RankError, RankFailure, StageTimeoutError
from .executors import DEFAULT, DEFAULT_MPI
from .executors import create as create_executor
from .executors.base import Executor, Launcher
from .executors.control import ControlServer
from .executors.local import WORKER_ARGV
from .executors.logs import tail as tail_of_log
from .paths import default_log_root
from .procs import pid_alive
from .runtime import protocol as P
from .runtime.rendezvous import backend_for, new_gang_id
from .runtime.sampler import interval_s as sample_interval_s
from .runtime.tasks import check_app
from .store import Store

log = logging.getLogger("phalanx.gang")

_FAIL_GRACE_S = 1.0  # after a first failure, how long other ranks get to report theirs
_POLL_S = 0.2
_FAILED = (P.Failed, P.Disconnected)  # the control events that end a rank's part in a task
_COMMAND_POLL_S = 0.05  # how often a command gang's exit codes are read
_live_gangs: weakref.WeakSet[Gang] = weakref.WeakSet()

# Turns ``site="name"`` into a site model; set by ``phalanx/__init__`` (site files are the
# orchestrator's), so this layer never imports it.
_site_loader: Callable[[str], Any] | None = None


def set_site_loader(loader: Callable[[str], Any]) -> None:
    global _site_loader
    _site_loader = loader


# How a gang shows in Jupyter — ``_repr_html_``, a live per-rank view of ``run``, rank output
# grouped by rank: phalanx.integrations.jupyter's hooks, injected by ``phalanx/__init__`` so that
# this layer imports neither the integration nor IPython.
_notebook: Any = None


def set_notebook(hooks: Any) -> None:
    global _notebook
    _notebook = hooks


class Gang:
    """``ranks`` processes that run BSP apps together.

    >>> with Gang(ranks=4) as gang:
    ...     gang.run(app, 1_000_000)      # -> [result of rank 0, ..., result of rank 3]
    """

    def __init__(
        self,
        ranks: int,
        *,
        executor: str | Executor | Launcher | None = None,
        communicator: str | None = None,
        rendezvous: str | None = None,
        log_dir: str | Path | None = None,
        echo: bool | Callable[[str], None] = True,
        start_timeout: float | None = None,
        comm_timeout: float = 1800.0,
        store: str | Path | Store | None = None,
        session: str = "default",
        control_host: str | None = None,
        site: str | Path | Any | None = None,
        slots: Sequence[int] = (),
        config: Mapping[str, Any] | None = None,
    ):
        """``site``: a site name, file or model (``px.Gang(4, site="ray-local")``): executor,
        communicator, rendezvous, store root, driver address and start timeout come from it;
        arguments given here win.  ``executor``: a registered name, an ``Executor`` (the
        caller opens and closes its run scope) or a ``Launcher``; ``slots``: the executor's
        slots this gang runs on (a scheduler's share); ``config``: keys over the executor's
        site section for this gang (a stage's own ``slurm:`` section).  ``echo``: the ranks'
        lines to stderr (True), to a callable, or (False) only to ``log_dir/rank-N.log`` — with
        no ``log_dir`` given, the gang says where that is when it starts."""
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"ranks must be an integer ≥ 1, got {ranks!r}")
        self._owned: Executor | None = None  # an executor this gang made: its run scope is the gang's
        if site is not None:
            # a site model (the orchestrator's, which this layer does not import) or what names one
            s: Any = site if hasattr(site, "create_executor") else _load_site(site)
            communicator = communicator or s.communicator
            rendezvous = rendezvous or s.rendezvous
            control_host = control_host or s.driver_host
            start_timeout = start_timeout or s.start_timeout
            if store is None:  # the site's store: root, catalogue and write-through target
                durable = s.store.durable if s.store.durability == "write-through" else None
                store = Store(s.store.root, session, metadata=s.store.metadata, durable=durable)
            if executor is None:
                executor = self._owned = s.create_executor()
        communicator = communicator or "tcp"
        self.world_size = ranks
        # MPI ranks must be started by an MPI launcher; everything else runs as local processes.
        executor = executor or (DEFAULT_MPI if communicator == "mpi" else DEFAULT)
        if isinstance(executor, str):
            executor = self._owned = create_executor(executor)
        self.executor = executor
        self.slots, self.config = list(slots), config
        self._scope_open = False
        self.communicator = communicator
        self.rendezvous = rendezvous or "tcp"
        self.echo = echo
        if echo is True and _notebook is not None:  # in a Jupyter kernel: rank lines under the cell that runs
            self.echo = _notebook.echo(self) or True
        self.start_timeout = start_timeout or 120.0
        self.comm_timeout = comm_timeout
        self.control_host = control_host or "127.0.0.1"  # where ranks reach the driver ("auto": this host's address)
        self._log_dir_arg = Path(log_dir) if log_dir else None
        self.store = store if isinstance(store, Store) else Store(store, session)
        self._launcher: Launcher | None = None
        self._control: ControlServer | None = None
        self._rdzv_url: str | None = None
        self._task = 0
        self.runs = 0  # apps run by the gang now running (its ranks); a fresh gang starts again at 0
        self.gang_id = ""
        self.log_dir: Path | None = None
        self.ready_seconds: float | None = None
        self.pids: list[int] = []
        self.hosts: list[str] = []  # where each rank runs (from its hello)
        # called with each resource sample a rank sends while an app runs (runtime.sampler), in
        # a control reader thread; the latest per rank: ``samples``
        self.on_sample: Callable[[P.Sample], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._launcher is not None

    @property
    def samples(self) -> dict[int, P.Sample]:
        """The latest resource sample of each rank (``runtime.sampler``); empty before the first."""
        return dict(self._control.samples) if self._control is not None else {}

    def _sampled(self, sample: P.Sample) -> None:
        sink = self.on_sample
        if sink is not None:
            sink(sample)

    def health(self) -> str | None:
        """None when every rank is alive and connected, else what is wrong: a gang kept idle
        between runs (reused by the next stage) may have lost a rank meanwhile."""
        launcher, control = self._launcher, self._control
        if launcher is None:
            return "not running"
        codes = launcher.exitcodes()
        dead = [f"rank {r} exited with code {c}" for r, c in enumerate(codes) if c is not None]
        # a rank whose main thread is gone but not yet reaped (threads still ending) is dead too
        here = socket.gethostname()
        dead += [
            f"rank {r} (pid {pid}) is gone"
            for r, (pid, host) in enumerate(zip(self.pids, self.hosts))
            if codes[r] is None and host == here and not pid_alive(pid)
        ]
        lost: list[int] = []
        if control is not None:  # (a command's gang has no control connections)
            with control.events.mutex:  # a rank's lost connection is an event nobody read yet
                lost = sorted({r for r, msg in control.events.queue if isinstance(msg, _FAILED)})
        dead += [f"rank {r} lost its connection" for r in lost if not any(d.startswith(f"rank {r} ") for d in dead)]
        return "; ".join(dead) or None

    def start(self) -> Gang:
        if self.running:
            return self
        t0 = time.perf_counter()
        try:
            sample_s = sample_interval_s()
        except ValueError as exc:
            raise GangError(str(exc)) from None
        launcher, log_dir = self._prepare()
        # weakly: the control server (its reader threads) must not keep the gang alive — a gang
        # nobody references any more is closed by its finalizer (the notebook's "no longer referenced")
        self._control = ControlServer(self.world_size, self.control_host, on_sample=_weak_sink(self))
        rank_env = self._rank_env(
            {
                **self._control.rank_env(),
                P.ENV_SAMPLE: f"{sample_s:g}",  # the driver's setting, on every executor
                P.ENV_COMM: self.communicator,
                P.ENV_TIMEOUT: str(self.comm_timeout),
                # Functions are pickled by reference to their module: ranks must import what the
                # driver imports (the user's script directory, a test directory...).
                "PYTHONPATH": os.pathsep.join([os.getcwd()] + [p for p in sys.path if p]),
            }
        )
        try:
            launcher.launch(WORKER_ARGV, rank_env, log_dir)
            self._await_ready()
        except BaseException:
            self._teardown(graceful=False)
            raise
        self.ready_seconds = time.perf_counter() - t0
        self.runs = 0
        log.debug("gang %s ready in %.2fs", self.gang_id, self.ready_seconds)
        return self

    def _prepare(self) -> tuple[Launcher, Path]:
        """A new gang id, log directory, launcher and rendezvous (torn down by ``_teardown``);
        returns the launcher and the log directory."""
        self.gang_id = new_gang_id()
        self.pids, self.hosts = [], []  # (the ranks of a gang before it: known again once ready)
        self.log_dir = log_dir = self._log_dir_arg or default_log_root() / self.gang_id
        if self.echo is False and self._log_dir_arg is None:  # nothing else would say where the output goes
            n = self.world_size
            files = f"{log_dir / 'rank-0.log'}" if n == 1 else f"{log_dir / 'rank-N.log'} (N = 0..{n - 1})"
            print(
                f"phalanx: gang {self.gang_id}: rank output goes to {files} (echo=False)", file=sys.stderr, flush=True
            )
        self._launcher = launcher = self._make_launcher()
        launcher.start_timeout = self.start_timeout
        _live_gangs.add(self)
        try:
            self._rdzv_url = backend_for(self.rendezvous).prepare(self.rendezvous, self.gang_id, log_dir)
        except BaseException:
            self._teardown(graceful=False)
            raise
        return launcher, log_dir

    def _rank_env(self, extra: dict[str, str]) -> list[dict[str, str]]:
        """Every rank's environment: world, rendezvous, gang id, the store's settings (root,
        session, metadata URL, memory budget, spill directory), ``extra``, its rank and placement."""
        launcher, rdzv_url = self._launcher, self._rdzv_url
        if launcher is None or rdzv_url is None:  # torn down by another thread (a cancel)
            raise GangError(f"gang {self.gang_id} was stopped")
        base = {
            P.ENV_WORLD_SIZE: str(self.world_size),
            P.ENV_RDZV: rdzv_url,
            P.ENV_GANG_ID: self.gang_id,
            P.ENV_PDEATHSIG: "1",
            **self.store.rank_env(),
            **extra,
        }
        placement = launcher.placement(self.world_size)
        return [{**base, P.ENV_RANK: str(r), **placement[r]} for r in range(self.world_size)]

    def run_command(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> None:
        """Run an external program as every rank (a command stage: an existing MPI or native
        code): it gets PHALANX_RANK, PHALANX_WORLD_SIZE, a rendezvous URL and the store's
        settings, plus ``env``.  Returns when every rank exited 0; else, as for apps, the
        others are stopped at once and ``RankError`` names the failed ranks with their log
        tails; ``GangError`` when it does not finish within ``timeout``."""
        if self.running:
            raise GangError(f"gang {self.gang_id} runs the rank worker: a command needs a gang of its own")
        launcher, log_dir = self._prepare()
        ok = False
        try:
            launcher.launch(list(argv), self._rank_env(dict(env or {})), log_dir)
            self._await_exit(timeout)
            ok = True
        finally:
            self._teardown(graceful=ok)

    def _await_exit(self, timeout: float | None) -> None:
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            launcher = self._launcher
            if launcher is None:  # torn down by another thread (a cancel)
                raise GangError(f"gang {self.gang_id} was stopped")
            codes = launcher.exitcodes()
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                failures = {r: self._failure_of(r, P.Disconnected()) for r in failed}
                stopped = [r for r, c in enumerate(codes) if c is None]
                raise RankError(list(failures.values()), stopped)
            if all(c == 0 for c in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise self._timed_out(
                    {r for r, c in enumerate(codes) if c is None},
                    "finished",
                    f"finish within the stage timeout (timeout={timeout:g}s)",
                )
            time.sleep(_COMMAND_POLL_S)

    def _make_launcher(self) -> Launcher:
        if isinstance(self.executor, Launcher):
            return self.executor  # the scheduler's: it checked the stage
        ex = self.executor
        config = ex.stage_config(self.config) if self.config else None
        try:
            ex.check(self.world_size, ex.effective_config(config))  # what the launch would fail on, first
        except GangError:
            raise
        except PhalanxError as exc:  # the site cannot hold this gang: it cannot be placed
            raise GangError(f"gang {self.gang_id}: {exc}") from exc
        if self._owned is not None and not self._scope_open:
            self._owned.open_run()  # a standalone gang is its own run: its pilot lives as long as it
            self._scope_open = True
        return ex.launcher(self.world_size, slots=self.slots, config=config, echo=self.echo)

    def _await_ready(self) -> None:
        ready: set[int] = set()
        pids: dict[int, int] = {}
        failures: dict[int, RankFailure] = {}
        hosts: dict[int, str] = {}
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size and not failures:
            event = self._next_event(deadline)
            if event is None:
                raise self._timed_out(
                    set(range(self.world_size)) - ready,
                    "ready",
                    f"start within the start timeout (start_timeout={self.start_timeout:g}s)",
                    {r: (pids[r], hosts[r]) for r in pids},
                )
            rank, msg = event
            if isinstance(msg, P.Hello):
                pids[rank], hosts[rank] = msg.pid, msg.host
            elif isinstance(msg, P.Ready):
                ready.add(rank)
            elif isinstance(msg, _FAILED):
                failures[rank] = self._failure_of(rank, msg)
        if failures:
            self._collect_more(failures, set(range(self.world_size)) - ready, None)
            raise GangError(
                f"gang of {self.world_size} could not start "
                f"(communicator {self.communicator!r}, rendezvous {self.rendezvous!r}):\n"
                + str(RankError(list(failures.values())))
            )
        self.pids = [pids[r] for r in range(self.world_size)]
        self.hosts = [hosts[r] for r in range(self.world_size)]

    def redirect_logs(self, log_dir: str | Path) -> bool:
        """Send the ranks' output to ``log_dir`` from now on; False if the executor cannot."""
        launcher = self._launcher
        if launcher is None or not launcher.redirect(Path(log_dir)):
            return False
        self.log_dir = Path(log_dir)
        return True

    def status(self) -> str | None:
        """The resource manager's view of the gang (``slurm: job 42 RUNNING on n[1-2]``), if any."""
        launcher = self._launcher
        return launcher.status() if launcher is not None else None

    def close(self) -> None:
        """Stop the ranks: ask them to leave, then make sure they did; end the run scope of an
        executor this gang made (a SLURM pilot it started)."""
        self._teardown(graceful=True)
        self._close_scope()

    def _close_scope(self) -> None:
        if self._scope_open and self._owned is not None:  # (only an executor of its own opens one)
            self._scope_open = False
            self._owned.close_run()

    def _teardown(self, graceful: bool) -> None:
        if self._launcher is None:
            return
        launcher, control = self._launcher, self._control
        self._launcher = self._control = None
        if graceful and control is not None:
            for rank in list(control.conns):
                try:
                    control.send(rank, P.Shutdown())
                except OSError:
                    pass
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(c is None for c in launcher.exitcodes()):
                time.sleep(0.02)
        launcher.kill(grace_s=1.0 if graceful else 0.5)
        if control is not None:
            control.close()
        if not graceful:  # a put that did not seal must leave nothing behind
            self.store.abort_staging(self.gang_id)
        if self._rdzv_url:
            try:
                backend_for(self._rdzv_url).cleanup(self._rdzv_url)
            except Exception as exc:  # cleanup must not hide the real error
                log.warning("rendezvous cleanup failed: %s", exc)
        _live_gangs.discard(self)

    def __enter__(self) -> Gang:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Gang {self.gang_id or '-'} ranks={self.world_size} {self.communicator} {state}>"

    def _repr_html_(self) -> str | None:  # a notebook's view: executor, ranks, memory, logs (integrations.jupyter)
        return _notebook.gang_html(self) if _notebook is not None else None

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text view of the same
        p.text(_notebook.gang_text(self) if _notebook is not None else repr(self))

    # ---- running apps -------------------------------------------------------------------
    def run(
        self,
        app: Callable[..., Any] | str,
        *args: Any,
        params: dict | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``app(env, *args, **kwargs)`` on every rank; one result per rank.

        ``app`` is a callable or ``"package.module:function"``; ``params`` becomes
        ``env.params``.  If a rank fails, the others are stopped and ``RankError`` is raised,
        with the failing rank's traceback from the app down (a function of a script or a
        notebook cell travels by value with its lines of source: the traceback shows them).
        Past ``timeout`` seconds ``GangError`` names the ranks that did not finish (a rank whose
        process is stopped, rather than those waiting for it).
        """
        check_app(app)
        # in a Jupyter kernel: a live per-rank view of this run (integrations.jupyter), whose
        # wrapped app marks the end of each rank's output
        view = _notebook.run_view(self, app) if _notebook is not None else None
        if view is None:
            return self._run(app, args, kwargs, params, timeout)
        with view:
            return self._run(view.app, args, kwargs, params, timeout)

    def _run(self, app: Any, args: tuple, kwargs: dict, params: dict | None, timeout: float | None) -> list[Any]:
        if not self.running:
            self.start()
        assert self._control is not None
        self._task += 1
        self.runs += 1
        task = self._task
        try:
            for rank in range(self.world_size):
                self._control.send(rank, P.Run(task, app, args, kwargs, params))
            return self._gather(task, timeout)
        except BaseException:
            # Ctrl-C, a timeout or a failed rank: no rank may be left behind in a collective.
            self._teardown(graceful=False)
            raise

    def _gather(self, task: int, timeout: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        deadline = time.monotonic() + timeout if timeout else None
        while len(results) + len(failures) < self.world_size and not failures:
            event = self._next_event(deadline)
            if event is None:
                raise self._timed_out(
                    set(range(self.world_size)) - set(results),
                    "finished",
                    f"finish within the stage timeout (timeout={timeout:g}s)",
                )
            rank, msg = event
            if isinstance(msg, P.Result) and msg.task == task:
                results[rank] = msg.value
            elif isinstance(msg, _FAILED):
                failures[rank] = self._failure_of(rank, msg)
        if failures:
            pending = set(range(self.world_size)) - set(results) - set(failures)
            self._collect_more(failures, pending, results)
            stopped = sorted(set(range(self.world_size)) - set(results) - set(failures))
            raise RankError(list(failures.values()), stopped)
        return [results[r] for r in range(self.world_size)]

    def _collect_more(
        self, failures: dict[int, RankFailure], pending: set[int], results: dict[int, Any] | None
    ) -> None:
        """After a first failure, give the other ranks a moment to report theirs."""
        deadline = time.monotonic() + _FAIL_GRACE_S
        pending = set(pending) - set(failures)
        control = self._control
        while pending and control is not None:
            try:
                rank, msg = control.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if rank not in pending:
                continue
            if isinstance(msg, _FAILED):
                failures[rank] = self._failure_of(rank, msg)
                # a rank that vanished after a peer had failed of its own accord (not of a lost
                # peer) was ended with it (mpirun ends the whole job): that peer is the cause
                failures[rank].after_peer = isinstance(msg, P.Disconnected) and any(
                    not f.collateral for r, f in failures.items() if r != rank
                )
                pending.discard(rank)
            elif isinstance(msg, P.Result) and results is not None:
                results[rank] = msg.value
                pending.discard(rank)
        self._blame_the_first(failures)

    def _blame_the_first(self, failures: dict[int, RankFailure]) -> None:
        """Ranks that vanished together (mpirun ends every rank when one dies): blame the one
        the launcher says ended first, not the one whose disconnect happened to arrive first."""
        launcher = self._launcher
        vanished = [f for f in failures.values() if not f.exc_type]  # no exception of its own
        if launcher is None or len(vanished) < 2:
            return
        first = launcher.first_failed()
        if first is not None and first in failures:
            for f in vanished:
                f.after_peer = f.rank != first

    def _next_event(self, deadline: float | None) -> tuple[int, P.ToDriver] | None:
        """The next (rank, message) from the ranks; None once ``deadline`` has passed."""
        while True:
            control, launcher = self._control, self._launcher
            if control is None or launcher is None:  # torn down by another thread (a cancel)
                raise GangError(f"gang {self.gang_id} was stopped")
            wait = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return control.events.get(timeout=wait)
            except queue.Empty:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                return None
            for rank, code in enumerate(launcher.exitcodes()):
                if code is not None and rank not in control.conns:
                    return rank, P.Disconnected()  # died before it ever connected

    def _timed_out(
        self, late: set[int], done: str, what: str, where: Mapping[int, tuple[int, str]] | None = None
    ) -> GangError:
        """e.g. "ranks 1, 3 did not manage to finish within the stage timeout (timeout=5s);
        ranks 0, 2 finished; logs in ..."; ``where``: rank → (pid, host) of the ranks known
        (default: the gang's).  A late rank whose process is stopped (SIGSTOP, Ctrl-Z, a debugger)
        is the one named: the other late ranks most likely wait for it in a collective."""
        if where is None:
            where = {r: (pid, host) for r, (pid, host) in enumerate(zip(self.pids, self.hosts))}
        stopped = {r for r in late if r in where and _stopped(*where[r])}
        text = f"gang {self.gang_id}: {_ranks(stopped or late)} did not manage to {what}"
        if stopped:
            one = len(stopped) == 1
            text += f": {'its process is' if one else 'their processes are'} stopped (SIGSTOP, Ctrl-Z or a debugger)"
            if late - stopped:
                text += (
                    f"; {_ranks(late - stopped)} {'was' if len(late - stopped) == 1 else 'were'} still running, "
                    f"most likely waiting for {'it' if one else 'them'} in a collective"
                )
        others = sorted(set(range(self.world_size)) - late)
        if others:
            text += f"; {_ranks(others)} {done}"
        launcher = self._launcher  # None once torn down by another thread (a cancel)
        status = launcher.status() if launcher is not None else None  # e.g. "slurm: job 42 PENDING (Resources)"
        if status:
            text += f" ({status})"
        kind = StageTimeoutError if done == "finished" else GangError  # the stage's timeout, not the start's
        return kind(f"{text}; logs in {self.log_dir}")

    def _failure_of(self, rank: int, msg: P.Failed | P.Disconnected) -> RankFailure:
        if isinstance(msg, P.Failed):
            return msg.failure
        code = self._wait_exitcode(rank, getattr(self._launcher, "exit_latency", 1.0))
        if code is not None and code < 0:
            try:
                how = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal (e.g. 53, as SLURM ends a step): no name
                how = f"killed by signal {-code}"
            launcher = self._launcher  # None once torn down by another thread (a cancel)
            if code == -signal.SIGKILL and launcher is not None:  # over a memory limit, the OOM killer...
                how += launcher.memory_note(rank)
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "lost its connection to the driver"
        tail = tail_of_log(self.log_dir / f"rank-{rank}.log") if self.log_dir else ""
        tail = f"last lines of its log:\n{tail}" if tail else ""
        launcher = self._launcher
        cause = (launcher.end_cause(rank) or "") if launcher is not None and code is not None else ""
        return RankFailure(rank, "", f"rank process {how}", traceback=tail, exitcode=code, cause=cause)

    def _wait_exitcode(self, rank: int, within_s: float = 1.0) -> int | None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            launcher = self._launcher
            if launcher is None:  # torn down by another thread (a cancel): its ranks were stopped
                return None
            code = launcher.exitcodes()[rank]
            if code is not None:
                return code
            time.sleep(0.01)
        return None


def _ranks(ranks: Iterable[int]) -> str:
    """ "rank 2" or "ranks 0, 1, 3"."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _stopped(pid: int, host: str) -> bool:
    """Whether a rank process of this host is stopped (state T or t: a SIGSTOP, Ctrl-Z, a debugger)."""
    if host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):  # gone, or not Linux
        return False


def _load_site(site: str | Path) -> Any:
    if _site_loader is None:  # set by ``import phalanx``
        raise RuntimeError("px.Gang(site=NAME) needs the site loader that `import phalanx` registers")
    return _site_loader(str(site))


@atexit.register
def _stop_all_gangs() -> None:
    for gang in list(_live_gangs):
        gang._teardown(graceful=False)
        gang._close_scope()


def _weak_sink(gang: Gang) -> Callable[[P.Sample], None]:
    """``gang._sampled`` through a weak reference (a sample for a gang already gone is dropped)."""
    ref = weakref.WeakMethod(gang._sampled)

    def sink(sample: P.Sample) -> None:
        method = ref()
        if method is not None:
            method(sample)

    return sink
