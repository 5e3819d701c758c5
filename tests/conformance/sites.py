"""The built-in sites the executor contract (``phalanx.testing.executor``) runs on here, and how
each is built; how the contract looks for what a gang leaves behind is ``phalanx.testing.site``.

A site of the suite is the shipped site file (site-configs/) pointed at this session's cluster,
with a few test settings over it (``ContractSite.data``); tests get fresh ``Site`` models from
it (``site.model(start_timeout=20)``), so what they check is what users run.  Only the public
API is used: the ``Site`` model, ``px.Gang``, ``run_workflow``, the run DB, and each resource
manager's own tools (the OS process table, ``squeue``, Ray's GCS tables).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from phalanx.testing.site import ContractSite, N

SITE_NAMES = (
    "local",
    "mpirun",
    "slurm",
    "slurm-pilot",
    "ray",
    "k8s-local",
    "radical-local",
    "slurm-multihost",
    "ray-multihost",
)
MARKS = {
    "local": [],
    "mpirun": [pytest.mark.mpi],
    "slurm": [pytest.mark.slurm],
    "slurm-pilot": [pytest.mark.slurm],
    "ray": [pytest.mark.ray],
    "k8s-local": [pytest.mark.kubernetes],
    "radical-local": [pytest.mark.radical],
    # the SLURM pilot across the test bed's hosts (docs/multihost.md): the multihost lane only
    "slurm-multihost": [pytest.mark.multihost],
    # a Ray cluster across the same hosts, the driver through Ray Client: the multihost lane only
    "ray-multihost": [pytest.mark.multihost],
}
SITE_FILES = Path(__file__).resolve().parents[2] / "site-configs"


def selected(config) -> list[str]:
    """Sites named by ``--site`` (repeatable, comma-separated), default all."""
    names = [n.strip() for opt in (config.getoption("--site", default=None) or []) for n in opt.split(",")]
    names = [n for n in names if n] or list(SITE_NAMES)
    unknown = [n for n in names if n not in SITE_NAMES]
    if unknown:
        raise pytest.UsageError(
            f"--site {', '.join(unknown)}: unknown; the conformance suite knows {', '.join(SITE_NAMES)}"
        )
    return list(dict.fromkeys(names))


def serve(request: pytest.FixtureRequest) -> Iterator[ContractSite]:
    """The ``site`` fixture of the project's contract classes: the ``ContractSite`` of this
    parameter; at the end of the class's tests on it, anything a gang left behind is freed (and
    a leftover is an error there: the tests must have seen it)."""
    with build(request.param, request) as site:
        yield site


# ---- building the sites -----------------------------------------------------------------------
def _site_file(name: str) -> dict:
    import yaml

    data = yaml.safe_load((SITE_FILES / f"{name}.yaml").read_text())
    data["store"] = data.get("store") or {}
    return data


# every site: a broken start fails in two minutes, not the files' five (the cluster is this host)
_SUITE = {"start_timeout": 120}


def build(name: str, request) -> ContractSite:
    """Bring the site's backend up (the session's fixtures) and describe the site; skips when
    this machine cannot run it."""
    if name == "local":
        # 4 slots on any machine, oversubscribed on a small one: the suite's gangs of 3 fit
        return ContractSite(name, {**_site_file("local"), **_SUITE, "cores": 4}, "local")
    if name == "mpirun":
        import importlib.util

        if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
            pytest.skip("site 'mpirun' needs mpirun (apt-get install openmpi-bin) and mpi4py")
        # no shipped file: this machine's cores through one mpirun, ranks in MPI_COMM_WORLD
        data = {
            "name": "mpirun-local",
            "executor": "mpirun",
            "communicator": "mpi",
            "rendezvous": "tcp",
            "cores": 4,
            "store": {},
            **_SUITE,
        }
        return ContractSite(name, data, "local")
    if name in ("slurm", "slurm-pilot"):
        conf = request.getfixturevalue("slurm_cluster")
        data = _site_file("slurm-local" if name == "slurm" else "slurm-pilot-local")
        data.update(_SUITE)
        data["slurm"]["conf"] = conf
        # bounds a wait in SLURM's queue, which a pilot's start_timeout does not (known_failures.py)
        data["slurm"]["pending_timeout"] = _SUITE["start_timeout"]
        if name == "slurm-pilot":
            # half the cluster (3 of 6 CPUs, one a node): two runs' pilots fit side by side
            data["cores"] = N
            data["slurm"]["pilot"] = {**data["slurm"]["pilot"], "nodes": 3, "ntasks": N}
            impossible = {
                "more-ranks-than-it-has": {"ranks": N + 1, "reason": r"slurm: .*pilot"},
                # partition 'small' has MaxNodes=1: a pilot of 3 nodes there never starts
                "an-impossible-request": {
                    "ranks": 2,
                    "site": {"slurm": {"partition": "small", "pilot": {"nodes": 3, "ntasks": N}}},
                    "reason": r"PartitionNodeLimit|PartitionConfig",
                },
            }
        else:
            impossible = {
                "more-ranks-than-it-has": {
                    "ranks": 7,
                    "reason": r"slurm: .*(node configuration is not available|PartitionConfig)",
                },
                # partition 'small' has MaxNodes=1: a job of 2 nodes there never starts
                "an-impossible-request": {
                    "ranks": 2,
                    "site": {"slurm": {"partition": "small", "nodes": 2}},
                    "reason": r"PartitionNodeLimit|PartitionConfig",
                },
            }
        # each run holds its own pilot: three pilots of one node (2 tasks) fill the 3 nodes
        side_by_side = (
            {"cores": 2, "slurm": {"pilot": {**data["slurm"]["pilot"], "nodes": 1, "ntasks": 2}}}
            if name == "slurm-pilot"
            else {}
        )
        return ContractSite(
            name,
            data,
            "slurm",
            slurm_conf=conf,
            impossible=impossible,
            side_by_side=side_by_side,
            waiting=r"PENDING \((Resources|Priority)\)",
        )
    if name == "ray":
        cluster = request.getfixturevalue("ray_cluster")
        data = _site_file("ray-local")
        data.update(_SUITE)
        data["ray"] = {**data["ray"], "address": cluster.address}
        impossible = _ray_impossible({"GPU": 1})  # a GPU of a cluster that has none
        return ContractSite(name, data, "ray", impossible=impossible, waiting=r"not placeable|Ray says")
    if name == "k8s-local":
        cluster = request.getfixturevalue("k8s_cluster")
        data = _site_file("k8s-local")
        data.update(_SUITE)
        # the tests' own files (markers, facts) are written by the ranks: pytest's temporary
        # directory is shared with the pods like the store
        temp = str(request.getfixturevalue("tmp_path_factory").getbasetemp())
        data["kubernetes"] = {
            **data["kubernetes"],
            "kubeconfig": str(cluster.kubeconfig),
            "host_paths": [*data["kubernetes"]["host_paths"], temp],
        }
        impossible = {
            # 1.5 CPUs a rank: one fits on each of the 2 real nodes, the gang of 4 never does
            "more-ranks-than-it-has": {
                "ranks": N + 1,
                "site": {"kubernetes": {"cpu": "1500m"}},
                "reason": r"kubernetes: .*Unschedulable.*Insufficient cpu",
            },
            "an-impossible-request": {
                "ranks": 1,
                "site": {"kubernetes": {"node_selector": {"phalanx.dev/node": "none"}}},
                "reason": r"kubernetes: .*Unschedulable.*node affinity/selector",
            },
        }
        return ContractSite(
            name, data, "kubernetes", impossible=impossible, waiting=r"kubernetes: .*Unschedulable.*Insufficient cpu"
        )
    if name == "radical-local":
        from infra.radical import available, site_data

        reason = available()
        if reason:
            pytest.skip(f"site 'radical-local': {reason}")

        # RP's files (the session, the pilots' sandboxes) in pytest's temporary directory;
        # 4 cores: the pilot is 2 "nodes" of this machine's cores (oversubscribed on a small
        # one, like the local site), so the suite's gangs of 3 fit and a gang of 5 never does
        base = request.getfixturevalue("tmp_path_factory").getbasetemp() / "radical-local"  # one RP session for all
        base.mkdir(exist_ok=True)
        data = site_data(str(base), cores=4)
        data.update(_SUITE)
        # the pilot's size is known before it runs: the gang fails at once, as a SLURM pilot's
        # step does (RP's own "task can never be scheduled" once the pilot is up: test_radical.py)
        impossible = {
            "more-ranks-than-it-has": {
                "ranks": 5,
                "reason": r"radical: a gang of 5 ranks .*does not fit the "
                r"pilot's 4 cores",
            },
            "an-impossible-request": {
                "ranks": 1,
                "site": {"radical": {"gpus_per_rank": 1}},
                "reason": r"radical: a gang of 1 ranks x 1 GPUs does not fit the pilot's 0 GPUs",
            },
        }
        # three pilots starting at once (the side-by-side test) take 65-75 s on a quiet 2-core
        # machine and passed 120 s under CI's load: RP's agents bootstrap on the same cores
        return ContractSite(name, data, "radical", impossible=impossible, side_by_side={"start_timeout": 360})
    if name == "slurm-multihost":
        return _multihost(request)
    if name == "ray-multihost":
        return _ray_multihost(request)
    raise ValueError(name)


def _ray_impossible(resources: dict) -> dict:
    """What Ray refuses: a gang of N + 1 ranks on a cluster of N CPUs (Ray keeps the group
    pending: the cluster may yet grow), and one rank whose bundle (``resources``) no node holds
    (Ray says INFEASIBLE); either fails after ``ready_timeout_s`` (2 s) with Ray's word."""
    return {
        "more-ranks-than-it-has": {
            "ranks": N + 1,
            "site": {"ray": {"ready_timeout_s": 2}},
            "reason": r"not placeable within 2 s: .*Ray says",
        },
        "an-impossible-request": {
            "ranks": 1,
            "site": {"ray": {"ready_timeout_s": 2, "resources": resources}},
            "reason": r"Ray says .*INFEASIBLE",
        },
    }


# ---- the SLURM pilot across the multi-host test bed ----------------------------------------------
INFRA = Path(__file__).resolve().parents[1] / "infra"
MH_SLURM_DIR = os.environ.get("PHALANX_SLURM_MH_DIR", "/var/tmp/phalanx-slurm-multihost")
MH_HOSTS = int(os.environ.get("PHALANX_MULTIHOST_HOSTS", "3"))


@dataclass
class MultihostSite(ContractSite):
    """A site whose ranks run on other hosts that share no /dev/shm or /tmp with the driver:
    ``hosts`` (their names), ``run_on(host, argv, **subprocess_kw)`` runs a command inside one,
    ``shared`` is a directory every host sees, ``veths`` each host's link in this namespace,
    ``service_key(executor)`` the key under which a run scope's store services publish
    themselves in each host's root (``<root>/.services/<key>.json``: how the contract finds the
    PID of one host's service to lose that host mid-read).  The store root
    (``data["store"]["root"]``) is in each host's own /dev/shm; the metadata is on ``shared``.
    On enter the store and log variables a driver-side ``px.Store`` needs are set (``px.Gang(site=...)``
    passes the store root only), and ``env``; on exit they are restored, and each host's store
    root and the shared directory are removed."""

    hosts: list[str] = field(default_factory=list)
    run_on: object = None
    shared: Path | None = None
    veths: dict[str, str] = field(default_factory=dict)
    bridge_addr: str = ""
    service_key: Callable[[Any], str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    _saved: dict = field(default_factory=dict)

    ENV = ("PHALANX_STORE_METADATA", "PHALANX_LOG_DIR")

    def __enter__(self) -> MultihostSite:
        self._saved = {k: os.environ.get(k) for k in (*self.ENV, *self.env)}
        os.environ["PHALANX_STORE_METADATA"] = self.data["store"]["metadata"]
        os.environ["PHALANX_LOG_DIR"] = str(self.shared / "logs")  # the ranks' and the pilot's logs
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            top = os.path.dirname(self.data["store"]["root"])
            for h in self.hosts:
                self.run_on(h, ["rm", "-rf", top], timeout=30)
            shutil.rmtree(top, ignore_errors=True)  # the driver's Store makes one here too
            if self.shared is not None:
                shutil.rmtree(self.shared, ignore_errors=True)


def _on_the_bed(name: str, request, tools: tuple[str, ...]):
    """The test bed up (idempotent: a bed that is up stays up) for site ``name``, or a skip
    saying what this machine lacks; pytest's tmp_path moved to one every host sees (under
    /var/tmp) unless ``--basetemp`` says where.  Returns ``infra.multihost``."""
    if os.geteuid() != 0:
        pytest.skip(f"site {name!r} needs root (the test bed's network and mount namespaces)")
    for tool in ("ip", "unshare", "nsenter", *tools):
        if shutil.which(tool) is None:
            pytest.skip(f"site {name!r}: '{tool}' is missing (iproute2, util-linux, slurm-wlm)")
    factory = request.getfixturevalue("tmp_path_factory")
    if getattr(factory, "_basetemp", None) is None and getattr(factory, "_given_basetemp", None) is None:
        # the ranks write the contract's marker and fact files into tmp_path: not under /tmp,
        # which every host has its own of
        moved = tempfile.mkdtemp(prefix="phalanx-conformance-", dir="/var/tmp")
        factory._given_basetemp = Path(moved) / "t"
        request.config.add_cleanup(lambda: shutil.rmtree(moved, ignore_errors=True))  # pytest keeps a given one
    base = str(factory.getbasetemp())
    if base.startswith(("/tmp/", "/dev/shm/")):
        pytest.skip(f"site {name!r}: pytest's --basetemp {base} is private to each host; use one under /var/tmp")
    from infra import multihost

    multihost.up(MH_HOSTS)
    return multihost


def _shared_dir() -> Path:
    shared = Path(tempfile.mkdtemp(prefix="phalanx-conformance-mh-", dir="/var/tmp"))
    shared.chmod(0o755)
    return shared


def _bed_site(name: str, data: dict, backend: str, multihost, shared: Path, **kw: Any) -> MultihostSite:
    return MultihostSite(
        name,
        data,
        backend,
        hosts=[h["name"] for h in multihost.hosts()],
        run_on=multihost.run_on,
        shared=shared,
        veths={h["name"]: h["veth"] for h in multihost.hosts()},
        bridge_addr=multihost.load_state()["bridge_addr"],
        **kw,
    )


def _multihost(request) -> MultihostSite:
    """The SLURM pilot across px-h1..px-h3 (tests/multihost/test_slurm_gang_multihost.py):
    driver at the bridge address, srun inside px-head, a file:// rendezvous on a shared dir,
    the store root in each host's /dev/shm (the pilot starts a store service per node), the
    catalogue SQLite on /var/tmp.  pytest's tmp_path must be one every host sees: unless
    ``--basetemp`` says otherwise, it is moved under /var/tmp."""
    import subprocess

    multihost = _on_the_bed("slurm-multihost", request, ("slurmctld",))
    r = subprocess.run([str(INFRA / "slurm-multihost-up.sh")], capture_output=True, text=True, timeout=180)
    if r.returncode:
        pytest.fail(f"tests/infra/slurm-multihost-up.sh failed ({r.returncode}):\n{r.stderr}\n{r.stdout}")
    conf = f"{MH_SLURM_DIR}/slurm.conf"
    state = multihost.load_state()
    shared = _shared_dir()
    pilot = {"nodes": MH_HOSTS, "ntasks": N, "time": "00:30:00"}
    data = {
        "name": "slurm-multihost",
        "executor": "slurm",
        "communicator": "tcp",
        "driver_host": state["bridge_addr"],  # 10.231.0.1: `auto` is 127.0.0.1 here
        "rendezvous": f"file://{shared}/rdzv",  # tcp would be rank 0's loopback
        "cores": N,
        "store": {
            "root": f"/dev/shm/{shared.name}/store",  # each host's own memory
            "metadata": f"sqlite://{shared}/meta.sqlite",
        },
        "slurm": {
            "allocation": "pilot",
            "conf": conf,
            "srun_via": [str(INFRA / "multihost-exec"), "px-head"],  # srun must run inside a host
            "ranks_per_node": 1,
            "poll_interval": 0.25,
            "pilot": pilot,
            # bounds a wait in SLURM's queue (known_failures.py); shorter than slurm-pilot's 120 s
            "pending_timeout": 30,
        },
        **_SUITE,
    }
    impossible = {
        "more-ranks-than-it-has": {"ranks": N + 1, "reason": r"slurm: .*pilot"},
        # partition 'small' has MaxNodes=1: a pilot of 3 nodes there never starts
        "an-impossible-request": {
            "ranks": 2,
            "site": {"slurm": {"partition": "small", "pilot": pilot}},
            "reason": r"PartitionNodeLimit|PartitionConfig",
        },
    }
    return _bed_site(
        "slurm-multihost",
        data,
        "slurm",
        multihost,
        shared,
        slurm_conf=conf,
        impossible=impossible,
        # each run its own pilot of one node and one task: three fit beside another pilot of 3
        side_by_side={"cores": 1, "slurm": {"pilot": {**pilot, "nodes": 1, "ntasks": 1}}},
        waiting=r"PENDING \((Resources|Priority)\)",
        # the pilot's services publish themselves as slurm-<its job id>
        service_key=lambda executor: f"slurm-{executor.pilot().job_id}",
    )


# ---- a Ray cluster across the multi-host test bed -------------------------------------------------
def _ray_multihost(request) -> MultihostSite:
    """Ray across px-h1..px-h3 (tests/multihost/test_ray_multihost.py): the head in px-head
    (no CPUs), one raylet of 1 CPU in each host, the driver (this process) through Ray Client at
    the head (the session's ``ray_multihost`` fixture brings the cluster up and connects); the
    ranks reach the driver at the bridge address, rendezvous through a file:// directory on
    /var/tmp; the store root in each host's /dev/shm, one store service per Ray node for each
    run (phalanx/executors/ray/services.py), the catalogue SQLite on /var/tmp; the services'
    token in a file on /var/tmp (the launcher hands its path to the actors)."""
    import secrets

    from phalanx.store.service import write_token_file

    multihost = _on_the_bed("ray-multihost", request, ())
    state = request.getfixturevalue("ray_multihost")
    shared = _shared_dir()
    token = write_token_file(shared / "token", secrets.token_hex(32))
    data = {
        "name": "ray-multihost",
        "executor": "ray",
        "communicator": "tcp",
        "driver_host": multihost.load_state()["bridge_addr"],  # 10.231.0.1: `auto` is 127.0.0.1 here
        "rendezvous": f"file://{shared}/rdzv",
        "cores": N,  # the raylets' CPUs: one a host
        "store": {
            "root": f"/dev/shm/{shared.name}/store",  # each host's own memory
            "metadata": f"sqlite://{shared}/meta.sqlite",
        },
        "ray": {
            "address": state["client"],  # ray://10.231.0.10:10001
            "namespace": "phalanx",
            "strategy": "SPREAD",
            "cpus_per_rank": 1,
            "ready_timeout_s": 30,
        },
        **_SUITE,
    }
    # a rank on two hosts at once (each raylet has its host's name as a resource of 1)
    impossible = _ray_impossible({"px-h1": 1, "px-h2": 1})
    return _bed_site(
        "ray-multihost",
        data,
        "ray",
        multihost,
        shared,
        impossible=impossible,
        waiting=r"not placeable|Ray says",
        # the run's services publish themselves as ray-<id> (StoreServices.key)
        service_key=lambda executor: executor.services.key,
        env={"PHALANX_STORE_TOKEN_FILE": str(token)},
    )
