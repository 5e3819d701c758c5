"""A real S3-compatible server (SeaweedFS, one ``weed server`` process) on loopback, for the
store's object-tier tests (marker ``s3``).

``tests/infra/seaweedfs-build.sh`` builds the pinned ``weed`` binary from the Go module proxy into
``~/.cache/phalanx-infra/bin`` (as the Kubernetes binaries are cached; CI's s3 lane runs it in
setup, 4-10 min cold, < 1 s when cached).  This module never builds unless asked (``ensure_binary``).

From tests::

    from infra import seaweedfs

    @pytest.fixture(scope="session")
    def seaweedfs_endpoint():
        weed = seaweedfs.find_binary()
        if weed is None:
            pytest.skip(seaweedfs.why_missing())
        server = seaweedfs.start(weed)        # free ports on 127.0.0.1, data in a temp dir
        try:
            server.create_bucket("phalanx-test")
            yield server                       # .endpoint, .env(), .object_size(bucket, key)
        finally:
            server.stop()                      # by PID; the temp dir is removed

By hand::

    .venv/bin/python tests/infra/seaweedfs.py build     # build (or reuse) the binary
    .venv/bin/python tests/infra/seaweedfs.py check     # where it is, or why it is not
    .venv/bin/python tests/infra/seaweedfs.py run       # start one, print its endpoint, stop on Ctrl-C

Every port (master, volume, filer, S3, and each one's gRPC port) is a free port of 127.0.0.1 and
every listener is bound to 127.0.0.1.  S3 credentials are random, written to a 0600 identities file
that ``weed`` reads (``-s3.config``): never on a command line (``ps`` shows command lines to every
user).  Only the standard library is used, except ``create_bucket`` (pyarrow).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BUILD = Path(__file__).resolve().parent / "seaweedfs-build.sh"
HOST = "127.0.0.1"


class SeaweedFSError(RuntimeError):
    pass


# ---- the binary -----------------------------------------------------------------------------------
def binary_path() -> Path:
    """Where the pinned binary is (or would be): ``$PHALANX_SEAWEEDFS_WEED``, else what
    seaweedfs-build.sh names (``$SEAWEEDFS_BIN_DIR/weed-<version>``)."""
    if os.environ.get("PHALANX_SEAWEEDFS_WEED"):
        return Path(os.environ["PHALANX_SEAWEEDFS_WEED"])
    r = subprocess.run(["bash", str(BUILD), "--path"], capture_output=True, text=True, timeout=30, check=True)
    return Path(r.stdout.strip())


def find_binary() -> Path | None:
    """The binary if it is there (cheap: never builds)."""
    p = binary_path()
    return p if p.is_file() and os.access(p, os.X_OK) else None


def why_missing() -> str:
    return (
        f"no SeaweedFS binary at {binary_path()}: build it with tests/infra/seaweedfs-build.sh "
        "(Go >= 1.26 and the Go module proxy, 4-10 min) or set PHALANX_SEAWEEDFS_WEED"
    )


def ensure_binary() -> Path:
    """Build the binary if it is missing (minutes), then return it."""
    if os.environ.get("PHALANX_SEAWEEDFS_WEED"):
        p = find_binary()
        if p is None:
            raise SeaweedFSError(why_missing())
        return p
    subprocess.run(["bash", str(BUILD)], check=True)
    p = find_binary()
    if p is None:
        raise SeaweedFSError(why_missing())
    return p


# ---- the server -----------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1 (held together while chosen, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


@dataclass
class SeaweedFS:
    """A running ``weed server``: master, volume, filer and S3 gateway in one process."""

    proc: subprocess.Popen
    workdir: Path
    ports: dict[str, int]
    access_key: str
    secret_key: str
    log: Path
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: the S3 endpoint."""
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def filer(self) -> str:
        return f"http://{HOST}:{self.ports['filer']}"

    def env(self) -> dict[str, str]:
        """The AWS variables a client of this server needs (credentials, region)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _ready(self) -> bool:
        """The S3 gateway answers HTTP (an unsigned request: 403 is an answer) and the filer does."""
        for url in (self.endpoint + "/", self.filer + "/"):
            try:
                with _NO_PROXY.open(url, timeout=2) as r:
                    r.read()
            except urllib.error.HTTPError:
                pass  # any HTTP status: the listener is up
            except OSError:
                return False
        return True

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise SeaweedFSError(
                    f"weed server exited with status {self.proc.returncode} before it answered; "
                    f"the tail of its log:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise SeaweedFSError(
                    f"weed server (pid {self.pid}) did not answer on {self.endpoint} within {timeout:.0f} s; "
                    f"the tail of its log:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def s3fs(self):
        """A ``pyarrow.fs.S3FileSystem`` on this server with its credentials."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=f"{HOST}:{self.ports['s3']}",
            scheme="http",
            region="us-east-1",
            access_key=self.access_key,
            secret_key=self.secret_key,
            allow_bucket_creation=True,
        )

    def create_bucket(self, name: str, timeout: float = 30) -> None:
        """Create a bucket, retrying while the gateway finds its filer and volume (seconds after start)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s3fs().create_dir(name)
                return
            except OSError as e:
                # a client error (a bad name) will not go away; anything else may, while it starts
                final = "HTTP status 4" in str(e) and "HTTP status 403" not in str(e)
                if final or time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SeaweedFSError(
                        f"bucket {name!r}: {e}; the tail of weed server's log:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.3)

    def object_size(self, bucket: str, key: str) -> int:
        """The stored size of an object as the filer has it (buckets are the filer's ``/buckets/``):
        what the server keeps, not what an S3 client says it sent."""
        url = f"{self.filer}/buckets/{bucket}/{urllib.parse.quote(key)}?metadata=true"
        with _NO_PROXY.open(urllib.request.Request(url, headers={"Accept": "application/json"}), timeout=10) as r:
            meta = json.loads(r.read())
        return int(meta["FileSize"])

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM the process this started (by PID), SIGKILL after 5 s (it takes longer than that to shut down, and its data is thrown away); remove the data dir."""
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            # its own process group (start_new_session): weed does not fork, but nothing can be left
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        # weed puts its gRPC unix sockets in /tmp whatever -dir says (server.go), named after our
        # ports; it removes them on SIGTERM, not when killed
        for name in ("master", "volume", "filer", "s3"):
            sock = Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports[name + '_grpc']}.sock")
            if sock.is_socket():
                sock.unlink(missing_ok=True)
        if not keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start(
    weed: Path | None = None,
    timeout: float = 60,
    workdir: Path | None = None,
    anonymous_buckets: tuple[str, ...] = (),
    volume_mb: int = 64,
) -> SeaweedFS:
    """Start ``weed server`` with an S3 gateway on free ports of 127.0.0.1, its data, identities file
    and log in a fresh temporary directory (below ``workdir`` if given); wait until it answers
    (``timeout`` s, else SeaweedFSError with its log tail, and nothing left running).

    Every request must be signed with the random credentials (``.env()``), except that unsigned
    requests may read, write and list the ``anonymous_buckets`` (create them with
    ``create_bucket``): an unsigned upload is the one this SeaweedFS stores with its
    ``aws-chunked`` framing unless the client sends plain bodies.  ``volume_mb``: the volume size
    limit (at most 16 volumes); 64 MB suits the tests, a bench of a GB needs more."""
    weed = weed or find_binary()
    if weed is None:
        raise SeaweedFSError(why_missing())
    wd = Path(tempfile.mkdtemp(prefix="phalanx-seaweedfs-", dir=workdir))
    try:
        data = wd / "data"
        data.mkdir()
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
        ports = dict(zip(names, _free_ports(len(names))))
        access_key, secret_key = "phx" + secrets.token_hex(8), secrets.token_hex(20)
        identities = {
            "identities": [
                {
                    "name": "phalanx-test",
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        if anonymous_buckets:
            actions = [f"{a}:{b}" for b in anonymous_buckets for a in ("Read", "List", "Write")]
            identities["identities"].append({"name": "anonymous", "actions": actions})
        config = wd / "s3-identities.json"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identities, f)
        log = wd / "weed.log"
        cmd = [
            str(weed),
            "server",
            f"-dir={data}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master_grpc']}",
            f"-master.volumeSizeLimitMB={volume_mb}",  # small volumes: a test writes kilobytes
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume_grpc']}",
            "-volume.max=16",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer_grpc']}",
            "-s3",
            f"-s3.port={ports['s3']}",
            f"-s3.port.grpc={ports['s3_grpc']}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",  # no Iceberg REST catalog, no Lance namespace server (fixed ports)
            "-s3.port.lance=0",
            f"-filer.localSocket={wd / 'filer.sock'}",  # not /tmp/seaweedfs-*-<port>.sock, left behind
            f"-s3.localSocket={wd / 's3.sock'}",
            "-master.telemetry=false",  # never reports to telemetry.seaweedfs.com
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=wd, start_new_session=True
            )
    except BaseException:
        shutil.rmtree(wd, ignore_errors=True)
        raise
    server = SeaweedFS(proc, wd, ports, access_key, secret_key, log)
    try:
        server.wait(timeout)
    except BaseException:
        server.stop()  # by PID; removes the directory (and the log: its tail is in the error)
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["build", "check", "run"])
    a = ap.parse_args(argv)
    if a.cmd == "build":
        print(ensure_binary())
        return 0
    if a.cmd == "check":
        p = find_binary()
        print(p if p else why_missing())
        return 0 if p else 1
    t = time.monotonic()
    server = start()
    try:
        print(f"SeaweedFS pid {server.pid}: S3 {server.endpoint}, filer {server.filer} ({time.monotonic() - t:.1f} s)")
        print(f"credentials: {server.workdir / 's3-identities.json'} (0600); Ctrl-C stops it")
        while server.proc.poll() is None:
            time.sleep(1)
        print(f"weed server exited ({server.proc.returncode}):\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
