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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

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
