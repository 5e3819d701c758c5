"""The executor contract for workflow runs (``phalanx.testing.executor.RunContract``) on every
built-in site of the suite (``--site``; conftest.py gives the ``site`` fixture)."""

from __future__ import annotations

from phalanx.testing.executor import RunContract


class TestRunContract(RunContract):
    """Command stages, gang reuse, stages too big, cancel, runs side by side."""
