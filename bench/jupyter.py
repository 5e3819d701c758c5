"""phalanx in Jupyter: how long a ``%%px`` round trip and a gang start take in a real kernel.

    .venv/bin/python bench/jupyter.py [--repeat 200] [--starts 5] [--ranks 2]

Targets (issue 12): a ``%%px`` round trip on a warm 2-rank gang ≤ 50 ms; starting a gang from a
notebook no slower than from a script.

- ``%%px`` round trip: the client sends a cell (as a notebook frontend does) and waits for the
  kernel's reply and idle state; a warm gang (``%px_gang 2`` started before).  Three cells: an
  assignment (nothing shown), a print on every rank (output grouped by rank), an expression
  (a value per rank).  Also the magic alone inside the kernel (no messaging), and
  ``gang.run(noop)`` from the notebook and from a script for comparison.
- gang start: ``px.Gang(2).start()`` in a fresh script process and in the kernel, alternated
  (script, notebook, script, ...) so that a busy machine slows both alike; ``ready_seconds``
  (launch → every rank connected with its communicator) and the wall time of the call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from jupyter_kernel import Kernel  # noqa: E402

SCRIPT_START = """
import json, time
import phalanx as px
t0 = time.perf_counter()
g = px.Gang({ranks}, echo=False)
g.start()
wall = time.perf_counter() - t0
runs = []
noop = lambda env: None
for _ in range({runs}):
    t = time.perf_counter(); g.run(noop); runs.append(time.perf_counter() - t)
g.close()
print(json.dumps({{"ready": g.ready_seconds, "wall": wall, "runs": runs}}))
"""

NB_START = """
import json, time
t0 = time.perf_counter()
_g = px.Gang({ranks})
_g.start()
_wall = time.perf_counter() - t0
_runs = []
for _ in range({runs}):
    t = time.perf_counter(); _g.run(noop); _runs.append(time.perf_counter() - t)
_g.close()
print(json.dumps({{"ready": _g.ready_seconds, "wall": _wall, "runs": _runs}}))
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def ms(values: list[float]) -> str:
    return (
        f"median {statistics.median(values) * 1e3:7.2f} ms · p90 {pct(values, 0.9) * 1e3:7.2f} ms · "
        f"min {min(values) * 1e3:6.2f} ms  (n={len(values)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200, help="%%px round trips per kind of cell")
    ap.add_argument("--starts", type=int, default=5, help="gang starts from a script and from the notebook each")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-jupyter-"))
    print(f"a real ipykernel of {sys.executable}; {args.ranks}-rank gangs on this machine")
    k = Kernel(work)
    try:
        k.execute("import phalanx as px\n%load_ext phalanx\nnoop = lambda env: None")
        res = k.execute(f"%px_gang {args.ranks}")
        print(f"%px_gang {args.ranks}: {res.seconds:.2f} s (cell round trip, gang start included)")
        k.execute("%%px\nx = rank")  # warm: the cell runner imported on the ranks

        print(f"\n%%px round trip on a warm {args.ranks}-rank gang (client → kernel → ranks → reply), target ≤ 50 ms:")
        results = {}
        for label, cell in (
            ("assignment", "%%px\nx = rank + 1"),
            ("print per rank", "%%px\nprint('rank', rank)"),
            ("value per rank", "%%px\nrank * 2"),
        ):
            times = [k.execute(cell).seconds for _ in range(args.repeat)]
            results[label] = times
            print(f"  {label:<16} {ms(times)}")
        inner = k.value(
            "[__import__('timeit').timeit(lambda: get_ipython().run_cell_magic('px', '', 'x = rank'), "
            f"number=1) for _ in range({args.repeat})]"
        )
        print(f"  {'magic alone':<16} {ms(inner)}  (inside the kernel, no messaging)")
        base = [k.execute("1").seconds for _ in range(args.repeat)]
        print(f"  {'empty cell':<16} {ms(base)}  (the kernel's own round trip, for scale)")

        print(f"\ngang start, {args.ranks} ranks, alternating a script and the notebook ({args.starts} each):")
        script, notebook = [], []
        for _ in range(args.starts):
            out = subprocess.run(
                [sys.executable, "-c", SCRIPT_START.format(ranks=args.ranks, runs=50)],
                capture_output=True,
                text=True,
                check=True,
                cwd=work,
            )
            script.append(json.loads(out.stdout.strip().splitlines()[-1]))
            res = k.execute(NB_START.format(ranks=args.ranks, runs=50))
            notebook.append(json.loads(res.stream().strip().splitlines()[-1]))
        for what in ("ready", "wall"):
            s = statistics.median(r[what] for r in script)
            n = statistics.median(r[what] for r in notebook)
            s_min, n_min = min(r[what] for r in script), min(r[what] for r in notebook)
            print(
                f"  {what:<6} median: script {s:6.2f} s · notebook {n:6.2f} s · notebook/script {n / s:5.2f}"
                f"   min: script {s_min:6.2f} s · notebook {n_min:6.2f} s · {n_min / s_min:5.2f}"
            )
        print(
            "  each (script, notebook) pair, ready: "
            + ", ".join(f"({a['ready']:.2f}, {b['ready']:.2f})" for a, b in zip(script, notebook))
        )
        pairs = statistics.median(b["ready"] / a["ready"] for a, b in zip(script, notebook))
        print(f"  median of the pairs' notebook/script ratios: {pairs:.2f}")
        s_runs = [t for r in script for t in r["runs"]]
        n_runs = [t for r in notebook for t in r["runs"]]
        print(f"  gang.run(noop) script   {ms(s_runs)}")
        print(f"  gang.run(noop) notebook {ms(n_runs)}")
        worst = max(statistics.median(t) for t in results.values())
        ratio = statistics.median(r["ready"] for r in notebook) / statistics.median(r["ready"] for r in script)
        print(
            f"\n%%px round trip (worst median) {worst * 1e3:.1f} ms: {'OK' if worst <= 0.05 else 'OVER'} (≤ 50 ms); "
            f"gang start notebook/script {ratio:.2f}"
        )
    finally:
        k.shutdown()


if __name__ == "__main__":
    main()
