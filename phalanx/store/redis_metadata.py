"""Store metadata in Redis: ``redis://host:port/db?prefix=phalanx:store:``.

Keys, per session (a session name never contains ``/``, so the keys cannot collide):

- ``<prefix>datasets/<session>``  hash: dataset name → JSON (version, location, schema, partitions…)
- ``<prefix>accessed/<session>``  hash: dataset name → last access time (LRU spill order)
- ``<prefix>pinned/<session>``    hash: dataset name → 1 when pinned
- ``<prefix>sessions``            set of sessions that hold datasets

``seal`` and ``relocate`` are optimistic transactions (WATCH the session's dataset hash, check,
MULTI/EXEC, retry if another client changed it in between): a name exists unless replaced,
and a move only lands if the dataset is still the version and location it copied.  ``delete``,
``touch`` and ``set_pinned`` are small Lua scripts (atomic on the server).
"""

from __future__ import annotations

import base64
import json
import time
from urllib.parse import parse_qs, urlencode, urlparse

import pyarrow as pa
import redis

from .metadata import DatasetInfo, MetadataBackend, PartitionInfo

DEFAULT_PREFIX = "phalanx:store:"

_DELETE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[4], ARGV[2]) end
return old
"""

_SET_IF_EXISTS = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1])
else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return 1
"""


class RedisMetadata(MetadataBackend):
    def __init__(self, url: str):
        u = urlparse(url)
        query = parse_qs(u.query)
        self.prefix = query.pop("prefix", [DEFAULT_PREFIX])[-1]
        self.url = url
        clean = u._replace(query=urlencode({k: v[-1] for k, v in query.items()})).geturl()
        self.client = redis.Redis.from_url(clean)
        self._delete = self.client.register_script(_DELETE)
        self._set_if_exists = self.client.register_script(_SET_IF_EXISTS)

    def __repr__(self) -> str:
        return f"RedisMetadata({self.url})"

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
        return json.dumps({
            "version": info.version, "location": info.location,
            "schema": base64.b64encode(info.schema.serialize().to_pybytes()).decode(),
            "partitions": [[p.index, p.rows, p.bytes, p.checksum] for p in info.partitions],
            "partitioning": info.partitioning, "producer": info.producer, "run": info.run,
            "created": info.created,
        }).encode()

    @staticmethod
    def _decode(session: str, name: str, blob: bytes, accessed: bytes | None,
                pinned: bytes | None) -> DatasetInfo:
        d = json.loads(blob)
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["schema"])))
        return DatasetInfo(session, name, d["version"], d["location"], schema,
                           [PartitionInfo(*p) for p in d["partitions"]], d["partitioning"],
                           d["producer"], d["run"], d["created"], bool(pinned),
                           float(accessed) if accessed else d["created"])

    # ---- reading ---------------------------------------------------------------------------
    def get(self, session: str, name: str) -> DatasetInfo | None:
        pipe = self.client.pipeline(transaction=True)  # the three hashes as of one instant
        for key in self._keys(session):
            pipe.hget(key, name)
        blob, accessed, pinned = pipe.execute()
        return self._decode(session, name, blob, accessed, pinned) if blob else None

    def list(self, session: str) -> list[DatasetInfo]:
        pipe = self.client.pipeline(transaction=True)
        for key in self._keys(session):
            pipe.hgetall(key)
        blobs, accessed, pinned = pipe.execute()
        return [self._decode(session, n.decode(), blobs[n], accessed.get(n), pinned.get(n))
                for n in sorted(blobs)]

    def sessions(self) -> list[str]:
        return sorted(s.decode() for s in self.client.smembers(self._sessions_key))

    # ---- writing ---------------------------------------------------------------------------
    def seal(self, info: DatasetInfo, replace: bool) -> DatasetInfo | None:
        datasets, accessed, pinned = self._keys(info.session)
        blob = self._encode(info)
        now = repr(info.accessed or info.created or time.time())
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(datasets)  # a seal of any other name in the session retries us
                    cur = pipe.hget(datasets, info.name)
                    if cur is not None and not replace:
                        raise FileExistsError(info.name)
                    old = (self._decode(info.session, info.name, cur, pipe.hget(accessed, info.name),
                                        pipe.hget(pinned, info.name)) if cur is not None else None)
                    pipe.multi()
                    pipe.hset(datasets, info.name, blob)
                    pipe.hset(accessed, info.name, now)
                    if info.pinned:
                        pipe.hset(pinned, info.name, 1)
                    else:
                        pipe.hdel(pinned, info.name)
                    pipe.sadd(self._sessions_key, info.session)
                    pipe.execute()
                    return old
                except redis.WatchError:
                    continue

    def relocate(self, session: str, name: str, version: str, old_location: str,
                 new_location: str, unless_pinned: bool = False) -> bool:
        datasets, _, pinned = self._keys(session)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(datasets, pinned)
                    cur = pipe.hget(datasets, name)
                    if cur is None:
                        return False
                    d = json.loads(cur)
                    if d["version"] != version or d["location"] != old_location:
                        return False
                    if unless_pinned and pipe.hget(pinned, name):
                        return False
                    d["location"] = new_location
                    pipe.multi()
                    pipe.hset(datasets, name, json.dumps(d).encode())
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def delete(self, session: str, name: str) -> DatasetInfo | None:
        datasets, accessed, pinned = self._keys(session)
        old = self._delete(keys=[datasets, accessed, pinned, self._sessions_key], args=[name, session])
        return self._decode(session, name, old, None, None) if old else None

    def touch(self, session: str, name: str, when: float | None = None) -> None:
        datasets, accessed, _ = self._keys(session)
        self._set_if_exists(keys=[datasets, accessed],
                            args=[name, repr(time.time() if when is None else when)])

    def set_pinned(self, session: str, name: str, pinned: bool) -> bool:
        datasets, _, pinned_key = self._keys(session)
        return bool(self._set_if_exists(keys=[datasets, pinned_key], args=[name, "1" if pinned else ""]))
