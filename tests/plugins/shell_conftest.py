"""The shell plug-in project's conftest.py: contract points it is known to break, as strict
xfails (``phalanx.testing.executor.mark_known_failures``): the fix flips them to XPASS(strict),
a failure, and the entry goes."""

from __future__ import annotations

from phalanx.testing.executor import mark_known_failures

# (test, the site fixture's parameter: None, the plug-in's site is not parametrised) → why
KNOWN_FAILURES = {
    (
        "test_a_gang_that_cannot_be_placed_fails_in_time_with_the_resource_managers_reason",
        None,
    ): "px.Gang(site=...) never calls Executor.check (only the scheduler does): a gang of 2 on a site "
    "of max_ranks 1 starts",
}


def pytest_collection_modifyitems(config, items):
    mark_known_failures(items, KNOWN_FAILURES)
