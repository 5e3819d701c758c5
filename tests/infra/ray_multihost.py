"""A Ray cluster across the multi-host test bed: the head (GCS, Ray Client server) in
``px-head`` with no CPUs, one raylet in each of ``px-h1`` .. ``px-hN``.

    python3 tests/infra/ray_multihost.py up       # idempotent; prints RAY_ADDRESS (Ray Client)
    python3 tests/infra/ray_multihost.py status   # JSON
    python3 tests/infra/ray_multihost.py down     # idempotent; exit 1 if a Ray process is left

(``tests/infra/ray-multihost-up.sh`` / ``-down.sh`` wrap these.)  From Python::

    from infra import ray_multihost
    state = ray_multihost.up()        # {"client": "ray://10.231.0.10:10001", "gcs": ..., "nodes": [...]}
    ray_multihost.down()

Every node is ``ray start --block`` started inside its host (``multihost.popen_on``) as the
leader of a new session: Ray's daemons (gcs_server, raylet, agents) and the workers a raylet
starts stay in that session, so ``down`` finds exactly them: SIGTERM to the ``ray start``
process (which stops its daemons), then SIGKILL to whatever of its session is left in that
host after a grace period, all by PID (never ``ray stop``, which kills every Ray process of a
host by name).  Ray's session files are in each host's own ``/tmp/pxray`` (removed by down);
the logs of ``ray start`` and the state are in ``/var/tmp/phalanx-ray-multihost`` (shared).

What Ray needs here (measured with Ray 2.60, docs/multihost.md):
- ``--node-ip-address`` of the host's bridge address on every node: Ray otherwise finds its IP
  by a UDP "connection" to 8.8.8.8, which fails in a host (no route out: it falls back to the
  hostname, which the bed's /etc/hosts resolves, but say it).  Inside a host every listener
  Ray opens on 0.0.0.0 can only be reached on that host's 10.231.0.x and its own loopback.
- A driver in the root namespace cannot connect to the GCS address directly
  (``ray.init("10.231.0.10:6379")``): a non-client driver needs a raylet of its own host (it
  dies on ``raylet_ipc_client: Failed to connect to socket .../sockets/raylet``, the head's
  socket, in px-head's private /tmp).  Through Ray Client (``ray://10.231.0.10:10001``, the
  head's client server) it works: that is the address ``up`` gives.
Settings: PHALANX_RAY_MH_DIR, PHALANX_RAY_MH_PORT (GCS, 6379), PHALANX_RAY_MH_CLIENT_PORT
(10001), PHALANX_RAY_MH_CPUS (CPUs of each worker node, 1), PHALANX_RAY_MH_STORE_MB (object
store of each node, 200).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

try:  # tests/infra/multihost.py: as the tests import it, else by its path (the command line)
    from infra import multihost
except ImportError:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("px_multihost", Path(__file__).resolve().parent / "multihost.py")
    multihost = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(multihost)

DIR = Path(os.environ.get("PHALANX_RAY_MH_DIR", "/var/tmp/phalanx-ray-multihost"))
STATE = DIR / "state.json"
PORT = int(os.environ.get("PHALANX_RAY_MH_PORT", "6379"))
CLIENT_PORT = int(os.environ.get("PHALANX_RAY_MH_CLIENT_PORT", "10001"))
CPUS = int(os.environ.get("PHALANX_RAY_MH_CPUS", "1"))
STORE_MB = int(os.environ.get("PHALANX_RAY_MH_STORE_MB", "200"))
TEMP = "/tmp/pxray"  # in each host's own /tmp
VENV_BIN = Path(sys.prefix) / "bin" if (Path(sys.prefix) / "bin" / "ray").exists() else None
READY = "will now block forever"  # what `ray start --block` logs once its node is up


def ray_exe() -> str:
    for cand in ([VENV_BIN / "ray"] if VENV_BIN else []) + [Path(__file__).resolve().parents[2] / ".venv/bin/ray"]:
        if cand.exists():
            return str(cand)
    raise FileNotFoundError("no ray executable (the venv's .venv/bin/ray)")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def load() -> dict | None:
    try:
        return json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None


def _save(state: dict) -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, STATE)


def _session(sid: int) -> list[int]:
    """PIDs whose session is ``sid`` (Ray's processes of one node)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            s = multihost._stat(int(d.name))
            if s and int(s[3]) == sid and s[0] not in ("Z", "X"):
                out.append(int(d.name))
    return out


def healthy(state: dict | None = None) -> bool:
    state = state if state is not None else load()
    if not state or not multihost.healthy():
        return False
    if not all(multihost.pid_alive(n["pid"], n["started"]) for n in state["nodes"]):
        return False
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((state["head_addr"], CLIENT_PORT)) == 0


def _start(host: dict, argv: list[str]) -> dict:
    log = DIR / f"{host['name']}.log"
    with open(log, "wb") as out:
        p = multihost.popen_on(
            host["name"],
            ["sh", "-c", f'mkdir -p {TEMP} && exec "$@"', "sh", *argv],
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # nsenter and sh exec: p.pid is ray start, a session leader
        )
    p.returncode = 0  # detached: down stops it by PID
    return {
        "name": host["name"],
        "addr": host["addr"],
        "pid": p.pid,
        "started": multihost.start_time(p.pid),
        "log": str(log),
    }


def _wait_ready(node: dict, deadline: float) -> None:
    while True:
        text = Path(node["log"]).read_text(errors="replace") if Path(node["log"]).exists() else ""
        if READY in text:
            return
        if not multihost.pid_alive(node["pid"], node["started"]):
            raise RuntimeError(f"ray on {node['name']} exited:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ray on {node['name']} not up in time; see {node['log']}")
        time.sleep(0.2)


def up(timeout: float = 180.0) -> dict:
    """The cluster (left alone when healthy); its state: client/gcs addresses, nodes."""
    if os.geteuid() != 0:
        raise PermissionError("the multi-host test bed needs root")
    multihost.up(int(os.environ.get("PHALANX_MULTIHOST_HOSTS", "3")))
    state = load()
    if healthy(state):
        return state
    if state:
        down()
    t0 = time.monotonic()
    deadline = t0 + timeout
    DIR.mkdir(parents=True, exist_ok=True)
    head, hosts = multihost.head(), multihost.hosts()
    ray = ray_exe()
    common = ["--block", f"--object-store-memory={STORE_MB << 20}", "--disable-usage-stats", f"--temp-dir={TEMP}"]
    state = {
        "gcs": f"{head['addr']}:{PORT}",
        "client": f"ray://{head['addr']}:{CLIENT_PORT}",
        "head_addr": head["addr"],
        "nodes": [],
    }
    try:
        node = _start(
            head,
            [ray, "start", "--head", f"--node-ip-address={head['addr']}", f"--port={PORT}", "--num-cpus=0"]
            + ["--include-dashboard=false", f"--ray-client-server-port={CLIENT_PORT}", *common],
        )
        state["nodes"].append(node)
        _save(state)
        _wait_ready(node, deadline)
        state["head_s"] = round(time.monotonic() - t0, 1)
        for h in hosts:
            node = _start(
                h,
                [ray, "start", f"--address={state['gcs']}", f"--node-ip-address={h['addr']}", f"--num-cpus={CPUS}"]
                + [f"--resources={json.dumps({h['name']: 1})}", *common],
            )
            state["nodes"].append(node)
            _save(state)
        for node in state["nodes"][1:]:
            _wait_ready(node, deadline)
        while not healthy(state):  # the client server answers
            if time.monotonic() > deadline:
                raise TimeoutError("the Ray Client server of the head does not answer")
            time.sleep(0.2)
    except BaseException:
        down()
        raise
    state["up_s"] = round(time.monotonic() - t0, 1)
    _save(state)
    return state


def down(grace: float = 15.0) -> dict:
    """Stop every node ``up`` started (by PID), remove the hosts' Ray files and the state."""
    t0 = time.monotonic()
    state = load() or {"nodes": []}
    live = [n for n in state["nodes"] if multihost.pid_alive(n["pid"], n["started"])]
    for n in reversed(live):  # workers first, then the head
        try:
            os.kill(n["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    left: list[int] = []
    while True:
        left = [p for n in live for p in _session(n["pid"])]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        multihost._end(left, grace=1.0)
    left = [p for n in live for p in _session(n["pid"])]
    for n in state["nodes"]:  # each host's own /tmp: Ray's session files, the cluster pointer
        try:
            multihost.run_on(
                n["name"], ["rm", "-rf", TEMP, "/tmp/ray/ray_current_cluster"], capture_output=True, timeout=20
            )
        except (KeyError, RuntimeError, subprocess.TimeoutExpired):  # the bed is down: its /tmp with it
            pass
    if STATE.exists():
        STATE.unlink()
    for n in state["nodes"]:
        Path(n.get("log", "/nonexistent")).unlink(missing_ok=True)
    try:
        DIR.rmdir()  # when empty
    except OSError:
        pass
    return {"down_s": round(time.monotonic() - t0, 1), "left": left}


def main(argv: list[str] | None = None) -> int:
    cmd = (argv if argv is not None else sys.argv[1:]) or ["status"]
    if cmd[0] == "up":
        s = up()
        print(f"export RAY_ADDRESS={s['client']}")
        print(
            f"# Ray across the bed: head {s['gcs']} (+ {len(s['nodes']) - 1} raylets) up in {s.get('up_s')} s",
            file=sys.stderr,
        )
    elif cmd[0] == "down":
        r = down()
        print(f"# Ray down in {r['down_s']} s" + (f", LEFT: {r['left']}" if r["left"] else ""), file=sys.stderr)
        return 1 if r["left"] else 0
    elif cmd[0] == "status":
        print(json.dumps({"healthy": healthy(), "state": load()}, indent=1))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
