"""The multi-host test bed's fixtures (tests/multihost/conftest.py: ``multihost_bed``,
``multihost_slurm``, ``shared_tmp``) for the multi-site tests here, which run part of a workflow
on the bed's SLURM pilot: the same fixtures, not copies (a bed or cluster that was up before the
session stays up; what a fixture started, it stops)."""

from multihost.conftest import multihost_bed, multihost_slurm, shared_tmp

__all__ = ["multihost_bed", "multihost_slurm", "shared_tmp"]
