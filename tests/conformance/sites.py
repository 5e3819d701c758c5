"""The built-in sites the executor contract (``phalanx.testing.executor``) runs on here, and how
each is built; how the contract looks for what a gang leaves behind is ``phalanx.testing.site``.

A site of the suite is the shipped site file (site-configs/) pointed at this session's cluster,
with a few test settings over it (``ContractSite.data``); tests get fresh ``Site`` models from
it (``site.model(start_timeout=20)``), so what they check is what users run.  Only the public
API is used: the ``Site`` model, ``px.Gang``, ``run_workflow``, the run DB, and each resource
manager's own tools (the OS process table, ``squeue``, Ray's GCS tables).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.testing.site import ContractSite, N

SITE_NAMES = ("local", "mpirun", "slurm", "slurm-pilot", "ray", "k8s-local", "radical-local")
MARKS = {
    "local": [],
    "mpirun": [pytest.mark.mpi],
    "slurm": [pytest.mark.slurm],
    "slurm-pilot": [pytest.mark.slurm],
    "ray": [pytest.mark.ray],
    "k8s-local": [pytest.mark.kubernetes],
    "radical-local": [pytest.mark.radical],
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
        impossible = {
            "more-ranks-than-it-has": {
                "ranks": N + 1,
                "site": {"ray": {"ready_timeout_s": 2}},
                "reason": r"not placeable within 2 s: .*Ray says",
            },
            "an-impossible-request": {
                "ranks": 1,
                "site": {"ray": {"ready_timeout_s": 2, "resources": {"GPU": 1}}},
                "reason": r"Ray says .*INFEASIBLE",
            },
        }
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
        return ContractSite(name, data, "radical", impossible=impossible)
    raise ValueError(name)
