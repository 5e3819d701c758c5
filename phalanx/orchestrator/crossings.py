"""How a dataset sealed on one site gets into another site's store: the one place that decides
the path (through an object store both sites name as their ``store.exchange``, else directly
from the producer's store), crosses it (``store.crossing.cross``: streamed, verified, resumable,
once) and says what happened.  Used by the scheduler (a workflow run's stages on several sites)
and by the Airflow stage operator (a task on one site reading an upstream task's output that
another site sealed)."""

from __future__ import annotations

from typing import Any

from ..errors import GangError
from ..redact import redact
from ..store import Store

__all__ = ["clear_exchange", "cross_dataset", "crossing_message", "shared_exchange"]


def shared_exchange(there: str | None, here: str | None) -> str | None:
    """The object store both sites name as their exchange (``here``'s URL: the consumer's own
    credentials reference), or None when they name none in common: the crossing is direct.  The
    URLs are compared with their credentials masked, so a producer's exchange known only
    redacted (an Airflow manifest) is recognized as the consumer's."""
    if there and here and redact(there) == redact(here):
        return here
    return None


def cross_dataset(
    dataset: str, src: Store, dst: Store, exchange: str | None, *, src_site: str, dst_site: str, run: str = ""
) -> dict[str, Any]:
    """Cross ``dataset`` of ``src`` (its session) into ``dst`` (its session): through
    ``exchange`` (two legs, up then down) when given, else directly.  Returns the record a run
    keeps: ``{"from", "to", "bytes", "seconds", "path", "already"}`` (``path``: "object store"
    or "direct"; ``already``: it had crossed before, nothing moved).  A failure raises
    ``GangError`` naming both sites and the path."""
    from ..store.crossing import cross

    via = "object store" if exchange else "direct"
    try:
        if exchange is None:
            legs = [cross(src, dataset, dst, run=run)]
        else:
            middle = Store(exchange, dst.session)
            legs = [cross(src, dataset, middle, run=run), cross(middle, dataset, dst, run=run)]
    except Exception as exc:
        raise GangError(
            f"input {dataset!r} could not cross from site {src_site!r} to site {dst_site!r} ({via}): {exc}"
        ) from exc
    return {
        "from": src_site,
        "to": dst_site,
        "bytes": sum(c.bytes_moved for c in legs),
        "seconds": round(sum(c.seconds for c in legs), 3),
        "path": via,
        "already": all(c.already for c in legs),
    }


def clear_exchange(exchange: str, session: str) -> int:
    """Remove ``session``'s datasets from the exchange ``exchange`` (they were in transit: every
    consumer holds its own copy); how many."""
    return Store(exchange, session).delete_session()


def crossing_message(dataset: str, record: dict[str, Any], scope: str = "in this run") -> str:
    """One line for an event or a task log: what crossed, where, how fast."""
    there, here = record["from"], record["to"]
    if record["already"]:
        return f"{dataset}: already crossed from {there} to {here} {scope}"
    moved, seconds = record["bytes"], record["seconds"]
    rate = moved / seconds / 1e6 if seconds > 0 else 0.0
    return (
        f"{dataset}: {there} → {here} ({record['path']}), {moved / 1e6:,.1f} MB in "
        f"{seconds:.2f} s ({rate:,.0f} MB/s), checksums verified"
    )
