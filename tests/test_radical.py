"""The RADICAL-Pilot executor (``executor: radical``): what the conformance suite does not cover.

Config and wrapper tests run anywhere; the rest (marker ``radical``) run real RP on this
machine's ``local.localhost`` (tests/infra/radical.py: site-configs/radical-local.yaml with RP's
files in a temporary directory) and are skipped with the reason when RP or mpiexec is missing.
One RP session serves the module (RP's session is the process's); every run submits its own
pilot.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from infra import radical as rinfra

import phalanx as px
from phalanx.errors import GangError
from phalanx.executors.radical.config import RadicalConfig
from phalanx.executors.radical.launcher import _WRAPPER, dq

REPO = Path(__file__).resolve().parents[1]


# ---- the section, without RP ---------------------------------------------------------------
def test_the_site_files_validate_and_an_unknown_key_is_named_with_its_line(tmp_path):
    from phalanx.orchestrator.loading import load_site

    for name in ("radical-local", "radical-example"):
        site = load_site(str(REPO / "site-configs" / f"{name}.yaml"))
        assert site.executor == "radical" and isinstance(site.radical, RadicalConfig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nexecutor: radical\nradical:\n  resource: local.localhost\n  cores_per_rnak: 2\n")
    with pytest.raises(Exception) as info:
        load_site(str(bad))
    assert "bad.yaml:5" in str(info.value) and "did you mean 'cores_per_rank'" in str(info.value), str(info.value)


def test_config_defaults_capacity_and_labels():
    local = RadicalConfig()
    assert local.resource == "local.localhost" and local.local
    assert local.slots() == os.cpu_count()  # a local pilot holds this machine's cores
    assert RadicalConfig(cores=8, cores_per_rank=2).slots() == 4
    assert RadicalConfig(resource="tacc.frontera", nodes=2).slots() is None  # RP's cores_per_node decide
    assert RadicalConfig(cores_per_rank=2).pilot_cores(site_cores=3) == 6
    with pytest.raises(ValueError, match="not an RP resource label"):
        RadicalConfig(resource="localhost")
    with pytest.raises(ValueError):
        RadicalConfig(cores=True)  # YAML's true is not a count


def test_a_stage_cannot_change_the_runs_pilot():
    from phalanx.executors import create

    ex = create("radical", {"cores": 4}, site="t")
    assert ex.capacity() == 4
    ex.check(4, ex.stage_config({"cores_per_rank": 1}))
    with pytest.raises(ValueError, match="radical.cores: the pilot is the run's"):
        ex.check(1, ex.stage_config({"cores": 8}))
    with pytest.raises(GangError, match="does not fit the pilot's 4 cores"):
        ex.check(2, ex.stage_config({"cores_per_rank": 3}))


def test_the_rank_wrapper_gets_every_argument_as_written(tmp_path):
    """RP writes a task's environment as ``export K="v"`` and its arguments through sh_quote
    (``$`` and backquotes left to the shell): argv travels in the environment, escaped, and
    arrives unchanged — exactly as RP's exec script does it."""
    argv = ["/bin/sh", "-c", 'printf "%s\\n" "$0" "$@"; exit 3', "$HOME", 'a"b\\c', "`id`", "", "it's"]
    env = {
        "PHALANX_RP_WRAPPER": dq(_WRAPPER),
        "PHALANX_RP_ARGC": str(len(argv)),
        **{f"PHALANX_RP_ARG_{i}": dq(a) for i, a in enumerate(argv)},
    }
    script = "".join(f'export {k}="{v}"\n' for k, v in env.items())
    script += f'export RP_TASK_SANDBOX={tmp_path} RP_RANK=1\n/bin/sh "-c" "$PHALANX_RP_WRAPPER" "phalanx-rank"\n'
    assert subprocess.run(["bash", "-c", script]).returncode == 3
    assert (tmp_path / "rank-1.out").read_text().split("\n")[:-1] == argv[3:]
    assert (tmp_path / "rank-1.exit").read_text().strip() == "3"


def test_radical_utils_id_counters_never_close_another_threads_file(tmp_path, monkeypatch):
    """radical.utils closes an id counter's file twice; another thread that opens a file between
    the two closes gets that number (here: takes it right after the first close).  Its file must
    stay open (without phalanx's fix, RP's profile writes failed with EBADF now and then)."""
    ru = pytest.importorskip("radical.utils")
    from phalanx.executors.radical import counters

    counters.install()
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    taken: list[int] = []
    real_close = os.close

    def close_then_reuse(fd: int) -> None:
        real_close(fd)
        if not taken:  # the first close of the counter's file: its number is another file's now
            os.dup2(other, fd)
            taken.append(fd)

    monkeypatch.setattr(os, "close", close_then_reuse)
    ru.generate_id("phalanx-test.%(item_counter)04d", ru.ID_CUSTOM, ns=str(tmp_path))  # an absolute ns: files here
    monkeypatch.undo()
    assert taken, "radical.utils opened no counter file"
    assert os.fstat(taken[0]).st_ino == os.fstat(other).st_ino  # still open, still the other file
    os.close(taken[0])
    os.close(other)


# ---- real RP -------------------------------------------------------------------------------
def needs_rp(fn):
    """Marker ``radical``; skipped with the reason where RP cannot run."""
    reason = rinfra.available()
    return pytest.mark.radical(pytest.mark.skipif(bool(reason), reason=str(reason))(fn))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return tmp_path_factory.mktemp("radical")


@pytest.fixture(scope="module")
def site(sandbox):
    return rinfra.site(str(sandbox), cores=4)


def _sockets(pid: int) -> set[str]:
    """The inodes of the sockets ``pid`` holds."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                found.add(link[8:-1])
    except OSError:
        pass
    return found


def _listeners(pids: set[int], skip: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(pid, local address) of the listening TCP sockets these processes hold (but ``skip``)."""
    inodes = {inode: pid for pid in pids for inode in _sockets(pid) - skip}
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in open(table).read().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                hexaddr = parts[1].split(":")[0]
                if v6:  # four little-endian 32-bit words
                    addr = socket.inet_ntop(
                        socket.AF_INET6, b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, 32, 8))
                    )
                else:
                    addr = socket.inet_ntoa(bytes.fromhex(hexaddr)[::-1])
                found.append((inodes[parts[9]], addr))
    return found


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _under(root: Path) -> set[int]:
    from phalanx.executors.radical.pilot import processes_in

    return set(processes_in(root))


def _env_of(app_env):
    return {
        k: os.environ.get(k)
        for k in ("RP_RANK", "RP_TASK_ID", "RP_PILOT_ID", "RP_CORES_PER_RANK", "PHALANX_THREADS", "PHALANX_GANG_ID")
    } | {"rank": app_env.rank, "pid": os.getpid()}


@pytest.fixture(scope="class")
def run_b(site):
    """One run's pilot with a gang of 2 ranks on it, shared by ``TestOneRun`` (a pilot takes
    10-40 s to start here): the sockets this process held before it, the executor, the gang.
    When the class ends, closing the run leaves nothing of its pilot."""
    earlier = _sockets(os.getpid())  # what earlier tests of this process left open is not this gang's
    ex = site.create_executor()
    ex.open_run()
    try:
        gang = px.Gang(2, executor=ex, echo=False).start()
        pilot = ex.pilot()
        yield earlier, ex, gang
        gang.close()
    finally:
        ex.close_run()
    assert _under(pilot.sandbox) == set(), "the shared run's pilot is still running after its close_run"


@needs_rp
class TestOneRun:
    """What one run's pilot and gang show (one pilot for the class: ``run_b``)."""

    def test_ranks_come_from_rp_rank_and_every_rp_endpoint_is_on_loopback(self, run_b, sandbox):
        earlier, _, gang = run_b
        facts = gang.run(_env_of)
        assert [f["RP_RANK"] for f in facts] == ["0", "1"] and [f["rank"] for f in facts] == [0, 1]
        assert {f["RP_TASK_ID"] for f in facts} == {f"phalanx-{gang.gang_id}"}
        assert len({f["RP_PILOT_ID"] for f in facts}) == 1
        assert gang.status().startswith(f"radical: task phalanx-{gang.gang_id} AGENT_EXECUTING on pilot ")
        # RP's bridges and components (client and agent: all work under the sandbox), the
        # ranks and this process listen on loopback only (radical.interface: lo).  Not Open
        # MPI's mpiexec, which RP starts a multi-rank task with: its PMIx server listens on
        # 0.0.0.0 and :: whatever its MCA settings (docs/radical.md) — named, not hidden
        pids = _under(sandbox) | {f["pid"] for f in facts} | {os.getpid()}
        listening = _listeners(pids, skip=earlier)
        assert len(listening) > 10, listening  # RP's endpoints were found at all
        wide = [
            (pid, addr, _name(pid)) for pid, addr in listening if addr not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
        ]
        assert [w for w in wide if w[2] not in ("mpiexec", "orterun")] == [], wide

    def test_rps_id_counters_stay_in_the_sandbox_not_the_users_home(self, run_b, sandbox):
        """radical.utils reads RADICAL_BASE when it is imported: the counters of phalanx's sessions
        went to ~/.radical/utils, which phalanx never cleans, whatever the sandbox said."""
        from phalanx.executors.radical.session import _sessions

        _, _, gang = run_b
        assert gang.run(lambda env: env.rank) == [0, 1]
        uids = {s.uid for s in _sessions.values()}
        assert uids
        home = Path(os.path.expanduser("~")) / ".radical" / "utils"
        assert not [u for u in uids if (home / u).exists()], f"RP id counters written under {home}"
        assert any(sandbox.rglob(f"utils/{u}") for u in uids), "RP's id counters are not under the sandbox"

    def test_each_run_holds_its_own_pilot_and_closing_one_leaves_the_other(self, site, run_b):
        """Run A (its own executor) beside run B (the class's): A's close ends A's pilot only."""
        _, b, gb = run_b
        a = site.create_executor()
        a.open_run()
        try:
            ga = px.Gang(1, executor=a, echo=False).start()
            pa, pb = a.pilot(), b.pilot()
            assert pa.uid != pb.uid and pa.sandbox != pb.sandbox
            assert _under(pa.sandbox) and _under(pb.sandbox)
            ga.close()
            a.close_run()
            assert _under(pa.sandbox) == set(), "run A's pilot is still running after its close_run"
            assert gb.health() is None and gb.run(lambda env: env.rank) == [0, 1]
        finally:
            a.close_run()
        # B's own close (it leaves nothing either): run_b's teardown


@needs_rp
def test_a_stage_section_sets_its_gangs_cores_and_command_arguments_arrive_as_written(site, tmp_path):
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    probe = (
        "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'rank': os.environ['PHALANX_RANK'], "
        "'cores': os.environ['RP_CORES_PER_RANK']}))"
    )
    wf = Workflow(
        name="radical-stage",
        stages={
            "cmd": Stage(
                kind="command",
                command=["python", "-c", probe, "$HOME", 'a"b', "`id`"],
                ranks=2,
                radical={"cores_per_rank": 2},
            )
        },
    )
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf, site, db=db)
    assert result.ok, result.failed
    [attempt] = db.attempts(result.run_id, "cmd")
    for r in range(2):
        line = (Path(attempt["log_dir"]) / f"rank-{r}.log").read_text().strip().splitlines()[-1]
        assert json.loads(line) == {"argv": ["$HOME", 'a"b', "`id`"], "rank": str(r), "cores": "2"}
    assert db.allocations(result.run_id) == []  # the pilot and the task were released
    bad = Workflow(name="radical-bad", stages={"s": Stage(kind="command", command=["true"], radical={"cores": 64})})
    result = run_workflow(bad, site, db=RunDB(tmp_path / "state2"))
    assert "radical.cores: the pilot is the run's" in result.failed["s"]


@needs_rp
def test_a_pilot_rp_cannot_start_fails_the_gang_with_rps_words(sandbox):
    site = rinfra.site(str(sandbox), cores=2, resource="local.nowhere")
    t0 = time.monotonic()
    with pytest.raises(GangError) as info:
        px.Gang(1, site=site, echo=False, start_timeout=60).start()
    assert time.monotonic() - t0 < 60
    assert re.search(
        r"radical: pilot .* FAILED before it became active.*RP.s pilot launcher: RuntimeError: missing "
        r"resource manager",
        str(info.value),
        re.S,
    ), str(info.value)


_DRIVER = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = [sys.argv[3], sys.argv[4]]
    import phalanx as px
    from infra import radical as rinfra

    class Hook:  # what the scheduler's hook writes to the run DB
        def held(self, record): self.write("held", record)
        def released(self, record): self.write("released", record)
        def write(self, what, record):
            with open(sys.argv[2], "a") as f:
                f.write(json.dumps([what, record]) + "\\n")

    site = rinfra.site(sys.argv[1], cores=2)
    ex = site.create_executor()
    ex.open_run(hook=Hook())
    gang = px.Gang(2, executor=ex, echo=False, start_timeout=600).start()  # a loaded machine: slow imports
    gang.run(lambda env: env.rank)
    print("ready", flush=True)
    time.sleep(3600)
""")


def _marked(mark: str) -> list[int]:
    """Processes carrying ``PHALANX_TEST_MARK=mark`` in their environment: the driver's, and
    everything it (or RP for it: bridges, the agent, its components, the ranks) started."""
    out = []
    for entry in os.scandir("/proc"):
        try:
            if (
                entry.name.isdigit()
                and f"PHALANX_TEST_MARK={mark}".encode() in open(f"/proc/{entry.name}/environ", "rb").read()
            ):
                out.append(int(entry.name))
        except OSError:
            pass
    return out


@needs_rp
@pytest.mark.parametrize("watcher", ["watcher", "no-watcher"])
def test_a_killed_drivers_pilot_ends_by_its_watcher_or_by_release(tmp_path, watcher):
    """A driver SIGKILLed with a gang running.  Its ranks leave (they watch the driver), RP's
    client processes die with it, and the pilot's watcher (watch.py, started by the pilot's
    bootstrap) sees the driver's connection end and cancels the pilot.  Without the watcher
    (killed first: a pilot on a node that cannot reach the driver), the agent runs on until
    ``release`` of the records the driver left — what ``phalanx status``/``cancel``/
    ``--resume`` call — ends it."""
    from phalanx.executors import release

    mark = f"phalanx-radical-test-{uuid.uuid4().hex}"
    records = tmp_path / "records.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(tmp_path / "rp"), str(records), str(REPO / "tests"), str(REPO)],
        env={**os.environ, "PHALANX_TEST_MARK": mark},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", "the driver did not start its gang"
        held: dict[str, dict] = {}
        for what, record in (json.loads(line) for line in records.read_text().splitlines()):
            if what == "held":
                held[record["id"]] = record
            else:
                held.pop(record["id"], None)
        pilots = [r for r in held.values() if r["kind"] == "pilot"]
        assert len(pilots) == 1 and [r["kind"] for r in held.values()].count("task") == 1, held
        sandbox = Path(pilots[0]["sandbox"])
        watchers = [
            p
            for p in _under(sandbox)  # python .../radical/watch.py HOST PORT (not the bootstrap)
            if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:2]
            == [str(REPO / "phalanx" / "executors" / "radical" / "watch.py").encode()]
        ]
        assert len(watchers) == 1, "the pilot has no watcher"
        if watcher == "no-watcher":
            os.kill(watchers[0], signal.SIGKILL)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = time.monotonic()
    if watcher == "watcher":
        while (_marked(mark) or _under(sandbox)) and time.monotonic() - killed < 30:
            time.sleep(0.2)
        assert _marked(mark) == [] and _under(sandbox) == set(), (_marked(mark), _under(sandbox))
        assert all("already gone" in release(r) for r in held.values())
        return
    time.sleep(5)  # what dies with the driver has died by now
    assert _under(sandbox), "the pilot's agent did not outlive its driver: release has nothing to show"
    lines = [release(r) for r in held.values()]
    assert any("cancelled" in line for line in lines), lines
    deadline = time.monotonic() + 20
    while (_marked(mark) or _under(sandbox)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(mark) == [] and _under(sandbox) == set(), (_marked(mark), _under(sandbox))
    assert all("already gone" in release(r) for r in held.values())  # a second release finds nothing


@pytest.mark.slow
@needs_rp
def test_the_etl_example_gives_the_same_data_on_radical_as_locally(tmp_path):
    """``phalanx run workflows/etl_to_training.yaml`` on the local site and on radical-local
    (as users run it: the CLI, the shipped site file): every dataset the run seals is equal."""
    from test_examples import ETL_SMALL  # the example's sizes shrunk: the same stages, less data

    env = {**os.environ, "PHALANX_STATE": str(tmp_path / "state")}
    sets = [a for k, v in ETL_SMALL.items() for a in ("--set", f"{k}={v}")]
    sessions = {}
    for name in ("local", "radical-local"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "phalanx.cli",
                "run",
                "workflows/etl_to_training.yaml",
                "--site",
                name,
                "--plain",
                *sets,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, f"{name}: {r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        sessions[name] = _session_of(env)
    local, remote = (px.Store(session=sessions[n]) for n in ("local", "radical-local"))
    names = sorted(local.list())
    assert names == sorted(remote.list()) and {"transactions", "users", "features", "train_metrics"} <= set(names)
    for ds in names:
        a, b = local.read(ds), remote.read(ds)
        clock = [c for c in ("seconds",) if c in a.column_names]  # a wall-clock column differs by nature
        a, b = a.drop_columns(clock), b.drop_columns(clock)
        key = [c for c in ("tx_id", "user_id", "epoch") if c in a.column_names][:1]
        if key:
            a, b = a.sort_by([(key[0], "ascending")]), b.sort_by([(key[0], "ascending")])
        assert a.schema == b.schema and a.num_rows == b.num_rows, ds
        assert a.equals(b), f"dataset {ds!r} differs between local and radical-local"
    for s in sessions.values():
        px.Store(session=s).delete_session()


def _session_of(env: dict) -> str:
    """The store session of the newest run in the state directory's run DB."""
    from phalanx.orchestrator.rundb import RunDB

    db = RunDB(env["PHALANX_STATE"])
    run = max(db.runs(), key=lambda r: r["started"])
    return run["session"]
