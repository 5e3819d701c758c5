"""The Redis rendezvous' keys (``redis://host:port/db?prefix=…``), without torch: the client
and the gang's key prefix, and removing a gang's keys after it ended."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

from ..extras import require

if TYPE_CHECKING:
    import redis


def client_and_prefix(url: str) -> tuple[redis.Redis[bytes], str]:
    """A redis-py client for ``url`` (its ``prefix`` query removed) and the gang's key prefix."""
    redis = require("redis", "redis", "rendezvous redis://")
    u = urlparse(url)
    prefix = parse_qs(u.query).get("prefix", ["phalanx:"])[0]
    clean = u._replace(query="").geturl()
    return redis.Redis.from_url(clean), prefix


def delete_prefix(url: str) -> None:
    client, prefix = client_and_prefix(url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
