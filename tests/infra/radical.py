"""RADICAL-Pilot on this machine, for tests marked ``radical`` (and the conformance site
``radical-local``).

Nothing runs as a service: every run submits its own pilot to RP's ``local.localhost``
resource (RP's agent, forked here) and cancels it when it ends.  What RP needs to run here is
what ``site-configs/radical-local.yaml`` and the executor set, and this module only points it at
a test's own directory:

- the resource config with the real core count: the executor merges ``cores_per_node`` =
  this machine's cores over RP's ``local.localhost`` (RP's default, 8 fake cores, makes Open MPI
  bind ranks to cores that do not exist: a multi-rank task exits 1 with empty output);
- an activated venv: the executor gives RP's processes ``VIRTUAL_ENV`` and the venv's ``bin``
  on ``PATH`` (``radical.venv: auto``);
- the sandbox: ``radical.sandbox`` — here a temporary directory per test session (users: the
  state directory);
- Open MPI as root: the executor exports ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`` before mpiexec
  when it runs as root;
- loopback: ``radical.interface: lo`` (every RP endpoint bound to 127.0.0.1) and the site's
  ``pre_launch`` lines keep Open MPI's own sockets on ``lo``.

By hand::

    .venv/bin/python tests/infra/radical.py check      # what is missing, or "ok"
    .venv/bin/python tests/infra/radical.py site DIR   # the test site as YAML, sandbox in DIR
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

SITE_FILE = Path(__file__).resolve().parents[2] / "site-configs" / "radical-local.yaml"


def available() -> str | None:
    """Why RP cannot run here (None: it can)."""
    if importlib.util.find_spec("radical") is None or importlib.util.find_spec("radical.pilot") is None:
        return "radical.pilot is not installed: pip install 'phalanx[radical]' (builds sdists: gcc needed)"
    if shutil.which("mpiexec") is None:
        return "mpiexec is missing (apt-get install openmpi-bin): RP starts multi-rank tasks with it"
    if sys.prefix == getattr(sys, "base_prefix", sys.prefix):
        return "not in a venv: RP's local agent starts from VIRTUAL_ENV (radical.venv: auto needs one)"
    return None


def site_data(sandbox: str, cores: int | None = None, **radical: Any) -> dict:
    """``site-configs/radical-local.yaml`` as a mapping, RP's files under ``sandbox``;
    ``cores``: the pilot's (the site's slots); ``radical``: more keys of the section."""
    import yaml

    data = yaml.safe_load(SITE_FILE.read_text())
    data["store"] = data.get("store") or {}
    data["radical"] = {**data["radical"], "sandbox": str(sandbox), **radical}
    if cores:
        data["cores"] = cores
    return data


def site(sandbox: str, cores: int | None = None, **radical: Any):
    """The test site as a ``Site`` model."""
    from phalanx.orchestrator.models import Site
    from phalanx.orchestrator.yamlio import parse

    return parse(Site, site_data(sandbox, cores, **radical), source="tests/infra/radical.py")


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        reason = available()
        print(reason or "ok")
        return 1 if reason else 0
    if argv[:1] == ["site"] and len(argv) == 2:
        import yaml

        print(yaml.safe_dump(site_data(argv[1]), sort_keys=False))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    # run as a script, this file's directory comes first on sys.path, and this file would be
    # the package ``radical``
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.exit(main(sys.argv[1:]))
