"""Fixtures of the multi-host test bed (tests/infra/multihost.py, docs/multihost.md).

- ``multihost_bed``: hosts px-h1..px-h3 and the head px-head, up once per session and down
  at its end (a bed that was up before the session stays up; PHALANX_MULTIHOST_KEEP=1 keeps
  ours).  Yields the ``infra.multihost`` module: ``run_on(host, argv, env)``, ``popen_on``,
  ``hosts()``, ``head()``.
- ``multihost_slurm``: the SLURM cluster across those hosts (tests/infra/slurm-multihost-up.sh),
  one slurmd per host; yields its slurm.conf.  Run srun inside a host (``run_on("px-head",
  ["srun", ...])``): srun in the root namespace cannot be reached by the hosts.
- ``shared_tmp``: a directory every host sees (under /var/tmp): pytest's ``tmp_path`` is
  under /tmp, which is private to each host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

INFRA = Path(__file__).resolve().parent.parent / "infra"
SLURM_DIR = os.environ.get("PHALANX_SLURM_MH_DIR", "/var/tmp/phalanx-slurm-multihost")
SLURM_CONF = f"{SLURM_DIR}/slurm.conf"
N_HOSTS = int(os.environ.get("PHALANX_MULTIHOST_HOSTS", "3"))


def _keep() -> bool:
    return bool(os.environ.get("PHALANX_MULTIHOST_KEEP"))


@pytest.fixture(scope="session")
def multihost_bed():
    if os.geteuid() != 0:
        pytest.skip("the multi-host test bed needs root (network and mount namespaces)")
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"'{tool}' is missing (iproute2, util-linux)")
    from infra import multihost

    was_up = multihost.healthy(N_HOSTS)
    multihost.up(N_HOSTS)
    yield multihost
    if not was_up and not _keep():
        r = multihost.down()
        assert not r["left"], f"the bed's down left {r['left']}"


def slurm_env(**extra) -> dict:
    return {**os.environ, "SLURM_CONF": SLURM_CONF, **extra}


def _slurm_up() -> None:
    r = subprocess.run([str(INFRA / "slurm-multihost-up.sh")], capture_output=True, text=True, timeout=180)
    if r.returncode:
        pytest.fail(f"tests/infra/slurm-multihost-up.sh failed ({r.returncode}):\n{r.stderr}\n{r.stdout}")


@pytest.fixture(scope="session")
def multihost_slurm(multihost_bed):
    if shutil.which("slurmctld") is None:
        pytest.skip("slurmctld is not installed (scripts/setup-slurm.sh installs Debian's slurm-wlm and munge)")
    was_up = Path(SLURM_CONF).exists() and (
        subprocess.run(["scontrol", "ping"], env=slurm_env(), capture_output=True, text=True, timeout=30).stdout.count(
            "is UP"
        )
        > 0
    )
    _slurm_up()
    yield SLURM_CONF
    if not was_up and not _keep():
        subprocess.run([str(INFRA / "slurm-multihost-down.sh"), "--keep-bed"], capture_output=True, timeout=120)


@pytest.fixture
def shared_tmp():
    d = tempfile.mkdtemp(prefix="phalanx-multihost-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)
