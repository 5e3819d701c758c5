#!/usr/bin/env python
"""Gang start time on SLURM — per-stage job vs pilot job step — next to local processes.

For each executor, ``--repeat`` times (interleaved, so machine load hits all alike):
  start   Gang(ranks).start(): ranks launched, connected, rendezvoused, communicator built
  app     one trivial app (an allreduce) on the started gang
  close   graceful stop (ranks exit; the SLURM job or step ends)
  bare    SLURM's own overhead without Python: launch ``true`` on every rank → all exit codes
Uses the private test cluster (tests/infra/slurm-up.sh; started here if it is not up, and
stopped again at the end).

    .venv/bin/python bench/slurm_gang.py [--ranks 2] [--repeat 5]

``--fanout N``: instead, N one-rank gangs that start together (a fan-out's instances), each
launched from its own thread as the scheduler does, running ``true``, per-stage mode:
  array           one ``sbatch --array`` for all (slurm.array: true), one squeue for all
  per-job         one sbatch each (slurm.array: false), one squeue for all
  per-job, own    one sbatch each, and each gang polling its own job (before job arrays)
printing, per mode: the time to submit them all (and per instance), until all exited, to close
them, the overhead per instance (the whole fan-out over N: ``true`` costs nothing), SLURM
commands run, and slurmctld's CPU.  On the test cluster the 200 jobs run 6 at a time (3 nodes x
2 CPUs), so "exited" is mostly SLURM starting 200 batch scripts and sruns on 2 real cores.

    .venv/bin/python bench/slurm_gang.py --fanout 200 [--modes array,per-job,per-job-own]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import phalanx as px  # noqa: E402
from phalanx.executors.local import LocalLauncher  # noqa: E402
from phalanx.executors.slurm import SlurmLauncher, SlurmPilot  # noqa: E402

SLURM_DIR = os.environ.get("PHALANX_SLURM_DIR", "/tmp/phalanx-slurm")
CONF = f"{SLURM_DIR}/slurm.conf"


def allreduce(env):
    import numpy as np

    return float(env.comm.allreduce(np.array([env.rank], dtype=np.float64))[0])


def cluster_up() -> bool:
    r = subprocess.run(["scontrol", "ping"], env={**os.environ, "SLURM_CONF": CONF}, capture_output=True, text=True)
    return Path(CONF).exists() and "is UP" in r.stdout


def bare(launcher, ranks: int, log_dir: Path) -> float:
    env = [{"PHALANX_WORLD_SIZE": str(ranks)} for _ in range(ranks)]
    t0 = time.perf_counter()
    launcher.launch(["true"], env, log_dir)
    while any(c is None for c in launcher.exitcodes()):
        time.sleep(0.01)
    took = time.perf_counter() - t0
    launcher.kill()
    return took


def ctld_cpu() -> float:
    """CPU seconds slurmctld has used (the test cluster's, by its pid file)."""
    pid = Path(SLURM_DIR, "run", "slurmctld.pid").read_text().strip()
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FANOUT_MODES = ("array", "per-job", "per-job-own")


def fanout(n: int, mode: str, tmp: Path) -> dict:
    """N one-rank gangs running ``true``, launched together: times, commands, slurmctld CPU."""
    import threading

    from phalanx.executors.slurm import SlurmExecutor

    section = {"conf": CONF, "partition": "debug", "time": "00:10:00", "poll_interval": 0.5}
    ex = SlurmExecutor({**section, "array": mode == "array"}, site="bench")
    launchers = [ex.launcher(1) for _ in range(n)]
    if mode == "per-job-own":
        for launcher in launchers:
            launcher.watcher = None  # type: ignore[attr-defined]  # each polls squeue itself
    env = [{"PHALANX_WORLD_SIZE": "1"}]
    cpu0, t0 = ctld_cpu(), time.perf_counter()
    threads = [
        threading.Thread(target=l.launch, args=(["true"], env, tmp / f"{mode}-{i}")) for i, l in enumerate(launchers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = time.perf_counter() - t0
    pending = list(launchers)
    while pending:  # what every gang's monitor does, here from one thread
        pending = [l for l in pending if any(c is None for c in l.exitcodes())]
        time.sleep(0.05)
    exited = time.perf_counter() - t0
    assert all(l.exitcodes() == [0] for l in launchers)
    for launcher in launchers:
        launcher.kill()
    closed = time.perf_counter() - t0
    calls: dict[str, int] = {}
    for slurm in {id(l.slurm): l.slurm for l in launchers}.values():
        for name, count in slurm.calls.items():
            calls[name] = calls.get(name, 0) + count
    jobs = {l.job_id.split("_")[0] for l in launchers if l.job_id}
    return {
        "submit_s": submitted,
        "exited_s": exited,
        "closed_s": closed,
        "per_instance_s": closed / n,
        "jobs": len(jobs),
        "calls": calls,
        "ctld_cpu_s": ctld_cpu() - cpu0,
    }


def main_fanout(n: int, modes: list[str]) -> None:
    started_here = False
    if not cluster_up():
        subprocess.run([str(REPO / "tests/infra/slurm-up.sh")], check=True, capture_output=True)
        started_here = True
    tmp = Path(tempfile.mkdtemp(prefix="phalanx-bench-fanout-"))
    results = {}
    try:
        for mode in modes:
            results[mode] = fanout(n, mode, tmp)
    finally:
        if started_here:
            subprocess.run([str(REPO / "tests/infra/slurm-down.sh")], capture_output=True)
    print(
        f"fan-out of {n} one-rank gangs running `true` (SLURM: 3 slurmd nodes x 2 CPUs on this "
        f"{os.cpu_count()}-core machine, poll_interval 0.5 s)"
    )
    print(
        f"{'mode':<12} {'jobs':>5} {'submit s':>9} {'ms/inst':>8} {'exited s':>9} {'closed s':>9} {'per inst s':>11} "
        f"{'sbatch':>7} {'squeue':>7} {'scancel':>8} {'ctld cpu s':>11}"
    )
    for mode, r in results.items():
        c = r["calls"]
        print(
            f"{mode:<12} {r['jobs']:>5} {r['submit_s']:9.2f} {1000 * r['submit_s'] / n:8.1f} "
            f"{r['exited_s']:9.2f} {r['closed_s']:9.2f} "
            f"{r['per_instance_s']:11.3f} {c.get('sbatch', 0):>7} {c.get('squeue', 0):>7} {c.get('scancel', 0):>8} "
            f"{r['ctld_cpu_s']:11.2f}"
        )
    if "array" in results:
        a = results["array"]
        for mode, r in results.items():
            if mode != "array":
                print(
                    f"array vs {mode}: per-instance overhead {a['per_instance_s'] / r['per_instance_s']:.2f}x "
                    f"({r['per_instance_s'] - a['per_instance_s']:+.3f} s saved per instance), "
                    f"submit {a['submit_s'] / r['submit_s']:.2f}x, slurmctld CPU {a['ctld_cpu_s'] / max(r['ctld_cpu_s'], 1e-9):.2f}x"
                )
    print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fanout", type=int, default=0, help="N one-rank gangs: job arrays vs one job each")
    ap.add_argument("--modes", default=",".join(FANOUT_MODES), help="fan-out modes, comma-separated")
    args = ap.parse_args()
    if args.fanout:
        main_fanout(args.fanout, [m for m in args.modes.split(",") if m])
        return

    started_here = False
    if not cluster_up():
        subprocess.run([str(REPO / "tests/infra/slurm-up.sh")], check=True, capture_output=True)
        started_here = True
    tmp = Path(tempfile.mkdtemp(prefix="phalanx-bench-slurm-"))
    base = {"conf": CONF, "spread_job": True, "poll_interval": 0.25}
    pilot = None
    try:
        # the pilot holds what the gangs need (one slot per rank), the rest stays free for
        # the per-stage jobs
        t0 = time.perf_counter()
        pilot = SlurmPilot.from_site({**base, "pilot": {"nodes": min(args.ranks, 3), "ntasks": args.ranks}}).start(
            timeout=60
        )
        pilot_wait = time.perf_counter() - t0
        makers = {
            "local": lambda: LocalLauncher(echo=False),
            "slurm per-stage": lambda: SlurmLauncher.from_site(base, args.ranks),
            "slurm pilot": lambda: SlurmLauncher.from_site({**base, "allocation": "pilot"}, args.ranks, pilot=pilot),
        }
        times: dict[str, dict[str, list[float]]] = {
            m: {"start": [], "app": [], "close": [], "bare": []} for m in makers
        }
        for i in range(args.repeat):
            for mode, make in makers.items():
                gang = px.Gang(args.ranks, executor=make(), echo=False, log_dir=tmp / f"{mode.replace(' ', '-')}-{i}")
                gang.start()
                t1 = time.perf_counter()
                assert gang.run(allreduce) == [sum(range(args.ranks))] * args.ranks
                t2 = time.perf_counter()
                gang.close()
                t3 = time.perf_counter()
                rec = times[mode]
                rec["start"].append(gang.ready_seconds)
                rec["app"].append(t2 - t1)
                rec["close"].append(t3 - t2)
                rec["bare"].append(bare(make(), args.ranks, tmp / f"bare-{mode.replace(' ', '-')}-{i}"))
    finally:
        if pilot is not None:
            pilot.close()
        if started_here:
            subprocess.run([str(REPO / "tests/infra/slurm-down.sh")], capture_output=True)

    med = {m: {k: statistics.median(v) for k, v in rec.items()} for m, rec in times.items()}
    print(
        f"gang of {args.ranks} ranks, median of {args.repeat} "
        f"(SLURM: 3 slurmd nodes on this {os.cpu_count()}-core machine; pilot held: "
        f"allocation became RUNNING in {pilot_wait:.2f} s, once)"
    )
    print(
        f"{'executor':<16} {'start s':>8} {'×local':>7} {'app s':>7} {'close s':>8} "
        f"{'start+close':>12} {'×local':>7} {'bare s':>7}"
    )
    loc = med["local"]
    for mode, m in med.items():
        sc = m["start"] + m["close"]
        print(
            f"{mode:<16} {m['start']:8.2f} {m['start'] / loc['start']:7.2f} {m['app']:7.3f} "
            f"{m['close']:8.2f} {sc:12.2f} {sc / (loc['start'] + loc['close']):7.2f} {m['bare']:7.3f}"
        )
    ps, pp = med["slurm per-stage"], med["slurm pilot"]
    print(
        f"pilot vs per-stage: start {pp['start'] / ps['start']:.2f}×, "
        f"bare launch {pp['bare'] / ps['bare']:.2f}× ({ps['bare'] - pp['bare']:+.2f} s saved per gang)"
    )
    print(
        "all runs (s):",
        json.dumps({m: {k: [round(x, 3) for x in v] for k, v in rec.items()} for m, rec in times.items()}),
    )
    print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())


if __name__ == "__main__":
    main()
