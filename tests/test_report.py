"""`phalanx report`: the HTML page of a run shows what the run database holds, escaped."""

from __future__ import annotations

import html
import re
import sqlite3
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from phalanx.orchestrator import scheduler
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.report import LABEL_W, RIGHT, WIDTH, UnknownRun, summary, write_report
from phalanx.orchestrator.rundb import RunDB

SVG = "{http://www.w3.org/2000/svg}"
WORKFLOW = "report-demo"
GEN = "gen.rows-1"  # workflow and stage names are plain (validated): markup goes in by hand below
FAILURE = "<b>planned failure 1</b> & <script>alert(1)</script>"


def totals_failing_with_markup(env):
    """apps:wf_totals (imported on the ranks as test_report:...) whose planned failure carries markup."""
    from apps import wf_totals

    try:
        return wf_totals(env)
    except RuntimeError as exc:
        raise RuntimeError(FAILURE.replace("planned failure 1", str(exc))) from None


# ---- a small DOM from html.parser ----------------------------------------------------------
class Node:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Node | None):
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        found = []
        for c in self.children:
            if isinstance(c, Node):
                if (
                    (tag is None or c.tag == tag)
                    and (cls is None or cls in c.classes())
                    and all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
                ):
                    found.append(c)
                found += c.all(tag, cls, **attrs)
        return found

    def one(self, *args, **kwargs) -> Node:
        found = self.all(*args, **kwargs)
        assert len(found) == 1, (args, kwargs, len(found))
        return found[0]


class Tree(HTMLParser):
    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#root", {}, None)
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(node)
        if tag not in self.VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.cur))

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        assert node is not None and node.parent is not None, f"stray </{tag}>"
        self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse(path: Path) -> tuple[str, Node, ET.Element]:
    page = path.read_text(encoding="utf-8")
    svg = re.search(r"<svg\b.*?</svg>", page, re.S)
    assert svg, "no inline SVG"
    return page, Tree(page).root, ET.fromstring(svg.group(0))  # the SVG is well-formed XML


def number(text: str) -> int:
    return int(text.split()[0].replace(",", ""))


# ---- one real run: a clean stage, then a stage failing once and retried -------------------
@pytest.fixture(scope="module")
def retried(tmp_path_factory):
    """Small gangs and no backoff: starting ranks is most of this module's time."""
    tmp = tmp_path_factory.mktemp("report")
    db = RunDB(tmp / "state")
    wf = Workflow(
        name=WORKFLOW,
        stages={
            GEN: Stage(app="apps:wf_generate", ranks=1, params={"rows": 4000, "seed": 3}, outputs=["tx"]),
            "totals": Stage(
                app="test_report:totals_failing_with_markup",
                ranks=2,
                retries=1,
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                outputs=["totals"],
                params={"fail_marker": str(tmp / "marker"), "fail_times": 1},
            ),
        },
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "BACKOFF_S", (0.0,))
        result = scheduler.run_workflow(wf, Site(name="test4", cores=4), db=db)
    assert result.ok, result.failed
    return db, result.run_id, write_report(db, result.run_id)


def test_written_to_the_state_dir_by_default_or_where_asked(retried, tmp_path):
    db, run_id, path = retried
    assert path == db.state_dir / "reports" / f"{run_id}.html" and path.is_file()
    assert write_report(db, run_id, tmp_path / "r.html") == tmp_path / "r.html"
    assert write_report(db, run_id, tmp_path) == tmp_path / f"{run_id}.html"
    page = path.read_text()
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_the_page_is_readable_by_its_user_only(tmp_path):
    """Like the run DB and the logs it shows (0600 in 0700 directories), whatever the umask; an
    older report left 0644 in <state>/reports is made 0600 when written again."""
    import os
    import stat

    db = RunDB(tmp_path / "state")
    run_id, _ = db.new_run("modes", "wf.yaml", "here", None, {"a": 1})
    old = os.umask(0o022)
    try:
        stale = db.state_dir / "reports" / f"{run_id}.html"
        stale.parent.mkdir(mode=0o700)
        stale.write_text("an older page")
        stale.chmod(0o644)
        paths = [write_report(db, run_id), write_report(db, run_id, tmp_path / "asked.html")]
    finally:
        os.umask(old)
    assert paths[0] == stale and "an older page" not in stale.read_text()
    assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in paths] == [oct(0o600)] * 2
    assert oct(stat.S_IMODE(stale.parent.stat().st_mode)) == oct(0o700)


def test_header_names_the_run(retried):
    db, run_id, path = retried
    _, root, _ = parse(path)
    header = {tr.one("th").text(): tr.one("td").text() for tr in root.one("table", id="run").all("tr")}
    run = db.run(run_id)
    assert header["workflow"] == WORKFLOW and header["run id"] == run_id and header["state"] == "succeeded"
    assert header["site"] == "test4" and header["session"] == run["session"] and header["file"] == "<python>"
    assert header["total time"].endswith("s") and header["ended"] != "-"


def test_every_stage_has_a_lane_and_a_section(retried):
    db, run_id, path = retried
    _, root, svg = parse(path)
    names = [s["stage"] for s in db.stages(run_id)]
    assert names == [GEN, "totals"]
    assert [g.get("data-stage") for g in svg.iter(f"{SVG}g") if g.get("class") == "lane"] == names
    assert [s.attrs["data-stage"] for s in root.all("section", cls="stage")] == names
    assert [h.text() for h in root.all("h3", cls="stage-name")] == names


def test_one_bar_per_attempt_and_per_rank_of_each_succeeded_attempt(retried):
    db, run_id, path = retried
    _, _, svg = parse(path)
    lanes = {g.get("data-stage"): g for g in svg.iter(f"{SVG}g") if g.get("class") == "lane"}
    for st in db.stages(run_id):
        attempts = db.attempts(run_id, st["stage"])
        bars = [g for g in lanes[st["stage"]].iter(f"{SVG}g") if "attempt" in g.get("class", "").split()]
        assert [(int(g.get("data-attempt")), g.get("class").split()[1]) for g in bars] == [
            (a["attempt"], a["state"]) for a in attempts
        ]
        succeeded = sum(a["state"] == "succeeded" for a in attempts)
        ranks = [r for r in lanes[st["stage"]].iter(f"{SVG}rect") if r.get("class") == "rank"]
        assert len(ranks) == st["ranks"] * succeeded
        for g in bars:  # each rank once per succeeded attempt, with its pid and host in the tooltip
            mine = [r for r in g.iter(f"{SVG}rect") if r.get("class") == "rank"]
            assert sorted(int(r.get("data-rank")) for r in mine) == (
                list(range(st["ranks"])) if g.get("class") == "attempt succeeded" else []
            )
            attempt = next(a for a in attempts if a["attempt"] == int(g.get("data-attempt")))
            info = {r["rank"]: r for r in attempt["rank_info"]}
            for r in mine:
                tip = r.find(f"{SVG}title").text
                rank = info[int(r.get("data-rank"))]
                assert f"rank {rank['rank']} · pid {rank['pid']} · host {rank['host']}" in tip
                assert tip.startswith(f"stage {st['stage']} · attempt {g.get('data-attempt')}")
    assert sum(1 for _ in svg.iter(f"{SVG}rect") if _.get("class") == "rank") == 1 * 1 + 2 * 1


def test_rows_bytes_and_repartition_paths_are_the_run_dbs(retried):
    db, run_id, path = retried
    page, root, _ = parse(path)
    for st in db.stages(run_id):
        sec = root.one("section", data_stage=st["stage"])
        shown = {
            tr.attrs["data-name"]: (number(tr.one("td", cls="rows").text()), number(tr.one("td", cls="bytes").text()))
            for tr in sec.all("tr", cls="output")
        }
        assert shown == {k: tuple(v) for k, v in st["outputs"].items()} and shown
        inputs = {
            tr.attrs["data-name"]: {
                "dataset": tr.one("td", cls="dataset").text(),
                "rows": number(tr.one("td", cls="rows").text()),
                "bytes": number(tr.one("td", cls="bytes").text()),
                "plan": tr.one("td", cls="plan").text(),
                "read_here": number(tr.one("td", cls="read_here").text()),
                "fetched": number(tr.one("td", cls="fetched").text()),
            }
            for tr in sec.all("tr", cls="input")
        }
        assert inputs == st["inputs"]
        facts = {tr.one("th").text(): tr.one("td").text() for tr in sec.one("table", cls="kv").all("tr")}
        assert facts["state"] == st["state"] and int(facts["ranks"]) == st["ranks"]
        assert int(facts["attempts"]) == st["attempts"]
    totals = {s["stage"]: s for s in db.stages(run_id)}["totals"]
    assert totals["inputs"]["tx"]["rows"] == 4000 and totals["inputs"]["tx"]["plan"]
    # one host: every stored byte read is read here, none fetched
    assert totals["inputs"]["tx"]["read_here"] > 0 and totals["inputs"]["tx"]["fetched"] == 0
    assert html.escape(totals["inputs"]["tx"]["plan"]) in page


def test_the_failed_attempt_is_drawn_failed_and_its_error_shown_escaped(retried):
    db, run_id, path = retried
    page, root, svg = parse(path)
    failed = db.attempts(run_id, "totals")[0]
    assert failed["state"] == "failed" and FAILURE in failed["error"]
    bar = next(g for g in svg.iter(f"{SVG}g") if g.get("class") == "attempt failed")
    assert bar.get("data-attempt") == "1"
    assert "attempt 1 · failed" in bar.find(f"{SVG}rect").find(f"{SVG}title").text
    block = root.one("div", cls="failure")
    assert block.attrs["data-stage"] == "totals" and block.attrs["data-attempt"] == "1"
    assert block.one("pre", cls="error").text() == failed["error"]  # exactly, once unescaped
    assert html.escape(FAILURE) in page and FAILURE not in page
    assert "<b>" not in page and "<script" not in page  # the markup stayed text
    events = [tr.all("td")[3].text() for tr in root.all("tr", cls="event")]
    assert [e for e in events if e != "start"] == ["succeeded", "failed", "retry", "succeeded"]


def test_names_with_markup_are_escaped(tmp_path):
    """Names are validated plain, but the page trusts nothing a database holds."""
    db = RunDB(tmp_path / "state")
    name = "gen <b>&"
    run_id, _ = db.new_run("w<i>", "wf.yaml", "here", None, {name: 1})
    page, root, svg = parse(write_report(db, run_id))
    assert "<i>" not in page and "<b>" not in page and html.escape(name) in page
    label = next(t for t in svg.iter(f"{SVG}text") if t.get("class") == "stage-label" and name in "".join(t.itertext()))
    assert label.find(f"{SVG}title").text == name
    assert root.one("head").one("title").text().endswith("w<i>")


def test_the_timeline_fits_the_picture_and_its_ticks_read_well(retried):
    db, run_id, path = retried
    _, _, svg = parse(path)
    _, _, width, height = map(float, svg.get("viewBox").split())
    assert width == WIDTH
    for r in svg.iter(f"{SVG}rect"):
        x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
        assert 0 <= x and x + w <= width + 0.01 and 0 <= y and y + h <= height + 0.01 and w > 0 and h > 0
    for g in svg.iter(f"{SVG}g"):  # rank bars lie inside their attempt's bar
        if "attempt" not in g.get("class", "").split():
            continue
        bar = g.find(f"{SVG}rect")
        bx, by, bw, bh = (float(bar.get(k)) for k in ("x", "y", "width", "height"))
        for r in g.iter(f"{SVG}rect"):
            x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
            assert bx - 0.1 <= x and x + w <= bx + bw + 0.1 and by <= y and y + h <= by + bh
    run = db.run(run_id)
    span = summary(db, run_id)["t1"] - run["started"]
    labels = [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "tick-label"]
    xs = [float(t.get("x")) for t in svg.iter(f"{SVG}text") if t.get("class") == "tick-label"]
    # whole seconds, or tenths for a run shorter than ~10 s (a fast machine's retried run)
    assert re.fullmatch(r"0(\.0+)?s", labels[0]) and 3 <= len(labels) <= 11
    assert all(re.fullmatch(r"\d+(\.\d+)?s", s) for s in labels), labels
    secs = [float(s[:-1]) for s in labels]
    assert xs[0] == LABEL_W and xs == sorted(xs) and xs[-1] <= WIDTH - RIGHT and secs[-1] <= span
    for t, x in zip(secs, xs):  # a tick at t seconds sits where the axis puts t
        assert x == pytest.approx(LABEL_W + (WIDTH - LABEL_W - RIGHT) * t / span, abs=0.06)
    for a in db.attempts(run_id):  # and so does every attempt's bar
        g = next(g for g in svg.iter(f"{SVG}g") if g.get("data-stage") == a["stage"])
        bar = next(b for b in g.iter(f"{SVG}g") if b.get("data-attempt") == str(a["attempt"])).find(f"{SVG}rect")
        expect = LABEL_W + (WIDTH - LABEL_W - RIGHT) * (a["started"] - run["started"]) / span
        assert float(bar.get("x")) == pytest.approx(expect, abs=0.06)


def test_an_unknown_run_is_a_clear_error(tmp_path):
    db = RunDB(tmp_path / "state")
    with pytest.raises(KeyError) as err:
        write_report(db, "20990101-000000-nosuch")
    assert isinstance(err.value, UnknownRun)
    assert str(err.value) == f"no run '20990101-000000-nosuch' in {db.path}"
    assert not (db.state_dir / "reports").exists()


# ---- a run written by hand: exact times, and the lanes that have no bar of their own -----------
def test_reused_skipped_failed_and_lost_stages(tmp_path):
    db = RunDB(tmp_path / "state")
    run_id, _ = db.new_run("hand", "wf.yaml", "here", None, {"made": 2, "broke": 1, "after": 1, "hung": 1})
    db.start_attempt(run_id, "made", 1, "g1", "/logs")
    db.end_attempt(
        run_id,
        "made",
        1,
        "succeeded",
        ranks=[
            {"rank": 0, "pid": 11, "host": "h<0>", "started": 1003.0, "ended": 1007.0},
            {"rank": 1, "pid": 12, "host": "h<0>", "started": 1003.5, "ended": 1006.0},
        ],
    )
    db.set_stage(run_id, "made", "succeeded", started=1001.0, ended=1008.0, outputs={"x": [10, 80]})
    db.event(run_id, "reused", "outputs sealed by an earlier attempt: not run again", "made")
    db.set_stage(run_id, "broke", "failed", started=1001.0, ended=1002.0, error="gang <img src=x> never started")
    db.set_stage(run_id, "after", "skipped", error="an upstream stage failed")
    db.set_stage(run_id, "hung", "running", started=1002.0)
    db.start_attempt(run_id, "hung", 1, "g2", "/logs")
    db.set_run(run_id, "cancelled")
    with sqlite3.connect(db.path) as con:  # times a 10 s picture with 1 s ticks
        con.execute("UPDATE runs SET started=1000.0, ended=1010.0")
        con.execute("UPDATE attempts SET started=1002.0, ended=1008.0 WHERE stage='made'")
        con.execute("UPDATE attempts SET started=1004.0 WHERE stage='hung'")
    page, root, svg = parse(write_report(db, run_id))
    lanes = {g.get("data-stage"): g for g in svg.iter(f"{SVG}g") if g.get("class") == "lane"}
    notes = {
        k: "".join(t.text for t in g.iter(f"{SVG}text") if t.get("class") == "lane-note") for k, g in lanes.items()
    }
    assert notes == {
        "made": "",
        "broke": "failed: no attempt recorded (gang <img src=x> never started)",
        "after": "skipped: an upstream stage failed",
        "hung": "",
    }
    tags = [(k, t.text) for k, g in lanes.items() for t in g.iter(f"{SVG}text") if t.get("class") == "lane-tag"]
    assert tags == [("made", "reused")]  # its bars are from the run's earlier invocation
    hung = next(g for g in lanes["hung"].iter(f"{SVG}g") if g.get("data-attempt") == "1")
    assert hung.get("class") == "attempt cancelled"  # the run is over: it never ends
    scale = (WIDTH - LABEL_W - RIGHT) / 10
    made = next(g for g in lanes["made"].iter(f"{SVG}g") if g.get("data-attempt") == "1")
    bar, *ranks = [r for r in made.iter(f"{SVG}rect")]
    assert (float(bar.get("x")), float(bar.get("width"))) == pytest.approx((LABEL_W + 2 * scale, 6 * scale), abs=0.06)
    assert [float(r.get(k)) for r in ranks for k in ("x", "width")] == pytest.approx(
        [LABEL_W + 3 * scale, 4 * scale, LABEL_W + 3.5 * scale, 2.5 * scale], abs=0.06
    )
    span = next(r for r in lanes["made"].iter(f"{SVG}rect") if r.get("class") == "stage-span")
    assert float(span.get("x")) == pytest.approx(LABEL_W + scale, abs=0.06)  # placed 1 s before the bar
    assert [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "tick-label"] == [f"{i}s" for i in range(11)]
    failure = root.one("div", cls="failure")
    assert failure.attrs["data-stage"] == "broke" and failure.one("pre").text() == "gang <img src=x> never started"
    assert "<img" not in page and "h&lt;0&gt;" in page


def test_credentials_in_the_run_db_are_masked_on_the_page(tmp_path):
    """A database written before redaction existed (raw SQL here): the page still masks them."""
    db = RunDB(tmp_path / "state")
    run_id, _ = db.new_run("creds", "wf.yaml", "here", None, {"s": 2})
    db.start_attempt(run_id, "s", 1, "g1", "/logs")
    secret, url = "pw-0f9e8d7c", "redis://app:pw-0f9e8d7c@10.0.0.5:6379/0"
    with sqlite3.connect(db.path) as con:
        con.execute("UPDATE runs SET site=?, file=?", (url, f"s3://b/wf.yaml?secret_key={secret}"))
        con.execute("UPDATE stages SET state='failed', error=?", (f"gang could not start (rendezvous {url!r})",))
        con.execute("UPDATE attempts SET state='failed', error=?", (f"ConnectionError: {url}\nPASSWORD={secret}",))
        con.execute(
            "INSERT INTO events VALUES (?,?,?,?,?)", (run_id, 1.0, "s", "failed", f"{{'password': '{secret}'}}")
        )
    page = write_report(db, run_id).read_text()
    assert secret not in page
    assert page.count("redis://app:***@10.0.0.5:6379/0") >= 3 and "secret_key=***" in page
