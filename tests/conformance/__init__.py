"""Conformance suites: one contract, every implementation.  The contracts are importable mix-ins
in ``phalanx.testing`` (a plug-in's tests subclass them the same way); this package runs them on
the built-in implementations.

- ``test_contract_gang.py`` / ``test_contract_stages.py``: the executor contract
  (``phalanx.testing.executor``), run on every site this machine can bring up
  (``pytest tests/conformance --site local,ray``; default: all of ``sites.SITE_NAMES``).
  ``sites.py`` says how each built-in site is built; ``phalanx.testing.site`` how the contract
  looks for what a gang leaves behind (processes, SLURM jobs and steps, Ray actors and
  placement groups); ``known_failures.py`` lists the contract points today's code breaks
  (strict xfail).
- The metadata backend, store tier and communicator contracts (``phalanx.testing.store``,
  ``phalanx.testing.communicator``) run in tests/test_store_backends.py and tests/test_comm.py.
"""
