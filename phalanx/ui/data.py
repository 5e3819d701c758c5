"""What the dashboard shows, as JSON-ready dicts read from the run DB and the store.

Pure reads, no web framework: the server (``ui.app``) calls these in a thread, and tests call
them directly.  Everything taken from a run (names, errors, messages) is masked by the run DB
and ``phalanx.redact`` before it leaves here; the page escapes it when it draws it.
"""

from __future__ import annotations

import time
from typing import Any

from ..orchestrator.report import UnknownRun, summary, timeline_svg
from ..orchestrator.retry import label
from ..orchestrator.rundb import FINAL, RunDB
from ..orchestrator.samples import straggler as find_straggler
from ..redact import redact, redact_opt

# DAG layout, in SVG units: one column per depth, one row per stage of that depth.
NODE_W, NODE_H, COL_GAP, ROW_GAP, MARGIN = 170, 44, 60, 18, 10


def runs(db: RunDB, limit: int = 50) -> list[dict]:
    """The newest runs, newest first: id, workflow, state, start, duration, stage counts by state."""
    out = []
    now = time.time()
    for r in db.runs(limit):
        states: dict[str, int] = {}
        for s in db.stages(r["id"]):
            states[s["state"]] = states.get(s["state"], 0) + 1
        out.append(
            {
                "id": r["id"],
                "workflow": r["workflow"],
                "state": r["state"],
                "file": redact_opt(r["file"]),
                "site": r["site"],
                "started": r["started"],
                "seconds": (r["ended"] or now) - r["started"] if r["started"] else None,
                "stages": states,
            }
        )
    return out


def run(db: RunDB, run_id: str) -> dict:
    """One run: its header, stages (attempts, ranks with their latest resource sample, inputs,
    outputs), DAG layout, failures (each failed rank with its log) and events.  ``UnknownRun``
    when the run DB has no such run."""
    s = summary(db, run_id)  # the report's view: attempts per stage, lost attempts of ended runs
    rec = s["run"]
    now = time.time()
    samples = _latest_samples(db, run_id)
    stages = []
    for st in s["stages"]:
        attempts = [_attempt(a) for a in st["attempt_list"]]
        last = st["attempt_list"][-1] if st["attempt_list"] else None
        stages.append(
            {
                "name": st["stage"],
                "state": st["state"],
                "ranks": st["ranks"],
                "site": st.get("site"),
                "attempts": attempts,
                "seconds": ((st["ended"] or now) - st["started"]) if st["started"] else None,
                "error": redact_opt(st["error"]),
                "outputs": {k: {"rows": v[0], "bytes": v[1]} for k, v in (st["outputs"] or {}).items()},
                "inputs": {
                    k: {
                        "dataset": v.get("dataset"),
                        "rows": v.get("rows"),
                        "bytes": v.get("bytes"),
                        "plan": v.get("plan"),
                    }
                    for k, v in (st["inputs"] or {}).items()
                },
                "rank_table": (table := _rank_table(st, last, samples) if last else []),
                "straggler": straggler(table),
                "deps": st.get("deps") or [],
            }
        )
    return {
        "run": {
            "id": rec["id"],
            "workflow": rec["workflow"],
            "state": rec["state"],
            "final": rec["state"] in FINAL,
            "file": redact_opt(rec["file"]),
            "site": rec["site"],
            "session": rec["session"],
            "started": rec["started"],
            "seconds": ((rec["ended"] or now) - rec["started"]) if rec["started"] else None,
        },
        "stages": stages,
        "dag": dag_layout(stages),
        "failures": failures(stages),
        "events": [
            {"ts": e["ts"], "stage": e["stage"], "kind": e["kind"], "message": redact_opt(e["message"])}
            for e in s["events"][-200:]  # the newest: a long run's whole history is the report's
        ],
    }


def timeline(db: RunDB, run_id: str) -> str:
    """The report's timeline of the run, as an SVG element."""
    return timeline_svg(summary(db, run_id))


def _attempt(a: dict) -> dict:
    return {
        "attempt": a["attempt"],
        "state": a["state"],
        "started": a["started"],
        "seconds": (a["until"] - a["started"]) if a["started"] else None,
        "cause": label(a["cause"]) if a.get("cause") else None,
        "error": _first_line(redact_opt(a["error"])),
        "failed_ranks": [
            r["rank"] for r in a.get("rank_info") or [] if isinstance(r, dict) and r.get("outcome") == "failed"
        ],
    }


def _rank_table(st: dict, attempt: dict, samples: dict[tuple[str, int, int], dict]) -> list[dict]:
    """Per rank of the stage's latest attempt: where it ran, how it ended, its latest sample."""
    records = {r["rank"]: r for r in attempt.get("rank_info") or [] if isinstance(r, dict) and "rank" in r}
    rows = []
    for rank in range(st["ranks"] or 0):
        rec = records.get(rank, {})
        sample = samples.get((st["stage"], attempt["attempt"], rank), {})
        failed = rec.get("outcome") == "failed"
        rows.append(
            {
                "rank": rank,
                "host": rec.get("host") or sample.get("host"),
                "pid": rec.get("pid"),
                "failed": failed,
                "outcome": rec.get("outcome") or ("ok" if rec.get("ended") else None),
                "error": _first_line(redact_opt(rec.get("error"))),
                "attempt": attempt["attempt"],
                **{k: sample.get(k) for k in ("cpu", "rss", "peak_rss", "sent", "received", "comm_s", "elapsed")},
            }
        )
    return rows


def straggler(ranks: list[dict]) -> int | None:
    """The rank the others waited for (``orchestrator.samples.straggler``: the one rule that
    ``phalanx status`` and the report use too), among the ranks with a sample; or None."""
    sampled = [r for r in ranks if r.get("elapsed") is not None]
    found = find_straggler(sampled)
    return found.rank if found is not None else None


def _latest_samples(db: RunDB, run_id: str) -> dict[tuple[str, int, int], dict]:
    """The newest resource sample of each rank of each attempt (none where the run DB has no
    samples: a run of an older phalanx, or sampling off)."""
    return {(r["stage"], r["attempt"], r["rank"]): r for r in db.samples(run_id, latest=True)}


def failures(stages: list[dict]) -> list[dict]:
    """Each failed attempt's failed ranks (or the attempt itself when no rank is named): what the
    page lists with a link to the rank's log."""
    out = []
    for st in stages:
        for a in st["attempts"]:
            if a["state"] != "failed":
                continue
            out.append(
                {
                    "stage": st["name"],
                    "attempt": a["attempt"],
                    "ranks": a["failed_ranks"],
                    "cause": a["cause"],
                    "error": a["error"],
                }
            )
    return out


def dag_layout(stages: list[dict]) -> dict:
    """Positions for drawing the run's DAG: a stage's column is the length of the longest chain
    of stages it waits for; stages of a column are stacked in the workflow's order."""
    names = [s["name"] for s in stages]
    deps = {s["name"]: [d for d in s["deps"] if d in names] for s in stages}
    depth: dict[str, int] = {}

    def level(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in depth:
            ups = [d for d in deps[name] if d not in seen]  # a cycle cannot pass validation; guard anyway
            depth[name] = 1 + max((level(d, seen | {name}) for d in ups), default=-1)
        return depth[name]

    rows: dict[int, int] = {}
    nodes = []
    for s in stages:
        col = level(s["name"])
        row = rows.get(col, 0)
        rows[col] = row + 1
        x, y = MARGIN + col * (NODE_W + COL_GAP), MARGIN + row * (NODE_H + ROW_GAP)
        nodes.append({"name": s["name"], "state": s["state"], "x": x, "y": y, "w": NODE_W, "h": NODE_H})
    width = MARGIN * 2 + (max(depth.values(), default=0) + 1) * (NODE_W + COL_GAP) - COL_GAP
    height = MARGIN * 2 + max(rows.values(), default=1) * (NODE_H + ROW_GAP) - ROW_GAP
    edges = [[d, s] for s, ups in deps.items() for d in ups]
    return {"nodes": nodes, "edges": edges, "width": width, "height": height}


def store_view(store: Any, session: str | None = None) -> list[dict]:
    """The store's datasets (of one session, or of every session): per dataset its rows, bytes,
    partitioning, producer, and per partition its rows, bytes and where it lives."""
    sessions = [session] if session else sorted(store.sessions())
    out = []
    for name in sessions:
        for info in store.meta.list(name):
            out.append(
                {
                    "session": info.session,
                    "name": info.name,
                    "rows": info.num_rows,
                    "bytes": info.nbytes,
                    "partitioning": info.partitioning.get("kind"),
                    "producer": info.producer,
                    "run": info.run,
                    "created": info.created,
                    "columns": [f"{f.name}: {f.type}" for f in info.schema],
                    "partitions": [
                        {"index": p.index, "rows": p.rows, "bytes": p.bytes, **p.place} for p in info.partitions
                    ],
                }
            )
    return out


def _first_line(text: str | None) -> str | None:
    if not text:
        return text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return redact(lines[-1] if lines and lines[0].startswith("Traceback") else lines[0])[:300] if lines else ""


__all__ = ["UnknownRun", "dag_layout", "failures", "run", "runs", "store_view", "timeline"]
