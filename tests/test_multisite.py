"""One workflow, several sites: each stage on the site it names, with its own store, slots and
executor; an input sealed on another site's store crosses into the consumer's store first —
byte-identical, verified, once per run, and reused by --resume.

The sites here are this machine with different store roots and slot counts (the local
executor); the multi-site runs on SLURM + Kubernetes are in the multisite lane's other files."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from apps import wf_generate_reference as generated
from test_store_backends import s3_endpoint, s3_root  # noqa: F401  (the moto fixture)

import phalanx as px
from phalanx.cli import crossing_text
from phalanx.errors import GangError
from phalanx.executors import executors
from phalanx.executors.local import LocalExecutor
from phalanx.orchestrator import crossings
from phalanx.orchestrator.loading import load_workflow, site_plan
from phalanx.orchestrator.models import Site, Stage, StoreConfig, Workflow
from phalanx.orchestrator.report import write_report
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import RunResult, run_workflow
from phalanx.orchestrator.yamlio import ConfigError
from phalanx.store.tiers import part_file

pytestmark = pytest.mark.multisite


@pytest.fixture
def db(tmp_path):
    return RunDB(tmp_path / "state")


def two_sites(tmp_path: Path) -> tuple[Site, Site]:
    hpc = Site(name="hpc", cores=2, store=StoreConfig(root=str(tmp_path / "hpc-store")))
    cloud = Site(name="cloud", cores=3, store=StoreConfig(root=str(tmp_path / "cloud-store")))
    return hpc, cloud


def across(**totals_params) -> Workflow:
    """tx made on one site; two stages of the other site read it (by key, N=2 → M=3)."""
    return Workflow(
        name="across",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 4000, "seed": 5}, outputs=["tx"]),
            "totals": Stage(
                app="apps:wf_totals",
                ranks=3,
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                outputs=["totals"],
                params=totals_params,
            ),
            "again": Stage(
                app="apps:wf_totals",
                ranks=1,
                inputs={"tx": "tx"},
                outputs=["totals_again"],
                params={"output": "totals_again"},
            ),
        },
    )


def test_stages_on_two_sites_get_their_input_across_once_byte_identical(db, tmp_path):
    hpc, cloud = two_sites(tmp_path)
    wf = across()
    sites = {"generate": hpc, "totals": cloud, "again": cloud}
    result = run_workflow(wf, hpc, db=db, sites=sites)
    assert result.ok, result.failed
    made = px.Store(hpc.store.root, session=result.session)
    got = px.Store(cloud.store.root, session=result.session)
    assert not made.exists("totals") and got.exists("totals")  # sealed where its stage ran
    expected = generated(4000, 2, seed=5).groupby("user", as_index=False)["amount"].sum()
    for name in ("totals", "totals_again"):
        table = got.read(name).to_pandas().sort_values("user").reset_index(drop=True)
        pd.testing.assert_frame_equal(table, expected, check_dtype=False)
    # the crossed dataset: the same partition files, byte for byte, and the same checksums
    src, dst = made.info("tx"), got.info("tx")
    assert [p.checksum for p in src.partitions] == [p.checksum for p in dst.partitions]
    for i in range(src.num_partitions):
        assert (Path(src.location) / part_file(i)).read_bytes() == (Path(dst.location) / part_file(i)).read_bytes()
    # the run record says how each input got there; the bytes crossed once for two readers
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    crossings = [stages[s]["inputs"]["tx"]["crossed"] for s in ("totals", "again")]
    assert all(c["from"] == "hpc" and c["to"] == "cloud" and c["path"] == "direct" for c in crossings)
    assert sorted(c["bytes"] for c in crossings) == [0, src.nbytes]
    assert sorted(c["already"] for c in crossings) == [False, True]
    # where a user sees it: phalanx status and the HTML report
    status = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", result.run_id, "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0, status.stderr
    assert f"crossed from site hpc (direct, {src.nbytes / 1e6:.1f} MB in" in status.stdout, status.stdout
    assert "crossed from site hpc earlier in this run" in status.stdout
    page = write_report(db, result.run_id, tmp_path / "report.html").read_text()
    # the timeline: one group of lanes per site, each under its name, its stages in it
    hpc_at, cloud_at = (
        page.index('class="site-group" data-site="hpc"'),
        page.index('class="site-group" data-site="cloud"'),
    )
    assert hpc_at < page.index('data-stage="generate"') < cloud_at < page.index('data-stage="totals"')
    assert re.search(r"generate +succeeded .* on hpc", status.stdout), status.stdout
    assert f'<td class="crossed" data-bytes="{src.nbytes}">from hpc (direct, ' in page
    # ...and on the timeline: one bar in the lane of the stage that crossed it (not of the one
    # that found it crossed), at the start of its attempt, as long as the crossing took
    bars = re.findall(r'<g class="lane" data-stage="(\w+)"|<rect class="crossing" data-dataset="(\w+)" [^>]*>', page)
    lane, drawn = None, []
    for stage, dataset in bars:
        lane = stage or lane
        if dataset:
            drawn.append((lane, dataset))
    crossed_by = next(s for s in ("totals", "again") if not stages[s]["inputs"]["tx"]["crossed"]["already"])
    assert drawn == [(crossed_by, "tx")], drawn
    assert "input crossed · tx: hpc → cloud (direct)" in page
    events = [(e["stage"], e["kind"], e["message"]) for e in db.events(result.run_id)]
    assert any(k == "sites" and "generate on hpc, totals on cloud, again on cloud" in m for _, k, m in events)
    assert sum(1 for _, k, m in events if k == "crossed" and "hpc → cloud" in m) == 1


def failed_after_crossing(db, tmp_path: Path) -> tuple[Workflow, Site, Site, dict[str, Site], RunResult]:
    """A run whose totals (on cloud) fails once, for its own reason, after tx crossed from hpc:
    (workflow, hpc, cloud, sites, the failed run) for a resume."""
    hpc, cloud = two_sites(tmp_path)
    wf = across(fail_marker=str(tmp_path / "fail-once"), fail_times=1)
    del wf.stages["again"]
    sites = {"generate": hpc, "totals": cloud}
    first = run_workflow(wf, hpc, db=db, sites=sites)
    assert not first.ok and "planned failure" in first.failed["totals"]
    return wf, hpc, cloud, sites, first


def test_a_resumed_run_does_not_send_again_what_already_crossed(db, tmp_path):
    wf, hpc, cloud, sites, first = failed_after_crossing(db, tmp_path)
    tx = px.Store(cloud.store.root, session=first.session).info("tx")  # crossed before the failure
    again = run_workflow(wf, hpc, db=db, sites=sites, resume=first.run_id)
    assert again.ok, again.failed
    crossed = {s["stage"]: s for s in db.stages(first.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    assert crossed["already"] and crossed["bytes"] == 0
    assert px.Store(cloud.store.root, session=first.session).info("tx").version == tx.version


def test_validate_checks_each_stage_against_its_own_site(tmp_path):
    (tmp_path / "site-configs").mkdir()
    (tmp_path / "site-configs" / "small.yaml").write_text(f"name: small\ncores: 2\nstore: {{root: {tmp_path}/s}}\n")
    (tmp_path / "apps_here.py").write_text("def run(env):\n    pass\n")
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        textwrap.dedent(
            """\
            name: sites
            stages:
              a: {app: "apps:wf_generate", ranks: 3, site: small, outputs: [tx]}
              b:
                app: "apps:wf_totals"
                inputs: {tx: tx}
                site: nowhere
            """
        )
    )
    with pytest.raises(ConfigError) as err:
        load_workflow(wf)
    problems = err.value.problems
    assert any(p.startswith(f"{wf}:7:") and "no such site file 'nowhere'" in p for p in problems), problems
    wf.write_text(wf.read_text().replace("site: nowhere", "site: local"))
    with pytest.raises(ConfigError) as err:
        load_workflow(wf)
    assert err.value.problems == [f"{wf}:3: stages.a.ranks: 3 ranks, but site 'small' can give at most 2"]
    wf.write_text(wf.read_text().replace("ranks: 3", "ranks: 2"))
    got, site = load_workflow(wf)
    assert site.name == "local" and got.stages["a"].site == "small"


def site_files(tmp_path: Path) -> Path:
    """site-configs/ with an "hpc" and a "cloud" site (their own store roots) beside a workflow
    file of three stages on them: the ETL shape, made small."""
    (tmp_path / "site-configs").mkdir()
    for name, cores in (("hpc", 2), ("cloud", 3)):
        (tmp_path / "site-configs" / f"{name}.yaml").write_text(
            f"name: {name}\ncores: {cores}\nstore: {{root: {tmp_path}/{name}-store}}\n"
        )
    wf = tmp_path / "wf.yaml"
    wf.write_text(
        textwrap.dedent(
            """\
            name: etl-across
            site: hpc
            stages:
              generate: {app: "apps:wf_generate", ranks: 2, params: {rows: 3000, seed: 9}, outputs: [tx]}
              totals:
                app: "apps:wf_totals"
                ranks: 3
                site: cloud
                inputs: {tx: {dataset: tx, by: [user]}}
                outputs: [totals]
            """
        )
    )
    return wf


def test_validate_says_where_each_stage_runs_and_what_crosses_and_the_file_runs(tmp_path):
    wf = site_files(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "validate", str(wf)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "  generate: site 'hpc' (local), 2 ranks" in lines
    assert "  totals: site 'cloud' (local), 3 ranks" in lines
    assert "  crosses: tx from 'hpc' to 'cloud', direct (read by totals)" in lines
    result = px.run(str(wf), state=tmp_path / "state", progress=False)
    assert result.ok, result.failed
    got = px.Store(tmp_path / "cloud-store", session=result.session).read("totals").to_pandas()
    expected = generated(3000, 2, seed=9).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got.sort_values("user").reset_index(drop=True), expected, check_dtype=False)


def test_a_python_workflow_names_a_site_per_stage(tmp_path, monkeypatch):
    import apps

    site_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # ./site-configs
    wf = px.Workflow("py-across", site="hpc")
    wf.add(px.stage(apps.wf_generate, ranks=2, params={"rows": 2000, "seed": 4}, outputs=["tx"]))
    wf.add(px.stage(apps.wf_totals, ranks=1, site="cloud", inputs={"tx": "tx"}, outputs=["totals"]))
    result = px.run(wf, state=tmp_path / "state", progress=False)
    assert result.ok, result.failed
    got = px.Store(tmp_path / "cloud-store", session=result.session).read("totals").to_pandas()
    expected = generated(2000, 2, seed=4).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got.sort_values("user").reset_index(drop=True), expected, check_dtype=False)
    assert not px.Store(tmp_path / "hpc-store", session=result.session).exists("totals")


def test_sites_that_share_an_object_store_cross_through_it(db, tmp_path, seaweedfs_endpoint, monkeypatch):
    """Two sites whose stores do not reach each other's hosts but name the same exchange (a real
    S3-compatible server, SeaweedFS): tx goes up to it and down to the consumer's store.  Its
    credentials by reference (env:EXCHANGE); the AWS variables hold wrong ones, so a crossing
    that used them would be refused."""
    monkeypatch.setenv("EXCHANGE_ACCESS_KEY_ID", seaweedfs_endpoint.access_key)
    monkeypatch.setenv("EXCHANGE_SECRET_ACCESS_KEY", seaweedfs_endpoint.secret_key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    exchange = f"s3://phalanx-test/exchange?endpoint_override={seaweedfs_endpoint.endpoint}&credentials=env:EXCHANGE"
    hpc, cloud = two_sites(tmp_path)
    hpc.store.exchange = cloud.store.exchange = exchange
    wf = across()
    del wf.stages["again"]
    result = run_workflow(wf, hpc, db=db, sites={"generate": hpc, "totals": cloud})
    assert result.ok, result.failed
    crossed = {s["stage"]: s for s in db.stages(result.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    src = px.Store(hpc.store.root, session=result.session).info("tx")
    assert crossed["path"] == "object store" and crossed["bytes"] == 2 * src.nbytes  # up, then down
    records = str(db.stages(result.run_id)) + str(db.events(result.run_id))
    assert seaweedfs_endpoint.secret_key not in records
    # what crossed through the exchange was in transit: a succeeded run leaves nothing there
    assert px.Store(exchange, session=result.session).list() == []
    left = seaweedfs_endpoint.s3fs().get_file_info(pafs.FileSelector("phalanx-test/exchange", recursive=True))
    assert [f.path for f in left if f.type == pafs.FileType.File] == []
    said = [e["message"] for e in db.events(result.run_id) if e["kind"] == "exchange"]
    assert len(said) == 1 and said[0].startswith(
        "removed this run's 1 dataset(s) in transit from s3://phalanx-test/exchange"
    )
    got = px.Store(cloud.store.root, session=result.session)
    assert [p.checksum for p in got.info("tx").partitions] == [p.checksum for p in src.partitions]
    expected = generated(4000, 2, seed=5).groupby("user", as_index=False)["amount"].sum()
    table = got.read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    pd.testing.assert_frame_equal(table, expected, check_dtype=False)


class UnreachableExecutor(LocalExecutor):
    """A site whose resource manager does not answer when the run opens it (what a SLURM
    controller or a Ray head that is down looks like to ``open_run``)."""

    def open_run(self, *args, **kwargs) -> None:
        raise ConnectionError("the resource manager at 192.0.2.1:6817 refused the connection")


def test_a_site_that_cannot_be_reached_fails_only_its_stages_naming_it(db, tmp_path):
    if "unreachable" not in executors.names():
        executors.register(
            "unreachable", "test_multisite:UnreachableExecutor", config="phalanx.executors.local:LocalConfig"
        )
    hpc, _ = two_sites(tmp_path)
    down = Site(name="far", executor="unreachable", cores=2, store=StoreConfig(root=str(tmp_path / "far-store")))
    wf = across()
    sites = {"generate": hpc, "totals": down, "again": hpc}
    result = run_workflow(wf, hpc, db=db, sites=sites)
    assert not result.ok and set(result.failed) == {"totals"}
    assert result.failed["totals"].startswith("site 'far' cannot be reached: ConnectionError: the resource manager")
    stages = {s["stage"]: s["state"] for s in db.stages(result.run_id)}
    assert stages == {"generate": "succeeded", "totals": "failed", "again": "succeeded"}
    expected = generated(4000, 2, seed=5).groupby("user", as_index=False)["amount"].sum()
    table = px.Store(hpc.store.root, session=result.session).read("totals_again").to_pandas()
    pd.testing.assert_frame_equal(table.sort_values("user").reset_index(drop=True), expected, check_dtype=False)


def test_a_crossing_that_fails_is_retried_then_fails_the_stage_naming_both_sites(db, tmp_path, monkeypatch):
    """The exchange both sites name does not answer (nothing listens on its port): each attempt
    of the consumer tries its crossing three times (the pauses made short here), the stage's
    retries retry it, and the stage fails naming both sites and the exchange; what the producer
    sealed stays for a resume."""
    monkeypatch.setattr(crossings, "CROSSING_PAUSES_S", (0.01, 0.02))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hpc, cloud = two_sites(tmp_path)
    hpc.store.exchange = cloud.store.exchange = f"s3://nowhere/x?endpoint_override=http://127.0.0.1:{port}"
    wf = across()
    del wf.stages["again"]
    wf.stages["totals"].retries = 1
    result = run_workflow(wf, hpc, db=db, sites={"generate": hpc, "totals": cloud})
    assert not result.ok
    error = result.failed["totals"]
    assert error.startswith(
        "input 'tx' could not cross from site 'hpc' to site 'cloud' (object store s3://nowhere/x, 3 tries):"
    ), error
    attempts = db.attempts(result.run_id, "totals")
    assert [a["state"] for a in attempts] == ["failed", "failed"]
    retries = [e["message"] for e in db.events(result.run_id) if e["kind"] == "crossing retry"]
    assert len(retries) == 4 and retries[0].startswith("tx: try 1 of 3 from site 'hpc' to site 'cloud' (object store")
    assert retries[1].endswith("again in 0.02 s")
    assert px.Store(hpc.store.root, session=result.session).exists("tx")  # completed work stays


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def totals_of(rows: int, seed: int) -> pd.DataFrame:
    """The independent reference: per-user sums of what wf_generate makes on 2 ranks."""
    return generated(rows, 2, seed=seed).groupby("user", as_index=False)["amount"].sum()


def sorted_table(store: px.Store, name: str) -> pd.DataFrame:
    return store.read(name).to_pandas().sort_values("user").reset_index(drop=True)


def test_a_resume_after_the_producer_made_a_new_version_crosses_it_again(db, tmp_path):
    """totals fails after tx crossed; the resume changes generate's seed, so tx on hpc is a new
    version and the copy on cloud (crossed from the old one) is replaced — it used to fail the
    stage for good ('exists and did not cross from ...; pass replace=True')."""
    wf, hpc, cloud, sites, first = failed_after_crossing(db, tmp_path)
    got = px.Store(cloud.store.root, session=first.session)
    old = got.info("tx")
    wf.stages["generate"].params["seed"] = 6
    again = run_workflow(wf, hpc, db=db, sites=sites, resume=first.run_id)
    assert again.ok, again.failed
    made = px.Store(hpc.store.root, session=first.session).info("tx")
    assert made.version != old.origin["version"]  # the producer ran again: a new version
    new = got.info("tx")
    assert new.origin["version"] == made.version and new.version != old.version
    assert [p.checksum for p in new.partitions] == [p.checksum for p in made.partitions]
    pd.testing.assert_frame_equal(sorted_table(got, "totals"), totals_of(4000, 6), check_dtype=False)
    crossed = {s["stage"]: s for s in db.stages(first.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    assert not crossed["already"] and crossed["bytes"] == made.nbytes
    assert crossed["replaced"] == f"it replaces version {old.version} (crossed from version {old.origin['version']})"


def test_a_crossing_never_replaces_what_the_consumers_site_made_itself(db, tmp_path):
    """Both sites share one session name (store.session).  The cloud site's store holds a tx a
    user put there: the crossing refuses it, naming both sites, at once (no retry), and leaves
    it as it was.  A tx that generate itself sealed there, when the workflow ran it on cloud,
    is its stale output: replaced by the crossing once generate runs on hpc."""
    hpc, cloud = two_sites(tmp_path)
    hpc.store.session = "shared"
    wf = across()
    del wf.stages["again"]
    mine = px.Store(cloud.store.root, session="shared")
    mine.put("tx", [pa.Table.from_pandas(generated(10, 1))])
    before = mine.info("tx")
    refused = run_workflow(wf, hpc, db=db, sites={"generate": hpc, "totals": cloud})
    assert not refused.ok and set(refused.failed) == {"totals"}
    error = refused.failed["totals"]
    assert error.startswith(
        "input 'tx' cannot cross from site 'hpc' to site 'cloud': the store of site 'cloud' holds a dataset 'tx' "
        f"of its own (made there by a put, version {before.version}, session 'shared')"
    ), error
    assert not any(e["kind"] == "crossing retry" for e in db.events(refused.run_id))
    assert mine.info("tx").version == before.version and mine.info("tx").origin == {}
    # generate on cloud seals tx there; moved to hpc, its crossing replaces that output
    mine.delete("tx")
    on_cloud = run_workflow(wf, hpc, db=db, sites={"generate": cloud, "totals": cloud})
    assert on_cloud.ok, on_cloud.failed
    stale = mine.info("tx")
    assert stale.origin == {} and stale.producer == "generate"
    wf.stages["generate"].params["seed"] = 8
    moved = run_workflow(wf, hpc, db=db, sites={"generate": hpc, "totals": cloud})
    assert moved.ok, moved.failed
    made = px.Store(hpc.store.root, session="shared").info("tx")
    assert mine.info("tx").origin["version"] == made.version
    crossed = {s["stage"]: s for s in db.stages(moved.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    assert crossed["replaced"] == f"it replaces version {stale.version} (put there)"
    pd.testing.assert_frame_equal(sorted_table(mine, "totals"), totals_of(4000, 8), check_dtype=False)


def test_a_damaged_crossed_copy_is_sent_again_on_resume(db, tmp_path):
    """After tx crossed, a bit of its copy on cloud flips (totals then fails for its own
    reason).  The resume's crossing checks the copy before trusting it (once: a new driver is
    a new attempt), finds the damage and sends tx again; totals equals the reference."""
    wf, hpc, cloud, sites, first = failed_after_crossing(db, tmp_path)
    got = px.Store(cloud.store.root, session=first.session)
    damaged = got.info("tx")
    flip_a_byte(Path(damaged.location) / part_file(1))
    again = run_workflow(wf, hpc, db=db, sites=sites, resume=first.run_id)
    assert again.ok, again.failed
    made = px.Store(hpc.store.root, session=first.session).info("tx")
    assert made.version == damaged.origin["version"]  # the producer was reused: the same version
    crossed = {s["stage"]: s for s in db.stages(first.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    assert not crossed["already"] and crossed["bytes"] == made.nbytes
    assert crossed["replaced"].startswith(f"its copy there (version {damaged.version}) failed its check: ")
    assert "partition 1" in crossed["replaced"]
    for i in range(made.num_partitions):
        assert (Path(made.location) / part_file(i)).read_bytes() == (
            Path(got.info("tx").location) / part_file(i)
        ).read_bytes()
    pd.testing.assert_frame_equal(sorted_table(got, "totals"), totals_of(4000, 5), check_dtype=False)


def test_a_crossing_that_fails_once_is_tried_again_within_the_attempt(db, tmp_path, monkeypatch):
    """A stage with no retries (the default) survives a transient crossing failure.  The fault,
    real and deterministic: partition 0 of tx on hpc is moved away right after generate seals it
    (what a file system that hiccups looks like to the reader: the file is not there), so the
    first try fails reading it; the crossing says so in an event 'crossing retry' before its
    pause, and that event — seen here synchronously, in the run's own callback — puts the file
    back.  The second try crosses it; one attempt, no stage retry."""
    monkeypatch.setattr(crossings, "CROSSING_PAUSES_S", (0.05, 0.2))
    hpc, cloud = two_sites(tmp_path)
    wf = across()
    del wf.stages["again"]
    aside: list[tuple[Path, Path]] = []

    def on_event(stage: str, kind: str, message: str) -> None:
        if stage == "generate" and kind == "succeeded":
            (session,) = [p for p in Path(hpc.store.root).iterdir() if p.is_dir() and not p.name.startswith(".")]
            part = Path(px.Store(hpc.store.root, session=session.name).info("tx").location) / part_file(0)
            aside.append((part, part.rename(tmp_path / "away")))
        elif kind == "crossing retry":
            part, away = aside.pop()
            away.rename(part)

    result = run_workflow(wf, hpc, db=db, sites={"generate": hpc, "totals": cloud}, on_event=on_event)
    assert result.ok, result.failed
    assert [a["state"] for a in db.attempts(result.run_id, "totals")] == ["succeeded"]
    (said,) = [e["message"] for e in db.events(result.run_id) if e["kind"] == "crossing retry"]
    assert said.startswith("tx: try 1 of 3 from site 'hpc' to site 'cloud' (direct) failed: ") and "missing" in said
    assert said.endswith("again in 0.05 s")
    crossed = {s["stage"]: s for s in db.stages(result.run_id)}["totals"]["inputs"]["tx"]["crossed"]
    assert crossed["tries"] == 2 and not crossed["already"]
    assert crossing_text(crossed).endswith(" s, after 2 tries)")  # what `phalanx status` says of the input
    got = px.Store(cloud.store.root, session=result.session)
    pd.testing.assert_frame_equal(sorted_table(got, "totals"), totals_of(4000, 5), check_dtype=False)


def test_a_crossing_pauses_1_then_4_s_and_its_last_failure_names_both_sites_and_the_path(tmp_path):
    """cross_dataset itself: a source partition gone for good fails every try; the pauses asked
    of ``wait`` are 1 s then 4 s (recorded, not slept); the error names both sites, the path
    and the tries.  A ``wait`` that says cancelled stops after the first try."""
    src = px.Store(tmp_path / "a", session="s")
    src.put("tx", [pa.Table.from_pandas(generated(100, 1))] * 2)
    os.unlink(Path(src.info("tx").location) / part_file(1))
    dst = px.Store(tmp_path / "b", session="s")
    waits: list[float] = []
    said: list[str] = []
    with pytest.raises(GangError) as err:
        crossings.cross_dataset(
            "tx", src, dst, None, src_site="a", dst_site="b", wait=waits.append, on_retry=said.append
        )
    assert str(err.value).startswith("input 'tx' could not cross from site 'a' to site 'b' (direct, 3 tries): ")
    assert f"{src.info('tx').location}/{part_file(1)}" in str(err.value) and "is missing" in str(err.value)
    assert waits == [1.0, 4.0] and len(said) == 2
    with pytest.raises(GangError, match=r"did not cross from site 'a' to site 'b' \(direct\): cancelled after try 1"):
        crossings.cross_dataset("tx", src, dst, None, src_site="a", dst_site="b", wait=lambda s: True)
    assert not dst.exists("tx") and len(dst.unsealed()) == 1  # partition 0 staged: a later try keeps it


def test_independent_stages_on_two_sites_run_side_by_side(db, tmp_path):
    """Two stages with nothing between them, one per site: each waits (bounded: 60 s, then it
    fails) until the other has started, so the run succeeds only if they run at once; their
    attempts' intervals in the run DB overlap."""
    hpc, cloud = two_sites(tmp_path)
    meet = tmp_path / "meet"
    meet.mkdir()

    def stage(peer: str) -> Stage:
        return Stage(app="apps:wf_meet", ranks=2, params={"dir": str(meet), "peer": peer})

    wf = Workflow(name="side-by-side", stages={"left": stage("right"), "right": stage("left")})
    result = run_workflow(wf, hpc, db=db, sites={"left": hpc, "right": cloud})
    assert result.ok, result.failed
    (left,), (right,) = db.attempts(result.run_id, "left"), db.attempts(result.run_id, "right")
    assert left["started"] < right["ended"] and right["started"] < left["ended"]
    assert {s["stage"]: s["site"] for s in db.stages(result.run_id)} == {"left": "hpc", "right": "cloud"}


def test_the_plan_names_the_path_of_each_crossing(tmp_path):
    """validate's plan: through the object store both sites name (its URL, credentials
    masked), directly otherwise, and nothing where both sites name one store."""
    hpc, cloud = two_sites(tmp_path)
    wf = across()
    local = Site(name="also-hpc", cores=1, store=StoreConfig(root=hpc.store.root))
    sites = {"generate": hpc, "totals": cloud, "again": local}
    lines = site_plan(wf, sites)
    assert "  crosses: tx from 'hpc' to 'cloud', direct (read by totals)" in lines
    assert "  shares: tx of 'hpc' with 'also-hpc': one store, nothing crosses (read by again)" in lines
    hpc.store.exchange = cloud.store.exchange = "s3://bucket/x?endpoint_override=http://127.0.0.1:1&credentials=env:EX"
    lines = site_plan(wf, {"generate": hpc, "totals": cloud, "again": cloud})
    assert "  crosses: tx from 'hpc' to 'cloud', object store s3://bucket/x (read by totals, again)" in lines
    hpc.store.exchange = "s3://AKIAEXAMPLE:hunter2@bucket/x"
    cloud.store.exchange = "s3://AKIAEXAMPLE:hunter2@bucket/x"
    shown = "\n".join(site_plan(wf, {"generate": hpc, "totals": cloud, "again": cloud}))
    assert "hunter2" not in shown and "object store s3://" in shown


def killed_run(tmp: Path) -> tuple[Workflow, Site, dict[str, Site]]:
    """generate (4 ranks on hpc) seals tx in 4 partitions; totals on cloud reads it."""
    hpc = Site(name="hpc", cores=4, store=StoreConfig(root=str(tmp / "hpc-store")))
    cloud = Site(name="cloud", cores=2, store=StoreConfig(root=str(tmp / "cloud-store")))
    wf = Workflow(
        name="killed",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=4, params={"rows": 40000, "seed": 3}, outputs=["tx"]),
            "totals": Stage(app="apps:wf_totals", ranks=2, inputs={"tx": "tx"}, outputs=["totals"]),
        },
    )
    return wf, hpc, {"generate": hpc, "totals": cloud}


DRIVER = """
import os, sys
from pathlib import Path

import phalanx as px
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.store.tiers import part_file
from test_multisite import killed_run

tmp, stop = Path(sys.argv[1]), int(sys.argv[2])
wf, hpc, sites = killed_run(tmp)

def on_event(stage, kind, message):
    if kind == "run":
        print("run", message, flush=True)
    if stage == "generate" and kind == "succeeded":
        # partition STOP of tx becomes a FIFO nobody writes: the crossing blocks opening it,
        # with partitions 0..STOP-1 arrived on cloud; the real file waits beside it
        (session,) = [p for p in (tmp / "hpc-store").iterdir() if p.is_dir() and not p.name.startswith(".")]
        part = Path(px.Store(tmp / "hpc-store", session=session.name).info("tx").location) / part_file(stop)
        part.rename(tmp / "held-back")
        os.mkfifo(part)
        print("fifo", part, flush=True)

run_workflow(wf, hpc, db=RunDB(tmp / "state"), sites=sites, on_event=on_event)
print("the crossing did not block", flush=True)
"""


@pytest.mark.slow
def test_a_crossing_killed_partway_is_resumed_sending_only_the_rest(tmp_path):
    """The driver is killed (SIGKILL, by its PID) in the middle of a crossing: partitions 0 and
    1 of tx's 4 had arrived on cloud, the crossing was blocked reading partition 2 (a FIFO in
    its place, the fault injected by the driver script's own event callback when generate
    sealed tx: deterministic, no timing).  ``--resume`` (run_workflow(resume=)) keeps the two
    that arrived and passed their checksums and sends only partitions 2 and 3; the result
    equals the reference and the copy the producer's files byte for byte."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    tests = Path(__file__).parent
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "2"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tests,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])},
        start_new_session=True,
    )
    try:
        run_line = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert run_line[:1] == ["run"], run_line
        fifo_line = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert fifo_line[:1] == ["fifo"], fifo_line
        made = px.Store(tmp_path / "hpc-store", session=Path(fifo_line[1]).parents[2].name).info("tx")
        deadline = time.monotonic() + 60
        while True:  # partition 1 whole on cloud: the crossing is at partition 2 (the FIFO) or about to be
            staged = list((tmp_path / "cloud-store").glob(f"*/.staging/cross-*/{part_file(1)}"))
            if staged and staged[0].stat().st_size == made.partitions[1].bytes:
                break
            assert proc.poll() is None, f"the driver ended: {proc.stdout.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "partition 1 never arrived on cloud"
            time.sleep(0.05)  # polling a file, bounded by the deadline
        os.kill(proc.pid, signal.SIGKILL)  # by PID: the driver this test started
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its gangs' ranks, had any outlived it (the group it leads)
    fifo = Path(fifo_line[1])
    fifo.unlink()
    (tmp_path / "held-back").rename(fifo)
    session = fifo.parents[2].name
    got = px.Store(tmp_path / "cloud-store", session=session)
    assert not got.exists("tx") and len(got.unsealed()) == 1
    wf, hpc, sites = killed_run(tmp_path)
    db = RunDB(tmp_path / "state")
    again = run_workflow(wf, hpc, db=db, sites=sites, resume=run_line[1])
    assert again.ok, again.failed
    crossed = {s["stage"]: s for s in db.stages(run_line[1])}["totals"]["inputs"]["tx"]["crossed"]
    assert crossed["bytes"] == made.partitions[2].bytes + made.partitions[3].bytes  # only the rest
    assert not crossed["already"] and got.unsealed() == []
    copy = got.info("tx")
    assert copy.origin["version"] == made.version
    for i in range(4):
        assert (Path(copy.location) / part_file(i)).read_bytes() == (Path(made.location) / part_file(i)).read_bytes()
    expected = generated(40000, 4, seed=3).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(sorted_table(got, "totals"), expected, check_dtype=False)


def test_a_damaged_copy_in_the_exchange_is_checked_and_sent_up_again(s3_endpoint, tmp_path):  # noqa: F811
    """Through an exchange (moto on loopback here): the copy there is trusted on the way up (a
    check would download it) but read, and so checked, on the way down.  Damaged in the
    exchange and gone from the consumer's store, it fails that read; the crossing then checks
    the exchange's copy, sends it up again and down — one try, the data equal to the source."""
    exchange = s3_root(s3_endpoint)
    src = px.Store(tmp_path / "a", session="s")
    src.put("tx", [pa.Table.from_pandas(generated(300, 1, seed=s)) for s in range(3)])
    dst = px.Store(tmp_path / "b", session="s")

    def cross(**kw) -> dict:
        return crossings.cross_dataset("tx", src, dst, exchange, src_site="a", dst_site="b", **kw)

    first = cross()
    assert first["path"] == "object store" and first["exchange"] == exchange.split("?")[0]
    middle = px.Store(exchange, session="s")
    copy = middle.info("tx")
    good = middle.tier.read_buffer(copy.location, 1).to_pybytes()
    middle.tier.write_buffer(copy.location, 1, pa.py_buffer(good[:-8]))  # cut short in the exchange
    dst.delete("tx")
    said: list[str] = []
    again = cross(on_retry=said.append)
    assert said == [] and again["tries"] == 1 and not again["already"]
    nbytes = src.info("tx").nbytes
    assert again["bytes"] == 2 * nbytes  # up again (all of it: the copy there is replaced), then down
    assert [p.checksum for p in dst.info("tx").partitions] == [p.checksum for p in src.info("tx").partitions]
    assert dst.read("tx").to_pandas().equals(src.read("tx").to_pandas())
