#!/usr/bin/env python3
"""Run the fault suite and regenerate the table in docs/reliability.md from its results.

    .venv/bin/python scripts/reliability_table.py            # the whole suite (local, slurm, ray)
    .venv/bin/python scripts/reliability_table.py -m "faults and not slurm and not ray"

Each fault test records fault, backend, what phalanx did, time to detect and data lost
(the fault fixture in tests/conftest.py); the table between the markers in docs/reliability.md is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"


def render(rows: list[dict]) -> str:
    lines = ["| fault | backend | outcome | time to detect | data lost | test |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["fault"], r["backend"])):
        detect = f"{r['detect_s']:.2f} s" if r.get("detect_s") is not None else "—"
        state = "passes" if r["passed"] else "**FAILS**"
        lines.append(f"| {r['fault']} | {r['backend']} | {r['result']} | {detect} | {r['lost'] or '—'} | {state} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", default="faults", help="pytest marker expression (default: faults)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "PHALANX_FAULT_RESULTS": str(results)}
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", args.m, "tests/faults"], cwd=ROOT, env=env)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    if not rows:
        print("no fault results recorded", file=sys.stderr)
        return code or 1
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: markers {BEGIN} / {END} not found", file=sys.stderr)
        return 1
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")
    print(f"{DOC}: {len(rows)} faults, {sum(not r['passed'] for r in rows)} failing")
    return code


if __name__ == "__main__":
    sys.exit(main())
