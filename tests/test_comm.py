"""Communicator conformance: the contract (phalanx.testing.communicator) on tcp (the
default: its shared-memory data path on one host, and its own sockets with PHALANX_SHM=0), Gloo
(the same two ways), shm, MPI and UCX at every world size, plus library noise and fail-fast.

One gang per (communicator, world size) lives for the whole module (starting one costs ~2 s).
"""

from __future__ import annotations

import importlib.util
import shutil
import time

import pytest

import phalanx as px
from phalanx.errors import RankError
from phalanx.procs import descendants as _descendants
from phalanx.testing.comm_apps import app_every_collective_warnings_caught, app_fail_on_rank_1, app_print
from phalanx.testing.communicator import CommContract


def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not on PATH (apt-get install openmpi-bin)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed (pip install mpi4py)"
    return None


UCX_SKIP = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx not installed (pip install 'phalanx[ucx]')"
)
MPI_SKIP = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
CASES = (
    [pytest.param(("tcp", n), id=f"tcp-{n}") for n in (1, 2, 3, 4)]
    + [pytest.param(("tcp-noshm", n), id=f"tcp-noshm-{n}") for n in (2, 3)]
    + [pytest.param(("gloo", n), id=f"gloo-{n}", marks=pytest.mark.torch) for n in (1, 2, 3, 4)]
    + [pytest.param(("gloo-noshm", n), id=f"gloo-noshm-{n}", marks=pytest.mark.torch) for n in (2, 3)]
    + [pytest.param(("shm", n), id=f"shm-{n}") for n in (1, 2, 3, 4)]
    + [pytest.param(("mpi", n), id=f"mpi-{n}", marks=[pytest.mark.mpi, MPI_SKIP]) for n in (1, 2, 3)]
    + [pytest.param(("ucx", n), id=f"ucx-{n}", marks=[pytest.mark.ucx, UCX_SKIP]) for n in (1, 2, 3)]
)


class TestCommConformance(CommContract):
    """tcp, Gloo, shm, MPI and UCX at every world size."""

    @pytest.fixture(scope="class", params=CASES)
    @classmethod
    def comm_gang(cls, request):
        """One gang per (communicator, world size) for the class: the mix-in's own takes a
        communicator name; these also run with shared memory off and MPI under mpirun."""
        communicator, ranks = request.param
        executor = "mpirun" if communicator == "mpi" else "local"
        mp = pytest.MonkeyPatch()
        if communicator.endswith("-noshm"):  # the communicator's own wire: shared memory turned off
            communicator = communicator[: -len("-noshm")]
            mp.setenv("PHALANX_SHM", "0")
        g = px.Gang(ranks=ranks, executor=executor, communicator=communicator, echo=False)
        try:
            g.start()
        finally:
            mp.undo()  # the ranks have their environment: later gangs get the default
        yield g
        g.close()


def test_no_library_noise_in_rank_output(tmp_path):
    """A gang that prints nothing shows nothing: no warning from torch (or any library) at
    start, in any collective or at shutdown; its rank logs are empty and private (0600)."""
    lines: list[str] = []
    with px.Gang(ranks=2, echo=lines.append, log_dir=tmp_path) as g:
        assert g.run(app_every_collective_warnings_caught) == [[], []]
        assert lines == [] and list(tmp_path.glob("rank-*.log")) == []
        g.run(app_print, "hello")
    assert sorted(lines) == ["[rank 0] hello", "[rank 1] hello"]
    for log in tmp_path.glob("rank-*.log"):
        assert log.stat().st_mode & 0o777 == 0o600, f"{log}: {oct(log.stat().st_mode)}"


# ---- mpirun executor: fail-fast leaves nothing behind -------------------------------------
def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.mpi
@MPI_SKIP
def test_mpirun_rank_failure_is_fast_and_leaves_no_process():
    gang = px.Gang(ranks=2, executor="mpirun", communicator="mpi", echo=False)
    try:
        gang.start()
        launched = gang._launcher.proc  # mpirun (behind its shim on Linux)
        below = _descendants(launched.pid)  # mpirun and the ranks
        assert set(gang.pids) <= set(below)
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 fails on purpose") as info:
            gang.run(app_fail_on_rank_1)
        assert time.monotonic() - t0 < 5.0
        assert info.value.ranks == [1]
        assert launched.poll() is not None
        assert [pid for pid in below if _running(pid)] == []
        assert not gang.running
    finally:
        gang.close()


# ---- a rank that dies mid-collective: the survivors fail fast and name it ----------------------
def app_rank_1_dies_in_alltoallv(env):
    import os

    import numpy as np

    if env.rank == 1:
        os._exit(3)
    counts = [1 << 20] * env.world_size  # the survivors wait for rank 1's piece
    env.comm.alltoallv(np.zeros(sum(counts), dtype=np.uint8), counts)


@pytest.mark.parametrize("communicator", ["tcp", "tcp-noshm", pytest.param("ucx", marks=[pytest.mark.ucx, UCX_SKIP])])
def test_rank_death_fails_the_gang_fast_names_it_and_stops_the_others(communicator, monkeypatch):
    if communicator.endswith("-noshm"):
        communicator = communicator[: -len("-noshm")]
        monkeypatch.setenv("PHALANX_SHM", "0")
    gang = px.Gang(ranks=3, communicator=communicator, echo=False)
    try:
        gang.start()
        pids = list(gang.pids)
        t0 = time.monotonic()
        with pytest.raises(RankError, match="exited with code 3") as info:
            gang.run(app_rank_1_dies_in_alltoallv)
        assert time.monotonic() - t0 < 30.0  # not the collective's 1800 s timeout
        assert info.value.first.rank == 1  # the cause, before the survivors that lost it
        assert [pid for pid in pids if _running(pid)] == []
    finally:
        gang.close()


# ---- tcp: ranks without torch, sockets that only the gang's key opens ------------------------
def app_modules_after_a_shuffle(env):
    import sys

    import pyarrow as pa

    df = px.DataFrame.from_arrow(pa.table({"k": list(range(env.rank, 200, 2))}), env)
    keys = df.shuffle("k").to_arrow()["k"].to_pylist()
    return keys, sorted(m for m in ("torch", "torch.distributed") if m in sys.modules)


@pytest.mark.slow  # kept out of the core lane's 5 minutes: fresh interpreters per rank
def test_tcp_ranks_never_import_torch():
    with px.Gang(ranks=2, communicator="tcp", echo=False) as g:
        results = g.run(app_modules_after_a_shuffle)
    assert sorted(k for keys, _ in results for k in keys) == list(range(200))
    assert [mods for _, mods in results] == [[], []]


def _serve_one(listener, key, box):
    from phalanx.runtime.netio import accept_peers

    try:
        address = "%s:%d" % listener.getsockname()
        box["peers"] = sorted(accept_peers(listener, address, 1, 0, 2, key, time.monotonic() + 10, "test"))
    except Exception as exc:
        box["error"] = exc


def _relay(front, back_address, stop):
    """A man in the middle without the key: pipes bytes both ways between whoever dials
    ``front`` and the real listener at ``back_address``."""
    import select
    import socket

    a, _ = front.accept()
    b = socket.create_connection(back_address)
    try:
        while not stop.is_set():
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for src in ready:
                data = src.recv(65536)
                if not data:
                    return
                (b if src is a else a).sendall(data)
    except OSError:
        pass
    finally:
        a.close()
        b.close()


def test_tcp_handshake_cannot_be_relayed_by_a_man_in_the_middle(caplog):
    """Someone who published its own address in place of rank 0's (a writable file or Redis
    rendezvous) and relays the bytes to the real rank 0 gets nothing: each proof is bound to the
    address its dialler used, so both ends refuse, and rank 0 keeps waiting for the real peer."""
    import socket
    import threading

    from phalanx.errors import PhalanxError
    from phalanx.runtime.netio import connect_peer

    key = b"k" * 16
    listener, front = socket.socket(), socket.socket()
    for s in (listener, front):
        s.bind(("127.0.0.1", 0))
        s.listen(4)
    box: dict = {}
    stop = threading.Event()
    server = threading.Thread(target=_serve_one, args=(listener, key, box))
    relay = threading.Thread(target=_relay, args=(front, listener.getsockname(), stop))
    server.start()
    relay.start()
    try:
        with pytest.raises(PhalanxError, match="handshake with rank 0 at .* failed"):
            connect_peer(front.getsockname(), 1, 0, key, time.monotonic() + 10, "test")
        connect_peer(listener.getsockname(), 1, 0, key, time.monotonic() + 10, "test").close()
        server.join(10)
        assert box == {"peers": [1]}
        assert "does not hold this gang's key" in caplog.text
    finally:
        stop.set()
        relay.join(10)
        server.join(10)
        listener.close()
        front.close()


@pytest.mark.parametrize("intruder", ["wrong key", "not a rank", "silent"])
def test_tcp_listener_admits_only_holders_of_the_gang_key(intruder, monkeypatch, caplog):
    """A rank's socket authenticates both ways.  An intruder — a process without the key (another
    user's, a stale gang's), one that does not speak the protocol, one that connects and says
    nothing — is refused on both ends and cannot fail the gang: the listener goes on waiting and
    admits the real peer that comes next."""
    import socket
    import threading

    from phalanx.errors import PhalanxError
    from phalanx.runtime import netio

    monkeypatch.setattr(netio, "HANDSHAKE_S", 3.0)
    key = b"k" * 16
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    address = listener.getsockname()
    box: dict = {}
    server = threading.Thread(target=_serve_one, args=(listener, key, box))
    server.start()
    try:
        if intruder == "wrong key":
            with pytest.raises(PhalanxError, match="handshake with rank 0 at .* failed"):
                netio.connect_peer(address, 1, 0, b"x" * 16, time.monotonic() + 10, "test")
        elif intruder == "not a rank":
            with socket.create_connection(address) as raw:
                raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 64)
                try:  # until rank 0 has refused it and closed (or reset) the connection
                    while raw.recv(1024):
                        pass
                except ConnectionResetError:
                    pass
        else:
            silent = socket.create_connection(address)
        t0 = time.monotonic()
        sock = netio.connect_peer(address, 1, 0, key, time.monotonic() + 10, "test")
        sock.close()
        server.join(10)
        assert box == {"peers": [1]}
        if intruder == "silent":  # still mid-handshake, it does not hold up the real peer
            assert time.monotonic() - t0 < netio.HANDSHAKE_S
        else:
            assert "rank 0 refused a connection from 127.0.0.1" in caplog.text
    finally:
        if intruder == "silent":
            silent.close()
        server.join(10)
        listener.close()
