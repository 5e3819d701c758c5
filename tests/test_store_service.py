"""phalanx.store.service on loopback: a partition's exact bytes over its HTTP bulk path and over
Arrow Flight, the token, the path checks, the errors and the bound address.  The same across real (namespace) hosts:
tests/multihost/test_store_service_multihost.py."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

import psutil
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from phalanx.errors import UnsafePathError
from phalanx.store import http_bytes
from phalanx.store.http_bytes import _byte_range
from phalanx.store.remote import local_endpoint
from phalanx.store.service import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    AuthRefusedError,
    LocationRefusedError,
    RemotePartitionNotFoundError,
    ServiceUnreachableError,
    StoreService,
    bytes_url,
    fetch,
    fetch_flight,
    fetch_hashed,
    fetch_table,
    ping,
    token_from_env,
    write_token_file,
)
from phalanx.store.tiers import FileTier, checksum_buffer, part_file

TOKEN = "s3cret-token-for-the-test"


def _table(rows: int = 20_000) -> pa.Table:
    return pa.table(
        {
            "key": pa.array([f"user-{i % 977:05d}" for i in range(rows)]),
            "n": pa.array(range(rows), pa.int64()),
            "x": pa.array([i * 0.5 for i in range(rows)], pa.float64()),
        }
    )


@pytest.fixture(scope="module", params=["bulk", "flight-only"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    tier = FileTier(root)
    location = tier.final("s", "ds", "v0-abc")
    table = _table()
    nbytes, checksum = tier.write_partition(location, 0, table)
    outside = tmp_path_factory.mktemp("outside")
    FileTier(outside).write_partition(str(outside / "d"), 0, table)
    os.symlink(outside / "d", root / "s" / "link")
    bytes_port = 0 if request.param == "bulk" else None
    with StoreService(root, "127.0.0.1", token=TOKEN, chunk=64 << 10, bytes_port=bytes_port) as svc:
        assert bytes_url(svc.endpoint, TOKEN) == svc.bytes_url and bool(svc.bytes_url) == (request.param == "bulk")
        yield svc, root, location, table, nbytes, checksum, outside


def test_fetch_returns_the_exact_bytes_and_checksum(served):
    svc, root, location, table, nbytes, checksum, _ = served
    buf = fetch(svc.endpoint, TOKEN, location, 0)
    with open(os.path.join(location, part_file(0)), "rb") as f:
        assert buf.to_pybytes() == f.read()
    assert buf.size == nbytes > 64 << 10  # several chunks
    assert checksum_buffer(buf) == checksum
    got = ipc.open_file(pa.BufferReader(buf)).read_all()
    assert got.equals(table)
    assert got.column("n").chunk(0).buffers()[1].address - buf.address < buf.size  # a view of buf
    assert fetch_table(svc.endpoint, TOKEN, location, 0).equals(table)
    # over 3 concurrent streams, each a byte range: the same bytes in one buffer
    assert fetch(svc.endpoint, TOKEN, location, 0, streams=3).to_pybytes() == buf.to_pybytes()
    assert fetch_flight(svc.endpoint, TOKEN, location, 0).to_pybytes() == buf.to_pybytes()
    # the digest hashed as the bytes arrive (or after, over Flight or several streams) is theirs
    for streams in (1, 3):
        got, digest = fetch_hashed(svc.endpoint, TOKEN, location, 0, streams=streams)
        assert got.to_pybytes() == buf.to_pybytes() and digest == checksum


def test_a_wrong_or_missing_token_is_refused_without_showing_it(served):
    svc, _, location, *_ = served
    for token in ("wrong", ""):
        with pytest.raises(AuthRefusedError) as err:
            fetch(svc.endpoint, token, location, 0)
        assert svc.endpoint in str(err.value) and location in str(err.value) and "partition 0" in str(err.value)
        assert TOKEN not in str(err.value)
    assert TOKEN not in repr(svc)


def test_a_location_outside_the_root_is_refused_naming_it(served):
    svc, root, _, _, _, _, outside = served
    for location in (str(outside / "d"), f"{root}/s/../../{outside.name}/d", str(root / "s" / "link")):
        with pytest.raises(LocationRefusedError) as err:
            fetch(svc.endpoint, TOKEN, location, 0)
        assert f"refusing to serve {location}" in str(err.value), err.value
    assert "symbolic link" in str(err.value)
    fifo = root / "s" / "fifo"  # a FIFO where a partition should be: refused, not waited on
    fifo.mkdir()
    os.mkfifo(fifo / part_file(0))
    with pytest.raises(LocationRefusedError, match="not a regular file"):
        fetch(svc.endpoint, TOKEN, str(fifo), 0, timeout=5)


def test_a_missing_partition_names_location_and_index(served):
    svc, root, location, *_ = served
    with pytest.raises(RemotePartitionNotFoundError) as err:
        fetch(svc.endpoint, TOKEN, location, 3)
    assert str(err.value) == (
        f"partition 3 at {location} from the store service {svc.endpoint}: no such partition there"
    )
    assert isinstance(err.value, FileNotFoundError)  # Store.partition's "moved meanwhile?" path catches it
    with pytest.raises(RemotePartitionNotFoundError):
        fetch(svc.endpoint, TOKEN, str(root / "s" / "nothing"), 0)


def test_the_server_is_bound_to_the_address_asked(served, tmp_path):
    svc, root, location, *_ = served
    assert svc.endpoint == f"grpc+tcp://127.0.0.1:{svc.port}"
    # gRPC listens on an IPv6 socket with the IPv4-mapped address: ::ffff:127.0.0.1, not :: or 0.0.0.0
    listening = {
        (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == svc.port
    }
    assert listening == {("127.0.0.1", svc.port)}
    with pytest.raises(ValueError, match="every interface"):
        StoreService(root, "0.0.0.0", token=TOKEN)
    # bound to 127.0.0.2 only: the same port on 127.0.0.1 answers nothing, fast
    with StoreService(root, "127.0.0.2", token=TOKEN) as other:
        assert len(fetch(other.endpoint, TOKEN, location, 0)) > 0
        t0 = time.monotonic()
        with pytest.raises(ServiceUnreachableError) as err:
            fetch(f"grpc+tcp://127.0.0.1:{other.port}", TOKEN, location, 0, timeout=5)
        assert time.monotonic() - t0 < 2
        assert f"127.0.0.1:{other.port}" in str(err.value) and location in str(err.value)


def test_the_token_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    monkeypatch.setenv("PHALANX_STATE", str(tmp_path / "state"))
    # nothing named: a per-user secret made in the state directory, 0600, the same next time
    made = token_from_env()
    default = tmp_path / "state" / "store.token"
    assert len(made) == 64 and default.read_text() == made and default.stat().st_mode & 0o777 == 0o600
    assert token_from_env() == made
    path = write_token_file(tmp_path / "secret", TOKEN)
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setenv(ENV_TOKEN_FILE, str(path))
    assert token_from_env() == TOKEN
    os.chmod(path, 0o644)
    with pytest.raises(UnsafePathError, match="chmod 600") as err:
        token_from_env()
    assert TOKEN not in str(err.value)
    monkeypatch.setenv(ENV_TOKEN, "from-env")
    assert token_from_env() == "from-env"


def test_a_service_that_hangs_fails_at_the_timeout_naming_the_endpoint():
    with socket.create_server(("127.0.0.1", 0)) as hung:  # accepts connections, never answers
        port = hung.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ServiceUnreachableError, match=f"store service grpc\\+tcp://127.0.0.1:{port}: "):
            fetch(f"grpc+tcp://127.0.0.1:{port}", TOKEN, "/x", 0, timeout=0.5)
        assert time.monotonic() - t0 < 2


def test_a_service_that_is_gone_fails_fast_naming_the_endpoint(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(
        ServiceUnreachableError, match=f"partition 1 at /x from the store service grpc\\+tcp://127.0.0.1:{port}"
    ):
        fetch(f"grpc+tcp://127.0.0.1:{port}", TOKEN, "/x", 1, timeout=5)
    assert time.monotonic() - t0 < 2


def test_a_service_publishes_its_endpoint_for_its_hosts_ranks_and_answers_pings(tmp_path, monkeypatch):
    root = tmp_path / "store"
    root.mkdir()
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.store.service", "--root", str(root), "--host", "127.0.0.1", "--key", "job-1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = proc.stdout.readline().strip()
        assert local_endpoint(root, "job-1") == endpoint
        assert (root / ".services" / "job-1.json").stat().st_mode & 0o777 == 0o600
        assert local_endpoint(root, "job-2") is None
        assert ping(endpoint, TOKEN) == socket.gethostname()
        with pytest.raises(AuthRefusedError):
            ping(endpoint, "wrong")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    assert local_endpoint(root, "job-1") is None  # removed on exit
    with pytest.raises(ServiceUnreachableError, match=re.escape(endpoint)):
        ping(endpoint, TOKEN, timeout=2)


# ---- the HTTP bulk path -----------------------------------------------------------------------
def _get(url: str, path: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
    split = urlsplit(url)
    conn = http.client.HTTPConnection(split.hostname, split.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def test_the_bulk_path_is_bound_like_flight_and_asks_for_the_same_token(tmp_path):
    tier = FileTier(tmp_path)
    location = tier.final("s", "ds", "v0")
    tier.write_partition(location, 0, _table(1000))
    with StoreService(tmp_path, "127.0.0.1", token=TOKEN) as svc:
        assert svc.bytes_url.startswith("http://127.0.0.1:")
        port = int(svc.bytes_url.rsplit(":", 1)[1])
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", port) in listening and ("0.0.0.0", port) not in listening
        path = f"/part?location={quote(location, safe='')}&index=0"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status, body, _ = _get(svc.bytes_url, path, headers)
            assert status == 401 and TOKEN.encode() not in body
        status, body, head = _get(svc.bytes_url, path, {"Authorization": f"Bearer {TOKEN}", "Range": "bytes=10-19"})
        whole = (Path(location) / part_file(0)).read_bytes()
        assert (status, body) == (206, whole[10:20]) and head["Content-Range"] == f"bytes 10-19/{len(whole)}"
        status, _, _ = _get(svc.bytes_url, "/etc/passwd", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 400
        status, body, _ = _get(svc.bytes_url, path, {"Authorization": f"Bearer {TOKEN}", "Range": "bytes=99999999-"})
        assert status == 416


def test_byte_ranges_are_read_as_the_http_standard_says():
    assert _byte_range(None, 100) == (0, 100)
    assert _byte_range("bytes=0-0", 100) == (0, 1)
    assert _byte_range("bytes=10-", 100) == (10, 100)
    assert _byte_range("bytes=90-200", 100) == (90, 100)  # a last byte past the end: up to the end
    assert _byte_range("bytes=0-5", 0) == (0, 0)  # an empty file
    for bad in ("bytes=100-", "bytes=5-4", "bytes=-5", "items=0-1", "bytes=a-b", "bytes=1-x"):
        assert _byte_range(bad, 100) is None, bad


@pytest.fixture
def bad_holder(monkeypatch):
    """A holder that announces 1,000,000 bytes, sends 10, then stops (``"hang"``) or closes
    (``"close"``) — as a host that dies mid-transfer does, seen from the reader."""
    monkeypatch.setattr(http_bytes, "STALL_TIMEOUT", 1.0)
    servers = []

    def start(mode: str) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def answer() -> None:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\nContent-Range: bytes 0-999999/1000000\r\n\r\n")
            conn.sendall(b"0123456789")
            if mode == "close":
                conn.close()
            else:
                servers.append(conn)

        threading.Thread(target=answer, daemon=True).start()
        return f"http://127.0.0.1:{server.getsockname()[1]}"

    yield start
    for s in servers:
        s.close()


def test_a_holder_that_stops_mid_file_fails_the_read_naming_it(bad_holder):
    url = bad_holder("hang")
    t0 = time.monotonic()
    with pytest.raises(ServiceUnreachableError, match=f"partition 2 at /x from the store service {url}: no data for"):
        http_bytes.get(url, TOKEN, "/x", 2, timeout=30)
    assert time.monotonic() - t0 < 5  # the stall timeout, not the fetch's 30 s
    url = bad_holder("close")
    with pytest.raises(ServiceUnreachableError, match="the service closed the connection after 10 of 1000000 bytes"):
        http_bytes.get(url, TOKEN, "/x", 2, timeout=30)


def test_a_service_restarted_on_the_same_port_is_asked_again_for_its_bulk_path(tmp_path):
    """A host's store service restarted on the port its predecessor had (ports are reused): the
    bulk path this process remembered for that endpoint is dead; the fetch asks the new
    service for its own and reads the partition (the multi-host lane met this as a refused
    connection to a service that answered pings)."""
    tier = FileTier(tmp_path)
    location = tier.final("s", "ds", "v0-abc")
    table = _table(1000)
    tier.write_partition(location, 0, table)
    with StoreService(tmp_path, "127.0.0.1", token=TOKEN) as first:
        port, endpoint, old_bulk = first.port, first.endpoint, first.bytes_url
        assert fetch(endpoint, TOKEN, location, 0).size > 0  # the bulk path is remembered now
    with StoreService(tmp_path, "127.0.0.1", port=port, token=TOKEN) as second:
        assert second.endpoint == endpoint and second.bytes_url != old_bulk
        got = ipc.open_file(pa.BufferReader(fetch(endpoint, TOKEN, location, 0))).read_all()
        assert got.equals(table)
        assert bytes_url(endpoint, TOKEN) == second.bytes_url
    with pytest.raises(ServiceUnreachableError, match=endpoint.split("//")[1]):  # gone for good: said as before
        fetch(endpoint, TOKEN, location, 0, timeout=5)


def test_a_reader_keeps_its_connection_and_replaces_one_the_service_closed(tmp_path):
    """Fetches reuse one kept HTTP/1.1 connection (its TCP window grown); one the service
    closed meanwhile (idle timeout, restart) is replaced without failing the fetch; a hash
    computed on arrival matches ``checksum_buffer`` of the bytes."""
    tier = FileTier(tmp_path)
    location = tier.final("s", "ds", "v0")
    _, checksum = tier.write_partition(location, 0, _table(5000))
    with StoreService(tmp_path, "127.0.0.1", token=TOKEN) as svc:
        server = svc._bytes._httpd
        for _ in range(3):
            buf, digest = fetch_hashed(svc.endpoint, TOKEN, location, 0)
            assert digest == checksum == checksum_buffer(buf)
            assert len(server.live) == 1  # the same connection served all three
        # headers and file are two sends: without TCP_NODELAY a small file waits ~40 ms for the
        # reader's delayed ACK on a kept connection
        assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in server.live)
        assert len(http_bytes._kept[(os.getpid(), svc.bytes_url)]) == 1
        server.end_connections()  # as an idle timeout on the service's side does
        assert checksum_buffer(fetch(svc.endpoint, TOKEN, location, 0)) == checksum
        assert len(server.live) == 1


def test_a_holder_frees_the_thread_of_a_reader_that_stops_reading(tmp_path, monkeypatch):
    """A reader that asks for a file and then reads nothing: the holder's blocking sendfile
    gives up after ``SERVE_TIMEOUT`` (``SO_SNDTIMEO``), closes the connection and frees its
    thread; the reader gets less than the file, then the end of the connection."""
    monkeypatch.setattr(http_bytes, "SERVE_TIMEOUT", 0.3)
    path = tmp_path / "big"
    size = 64 << 20  # far more than the socket buffers of both ends hold
    with open(path, "wb") as f:
        f.truncate(size)
    server = http_bytes.BytesServer("127.0.0.1", TOKEN, lambda location, index: os.open(path, os.O_RDONLY))
    try:
        reader = socket.create_connection(("127.0.0.1", server.port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        reader.sendall(f"GET /part?location=x&index=0 HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        t0 = time.monotonic()
        while not server._httpd.live and time.monotonic() - t0 < 5:
            time.sleep(0.01)  # polls for the holder to take the request (a condition, not a sleep to pass)
        t0 = time.monotonic()
        while server._httpd.live and time.monotonic() - t0 < 20:
            time.sleep(0.05)  # polls for the holder to give up
        assert not server._httpd.live and 0.25 < time.monotonic() - t0 < 10
        got = 0
        reader.settimeout(10)
        while chunk := reader.recv(1 << 20):
            got += len(chunk)
        assert 0 < got < size
    finally:
        reader.close()
        server.close()
