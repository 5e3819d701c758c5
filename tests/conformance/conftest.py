"""The conformance suite's sites: every test that takes ``site`` runs once per selected site
(``pytest --site NAME``, default all), grouped by site within a module so that a module's
shared gang starts once per site; a site's backend is started by the session's fixtures."""

from __future__ import annotations

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
