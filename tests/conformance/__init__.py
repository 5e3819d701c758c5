"""Conformance suites: one contract, every implementation.

- ``test_contract_gang.py`` / ``test_contract_stages.py``: the executor contract, run on every
  site this machine can bring up (``pytest tests/conformance --site local,ray``; default: all
  of ``sites.SITE_NAMES``).  ``sites.py`` says how each site is built and how the suite looks
  for what a gang leaves behind (processes, SLURM jobs and steps, Ray actors and placement
  groups); ``known_failures.py`` lists the contract points today's code breaks (strict xfail).
- ``store_contract.py`` / ``comm_contract.py``: mix-ins of the metadata backend, store tier and
  communicator contracts; tests/test_store_backends.py and tests/test_comm.py subclass them for
  the built-in backends, and a plug-in's tests subclass them the same way.
"""
