"""``phalanx``: validate workflows, look into the store, publish the config schemas."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def _overrides(items: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items as {KEY: VALUE}; a ConfigError names every malformed one."""
    from .orchestrator.yamlio import ConfigError

    out, bad = {}, []
    for item in items:
        key, sep, value = item.partition("=")
        if sep and all(key.split(".")):
            out[key] = value
        else:
            bad.append(f"--set {item}: expected KEY=VALUE, e.g. stages.gen.params.rows=1000")
    if bad:
        raise ConfigError(bad)
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from .orchestrator.fanout import fanout_plan
    from .orchestrator.loading import load_workflow, site_plan, stage_sites, store_reach_notes
    from .orchestrator.yamlio import ConfigError

    try:
        wf, site = load_workflow(
            args.workflow, site=args.site, overrides=_overrides(args.set), check_imports=not args.no_imports
        )
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    ranks = max(st.ranks for st in wf.stages.values())
    print(
        f"{args.workflow}: ok — workflow {wf.name!r}, {len(wf.stages)} stages, "
        f"largest gang {ranks} ranks, site {site.name!r} ({site.executor}, {_slots(site.capacity())})"
    )
    sites = stage_sites(wf, site, Path(args.workflow).resolve().parent)
    if len({s.name for s in sites.values()}) > 1:
        print("\n".join(site_plan(wf, sites)))
    for line in fanout_plan(wf):  # how many instances each fan-out makes
        print(line)
    for note in store_reach_notes(sites.values()):  # a store no rank on another host can read
        print(note, file=sys.stderr)
    return 0


def _slots(capacity: int | None) -> str:
    return f"{capacity} slots" if capacity else "slots as its resource manager gives them"


def cmd_run(args: argparse.Namespace) -> int:
    from .orchestrator.loading import load_workflow
    from .orchestrator.rundb import RunDB
    from .orchestrator.yamlio import ConfigError

    db = RunDB(args.state)
    if args.overrides_file:  # a detached driver: its --set items, kept off its command line
        path = Path(args.overrides_file)
        args.set = [*json.loads(path.read_text()), *args.set]
        path.unlink(missing_ok=True)
    if args.resume:
        run = db.run(args.resume)
        if run is None:
            print(f"phalanx run: no run {args.resume!r} in {db.path}", file=sys.stderr)
            return 1
    try:  # every problem in the file, before anything starts (and before --detach leaves)
        wf, site = load_workflow(args.workflow, site=args.site, overrides=_overrides(args.set))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.detach:
        return _detach(args, db)
    from .orchestrator.progress import RunProgress

    t0 = time.monotonic()
    progress = RunProgress(wf, live=None if not args.plain else False)
    # `phalanx cancel` sends SIGTERM: stop the gangs as Ctrl-C does.  The first SIGTERM or Ctrl-C
    # cancels; those that come while the gangs stop change nothing (one message, exit 130).
    before = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _drive(args, db, wf, site, progress, t0)
    finally:
        if not _COMMAND:  # main(argv) from a program: its handlers back (a command is exiting)
            for sig, handler in before.items():
                signal.signal(sig, handler)


def _drive(args: argparse.Namespace, db, wf, site, progress, t0: float) -> int:
    from .orchestrator.handle import RunHandle
    from .orchestrator.rundb import RunDBError, RunLockedError

    handle = None
    try:
        with progress:
            handle = RunHandle.start(wf, site, db=db, file=str(args.workflow), resume=args.resume, on_event=progress)
            if args.run_id_fd is not None:  # a detached driver: the run exists, tell `run --detach`
                from .orchestrator.detached import announce

                announce(args.run_id_fd, handle.run_id)
            result = handle.result()
    except RunLockedError as exc:  # a second driver of one run
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 1
    except RunDBError as exc:  # e.g. its file system full: the run cannot be recorded, it stops
        _hold_signals()
        print(f"phalanx run: {exc}", file=sys.stderr)
        if handle is not None:
            handle.cancel()  # no gang left running (the scheduler stopped them on the error)
            print(f"  run {handle.run_id}: {_mark_failed(db, handle.run_id, exc)}", file=sys.stderr)
            print(f"  once there is room: phalanx run {args.workflow} --resume {handle.run_id}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _hold_signals()  # the first one may have been Python's own Ctrl-C (a program's main(argv))
        if handle is not None:
            handle.cancel()
        run_id = args.resume or (handle.run_id if handle else "") or progress.run_id or "?"
        print(
            f"\ncancelled: every gang was stopped; sealed outputs are kept.\n"
            f"resume with: phalanx run {args.workflow} --resume {run_id}",
            file=sys.stderr,
        )
        return 130
    state = {"succeeded": "succeeded", "cancelled": "CANCELLED"}.get(result.state, "FAILED")
    print(f"run {result.run_id} {state} in {time.monotonic() - t0:.1f}s (store session {result.session!r})")
    _print_failures(db, result.run_id, result.failed, result.skipped, str(args.workflow))
    return 0 if result.ok else 1


def _mark_failed(db, run_id: str, exc: BaseException) -> str:
    """Record what can be recorded of a run whose run DB refused a write; says what it did."""
    from .orchestrator.rundb import RunDBError

    try:
        db.event(run_id, "failed", f"the run database could not be written: {exc}")
        db.set_run(run_id, "failed")
        return "marked failed"
    except RunDBError:
        return "could not be marked failed either; `phalanx status` shows it lost (its driver has exited)"


def _print_failures(db, run_id: str, failed: dict[str, str], skipped: list[str], file: str | None) -> None:
    """On stderr: each failed stage with its error, the failing rank's traceback tail and its
    logs; the stages that never ran; how to resume."""
    from .redact import redact

    for stage, error in failed.items():
        attempts = db.attempts(run_id, stage)
        logs = attempts[-1]["log_dir"] if attempts else "-"
        print(f"  stage {stage!r} failed: {redact(error)}", file=sys.stderr)
        tail = _traceback_tail(attempts[-1]["error"] if attempts else "")
        if tail:
            print(tail, file=sys.stderr)
        print(f"    logs: {logs}", file=sys.stderr)
    why = {s["stage"]: s["error"] for s in db.stages(run_id)} if skipped else {}
    for stage in skipped:  # the reason the scheduler recorded (an upstream failure, a cancel)
        print(f"  stage {stage!r} did not run: {why.get(stage) or 'an upstream stage failed'}", file=sys.stderr)
    if (failed or skipped) and file and file != "<python>":
        print(f"resume with: phalanx run {file} --resume {run_id}", file=sys.stderr)


# ---- detached runs: a driver of its own that outlives the terminal (orchestrator/detached.py) ----
def _detach(args: argparse.Namespace, db) -> int:
    """Start the driver (``phalanx run`` of this file) detached; print the run id once the run is
    in the run DB.  The ``--set`` items go to the driver in a file only this user can read (which
    it removes once read), not on its command line: ``ps`` would show them for the whole run."""
    import uuid

    from .orchestrator.detached import DriverInterrupted, DriverStartError, start_driver
    from .private import create_private, private_dir

    overrides = None
    if args.set:
        drivers = private_dir(
            db.state_dir / "drivers", "the logs of detached drivers", "set PHALANX_STATE to a directory of your own"
        )
        overrides = create_private(drivers / f".overrides-{uuid.uuid4().hex}.json")  # 0600
        overrides.write_text(json.dumps(args.set))
    argv = [
        sys.executable,
        "-m",
        "phalanx.cli",
        "run",
        str(args.workflow),
        "--plain",
        f"--state={db.state_dir.resolve()}",
        *([f"--overrides-file={overrides}"] if overrides else []),
        *([f"--site={args.site}"] if args.site else []),
        *([f"--resume={args.resume}"] if args.resume else []),
        "--run-id-fd",  # start_driver appends the pipe's descriptor
    ]
    before = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM as Ctrl-C: the driver is stopped
    try:
        driver = start_driver(argv, db, resume=args.resume)
    except DriverStartError as exc:
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 1
    except DriverInterrupted as exc:  # Ctrl-C before the run id came: the driver was stopped
        _hold_signals()
        if exc.run_id:
            run = db.run(exc.run_id)
            print(
                f"\ninterrupted: the detached driver was stopped; run {exc.run_id} is "
                f"{run['state'] if run else 'gone'} (sealed outputs are kept; its log: {exc.log}).\n"
                f"resume with: phalanx run {args.workflow} --resume {exc.run_id}",
                file=sys.stderr,
            )
        else:
            print(
                "\ninterrupted: the detached driver was stopped before it started a run; nothing runs", file=sys.stderr
            )
        return 130
    except KeyboardInterrupt:  # before the driver was started
        print("\ninterrupted: no driver was started; nothing runs", file=sys.stderr)
        return 130
    finally:
        if not _COMMAND:
            signal.signal(signal.SIGTERM, before)
        if overrides is not None:  # the driver removed it once read; not if it ended first
            overrides.unlink(missing_ok=True)
    run_id = driver.run_id
    print(run_id)
    print(
        f"run {run_id} goes on in the background (driver pid {driver.pid}); its log: {driver.log}\n"
        f"  phalanx status {run_id} · phalanx wait {run_id} · phalanx logs {run_id} --driver · "
        f"phalanx cancel {run_id}",
        file=sys.stderr,
    )
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait until a run (driven from anywhere: a detached driver, another terminal) finishes:
    0 succeeded, 1 failed/cancelled/lost (a driver that died is noticed), 124 timed out."""
    import socket

    from .orchestrator.detached import driver_log, wait_run
    from .orchestrator.handle import run_status
    from .orchestrator.rundb import RunDB

    db = RunDB(args.state)
    status = run_status(db, args.run)  # a driver gone without a word makes the run "lost" here
    if status is None:
        print(f"phalanx wait: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    run = db.run(args.run)
    if run is None:  # removed from the run DB meanwhile
        print(f"phalanx wait: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    if not status.finished and run["host"] != socket.gethostname():
        print(
            f"phalanx wait: run {args.run} is driven from host {run['host']!r}: a driver that dies "
            "there is not noticed from here",
            file=sys.stderr,
        )
    try:
        status = wait_run(db, args.run, timeout=args.timeout)
    except KeyboardInterrupt:  # stops the waiting, not the run
        return 130
    if status is None:  # removed from the run DB while we waited
        print(f"phalanx wait: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    if not status.finished:
        print(f"run {args.run} still {status.state} after {args.timeout:g}s")
        return 124
    run = db.run(args.run)
    if run is None:  # removed from the run DB since
        print(f"phalanx wait: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    took = f" in {run['ended'] - run['started']:.1f}s" if run["ended"] and run["started"] else ""
    print(f"run {args.run} {status.state}{took} (store session {status.session!r})")
    if status.state == "lost":
        gone = [e["message"] for e in db.events(args.run) if e["kind"] == "lost"]
        print(f"  {gone[-1] if gone else 'its driver is gone'}: the run stopped where it was", file=sys.stderr)
        if driver_log(db, args.run).exists():
            print(f"    driver log: {driver_log(db, args.run)}", file=sys.stderr)
    failed = {n: s.error or s.state for n, s in status.stages.items() if s.state == "failed"}
    skipped = [n for n, s in status.stages.items() if s.state == "skipped"]
    _print_failures(db, args.run, failed, skipped, None)
    if status.state != "succeeded" and run["file"] and run["file"] != "<python>":
        print(f"resume with: phalanx run {run['file']} --resume {args.run}", file=sys.stderr)
    return 0 if status.state == "succeeded" else 1


def _traceback_tail(error: str | None, lines: int = 6) -> str:
    """The last lines of the first failing rank's traceback in an attempt's error, indented."""
    marker = "--- traceback of rank "
    if not error or marker not in error:
        return ""
    head, _, tb = error.partition(marker)
    rank, _, tb = tb.partition("---\n")
    body = [line for line in tb.rstrip().splitlines() if line.strip()]
    return "\n".join(
        [f"    rank {rank.strip()}, last lines of its traceback:"] + [f"      {line}" for line in body[-lines:]]
    )


_COMMAND = False  # main() runs as the `phalanx` command (not main(argv) called by a program)


def _interrupt(signum, frame):
    """SIGTERM or Ctrl-C: KeyboardInterrupt once; the next ones are held (``_hold_signals``)."""
    _hold_signals()
    raise KeyboardInterrupt


def _hold_signals() -> None:
    """From now on SIGINT and SIGTERM interrupt nothing: the cancel they asked for is under way.
    The command ignores them (SIG_IGN: Python keeps it while it exits, where a handler of its
    own would be reset to the default and a late SIGTERM would kill it); a program that called
    main(argv) gets a handler that does nothing, replaced by its own afterwards."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN if _COMMAND else _ignore_signal)


def _ignore_signal(signum, frame) -> None:
    pass


def cmd_cancel(args: argparse.Namespace) -> int:
    """Stop a running run: its driver gets SIGTERM and stops every gang as on Ctrl-C."""
    import socket

    from .orchestrator.detached import stop_run_driver
    from .orchestrator.rundb import FINAL, RunDB

    db = RunDB(args.state)
    run = db.run(args.run)  # a driver that died unannounced is marked "lost" here
    if run is None:
        print(f"phalanx cancel: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    if run["state"] in FINAL:
        print(f"run {args.run} is already {run['state']}")
        return 0
    if run["host"] != socket.gethostname():
        print(
            f"phalanx cancel: run {args.run} is driven from host {run['host']!r} (pid {run['pid']}); "
            "run phalanx cancel there",
            file=sys.stderr,
        )
        return 1
    pid = run["pid"]
    stopped = stop_run_driver(run, args.wait)  # only the driver itself, never a new owner of its pid
    if stopped is None:
        print(
            f"phalanx cancel: run {args.run} records its driver as process {pid} without its start time "
            f"(an older phalanx wrote it), and process {pid} runs: it may be the driver or another process "
            f"given the pid since, so it was not signalled. If `ps -o pid,lstart,args -p {pid}` shows the "
            f"run's driver (phalanx run ...), stop it with: kill {pid}",
            file=sys.stderr,
        )
        return 1
    if not stopped:
        print(f"run {args.run}: driver {pid} did not stop within {args.wait:.0f}s; killed it", file=sys.stderr)
    after = db.run(args.run)
    print(f"run {args.run} {after['state'] if after is not None else 'removed from the run DB'}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .orchestrator.report import write_report
    from .orchestrator.rundb import RunDB

    try:
        path = write_report(RunDB(args.state), args.run, args.output)
    except KeyError as exc:
        print(f"phalanx report: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _driver_unknown(run: dict) -> bool:
    """A running run of this host whose driver cannot be told from another process given its
    pid: a record of an older phalanx (pid without start time) whose pid runs."""
    import socket

    from .orchestrator.rundb import driver_alive

    return run["state"] == "running" and run["host"] == socket.gethostname() and driver_alive(run) is None


def cmd_status(args: argparse.Namespace) -> int:
    from .orchestrator.detached import driver_log
    from .orchestrator.rundb import RunDB
    from .orchestrator.samples import latest_attempts, rank_lines

    db = RunDB(args.state)
    if not args.run:
        for r in db.runs():
            took = f"{(r['ended'] or time.time()) - r['started']:.1f}s"
            state = "running?" if _driver_unknown(r) else r["state"]  # `phalanx status RUN` says why
            print(f"{r['id']:26} {r['workflow']:24} {state:10} {took:>9}  {r['file']}")
        return 0
    run = db.run(args.run)
    if run is None:
        print(f"phalanx status: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    unsure = _driver_unknown(run)
    state = "running? (unknown: see the driver line)" if unsure else run["state"]
    print(f"run {run['id']}: {run['workflow']} — {state} (session {run['session']!r})")
    if unsure:  # a record of an older phalanx: pid without start time, and the pid runs
        print(
            f"  driver: process {run['pid']} runs, but the run DB has no start time for it (an older "
            "phalanx wrote it): it may be the driver or another process given the pid since"
        )
    if driver_log(db, run["id"]).exists():  # started with --detach
        print(f"  driver pid {run['pid']}, log {driver_log(db, run['id'])}")
    # where the resource manager placed a stage: its latest attempt's, shown while it runs
    placed = {e["stage"]: e["message"] for e in db.events(args.run) if e["kind"] == "placed"}
    released: dict[str, list[str]] = {}
    cached: dict[str, str] = {}  # stage → whose outputs it reused (caching across runs)
    for e in db.events(args.run):
        if e["kind"] == "release":
            released.setdefault(e["stage"], []).append(e["message"])
        elif e["kind"] == "cached":
            cached[e["stage"]] = e["message"]
    stages = db.stages(args.run)
    several = len({s.get("site") for s in stages if s.get("site")}) > 1  # a run over several sites
    causes = attempt_causes(db.attempts(args.run))
    sampled = latest_attempts(db.samples(args.run))  # each rank's newest resource sample (orchestrator.samples)
    for s in stages:
        rows = ", ".join(f"{k} {v[0]:,} rows" for k, v in s["outputs"].items())
        took = f"{s['ended'] - s['started']:.1f}s" if s["ended"] and s["started"] else ""
        site = f"  on {s['site']}" if several and s.get("site") else ""
        print(
            f"  {s['stage']:20} {s['state']:10} ranks {s['ranks'] or '-':>3}  attempts {s['attempts']}"
            f"  {took:>7}  {rows}{site}{('  ' + s['error']) if s['error'] else ''}"
        )
        if s["stage"] in cached and s["state"] == "succeeded" and not s["attempts"]:
            print(f"      cached: {cached[s['stage']]}")
        if s["stage"] in causes:  # why each attempt ended: "attempt 1 failed: out of memory"
            print(f"      {causes[s['stage']]}")
        if s["stage"] in placed and s["state"] == "running":  # e.g. "slurm: job 42 RUNNING on n[1-2]"
            print(f"      on {placed[s['stage']]}")
        for freed in released.get(s["stage"], []):  # what a dead driver left, freed by status/cancel/resume
            print(f"      released {freed}")
        for local, i in s["inputs"].items():
            fetched = i.get("fetched", 0)  # bytes of stored partitions fetched from other hosts
            where = f"; {fetched / 1e6:.1f} MB fetched, {i.get('read_here', 0) / 1e6:.1f} MB here" if fetched else ""
            where += crossing_text(i.get("crossed"))
            print(f"      ← {local}: {i['dataset']} {i['rows']:,} rows {i['bytes'] / 1e6:.1f} MB ({i['plan']}{where})")
        for line in rank_lines(sampled.get(s["stage"], [])):  # CPU, memory, traffic per rank; the straggler
            print(f"      {line}")
    return 0


def attempt_causes(attempts: list[dict]) -> dict[str, str]:
    """Per stage that failed an attempt: each attempt's end and cause, for ``phalanx status``
    ("attempt 1 failed: out of memory; attempt 2 succeeded")."""
    from .orchestrator.retry import label

    per: dict[str, list[dict]] = {}
    for a in attempts:
        per.setdefault(a["stage"], []).append(a)
    return {
        stage: "; ".join(
            f"attempt {a['attempt']} {a['state']}" + (f": {label(a['cause'])}" if a.get("cause") else "") for a in mine
        )
        for stage, mine in per.items()
        if any(a.get("cause") for a in mine)
    }


def crossing_text(crossed: dict | None) -> str:
    """How an input came from another site's store, for ``phalanx status`` ("" when it did not)."""
    if not crossed:
        return ""
    tries = crossed.get("tries", 1)
    after = f", after {tries} tries" if tries > 1 else ""
    if crossed.get("already"):
        return f"; crossed from site {crossed['from']} earlier in this run{after}"
    replaced = f"; {crossed['replaced']}" if crossed.get("replaced") else ""
    return (
        f"; crossed from site {crossed['from']} ({crossed['path']}, {crossed['bytes'] / 1e6:.1f} MB in "
        f"{crossed['seconds']:.2f} s{after}){replaced}"
    )


def cmd_logs(args: argparse.Namespace) -> int:
    from .orchestrator.detached import driver_log
    from .orchestrator.rundb import RunDB

    db = RunDB(args.state)
    if db.run(args.run) is None:
        print(f"phalanx logs: no run {args.run!r} in {db.path}", file=sys.stderr)
        return 1
    if args.driver:
        log = driver_log(db, args.run)
        if not log.exists():
            print(
                f"phalanx logs: run {args.run!r} has no driver log (it was not started with "
                "`phalanx run --detach`; its driver printed to its terminal)",
                file=sys.stderr,
            )
            return 1
        if args.follow:
            return _follow_logs(db, args)
        sys.stdout.write(log.read_text(errors="replace"))
        return 0
    if args.follow:
        return _follow_logs(db, args)
    attempts = db.attempts(args.run, args.stage)
    if not attempts:
        print(
            f"phalanx logs: run {args.run!r} has no attempts" + (f" of stage {args.stage!r}" if args.stage else ""),
            file=sys.stderr,
        )
        return 1
    last = {}
    for a in attempts:  # the latest attempt of each stage, unless --attempt says otherwise
        if args.attempt is None or a["attempt"] == args.attempt:
            last[a["stage"]] = a
    for stage, a in last.items():
        files = sorted(Path(a["log_dir"]).glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1]))
        for f in files:
            rank = int(f.stem.split("-")[1])
            if args.rank is not None and rank != args.rank:
                continue
            for line in f.read_text(errors="replace").splitlines():
                print(f"[{stage} attempt {a['attempt']} rank {rank}] {line}")
    return 0


def _follow_logs(db, args: argparse.Namespace) -> int:
    """``phalanx logs RUN --follow``: the lines of every attempt (or the detached driver's log)
    as they are written, until the run ends; then its state, and 0 if it succeeded, as ``phalanx
    wait``.  Ctrl-C stops the following, not the run."""
    from .orchestrator.detached import driver_log
    from .orchestrator.logfollow import follow, follow_file
    from .orchestrator.rundb import FINAL

    def ended() -> bool:
        run = db.run(args.run)
        return run is None or run["state"] in FINAL

    try:
        if args.driver:
            for text in follow_file(driver_log(db, args.run), ended, 0.25, sys.stdout.flush):
                print(text)
        else:
            lines = follow(db, args.run, args.stage, args.rank, args.attempt, poll_s=0.25, on_wait=sys.stdout.flush)
            for line in lines:  # flushed whenever it waits: a pipe (| grep) sees each line within 0.25 s
                print(f"[{line.stage} attempt {line.attempt} rank {line.rank}] {line.text}")
    except KeyboardInterrupt:
        return 130
    except KeyError:  # removed from the run DB meanwhile: reported below
        pass
    run = db.run(args.run)
    state = run["state"] if run else f"removed from {db.path}"
    print(f"phalanx logs: run {args.run} {state}", file=sys.stderr)
    return 0 if state == "succeeded" else 1


def _store(args: argparse.Namespace):
    from .store import Store

    return Store(args.root, args.session)


def cmd_store(args: argparse.Namespace) -> int:
    from .errors import PhalanxError

    try:
        store = _store(args)
        if args.store_cmd == "ls":
            infos = store.meta.list(store.session)
            if not infos:
                print(f"no datasets in session {store.session!r} of {store.root}")
            for info in infos:
                hosts = list(dict.fromkeys(p.host for p in info.partitions if p.host))
                print(
                    f"{info.name:30} {info.num_rows:>14,} rows {info.nbytes / 1e6:>10.1f} MB "
                    f"{info.num_partitions:>4} parts  {info.partitioning.get('kind')}  {info.producer}"
                    + (f"  on {','.join(hosts)}" if hosts else "")
                )
        elif args.store_cmd == "show":
            info = store.info(args.name)  # each partition's host and tier (memory or spill) too
            print(json.dumps({**info.summary(), "at": store.partition_places(info)}, indent=2, default=str))
        elif args.store_cmd == "rm":
            return cmd_store_rm(store, args)
        elif args.store_cmd == "sessions":
            cmd_store_sessions(store)
        elif args.store_cmd == "gc":
            cmd_store_gc(store, args)
    except (PhalanxError, ValueError) as exc:  # e.g. Redis metadata unreachable: one line, no traceback
        print(f"phalanx store: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_store_rm(store, args: argparse.Namespace) -> int:
    if (args.all and args.names) or not (args.all or args.names or args.staging):
        print(
            "phalanx store rm: give dataset names, --all (every dataset of the session) "
            "or --staging (its unsealed writes)",
            file=sys.stderr,
        )
        return 2
    if args.all or args.staging:
        gone = store.remove_unsealed()
        print(
            f"removed {len(gone)} unsealed writes ({sum(u.bytes for u in gone) / 1e6:.1f} MB) "
            f"of session {store.session!r}"
        )
    if args.all:
        print(f"removed {store.delete_session()} datasets of session {store.session!r}")
    for name in args.names:
        store.delete(name)
        print(f"removed {name}")
    return 0


def cmd_store_gc(store, args: argparse.Namespace) -> None:
    """Remove the sessions no run references (orchestrator/cache.py ``collect``); say what goes."""
    from .orchestrator.cache import collect
    from .orchestrator.rundb import RunDB

    db = RunDB(args.state)
    report = collect(store, db, dry_run=args.dry_run, keep_last=args.keep_last, min_age=args.min_age)
    verb = "would remove" if args.dry_run else "removed"
    for c in report.removed:
        print(f"{verb} {c.session}: {c.datasets} datasets, {c.bytes:,} bytes ({c.why})")
    for c in report.staging:
        print(f"{verb} the unsealed writes of {c.session}: {c.bytes:,} bytes (its runs ended)")
    for session, why in report.kept if args.verbose else ():
        print(f"kept {session}: {why}")
    print(
        f"{'would free' if args.dry_run else 'freed'} {report.freed:,} bytes ({report.freed / 1e6:.1f} MB) of "
        f"{store.root}; kept {len(report.kept)} session{'' if len(report.kept) == 1 else 's'} (runs of {db.path}"
        + ("" if args.verbose else "; -v says why each")
        + ")"
        + (" — dry run: nothing removed" if args.dry_run else "")
    )


def cmd_store_sessions(store) -> None:
    """Every session with its datasets, and the writes no seal published (a killed driver's)."""
    unsealed: dict[str, list] = {}
    for u in store.unsealed():
        unsealed.setdefault(u.session, []).append(u)
    for session in sorted(set(store.sessions()) | set(unsealed)):
        infos = store.meta.list(session)
        line = f"{session:50} {len(infos):>4} datasets {sum(d.nbytes for d in infos) / 1e6:>10.1f} MB"
        if session in unsealed:
            writes = unsealed[session]
            line += (
                f"  + {len(writes)} unsealed writes {sum(u.bytes for u in writes) / 1e6:.1f} MB, "
                f"last written {min(u.idle_s for u in writes):.0f}s ago "
                f"(free: phalanx store --session {session} rm --staging)"
            )
        print(line)


def cmd_ui(args: argparse.Namespace) -> int:
    """The live dashboard: serves until Ctrl-C; prints its address, token included."""
    from .orchestrator.rundb import RunDB
    from .store.service import read_token_file
    from .ui.server import Dashboard

    db = RunDB(args.state)
    try:
        store = _store(argparse.Namespace(root=args.root, session="default"))
    except Exception as exc:  # the store's root refused, Redis down: the runs are still shown
        print(f"phalanx ui: no store page ({type(exc).__name__}: {exc})", file=sys.stderr)
        store = None
    token = read_token_file(args.token_file) if args.token_file else None
    try:
        board = Dashboard(db, host=args.host, port=args.port, token=token, store=store)
    except (OSError, ValueError) as exc:
        print(f"phalanx ui: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    print(f"phalanx ui: runs of {db.path}" + (f", store {store.root}" if store is not None else ""))
    print(f"open {board.url}", flush=True)  # the token: this terminal's user only (as Jupyter's)
    try:
        board.serve()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    """Prometheus' /metrics for the run DB (a headless driver's host): serves until Ctrl-C."""
    from .observe.metrics import MetricsServer
    from .orchestrator.rundb import RunDB
    from .store.service import read_token_file

    db = RunDB(args.state)
    token = read_token_file(args.token_file) if args.token_file else None
    try:
        server = MetricsServer(db, host=args.host, port=args.port, token=token, runs=args.runs)
    except (OSError, ValueError) as exc:
        print(f"phalanx metrics: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    how = "a bearer token (--token-file)" if token else "no token: any user of this machine can scrape it"
    print(f"phalanx metrics: runs of {db.path}; {how}")
    print(f"scrape {server.url}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    for path, text in schema_files(Path(args.out)).items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def schema_files(out: Path) -> dict[Path, str]:
    """The published JSON Schemas (docs/*.schema.json), generated from the models."""
    from .orchestrator.models import Site, Workflow

    return {
        out / f"{name}.schema.json": json.dumps(model.model_json_schema(), indent=2) + "\n"
        for name, model in (("workflow", Workflow), ("site", Site))
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phalanx", description="Gang-scheduled BSP dataframe workflows.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    v = sub.add_parser("validate", help="check a workflow file without running it")
    v.add_argument("workflow")
    v.add_argument("--site", help="site name (site-configs/NAME.yaml) or site file")
    v.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. stages.gen.params.rows=1000",
    )
    v.add_argument("--no-imports", action="store_true", help="do not import the stages' apps")
    v.set_defaults(fn=cmd_validate)

    r = sub.add_parser("run", help="run a workflow (or resume a failed run)")
    r.add_argument("workflow")
    r.add_argument("--site", help="site name (site-configs/NAME.yaml) or site file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--resume", metavar="RUN_ID", help="rerun only the stages that did not seal their outputs")
    r.add_argument("--state", help="state directory (default: $PHALANX_STATE or ~/.local/state/phalanx)")
    r.add_argument("--plain", action="store_true", help="event lines instead of a live table")
    r.add_argument(
        "--detach",
        action="store_true",
        help="run in the background (a driver process that outlives the terminal, its "
        "output in STATE/drivers/RUN.log); prints the run id and returns",
    )
    r.add_argument("--run-id-fd", type=int, help=argparse.SUPPRESS)  # a detached driver's report
    r.add_argument("--overrides-file", help=argparse.SUPPRESS)  # a detached driver's --set items (JSON)
    r.set_defaults(fn=cmd_run)

    w = sub.add_parser(
        "wait", help="wait until a run finishes (exit 0 succeeded, 1 failed, cancelled or lost, 124 timeout)"
    )
    w.add_argument("run")
    w.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 124)")
    w.add_argument("--state")
    w.set_defaults(fn=cmd_wait)

    c = sub.add_parser("cancel", help="stop a running run (its gangs stop; sealed outputs stay)")
    c.add_argument("run")
    c.add_argument("--wait", type=float, default=30.0, help="seconds before the driver is killed")
    c.add_argument("--state")
    c.set_defaults(fn=cmd_cancel)

    rp = sub.add_parser("report", help="write an HTML page of a run: timeline, rows, bytes, repartition paths")
    rp.add_argument("run")
    rp.add_argument("-o", "--output", help="file or directory (default: STATE/reports/RUN.html)")
    rp.add_argument("--state")
    rp.set_defaults(fn=cmd_report)

    st = sub.add_parser("status", help="list runs, or the stages of one run")
    st.add_argument("run", nargs="?")
    st.add_argument("--state")
    st.set_defaults(fn=cmd_status)

    lg = sub.add_parser("logs", help="the ranks' output of a run (latest attempt of each stage)")
    lg.add_argument("run")
    lg.add_argument("stage", nargs="?")
    lg.add_argument("--rank", type=int)
    lg.add_argument("--attempt", type=int)
    lg.add_argument("--driver", action="store_true", help="the driver's own output (a run started with --detach)")
    lg.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="every attempt's lines as they are written, until the run ends (exit status as `phalanx wait`)",
    )
    lg.add_argument("--state")
    lg.set_defaults(fn=cmd_logs)

    s = sub.add_parser("store", help="list, show or remove datasets; gc: what no run references")
    s.add_argument("--root", help="store directory (default: $PHALANX_STORE or /dev/shm/phalanx-$USER/store)")
    s.add_argument("--session", default="default")
    ssub = s.add_subparsers(dest="store_cmd", required=True)
    ssub.add_parser("ls")
    show = ssub.add_parser("show")
    show.add_argument("name")
    rm = ssub.add_parser("rm", help="remove datasets of the session (--all: all of them)")
    rm.add_argument("names", nargs="*")
    rm.add_argument("--all", action="store_true")
    rm.add_argument(
        "--staging", action="store_true", help="remove the session's unsealed writes (a killed driver's); datasets stay"
    )
    ssub.add_parser(
        "sessions", help="every session with its datasets' count and size (a run writes to <workflow>-<run id>)"
    )
    gc = ssub.add_parser(
        "gc",
        help="remove the sessions no run references: runs deleted from the run database, or beyond --keep-last; "
        "never a running run's, another user's, one used within --min-age, or one no run made",
    )
    gc.add_argument("--root", default=argparse.SUPPRESS, help="store directory (as phalanx store --root)")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    gc.add_argument(
        "--keep-last", type=int, metavar="N", help="keep the sessions of only the N newest runs of each workflow"
    )
    gc.add_argument(
        "--min-age",
        type=float,
        default=3600.0,
        metavar="S",
        help="keep sessions written or read in the last S seconds (default 3600: a run another state directory drives)",
    )
    gc.add_argument(
        "--state", help="state directory whose runs count (default: $PHALANX_STATE or ~/.local/state/phalanx)"
    )
    gc.add_argument("-v", "--verbose", action="store_true", help="say why each kept session stays")
    s.set_defaults(fn=cmd_store)

    ui = sub.add_parser("ui", help="a live web dashboard of runs, their ranks, logs and the store (Ctrl-C stops it)")
    ui.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one)")
    ui.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine's users only)"
    )
    ui.add_argument("--root", help="store directory whose datasets it shows (as phalanx store --root)")
    ui.add_argument("--token-file", help="a file holding the token (default: a new one, printed in the address)")
    ui.add_argument("--state")
    ui.set_defaults(fn=cmd_ui)

    me = sub.add_parser(
        "metrics", help="serve Prometheus metrics of runs, stages and ranks at /metrics (Ctrl-C stops it)"
    )
    me.add_argument("--port", type=int, default=9465, help="port (default 9465; 0: a free one)")
    me.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; another needs --token-file)"
    )
    me.add_argument("--token-file", help="a file (mode 0600) holding the bearer token every scrape must present")
    me.add_argument("--runs", type=int, default=20, help="the newest runs exported, besides running ones (default 20)")
    me.add_argument("--state")
    me.set_defaults(fn=cmd_metrics)

    sc = sub.add_parser("schema", help="write the JSON Schemas of workflow and site files")
    sc.add_argument("--out", default="docs")
    sc.set_defaults(fn=cmd_schema)

    args = ap.parse_args(argv)
    global _COMMAND
    _COMMAND = argv is None
    # `phalanx status | head` ends quietly; not for a driver (run), which writes to rank sockets
    # that may have just closed: there a broken pipe is an error to handle, not death.
    # Only for the command itself: main(argv) called from a program (a test) must not change
    # how that whole process treats SIGPIPE.
    if argv is None and hasattr(signal, "SIGPIPE") and args.fn is not cmd_run:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    from .errors import PhalanxError

    try:
        return args.fn(args)
    except PhalanxError as exc:  # a refused directory, an unreachable store...: one line, no traceback
        print(f"phalanx {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
