"""A partition fetched from another host: raw TCP vs Arrow Flight (vs Vineyard), same run.

Two hosts of the multi-host test bed (docs/multihost.md: network namespaces with their own
/dev/shm on a private bridge).  The holder host writes user-shaped partitions (the ETL
example's transactions plus a string key; phalanx/examples/synthetic.py) into a file tier on
its own /dev/shm; the reader host fetches each one, interleaved, several times:

  tcp           a plain socket: the holder sendall()s the memory-mapped file, the reader
                recv_into()s a fresh buffer (a user-space read of every page on the holder)
  tcp-sendfile  the same socket, the holder os.sendfile()s the file from its descriptor (the
                syscall the service's bulk path uses: the kernel sends the page-cache pages),
                the reader recv_into()s a fresh buffer: the tighter reference, what a
                sendfile-and-receive path can do with no protocol around it
  fetch         phalanx.store.service.fetch, what a reader on another host runs: the file's
                exact bytes, one buffer, over the service's HTTP/1.1 bulk path (the holder
                sendfile()s, the reader readinto()s; store/http_bytes.py)
  ... x2        the same over 2 concurrent connections, each a byte range (fetch(streams=2))
  fetch+verify  what Store.partition does with another host's partition: service.fetch_hashed
                (the bytes hashed piece by piece as they land, while in cache), the digest
                compared with the metadata's, the zero-copy IPC open
  fetch+rehash  the same, but fetch, then tiers.checksum_buffer over the whole buffer (a second
                pass, from memory: how a fetched partition was checked before)
  flight-bytes  service.fetch_flight: the same bytes as Flight record batches of one binary
                value each (the path before the bulk path; x2: two streams)
  flight-table  phalanx.store.service.fetch_table: do_get of the IPC record batches
  vineyard-rpc      (--vineyard) vineyardd on both hosts, metadata in etcd on px-head; the
                    reader's RPC client of the holder's vineyardd gets the table
  vineyard-migrate  the reader's own vineyardd migrates the object, its IPC client maps it
                    (Vineyard 0.24's Python cannot read back a timestamp column: its tables
                    have ``ts`` as int64; strings come back as large_string)

    .venv/bin/python bench/store_remote.py                   # px-h1 -> px-h2, brings the bed up
    .venv/bin/python bench/store_remote.py --hosts px-h1,px-h3 --sizes 64,256 --reps 7
    .venv/bin/python bench/store_remote.py --sizes 64,256,1024 --reps 11 --malloc default \
        --methods tcp-sendfile,fetch,fetch+verify,fetch+rehash

Prints MB/s (median and best of the repetitions; MB = 1e6 bytes) and each method's median
paired ratio to both raw references (``vs tcp``, ``vs sendfile``), with the load average
before and after (2-core machine, shared).
Needs root (the bed).  Results: docs/store.md, "Across hosts".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

CHUNK_KIB = 4096
CPU_REQUEST = 0xFFFFFFFF  # on the tcp connection: "send your CPU seconds"
SENDFILE_BIT = 0x80000000  # on the tcp connection: "send file i with os.sendfile" (i | this bit)
REFERENCES = ("tcp", "tcp-sendfile")  # the raw references every method is compared with
# glibc returns each large free()d block to the kernel (mmap threshold), so every gRPC receive
# buffer is a fresh mapping: a page fault and a cleared page per 4 KiB.  Keeping them:
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


# ---- data -------------------------------------------------------------------------------------
def user_table(nbytes: int, seed: int = 0):
    """About ``nbytes`` of transactions (string keys and categories, int, float, timestamp,
    bool columns) as the ETL example makes them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from phalanx.examples.synthetic import make_transactions

    def make(rows: int) -> pa.Table:
        tx = make_transactions(rows, max(1, rows // 20), seed, 0, 1)
        key = pc.binary_join_element_wise("user-", pc.cast(tx["user_id"], pa.string()), "")
        return tx.add_column(0, "user_key", key)

    sample = make(20_000)
    rows = max(1, int(nbytes / (sample.nbytes / sample.num_rows)))
    return make(rows)


# ---- holder host ------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from phalanx.store.service import StoreService
    from phalanx.store.tiers import FileTier, part_file

    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-remote-", dir="/dev/shm"))
    tier = FileTier(root)
    parts = []
    for mb in args.sizes:
        location = tier.final("bench", f"p{mb}", "v0")
        nbytes, checksum = tier.write_partition(location, 0, user_table(int(mb * 1e6)))
        parts.append({"mb": mb, "location": location, "nbytes": nbytes, "checksum": checksum})
    files = [tier.read_buffer(p["location"], 0) for p in parts]  # the mapped files tcp sends
    fds = [os.open(Path(p["location"]) / part_file(0), os.O_RDONLY | os.O_CLOEXEC) for p in parts]  # tcp-sendfile's

    lsock = socket.create_server((args.addr, 0))
    threading.Thread(target=_tcp_server, args=(lsock, files, fds), daemon=True).start()
    svc = StoreService(root, args.addr, chunk=args.chunk << 10)  # token: PHALANX_STORE_TOKEN_FILE
    print(
        json.dumps({"endpoint": svc.endpoint, "tcp": [args.addr, lsock.getsockname()[1]], "parts": parts}), flush=True
    )
    sys.stdin.read()  # until the driver closes our stdin
    svc.close()
    for fd in fds:
        os.close(fd)
    shutil.rmtree(root, ignore_errors=True)
    del pa
    return 0


def _tcp_server(lsock: socket.socket, files: list, fds: list[int]) -> None:
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_tcp_conn, args=(conn, files, fds), daemon=True).start()


def _tcp_conn(conn: socket.socket, files: list, fds: list[int]) -> None:
    with conn:
        while True:
            req = conn.recv(4)
            if len(req) < 4:
                return
            i = struct.unpack("!I", req)[0]
            if i == CPU_REQUEST:  # the holder process's CPU seconds so far (all its threads)
                ru = resource.getrusage(resource.RUSAGE_SELF)
                conn.sendall(struct.pack("!d", ru.ru_utime + ru.ru_stime))
                continue
            if i & SENDFILE_BIT:  # the kernel sends the file's pages: nothing in Python reads them
                fd = fds[i & ~SENDFILE_BIT]
                size = os.fstat(fd).st_size
                conn.sendall(struct.pack("!Q", size))
                sent = 0
                while sent < size:
                    n = os.sendfile(conn.fileno(), fd, sent, size - sent)
                    if n == 0:
                        raise ConnectionError("sendfile sent nothing: the file shrank?")
                    sent += n
                continue
            buf = files[i]
            conn.sendall(struct.pack("!Q", buf.size))
            conn.sendall(memoryview(buf))


# ---- reader host ------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError("tcp sender went away")
        view = view[n:]


def read(args: argparse.Namespace) -> int:
    import random

    import pyarrow as pa
    import pyarrow.ipc as ipc

    from phalanx.store.service import fetch, fetch_flight, fetch_hashed, fetch_table, token_from_env
    from phalanx.store.tiers import checksum_buffer

    info = json.loads(Path(args.info).read_text())
    token = token_from_env()
    sock = socket.create_connection(tuple(info["tcp"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp(i: int) -> object:
        return _tcp_get(i)

    def tcp_sendfile(i: int) -> object:
        return _tcp_get(i | SENDFILE_BIT)

    def _tcp_get(i: int) -> object:
        sock.sendall(struct.pack("!I", i))
        head = bytearray(8)
        _recv_exact(sock, memoryview(head))
        out = pa.allocate_buffer(struct.unpack("!Q", head)[0])
        _recv_exact(sock, memoryview(out))
        return out

    def part(i: int) -> tuple[str, str, str, int]:
        return info["endpoint"], token, info["parts"][i]["location"], 0

    def hbytes(i: int) -> object:
        return fetch(*part(i))

    def hbytes2(i: int) -> object:
        return fetch(*part(i), streams=2)

    def hverify(i: int) -> object:
        buf, digest = fetch_hashed(*part(i))
        if digest != info["parts"][i]["checksum"]:
            raise AssertionError("checksum mismatch")
        return ipc.open_file(pa.BufferReader(buf)).read_all()

    def hrehash(i: int) -> object:
        buf = hbytes(i)
        if checksum_buffer(buf) != info["parts"][i]["checksum"]:
            raise AssertionError("checksum mismatch")
        return ipc.open_file(pa.BufferReader(buf)).read_all()

    def fbytes(i: int) -> object:
        return fetch_flight(*part(i))

    def fbytes2(i: int) -> object:
        return fetch_flight(*part(i), streams=2)

    def ftable(i: int) -> object:
        return fetch_table(*part(i))

    run = {
        "tcp": tcp,
        "tcp-sendfile": tcp_sendfile,
        "fetch": hbytes,
        "fetch x2": hbytes2,
        "fetch+verify": hverify,
        "fetch+rehash": hrehash,
        "flight-bytes": fbytes,
        "flight-bytes x2": fbytes2,
        "flight-table": ftable,
    }
    if info.get("vineyard"):
        run.update(_vineyard_readers(info["vineyard"]))
    if args.methods:
        run = {m: f for m, f in run.items() if m in args.methods.split(",") or m in REFERENCES}
    # once each, checked: the same bytes / rows everywhere
    for i, p in enumerate(info["parts"]):
        for method in (tcp, tcp_sendfile, hbytes, hbytes2, fbytes, fbytes2):
            assert checksum_buffer(method(i)) == p["checksum"], method.__name__
        rows = hverify(i).num_rows
        assert hrehash(i).num_rows == rows
        if "flight-table" in run:
            assert ftable(i).num_rows == rows
        for m in ("vineyard-rpc", "vineyard-migrate"):
            if m in run:
                assert run[m](i).num_rows == rows

    def holder_cpu() -> float:
        sock.sendall(struct.pack("!I", CPU_REQUEST))
        out = bytearray(8)
        _recv_exact(sock, memoryview(out))
        cpu: float = struct.unpack("!d", out)[0]
        return cpu

    def my_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process (gRPC's too)
        return ru.ru_utime + ru.ru_stime

    # per method and size, one row per repetition: [MB/s, reader CPU s/GB, holder CPU s/GB]
    results: dict[str, dict[str, list[list[float]]]] = {m: {str(p["mb"]): [] for p in info["parts"]} for m in run}
    rng = random.Random(0)
    for _ in range(args.reps):
        for i, p in enumerate(info["parts"]):
            inner = max(1, min(16, int(64 / p["mb"])))  # small partitions: several per timing
            methods = list(run)
            rng.shuffle(methods)  # interleaved, in a new order each time
            for m in methods:
                c0, h0, t0 = my_cpu(), holder_cpu(), time.perf_counter()
                for _ in range(inner):
                    run[m](i)
                dt = time.perf_counter() - t0
                gb = inner * p["nbytes"] / 1e9
                results[m][str(p["mb"])].append([gb * 1e3 / dt, (my_cpu() - c0) / gb, (holder_cpu() - h0) / gb])
    print(json.dumps(results), flush=True)
    return 0


# ---- Vineyard (optional) ----------------------------------------------------------------------
def _vineyard_readers(vy: dict) -> dict:
    """vineyard-rpc: an RPC client of the holder's vineyardd gets the table over the network;
    vineyard-migrate: the reader host's own vineyardd migrates the object from the holder's
    (metadata in etcd), the local IPC client maps it, the local copy is dropped again."""
    import vineyard

    rpc = vineyard.connect(host=vy["host"], port=vy["port"])
    ipc_client = vineyard.connect(vy["socket"])
    ids = [vineyard.ObjectID(o) for o in vy["objects"]]

    def migrate(i: int):
        local = ipc_client.migrate(ids[i])
        table = ipc_client.get(local)
        if local != ids[i]:
            ipc_client.delete(local)
        return table

    return {"vineyard-rpc": lambda i: rpc.get(ids[i]), "vineyard-migrate": migrate}


# ---- driver -----------------------------------------------------------------------------------
def _hosts(spec: str) -> tuple[dict, dict, bool]:
    """The holder and reader hosts, and whether the bed was up before (else we bring it up)."""
    from infra import multihost

    was_up = multihost.healthy()
    if not was_up:
        multihost.up(3)
    byname = {h["name"]: h for h in multihost.hosts()}
    a, b = spec.split(",")
    return byname[a], byname[b], was_up


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="px-h1,px-h2", help="holder,reader (test-bed host names)")
    p.add_argument("--sizes", default="1,16,64,256", help="partition sizes in MB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vineyard", action="store_true", help="also Vineyard (vineyardd on both hosts, etcd on px-head)")
    p.add_argument("--chunk", type=int, default=CHUNK_KIB, help="KiB per Flight message of a bytes fetch")
    p.add_argument(
        "--malloc",
        default="both",
        choices=["default", "tuned", "both"],
        help="the reader's glibc malloc: as it comes, tuned (large frees kept: MALLOC_MMAP_THRESHOLD_), or both runs",
    )
    p.add_argument("--methods", help="only these rows (comma-separated; tcp and tcp-sendfile always run)")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--keep-bed", action="store_true", help="leave a bed this run brought up")
    p.add_argument("--role", choices=["serve", "read"], help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--info", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [float(s) if "." in s else int(s) for s in str(args.sizes).split(",")]
    if args.role == "serve":
        return serve(args)
    if args.role == "read":
        return read(args)

    from infra import multihost

    from phalanx.store.service import ENV_TOKEN_FILE, write_token_file

    holder, reader, was_up = _hosts(args.hosts)
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-remote-", dir="/var/tmp"))  # every host sees it
    env = {**os.environ, ENV_TOKEN_FILE: str(write_token_file(work / "token", secrets.token_urlsafe(32)))}
    me = [sys.executable, str(Path(__file__).resolve())]
    sizes = ",".join(map(str, args.sizes))
    print(
        f"# {holder['name']} ({holder['addr']}) -> {reader['name']} ({reader['addr']}), sizes {sizes} MB, "
        f"{args.reps} reps, Flight chunk {args.chunk} KiB"
    )
    print(f"# load average before: {_loadavg()} ({os.cpu_count()} CPUs)", flush=True)
    server = multihost.popen_on(
        holder["name"],
        [*me, "--role", "serve", "--addr", holder["addr"], "--sizes", sizes],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    vy_procs: list[subprocess.Popen] = []
    try:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"the holder on {holder['name']} failed (exit {server.wait()})")
        info = json.loads(line)
        if args.vineyard:
            info["vineyard"], vy_procs = _vineyard_up(multihost, holder, reader, info, work, env)
        (work / "info.json").write_text(json.dumps(info))
        results = {}
        for variant in ["default", "tuned"] if args.malloc == "both" else [args.malloc]:
            renv = {**env, **TUNED_MALLOC} if variant == "tuned" else env
            r = multihost.run_on(
                reader["name"],
                [*me, "--role", "read", "--info", str(work / "info.json"), "--reps", str(args.reps)]
                + (["--methods", args.methods] if args.methods else []),
                env=renv,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if r.returncode:
                raise SystemExit(f"the reader on {reader['name']} failed:\n{r.stderr}")
            results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        _stop(vy_procs)
        server.stdin.close()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        if not was_up and not args.keep_bed:
            multihost.down()
    print(f"# load average after: {_loadavg()}")
    for variant, res in results.items():
        print(
            f"\n## reader's malloc: {variant}"
            + (f" ({' '.join(f'{k}={v}' for k, v in TUNED_MALLOC.items())})" if variant == "tuned" else "")
        )
        _report(res, info)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "results": results}, indent=1))
    return 0


def _report(results: dict, info: dict) -> None:
    """Per size and method: median and best MB/s over the repetitions; "vs tcp" and "vs
    sendfile": the median over repetitions of (this method's MB/s / that raw reference's MB/s
    in the same repetition, measured next to it), which a load that drifts during the run
    disturbs less than a ratio of medians; CPU seconds per GB moved, in the reader and the
    holder process (vineyardd's own CPU not seen)."""
    sizes = [str(p["mb"]) for p in info["parts"]]
    nbytes = {str(p["mb"]): p["nbytes"] for p in info["parts"]}
    print(
        f"{'size':>7} {'file MB':>8}  {'method':<20} {'median MB/s':>11} {'best MB/s':>10} {'vs tcp':>7}"
        f" {'vs sendfile':>11} {'reader CPU s/GB':>16} {'holder CPU s/GB':>16}"
    )
    for s in sizes:
        refs = [[row[0] for row in results[ref][s]] for ref in REFERENCES]
        for m, by in results.items():
            rows = by[s]
            rate = [row[0] for row in rows]
            paired = [statistics.median(r / t for r, t in zip(rate, ref)) for ref in refs]
            rcpu = statistics.median(row[1] for row in rows)
            hcpu = (
                f"{statistics.median(row[2] for row in rows):16.2f}" if not m.startswith("vineyard") else f"{'-':>16}"
            )
            print(
                f"{s + 'MB':>7} {nbytes[s] / 1e6:8.1f}  {m:<20} {statistics.median(rate):11.0f} {max(rate):10.0f}"
                f" {paired[0]:7.0%} {paired[1]:11.0%} {rcpu:16.2f} {hcpu}"
            )


# ---- Vineyard across the two hosts (optional) -------------------------------------------------
VY_SOCKET = "/tmp/phalanx-bench-vineyard.sock"  # each host's own /tmp
VY_PORT = 9600  # vineyardd's RPC port; it listens on 0.0.0.0 (no option to bind an address)
ETCD_PORT = 2379

# vineyard 0.24 imports pkg_resources, which setuptools >= 81 no longer ships
PKG_RESOURCES_SHIM = """import importlib.resources


def resource_filename(package, name):
    return str(importlib.resources.files(package) / name)
"""


def _vineyard_up(multihost, holder: dict, reader: dict, info: dict, work: Path, env: dict) -> tuple[dict, list]:
    """etcd on px-head (the bed's head node), vineyardd on the holder and the reader with their
    metadata in it, the partitions put (persisted: globally visible) on the holder."""
    import importlib.util

    spec = importlib.util.find_spec("vineyard")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--vineyard: pip install vineyard vineyard-bdist")
    vineyardd = str(Path(spec.submodule_search_locations[0]) / "bdist" / "vineyardd")
    etcd = shutil.which("etcd", path=str(Path(sys.executable).parent)) or "etcd"
    shim = work / "vyshim"
    shim.mkdir()
    (shim / "pkg_resources.py").write_text(PKG_RESOURCES_SHIM)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")])))
    head = multihost.head()
    url = f"http://{head['addr']}:{ETCD_PORT}"
    procs = []

    def start(host: str, argv: list[str], name: str) -> None:
        log = open(work / f"{name}.log", "w")
        procs.append(multihost.popen_on(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    start(
        head["name"],
        [etcd, "--data-dir", str(work / "etcd"), "--listen-client-urls", url]
        + ["--advertise-client-urls", url, "--listen-peer-urls", f"http://{head['addr']}:{ETCD_PORT + 1}"]
        + ["--initial-advertise-peer-urls", f"http://{head['addr']}:{ETCD_PORT + 1}"]
        + ["--initial-cluster", f"default=http://{head['addr']}:{ETCD_PORT + 1}"],
        "etcd",
    )
    time.sleep(2)
    for h in (holder, reader):
        argv = [vineyardd, "--socket", VY_SOCKET, "--rpc_socket_port", str(VY_PORT), "--size", "3Gi"]
        argv += ["--log_dir", str(work)]  # not the host's /tmp (glog's default): removed with work
        start(
            h["name"],
            argv + ["--meta", "etcd", "--etcd_endpoint", url, "--etcd_prefix", f"/bench{os.getpid()}"],
            h["name"],
        )
    code = (
        "import json,sys,time,vineyard;from phalanx.store.tiers import FileTier\n"
        "info=json.loads(sys.argv[1])\n"
        "for _ in range(100):\n"
        "  try: c=vineyard.connect(sys.argv[2]); break\n"
        "  except Exception: time.sleep(0.2)\n"
        "import pyarrow as pa\n"
        "t=FileTier('/');ids=[]\n"
        "for p in info['parts']:\n"
        "  tb=t.open_partition(t.read_buffer(p['location'],0))\n"
        "  tb=tb.set_column(tb.schema.get_field_index('ts'),'ts',tb['ts'].cast(pa.int64()))\n"  # no timestamp resolver
        "  ids.append(int(c.put(tb, persist=True)))\n"
        "print(json.dumps(ids))\n"
    )
    r = multihost.run_on(
        holder["name"],
        [sys.executable, "-c", code, json.dumps(info), VY_SOCKET],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode:
        logs = "".join((work / f"{n}.log").read_text()[-2000:] for n in ("etcd", holder["name"], reader["name"]))
        _stop(procs)
        raise SystemExit(f"vineyard put on {holder['name']} failed:\n{r.stderr[-3000:]}\n{logs}")
    objects = json.loads(r.stdout.strip().splitlines()[-1])
    return {"host": holder["addr"], "port": VY_PORT, "socket": VY_SOCKET, "objects": objects}, procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # by the PIDs we started
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
