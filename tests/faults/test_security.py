"""A hostile or careless environment: credentials in a site's URLs, and another local user.

- A rendezvous URL with a password (nothing listening; a real redis-server with
  ``--requirepass`` refusing the password; the right password but a database the server does
  not have): the run fails, and the password is in none of what phalanx prints or keeps —
  the terminal, ``phalanx status``, ``phalanx logs``, ``phalanx report``, any column of the run
  DB (and its raw bytes), any file under the state directory.
- A second local user (``phalanxmallory``, created if missing; needs root) who pre-created the
  victim's default directories, mode 777, with a catalogue of their own: phalanx refuses them,
  naming path, owner and mode, and never opens the planted ``meta.sqlite``.
- What phalanx creates by default is the user's alone: directories 0700, files 0600.
"""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import phalanx as px
from phalanx.errors import UnsafePathError
from phalanx.gang import default_log_root
from phalanx.orchestrator.rundb import RunDB
from phalanx.redact import redact
from phalanx.runtime.rendezvous import free_port
from phalanx.store.tiers import default_spill_root

TESTS = Path(__file__).resolve().parent.parent
MALLORY = "phalanxmallory"


def phalanx_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def write_run_files(tmp_path: Path, rendezvous: str = "tcp") -> tuple[Path, Path]:
    wf, site = tmp_path / "wf.yaml", tmp_path / "site.yaml"
    wf.write_text(
        textwrap.dedent("""
        name: sec
        stages:
          gen: {app: "apps:wf_generate", ranks: 2, params: {rows: 1000}, outputs: [tx]}
    """)
    )
    site.write_text(f"name: sec\nexecutor: local\ncores: 2\nrendezvous: '{rendezvous}'\n")
    return wf, site


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": str(TESTS),
        "PATH": "/usr/bin:/bin",
        "PHALANX_STATE": str(tmp_path / "state"),
        **{k: v for k, v in os.environ.items() if k.startswith("PHALANX_STORE")},
        **extra,
    }


def run_id_of(out: subprocess.CompletedProcess) -> str:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("run ") and " in " in ln)
    return line.split()[1]


# ---- defect 6: credentials never leave the site file ------------------------------------------
@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    """A redis-server on loopback that requires a password: (password, port)."""
    redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'phalanx[redis]')")
    exe = shutil.which("redis-server") or pytest.skip("redis-server is not installed (apt-get install redis-server)")
    secret, port = f"rightpw-{uuid.uuid4().hex}", free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            secret,
            "--dir",
            str(tmp_path_factory.mktemp("redis")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client, deadline = redis.Redis(port=port, password=secret), time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail(f"redis-server --requirepass did not start on port {port}")
    client.close()
    yield secret, port
    proc.terminate()
    proc.wait(timeout=10)


def everything_phalanx_shows_and_keeps(
    tmp_path: Path, env: dict[str, str], run: subprocess.CompletedProcess, run_id: str
) -> dict[str, str]:
    """Every text a user or another process can see about the run, by where it is."""
    state = tmp_path / "state"
    seen = {"terminal": run.stdout + run.stderr}
    for what in (["status"], ["status", run_id], ["logs", run_id], ["report", run_id, "-o", str(tmp_path / "r.html")]):
        out = phalanx_cli(*what, env=env)
        seen[f"phalanx {what[0]}"] = out.stdout + out.stderr
    seen["report page"] = (tmp_path / "r.html").read_text()
    with sqlite3.connect(state / "runs.sqlite") as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            rows = con.execute(f"SELECT * FROM {table}").fetchall()
            seen[f"run DB table {table}"] = "\n".join(repr(v) for row in rows for v in row)
    for path in state.rglob("*"):  # the DB's raw bytes (and -wal), rank logs, reports
        if path.is_file():
            seen[str(path.relative_to(tmp_path))] = path.read_bytes().decode("latin-1")
    return seen


@pytest.mark.parametrize("case", ["nothing listens", "wrong password", "right password, no such db"])
def test_a_password_in_the_rendezvous_url_is_never_shown_or_kept(case, tmp_path, redis_with_password, fault):
    right, port = redis_with_password
    secret = right if case == "right password, no such db" else f"wrongpw-{uuid.uuid4().hex}"
    url = {
        "nothing listens": f"redis://:{secret}@127.0.0.1:{free_port()}/0",
        "wrong password": f"redis://default:{secret}@127.0.0.1:{port}/0",
        "right password, no such db": f"redis://:{secret}@127.0.0.1:{port}/999",
    }[case]
    fault.describe(f"a password in the rendezvous URL, rendezvous fails ({case})")
    wf, site = write_run_files(tmp_path, url)
    env = cli_env(tmp_path)
    t0 = time.monotonic()
    run = phalanx_cli("run", "--plain", str(wf), "--site", str(site), env=env)
    fault.detected(time.monotonic() - t0)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "could not start" in run.stderr and "127.0.0.1" in run.stderr  # still says where

    seen = everything_phalanx_shows_and_keeps(tmp_path, env, run, run_id_of(run))
    leaks = [where for where, text in seen.items() if secret in text]
    assert not leaks, f"the password is in: {leaks}"
    assert "redis://" in seen["phalanx status"] and ":***@127.0.0.1" in seen["report page"]
    fault.outcome(
        "stage failed naming the URL as redis://…:***@host; the password is in none of: "
        "terminal, status, logs, report, run DB"
    )
    fault.data_lost("none")


# ---- defect 7: directories another user made ------------------------------------------------
@pytest.fixture(scope="module")
def mallory() -> int:
    """The uid of a second local user (created without a home if missing)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to create a second user and give it a directory")
    try:
        return pwd.getpwnam(MALLORY).pw_uid
    except KeyError:
        pass
    made = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", MALLORY], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot create a second user: useradd: {made.stderr.strip()}")
    return pwd.getpwnam(MALLORY).pw_uid


@pytest.fixture
def victim(monkeypatch):
    """A fresh user name for this process (``getpass.getuser`` reads LOGNAME first): the
    default directories ``<base>/phalanx-<name>`` are new paths; removed afterwards."""
    name = f"victim{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("LOGNAME", name)
    assert getpass.getuser() == name
    yield name
    bases = {Path("/dev/shm"), Path("/var/tmp"), Path(tempfile.gettempdir())}
    for base in bases:
        subprocess.run(["rm", "-rf", str(base / f"phalanx-{name}")], check=True)


def store_base() -> Path:  # where tiers.default_root puts phalanx-<user>
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def planted(path: Path, uid: int, mode: int = 0o777) -> Path:
    """``path`` made by another user, as an attacker would leave it (with a catalogue inside)."""
    path.mkdir()
    (path / "store").mkdir()
    with sqlite3.connect(path / "store" / "meta.sqlite") as con:
        con.execute("CREATE TABLE planted (x)")
    for p in (path, path / "store", path / "store" / "meta.sqlite"):
        os.chown(p, uid, uid)
    os.chmod(path, mode)
    return path


def test_a_store_root_another_user_made_is_refused(tmp_path, mallory, victim, fault):
    fault.describe("a hostile local user pre-created the default store root (mode 777, own meta.sqlite)")
    root = planted(store_base() / f"phalanx-{victim}", mallory)
    meta = root / "store" / "meta.sqlite"
    before = (meta.read_bytes(), meta.stat().st_mtime_ns)
    wf, site = write_run_files(tmp_path)
    env = {k: v for k, v in cli_env(tmp_path, LOGNAME=victim).items() if not k.startswith("PHALANX_STORE")}
    t0 = time.monotonic()
    run = phalanx_cli("run", "--plain", str(wf), "--site", str(site), env=env)
    fault.detected(time.monotonic() - t0)
    assert run.returncode != 0
    message = f"refusing to use {root}"
    assert message in run.stderr, run.stderr
    refusal = run.stderr[run.stderr.index(message) :]
    assert f"owned by {MALLORY} (uid {mallory})" in refusal and "mode 0777" in refusal
    assert "PHALANX_STORE" in refusal  # what to do instead
    assert (meta.read_bytes(), meta.stat().st_mtime_ns) == before  # the planted catalogue never opened
    assert sorted(os.listdir(root / "store")) == ["meta.sqlite"]  # nothing written there
    fault.outcome("refused before any stage ran, naming path, owner and mode; the planted catalogue untouched")
    fault.data_lost("none")


def test_every_default_directory_refuses_another_users(tmp_path, mallory, victim, monkeypatch):
    monkeypatch.delenv("PHALANX_STORE_SPILL", raising=False)
    monkeypatch.delenv("PHALANX_LOG_DIR", raising=False)
    spill = planted(
        Path("/var/tmp" if Path("/var/tmp").is_dir() else tempfile.gettempdir()) / f"phalanx-{victim}",
        mallory,
        mode=0o755,
    )  # not writable by others, but not ours: refused too
    with pytest.raises(UnsafePathError, match=f"{spill}.*owned by {MALLORY}.*PHALANX_STORE_SPILL"):
        default_spill_root()
    logs = Path(tempfile.gettempdir()) / f"phalanx-{victim}"
    if logs != spill:
        planted(logs, mallory)
    with pytest.raises(UnsafePathError, match=f"{logs}.*PHALANX_LOG_DIR"):
        default_log_root()
    state = planted(tmp_path / "state", mallory)
    with pytest.raises(UnsafePathError, match=f"{state}.*PHALANX_STATE"):
        RunDB(state)


def test_a_symlink_or_a_writable_dir_of_ones_own_is_refused_and_a_readable_one_made_private(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        RunDB(tmp_path / "link")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(UnsafePathError, match=r"mode 0777 lets group and others write.*chmod 700"):
        RunDB(tmp_path / "open")
    (tmp_path / "readable").mkdir()
    os.chmod(tmp_path / "readable", 0o755)
    RunDB(tmp_path / "readable")
    assert mode(tmp_path / "readable") == 0o700


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o777


def test_what_phalanx_creates_is_private(tmp_path, victim, monkeypatch, fault):
    """A run with every default location: the store root and the state directory it creates
    are 0700 with nothing looser inside; the catalogue, run DB and partitions are 0600."""
    fault.describe("files and directories a run creates, seen by another local user")
    for var in ("PHALANX_STORE", "PHALANX_STORE_SPILL", "PHALANX_STATE", "PHALANX_LOG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    wf, site = write_run_files(tmp_path)
    env = {
        **{k: v for k, v in cli_env(tmp_path, LOGNAME=victim).items() if not k.startswith("PHALANX_S")},
        "XDG_STATE_HOME": str(tmp_path / "xdg"),
    }
    run = phalanx_cli("run", "--plain", str(wf), "--site", str(site), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    root, state = store_base() / f"phalanx-{victim}", tmp_path / "xdg" / "phalanx"
    store = px.Store(root / "store", session=f"sec-{run_id_of(run)}")
    assert store.read("tx").num_rows == 1000

    made = {p: mode(p) for top in (root, state) for p in [top, *top.rglob("*")] if "logs" not in p.parts}
    assert {p.name for p in made} >= {"meta.sqlite", "runs.sqlite", "part-00000.arrow", "part-00001.arrow"}
    loose = {str(p): f"{m:04o}" for p, m in made.items() if m != (0o700 if p.is_dir() else 0o600)}
    assert not loose, f"readable or writable by others: {loose}"
    fault.outcome("store root and state directory 0700; catalogue, run DB and partitions 0600")
    fault.data_lost("none")


def test_rank_logs_are_private(tmp_path):
    wf = tmp_path / "say.yaml"
    wf.write_text(
        textwrap.dedent(f"""
        name: say
        stages:
          say: {{kind: command, ranks: 2, command: [{sys.executable!r}, -c, "print('hello')"]}}
    """)
    )
    run = phalanx_cli("run", "--plain", str(wf), env=cli_env(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    logs = tmp_path / "state" / "logs"
    made = {p: mode(p) for p in [logs, *logs.rglob("*")]}
    assert {"rank-0.log", "rank-1.log"} <= {p.name for p in made}
    loose = {str(p): f"{m:04o}" for p, m in made.items() if m != (0o700 if p.is_dir() else 0o600)}
    assert not loose, f"readable by others: {loose}"


@pytest.mark.parametrize(
    "text, shown",
    [
        ("rendezvous 'redis://:pw1@127.0.0.1:1/0'", "rendezvous 'redis://:***@127.0.0.1:1/0'"),
        ("rediss://default:p@ss/w0rd@h:6380/0?prefix=x", "rediss://default:***@h:6380/0?prefix=x"),
        (
            "postgresql://bob:s3cr3t@db/x and https://ghp_token@github.com/a",
            "postgresql://bob:***@db/x and https://***@github.com/a",
        ),
        (
            "s3://b/p?endpoint_override=http://minio:9000&access_key=AKIA1&secret_key=abc%2Fdef",
            "s3://b/p?endpoint_override=http://minio:9000&access_key=***&secret_key=***",
        ),
        (
            "env {'PHALANX_AUTHKEY': '9f8e7d6c', 'AWS_SECRET_ACCESS_KEY': 'wJalr/K7+'}",
            "env {'PHALANX_AUTHKEY': '***', 'AWS_SECRET_ACCESS_KEY': '***'}",
        ),
        ("?password=x&user=me", "?password=***&user=me"),
        # what is no credential stays as it is: plain URLs, an e-mail in a path, a field named in a message
        (
            "tcp://127.0.0.1:5000 file:///tmp/x http://h:8080/p?mail=a@b.c",
            "tcp://127.0.0.1:5000 file:///tmp/x http://h:8080/p?mail=a@b.c",
        ),
        ("wf.yaml:7: stages.gen.password: unknown key", "wf.yaml:7: stages.gen.password: unknown key"),
    ],
)
def test_redact_masks_every_form_of_credential(text, shown):
    assert redact(text) == shown


def test_redact_masks_this_processs_secrets_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("PHALANX_AUTHKEY", "00112233445566778899aabb")
    monkeypatch.setenv("PHALANX_STORE_METADATA", "redis://:metapassword1@h:6379/0")
    assert redact("key 00112233445566778899aabb, then metapassword1 alone") == "key ***, then *** alone"
