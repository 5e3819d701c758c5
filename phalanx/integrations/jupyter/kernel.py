"""The kernel's gangs: those ``%px_gang`` named, and every gang a cell made.

No rank outlives the kernel, and none outlives its use:

- a gang a cell made and nothing refers to any more (``gang = px.Gang(4)`` run again: the first
  gang is unreachable) is closed after the cell (``post_run_cell``), with a note;
- at kernel shutdown or restart every gang is closed (an exit handler; a kernel that is killed
  outright takes its ranks with it: each rank ends when its driver's connection does, and a
  local rank gets the parent-death signal).

Imports IPython only through ``sys.modules``: a kernel has it loaded already.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

_named: dict[str, Any] = {}  # %px_gang --name NAME → its gang
_current: list[str] = []  # the name %%px uses without -g (last started)
_adopted: list[Any] = []  # every gang a cell of this kernel made
_lock = threading.Lock()
_installed = False
CLOSE_AT_EXIT_S = 4.0  # jupyter_client kills a kernel that takes longer than 5 s to exit


def shell() -> Any:
    """The IPython shell of the Jupyter kernel that runs this process, or None."""
    if "ipykernel" not in sys.modules:
        return None
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    sh = get() if get is not None else None
    return sh if sh is not None and getattr(sh, "kernel", None) is not None else None


def main_thread_of_kernel() -> bool:
    return threading.current_thread() is threading.main_thread() and shell() is not None


def install(sh: Any = None) -> None:
    """Once per kernel: close unreferenced gangs after each cell, and every gang at exit."""
    global _installed
    if _installed:
        return
    sh = sh or shell()
    if sh is None:
        return
    sh.events.register("post_run_cell", _after_cell)
    atexit.register(close_all)  # runs before px.Gang's own exit handler (last registered, first run)
    _installed = True


def adopt(gang: Any) -> None:
    install()
    with _lock:
        _adopted.append(gang)


# ---- named gangs (%px_gang) -----------------------------------------------------------------------
def name_gang(name: str, gang: Any) -> Any:
    """Make ``gang`` the one called ``name`` and the current one; the gang it replaces."""
    with _lock:
        old = _named.get(name)
        _named[name] = gang
        if name in _current:
            _current.remove(name)
        _current.append(name)
    return old


def forget(name: str) -> Any:
    with _lock:
        gang = _named.pop(name, None)
        if name in _current:
            _current.remove(name)
    return gang


def named(name: str | None = None) -> Any:
    """The gang called ``name`` (default: the current one), or None."""
    with _lock:
        if name is None:
            name = _current[-1] if _current else None
        return _named.get(name) if name is not None else None


def names() -> dict[str, Any]:
    with _lock:
        return dict(_named)


def current_name() -> str | None:
    with _lock:
        return _current[-1] if _current else None


# ---- cleanup --------------------------------------------------------------------------------------
def _after_cell(result: Any = None) -> None:
    for gang in unreferenced():
        if gang.running:
            print(
                f"phalanx: gang {gang.gang_id} ({gang.world_size} ranks) is no longer referenced: closed",
                file=sys.stderr,
            )
            gang.close()


def unreferenced() -> list[Any]:
    """Adopted gangs that only this module still holds, taken out of it."""
    found = []
    with _lock:
        i = 0
        while i < len(_adopted):
            # references: the list's, and getrefcount's argument (nothing of the user's)
            if sys.getrefcount(_adopted[i]) <= 2:
                found.append(_adopted.pop(i))
            else:
                i += 1
    return found


def close_all(timeout: float = CLOSE_AT_EXIT_S) -> list[str]:
    """Close every gang of this kernel, side by side, within ``timeout`` (what is left then, px.Gang's
    own exit handler kills); the ids of the gangs closed."""
    with _lock:
        gangs = {id(g): g for g in list(_named.values()) + _adopted if g.running}
        _named.clear()
        _current.clear()
        _adopted.clear()
    threads = [threading.Thread(target=g.close, name="phalanx-close-gang", daemon=True) for g in gangs.values()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [g.gang_id for g in gangs.values()]
