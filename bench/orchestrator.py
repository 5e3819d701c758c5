#!/usr/bin/env python
"""Orchestration overhead per stage: a chain of trivial 2-rank stages, each reading the previous
stage's output from the store and sealing its own (gang start + rendezvous + hand-off + seal +
bookkeeping); with ``--fanout N``, the overhead per instance of a fan-out of N trivial one-rank
instances gathered by a fan-in stage, the same fan-out with ``cache: true`` and its fully
cached rerun, against the same work as separate runs (what a sweep took before ``foreach:``).

    .venv/bin/python bench/orchestrator.py [--stages 10] [--ranks 2]
    .venv/bin/python bench/orchestrator.py --fanout 200 [--separate 20] [--site slurm-local]
    .venv/bin/python bench/orchestrator.py --observe [--repeat 3]

``--observe``: the chain with per-rank resource sampling off, on (every 2 s, the default, and
every 0.1 s), and on with the dashboard (``phalanx ui``) serving viewers that follow the run
live the whole time (each its server-sent events, a log stream, and the runs list every 0.2 s);
the modes alternate, ``--repeat`` times each, and the median per-stage time of each is printed
against sampling off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow


def seed(env):
    env.output("d0", pa.table({"x": [env.rank]}))


def step(env):
    df = env.input("prev")
    env.output(env.outputs[0], df)


def chain(stages: int, ranks: int, site: Site, db: RunDB | None = None) -> tuple[float, list[float]]:
    """Total seconds and per-stage seconds (gang start → sealed output) of a trivial chain
    (recorded in ``db``, default: a new run DB of its own)."""
    steps = {"s0": Stage(app="orchestrator:seed", ranks=ranks, outputs=["d0"])}
    for i in range(1, stages):
        steps[f"s{i}"] = Stage(app="orchestrator:step", ranks=ranks, inputs={"prev": f"d{i - 1}"}, outputs=[f"d{i}"])
    with tempfile.TemporaryDirectory() as state:
        db = db or RunDB(state)
        t0 = time.perf_counter()
        result = run_workflow(Workflow(name="chain", stages=steps), site, db=db)
        total = time.perf_counter() - t0
        assert result.ok, result.failed
        per = [s["ended"] - s["started"] for s in db.stages(result.run_id)]
        px.Store(session=result.session).delete_session()
    return total, per


def observe_report(stages: int, ranks: int, site: Site, repeat: int, viewers: int = 2) -> None:
    """Per-stage overhead of sampling and of the dashboard watching the run (``--observe``)."""
    import os

    modes = {
        "sampling off": ("0", False),
        "sampling every 2 s (default)": ("2", False),
        "sampling every 0.1 s": ("0.1", False),
        f"sampling 2 s + dashboard, {viewers} live viewers": ("2", True),
    }
    per_mode: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeat):
        for label, (every, board) in modes.items():
            os.environ["PHALANX_SAMPLE_S"] = every
            with tempfile.TemporaryDirectory() as state:
                db = RunDB(state)
                watch = Watchers(db, viewers) if board else None
                try:
                    total, _ = chain(stages, ranks, site, db)
                finally:
                    if watch is not None:
                        watch.stop()
            per_mode[label].append(total / stages)
    os.environ.pop("PHALANX_SAMPLE_S", None)
    print(f"chain of {stages} trivial {ranks}-rank stages, {repeat} runs of each mode, alternating")
    base = statistics.median(per_mode["sampling off"])
    for label, times in per_mode.items():
        med = statistics.median(times)
        print(
            f"  {label:44} median {med:5.3f} s per stage (runs {', '.join(f'{t:.3f}' for t in times)})  x{med / base:.3f}"
        )


class Watchers:
    """``phalanx ui`` as a user runs it (a process of its own) and ``n`` viewers (one more
    process) following the newest run as a browser does: its server-sent events, a log stream,
    and the runs list at each update."""

    def __init__(self, db: RunDB, n: int):
        import os
        import re
        import subprocess

        env = {**os.environ, "PHALANX_STATE": str(db.state_dir)}
        self.board = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli", "ui", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.board.stdout is not None
        self.board.stdout.readline()
        url = re.search(r"open (http://\S+)/\?token=(\S+)", self.board.stdout.readline())
        assert url, "phalanx ui printed no address"
        self.viewers = subprocess.Popen(
            [sys.executable, __file__, "--view", url.group(1), "--viewers", str(n)],
            env={**env, "PHALANX_UI_TOKEN": url.group(2)},  # not in argv
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.viewers.stdout is not None
        # measured from here: both processes started (their imports done) and every viewer served
        for _ in range(n):
            assert self.viewers.stdout.readline().startswith("viewing"), "a viewer did not start"

    def stop(self) -> None:
        for proc in (self.viewers, self.board):
            proc.terminate()
            proc.wait(30)


def view(base: str, n: int) -> None:
    """``n`` viewers of the dashboard at ``base`` (``--view``), until terminated."""
    import os
    import threading

    import httpx

    headers = {"authorization": f"Bearer {os.environ['PHALANX_UI_TOKEN']}"}

    def one() -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
            c.get("/api/runs").raise_for_status()
            print("viewing", flush=True)
            while True:
                try:
                    follow(c)
                except Exception as exc:  # said, and the viewer goes on (as a browser retries)
                    print(f"viewer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    time.sleep(0.2)

    def follow(c) -> None:
        got = c.get("/api/runs")
        got.raise_for_status()
        runs = got.json()
        if not runs or runs[0]["state"] != "running":
            time.sleep(0.2)
            return
        run = runs[0]["id"]
        with c.stream("GET", f"/api/runs/{run}/stream") as events, c.stream("GET", f"/api/runs/{run}/logs"):
            for line in events.iter_lines():
                if line.startswith("event: end"):
                    break
                c.get("/api/runs").raise_for_status()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def item(env):
    env.output(env.outputs[0], pa.table({"i": [env.params["i"]] if env.rank == 0 else pa.array([], pa.int64())}))


def gather_sum(env):
    table = env.input("parts").to_arrow()
    env.output("total", pa.table({"sum": [sum(table["i"].to_pylist())]}))


def fanout(n: int, site: Site, cache: bool = False) -> tuple[float, list[float], float | None]:
    """Seconds of a run whose stage fans out into ``n`` one-rank instances (then a fan-in), each
    instance's seconds (gang start → sealed output), and with ``cache`` (every stage cacheable)
    the seconds of a second run of the same workflow that reuses all of the first's outputs."""
    stages = {
        "items": Stage(app="orchestrator:item", foreach={"matrix": {"i": list(range(n))}}, outputs=["one"]),
        "sum": Stage(app="orchestrator:gather_sum", inputs={"parts": "one"}, outputs=["total"]),
    }
    wf = Workflow(name="fanout", stages=stages, **({"cache": True} if cache else {}))
    sessions = []
    with tempfile.TemporaryDirectory() as state:
        db = RunDB(state)
        t0 = time.perf_counter()
        result = run_workflow(wf, site, db=db)
        total = time.perf_counter() - t0
        assert result.ok, result.failed
        sessions.append(px.Store(site.store.root, result.session, metadata=site.store.metadata))
        assert sessions[0].read("total").column("sum").to_pylist() == [n * (n - 1) // 2]
        per = [s["ended"] - s["started"] for s in db.stages(result.run_id) if s["stage"].startswith("items.")]
        rerun = None
        if cache:
            t0 = time.perf_counter()
            again = run_workflow(wf, site, db=db)
            rerun = time.perf_counter() - t0
            assert again.ok, again.failed
            cached = [e["stage"] for e in db.events(again.run_id) if e["kind"] == "cached"]
            assert len(cached) == n + 1 and not db.attempts(again.run_id), "not every stage was reused"
            sessions.append(px.Store(site.store.root, again.session, metadata=site.store.metadata))
            assert sessions[1].read("total").column("sum").to_pylist() == [n * (n - 1) // 2]
        for store in sessions:
            store.delete_session()
    return total, per, rerun


def separate_runs(k: int, site: Site) -> float:
    """Seconds of ``k`` runs of a one-stage workflow, one after another (a sweep as a loop of runs)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as state:
        db = RunDB(state)
        for i in range(k):
            wf = Workflow(name="one", stages={"item": Stage(app="orchestrator:item", params={"i": i}, outputs=["one"])})
            result = run_workflow(wf, site, db=db)
            assert result.ok, result.failed
            px.Store(site.store.root, result.session, metadata=site.store.metadata).delete_session()
    return time.perf_counter() - t0


def fanout_report(n: int, k: int, site: Site) -> None:
    print(f"fan-out of {n} trivial one-rank instances + a fan-in on site {site.name!r} ({site.executor})")
    total, per, _ = fanout(n, site)
    print(
        f"  foreach: {total:7.2f} s in all, {total / n:5.3f} s per instance "
        f"(an instance's own time: median {statistics.median(per):.2f} s, max {max(per):.2f} s)"
    )
    first, _, rerun = fanout(n, site, cache=True)
    assert rerun is not None
    print(
        f"  cache: true, first run: {first:7.2f} s, {first / n:5.3f} s per instance (each looked up, none found)\n"
        f"  cache: true, rerun:     {rerun:7.2f} s, {rerun / n:5.3f} s per instance, every instance and the fan-in "
        f"reused  → x{first / rerun:.1f}"
    )
    if k:
        apart = separate_runs(k, site)
        print(
            f"  {k} separate runs: {apart:7.2f} s, {apart / k:5.3f} s per run  "
            f"→ foreach x{(apart / k) / (total / n):.1f} less per item"
        )


def example_split(path: Path) -> None:
    """The example pipeline at its default size, split into stages."""
    from phalanx.orchestrator.loading import load_workflow

    wf, site = load_workflow(path)
    with tempfile.TemporaryDirectory() as state:
        db = RunDB(state)
        t0 = time.perf_counter()
        result = run_workflow(wf, site, db=db)
        total = time.perf_counter() - t0
        assert result.ok, result.failed
        print(f"\n{path.name}: {total:.2f} s end to end")
        for s in db.stages(result.run_id):
            a = db.attempts(result.run_id, s["stage"])[-1]
            app = [r["ended"] - r["started"] for r in a["rank_info"]]
            rows = ", ".join(f"{k} {v[0]:,} rows" for k, v in s["outputs"].items())
            own = f"app {max(app):.2f} s" if app else "command"
            print(f"  {s['stage']:10} {s['ended'] - s['started']:6.2f} s  ({own})  {rows}")
        px.Store(session=result.session).delete_session()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--no-example", action="store_true", help="skip the example pipeline's split")
    ap.add_argument("--site", default="local", help="site name or file (slurm-local, ray-local...)")
    ap.add_argument("--fanout", type=int, default=0, help="measure a fan-out of N instances instead of the chain")
    ap.add_argument("--separate", type=int, default=20, help="with --fanout: this many separate runs to compare")
    ap.add_argument("--observe", action="store_true", help="sampling and the dashboard on vs off (the chain)")
    ap.add_argument("--repeat", type=int, default=3, help="with --observe: runs of each mode")
    ap.add_argument("--view", metavar="URL", help=argparse.SUPPRESS)  # --observe's viewer process
    ap.add_argument("--viewers", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from phalanx.orchestrator.loading import load_site

    site = load_site(args.site)
    if args.view:
        view(args.view, args.viewers)
        return
    if args.observe:
        observe_report(args.stages, args.ranks, site, args.repeat)
        print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())
        return
    if args.fanout:
        fanout_report(args.fanout, args.separate, site)
        print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())
        return
    if site.executor == "local":
        modes = {  # how a stage gets its gang
            "cold (new processes each stage)": site.model_copy(update={"warm_ranks": 0, "reuse_gangs": False}),
            "warm pool (fresh gang, imports done)": site.model_copy(update={"reuse_gangs": False}),
            "reuse (default: gang kept across stages)": site,
        }
    elif site.executor == "ray":
        modes = {
            "ray: new gang each stage": site.model_copy(update={"reuse_gangs": False}),
            "ray: reuse (default)": site,
        }
    else:  # batch jobs hold real resources while idle: no reuse
        modes = {f"{site.executor}: a new gang (job or step) each stage": site}
    print(f"chain of {args.stages} trivial {args.ranks}-rank stages on site {site.name!r} (target < 1.5 s per stage)")
    base = None
    for label, site in modes.items():
        total, per = chain(args.stages, args.ranks, site)
        each = total / args.stages
        base = base or each
        print(
            f"  {label:42} {total:6.2f} s in all, {each:5.2f} s per stage "
            f"(median {statistics.median(per):.2f}, max {max(per):.2f})  x{base / each:.1f} vs cold"
        )
    if not args.no_example and site.executor == "local":
        example_split(Path(__file__).resolve().parent.parent / "workflows" / "etl_to_training.yaml")
    print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())


if __name__ == "__main__":
    main()
