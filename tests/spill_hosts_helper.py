"""Another host for tests/test_store_spill_hosts.py: a process that sees its own store root at
the path where the test process has its own (a bind mount in a private mount namespace, as the
multi-host bed gives each host its own /dev/shm), runs a store service there, and calls the
methods of its ``px.Store`` that the test sends it.

    unshare -m --propagation private sh -c 'mount --bind OWN ROOT && exec python THIS ROOT SPILL CATALOGUE BUDGET'

Messages on stdin/stdout: an 8-byte length, then a pickle; requests are (method, args,
kwargs) — method ``"attr"`` reads an attribute, ``"root_id"`` the root's identity — and
replies ("ok", result) or ("err", exception).  The first reply is ("ok", endpoint).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from typing import Any, BinaryIO


def send(out: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    out.write(struct.pack("!Q", len(data)) + data)
    out.flush()


def receive(inp: BinaryIO) -> Any:
    head = inp.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("!Q", head)
    return pickle.loads(inp.read(n))


def main() -> int:
    root, spill, catalogue, budget = sys.argv[1:5]
    import phalanx as px
    from phalanx.runtime.envvars import ENV_STORE_SERVICE_KEY
    from phalanx.store.remote import publish_endpoint
    from phalanx.store.service import StoreService

    out, inp = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # nothing else on the message channel
    svc = StoreService(root, "127.0.0.1", also=[spill])
    publish_endpoint(root, os.environ[ENV_STORE_SERVICE_KEY], svc.endpoint)
    store = px.Store(root, session="s", metadata=catalogue, memory_budget=int(budget), spill=spill)
    send(out, ("ok", svc.endpoint))
    try:
        while True:
            try:
                method, args, kwargs = receive(inp)
            except EOFError:
                return 0
            try:
                if method == "attr":
                    result = getattr(store, args[0])
                elif method == "root_id":
                    result = store.tier.root_id()
                else:
                    result = getattr(store, method)(*args, **kwargs)
                send(out, ("ok", result))
            except Exception as exc:  # handed to the test as it is
                try:
                    send(out, ("err", exc))
                except Exception:  # not picklable: its type and message
                    send(out, ("err", RuntimeError(f"{type(exc).__name__}: {exc}")))
    finally:
        svc.close()


if __name__ == "__main__":
    sys.exit(main())
