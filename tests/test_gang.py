"""Gang lifecycle: reuse, fail-fast, dead ranks, Ctrl-C, timeouts, rendezvous, bad input."""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import apps
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.runtime.protocol import heartbeat_s

HERE = Path(__file__).parent


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, within=5.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture
def gang2():
    with px.Gang(ranks=2, echo=False) as g:
        yield g


def test_gang_keeps_its_ranks_across_runs_and_passes_params(gang2):
    first = gang2.run(apps.rank_info, params={"rows": 5})
    second = gang2.run("apps:rank_info")
    assert [r[:3] for r in first] == [(0, 2, {"rows": 5}), (1, 2, {"rows": 5})]
    assert [r[:3] for r in second] == [(0, 2, {}), (1, 2, {})]
    assert [r[3] for r in first] == [r[3] for r in second] == gang2.pids
    assert gang2.run(apps.exchange_ranks) == [[b"\x00", b"\x01"], [b"\x00\x00", b"\x01\x01"]]


def app_rank1_raises(env):
    if env.rank == 1:
        raise ValueError("bad value on rank 1")
    env.comm.barrier()  # rank 0 would wait here forever without fail-fast


def test_failing_rank_stops_the_others_and_reports_its_traceback(gang2):
    pids = list(gang2.pids)
    t0 = time.monotonic()
    with pytest.raises(px.RankError) as info:
        gang2.run(app_rank1_raises)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.ranks == [1] and err.stopped == [0]
    assert err.failures[0].exc_type == "ValueError"
    assert "bad value on rank 1" in str(err) and "app_rank1_raises" in str(err)
    assert wait_dead(pids) == []
    # the next run starts a fresh gang
    assert [r[0] for r in gang2.run(apps.rank_info)] == [0, 1]
    assert set(gang2.pids).isdisjoint(pids)


def app_exit(env, how, dead):
    if env.rank == dead:
        time.sleep(0.2)  # the other rank is already waiting in the barrier
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    env.comm.barrier()


@pytest.mark.parametrize("dead", [0, 1])
@pytest.mark.parametrize("how,expected", [("exit", "exited with code 3"), ("kill", "killed by signal SIGKILL")])
def test_a_rank_that_dies_fails_the_gang_fast_and_is_named_first(gang2, how, expected, dead):
    pids = list(gang2.pids)
    t0 = time.monotonic()
    with pytest.raises(px.RankError) as info:
        gang2.run(app_exit, how, dead)
    assert time.monotonic() - t0 < 10
    assert dead in info.value.ranks
    # the dead rank is the headline, not the survivor's "connection closed by peer"
    assert f"first: rank {dead}: rank process {expected}" in str(info.value).splitlines()[0]
    assert wait_dead(pids) == []


def app_unknown_column(env):
    df = px.DataFrame.from_arrow(pa.table({"a": [env.rank]}), env)
    return df.groupby("nope").agg({"a": "sum"})


def test_bad_arguments_raise_on_every_rank(gang2):
    with pytest.raises(px.RankError) as info:
        gang2.run(app_unknown_column)
    assert info.value.ranks == [0, 1]
    assert all(f.exc_type == "KeyError" and "groupby" in f.message and "nope" in f.message for f in info.value.failures)


def app_mismatched_keys(env):
    left = px.DataFrame.from_arrow(pa.table({"k": [1, 2], "a": [1, 2]}), env)
    right = px.DataFrame.from_arrow(pa.table({"k": ["1", "2"], "b": [1, 2]}), env)
    return left.merge(right, on="k")


def test_merge_with_mismatched_key_types_names_the_key(gang2):
    with pytest.raises(px.RankError) as info:
        gang2.run(app_mismatched_keys)
    assert info.value.ranks == [0, 1]
    assert "key 'k' is int64 on the left but string on the right" in str(info.value)


def app_read_missing(env, path):
    return px.read_parquet(path, env)


def test_missing_input_files_fail_on_every_rank(gang2, tmp_path):
    with pytest.raises(px.RankError) as info:
        gang2.run(app_read_missing, str(tmp_path / "nothing" / "*.parquet"))
    assert info.value.ranks == [0, 1]
    assert {f.exc_type for f in info.value.failures} == {"FileNotFoundError"}
    assert "nothing" in str(info.value)


def test_non_callable_app_is_refused_before_any_rank_runs(gang2):
    pids = list(gang2.pids)
    with pytest.raises(TypeError, match="callable or 'package.module:function'"):
        gang2.run(42)
    assert gang2.running and gang2.pids == pids


def test_app_that_does_not_import_fails_on_every_rank(gang2):
    with pytest.raises(px.RankError) as info:
        gang2.run("no_such_module_xyz:main")
    assert info.value.ranks == [0, 1]
    assert "cannot import module 'no_such_module_xyz'" in str(info.value)


def test_run_timeout_stops_the_ranks(gang2):
    pids = list(gang2.pids)
    with pytest.raises(px.GangError, match="timeout=1"):
        gang2.run(apps.sleep_forever, timeout=1)
    assert wait_dead(pids) == []
    assert not gang2.running


def sleeping_driver(tmp_path, **env: str) -> tuple[subprocess.Popen, list[int]]:
    """A driver process whose gang of 2 sleeps forever, and its ranks' pids."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import phalanx as px, apps
        with px.Gang(ranks=2, echo=False) as g:
            print("PIDS", *g.pids, flush=True)
            g.run(apps.sleep_forever)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), proc.stderr.read()
    return proc, [int(p) for p in line.split()[1:]]


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
def test_ctrl_c_stops_every_rank(tmp_path):
    proc, pids = sleeping_driver(tmp_path)
    assert all(alive(p) for p in pids)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    assert "KeyboardInterrupt" in proc.stderr.read()
    assert wait_dead(pids) == []


def app_sleep_pid(env, seconds):
    time.sleep(seconds)
    return os.getpid()


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_heartbeats_keep_ranks_alive_past_the_driver_timeout(monkeypatch):
    """Ranks leave a silent driver after PHALANX_DRIVER_TIMEOUT; the driver's heartbeats keep
    them while an app runs longer than that."""
    monkeypatch.setenv("PHALANX_DRIVER_TIMEOUT", "1")
    with px.Gang(ranks=2, echo=False) as g:
        assert g.run(app_sleep_pid, 3.0) == g.pids
        assert g.run(app_sleep_pid, 0.0) == g.pids


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_ranks_leave_a_driver_that_stops_answering(tmp_path):
    """A driver that hangs (here: SIGSTOP) keeps its connections open: no end of file, no
    parent death; the ranks notice the missing heartbeats and exit (their last words go to
    the stopped driver's pipes: no log to read here)."""
    proc, pids = sleeping_driver(tmp_path, PHALANX_DRIVER_TIMEOUT="2")
    try:
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_dead(pids, within=20) == []
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait(timeout=10)
    # the last heartbeat came up to one interval before the stop
    assert took > 2 - heartbeat_s(2) - 0.2, f"the ranks left {took:.1f} s after the stop: not by the 2 s timeout"


@pytest.mark.parametrize("communicator", ["tcp", pytest.param("gloo", marks=pytest.mark.torch)])
@pytest.mark.parametrize("rendezvous", ["file", "tcp://127.0.0.1"])
def test_other_rendezvous(rendezvous, communicator, tmp_path):
    if rendezvous == "file":
        rendezvous = f"file://{tmp_path}"
    with px.Gang(ranks=3, rendezvous=rendezvous, communicator=communicator, echo=False) as g:
        assert g.run(apps.exchange_ranks)[2] == [b"\x00\x00\x00", b"\x01\x01\x01", b"\x02\x02\x02"]
    assert list(tmp_path.iterdir()) == []  # the rendezvous' files are gone with the gang


@pytest.mark.redis
@pytest.mark.parametrize("communicator", ["tcp", pytest.param("gloo", marks=pytest.mark.torch)])
def test_redis_rendezvous_against_a_real_server(redis_url, communicator):
    import redis

    with px.Gang(ranks=2, rendezvous=redis_url, communicator=communicator, echo=False) as g:
        assert g.run(apps.exchange_ranks)[1] == [b"\x00\x00", b"\x01\x01"]
        client = redis.Redis.from_url(redis_url)
        assert any(k.startswith(f"phalanx:{g.gang_id}:".encode()) for k in client.scan_iter())
    assert not any(k.startswith(f"phalanx:{g.gang_id}:".encode()) for k in client.scan_iter())


def test_gang_that_cannot_start_says_why():
    with pytest.raises(px.GangError, match="unknown communicator 'carrier-pigeon'"):
        px.Gang(ranks=2, communicator="carrier-pigeon", echo=False).start()


def test_bad_rank_count():
    with pytest.raises(ValueError, match="ranks must be an integer ≥ 1"):
        px.Gang(ranks=0)


def test_rank_output_is_prefixed_and_logged(tmp_path):
    lines: list[str] = []
    with px.Gang(ranks=2, echo=lines.append, log_dir=tmp_path) as g:
        g.run(app_print)
    assert "[rank 1] hello from 1" in lines
    assert (tmp_path / "rank-0.log").read_text().count("hello from 0") == 1


def app_print(env):
    print(f"hello from {env.rank}", flush=True)


def test_ranks_reach_the_driver_on_this_hosts_address():
    """control_host="auto" (ranks on other machines) advertises the host's own address."""
    import socket

    with px.Gang(2, control_host="auto", echo=False) as gang:
        assert gang.run(lambda env: env.comm.allreduce(1)) == [2, 2]
        assert gang._control.address.startswith(socket.gethostbyname(socket.getfqdn()) + ":")


def listening_addresses(env):
    """The (address, port) of every TCP socket this rank listens on, from /proc."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    found.append((addr, int(port, 16)))
    return found


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_tcp_ranks_listen_on_nothing_once_wired():
    """tcp's listeners (rank 0's rendezvous port, every rank's mesh port) close once the mesh
    is up: a running gang offers no port to anyone."""
    with px.Gang(3, communicator="tcp", echo=False) as gang:
        assert gang.run(listening_addresses) == [[], [], []]


def test_tcp_listeners_bind_where_the_rendezvous_is(monkeypatch):
    from phalanx.runtime.netio import bind_host

    monkeypatch.delenv("PHALANX_BIND_HOST", raising=False)
    assert bind_host("tcp://127.0.0.1:29500") == "127.0.0.1"
    assert bind_host("tcp://localhost:29500") == "127.0.0.1"
    monkeypatch.setenv("PHALANX_HOST", "127.0.0.1")
    assert bind_host("file:///tmp/rdzv") == "127.0.0.1"
    monkeypatch.setenv("PHALANX_BIND_HOST", "10.1.2.3")
    assert bind_host("tcp://127.0.0.1:29500") == "10.1.2.3"


@pytest.mark.torch
def test_ranks_listen_on_loopback_only():
    """Rank 0's rendezvous store and Gloo's sockets must not be reachable from other hosts."""
    with px.Gang(2, communicator="gloo", echo=False) as gang:
        per_rank = gang.run(listening_addresses)
    assert per_rank[0], "rank 0 hosts the tcp rendezvous: it must listen somewhere"
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 in /proc's byte order
    for rank, addrs in enumerate(per_rank):
        assert all(a in loopback for a, _ in addrs), f"rank {rank} listens on {addrs}"


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_a_gang_on_one_launcher_instance_restarts_with_new_ranks_after_a_failure():
    from phalanx.executors.local import LocalLauncher

    def fail_on_1(env):
        if env.rank == 1:
            raise ValueError("no")
        env.comm.barrier()

    gang = px.Gang(2, executor=LocalLauncher(echo=False), echo=False)
    try:
        first = gang.run(lambda env: os.getpid())
        with pytest.raises(px.RankError):
            gang.run(fail_on_1)
        again = gang.run(lambda env: os.getpid())  # a fresh gang on the same launcher
        assert len(again) == 2 and not set(again) & set(first)
        assert gang._launcher.exitcodes() == [None, None]
    finally:
        gang.close()


# ---- what users read: tracebacks, where the output goes, who did not finish (issue 22) --------
SCRIPT = """
import linecache

import phalanx as px

# code whose file no rank can read, as a notebook cell's: only this process's linecache has it
cell = "def divide(x):\\n    return 1 / x  # the cell's line\\n"
linecache.cache[CELL] = (len(cell), None, cell.splitlines(True), CELL)
exec(compile(cell, CELL, "exec"))


def fails(env):
    divide(env.rank)  # the script's line


with px.Gang(1, echo=False) as gang:
    try:
        gang.run(fails)
    except px.RankError as err:
        ERROR = str(err)
"""


def test_a_script_apps_traceback_names_its_files_and_lines_and_shows_them(tmp_path):
    """A script's functions (here run as ``python script.py`` runs them: in ``__main__``, without
    the cost of another interpreter) and code only the driver has the source of (a notebook's
    cell) travel by value: the rank's traceback names their files and lines (not cloudpickle's
    "<dynamic-code>"), shows the lines, and starts at the app (no phalanx frame)."""
    script, cell = tmp_path / "script.py", tmp_path / "not-on-disk" / "cell.py"
    script.write_text(SCRIPT)
    ns = {"__name__": "__main__", "__file__": str(script), "CELL": str(cell)}
    try:
        exec(compile(SCRIPT, str(script), "exec"), ns)
    finally:
        linecache.cache.pop(str(cell), None)
    line = SCRIPT.splitlines().index("    divide(env.rank)  # the script's line") + 1
    tb = ns["ERROR"].split("--- traceback of rank 0 ---\n", 1)[-1]
    assert tb.startswith(
        "Traceback (most recent call last):\n"
        f'  File "{script}", line {line}, in fails\n    divide(env.rank)  # the script\'s line\n'
    ), tb
    assert f'  File "{cell}", line 2, in divide\n    return 1 / x  # the cell\'s line\n' in tb, tb
    assert tb.rstrip().endswith("ZeroDivisionError: division by zero"), tb
    assert "<dynamic-code>" not in tb and "phalanx" not in tb, tb


def test_a_gang_that_does_not_echo_says_where_its_output_goes(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PHALANX_LOG_DIR", str(tmp_path))
    gang = px.Gang(2, echo=False)
    gang.run_command([sys.executable, "-c", "print('to the log')"])
    err = capfd.readouterr().err
    assert (
        err == f"phalanx: gang {gang.gang_id}: rank output goes to {gang.log_dir}/rank-N.log (N = 0..1) (echo=False)\n"
    )
    assert gang.log_dir == tmp_path / gang.gang_id and (gang.log_dir / "rank-1.log").read_text() == "to the log\n"
    px.Gang(1, echo=False, log_dir=tmp_path / "mine").run_command(["true"])  # the caller chose where: no word
    assert capfd.readouterr().err == ""


def app_barrier(env):
    env.comm.barrier()


def test_a_stage_timeout_names_the_stopped_rank_not_the_one_waiting_for_it(gang2):
    os.kill(gang2.pids[1], signal.SIGSTOP)  # as a debugger, a Ctrl-Z or a user would
    with pytest.raises(px.GangError) as info:
        gang2.run(app_barrier, timeout=0.3)
    msg = str(info.value)
    assert msg.startswith(
        f"gang {gang2.gang_id}: rank 1 did not manage to finish within the stage timeout (timeout=0.3s): its "
        "process is stopped (SIGSTOP, Ctrl-Z or a debugger); rank 0 was still running, most likely waiting for "
        "it in a collective; logs in "
    ), msg


def test_a_started_gang_nobody_references_is_freed_at_once():
    """No reference cycle through the control plane (its sample sink): dropping the last
    reference frees the gang, and its finalizer closes it, without waiting for the cyclic GC."""
    import gc
    import weakref

    g = px.Gang(1)
    g.start()
    gone = weakref.ref(g)
    gc.disable()
    try:
        del g
        assert gone() is None
    finally:
        gc.enable()
