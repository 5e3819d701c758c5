"""phalanx's conformance contracts, for plug-ins' tests (as ``fsspec.tests.abstract``): pytest
mix-in classes that a test module subclasses, overriding the fixture that says what is under
test.  They need pytest (``pip install pytest``); ``import phalanx`` never imports this package.

- ``phalanx.testing.executor``: ``GangContract`` and ``RunContract``, the executor contract, on
  a ``site`` fixture (a ``phalanx.testing.site.ContractSite``); ``mark_known_failures``.
- ``phalanx.testing.site``: ``ContractSite``, a site under test and how the contract looks for
  what its gangs leave behind.
- ``phalanx.testing.communicator``: ``CommContract``, on a ``communicator`` fixture (its name).
- ``phalanx.testing.store``: ``TierContract`` (a ``tier_root`` fixture) and ``MetadataContract``
  (a ``metadata_url`` fixture).
- ``phalanx.testing.ranks``, ``.comm_apps``, ``.tables``: what the contracts run on the ranks and
  the data they check; importable without pytest (ranks import them by reference).

This module imports nothing itself: a rank that unpickles an app of ``phalanx.testing.ranks``
must not pull in pytest.
"""

import sys

if "pytest" in sys.modules:  # a test session: the contracts' asserts explain themselves, as a test module's do
    sys.modules["pytest"].register_assert_rewrite(
        "phalanx.testing.executor", "phalanx.testing.communicator", "phalanx.testing.store"
    )
