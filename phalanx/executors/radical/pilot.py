"""A run's pilot: one RADICAL-Pilot pilot, submitted when the run opens, cancelled when it closes.

Everything the pilot started lives in its sandbox (``<sandbox>/radical.pilot.sandbox/<session>/
<pilot>``): RP's agent and its components run there, every task in a directory of it.  That is
how phalanx finds them again — a pilot's processes are those of its host whose working
directory is in its sandbox — when RP does not end them itself: cancelling a pilot stops the
agent but leaves the tasks it runs as they are (RP 1.103), and a driver killed without a word
leaves the whole pilot running until its walltime.  ``release`` (another process: ``phalanx
status``/``cancel``/``--resume``) asks the agent through its command port, as
``radical-pilot-control`` does, and then ends what is left of a local pilot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ...errors import GangError
from ..base import AllocationHook, held, released
from .config import RadicalConfig
from .session import RPSession, session_for

log = logging.getLogger("phalanx.executors.radical")
FINAL = ("DONE", "FAILED", "CANCELED")
LOCAL_RUNTIME_MIN = 7 * 24 * 60  # a local pilot ends with its run, not at a walltime


def url_path(url: Any) -> Path:
    """A sandbox URL RP gives (``file://localhost/tmp/...``) as a path."""
    text = str(url)
    return Path(urlparse(text).path if "://" in text else text)


def _site(site: str) -> str:
    return f" (site {site!r})" if site and site != "radical" else ""


class RadicalPilot:
    """The run's pilot.  ``submit()`` starts it (in a thread: an RP session takes seconds to
    start, the pilot more to become active); the first gang waits for it in ``wait_active``;
    ``close()`` ends it and what still runs on it."""

    def __init__(
        self,
        cfg: RadicalConfig,
        site: str = "radical",
        site_cores: int | None = None,
        hook: AllocationHook | None = None,
    ):
        self.cfg = cfg
        self.site = site
        self.cores = cfg.pilot_cores(site_cores)
        self.hook = hook
        self.uid = f"{cfg.job_name}-pilot-{uuid.uuid4().hex[:12]}"
        self.session: RPSession | None = None
        self.pilot: Any = None
        self.tmgr: Any = None
        self.sandbox: Path | None = None
        self.error: BaseException | None = None
        self.closed = False
        self._record: dict | None = None
        self._ready = threading.Event()  # submitted (or failed to be)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- start ------------------------------------------------------------------------------
    def submit(self) -> RadicalPilot:
        """Submit the pilot in the background (once)."""
        with self._lock:
            if self._thread is None and not self.closed:
                self._thread = threading.Thread(target=self._submit, name=f"phalanx-radical-{self.uid}", daemon=True)
                self._thread.start()
        return self

    def description(self) -> dict[str, Any]:
        cfg = self.cfg
        assert self.session is not None, "a pilot is described once its session is made (_submit)"
        runtime = cfg.runtime if "runtime" in cfg.model_fields_set or not cfg.local else LOCAL_RUNTIME_MIN
        pd: dict[str, Any] = {
            "uid": self.uid,
            "resource": cfg.resource,
            "runtime": runtime,
            "sandbox": str(self.session.root),
            "exit_on_error": False,
        }
        if self.cores:
            pd["cores"] = self.cores
        if cfg.nodes:
            pd["nodes"] = cfg.nodes
        if cfg.gpus:
            pd["gpus"] = cfg.gpus
        for key in ("access_schema", "queue", "project"):
            if getattr(cfg, key):
                pd[key] = getattr(cfg, key)
        return pd

    def _submit(self) -> None:
        try:
            session = session_for(self.cfg)
            from .session import import_rp

            rp = import_rp()
            with self._lock:  # close() meanwhile: nothing is submitted
                self.session = session
                if self.closed:
                    return
                self._record = {
                    "executor": "radical",
                    "kind": "pilot",
                    "id": self.uid,
                    "resource": self.cfg.resource,
                    "host": socket.gethostname(),
                    "session": session.uid,
                    "sandbox": str(session.root / "radical.pilot.sandbox" / session.uid / self.uid),
                }
                held(self.hook, self._record)  # before RP knows it: found by its sandbox
                # a TaskManager per pilot: RP's fails every task it manages (of any pilot) as
                # "pilot died" when one of its pilots ends — another run's, here
                self.tmgr = session.task_manager()
                with session.api:
                    self.pilot = session.pmgr.submit_pilots(rp.PilotDescription(self.description()))
                    self.tmgr.add_pilots(self.pilot)
                self.sandbox = url_path(self.pilot.pilot_sandbox)
                if str(self.sandbox) != self._record["sandbox"]:
                    self._record = {**self._record, "sandbox": str(self.sandbox)}
                    held(self.hook, self._record)
                log.debug("radical: pilot %s submitted", self.uid)
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def wait_active(self, timeout: float | None, gone: threading.Event | None = None) -> None:
        """Until the pilot is active; ``GangError`` with RP's word when it failed, was closed,
        or is not active within ``timeout`` (or ``radical.pilot_timeout``)."""
        self.submit()
        timeout = self.cfg.pilot_timeout or timeout
        deadline = time.monotonic() + timeout if timeout else None
        wait = 0.05
        while True:
            if self.closed or (gone is not None and gone.is_set()):
                raise GangError(f"radical: pilot {self.uid} was closed before it became active{_site(self.site)}")
            if self._ready.is_set():
                if self.error is not None:
                    if isinstance(self.error, GangError):
                        raise GangError(str(self.error))
                    raise GangError(
                        f"radical: pilot {self.uid} could not be submitted{_site(self.site)}: "
                        f"{type(self.error).__name__}: {self.error}"
                    ) from self.error
                state = self.pilot.state
                if state == "PMGR_ACTIVE":
                    return
                if state in FINAL:
                    raise GangError(
                        f"radical: pilot {self.uid} {state} before it became active{_site(self.site)}{self._log_tail()}"
                    )
            if deadline is not None and time.monotonic() > deadline:
                what = self.pilot.state if self.pilot is not None else "starting an RP session"
                raise GangError(
                    f"radical: pilot {self.uid} {what} for more than {timeout:.0f} s "
                    f"({self.cfg.resource}){_site(self.site)}"
                )
            time.sleep(wait)
            wait = min(wait * 1.5, 0.25)

    def _log_tail(self) -> str:
        """Why a pilot failed, in RP's words: the exception its launcher logged (a resource
        RP cannot start), or what the pilot's bootstrap and agent said last."""
        lines: list[str] = []
        if self.session is not None:
            for log_file in sorted(self.session.path.glob("pmgr_launching.*.log")):
                try:
                    text = log_file.read_text(errors="replace").splitlines()
                except OSError:
                    continue
                errors = [l.strip() for l in text if re.match(r"^\w+(Error|Exception): ", l.strip())]
                lines += [f"  RP's pilot launcher: {e}" for e in errors[-2:]]
        if self.sandbox is not None:
            for name in ("bootstrap_0.err", "bootstrap_0.out", "agent_0.err"):
                try:
                    text = (self.sandbox / name).read_text(errors="replace").strip().splitlines()
                except OSError:
                    continue
                lines += [f"  {name}: {line}" for line in text[-5:] if line.strip()]
        try:
            if self.pilot is not None and self.pilot.stderr:
                lines.append(f"  {str(self.pilot.stderr).strip().splitlines()[-1]}")
        except Exception:
            pass
        return (
            (f"; sandbox {self.sandbox}:\n" + "\n".join(lines[-8:]))
            if lines
            else f"; see RP's logs in {self.session.path if self.session else self.sandbox}"
        )

    @property
    def state(self) -> str:
        if self.pilot is None:
            return "NEW" if not self._ready.is_set() else "FAILED"
        return self.pilot.state

    def status(self) -> str:
        return f"radical: pilot {self.uid} {self.state} on {self.cfg.resource} ({self.cores or '?'} cores)"

    # ---- end --------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Cancel the pilot (RP's agent ends) and end whatever still runs in its sandbox.  A
        pilot not submitted yet never will be (the RP session it waited for stays the
        process's); RP's acknowledgement is awaited ``timeout`` s (default: 2 s for a local
        pilot, whose processes phalanx ends itself, else 60 s)."""
        with self._lock:  # a submission under way finishes first: then it can be cancelled
            if self.closed:
                return
            self.closed = True
            pilot, session = self.pilot, self.session
        if timeout is None:
            timeout = 2.0 if self.cfg.local else 60.0
        if pilot is not None and session is not None and not session.closed and pilot.state not in FINAL:
            try:
                with session.api:  # RP publishes the cancel; its wait is ours (without the lock)
                    session.pmgr.cancel_pilots(pilot.uid, _timeout=0.01)
            except Exception as exc:
                log.warning("radical: cancelling pilot %s: %s", pilot.uid, exc)
            deadline = time.monotonic() + timeout
            while pilot.state not in FINAL and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.sandbox is not None and self.cfg.local:
            sweep(self.sandbox, grace_s=2.0)
        if self.tmgr is not None and session is not None and not session.closed:
            try:
                with session.api:
                    self.tmgr.close()
            except Exception as exc:
                log.warning("radical: closing the task manager of pilot %s: %s", self.uid, exc)
        record, self._record = self._record, None
        if record is not None:
            released(self.hook, record)


# ---- what another process can do: ask the agent, end a local pilot's processes --------------
def agent_command(sandbox: Path, cmd: str, arg: dict, timeout: float = 5.0) -> bool:
    """Send a command to a pilot's agent through its command port (``agent_0.ports.json`` in
    its sandbox, as ``radical-pilot-control`` does); False when no agent answers."""
    try:
        info = json.loads((Path(sandbox) / "agent_0.ports.json").read_text())
        with socket.create_connection((info["command_hostip"], int(info["command_port"])), timeout=timeout) as s:
            s.sendall(json.dumps({"cmd": cmd, "arg": arg}).encode())
            return s.recv(16) == b"OK"
    except (OSError, ValueError, KeyError):
        return False


def processes_in(directory: Path) -> list[int]:
    """Processes of this host whose working directory is ``directory`` or below it."""
    root = os.path.realpath(directory)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + "/"):
            found.append(int(entry.name))
    return found


def sweep(directory: Path, grace_s: float = 2.0) -> list[int]:
    """SIGTERM every process working in ``directory`` (a pilot's or task's sandbox), SIGKILL
    what is left after ``grace_s``; the pids found."""
    from ...procs import pid_alive, signal_pid

    if "radical.pilot.sandbox" not in Path(directory).parts[:-1]:  # never anything but RP's sandboxes
        raise ValueError(f"{directory} is not a pilot's or task's sandbox")
    pids = processes_in(directory)
    for pid in pids:
        signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in processes_in(directory):
        signal_pid(pid, signal.SIGKILL)
    return pids


def release(record: dict) -> str:
    """Free a pilot or task a driver recorded (``base.held``), from any process."""
    kind, uid = record.get("kind", "pilot"), record["id"]
    sandbox = Path(record["sandbox"]) if record.get("sandbox") else None
    local = str(record.get("resource", "")).startswith("local.") and record.get("host") == socket.gethostname()
    if sandbox is None:
        return f"radical: {kind} {uid}: no sandbox recorded; nothing to do"
    if kind == "task":
        pilot_box = sandbox.parent
        asked = agent_command(pilot_box, "cancel_tasks", {"uids": [uid]})
        swept = sweep(sandbox) if local else []
        if not asked and not swept:
            return f"radical: task {uid} already gone"
        return f"radical: task {uid} cancelled" + (f" ({len(swept)} processes ended)" if swept else "")
    asked = agent_command(sandbox, "cancel_pilots", {"uids": [uid]})
    ended: list[int] = []
    if local:
        deadline = time.monotonic() + (10.0 if asked else 0.0)
        while asked and processes_in(sandbox) and time.monotonic() < deadline:  # the agent ends its part
            time.sleep(0.1)
        ended = sweep(sandbox)
    if not asked and not ended:
        return f"radical: pilot {uid} already gone"
    return (
        f"radical: pilot {uid} cancelled"
        + (" through its agent's command port" if asked else "")
        + (f"; {len(ended)} processes of its sandbox ended" if ended else "")
    )


__all__ = ["FINAL", "RadicalPilot", "agent_command", "processes_in", "release", "sweep", "url_path"]
