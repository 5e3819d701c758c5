"""The multi-host test bed itself: hosts that share what a cluster's nodes share and nothing
else, and a SLURM cluster whose jobs land on them (tests/infra/multihost.py,
tests/infra/slurm-multihost-up.sh, docs/multihost.md).

Run: .venv/bin/python -m pytest -m multihost tests/multihost -p no:randomly -q
test_down_leaves_nothing takes everything down and brings it back: it stays the last test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from .conftest import INFRA, N_HOSTS, SLURM_DIR, slurm_env

pytestmark = pytest.mark.multihost

REPO = Path(__file__).resolve().parents[2]
HOSTS = [f"px-h{i}" for i in range(1, N_HOSTS + 1)]


def on(bed, host: str, *argv: str, env: dict | None = None, timeout: float = 30) -> str:
    r = bed.run_on(host, list(argv), env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{host}: {argv} exited {r.returncode}: {r.stderr}"
    return r.stdout


def py_on(bed, host: str, code: str, **kw) -> str:
    return on(bed, host, sys.executable, "-c", textwrap.dedent(code), **kw)


def test_each_host_has_its_own_hostname_and_address(multihost_bed):
    bed = multihost_bed
    assert [h["name"] for h in bed.hosts()] == HOSTS
    for h in [bed.head(), *bed.hosts()]:
        out = py_on(
            bed,
            h["name"],
            """
            import json, socket, subprocess
            addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True).stdout)
            print(json.dumps([socket.gethostname(), socket.gethostbyname(socket.gethostname()),
                              sorted(a["local"] for i in addrs for a in i["addr_info"])]))
            """,
        )
        name, resolved, addrs = json.loads(out)
        assert name == h["name"]
        assert resolved == h["addr"]  # /etc/hosts inside the host names every host of the bed
        assert addrs == sorted(["127.0.0.1", h["addr"]])  # only loopback and its bridge address
    assert os.uname().nodename not in HOSTS  # the root namespace keeps its own


def test_dev_shm_and_tmp_are_private_to_each_host(multihost_bed):
    bed = multihost_bed
    mark = f"px-mark-{uuid.uuid4().hex[:8]}"
    on(bed, "px-h1", "sh", "-c", f"echo h1 > /dev/shm/{mark} && echo h1 > /tmp/{mark}")
    try:
        assert on(bed, "px-h1", "cat", f"/dev/shm/{mark}", f"/tmp/{mark}") == "h1\nh1\n"
        for h in HOSTS[1:] + ["px-head"]:
            out = on(bed, h, "sh", "-c", f"ls /dev/shm/{mark} /tmp/{mark} 2>/dev/null; true")
            assert out == "", f"{h} sees px-h1's files: {out}"
        assert not Path(f"/dev/shm/{mark}").exists() and not Path(f"/tmp/{mark}").exists()
        # each host's /dev/shm is its own tmpfs (another device than the root namespace's)
        devs = {h: on(bed, h, "stat", "-c", "%d", "/dev/shm").strip() for h in HOSTS}
        assert len(set(devs.values())) == len(HOSTS) and str(os.stat("/dev/shm").st_dev) not in devs.values()
    finally:
        on(bed, "px-h1", "rm", "-f", f"/dev/shm/{mark}", f"/tmp/{mark}")


def test_tcp_between_hosts_over_the_bridge(multihost_bed):
    bed = multihost_bed
    h1 = bed.hosts()[0]
    server = bed.popen_on(
        "px-h1",
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import socket
                s = socket.socket(); s.bind(("{h1["addr"]}", 0)); s.listen(8); s.settimeout(20)
                print(s.getsockname()[1], flush=True)
                for _ in range({len(HOSTS)}):  # one connection from each other host, one from root
                    c, peer = s.accept()
                    c.sendall(f"{{socket.gethostname()}} saw {{peer[0]}} say ".encode() + c.recv(64)); c.close()
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        client = """
            import socket, sys
            c = socket.create_connection(("px-h1", int(sys.argv[1])), timeout=10)
            c.sendall(socket.gethostname().encode()); print(c.recv(128).decode())
            """
        for h in HOSTS[1:]:
            out = on(bed, h, sys.executable, "-c", textwrap.dedent(client), str(port))
            addr = next(x["addr"] for x in bed.hosts() if x["name"] == h)
            assert out.strip() == f"px-h1 saw {addr} say {h}"
        import socket  # the root namespace reaches the hosts through its bridge address

        with socket.create_connection((h1["addr"], port), timeout=10) as c:
            c.sendall(b"root")
            assert c.recv(128).decode() == f"px-h1 saw {bed.load_state()['bridge_addr']} say root"
        assert server.wait(timeout=10) == 0
    finally:
        server.kill()
        server.wait()


def test_repo_venv_and_home_are_shared(multihost_bed, shared_tmp):
    bed = multihost_bed
    (shared_tmp / "from-root").write_text("root")
    for h in HOSTS:
        out = py_on(
            bed,
            h,
            f"""
            import importlib.util, pathlib, socket, sys
            p = pathlib.Path("{shared_tmp}")
            (p / socket.gethostname()).write_text("x")
            phalanx = importlib.util.find_spec("phalanx").origin  # the repo, through the venv
            print(sys.prefix, phalanx, (p / "from-root").read_text(), pathlib.Path.home().is_dir())
            """,
        )
        assert out.split() == [sys.prefix, str(REPO / "phalanx" / "__init__.py"), "root", "True"]
    assert sorted(p.name for p in shared_tmp.iterdir()) == sorted(["from-root", *HOSTS])
    # the working directory follows (entering a mount namespace alone would land in "/")
    assert bed.run_on("px-h2", ["pwd"], cwd=shared_tmp, capture_output=True, text=True).stdout.strip() == str(
        shared_tmp
    )


def test_up_is_idempotent(multihost_bed):
    bed = multihost_bed
    before = bed.load_state()["hosts"]
    t0 = time.monotonic()
    r = subprocess.run([str(INFRA / "multihost-up.sh"), "-n", str(N_HOSTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 5
    assert bed.load_state()["hosts"] == before  # the same holders: nothing was restarted


# ---- SLURM across the hosts -----------------------------------------------------------------
WHERE = """
import json, os, socket
open(f"/dev/shm/task-{os.environ['SLURM_PROCID']}", "w").close()
print(json.dumps({"rank": int(os.environ["SLURM_PROCID"]), "host": socket.gethostname(),
                  "node": os.environ["SLURMD_NODENAME"], "shm": sorted(os.listdir("/dev/shm"))}))
"""


def _tasks(out: str) -> list[dict]:
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda t: t["rank"])


def _markers(task: dict) -> list[str]:
    """The task markers a task saw in its /dev/shm (earlier gangs on that host may have left
    their own phalanx-$USER directory there: not a marker, not shared)."""
    return [name for name in task["shm"] if name.startswith("task-")]


def test_srun_tasks_land_on_three_hosts_with_private_dev_shm(multihost_bed, multihost_slurm, shared_tmp):
    bed = multihost_bed
    app = shared_tmp / "where.py"
    app.write_text(WHERE)
    out = on(bed, "px-head", "srun", "-N", str(N_HOSTS), "-n", str(N_HOSTS), sys.executable, str(app), env=slurm_env())
    tasks = _tasks(out)
    assert [t["host"] for t in tasks] == HOSTS and [t["node"] for t in tasks] == HOSTS
    for t in tasks:  # each task sees its own marker only: no /dev/shm in common
        assert _markers(t) == [f"task-{t['rank']}"], t
    for h in HOSTS:
        on(bed, h, "sh", "-c", "rm -f /dev/shm/task-*")


def test_sbatch_from_the_root_namespace(multihost_bed, multihost_slurm, shared_tmp):
    app = shared_tmp / "where.py"
    app.write_text(WHERE)
    script = shared_tmp / "job.sh"
    script.write_text(f"#!/bin/sh\nsrun {sys.executable} {app}\nsrun rm -f /dev/shm/task-0 /dev/shm/task-1\n")
    r = subprocess.run(
        ["sbatch", "--wait", "-N", "2", "-n", "2", "-o", str(shared_tmp / "out.txt"), str(script)],
        env=slurm_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    tasks = _tasks((shared_tmp / "out.txt").read_text())
    assert len({t["host"] for t in tasks}) == 2 and all(t["host"] in HOSTS for t in tasks)
    assert all(_markers(t) == [f"task-{t['rank']}"] for t in tasks), tasks


# ---- last: everything goes and comes back ---------------------------------------------------
def test_down_leaves_nothing(multihost_bed, multihost_slurm):
    bed = multihost_bed
    state = bed.load_state()
    holders = [h["holder"] for h in state["hosts"]]
    inodes = [os.stat(h["netns"]).st_ino for h in state["hosts"]]
    inside = {p for i in inodes for p in bed.procs_in_netns(i)} - set(holders)
    assert inside, "slurmctld and the slurmds run inside the hosts"
    munged = int(Path(SLURM_DIR, "munge", "munged.pid").read_text())  # in the root namespace
    for _ in range(2):  # down twice: the second has nothing to do
        r = subprocess.run([str(INFRA / "slurm-multihost-down.sh")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([str(INFRA / "multihost-down.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        assert not [p for p in [*holders, *sorted(inside), munged] if bed.pid_alive(p)]
        assert not list(Path("/run/netns").glob("px-*"))
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "pxbr0" not in links and " pxv" not in links
        assert not bed.STATE_DIR.exists()
        assert bed.load_state() is None and bed.hosts() == []
        assert not any(  # nothing on the bridge's addresses anywhere
            f"{bed.NET}." in line
            for line in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout.splitlines()
        )
    finally:  # the session's fixtures expect the bed (and its SLURM) up until they end
        bed.up(N_HOSTS)
        r = subprocess.run([str(INFRA / "slurm-multihost-up.sh")], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
