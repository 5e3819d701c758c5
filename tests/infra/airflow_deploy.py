"""Airflow 3 deployed as users run it, for tests/test_airflow.py: a scheduler (LocalExecutor: its
workers are processes it starts), a dag-processor, a triggerer and an api-server, each an
``airflow`` command of its own, on SQLite, everything bound to 127.0.0.1.

- The api-server listens on a free port of 127.0.0.1; the workers reach its execution API there.
- The scheduler's and triggerer's log servers (which bind every address) are not started
  (``--skip-serve-logs``): the api-server reads task logs from the shared log folder.
- ``simple_auth_manager_all_admins``: the REST API needs no login, so no credential exists; the
  JWT and API secrets the processes share are random, passed in the environment only.
- ``stop()`` ends the processes it started, by PID (SIGTERM, then SIGKILL after a deadline),
  and each one's process group (LocalExecutor's workers, the api-server's children).

Every wait polls with a deadline; nothing sleeps to pass.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMPONENTS = {
    "api-server": ["api-server", "--host", "127.0.0.1", "--workers", "1"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.2, on_timeout=None) -> Any:
    """``check()``'s first truthy value, polled every ``every`` s; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"waited {timeout:.0f} s for {what}{extra}")
        time.sleep(every)


class Deployment:
    """Airflow in ``home`` (whose ``airflow.db`` is migrated already) with ``dags`` as its DAG folder."""

    def __init__(self, home: Path, dags: Path, env: dict[str, str]):
        self.home, self.dags = home, dags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = home / "logs"
        self.env = {
            **env,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.logs),
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "300",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            # a triggerer paused by a test for a while is not declared dead (its triggers moved)
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "300",
        }
        self.procs: dict[str, subprocess.Popen] = {}

    # ---- the processes ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the four processes (``wait_up`` waits for the api-server)."""
        for name, args in COMPONENTS.items():
            if name == "api-server":
                args = [*args, "--port", str(self.port)]
            out = open(self.home / f"{name}.out", "wb")  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "airflow", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its workers in its group: ended with it
                cwd=self.home,
            )
            out.close()

    def wait_up(self, timeout: float = 180) -> None:
        wait_for("the api-server", self._api_up, timeout, 0.3, self.tails)

    def _api_up(self) -> bool:
        self.check_alive()
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise AssertionError(f"airflow {dead} exited{self.tails()}")

    def tails(self, n: int = 3000) -> str:
        out = []
        for name in self.procs:
            path = self.home / f"{name}.out"
            text = path.read_text(errors="replace")[-n:] if path.exists() else ""
            out.append(f"\n--- {name} ---\n{text}")
        return "".join(out)

    def pause(self, name: str) -> None:
        """SIGSTOP to a component's process group (by its PID): it does nothing until ``resume``."""
        if self.procs[name].poll() is None:
            _signal_group(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        if self.procs[name].poll() is None:
            _signal_group(self.procs[name].pid, signal.SIGCONT)

    def stop(self, grace: float = 6.0) -> None:
        """SIGTERM to each started process and its group, by PID; after ``grace`` s SIGKILL to
        the groups whose leader is still there.  A group is signalled only while its leader has
        not been reaped (its PID cannot belong to another process then)."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            _signal_group(p.pid, signal.SIGCONT)  # one paused by a test that failed meanwhile
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in running:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)  # it and what is left of its group (workers)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass

    # ---- the REST API (all admins: no login) ----------------------------------------------------------
    def api(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}/api/v2/{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}") from None
        return json.loads(raw) if raw else None

    def get_or_none(self, path: str) -> Any:
        try:
            return self.api("GET", path)
        except AssertionError:
            return None

    def wait_dag(self, dag_id: str, timeout: float = 120) -> None:
        def parsed():
            self.check_alive()
            return self.get_or_none(f"dags/{dag_id}")

        wait_for(f"DAG {dag_id} to be parsed", parsed, timeout, 0.5, self.tails)

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        run = self.api("POST", f"dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})
        return run["dag_run_id"]

    def ti(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return self.api("GET", f"dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}")

    def wait_ti(
        self, dag_id: str, run_id: str, task_id: str, states: set[str], try_number: int, timeout: float = 120
    ) -> dict[str, Any]:
        """The task instance once its try ``try_number`` is in one of ``states`` (a finished state
        it was not waited for fails at once)."""
        seen: dict[str, Any] = {}

        def reached():
            self.check_alive()
            ti = seen["ti"] = self.ti(dag_id, run_id, task_id)
            if ti["try_number"] == try_number and ti["state"] in states:
                return ti
            if ti["try_number"] == try_number and ti["state"] in ("success", "failed", "upstream_failed"):
                raise AssertionError(
                    f"{task_id} try {try_number} is {ti['state']}, not {states}:\n{self.log(dag_id, run_id, task_id, try_number)}"
                )
            return None

        return wait_for(
            f"{task_id} try {try_number} to be {states}",
            reached,
            timeout,
            0.3,
            lambda: (
                f" (last seen {seen.get('ti', {}).get('state')} try {seen.get('ti', {}).get('try_number')}){self.tails()}"
            ),
        )

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The task's log of one try as the UI shows it (the REST API's, every source merged)."""
        got = self.api(
            "GET", f"dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}/logs/{try_number}?full_content=true"
        )
        content = got.get("content", "") if isinstance(got, dict) else got
        if isinstance(content, list):
            return "\n".join(c.get("event", "") if isinstance(c, dict) else str(c) for c in content)
        return str(content)

    def clear(self, dag_id: str, run_id: str, task_id: str) -> None:
        self.api(
            "POST",
            f"dags/{dag_id}/clearTaskInstances",
            {"dry_run": False, "task_ids": [task_id], "dag_run_id": run_id, "only_failed": False},
        )

    def mark(self, dag_id: str, run_id: str, task_id: str, state: str) -> None:
        self.api("PATCH", f"dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances/{task_id}", {"new_state": state})


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group it leads (start_new_session): this PID's own group only
    except (ProcessLookupError, PermissionError):
        pass


def deploy(home: Path, dags: Path, migrated_db: Path, env: dict[str, str]) -> Deployment:
    """A deployment in ``home`` on a copy of ``migrated_db``, its processes started (not yet
    waited for: ``wait_up``)."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(migrated_db, home / "airflow.db")
    cfg = migrated_db.parent / "airflow.cfg"
    if cfg.exists():  # written once: not by four processes starting at once (the environment overrides it)
        shutil.copy(cfg, home / "airflow.cfg")
    d = Deployment(home, dags, env)
    try:
        d.start()
    except BaseException:
        d.stop()
        raise
    return d
