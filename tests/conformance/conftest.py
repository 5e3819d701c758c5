"""The conformance suite's sites: every test that takes ``site`` runs once per selected site
(``pytest --site NAME``, default all), grouped by site within a module so that a module's
shared gang starts once per site; a site's backend is started by the session's fixtures."""

from __future__ import annotations

import os
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
def ray_multihost():
    """The Ray cluster across the multi-host test bed (tests/infra/ray_multihost.py), up once
    for the session (idempotent: a cluster that is up is left alone) and this process connected
    to it through Ray Client; as tests/multihost/test_ray_multihost.py does, a cluster this
    session brought up is taken down at its end (PHALANX_MULTIHOST_KEEP=1 keeps it), one that
    was up stays.  Skipped where this process is already connected to another Ray cluster (the
    'ray' site's, in the same session: Ray allows one connection a process)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")
    if ray.is_initialized():
        pytest.skip("site 'ray-multihost': this process is connected to another Ray cluster (site 'ray'); run it alone")
    from infra import ray_multihost

    from phalanx.errors import GangError
    from phalanx.executors.ray import connect

    was_up = ray_multihost.healthy()
    t0 = time.monotonic()
    state = ray_multihost.up()
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
    state["fixture_up_s"] = round(time.monotonic() - t0, 1)
    print(f"ray-multihost: Ray across the bed ready in {state['fixture_up_s']} s (was up: {was_up})", file=sys.stderr)
    yield state
    if ray.is_initialized():
        ray.shutdown()
    if not was_up and not os.environ.get("PHALANX_MULTIHOST_KEEP"):
        r = ray_multihost.down()
        assert not r["left"], f"Ray processes left: {r['left']}"
