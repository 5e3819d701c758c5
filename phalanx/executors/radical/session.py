"""This process's RADICAL-Pilot session: one ``rp.Session`` with its PilotManager.

A session costs seconds and a dozen processes (RP's ZeroMQ bridges and client components), so
the runs of a process share it, as Ray's connection is shared: each run submits and cancels its
own pilot on it (``pilot.RadicalPilot``, with a TaskManager of its own: RP's TaskManager fails
every task it manages when any one of its pilots ends), and the session is closed when the
process exits.
Sessions differ only where what RP reads at start-up differs (the resource configuration,
the interface, the Python environment, the sandbox root): the session of those settings is made
once and kept.

What RP needs to start here, set for the session's own processes while they start (and never
left in this process's environment):

- ``VIRTUAL_ENV`` and the environment's ``bin`` first on ``PATH`` (``radical.venv: auto``): RP
  starts ``radical-pilot-bridge``/``-component`` from ``PATH`` and a local agent from
  ``VIRTUAL_ENV`` (without it the bootstrap takes the system's ``python3`` and the pilot fails:
  ``radical-pilot-agent_0: command not found``);
- ``RADICAL_CONFIG_USER_DIR``: a private copy of the user's RP configs with ``radical.
  resource_config`` merged over the resource's (on ``local.*``: this machine's real core count);
- ``RADICAL_BASE`` (RP's id counters), RP's console reports off, and with ``radical.interface``
  the advertised interface (``RADICAL_DEFAULT_IFACE``) and every endpoint bound to its address
  (``_hook/sitecustomize.py``; radical.utils binds ``tcp://*`` otherwise).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...errors import GangError, MissingDependencyError
from ...extras import require
from ...runtime.envvars import ENV_RADICAL_BIND
from ..network import Beacon
from . import counters
from .config import RadicalConfig

log = logging.getLogger("phalanx.executors.radical")
HOOK_DIR = Path(__file__).resolve().parent / "_hook"

_lock = threading.RLock()  # sessions are made one at a time (they change os.environ)
_sessions: dict[str, RPSession] = {}


def import_rp():
    """``import radical.pilot``, or an error naming the extra to install."""
    rp = require("radical.pilot", "radical", "executor 'radical'")
    counters.install()  # before RP makes its first id: see counters.py
    return rp


def interface_address(iface: str) -> str:
    """The IPv4 address of a network interface (``lo`` → 127.0.0.1)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
        except OSError as exc:
            raise GangError(
                f"radical.interface: {iface!r} is no network interface with an IPv4 address here ({exc.strerror})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def venv_of(cfg: RadicalConfig) -> str | None:
    """The Python environment RP's processes start from (``radical.venv``)."""
    if cfg.venv == "none":
        return None
    if cfg.venv == "auto":
        if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
            return sys.prefix
        return os.environ.get("VIRTUAL_ENV") or None
    return os.path.abspath(os.path.expanduser(os.path.expandvars(cfg.venv)))


def resource_overrides(cfg: RadicalConfig) -> dict[str, Any]:
    """``radical.resource_config`` with the defaults a local resource needs."""
    over = dict(cfg.resource_config)
    if cfg.local:
        over.setdefault("cores_per_node", os.cpu_count() or 1)
        over.setdefault("gpus_per_node", 0)
    return over


def sandbox_root(cfg: RadicalConfig) -> Path:
    """Where the session's files and the pilots' sandboxes go (private to this user)."""
    from ...paths import state_dir
    from ...private import private_dir

    if cfg.sandbox:
        root = Path(os.path.expanduser(os.path.expandvars(cfg.sandbox)))
        root.mkdir(parents=True, exist_ok=True)
        return root.absolute()
    return private_dir(
        state_dir() / "radical",
        "RADICAL-Pilot's sessions and pilot sandboxes",
        "set radical.sandbox or PHALANX_STATE to a directory of your own",
    )


class RPSession:
    """One ``rp.Session`` with its PilotManager (closed at exit)."""

    def __init__(self, cfg: RadicalConfig, root: Path, key: str):
        self.key = key
        self.root = root
        self.resource = cfg.resource
        self.interface = cfg.interface
        self.bind = interface_address(cfg.interface) if cfg.interface else None
        self.closed = False
        self._lock = threading.Lock()
        # RP's managers talk to its registry through one ZeroMQ REQ socket, which is not
        # thread-safe: two runs submitting at once got a None endpoint.  Every call into RP's
        # API on this session takes this lock.
        self.api = threading.RLock()
        rp = import_rp()
        base = root / "client"
        base.mkdir(parents=True, exist_ok=True)
        # a local pilot ends with this process: its bootstrap starts watch.py, connected here
        self.beacon = Beacon(self.bind or "127.0.0.1", "phalanx-radical-beacon") if cfg.local else None
        self.env = env = self._environment(cfg, root)
        t0 = time.monotonic()
        with _patched_environ(env), counters.in_session_base():
            if self.bind:
                _install_bind(self.bind)
            _die_with_driver()
            self.session = rp.Session(cfg={"base": str(base), "client_sandbox": str(base)})
            try:
                self.pmgr = rp.PilotManager(session=self.session)
            except BaseException:
                self.session.close(download=False)
                raise
        self.uid = self.session.uid
        self.path = base / self.uid
        log.debug("radical: session %s up in %.1f s", self.uid, time.monotonic() - t0)

    def task_manager(self) -> Any:
        """A new TaskManager on this session (its components start in the session's environment)."""
        rp = import_rp()
        with _lock, self.api, _patched_environ(self.env), counters.in_session_base():
            return rp.TaskManager(session=self.session)

    def _environment(self, cfg: RadicalConfig, root: Path) -> dict[str, str | None]:
        env: dict[str, str | None] = {
            "RADICAL_CONFIG_USER_DIR": str(self._config_dir(cfg, root)),
            "RADICAL_BASE": str(root / "base"),
            "RADICAL_REPORT": "FALSE",
            "RADICAL_PILOT_REPORT": "FALSE",
            # profiles stay on: with RADICAL_PROFILE=FALSE RP 1.103's components die on their
            # way out ('Profiler' object has no attribute '_handle')
        }
        (root / "base").mkdir(exist_ok=True)
        venv = venv_of(cfg)
        if venv:
            env["VIRTUAL_ENV"] = venv
            path = os.environ.get("PATH", "")
            env["PATH"] = os.pathsep.join(
                [str(Path(venv) / "bin")] + [p for p in path.split(os.pathsep) if p != str(Path(venv) / "bin")]
            )
            env["CONDA_PREFIX"] = None  # RP prefers VIRTUAL_ENV, but be sure
        if cfg.interface:
            env["RADICAL_DEFAULT_IFACE"] = cfg.interface
            env[ENV_RADICAL_BIND] = self.bind
            env["PYTHONPATH"] = os.pathsep.join(
                [str(HOOK_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            )
        return env

    def _config_dir(self, cfg: RadicalConfig, root: Path) -> Path:
        """A private RADICAL_CONFIG_USER_DIR: the user's RP configs, ``resource_config`` merged
        over the resource's."""
        user = Path(os.environ.get("RADICAL_CONFIG_USER_DIR") or os.path.expanduser("~"))
        target = root / "config" / self.key
        configs = target / ".radical" / "pilot" / "configs"
        if configs.exists():
            shutil.rmtree(configs)
        if (user / ".radical" / "pilot" / "configs").is_dir():
            shutil.copytree(user / ".radical" / "pilot" / "configs", configs)
        configs.mkdir(parents=True, exist_ok=True)
        site, machine = cfg.resource.split(".", 1)
        over = resource_overrides(cfg)
        if self.beacon is not None:
            host, port = self.beacon.address
            watch = " ".join(
                shlex.quote(a) for a in (sys.executable, str(Path(__file__).with_name("watch.py")), host, str(port))
            )
            # RP's bootstrap runs each line as `eval "$(eval echo LINE)"`: quoted once for the echo
            over["pre_bootstrap_0"] = [
                *over.get("pre_bootstrap_0", []),
                shlex.quote(f"{watch} </dev/null >watch.log 2>&1 &"),
            ]
        if over:
            path = configs / f"resource_{site}.json"
            data = json.loads(path.read_text()) if path.exists() else {}
            data.setdefault(machine, {}).update(over)
            path.write_text(json.dumps(data, indent=2))
        return target

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        t0 = time.monotonic()
        try:
            with self.api:
                self.session.close(download=False, terminate=True)
            if self.beacon is not None:
                self.beacon.close()
        except Exception as exc:
            log.warning("radical: closing session %s: %s", self.uid, exc)
        log.debug("radical: session %s closed in %.1f s", self.uid, time.monotonic() - t0)


def session_for(cfg: RadicalConfig) -> RPSession:
    """This process's session for ``cfg``'s start-up settings (made on first use)."""
    root = sandbox_root(cfg)
    settings = {
        "resource": cfg.resource,
        "over": resource_overrides(cfg),
        "iface": cfg.interface,
        "venv": venv_of(cfg),
        "root": str(root),
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    with _lock:
        s = _sessions.get(key)
        if s is None or s.closed:
            try:
                s = _sessions[key] = RPSession(cfg, root, key)
            except (GangError, MissingDependencyError):
                raise
            except Exception as exc:
                raise GangError(
                    f"radical: cannot start a RADICAL-Pilot session for {cfg.resource}: {type(exc).__name__}: {exc}"
                ) from exc
            if len(_sessions) == 1:
                atexit.register(close_all)
        return s


def close_all() -> None:
    """Close every session of this process (at exit)."""
    with _lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for s in sessions:
        s.close()


def _install_bind(addr: str) -> None:
    """Bind this process's RP endpoints to ``addr`` (the hook the session's processes load)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("phalanx_radical_bind", HOOK_DIR / "sitecustomize.py")
    if spec is None or spec.loader is None:  # the hook ships with phalanx: only a broken install
        raise GangError(f"cannot load phalanx's RADICAL-Pilot hook {HOOK_DIR / 'sitecustomize.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(addr)


def _die_with_driver() -> None:
    """RP's proxy forks a worker per session that waits forever for a word from it: a driver
    killed without a word would leave it behind.  It gets the parent-death signal."""
    try:
        import radical.pilot.proxy as proxy
    except ImportError:
        return
    if getattr(proxy.Proxy._worker, "_phalanx", False):
        return
    worker = proxy.Proxy._worker

    def _worker(self: Any, *args: Any, **kwargs: Any) -> Any:
        from ...procs import die_with_parent

        die_with_parent()
        return worker(self, *args, **kwargs)

    setattr(_worker, "_phalanx", True)  # noqa: B010 (marks the wrapper; functions take attributes)
    proxy.Proxy._worker = _worker


class _patched_environ:
    """``os.environ`` with ``env`` over it (None: removed) for the block, then as it was."""

    def __init__(self, env: dict[str, str | None]):
        self.env = env
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for key, value in self.env.items():
            self.saved[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __exit__(self, *exc: Any) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


__all__ = ["RPSession", "close_all", "import_rp", "interface_address", "session_for"]
