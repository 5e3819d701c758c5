"""The driver host's store service, for a site whose store lives in each host's own memory.

On such a site (a SLURM pilot or a Ray cluster over several nodes, the store root in
``/dev/shm``) every host's ranks keep what they write in their host's memory, and each host runs
a store service from which the others fetch it.  But the driver writes into that store too: a
dataset crossing in from another site (``crossings``), an earlier run's output adopted by the
cache.  Those partitions land in the *driver's* host memory, which no rank shares — so the driver
serves them as well: one ``StoreService`` in the driver process, bound to the address the ranks
reach the driver at (the site's ``driver_host``), for as long as the run holds the site.  The
driver's ``Store`` records that endpoint with each partition it writes (``Store.placement``).

Partitions recorded before the service started (an adopted output; a resumed run's crossed
copy, recorded with the earlier run's service) are pointed at the new one as it opens
(``rehome``): the files are where they were; only where to ask for them changes.  After the run,
as with a pilot's nodes, the bytes stay in the driver host's memory but no service answers for
them: a later run that reads them from another host finds them lost and makes them again.
"""

from __future__ import annotations

import dataclasses
import logging

from ..executors.base import Executor
from ..paths import default_store_root, in_host_memory
from ..store import remote
from ..store.service import StoreService, resolve_host
from ..store.store import Store
from ..store.tiers import FileTier
from .models import Site

log = logging.getLogger("phalanx.orchestrator")


def store_in_host_memory(site: Site) -> bool:
    """Whether ``site``'s store root is each host's own memory (``paths.HOST_MEMORY``)."""
    root = site.store.root or str(default_store_root())
    return "://" not in root and in_host_memory(root)


def needs_driver_service(site: Site, executor: Executor) -> bool:
    """Whether ranks of ``site`` on other hosts must read what the driver writes into its store:
    the root is each host's own memory and the executor runs ranks on other hosts, serving
    their partitions to each other (where it does not, ``phalanx validate`` says so instead)."""
    return store_in_host_memory(site) and executor.capabilities.remote_ranks and executor.serves_store()


class DriverStoreService:
    """The store service of the driver's host for one site of one run (``open``/``close``)."""

    def __init__(self, store: Store, driver_host: str, run_id: str):
        assert isinstance(store.tier, FileTier)  # needs_driver_service: a directory root
        self.store, self.root = store, store.tier.root
        self.host = resolve_host(driver_host)
        self.key = f"driver-{run_id}"
        self.service: StoreService | None = None

    def open(self) -> str:
        """Start serving the store's root (and its spill directory) and make the driver's
        writes record it; point partitions already on this host's root at it.  The endpoint."""
        store = self.store
        also = [store.spill_tier.root] if store.spill_tier is not None else []
        self.service = StoreService(self.root, self.host, also=also)
        remote.publish_endpoint(self.root, self.key, self.service.endpoint)
        store.service_key = self.key
        moved = rehome(store, self.service.endpoint)
        log.info(
            "store service of the driver's host for %s on %s%s",
            self.root,
            self.service.endpoint,
            f" ({moved} datasets pointed at it)" if moved else "",
        )
        return self.service.endpoint

    def close(self) -> None:
        if self.service is None:
            return
        self.store.service_key = ""
        remote.endpoint_record(self.root, self.key).unlink(missing_ok=True)
        self.service.close()
        self.service = None


def rehome(store: Store, endpoint: str) -> int:
    """Record ``endpoint`` as where to fetch every partition of ``store``'s session that lies on
    this host's root (same ``root_id``) under another endpoint; how many datasets changed.  A
    metadata step per dataset (the same version and files, sealed over itself)."""
    assert isinstance(store.tier, FileTier)
    root_id = store.tier.root_id()
    changed = 0
    for info in store.meta.list(store.session):
        parts = [
            dataclasses.replace(p, endpoint=endpoint) if p.root_id == root_id and p.endpoint != endpoint else p
            for p in info.partitions
        ]
        if parts != info.partitions:
            store.meta.seal(dataclasses.replace(info, partitions=parts), replace=True)
            changed += 1
    return changed
