"""Caching across runs (``cache: true``) and ``phalanx store gc``: a cacheable stage whose
fingerprint and input data match an earlier run's reuses its sealed, verified outputs (hard
links, no byte copied) instead of running; a changed param, a corrupted cached partition or
other upstream data make it run, and an event says why; gc removes what no run references."""

from __future__ import annotations

import os
import sqlite3
import textwrap
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from apps import wf_generate_reference as generated
from test_store_backends import s3_endpoint, s3_root  # noqa: F401  (the moto fixture)

import phalanx as px
from phalanx.cli import main
from phalanx.errors import DatasetExistsError
from phalanx.orchestrator.cache import cacheable, collect
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.store.tiers import part_file


class Runs:
    """One test's state directory, store root and apps' log; runs a workflow model there."""

    def __init__(self, tmp: Path):
        self.tmp, self.log = tmp, tmp / "ran.log"
        self.db = RunDB(tmp / "state")
        self.root = tmp / "store"
        self.site = Site(name="cache-test", cores=2, store={"root": str(self.root)})

    def run(self, wf: Workflow):
        result = run_workflow(wf, self.site, db=self.db)
        assert result.ok, result.failed
        return result

    def events(self, run_id: str, kind: str | None = None) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in self.db.events(run_id):
            if e["stage"] and (kind is None or e["kind"] == kind):
                out.setdefault(e["stage"], []).append(f"{e['kind']}: {e['message']}")
        return out

    def ran(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def store(self, session: str) -> px.Store:
        return px.Store(self.root, session)

    def pipeline(self, rows: int = 400, name: str = "cw", generate_cache: bool | None = None, **gen_params) -> Workflow:
        return Workflow(
            name=name,
            cache=True,
            stages={
                "generate": Stage(
                    app="cache_apps:generate",
                    ranks=2,
                    params={"rows": rows, "seed": 3, "log": str(self.log), **gen_params},
                    outputs=["tx"],
                    cache=generate_cache,
                ),
                "totals": Stage(
                    app="cache_apps:totals",
                    ranks=2,
                    inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                    outputs=["totals"],
                    params={"log": str(self.log)},
                ),
            },
        )


@pytest.fixture
def runs(tmp_path):
    return Runs(tmp_path)


def expected_totals(rows: int) -> pd.DataFrame:
    return generated(rows, 2, seed=3).groupby("user", as_index=False)["amount"].sum()


def got_totals(store: px.Store) -> pd.DataFrame:
    return store.read("totals").to_pandas().sort_values("user").reset_index(drop=True)


def inode(store: px.Store, name: str, index: int = 0) -> int:
    return os.stat(Path(store.info(name).location) / part_file(index)).st_ino


@pytest.mark.slow  # whole workflow runs (the core lane is at its 5-minute budget)
def test_a_second_run_reuses_the_cached_outputs_without_running_a_stage(runs):
    first = runs.run(runs.pipeline())
    assert runs.ran() == ["generate", "totals"]
    second = runs.run(runs.pipeline())
    assert runs.ran() == ["generate", "totals"]  # neither app ran again
    cached = runs.events(second.run_id)
    for stage in ("generate", "totals"):
        assert cached[stage] == [
            f"cached: outputs of run {first.run_id} (stage {stage!r}) reused: fingerprint matches; "
            "2 partitions verified, link"
        ]
    a, b = runs.store(first.session), runs.store(second.session)
    pd.testing.assert_frame_equal(got_totals(b), expected_totals(400), check_dtype=False)
    assert inode(a, "tx", 1) == inode(b, "tx", 1) and b.info("tx").origin["session"] == first.session
    states = {s["stage"]: (s["state"], s["attempts"]) for s in runs.db.stages(second.run_id)}
    assert states == {"generate": ("succeeded", 0), "totals": ("succeeded", 0)}  # no gang, no attempt
    assert runs.db.stages(second.run_id)[0]["fingerprint"] == runs.db.stages(first.run_id)[0]["fingerprint"]


@pytest.mark.slow  # two full runs
def test_a_changed_param_runs_again_and_the_event_names_the_change(runs):
    first = runs.run(runs.pipeline(400))
    second = runs.run(runs.pipeline(800))
    assert runs.ran() == ["generate", "totals"] * 2
    said = runs.events(second.run_id, "not cached")
    assert said["generate"] == [f"not cached: runs: changed since run {first.run_id}: params.rows: 400 → 800"]
    assert said["totals"] == [f"not cached: runs: changed since run {first.run_id}: upstream stage 'generate' changed"]
    pd.testing.assert_frame_equal(got_totals(runs.store(second.session)), expected_totals(800), check_dtype=False)


@pytest.mark.slow  # whole workflow runs (the core lane is at its 5-minute budget)
def test_a_corrupted_cached_partition_is_recomputed_not_reused(runs):
    first = runs.run(runs.pipeline())
    earlier = runs.store(first.session)
    bad = Path(earlier.info("tx").location) / part_file(1)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in a column's values
    bad.write_bytes(bytes(data))
    second = runs.run(runs.pipeline())
    said = runs.events(second.run_id)["generate"]
    assert said[0].startswith(f"not cached: outputs of run {first.run_id} (stage 'generate') not reused: ChecksumError")
    assert "dataset 'tx' partition 1" in said[0] and "checksum mismatch" in said[0]
    assert (
        said[1] == "not cached: runs: no earlier run with the same fingerprint has outputs that can be reused (above)"
    )
    # generate ran again and made the same data: totals, which reads it, is reused
    assert runs.ran() == ["generate", "totals", "generate"]
    assert runs.events(second.run_id, "cached")["totals"][0].startswith(f"cached: outputs of run {first.run_id}")
    now = runs.store(second.session)
    assert inode(now, "tx", 1) != os.stat(bad).st_ino and bad.read_bytes() == bytes(data)  # the earlier file untouched
    assert now.read("tx").num_rows == 400  # verified
    pd.testing.assert_frame_equal(got_totals(now), expected_totals(400), check_dtype=False)


@pytest.mark.slow  # two full runs
def test_a_stage_whose_upstream_made_other_data_runs_although_its_fingerprint_matches(runs):
    """generate (not cacheable) reads its row count from a file, which no fingerprint covers:
    totals' fingerprint is unchanged, but the data it would read is not what it read then."""
    rows_file = runs.tmp / "rows"
    rows_file.write_text("400")
    first = runs.run(runs.pipeline(generate_cache=False, rows_file=str(rows_file)))
    rows_file.write_text("600")
    second = runs.run(runs.pipeline(generate_cache=False, rows_file=str(rows_file)))
    assert runs.ran() == ["generate", "totals"] * 2
    said = runs.events(second.run_id, "not cached")
    assert "generate" not in said  # not cacheable: never looked up
    assert said["totals"][0] == (
        f"not cached: outputs of run {first.run_id} (stage 'totals') not reused: input 'tx' (tx) is not the "
        "data it read then (stage 'generate' ran again and made other data)"
    )
    pd.testing.assert_frame_equal(got_totals(runs.store(second.session)), expected_totals(600), check_dtype=False)


@pytest.mark.slow  # whole workflow runs (the core lane is at its 5-minute budget)
def test_the_python_api_caches_across_two_workflows_with_the_identical_stage(runs):
    import cache_apps

    def workflow(name: str) -> px.Workflow:
        wf = px.Workflow(name, cache=True)
        wf.stage(ranks=2, outputs=["tx"], params={"rows": 300, "seed": 3, "log": str(runs.log)})(cache_apps.generate)
        return wf

    state = runs.tmp / "state"
    a = px.run(workflow("wf-a"), site=runs.site, state=state, progress=False)
    b = px.run(workflow("wf-b"), site=runs.site, state=state, progress=False)
    assert a.ok and b.ok and runs.ran() == ["generate"]
    assert runs.events(b.run_id)["generate"] == [
        f"cached: outputs of run {a.run_id} (stage 'generate' of workflow 'wf-a') reused: fingerprint matches; "
        "2 partitions verified, link"
    ]
    got = runs.store(b.session).read("tx").to_pandas()
    pd.testing.assert_frame_equal(got, generated(300, 2, seed=3).reset_index(drop=True), check_dtype=False)


def test_cache_is_the_stage_s_else_the_workflow_s_else_the_site_s():
    site_on, site_off = Site(name="on", cache=True), Site(name="off")
    st = lambda **kw: Stage(app="m:f", **kw)  # noqa: E731
    assert cacheable(Workflow(name="w", stages={"s": st()}), "s", site_on)
    assert not cacheable(Workflow(name="w", stages={"s": st()}), "s", site_off)
    assert not cacheable(Workflow(name="w", cache=False, stages={"s": st()}), "s", site_on)
    assert cacheable(Workflow(name="w", cache=False, stages={"s": st(cache=True)}), "s", site_off)
    assert not cacheable(Workflow(name="w", cache=True, stages={"s": st(cache=False)}), "s", site_on)


# ---- the CLI: run twice, then store gc ------------------------------------------------------------
@pytest.mark.slow  # whole workflow runs (the core lane is at its 5-minute budget)
def test_cli_a_cached_rerun_then_gc_dry_run_and_gc(runs, capsys):
    (runs.tmp / "site.yaml").write_text(f"name: gc-site\ncores: 2\nstore:\n  root: {runs.root}\n")
    wf = runs.tmp / "wf.yaml"
    wf.write_text(
        textwrap.dedent(
            f"""\
            name: gcwf
            cache: true
            stages:
              generate:
                app: cache_apps:generate
                ranks: 2
                params: {{rows: 400, seed: 3, log: {runs.log}}}
                outputs: [tx]
              totals:
                app: cache_apps:totals
                ranks: 2
                needs: [generate]
                inputs: {{tx: {{dataset: tx, by: [user]}}}}
                outputs: [totals]
                params: {{log: {runs.log}}}
            """
        )
    )
    state, site = str(runs.tmp / "state"), str(runs.tmp / "site.yaml")
    assert main(["run", str(wf), "--site", site, "--state", state, "--plain"]) == 0
    assert main(["run", str(wf), "--site", site, "--state", state, "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.count("cached    outputs of run") == 2 and runs.ran() == ["generate", "totals"]
    first, second = sorted(runs.db.runs(), key=lambda r: r["started"])
    assert main(["status", second["id"], "--state", state]) == 0
    assert capsys.readouterr().out.count(f"      cached: outputs of run {first['id']} (stage '") == 2
    earlier = runs.store(first["session"])
    shared = sum(d.nbytes for d in earlier.meta.list(first["session"]))
    runs.store("notes").put("mine", pa.table({"x": [1, 2]}))  # no run's session: never removed
    with sqlite3.connect(runs.db.path) as con:  # the first run's record deleted: its session is garbage
        con.execute("DELETE FROM runs WHERE id=?", (first["id"],))
    gc = ["store", "--root", str(runs.root), "gc", "--state", state, "--min-age", "0"]

    assert main([*gc, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {first['session']}: 2 datasets" in out and "not in the run database" in out
    assert "dry run: nothing removed" in out
    assert set(earlier.sessions()) == {first["session"], second["session"], "notes"}

    assert main(gc) == 0
    out = capsys.readouterr().out
    assert f"removed {first['session']}: 2 datasets" in out
    freed = int(out.split("freed ")[1].split(" bytes")[0].replace(",", ""))
    assert freed < shared  # the second run's links keep the partitions' bytes
    assert set(earlier.sessions()) == {second["session"], "notes"}
    assert not (runs.root / first["session"]).exists()
    later = runs.store(second["session"])
    later.new_attempt()  # nothing trusted: every partition checked again
    pd.testing.assert_frame_equal(got_totals(later), expected_totals(400), check_dtype=False)
    assert later.read("tx").num_rows == 400 and runs.store("notes").read("mine").num_rows == 2


def test_gc_keeps_running_runs_recent_sessions_and_other_users_and_keep_last_drops_the_rest(tmp_path):
    db, store = RunDB(tmp_path / "state"), px.Store(tmp_path / "store")
    made = {}
    for i in range(4):  # runs of one workflow, oldest first; the last still running (this process)
        run_id, session = db.new_run("w", "<test>", "local", None, {"s": 1})
        store.for_session(session).put("out", pa.table({"x": list(range(100 * (i + 1)))}))
        made[i] = (run_id, session)
        if i < 3:
            db.set_run(run_id, "succeeded")
    with sqlite3.connect(db.path) as con:  # started one second apart (new_run ids sort to the second)
        for i, (run_id, _) in made.items():
            con.execute("UPDATE runs SET started=? WHERE id=?", (1000.0 + i, run_id))
    os.chown(tmp_path / "store" / made[0][1], 12345, -1)  # another user's (the tests run as root)
    report = collect(store, db, keep_last=1, min_age=0, dry_run=False)
    assert sorted(c.session for c in report.removed) == sorted([made[1][1], made[2][1]])  # older than the one kept
    kept = dict(report.kept)
    assert kept[made[3][1]].endswith("(running)") and kept[made[0][1]] == "its directory is another user's"
    assert report.freed == sum(c.bytes for c in report.removed) and set(store.sessions()) == {made[0][1], made[3][1]}
    # a run that ended just now, dropped by keep_last=0: used within --min-age (an hour), it stays
    run_id, session = db.new_run("w", "<test>", "local", None, {"s": 1})
    store.for_session(session).put("out", pa.table({"x": [1]}))
    db.set_run(run_id, "succeeded")
    report = collect(store, db, keep_last=0, dry_run=True)
    assert report.removed == [] and dict(report.kept)[session].startswith("used 0s ago")


def test_store_adopt_refuses_a_name_taken_and_never_writes_the_source(tmp_path):
    src = px.Store(tmp_path / "store", "a")
    src.put("t", [pa.table({"x": [1, 2]}), pa.table({"x": [3]})])
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "store" / "a").rglob("*"))
    dst = src.for_session("b")
    dst.put("t", pa.table({"x": [9]}))
    with pytest.raises(DatasetExistsError):
        dst.adopt(src, "t")
    adopted = dst.adopt(src, "t", replace=True)
    assert adopted.how == "link" and dst.read("t").column("x").to_pylist() == [1, 2, 3]
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "store" / "a").rglob("*")) == before
    src.delete_session()
    assert dst.read("t").column("x").to_pylist() == [1, 2, 3]


def test_store_adopt_copies_across_file_systems(tmp_path):
    """A spilled source (the spill directory on another file system than /dev/shm) cannot be
    linked: its bytes are copied, checked the same."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="phalanx-adopt-", dir="/dev/shm"))
    try:
        src = px.Store(root / "store", "a", memory_budget=0, spill=tmp_path / "spill")
        src.put("t", pa.table({"x": list(range(1000))}))
        assert src.spilled("t")
        dst = src.for_session("b")
        assert dst.adopt(src, "t").how == "copy"
        assert dst.read("t").column("x").to_pylist() == list(range(1000))
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_old_run_databases_get_the_fingerprint_hash_column_filled(tmp_path):
    state = tmp_path / "state"
    db = RunDB(state)
    run_id, _ = db.new_run("w", "<test>", "local", None, {"s": 1})
    db.set_stage(run_id, "s", "succeeded", fingerprint={"hash": "abc", "stage": {}})
    with sqlite3.connect(db.path) as con:  # as a database of the version before: no column, no index
        con.execute("DROP INDEX stages_by_fp_hash")
        con.execute("ALTER TABLE stages DROP COLUMN fp_hash")
    again = RunDB(state)
    assert [c["run_id"] for c in again.cache_candidates("abc", "other")] == [run_id]
    with sqlite3.connect(db.path) as con:
        assert con.execute("SELECT name FROM sqlite_master WHERE name='stages_by_fp_hash'").fetchone()


@pytest.mark.slow  # a moto server of its own
def test_store_adopt_on_an_object_store_is_a_server_side_copy_and_checked(s3_endpoint, tmp_path):  # noqa: F811
    from phalanx.errors import ChecksumError

    src = px.Store(s3_root(s3_endpoint), "a", metadata=str(tmp_path / "meta.sqlite"))
    src.put("t", [pa.table({"x": [1, 2]}), pa.table({"x": [3]})])
    dst = src.for_session("b")
    adopted = dst.adopt(src, "t")
    assert adopted.how == "server-side copy" and adopted.info.location != src.info("t").location
    src.put("u", pa.table({"x": list(range(100))}))
    info = src.info("u")
    with src.tier.fs.open_output_stream(f"{src.tier._path(info.location)}/{part_file(0)}") as out:
        out.write(b"not the partition that was sealed")
    with pytest.raises(ChecksumError, match="dataset 'u' partition 0"):
        dst.adopt(src, "u")
    assert not dst.exists("u") and dst.unsealed() == []
    src.delete_session()
    assert dst.read("t").column("x").to_pylist() == [1, 2, 3]
