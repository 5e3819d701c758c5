"""How a dataset sealed on one site gets into another site's store: the one place that decides
the path (through an object store both sites name as their ``store.exchange``, else directly
from the producer's store), crosses it (``store.crossing.cross``: streamed, verified, resumable,
once), retries it, and says what happened.  Used by the scheduler (a workflow run's stages on
several sites) and by the Airflow stage operator (a task on one site reading an upstream task's
output that another site sealed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import GangError, StoreError
from ..redact import redact
from ..store import Store

__all__ = [
    "CROSSING_PAUSES_S",
    "CROSSING_TRIES",
    "clear_exchange",
    "cross_dataset",
    "crossing_message",
    "crossing_path",
    "shared_exchange",
]

CROSSING_TRIES = 3  # a crossing's own tries, before it fails the stage's attempt
CROSSING_PAUSES_S = (1.0, 4.0)  # the pause after the first failed try, after the second (and on)


class CrossingRefused(GangError):
    """The destination holds a dataset of that name that it made itself: never replaced."""


def shared_exchange(there: str | None, here: str | None) -> str | None:
    """The object store both sites name as their exchange (``here``'s URL: the consumer's own
    credentials reference), or None when they name none in common: the crossing is direct.  The
    URLs are compared with their credentials masked, so a producer's exchange known only
    redacted (an Airflow manifest) is recognized as the consumer's."""
    if there and here and redact(there) == redact(here):
        return here
    return None


def crossing_path(exchange: str | None) -> str:
    """The path a crossing takes, for a plan, a record or an error: ``object store <URL>``
    (credentials masked, the query's options left out) or ``direct``."""
    return f"object store {_shown(exchange)}" if exchange else "direct"


def _shown(url: str) -> str:
    """An object store's URL as a plan, record or error shows it: credentials masked, its query
    (endpoint, credentials reference) left out."""
    return redact(url).split("?", 1)[0]


def cross_dataset(
    dataset: str,
    src: Store,
    dst: Store,
    exchange: str | None,
    *,
    src_site: str,
    dst_site: str,
    run: str = "",
    wait: Callable[[float], Any] = time.sleep,
    on_retry: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Cross ``dataset`` of ``src`` (its session) into ``dst`` (its session): through
    ``exchange`` (two legs, up then down) when given, else directly.  Returns the record a run
    keeps: ``{"from", "to", "bytes", "seconds", "path", "already", "tries"}`` (``path``: "object
    store" or "direct", ``exchange`` the object store's URL masked; ``already``: it had crossed
    before and its copy passed its check, nothing moved; ``replaced``: why a copy there was
    replaced, when one was).

    A copy in ``dst`` that crossed from another version of the source (a resume after the
    producer ran again), or that the same stage sealed there when it ran on that site, is
    replaced; one that ``dst``'s own site made otherwise (another stage's, a user's put) never
    is: ``GangError`` naming both sites, no retry.  A failed try is tried again, up to
    ``CROSSING_TRIES`` tries, pausing ``CROSSING_PAUSES_S`` between them (``wait(seconds)``:
    a true result — a cancel — stops there; ``on_retry(message)`` before each pause); what
    arrived and passed its checksum is kept by the next try.  The last failure raises
    ``GangError`` naming both sites, the path and the number of tries."""
    via = crossing_path(exchange)
    tries = 0
    while True:
        tries += 1
        try:
            replace = _may_replace(dataset, src, dst, src_site, dst_site)
            if exchange is None:
                legs = [_cross(src, dataset, dst, run, replace)]
            else:
                legs = _through(Store(exchange, dst.session), dataset, src, dst, run, replace, src_site, dst_site)
            break
        except CrossingRefused:
            raise
        except Exception as exc:
            said = f"from site {src_site!r} to site {dst_site!r} ({via}"
            if tries >= CROSSING_TRIES:
                raise GangError(redact(f"input {dataset!r} could not cross {said}, {tries} tries): {exc}")) from exc
            pause = CROSSING_PAUSES_S[min(tries, len(CROSSING_PAUSES_S)) - 1]
            if on_retry is not None:
                on_retry(
                    redact(f"{dataset}: try {tries} of {CROSSING_TRIES} {said}) failed: {exc}; again in {pause:g} s")
                )
            if wait(pause):  # cancelled meanwhile
                raise GangError(f"input {dataset!r} did not cross {said}): cancelled after try {tries}") from exc
    record = {
        "from": src_site,
        "to": dst_site,
        "bytes": sum(c.bytes_moved for c in legs),
        "seconds": round(sum(c.seconds for c in legs), 3),
        "path": "object store" if exchange else "direct",
        "already": all(c.already for c in legs),
        "tries": tries,
    }
    if exchange:
        record["exchange"] = _shown(exchange)
    if legs[-1].replaced:  # what the consumer's site held
        record["replaced"] = legs[-1].replaced
    return record


def _cross(src: Store, dataset: str, dst: Store, run: str, replace: bool, verify: bool = True) -> Any:
    from ..store.crossing import cross

    return cross(src, dataset, dst, run=run, replace=replace, verify=verify)


def _through(
    middle: Store, dataset: str, src: Store, dst: Store, run: str, replace: bool, src_site: str, dst_site: str
) -> list[Any]:
    """Up to the exchange, then down.  The exchange's copy is trusted by its metadata on the way
    up (checking it would download it: the down leg checks what it reads); when the down leg
    cannot read it, it is checked and sent up again where it fails, then the down leg is
    tried once more."""
    up_replace = _may_replace(dataset, src, middle, src_site, "exchange")
    up = _cross(src, dataset, middle, run, up_replace, verify=False)
    try:
        down = _cross(middle, dataset, dst, run, replace)
    except StoreError:
        if not up.already:  # just sent and read back: the exchange's copy is not the trouble
            raise
        up = _cross(src, dataset, middle, run, up_replace, verify=True)
        down = _cross(middle, dataset, dst, run, replace)
    return [up, down]


def _may_replace(dataset: str, src: Store, dst: Store, src_site: str, dst_site: str) -> bool:
    """Whether a crossing may replace ``dst``'s dataset ``dataset`` (False when there is none):
    yes for a copy (it crossed from somewhere: a resume after the producer made a new version)
    and for what the same producing stage sealed there when it ran on that site; never for
    anything else ``dst``'s site made — ``CrossingRefused`` naming both sites."""
    existing = dst.meta.get(dst.session, dataset)
    if existing is None or existing.origin:
        return existing is not None
    producer = src.info(dataset).producer
    if producer and existing.producer == producer:
        return True
    made = f"stage {existing.producer!r}" if existing.producer else "a put"
    raise CrossingRefused(
        f"input {dataset!r} cannot cross from site {src_site!r} to site {dst_site!r}: the store of site "
        f"{dst_site!r} holds a dataset {dataset!r} of its own (made there by {made}, version {existing.version}, "
        f"session {dst.session!r}), which a crossing never replaces; remove it (phalanx store rm) or rename "
        "one of the two"
    )


def clear_exchange(exchange: str, session: str) -> int:
    """Remove ``session``'s datasets from the exchange ``exchange`` (they were in transit: every
    consumer holds its own copy); how many."""
    return Store(exchange, session).delete_session()


def crossing_message(dataset: str, record: dict[str, Any], scope: str = "in this run") -> str:
    """One line for an event or a task log: what crossed, where, how fast."""
    there, here = record["from"], record["to"]
    tries = record.get("tries", 1)
    after = f" after {tries} tries" if tries > 1 else ""
    if record["already"]:
        return f"{dataset}: already crossed from {there} to {here} {scope}, its copy checked{after}"
    moved, seconds = record["bytes"], record["seconds"]
    rate = moved / seconds / 1e6 if seconds > 0 else 0.0
    replaced = f"; {record['replaced']}" if record.get("replaced") else ""
    return (
        f"{dataset}: {there} → {here} ({record['path']}), {moved / 1e6:,.1f} MB in "
        f"{seconds:.2f} s ({rate:,.0f} MB/s), checksums verified{after}{replaced}"
    )
