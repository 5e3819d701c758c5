"""``phalanx validate`` notes a site whose store lives in each host's own memory (``/dev/shm``)
while its executor may place ranks on several hosts and runs no store service there — the
read that would fail with PartitionLostError on another host is said before any run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from phalanx.orchestrator.loading import store_reach_notes
from phalanx.orchestrator.models import Site, StoreConfig


def site(executor: str, root: str | None = None, **fields) -> Site:
    sections = {
        "kubernetes": {"kubernetes": {"image": "python:3.12-slim"}},
        "slurm": {"slurm": {"allocation": fields.pop("allocation", "per-stage")}},
    }
    store = StoreConfig(root=root, **fields)
    return Site(name=f"{executor}-site", executor=executor, store=store, **sections.get(executor, {}))


@pytest.mark.parametrize(
    "made, noted",
    [
        (lambda: site("local"), False),  # one host: its memory is every rank's
        (lambda: site("slurm", allocation="pilot"), False),  # a store service on each pilot node
        (lambda: site("ray", "/dev/shm/x"), False),  # a store service on each node of the run
        (lambda: site("slurm"), True),  # per-stage jobs: no service, the default root in /dev/shm
        (lambda: site("kubernetes", "/dev/shm/px/store"), True),
        (lambda: site("kubernetes", "/shared/project/store"), False),  # a root every node mounts
        (lambda: site("kubernetes", "s3://lake/px"), False),
        (lambda: site("kubernetes", durability="write-through", durable="/shared/durable"), False),
    ],
    ids=["local", "slurm-pilot", "ray", "slurm-per-stage", "k8s-shm", "k8s-shared", "k8s-s3", "k8s-write-through"],
)
def test_a_host_memory_store_without_a_service_across_hosts_is_noted(made, noted):
    pytest.importorskip("kubernetes")
    got = store_reach_notes([made()])
    assert bool(got) == noted, got
    if noted:
        assert "runs no store service on its hosts" in got[0] and "PartitionLostError" in got[0]


def test_validate_says_it_on_stderr(tmp_path):
    (tmp_path / "site.yaml").write_text("name: cluster\nexecutor: slurm\nslurm: {allocation: per-stage}\n")
    (tmp_path / "wf.yaml").write_text(
        textwrap.dedent(
            """
            name: reach
            stages:
              s: {kind: command, command: ["true"]}
            """
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "validate",
            str(tmp_path / "wf.yaml"),
            "--site",
            str(tmp_path / "site.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("note: site 'cluster': store root /dev/shm/"), out.stderr
    assert "executor 'slurm' runs no store service on its hosts" in out.stderr
