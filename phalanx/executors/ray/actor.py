"""Inside the rank actor: one rank of a gang, in a process the raylet started.

``RankActor.serve`` runs the phalanx rank worker (``phalanx.runtime.worker.main``) in the actor
process itself for the rank's whole life, or — for a command stage — the program as a child
process that dies with the actor.  The actor has two threads (``max_concurrency=2``) so that
``redirect`` (a gang reused by the next stage writes to that stage's log directory) still
reaches it while ``serve`` runs.

Environment, compared with a local rank: ``PHALANX_PDEATHSIG=0`` (our parent is the raylet;
Ray ends a job's actors with its driver), no ``PHALANX_CPUS`` (Ray reserves CPU counts, not
core ids), and ``PHALANX_RAY_NODE_ID``, ``PHALANX_RAY_NODE_IP``, ``PHALANX_RAY_ACTOR_ID``.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...procs import die_with_parent
from ...runtime import protocol as P
from ...runtime.envvars import ENV_RAY_ACTOR_ID as ENV_ACTOR_ID  # the names phalanx.executors.ray exports
from ...runtime.envvars import ENV_RAY_NODE_ID as ENV_NODE_ID
from ...runtime.envvars import ENV_RAY_NODE_IP as ENV_NODE_IP


class RankActor:
    """One rank.  ``serve`` runs the rank until the gang shuts it down (wrapped by
    ``ray.remote`` on the driver, so importing this module needs no Ray)."""

    def info(self) -> dict[str, Any]:
        """Where this rank runs: pid, Ray node id and IP, host name."""
        import ray

        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
        }

    def redirect(self, log_path: str) -> None:
        """Send this rank's output (file descriptors 1 and 2) to ``log_path`` from now on."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        _flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def free_port(self, host: str) -> int:
        """A free TCP port of this node (for the rendezvous rank 0 hosts)."""
        from ...runtime.rendezvous import free_port

        return free_port(host)

    def serve(
        self,
        env: dict[str, str],
        log_path: str,
        command: list[str] | None = None,
        cwd: str | None = None,
        driver_python: str | None = None,
    ) -> int:
        """Run the rank; its exit code.  ``command`` None: the phalanx worker, in this process;
        else that program as a child process (a command stage), which dies with the actor."""
        import ray

        ctx = ray.get_runtime_context()
        env = dict(env)
        env.pop(P.ENV_CPUS, None)  # core ids mean nothing to Ray's CPU counts
        env.pop(P.ENV_CPUS_BY_RANK, None)
        env[P.ENV_PDEATHSIG] = "0"  # our parent is the raylet; Ray ends us with the job
        env[ENV_NODE_ID] = ctx.get_node_id()
        env[ENV_NODE_IP] = ray.util.get_node_ip_address()
        env[ENV_ACTOR_ID] = ctx.get_actor_id() or ""
        os.environ.update(env)
        if cwd and os.path.isdir(cwd):  # as for local ranks: the driver's directory, if here too
            os.chdir(cwd)
        # apps are pickled by reference: import what the driver imports (where it exists here)
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.insert(0, entry)

        self.redirect(log_path)
        if command is not None:
            return run_command(command, driver_python)

        from ...runtime import worker

        try:
            code = worker.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            _flush()
        return int(code or 0)


def is_worker(argv: Sequence[str]) -> bool:
    """Is ``argv`` the phalanx rank worker (``python -m phalanx.runtime.worker``)?"""
    return list(argv[-2:]) == ["-m", "phalanx.runtime.worker"]


def run_command(command: list[str], driver_python: str | None) -> int:
    """A command stage's program on this rank, output to our (redirected) stdout/stderr; it
    gets SIGKILL when the actor process ends (PDEATHSIG)."""
    import subprocess

    if driver_python and command and command[0] == driver_python:
        command = [sys.executable, *command[1:]]  # this node's Python, not the driver's path
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    except OSError as exc:
        print(f"phalanx: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 127
    return proc.wait()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
