"""The executor contract for a gang (``phalanx.testing.executor.GangContract``) on every
built-in site of the suite (``--site``; conftest.py gives the ``site`` fixture)."""

from __future__ import annotations

from phalanx.testing.executor import GangContract


class TestGangContract(GangContract):
    """One gang of N ranks per site serves the class (the mix-in's ``gang`` fixture)."""
