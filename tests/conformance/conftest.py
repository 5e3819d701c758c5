"""The conformance suite's sites: every test that takes ``site`` runs once per selected site
(``pytest --site NAME``, default all), grouped by site within a module so that a module's
shared gang starts once per site; a site's backend is started by the session's fixtures."""

from __future__ import annotations

import sys
import time

import pytest

from phalanx.testing.executor import mark_known_failures

from .known_failures import KNOWN_FAILURES
from .sites import MARKS, selected, serve


def pytest_generate_tests(metafunc):
    if "site" in metafunc.fixturenames:
        metafunc.parametrize(
            "site",
            [pytest.param(n, id=n, marks=MARKS[n]) for n in selected(metafunc.config)],
            indirect=True,
            scope="module",
        )


def pytest_collection_modifyitems(config, items):
    """Contract points today's code breaks on a site: strict xfail, so the fix flips them
    (non-strict where today's failure is a race)."""
    mark_known_failures(items, KNOWN_FAILURES)


@pytest.fixture(scope="module")
def site(request):
    """The ``ContractSite`` of this parameter; at the end of the module's tests on it, anything
    a gang left behind is freed (and a leftover is an error there: the tests must have seen it)."""
    yield from serve(request)


@pytest.fixture(scope="session")
def ray_multihost(ray_multihost_cluster):
    """The Ray cluster across the multi-host test bed (tests/conftest.py's
    ``ray_multihost_cluster``: up once a session, shared with tests/multihost) and this process
    connected to it through Ray Client.  Skipped where this process is already connected to
    another Ray cluster (the 'ray' site's, in the same session: Ray allows one connection a
    process)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")
    if ray.is_initialized():
        pytest.skip("site 'ray-multihost': this process is connected to another Ray cluster (site 'ray'); run it alone")
    from phalanx.errors import GangError
    from phalanx.executors.ray import connect

    state = ray_multihost_cluster
    t0 = time.monotonic()
    # the head's client port opens before its server can start a session for a client: under
    # load the first connection failed ("Starting Ray client server failed"), the next worked
    while True:
        try:
            connect(state["client"], "phalanx", site="ray-multihost")
            break
        except GangError:
            ray.shutdown()
            if time.monotonic() - t0 > 180:
                raise
            time.sleep(2)
    print(f"ray-multihost: connected in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    yield state
    if ray.is_initialized():
        ray.shutdown()
