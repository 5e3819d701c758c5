"""Where phalanx keeps things when nobody says: the one module that knows the default paths.

| what                        | default                                        | override              |
|-----------------------------|------------------------------------------------|-----------------------|
| gang (rank) logs            | ``<tmp>/phalanx-<user>/gangs``                 | ``PHALANX_LOG_DIR``   |
| run database, run logs      | ``$XDG_STATE_HOME/phalanx`` (``~/.local/state``) | ``PHALANX_STATE``   |
| store root (payload tier)   | ``/dev/shm/phalanx-<user>/store`` (else tmp)   | ``PHALANX_STORE``     |
| store spill directory       | ``/var/tmp/phalanx-<user>/store`` (else tmp)   | ``PHALANX_STORE_SPILL`` |

The shared ``phalanx-<user>`` directories are made private or refused (``private.private_dir``),
and so is the state directory, named or not; a log, store or spill directory the user names is
used as it is (a group-shared project directory is the user's choice).  This module sits in the
lowest layer: anything may import it, it imports only ``private`` (and ``errors`` through it).
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

from .private import private_dir

ENV_LOG_DIR = "PHALANX_LOG_DIR"
ENV_STATE = "PHALANX_STATE"
ENV_STORE = "PHALANX_STORE"  # a directory, or an s3:// URL (the store accepts one)
ENV_SPILL = "PHALANX_STORE_SPILL"
ENV_SHM_DIR = "PHALANX_SHM_DIR"  # read by the shared-memory communicator (runtime.comm.shm)


def default_log_root() -> Path:
    """Per-user directory for gang logs (``PHALANX_LOG_DIR`` overrides): ``<tmp>/phalanx-<user>/gangs``,
    refused if another user could write there."""
    root = os.environ.get(ENV_LOG_DIR)
    if root:
        return Path(root)
    return _own_dir(Path(tempfile.gettempdir()), "gang logs", ENV_LOG_DIR) / "gangs"


def default_state_dir() -> Path:
    """The run database's directory (``PHALANX_STATE`` overrides): ``$XDG_STATE_HOME/phalanx``,
    else ``~/.local/state/phalanx``.  Not checked: see ``state_dir``."""
    env = os.environ.get(ENV_STATE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "phalanx"


def state_dir(path: str | os.PathLike | None = None) -> Path:
    """``path`` (default: ``default_state_dir()``) as the state directory: created 0700, or
    refused if it is not a private directory of this user's — named or not, it holds the run
    database that decides what a resume skips."""
    return private_dir(
        Path(path) if path else default_state_dir(),
        "phalanx's run database and logs",
        f"set {ENV_STATE} to a directory of your own",
    )


HOST_MEMORY = Path("/dev/shm")  # each host's own shared memory: never shared between hosts


def in_host_memory(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies in this host's shared memory (a store root there is per host)."""
    return Path(path) == HOST_MEMORY or HOST_MEMORY in Path(path).parents


def default_store_root() -> Path:
    """Shared memory when the machine has it (the fast tier on one host), else the temp dir:
    ``<base>/phalanx-<user>/store``, refused if another user could write there.

    ``PHALANX_STORE`` overrides it (``Store`` also accepts an ``s3://`` URL there)."""
    env = os.environ.get(ENV_STORE)
    if env:
        return Path(env)
    base = HOST_MEMORY if HOST_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return _own_dir(base, "the store root", ENV_STORE) / "store"


def default_spill_root() -> Path:
    """Where datasets over the memory budget go: a disk directory (``PHALANX_STORE_SPILL``)."""
    env = os.environ.get(ENV_SPILL)
    if env:
        return Path(env)
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
    return _own_dir(base, "the store's spill directory", ENV_SPILL) / "store"


def _own_dir(base: Path, what: str, env: str) -> Path:
    """``<base>/phalanx-<user>``, private to this user (refused if someone else made it)."""
    return private_dir(base / f"phalanx-{getpass.getuser()}", f"holds {what}", f"set {env} to a directory of your own")


def default_shm_root() -> Path | None:
    """Shared memory for the ranks' exchange segments (``runtime.comm.shm``) when the store root
    is not on it: ``/dev/shm/phalanx-<user>``, refused if another user could write there; None
    where the machine has no ``/dev/shm``.  ``PHALANX_SHM_DIR`` overrides it (read by the
    communicator)."""
    base = Path("/dev/shm")
    if not base.is_dir():
        return None
    return _own_dir(base, "shared-memory exchange segments", ENV_SHM_DIR)
