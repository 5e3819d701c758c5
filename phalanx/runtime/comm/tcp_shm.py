"""``communicator: shm``: the ``tcp`` communicator with the shared-memory data path required.

``tcp`` moves bytes through shared memory (``shm.ShmDataPath``) only when every rank of the
gang shares one host and ``PHALANX_SHM`` allows it.  ``shm`` always does for co-located ranks,
also in a gang that spans hosts (shared memory within a host, the sockets between hosts), and
fails at start where ranks of one host cannot share it.
"""

from __future__ import annotations

from .tcp import TCPCommunicator


class ShmCommunicator(TCPCommunicator):
    """``tcp`` with the shared-memory path required for co-located ranks (a gang that spans
    hosts too: shared memory within a host, the sockets between hosts)."""

    name = "shm"
    shm_required = True
