"""A ``torch.distributed.Store`` kept in Redis, for sites that run one (rendezvous ``redis://``).

Gloo calls these methods from its own C++ threads; redis-py is thread-safe through its
connection pool.  ``get`` and ``wait`` block (polling) until the key exists or the timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import cast

import redis
import torch.distributed as dist

from ..redact import redact
from .redis_keys import client_and_prefix

_POLL_S = 0.002


def _bytes(value: str | bytes) -> bytes:
    """A value as Redis stores it: Gloo hands bytes, a Python caller may hand str."""
    return value.encode() if isinstance(value, str) else bytes(value)


class RedisStore(dist.Store):
    def __init__(self, url: str, timeout_s: float = 300.0):
        super().__init__()
        self.url = url
        self.client, self.prefix = client_and_prefix(url)
        self._timeout_s = timeout_s
        try:  # fail here, naming the URL (without its password), rather than inside Gloo
            self.client.ping()
        except redis.RedisError as exc:
            raise ConnectionError(f"rendezvous {redact(url)}: {exc}") from exc

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self.client.set(self._k(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.client.get(self._k(key))
        if value is None:  # deleted between the wait and the read
            raise KeyError(f"rendezvous {redact(self.url)}: key {key!r} was deleted while it was read")
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self.client.incrby(self._k(key), amount))

    def check(self, keys: list[str]) -> bool:
        return self.client.exists(*[self._k(k) for k in keys]) == len(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self._timeout_s
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous {redact(self.url)}: keys {keys} not set after {limit:.0f}s")
            time.sleep(_POLL_S)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        script = (
            "local v = redis.call('GET', KEYS[1]) "
            "if (v == false and ARGV[1] == '') or v == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2]) return ARGV[2] end "
            "if v == false then return ARGV[1] end return v"
        )
        # the script returns a string: bytes, the client not decoding responses
        reply = self.client.eval(script, 1, self._k(key), _bytes(expected), _bytes(desired))  # type: ignore[no-untyped-call]  # types-redis leaves eval unannotated
        return cast(bytes, reply)

    def delete_key(self, key: str) -> bool:
        return bool(self.client.delete(self._k(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.prefix + "*"))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
