"""Store metadata in Redis: ``redis://host:port/db?prefix=phalanx:store:``.

Keys, per session (a session name never contains ``/``, so the keys cannot collide):

- ``<prefix>datasets/<session>``  hash: dataset name → JSON (version, location, schema, partitions…)
- ``<prefix>accessed/<session>``  hash: dataset name → last access time (LRU spill order)
- ``<prefix>pinned/<session>``    hash: dataset name → 1 when pinned
- ``<prefix>sessions``            set of sessions that hold datasets
- ``<prefix>catalogue``           hash: ``id`` (random, set once) and ``writes`` (a counter of
  seals, moves and deletes)

Every connection (and reconnection) checks the catalogue against what this process saw
before: a Redis that came back empty (restarted without persistence, flushed) has another
``id``, one restored from an older snapshot has fewer ``writes``.  Either way the datasets this
process knows of are not what Redis holds, so every call fails (``StoreError`` naming the
URL) instead of reading or sealing against a different catalogue.  ``pinned_url()`` carries
the ``id`` to the ranks of a gang, so a rank started after the loss refuses it too.

``seal``, ``relocate`` and ``relocate_partitions`` are optimistic transactions (WATCH the session's dataset hash, check,
MULTI/EXEC, retry if another client changed it in between): a name exists unless replaced,
and a move only lands if the dataset is still the version and location(s) it copied.  ``delete``,
``touch`` and ``set_pinned`` are small Lua scripts (atomic on the server).
"""

from __future__ import annotations

import base64
import builtins
import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlparse

import pyarrow as pa
import redis

from ..errors import StoreError
from ..redact import redact
from .metadata import DatasetInfo, MetadataBackend, PartitionInfo, moved_places

DEFAULT_PREFIX = "phalanx:store:"

_DELETE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[4], ARGV[2]) end
return {old, redis.call('HINCRBY', KEYS[5], 'writes', 1)}
"""

_SET_IF_EXISTS = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1])
else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return 1
"""


class CatalogueLost(redis.RedisError):
    """Redis no longer holds the catalogue this process saw (emptied or rolled back)."""


F = TypeVar("F", bound=Callable[..., Any])


def _now(reply: Any) -> bytes | None:
    """A read on a watched pipeline before ``multi()``: redis-py runs it at once and returns the
    value, though its types say the pipeline."""
    value: bytes | None = reply
    return value


def _named(method: F) -> F:
    """Redis errors (unreachable, catalogue lost) become a StoreError naming the URL."""

    @functools.wraps(method)
    def call(self: RedisMetadata, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CatalogueLost as exc:
            raise StoreError(f"store metadata {self.where}: {exc}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreError(f"store metadata {self.where} is unreachable: {exc}") from None
        except redis.RedisError as exc:
            raise StoreError(f"store metadata {self.where}: {type(exc).__name__}: {exc}") from exc

    return call  # type: ignore[return-value]


class RedisMetadata(MetadataBackend):
    def __init__(self, url: str):
        u = urlparse(url)
        query = {k: v[-1] for k, v in parse_qs(u.query).items()}
        self.prefix = query.pop("prefix", DEFAULT_PREFIX)
        self._catalogue: str | None = query.pop("catalogue", None)  # the id a gang's driver saw
        self._writes = 0  # the highest write count this process has seen
        self.url = url if self._catalogue is None else _without(url, "catalogue")
        self.where = redact(self.url)
        query.setdefault("socket_connect_timeout", "5")  # an unreachable host fails in seconds
        clean = u._replace(query=urlencode(query)).geturl()
        self.client = redis.Redis.from_url(clean, redis_connect_func=self._on_connect)
        self._delete = self.client.register_script(_DELETE)
        self._set_if_exists = self.client.register_script(_SET_IF_EXISTS)

    def __repr__(self) -> str:
        return f"RedisMetadata({self.where})"

    def pinned_url(self) -> str:
        """``url`` naming this catalogue's id too (learnt now if need be): what a gang's ranks
        get, so that a rank started after Redis lost the catalogue refuses it."""
        if self._catalogue is None:
            try:
                self.client.ping()
            except redis.RedisError:  # unreachable: the ranks will say so themselves
                return self.url
        sep = "&" if urlparse(self.url).query else "?"
        return f"{self.url}{sep}catalogue={self._catalogue}"

    # ---- the catalogue's identity, checked on every (re)connection ------------------------------
    @property
    def _catalogue_key(self) -> str:
        return f"{self.prefix}catalogue"

    def _on_connect(self, conn: redis.connection.AbstractConnection) -> None:
        conn.on_connect()
        floor = self._writes  # seen before this connection's first command: it must see as many
        if self._catalogue is None:
            conn.send_command("HSETNX", self._catalogue_key, "id", uuid.uuid4().hex[:16])
            conn.read_response()
        conn.send_command("HMGET", self._catalogue_key, "id", "writes")
        ident, writes = conn.read_response()
        ident = ident.decode() if ident else None
        if self._catalogue is None:
            self._catalogue = ident
        elif ident != self._catalogue:
            raise CatalogueLost(
                f"the catalogue this store was opened with (id {self._catalogue}) is gone: Redis came back "
                "empty (restarted without persistence, or flushed), so every dataset sealed in it "
                "is lost to phalanx. Run Redis with persistence (appendonly yes) and resume the run "
                "from a new process: stages whose outputs are gone run again"
            )
        if int(writes or 0) < floor:
            raise CatalogueLost(
                f"the catalogue went back in time: it has {int(writes or 0)} writes, this process "
                f"saw {floor} (Redis restarted from an older snapshot): datasets sealed, replaced "
                "or deleted since may be wrong in it. Resume the run from a new process"
            )
        self._observe(writes)

    def _observe(self, writes: bytes | int | None) -> None:
        self._writes = max(self._writes, int(writes or 0))

    def close(self) -> None:
        self.client.close()

    # ---- keys and encoding -----------------------------------------------------------------
    def _keys(self, session: str) -> tuple[str, str, str]:
        p = self.prefix
        return f"{p}datasets/{session}", f"{p}accessed/{session}", f"{p}pinned/{session}"

    @property
    def _sessions_key(self) -> str:
        return f"{self.prefix}sessions"

    @staticmethod
    def _encode(info: DatasetInfo) -> bytes:
        return json.dumps(
            {
                "version": info.version,
                "location": info.location,
                "schema": base64.b64encode(info.schema.serialize().to_pybytes()).decode(),
                "partitions": [
                    [p.index, p.rows, p.bytes, p.checksum, *([p.place] if p.place else [])] for p in info.partitions
                ],
                "partitioning": info.partitioning,
                "producer": info.producer,
                "run": info.run,
                "created": info.created,
                **({"origin": info.origin} if info.origin else {}),  # a crossed dataset's (absent before)
            }
        ).encode()

    @staticmethod
    def _decode(session: str, name: str, blob: bytes, accessed: bytes | None, pinned: bytes | None) -> DatasetInfo:
        d = json.loads(blob)
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["schema"])))
        return DatasetInfo(
            session,
            name,
            d["version"],
            d["location"],
            schema,
            [PartitionInfo.of(*p) for p in d["partitions"]],
            d["partitioning"],
            d["producer"],
            d["run"],
            d["created"],
            bool(pinned),
            float(accessed) if accessed else d["created"],
            d.get("origin") or {},
        )

    # ---- reading ---------------------------------------------------------------------------
    def _snapshot(self, session: str, command: str, *args: str) -> list[Any]:
        """``command`` (hget, hgetall) on the session's three hashes as of one instant; the
        write count comes along."""
        pipe = self.client.pipeline(transaction=True)
        for key in self._keys(session):
            getattr(pipe, command)(key, *args)
        pipe.hget(self._catalogue_key, "writes")
        *found, writes = pipe.execute()
        self._observe(writes)
        return found

    @_named
    def get(self, session: str, name: str) -> DatasetInfo | None:
        blob, accessed, pinned = self._snapshot(session, "hget", name)
        return self._decode(session, name, blob, accessed, pinned) if blob else None

    @_named
    def list(self, session: str) -> list[DatasetInfo]:
        blobs, accessed, pinned = self._snapshot(session, "hgetall")
        return [self._decode(session, n.decode(), blobs[n], accessed.get(n), pinned.get(n)) for n in sorted(blobs)]

    @_named
    def sessions(self) -> builtins.list[str]:
        return sorted(s.decode() for s in self.client.smembers(self._sessions_key))

    # ---- writing ---------------------------------------------------------------------------
    @_named
    def seal(self, info: DatasetInfo, replace: bool) -> DatasetInfo | None:
        datasets, accessed, pinned = self._keys(info.session)
        blob = self._encode(info)
        now = repr(info.accessed or info.created or time.time())
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(datasets)  # a seal of any other name in the session retries us
                    cur = _now(pipe.hget(datasets, info.name))
                    if cur is not None and not replace:
                        raise FileExistsError(info.name)
                    old = (
                        self._decode(
                            info.session,
                            info.name,
                            cur,
                            _now(pipe.hget(accessed, info.name)),
                            _now(pipe.hget(pinned, info.name)),
                        )
                        if cur is not None
                        else None
                    )
                    pipe.multi()
                    pipe.hset(datasets, info.name, blob)
                    pipe.hset(accessed, info.name, now)
                    if info.pinned:
                        pipe.hset(pinned, info.name, 1)
                    else:
                        pipe.hdel(pinned, info.name)
                    pipe.sadd(self._sessions_key, info.session)
                    pipe.hincrby(self._catalogue_key, "writes", 1)
                    self._observe(pipe.execute()[-1])
                    return old
                except redis.WatchError:
                    continue

    @_named
    def relocate(
        self, session: str, name: str, version: str, old_location: str, new_location: str, unless_pinned: bool = False
    ) -> bool:
        def change(d: dict[str, Any], cur: bytes) -> bool:
            if d["version"] != version or d["location"] != old_location:
                return False
            d["location"] = new_location
            return True

        return self._change(session, name, change, unless_pinned)

    @_named
    def relocate_partitions(
        self, session: str, name: str, version: str, moves: dict[int, tuple[str, str]], unless_pinned: bool = False
    ) -> bool:
        def change(d: dict[str, Any], cur: bytes) -> bool:
            places = moved_places(self._decode(session, name, cur, None, None), moves)
            if d["version"] != version or places is None:
                return False
            for i, place in places.items():
                d["partitions"][i] = d["partitions"][i][:4] + ([place] if place else [])
            return True

        return self._change(session, name, change, unless_pinned)

    def _change(
        self, session: str, name: str, change: Callable[[dict[str, Any], bytes], bool], unless_pinned: bool
    ) -> bool:
        """Change the dataset's JSON in place (``change(d, blob)``: False to give up) in one
        optimistic transaction — and, with ``unless_pinned``, only if it is not pinned."""
        datasets, _, pinned = self._keys(session)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(datasets, pinned)
                    cur = _now(pipe.hget(datasets, name))
                    if cur is None:
                        return False
                    d = json.loads(cur)
                    if (unless_pinned and pipe.hget(pinned, name)) or not change(d, cur):
                        return False
                    pipe.multi()
                    pipe.hset(datasets, name, json.dumps(d).encode())
                    pipe.hincrby(self._catalogue_key, "writes", 1)
                    self._observe(pipe.execute()[-1])
                    return True
                except redis.WatchError:
                    continue

    @_named
    def delete(self, session: str, name: str) -> DatasetInfo | None:
        datasets, accessed, pinned = self._keys(session)
        found = self._delete(
            keys=[datasets, accessed, pinned, self._sessions_key, self._catalogue_key], args=[name, session]
        )
        if not found:
            return None
        old, writes = found
        self._observe(writes)
        return self._decode(session, name, old, None, None)

    @_named
    def touch(self, session: str, name: str, when: float | None = None) -> None:
        datasets, accessed, _ = self._keys(session)
        self._set_if_exists(keys=[datasets, accessed], args=[name, repr(time.time() if when is None else when)])

    @_named
    def set_pinned(self, session: str, name: str, pinned: bool) -> bool:
        datasets, _, pinned_key = self._keys(session)
        return bool(self._set_if_exists(keys=[datasets, pinned_key], args=[name, "1" if pinned else ""]))


def _without(url: str, key: str) -> str:
    """``url`` without the query parameter ``key`` (the others kept as written)."""
    u = urlparse(url)
    kept = [p for p in u.query.split("&") if p and p.split("=", 1)[0] != key]
    return u._replace(query="&".join(kept)).geturl()
