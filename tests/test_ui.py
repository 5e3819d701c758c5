"""``phalanx ui``: the dashboard's data against the run DB, its security, and the page itself in a
real browser (Debian's chromium, headless, through chromedriver) while a workflow runs."""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.ui import data

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.ui


def workflow(gate: Path) -> Workflow:
    return Workflow(
        name="board",
        stages={
            "wait": Stage(app="ui_apps:gated", ranks=2, params={"gate": str(gate)}, outputs=["out"]),
            "after": Stage(app="apps:wf_say", ranks=1, inputs={"tx": {"dataset": "out"}}),
            "breaks": Stage(app="ui_apps:fails_on_rank_1", ranks=2, needs=["wait"]),
            "uneven": Stage(app="ui_apps:uneven", ranks=2, needs=["wait"]),
        },
    )


@pytest.fixture
def db(tmp_path):
    return RunDB(tmp_path / "state")


@pytest.fixture
def board(db):
    from phalanx.ui.server import Dashboard

    b = Dashboard(db, port=0, poll_s=0.2).start()
    yield b
    b.stop()


def until(what, timeout=60.0, every=0.05):
    """Poll ``what()`` until it is truthy; its value (the test fails past the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)


def finished_run(db, tmp_path) -> str:
    gate = tmp_path / "gate"
    gate.write_text("")
    result = run_workflow(workflow(gate), Site(name="t", cores=4), db=db)
    assert not result.ok and set(result.failed) == {"breaks"}
    return result.run_id


def test_the_run_view_matches_the_run_db(db, tmp_path):
    run_id = finished_run(db, tmp_path)
    v = data.run(db, run_id)
    con = sqlite3.connect(db.path)  # read independently of RunDB
    states = dict(con.execute("SELECT stage, state FROM stages WHERE run_id=?", (run_id,)).fetchall())
    assert (
        {s["name"]: s["state"] for s in v["stages"]}
        == states
        == {
            "wait": "succeeded",
            "after": "succeeded",
            "breaks": "failed",
            "uneven": "succeeded",
        }
    )
    assert sorted(map(tuple, v["dag"]["edges"])) == [("wait", "after"), ("wait", "breaks"), ("wait", "uneven")]
    cols = {n["name"]: n["x"] for n in v["dag"]["nodes"]}
    assert cols["wait"] < cols["after"] == cols["breaks"]  # a stage is drawn right of what it waits for
    wait = next(s for s in v["stages"] if s["name"] == "wait")
    assert wait["outputs"]["out"]["rows"] == 10 + 20  # rank r wrote 10 * (r + 1) rows
    assert [f["stage"] for f in v["failures"]] == ["breaks"] and v["failures"][0]["ranks"] == [1]
    assert "planned failure on rank 1" in v["failures"][0]["error"]
    assert v["run"]["final"] and v["run"]["state"] == "failed"
    # rank 1 of "uneven" computed for a second while rank 0 waited for it at the barrier
    uneven = next(s for s in v["stages"] if s["name"] == "uneven")
    r0, r1 = uneven["rank_table"]
    assert r0["comm_s"] >= 0.8 and r1["elapsed"] - r1["comm_s"] >= 0.9
    assert uneven["straggler"] == 1
    assert r1["cpu"] > r0["cpu"]  # the final sample's CPU share is the whole task's: busy vs blocked


def test_every_request_needs_the_token(db, board, tmp_path):
    run_id = finished_run(db, tmp_path)
    c = httpx.Client(base_url=board.base)
    assert c.get("/api/runs").status_code == 401
    assert c.get("/api/runs", params={"token": "wrong"}).status_code == 401
    assert c.get("/", headers={"authorization": "Bearer wrong"}).status_code == 401
    first = c.get("/", params={"token": board.token}, follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/"  # the token leaves the address bar
    cookie = first.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    runs = c.get("/api/runs").json()  # the cookie from now on
    assert [r["id"] for r in runs] == [run_id]
    bearer = httpx.get(f"{board.base}/api/runs/{run_id}", headers={"authorization": f"Bearer {board.token}"})
    assert bearer.json()["run"]["id"] == run_id
    assert "default-src 'none'" in bearer.headers["content-security-policy"]
    # a page of another site that resolves its name to 127.0.0.1 (DNS rebinding) is refused
    assert c.get("/api/runs", headers={"host": "evil.example"}).status_code == 400
    assert c.get("/api/runs/no-such-run").status_code == 404


def test_the_store_page_lists_datasets_and_their_partitions(db, tmp_path, board):
    import phalanx as px

    run_id = finished_run(db, tmp_path)
    session = db.run(run_id)["session"]
    store = px.Store(session=session)
    from phalanx.ui.server import Dashboard

    b = Dashboard(db, port=0, store=store).start()
    try:
        got = httpx.get(
            f"{b.base}/api/store", params={"session": session}, headers={"authorization": f"Bearer {b.token}"}
        )
    finally:
        b.stop()
    (out,) = [d for d in got.json() if d["name"] == "out"]
    info = store.info("out")
    assert out["rows"] == info.num_rows == 30 and len(out["partitions"]) == info.num_partitions
    assert [p["rows"] for p in out["partitions"]] == [p.rows for p in info.partitions]


# ---- the page in a real browser ------------------------------------------------------------------
def chrome():
    """Headless chromium through Debian's chromedriver; skipped where they are not installed."""
    webdriver = pytest.importorskip("selenium.webdriver")
    driver_path = shutil.which("chromedriver")
    if not driver_path or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver_path), options=opts)


def test_the_page_follows_a_running_workflow_and_a_failed_ranks_log_is_one_click_away(db, board, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    shots = Path(os.environ.get("PHALANX_UI_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    gate = tmp_path / "gate"
    result: list = []
    runner = threading.Thread(
        target=lambda: result.append(run_workflow(workflow(gate), Site(name="t", cores=4), db=db)), daemon=True
    )
    runner.start()
    browser = chrome()

    # the page redraws a run's view whenever it changes: look elements up afresh each time
    def attr(selector, name):
        try:
            found = browser.find_elements(By.CSS_SELECTOR, selector)
            return found[0].get_attribute(name) if found else None
        except StaleElementReferenceException:
            return None

    def click(selector):
        def once():
            try:
                found = browser.find_elements(By.CSS_SELECTOR, selector)
                if found:
                    found[0].click()
                    return True
            except StaleElementReferenceException:
                pass
            return False

        until(once)

    def node_state(stage):
        return attr(f'#dag g[data-stage="{stage}"]', "data-state")

    try:
        run_id = until(lambda: [r["id"] for r in db.runs()])[0]
        browser.get(board.url)
        click(f'#runs-table tr[data-run="{run_id}"]')
        until(lambda: node_state("wait") == "running")
        until(lambda: "rank 1 waits for the gate" in db_log(db, run_id, "wait", 1))
        browser.save_screenshot(str(shots / "1-running.png"))
        until(lambda: node_state("after") == "pending")  # (None while the view is being redrawn)
        gate.write_text("")  # the stage may go on: the page updates without a reload
        until(lambda: node_state("wait") == "succeeded" and node_state("after") == "succeeded")
        until(lambda: node_state("breaks") == "failed" and node_state("uneven") == "succeeded")
        until(lambda: attr('#run-state [data-state="failed"]', "data-state"))
        browser.save_screenshot(str(shots / "2-failed.png"))
        # the failed rank's log: one click in the failures table
        click('#failures button[data-log="breaks/1"]')
        log = browser.find_element(By.ID, "loglines")  # outside the redrawn view
        until(lambda: "the disk is made of cheese" in log.text)
        browser.save_screenshot(str(shots / "3-log.png"))
        browser.find_element(By.ID, "logclose").click()
        until(lambda: not browser.find_element(By.ID, "logpanel").is_displayed())
        # the stage's ranks, with where they ran
        click('#dag g[data-stage="wait"] rect')
        until(lambda: attr("#stage-detail", "data-stage") == "wait")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#rank-table tr[data-rank]")) == 2
        # the straggler stands out: rank 1 of "uneven", which the other rank waited for
        click('#dag g[data-stage="uneven"] rect')
        until(lambda: attr("#rank-table tr.straggler", "data-rank") == "1")
        browser.save_screenshot(str(shots / "4-straggler.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()
        gate.write_text("")
        runner.join(60)
    assert result and set(result[0].failed) == {"breaks"}


def db_log(db, run_id, stage, rank) -> str:
    for a in db.attempts(run_id, stage):
        path = Path(a["log_dir"]) / f"rank-{rank}.log"
        if path.exists():
            return path.read_text()
    return ""


def test_the_command_prints_its_address_with_the_token_and_stops_on_ctrl_c(tmp_path):
    import re
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PHALANX_STATE": str(tmp_path / "state"), "PHALANX_STORE": str(tmp_path / "store")}
    db = RunDB(tmp_path / "state")
    run_id, _ = db.new_run("wf", "wf.yaml", "local", None, {"s": 1})  # running: this process drives it
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "ui", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        url = re.search(r"open (http://127\.0\.0\.1:\d+/\?token=\S+)", lines[1])
        assert url, lines
        assert str(tmp_path / "state") in lines[0] and str(tmp_path / "store") in lines[0]
        client = httpx.Client(follow_redirects=True)
        page = client.get(url.group(1))  # the printed address works as it is: token → cookie → page
        assert page.status_code == 200 and "app.js" in page.text
        base = url.group(1).split("?")[0]
        assert [r["id"] for r in client.get(base + "api/runs").json()] == [run_id]
        assert client.get(base + "api/store").json() == []
        # a browser following the run: its stream never ends by itself, and must not hold up Ctrl-C
        with client.stream("GET", base + f"api/runs/{run_id}/stream") as events:
            assert next(events.iter_lines()) == "event: run"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_the_dashboard_serves_prometheus_metrics_to_a_bearer(db, board, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    run_id = finished_run(db, tmp_path)
    got = httpx.get(f"{board.base}/metrics", headers={"authorization": f"Bearer {board.token}"})
    assert got.status_code == 200  # no redirect on the way
    families = {f.name: f for f in text_string_to_metric_families(got.text)}
    failed = [s for s in families["phalanx_stages"].samples if s.labels.get("run") == run_id]
    assert {s.labels["state"]: s.value for s in failed if s.value} == {"succeeded": 3, "failed": 1}
    assert httpx.get(f"{board.base}/metrics").status_code == 401


# ---- the real Prometheus scrapes them ----------------------------------------------------------
def prometheus_binary() -> str:
    """The pinned Prometheus server built by tests/infra/prometheus-build.sh (CI builds it first;
    PHALANX_REQUIRE_PROMETHEUS=1 there makes its absence a failure, not a skip)."""
    import subprocess

    script = Path(__file__).parent / "infra" / "prometheus-build.sh"
    path = subprocess.run([str(script), "--path"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.access(path, os.X_OK):
        if os.environ.get("PHALANX_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"no Prometheus at {path}: run {script}")
        pytest.skip(f"no Prometheus at {path} (tests/infra/prometheus-build.sh builds it)")
    return path


def test_the_real_prometheus_scrapes_the_dashboard_and_phalanx_metrics_with_their_tokens(db, board, tmp_path):
    import socket
    import subprocess

    from phalanx.observe.metrics import MetricsServer

    prometheus = prometheus_binary()
    run_id = finished_run(db, tmp_path)
    board_token, headless_token = tmp_path / "board.token", tmp_path / "headless.token"
    board_token.write_text(board.token)
    headless_token.write_text("headless-secret")
    for f in (board_token, headless_token):
        f.chmod(0o600)
    headless = MetricsServer(db, port=0, token="headless-secret").start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "prometheus.yml"
    jobs = [("dashboard", board.port, board_token), ("headless", headless.port, headless_token)]
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n"
        + "".join(
            f"  - job_name: {job}\n    authorization: {{credentials_file: {token}}}\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{p}']}}]\n"
            for job, p, token in jobs
        )
    )
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api/v1"

    def get(path, **params):
        try:
            return httpx.get(f"{api}/{path}", params=params, timeout=5).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None  # not up yet

    try:
        targets = until(
            lambda: (
                (t := get("targets"))
                and len(t["activeTargets"]) == 2
                and all(a["health"] == "up" for a in t["activeTargets"])
                and t
            ),
            timeout=90,
            every=0.2,
        )
        assert {a["labels"]["job"] for a in targets["activeTargets"]} == {"dashboard", "headless"}
        for job in ("dashboard", "headless"):
            found = until(
                lambda j=job: (r := get("query", query=f'phalanx_stages{{job="{j}",run="{run_id}"}}')) and r["result"],
                timeout=30,
                every=0.2,
            )
            by_state = {s["metric"]["state"]: float(s["value"][1]) for s in found if float(s["value"][1])}
            assert by_state == {"succeeded": 3.0, "failed": 1.0}, by_state
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        headless.stop()


def test_an_unreadable_run_db_is_said_as_json_not_a_crash(db, board):
    c = httpx.Client(base_url=board.base, headers={"authorization": f"Bearer {board.token}"})
    assert c.get("/api/runs").json() == []
    for leftover in db.path.parent.glob(db.path.name + "-*"):  # -wal, -shm
        leftover.unlink()
    db.path.write_bytes(b"this is not a database" * 100)
    got = c.get("/api/runs")
    assert got.status_code == 503 and "not a database" in got.json()["error"]
