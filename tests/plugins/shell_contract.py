"""The shell executor's conformance tests, as its own project would keep them (its
``tests/test_contract.py``): phalanx's executor contract, subclassed, on a site of the plug-in.

tests/test_executor_plugins.py copies this file (and shell_conftest.py, its conftest.py) into an
empty directory and runs pytest there, with the plug-in installed as a distribution (entry point
``phalanx.executors: shell``): nothing of phalanx's own tests is on the path.
"""

from __future__ import annotations

import pytest

from phalanx.testing.executor import GangContract, RunContract
from phalanx.testing.site import ContractSite


@pytest.fixture(scope="module")
def site():
    """The site under test: a site file's mapping.  Its ranks are processes of this host, so the
    default probes (backend "local") find whatever a gang leaves; leftovers are freed at the end.
    What it refuses: a gang over its ``max_ranks`` (the executor's ``check``)."""
    data = {"name": "shell-contract", "executor": "shell", "shell": {"shell": "/bin/sh", "rank_slots": 4}}
    refused = {"ranks": 2, "site": {"shell": {"max_ranks": 1}}, "reason": r"over max_ranks 1"}
    with ContractSite("shell", {**data, "start_timeout": 60}, impossible={"an-impossible-request": refused}) as s:
        yield s


class TestShellGangs(GangContract):
    """Start, collectives, a rank that raises or is killed, a closed gang leaves nothing."""


class TestShellRuns(RunContract):
    """Command stages, stages too big, cancel, runs side by side."""
