"""A multi-host test bed on one machine: N "hosts" that share what a cluster's nodes share.

Each host ``px-h1`` .. ``px-hN`` (and a head host ``px-head`` for controllers and drivers:
slurmctld, srun) is
- a network namespace with its own address on a private bridge (``pxbr0``, 10.231.0.1/24;
  host i is 10.231.0.(10+i), px-head 10.231.0.10, veth ``pxv<i>`` in the root namespace,
  ``eth0`` inside);
- its own hostname (UTS namespace) and its own ``/dev/shm`` and ``/tmp`` (a mount namespace
  with private tmpfs mounts) and its own ``/etc/hosts`` naming every host of the bed;
- kept alive by one *holder* process (``unshare ... sleep infinity``); every process of the
  host runs with ``nsenter -t HOLDER -m -u -n``, and its children stay there.
The root filesystem (home, the repository, the venv, /run, /var) stays shared, like a
cluster's shared filesystem.  Only stdlib: runs under any python3.

    python3 tests/infra/multihost.py up [-n 3]      # idempotent; prints the hosts
    python3 tests/infra/multihost.py exec px-h2 hostname
    python3 tests/infra/multihost.py status
    python3 tests/infra/multihost.py down           # idempotent; leaves nothing behind

From Python (the tests' fixture)::

    from infra import multihost
    bed = multihost.up(3)
    multihost.run_on("px-h1", ["hostname"], capture_output=True, text=True)
    multihost.down()

State: /run/phalanx-multihost (root only, 0700): state.json records each host's holder PID
(with its start time, so a reused PID is never signalled), address and namespace; hosts is the
/etc/hosts every host sees.  Needs root, iproute2 and util-linux (unshare, nsenter).
Settings (environment): PHALANX_MULTIHOST_NET (the /24's first three octets, "10.231.0"),
PHALANX_MULTIHOST_SHM (size of each host's /dev/shm tmpfs, "4g"),
PHALANX_MULTIHOST_DIR (the state directory).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE_DIR = Path(os.environ.get("PHALANX_MULTIHOST_DIR", "/run/phalanx-multihost"))
STATE = STATE_DIR / "state.json"
LOCK = Path(f"{STATE_DIR}.lock")  # beside the state directory, which down removes
NET = os.environ.get("PHALANX_MULTIHOST_NET", "10.231.0")
SHM_SIZE = os.environ.get("PHALANX_MULTIHOST_SHM", "4g")
BRIDGE = "pxbr0"
PREFIX = "px-h"  # host names and network namespace names: px-h1 .. px-hN
VETH = "pxv"  # root-side veth of host i: pxv<i>
BRIDGE_ADDR = f"{NET}.1"
HEAD = "px-head"  # host 0: the head node (controllers, drivers), no compute
BRIDGE_NAME = "px-bridge"  # the root namespace's address on the bridge, in every /etc/hosts
STEP_TIMEOUT = 10  # seconds for any one ip/umount call


def host_name(i: int) -> str:
    return HEAD if i == 0 else f"{PREFIX}{i}"


def host_addr(i: int) -> str:
    return f"{NET}.{10 + i}"


def log(msg: str) -> None:
    print(f"[multihost] {msg}", file=sys.stderr, flush=True)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


# ---- processes --------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0]); None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    s = _stat(pid)
    return int(s[19]) if s else None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Alive, not a zombie, and (when ``started`` is given) the same process as recorded."""
    s = _stat(pid)
    if not s or s[0] in ("Z", "X"):
        return False
    return started is None or int(s[19]) == started


def _reap(pid: int) -> None:
    try:  # our own child (the fixture's process started it): collect it, no zombie
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def procs_in_netns(inode: int) -> list[int]:
    """PIDs of every process whose network namespace is ``inode`` (a host's processes)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if os.stat(d / "ns" / "net").st_ino == inode:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _end(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM the given PIDs, SIGKILL what is still alive after ``grace`` seconds."""
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for p in pids:
            _reap(p)
        if not any(pid_alive(p) for p in pids):
            return
        time.sleep(0.05)
    for p in pids:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        for p in pids:
            _reap(p)
        time.sleep(0.05)


# ---- state ------------------------------------------------------------------------------
def load_state() -> dict | None:
    try:
        return json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None


def _save_state(state: dict) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, STATE)
    for h in state["hosts"]:  # one plain file per host for shell scripts: the holder's PID
        (STATE_DIR / f"{h['name']}.pid").write_text(f"{h['holder']}\n")


def hosts() -> list[dict]:
    """The compute hosts of the bed that is up: [{name, addr, holder, netns, ...}], [] when down."""
    s = load_state()
    return s["hosts"][1:] if s else []


def head() -> dict | None:
    """The head host (px-head) of the bed that is up."""
    s = load_state()
    return s["hosts"][0] if s else None


def _holder(host: str) -> int:
    for h in (load_state() or {"hosts": []})["hosts"]:
        if h["name"] == host or h["addr"] == host:
            if not pid_alive(h["holder"], h["started"]):
                raise RuntimeError(f"host {host}: its holder process {h['holder']} is gone")
            return h["holder"]
    raise KeyError(f"no host {host!r} in the multi-host test bed (is it up? {STATE})")


def _host_wd(cwd: str | os.PathLike | None) -> str:
    """The working directory inside a host: ``cwd`` (or ours), "/" where it is a host's own."""
    wd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    if _covered([wd], (load_state() or {}).get("kept", [])):
        return wd
    return "/" if any(wd == p or wd.startswith(p + "/") for p in ("/tmp", "/dev/shm")) else wd


def nsenter_argv(host: str, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
    """The command line that runs ``argv`` inside ``host`` (its network, UTS and mount ns), in
    ``cwd`` (default: ours).  Entering a mount namespace moves to its "/": --wd moves back."""
    return ["nsenter", "-t", str(_holder(host)), "-m", "-u", "-n", f"--wd={_host_wd(cwd)}", "--", *argv]


def run_on(host: str, argv: list[str], env: dict | None = None, cwd=None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run of ``argv`` inside ``host`` (``env``: the whole environment, as for run)."""
    return subprocess.run(nsenter_argv(host, argv, cwd), env=env, **kw)


def popen_on(host: str, argv: list[str], env: dict | None = None, cwd=None, **kw) -> subprocess.Popen:
    """subprocess.Popen of ``argv`` inside ``host``."""
    return subprocess.Popen(nsenter_argv(host, argv, cwd), env=env, **kw)


# ---- health ------------------------------------------------------------------------------
def _host_ok(h: dict) -> bool:
    if not pid_alive(h["holder"], h["started"]):
        return False
    if _stat(h["holder"]) is None or Path(f"/proc/{h['holder']}/comm").read_text().strip() != "sleep":
        return False
    return _ns_inode(f"/proc/{h['holder']}/ns/net") == _ns_inode(f"/run/netns/{h['name']}") is not None


def healthy(n: int | None = None) -> bool:
    s = load_state()
    if not s or (n is not None and len(s["hosts"]) != n + 1) or s.get("net") != NET:
        return False
    if not _covered(kept_paths(), s.get("kept", [])):  # brought up by a checkout elsewhere
        return False
    if _sh("ip", "link", "show", BRIDGE, check=False).returncode:
        return False
    return all(_host_ok(h) for h in s["hosts"])


# ---- up / down ---------------------------------------------------------------------------
def _hosts_file(n: int) -> str:
    lines = ["127.0.0.1 localhost", f"{BRIDGE_ADDR} {BRIDGE_NAME}"]
    lines += [f"{host_addr(i)} {host_name(i)}" for i in range(0, n + 1)]
    return "\n".join(lines) + "\n"


def kept_paths() -> list[str]:
    """What a host must still see under /tmp, its own there otherwise: this checkout and the
    venv when they live under /tmp (CI's fresh clone), as a cluster's shared filesystem would."""
    here = {str(Path(__file__).resolve().parents[2]), sys.prefix, os.path.realpath(sys.prefix)}
    under = sorted(p for p in here if p.startswith("/tmp/"))
    return [p for p in under if not any(p.startswith(q + "/") for q in under)]


def _covered(paths: list[str], kept: list[str]) -> bool:
    return all(any(p == k or p.startswith(k + "/") for k in kept) for p in paths)


def _holder_script(name: str, hosts_file: Path, kept: list[str]) -> str:
    # a kept path is bind-mounted aside before the host's own /tmp hides it, then moved back
    aside = [STATE_DIR / f"keep-{name}-{i}" for i in range(len(kept))]
    for a in aside:
        a.mkdir(mode=0o700, exist_ok=True)
    return (
        "set -e; "
        f"hostname {name}; "
        f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 shm-{name} /dev/shm; "
        + "".join(f"mount --bind {shlex.quote(k)} {a}; " for k, a in zip(kept, aside))
        + f"mount -t tmpfs -o mode=1777 tmp-{name} /tmp; "
        + "".join(f"mkdir -p {shlex.quote(k)}; mount --move {a} {shlex.quote(k)}; " for k, a in zip(kept, aside))
        + f"mount --bind {hosts_file} /etc/hosts; "
        "exec sleep infinity"
    )


@contextlib.contextmanager
def _locked(timeout: float = 90.0):
    """One up or down at a time on this machine (two test sessions starting together)."""
    with open(LOCK, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{LOCK} held for {timeout}s by another up/down") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_subnet_free() -> None:
    """Refuse a /24 that this machine already uses for something else (an address or a route)."""
    for what in (["ip", "-o", "-4", "addr"], ["ip", "-4", "route"]):
        for line in _sh(*what).stdout.splitlines():
            if f" {NET}." in f" {line}" and BRIDGE not in line:
                raise RuntimeError(f"{NET}.0/24 is in use here ({line.strip()}): set PHALANX_MULTIHOST_NET")


def up(n: int = 3, timeout: float = 60.0) -> list[dict]:
    """Bring up hosts px-h1..px-hN (a healthy bed of that size is left alone); its hosts."""
    if os.geteuid() != 0:
        raise PermissionError("the multi-host test bed needs root (network and mount namespaces)")
    with _locked():
        if healthy(n):
            return hosts()
        if load_state() or _leftovers():
            log("a bed is there but not as asked (or broken): taking it down first")
            _down()
        _check_subnet_free()
        return _up(n, timeout)


def _up(n: int, timeout: float) -> list[dict]:
    t0 = time.monotonic()
    deadline = t0 + timeout
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(STATE_DIR, 0o700)
    hosts_file = STATE_DIR / "hosts"
    hosts_file.write_text(_hosts_file(n))
    os.chmod(hosts_file, 0o644)
    kept = kept_paths()
    state = {"net": NET, "bridge": BRIDGE, "bridge_addr": BRIDGE_ADDR, "kept": kept, "hosts": []}
    try:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        holders = []
        for i in range(0, n + 1):
            name, addr, veth = host_name(i), host_addr(i), f"{VETH}{i}"
            _sh("ip", "netns", "add", name)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _sh("ip", "link", "set", veth, "master", BRIDGE, "up")
            _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", name, "link", "set", "eth0", "up")
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            p = subprocess.Popen(
                # enter the netns first: `unshare --net=FILE` would make a NEW, empty one and
                # bind-mount it over FILE (util-linux's "persistent namespace"), not join it
                ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--uts", "--propagation", "private"]
                + ["sh", "-c", _holder_script(name, hosts_file, kept)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            holders.append(p)
            h = {"name": name, "addr": addr, "veth": veth, "netns": f"/run/netns/{name}", "holder": p.pid}
            h["started"] = start_time(p.pid)
            state["hosts"].append(h)
            _save_state(state)
        for p, h in zip(holders, state["hosts"]):  # ready when the holder has exec'd sleep
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"{h['name']}: holder exited {p.returncode}: {p.stderr.read().decode().strip()}")
                if Path(f"/proc/{p.pid}/comm").read_text().strip() == "sleep":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{h['name']}: holder not ready after {timeout}s")
                time.sleep(0.02)
            p.stderr.close()
            p.returncode = 0  # detached: Popen must not complain that it is still running
        state["up_s"] = round(time.monotonic() - t0, 2)
        _save_state(state)
    except BaseException:
        _down()
        raise
    log(
        f"{n} hosts and a head up in {state['up_s']} s: "
        + ", ".join(f"{h['name']}={h['addr']}" for h in state["hosts"])
    )
    return state["hosts"][1:]


def _leftovers() -> dict:
    """Our namespaces and links that are there (by our own names: px-h*, pxv*, pxbr0)."""
    ns = [p.name for p in Path("/run/netns").glob(f"{PREFIX}*")] if Path("/run/netns").is_dir() else []
    links = []
    r = _sh("ip", "-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if dev == BRIDGE or (dev.startswith(VETH) and dev[len(VETH) :].isdigit()):
            links.append(dev)
    return {"netns": sorted(ns), "links": sorted(links)} if ns or links else {}


def down() -> dict:
    """End every process in the bed's hosts (by PID), delete namespaces, veths and bridge."""
    with _locked():
        return _down()


def _down() -> dict:
    t0 = time.monotonic()
    s = load_state() or {"hosts": []}
    names = {h["name"] for h in s["hosts"]} | set(_leftovers().get("netns", []))
    # every process still inside one of our hosts (daemons, ranks), then the holders
    inodes = {_ns_inode(f"/run/netns/{n}") for n in names} - {None}
    inside = [p for ino in inodes for p in procs_in_netns(ino)]
    holders = [h["holder"] for h in s["hosts"] if pid_alive(h["holder"], h.get("started"))]
    others = [p for p in inside if p not in holders]
    if others:
        log(f"ending {len(others)} process(es) still in the hosts: {others}")
        _end(others)
    _end(holders)
    for n in sorted(names):
        path = f"/run/netns/{n}"
        for _ in range(4):  # mounts may be stacked on the file: each del removes one
            if not os.path.exists(path):
                break
            if _sh("ip", "netns", "del", n, check=False).returncode and os.path.exists(path):
                _sh("umount", path, check=False)  # "Device or resource busy": unmount by hand
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if os.path.exists(path):
            log(f"could not remove {path}")
    for dev in _leftovers().get("links", []):  # the veths die with their namespace; the bridge
        _sh("ip", "link", "del", dev, check=False)
    for f in STATE_DIR.glob("*") if STATE_DIR.is_dir() else []:
        if f.is_dir() and not f.is_symlink():
            f.rmdir()  # a keep-* mount point (empty: its mount was in the host's namespace)
        else:
            f.unlink()
    if STATE_DIR.is_dir():
        STATE_DIR.rmdir()
    left = _leftovers()
    if left:
        log(f"left behind: {left}")
    return {"down_s": round(time.monotonic() - t0, 2), "left": left}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="bring the hosts up (idempotent)")
    u.add_argument("-n", "--hosts", type=int, default=int(os.environ.get("PHALANX_MULTIHOST_HOSTS", "3")))
    sub.add_parser("down", help="take everything down (idempotent)")
    sub.add_parser("status", help="print the state (JSON) and whether it is healthy")
    e = sub.add_parser("exec", help="run a command inside a host: exec HOST CMD...")
    e.add_argument("host")
    e.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.cmd == "up":
        up(a.hosts)
        for h in load_state()["hosts"]:
            print(f"{h['name']} {h['addr']} holder={h['holder']}")
    elif a.cmd == "down":
        r = down()
        log(f"down in {r['down_s']} s" + (f", LEFT: {r['left']}" if r["left"] else ""))
        return 1 if r["left"] else 0
    elif a.cmd == "status":
        print(json.dumps({"healthy": healthy(), "state": load_state(), "leftovers": _leftovers()}, indent=1))
    else:
        if not a.argv:
            ap.error("exec HOST CMD...")
        os.execvp("nsenter", nsenter_argv(a.host, a.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
