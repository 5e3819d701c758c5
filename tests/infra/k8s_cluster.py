"""A Kubernetes test cluster on this machine's loopback, for tests marked ``k8s``.

A real control plane (etcd, kube-apiserver with native gang scheduling, controller-manager,
scheduler), kwok for fake nodes, and real nodes "127.0.0.1", "127.0.0.2", ... (kubelet +
containerd + runc: pods really run).  ``tests/infra/k8s/up.sh`` brings it up and
``tests/infra/k8s/down.sh`` stops it; see tests/infra/k8s/README.md.

From tests (conftest.py)::

    from infra import k8s_cluster

    @pytest.fixture(scope="session")
    def k8s():
        reason = k8s_cluster.available()
        if reason:
            pytest.skip(f"no Kubernetes test cluster: {reason}")
        cluster = k8s_cluster.ensure_cluster(real_nodes=2)
        yield cluster                      # .kubeconfig, .real_nodes, .request(...)
        k8s_cluster.teardown()             # kept when PHALANX_K8S_KEEP=1 or it was up before

Scheduling tests add fake capacity (pods bound to kwok nodes are simulated, never run)::

    names = k8s_cluster.add_kwok_nodes(3, cpu="4", memory="8Gi", prefix="gang-")
    ...
    k8s_cluster.delete_nodes(names)

Pods meant to really run select a real node: ``nodeSelector: {"phalanx.dev/node": "real"}``
(or ``kubernetes.io/hostname: 127.0.0.2``); fake nodes carry ``type: kwok``.

By hand::

    .venv/bin/python tests/infra/k8s_cluster.py up [--real-nodes 2] [--kwok-nodes 0]
    .venv/bin/python tests/infra/k8s_cluster.py status | available | down [--purge]

Only the standard library is used (no ``kubernetes`` package needed).  The cluster needs root,
Linux, the binaries of ``tests/infra/k8s/build.sh`` (built in CI setup, cached in
``~/.cache/phalanx-infra/bin``); ``available()`` says why it cannot be had, and never builds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

K8S_DIR = Path(__file__).resolve().parent / "k8s"
UP, DOWN, BUILD = K8S_DIR / "up.sh", K8S_DIR / "down.sh", K8S_DIR / "build.sh"
SERVER = "https://127.0.0.1:6443"
REAL_LABEL = {"phalanx.dev/node": "real"}  # nodeSelector for pods that must really run
KWOK_LABEL = {"type": "kwok"}
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def state_dir() -> Path:
    """As up.sh: $K8S_STATE_DIR, else ${TMPDIR:-/tmp}/phalanx-k8s."""
    if os.environ.get("K8S_STATE_DIR"):
        return Path(os.environ["K8S_STATE_DIR"])
    return Path(os.environ.get("TMPDIR") or "/tmp") / "phalanx-k8s"


def bin_dir() -> Path:
    """As build.sh: $K8S_BIN_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin."""
    if os.environ.get("K8S_BIN_DIR"):
        return Path(os.environ["K8S_BIN_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "phalanx-infra" / "bin"


def real_node_names(n: int) -> list[str]:
    return [f"127.0.0.{i}" for i in range(1, n + 1)]


def kwok_node_names(n: int) -> list[str]:
    return [f"kwok-node-{i}" for i in range(1, n + 1)]


class ClusterError(RuntimeError):
    pass


# ---- the API, with the admin token and the cluster's CA ---------------------------------------
@dataclass
class Cluster:
    kubeconfig: Path
    state_dir: Path
    real_nodes: list[str] = field(default_factory=list)
    kwok_nodes: list[str] = field(default_factory=list)
    server: str = SERVER
    started: bool = False  # this process brought (part of) it up

    @property
    def ca(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    @property
    def token(self) -> str:
        return (self.state_dir / "pki" / "tokens.csv").read_text().split(",", 1)[0]

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig)}

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        params: dict | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
        raw: bool = False,
    ):
        """One API call; returns the decoded JSON (``raw=True``: the text, e.g. pod logs).
        Raises ClusterError with the server's message on HTTP errors (``.status`` is set)."""
        return _request(self.state_dir, method, path, body, params, content_type, timeout, raw, self.server)

    def add_kwok_nodes(
        self, n: int, cpu: str = "4", memory: str = "8Gi", prefix: str = "kwok-fake-", **kw
    ) -> list[str]:
        return add_kwok_nodes(n, cpu, memory, prefix, state=self.state_dir, **kw)

    def delete_nodes(self, names, wait: bool = True) -> None:
        delete_nodes(names, wait=wait, state=self.state_dir)


_ssl: dict[str, ssl.SSLContext] = {}


def _request(
    state: Path,
    method: str,
    path: str,
    body=None,
    params=None,
    content_type: str = "application/json",
    timeout: float = 30,
    raw: bool = False,
    server: str = SERVER,
):
    ca = str(state / "pki" / "ca.crt")
    ctx = _ssl.get(ca)
    if ctx is None:
        ctx = _ssl[ca] = ssl.create_default_context(cafile=ca)
    token = (state / "pki" / "tokens.csv").read_text().split(",", 1)[0]
    url = server + path + ("?" + urllib.parse.urlencode(params) if params else "")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": "Bearer " + token, "Content-Type": content_type, "Accept": "application/json"},
    )
    # never through a proxy: the cluster is on loopback
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(req, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        err = ClusterError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}")
        err.status = e.code
        raise err from None
    if raw:
        return text
    return json.loads(text) if text else None


# ---- can it be had here? ------------------------------------------------------------------------
_available: str | None | bool = False  # False: not computed yet


def available(real_nodes: int = 2) -> str | None:
    """None if the cluster can be brought up here (or is up), else why not.  Cheap (< 1 s): it
    checks, never builds — building is CI setup's job (tests/infra/k8s/build.sh, ~15 min cold)."""
    global _available
    if _available is not False:
        return _available
    _available = _why_not(real_nodes)
    return _available


def _why_not(real_nodes: int) -> str | None:
    if not sys.platform.startswith("linux"):
        return "Linux only"
    if os.geteuid() != 0:
        return "needs root (containerd, cgroups, mounts)"
    for exe in ("openssl", "curl", "python3", "flock", "findmnt"):
        if shutil.which(exe) is None:
            return f"'{exe}' is not installed"
    r = subprocess.run(["bash", str(BUILD), "--check"], capture_output=True, text=True, timeout=60)
    if r.returncode:
        if shutil.which("go") is None:
            return f"go not installed ({r.stdout.strip()}; tests/infra/k8s/build.sh needs Go to build them)"
        return f"binaries not built: run tests/infra/k8s/build.sh ({r.stdout.strip()})"
    if real_nodes:
        missing = [
            pkg
            for path, pkg in (
                ("containerd", "containerd"),
                ("runc", "runc"),
                ("gcc", "gcc"),
                ("/usr/lib/cni/loopback", "containernetworking-plugins"),
                ("/bin/busybox", "busybox-static"),
            )
            if not (os.path.exists(path) if path.startswith("/") else shutil.which(path))
        ]
        if missing and shutil.which("apt-get") is None:
            return f"missing {' '.join(missing)} and no apt-get to install them"
        if not os.path.isdir("/sys/fs/cgroup"):
            return "no /sys/fs/cgroup"
    return None


# ---- state: is it up as wanted? -----------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _alive(d: Path, name: str) -> bool:
    """The daemon up.sh started (pid file), still running the program it started."""
    try:
        pid = int((d / "run" / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return False
    if not _pid_alive(pid):
        return False
    try:
        cmd = (d / "run" / f"{name}.cmd").read_text()
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except OSError:
        return True
    return argv0 == cmd


def _control_plane_up(state: Path) -> bool:
    return all(_alive(state, n) for n in CONTROL_PLANE)


def is_up(
    real_nodes: int = 2, kwok_nodes: int = 0, kwok_cpu: str = "4", kwok_memory: str = "8Gi", kwok_pods: str = "110"
) -> bool:
    """The cluster runs exactly as up.sh would leave it for these settings (no up.sh needed)."""
    state = state_dir()
    if not _control_plane_up(state) or not (state / "kubeconfig").exists():
        return False
    wanted = set(real_node_names(real_nodes))
    for d in state.glob("node-*"):
        name = d.name[len("node-") :]
        running = _alive(d, "kubelet") and _alive(d, "containerd")
        if (name in wanted) != running:
            return False
    try:
        if "ok" not in _request(state, "GET", "/readyz", raw=True, timeout=5):
            return False
        nodes = {n["metadata"]["name"]: n for n in _request(state, "GET", "/api/v1/nodes", timeout=5)["items"]}
    except (OSError, ClusterError, ValueError):
        return False
    for name in wanted:
        try:
            started = (state / f"node-{name}" / "run" / "kubelet.started").read_text().strip()
        except OSError:
            return False
        n = nodes.get(name)
        if n is None or not _ready(n, started) or n["metadata"].get("labels", {}).get("phalanx.dev/node") != "real":
            return False
    cap = f"{kwok_cpu}/{kwok_memory}/{kwok_pods}"
    fake = {name for name in nodes if re.fullmatch(r"kwok-node-\d+", name)}
    if fake != set(kwok_node_names(kwok_nodes)):
        return False
    return all(
        _ready(nodes[n]) and nodes[n]["metadata"].get("annotations", {}).get("phalanx.dev/capacity") == cap
        for n in fake
    )


def _ready(node: dict, since: str = "") -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" and c.get("lastHeartbeatTime", "") >= since
        for c in node.get("status", {}).get("conditions", [])
    )


# ---- bring up / tear down -------------------------------------------------------------------------
_started_by_us = False


def ensure_cluster(
    real_nodes: int = 2,
    kwok_nodes: int = 0,
    timeout: float = 300,
    kwok_cpu: str = "4",
    kwok_memory: str = "8Gi",
    kwok_pods: int = 110,
) -> Cluster:
    """The cluster with these nodes, brought up (tests/infra/k8s/up.sh) unless it already is.
    Warm (binaries built, state purged): ~4-5 s; first time on a machine (+apt): ~12 s; already up:
    ~0.01 s.  Raises ClusterError."""
    global _started_by_us
    reason = available(real_nodes)
    if reason:
        raise ClusterError(f"the Kubernetes test cluster cannot be brought up here: {reason}")
    state = state_dir()
    settings = dict(
        real_nodes=real_nodes,
        kwok_nodes=kwok_nodes,
        kwok_cpu=str(kwok_cpu),
        kwok_memory=str(kwok_memory),
        kwok_pods=str(kwok_pods),
    )
    started = False
    if not is_up(**settings):
        was_up = _control_plane_up(state)
        env = {
            **os.environ,
            "K8S_STATE_DIR": str(state),
            "K8S_REAL_NODES": str(real_nodes),
            "K8S_KWOK_NODES": str(kwok_nodes),
            "K8S_KWOK_NODE_CPU": str(kwok_cpu),
            "K8S_KWOK_NODE_MEM": str(kwok_memory),
            "K8S_KWOK_NODE_PODS": str(kwok_pods),
            "K8S_UP_TIMEOUT": str(int(min(timeout, 120))),
        }
        try:
            r = subprocess.run(
                ["bash", str(UP)], env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError(
                f"tests/infra/k8s/up.sh did not finish within {timeout:g} s:\n"
                f"{(e.stderr or b'')[-3000:]!r}\nlogs: {state}/logs, {state}/node-*/logs"
            ) from None
        if r.returncode:
            raise ClusterError(
                f"tests/infra/k8s/up.sh failed ({r.returncode}):\n{r.stderr[-4000:]}\n"
                f"logs: {state}/logs, {state}/node-*/logs"
            )
        started = not was_up
        _started_by_us = _started_by_us or started
    return Cluster(
        kubeconfig=state / "kubeconfig",
        state_dir=state,
        real_nodes=real_node_names(real_nodes),
        kwok_nodes=kwok_node_names(kwok_nodes),
        started=started,
    )


def teardown(purge: bool = False, force: bool = False) -> bool:
    """Stop the cluster (tests/infra/k8s/down.sh) if this process started it — unless
    PHALANX_K8S_KEEP=1 (kept for the next session).  A cluster that was up before (a developer's,
    or a kept one) stays up unless ``force``.  Returns whether it was stopped."""
    global _started_by_us
    if os.environ.get("PHALANX_K8S_KEEP", "") not in ("", "0") and not force:
        return False
    if not (_started_by_us or force):
        return False
    args = ["bash", str(DOWN)] + (["--purge"] if purge else [])
    subprocess.run(
        args,
        env={**os.environ, "K8S_STATE_DIR": str(state_dir())},
        capture_output=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    _started_by_us = False
    return True


# ---- fake (kwok) nodes for scheduling tests --------------------------------------------------------
def add_kwok_nodes(
    n: int,
    cpu: str = "4",
    memory: str = "8Gi",
    prefix: str = "kwok-fake-",
    *,
    pods: int = 110,
    labels: dict | None = None,
    taints: list | None = None,
    wait: float = 30,
    state: Path | None = None,
) -> list[str]:
    """Create fake nodes ``{prefix}1..{prefix}n`` (kwok makes them Ready and simulates their pods:
    Running at once, never really run).  Labelled type=kwok, phalanx.dev/node=kwok (+ ``labels``);
    ``taints`` e.g. ``[{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]``.
    A node of that name that exists already is replaced.  Waits until all are Ready."""
    state = state or state_dir()
    names = [f"{prefix}{i}" for i in range(1, n + 1)]
    cap = {"cpu": str(cpu), "memory": str(memory), "pods": str(pods)}
    for name in names:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    **KWOK_LABEL,
                    "phalanx.dev/node": "kwok",
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **(labels or {}),
                },
            },
            "spec": {"taints": taints or []},
            "status": {"allocatable": cap, "capacity": cap},
        }
        try:
            _request(state, "POST", "/api/v1/nodes", body)
        except ClusterError as e:
            if getattr(e, "status", None) != 409:
                raise
            delete_nodes([name], wait=True, state=state)
            _request(state, "POST", "/api/v1/nodes", body)
    deadline = time.monotonic() + wait
    pending = set(names)
    while pending:
        for name in list(pending):
            try:
                if _ready(_request(state, "GET", f"/api/v1/nodes/{name}")):
                    pending.discard(name)
            except ClusterError:
                pass
        if pending:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"kwok nodes not Ready within {wait:g} s: {sorted(pending)} "
                    f"(is kwok running? {state}/logs/kwok.log)"
                )
            time.sleep(0.1)
    return names


def delete_nodes(names, wait: bool = True, timeout: float = 30, state: Path | None = None) -> None:
    """Delete Node objects (absent ones are fine).  Pods bound to them are left to the test (the
    pod GC removes orphans only after ~40 s)."""
    state = state or state_dir()
    names = list(names)
    for name in names:
        try:
            _request(state, "DELETE", f"/api/v1/nodes/{name}")
        except ClusterError as e:
            if getattr(e, "status", None) != 404:
                raise
    deadline = time.monotonic() + timeout
    while wait and names:
        gone = []
        for name in names:
            try:
                _request(state, "GET", f"/api/v1/nodes/{name}")
            except ClusterError as e:
                if getattr(e, "status", None) != 404:
                    raise
                gone.append(name)
        names = [n for n in names if n not in gone]
        if names:
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes still there after {timeout:g} s: {names}")
            time.sleep(0.1)


# ---- command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring the cluster up (or check it); prints the kubeconfig path")
    up.add_argument("--real-nodes", type=int, default=2)
    up.add_argument("--kwok-nodes", type=int, default=0)
    up.add_argument("--timeout", type=float, default=600)
    sub.add_parser("down", help="stop it (tests/infra/k8s/down.sh)").add_argument("--purge", action="store_true")
    st = sub.add_parser("status", help="exit 0 if up with these nodes")
    st.add_argument("--real-nodes", type=int, default=2)
    st.add_argument("--kwok-nodes", type=int, default=0)
    sub.add_parser("available", help="print why the cluster cannot be had here (exit 1), or 'yes'")
    args = parser.parse_args(argv)
    if args.cmd == "available":
        reason = available()
        print(reason or "yes")
        return 1 if reason else 0
    if args.cmd == "up":
        t = time.monotonic()
        c = ensure_cluster(real_nodes=args.real_nodes, kwok_nodes=args.kwok_nodes, timeout=args.timeout)
        print(
            f"# up in {time.monotonic() - t:.1f} s: real nodes {c.real_nodes}, kwok nodes {c.kwok_nodes}",
            file=sys.stderr,
        )
        print(c.kubeconfig)
        return 0
    if args.cmd == "down":
        teardown(purge=args.purge, force=True)
        return 0
    ok = is_up(args.real_nodes, args.kwok_nodes)
    print(f"up: KUBECONFIG={state_dir() / 'kubeconfig'}" if ok else "down (or not as asked)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
