"""How gangs, runs, run handles and frames look in a notebook: HTML, and the same as plain text.

Pure functions of the objects they render: nothing here imports IPython, so a ``_repr_html_``
works anywhere (nbconvert, a test).  Everything taken from a gang, a run or a rank's output is
HTML-escaped (and credentials masked, ``phalanx.redact``).
"""

from __future__ import annotations

import html
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...redact import redact
from ...runtime.procinfo import memory

if TYPE_CHECKING:
    from ...gang import Gang

STATE_COLOURS = {
    "running": "#3b7dd8",
    "starting": "#3b7dd8",
    "done": "#2f9e55",
    "ok": "#2f9e55",
    "succeeded": "#2f9e55",
    "failed": "#d64545",
    "error": "#d64545",
    "stopped": "#e39b2d",
    "interrupted": "#e39b2d",
    "cancelled": "#e39b2d",
    "degraded": "#d64545",
    "lost": "#8c8c8c",
    "not started": "#8c8c8c",
    "pending": "#9a9a9a",
    "skipped": "#c9a3a3",
    "reused": "#2aa1a1",
}
_BOX = (
    "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;line-height:1.4;"
    "border:1px solid #ddd;border-radius:4px;padding:6px 10px;margin:2px 0;max-width:100%"
)
_TABLE = "border-collapse:collapse;margin:4px 0"
_CELL = "border:1px solid #e3e3e3;padding:2px 8px;text-align:left;vertical-align:top"
_PRE = (
    "font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;margin:2px 0 6px;padding:4px 6px;"
    "background:#f7f7f7;white-space:pre-wrap;max-height:24em;overflow:auto"
)


def esc(value: Any) -> str:
    return html.escape(redact(str(value)), quote=True)


def badge(state: str) -> str:
    colour = STATE_COLOURS.get(state, "#999")
    return (
        f'<span class="px-state" data-state="{esc(state)}" style="background:{colour};color:#fff;'
        f'border-radius:3px;padding:0 6px">{esc(state)}</span>'
    )


def table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """An HTML table; the cells of ``rows`` are HTML already."""
    head = "".join(f'<th style="{_CELL};background:#f3f3f3">{esc(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{c}</td>' for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}" style="{_TABLE}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def pre(text: str, cls: str = "") -> str:
    return f'<pre class="{cls}" style="{_PRE}">{esc(text)}</pre>'


def box(inner: str, cls: str) -> str:
    return f'<div class="{cls}" style="{_BOX}">{inner}</div>'


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


# ---- memory of ranks on this host -----------------------------------------------------------------
def is_here(host: str | None) -> bool:
    """Whether a rank's host (as the rank reported it) is this machine: its pid means something here."""
    return not host or host in (socket.gethostname(), socket.getfqdn(), "localhost")


def rank_memory(pid: int | None, host: str | None) -> str:
    mem = memory(pid) if is_here(host) else None  # the private memory a rank's limit counts
    return f"{size(mem.private)} (peak {size(mem.peak)})" if mem else "—"


# ---- gangs ----------------------------------------------------------------------------------------
def gang_facts(gang: Gang) -> dict[str, Any]:
    """What a notebook shows of a gang: executor, ranks and where they run, state, memory, logs."""
    ex = gang.executor
    name = getattr(ex, "name", type(ex).__name__)
    site = getattr(ex, "site", None)
    if gang.running:
        problem = gang.health()
        state = "running" if problem is None else "degraded"
    else:
        problem, state = None, ("stopped" if gang.gang_id else "not started")
    try:
        status = gang.status()
    except Exception as exc:  # the resource manager unreachable: a repr must not raise
        status = f"status unknown: {exc}"
    ranks = []
    if gang.running:
        for r in range(gang.world_size):
            pid = gang.pids[r] if r < len(gang.pids) else None
            host = gang.hosts[r] if r < len(gang.hosts) else None
            ranks.append({"rank": r, "host": host or "—", "pid": pid, "memory": rank_memory(pid, host)})
    return {
        "gang_id": gang.gang_id or "—",
        "state": state,
        "problem": problem,
        "ranks": gang.world_size,
        "executor": name + (f" (site {site})" if site and site != name else ""),
        "communicator": gang.communicator,
        "rendezvous": gang.rendezvous,
        "status": status,
        "ready_s": gang.ready_seconds,
        "runs": getattr(gang, "runs", 0),  # of the gang now running (not of those a failure replaced)
        "log_dir": str(gang.log_dir) if gang.log_dir else "—",
        "per_rank": ranks,
    }


def gang_html(gang: Gang) -> str:
    f = gang_facts(gang)
    where = _where(f["per_rank"])
    head = (
        f"<b>phalanx gang</b> <code>{esc(f['gang_id'])}</code> {badge(f['state'])} "
        f"· {f['ranks']} rank{'s' if f['ranks'] != 1 else ''}{(' on ' + esc(where)) if where else ''}"
    )
    facts = [
        ("executor", esc(f["executor"])),
        ("communicator", esc(f"{f['communicator']} · rendezvous {f['rendezvous']}")),
    ]
    if f["status"]:
        facts.append(("resource manager", esc(f["status"])))
    if f["problem"]:
        facts.append(("problem", f'<span style="color:#d64545">{esc(f["problem"])}</span>'))
    if f["ready_s"] is not None:
        facts.append(
            ("started in", esc(seconds(f["ready_s"])) + f" · {f['runs']} run{'s' if f['runs'] != 1 else ''} since")
        )
    facts.append(("log directory", f"<code>{esc(f['log_dir'])}</code>"))
    kv = "".join(
        f'<tr><th style="{_CELL};background:#f3f3f3">{k}</th><td style="{_CELL}">{v}</td></tr>' for k, v in facts
    )
    ranks = (
        table(
            ["rank", "host", "pid", "memory (resident)"],
            [[str(r["rank"]), esc(r["host"]), esc(r["pid"] or "—"), esc(r["memory"])] for r in f["per_rank"]],
            "px-ranks",
        )
        if f["per_rank"]
        else ""
    )
    return box(f'<div>{head}</div><table style="{_TABLE}">{kv}</table>{ranks}', "phalanx-gang")


def gang_text(gang: Gang) -> str:
    f = gang_facts(gang)
    lines = [
        f"phalanx gang {f['gang_id']} · {f['state']} · {f['ranks']} rank{'s' if f['ranks'] != 1 else ''}",
        f"  executor {f['executor']} · communicator {f['communicator']} · rendezvous {f['rendezvous']}",
    ]
    if f["status"]:
        lines.append(f"  resource manager: {f['status']}")
    if f["problem"]:
        lines.append(f"  problem: {f['problem']}")
    if f["ready_s"] is not None:
        lines.append(f"  started in {seconds(f['ready_s'])} · {f['runs']} run{'s' if f['runs'] != 1 else ''} since")
    for r in f["per_rank"]:
        lines.append(f"  rank {r['rank']}  {r['host']}  pid {r['pid'] or '—'}  memory {r['memory']}")
    lines.append(f"  logs {f['log_dir']}")
    return redact("\n".join(lines))


def _where(per_rank: list[dict]) -> str:
    hosts: dict[str, int] = {}
    for r in per_rank:
        hosts[r["host"]] = hosts.get(r["host"], 0) + 1
    return ", ".join(h if n == 1 or len(hosts) == 1 else f"{h} ×{n}" for h, n in hosts.items())


# ---- the view of one gang.run (view.RunView holds the state) --------------------------------------
def run_html(view: Any, final: bool, tail: int | None = None) -> str:
    """A run's per-rank table and, per rank, its output (the last ``tail`` lines while it runs);
    ``view`` is a ``view.RunView``."""
    s = view.snapshot(tail)
    head = (
        f"<b>{esc(s['title'])}</b> on gang <code>{esc(s['gang_id'])}</code> {badge(s['state'])} "
        f"· {esc(seconds(s['elapsed']))}"
    )
    rows = []
    for r in s["ranks"]:
        bar = _bar(r["fraction"], r["state"])
        prog = f"{bar} {esc(r['progress'])}" if r["progress"] else bar
        rows.append(
            [
                str(r["rank"]),
                esc(r["where"]),
                badge(r["state"]),
                esc(seconds(r["seconds"])),
                prog,
                esc(r["memory"]),
                esc(r["lines"]),
            ]
        )
    parts = [
        f"<div>{head}</div>",
        table(["rank", "where", "state", "time", "progress", "memory", "output lines"], rows, "px-run-ranks"),
    ]
    if s["note"]:
        parts.append(f'<div style="color:#a05a00">{esc(s["note"])}</div>')
    for r in s["ranks"]:
        if r["text"]:
            where = "in the rank's log" if final else "not shown"
            more = f" · {r['dropped']} earlier lines {where}" if r["dropped"] else ""
            parts.append(
                f'<details class="px-rank-output" data-rank="{r["rank"]}" open>'
                f"<summary>rank {r['rank']} output ({r['lines']} line{'s' if r['lines'] != 1 else ''}{esc(more)})"
                f"</summary>{pre(r['text'], 'px-rank-text')}</details>"
            )
    return box("".join(parts), "phalanx-run")


def run_text(view: Any, final: bool, tail: int | None = None) -> str:
    s = view.snapshot(tail)
    lines = [f"{s['title']} on gang {s['gang_id']}: {s['state']} · {seconds(s['elapsed'])}"]
    for r in s["ranks"]:
        lines.append(
            f"  rank {r['rank']}  {r['state']:<11} {seconds(r['seconds']):>8}  {r['progress'] or ''}"
            f"  memory {r['memory']}  {r['where']}".rstrip()
        )
    if s["note"]:
        lines.append(f"  {s['note']}")
    for r in s["ranks"]:
        if r["text"]:
            lines.append(
                f"[rank {r['rank']}]" + (f" ({r['dropped']} earlier lines in its log)" if r["dropped"] else "")
            )
            lines += ["  " + line for line in r["text"].splitlines()]
    return redact("\n".join(lines))


def _bar(fraction: float | None, state: str) -> str:
    colour = STATE_COLOURS.get(state, "#3b7dd8")
    width = 0 if fraction is None else max(0.0, min(fraction, 1.0)) * 100
    return (
        f'<span style="display:inline-block;width:80px;height:8px;background:#eee;vertical-align:middle">'
        f'<span style="display:block;width:{width:.0f}%;height:8px;background:{colour}"></span></span>'
    )


# ---- %%px results ---------------------------------------------------------------------------------
def px_html(blocks: list[dict]) -> str:
    """``blocks``: per rank ``{"rank", "stdout", "value": mime bundle | None, "n"}``, and frame
    previews ``{"frame": html}``."""
    parts = []
    for b in blocks:
        if "frame" in b:
            parts.append(b["frame"])
            continue
        if b.get("stdout"):
            parts.append(
                f'<div class="px-stdout" data-rank="{b["rank"]}"><span style="color:#777">[stdout:{b["rank"]}]'
                f"</span>{pre(b['stdout'], 'px-rank-text')}</div>"
            )
        if b.get("value"):
            value = b["value"].get("text/html") or pre(b["value"]["text/plain"])
            parts.append(
                f'<div class="px-out" data-rank="{b["rank"]}"><span style="color:#d84315">Out[{b["rank"]}:{b["n"]}]:'
                f"</span>{value}</div>"
            )
    return f'<div class="phalanx-px">{"".join(parts)}</div>'


def px_text(blocks: list[dict]) -> str:
    lines = []
    for b in blocks:
        if "frame" in b:
            lines.append(b["frame_text"])
            continue
        if b.get("stdout"):
            out = b["stdout"].rstrip("\n")
            lines.append(f"[stdout:{b['rank']}] " + (out if "\n" not in out else "\n" + out))
        if b.get("value"):
            lines.append(f"Out[{b['rank']}:{b['n']}]: {b['value']['text/plain']}")
    return "\n".join(lines)


# ---- frames ---------------------------------------------------------------------------------------
def frame_html(
    name: str, rows: int, per_rank: list[int], head: Any, partitioned_by: Sequence[str] | None, shown: int
) -> str:
    """A preview of a distributed frame: its shape over the ranks, then its first rows (pandas)."""
    cols = len(head.columns)
    by = f" · hash-partitioned by {', '.join(partitioned_by)}" if partitioned_by else ""
    info = (
        f"<b>phalanx DataFrame</b> <code>{esc(name)}</code> · {rows:,} rows × {cols} columns on "
        f"{len(per_rank)} ranks ({esc(', '.join(f'{n:,}' for n in per_rank))}){esc(by)}"
        f" · first {min(shown, rows)} rows:"
    )
    return box(f"<div>{info}</div>{head.to_html(max_rows=shown, border=0)}", "phalanx-frame")


def frame_text(
    name: str, rows: int, per_rank: list[int], head: Any, partitioned_by: Sequence[str] | None, shown: int
) -> str:
    by = f" · hash-partitioned by {', '.join(partitioned_by)}" if partitioned_by else ""
    return (
        f"phalanx DataFrame {name}: {rows:,} rows × {len(head.columns)} columns on {len(per_rank)} ranks "
        f"({', '.join(f'{n:,}' for n in per_rank)}){by}\n{head.to_string(max_rows=shown)}"
    )


# ---- run handles (px.submit / px.run) -------------------------------------------------------------
def handle_facts(handle: Any) -> dict[str, Any]:
    """The run as its database says, with the ranks of its live gangs (where, memory)."""
    status = handle.status()
    sched = getattr(handle, "_sched", None)
    site = getattr(sched, "site", None)
    gangs = dict(getattr(sched, "_gangs", {}) or {})  # stage → its gang, while it runs
    db = handle._db
    run = db.run(handle.run_id) or {}
    now = time.time()
    stages = []
    for name, st in status.stages.items():
        took = ((st.ended or now) - st.started) if st.started else None
        gang = gangs.get(name)
        where = ""
        if gang is not None and gang.running:
            where = "; ".join(
                f"rank {r}: {h} pid {p} · {rank_memory(p, h)}" for r, (p, h) in enumerate(zip(gang.pids, gang.hosts))
            )
        rows = ", ".join(f"{k}: {v:,}" for k, v in st.rows.items())
        stages.append(
            {
                "stage": name,
                "state": st.state,
                "ranks": st.ranks,
                "attempts": st.attempts,
                "seconds": took,
                "rows": rows,
                "where": where,
                "error": (st.error or "").splitlines()[0:1],
            }
        )
    started = run.get("started")
    return {
        "run_id": status.run_id,
        "workflow": status.workflow,
        "state": status.state,
        "session": status.session,
        "site": getattr(site, "name", None) or run.get("site") or "—",
        "executor": getattr(site, "executor", None) or "—",
        "elapsed": ((run.get("ended") or now) - started) if started else None,
        "log_dir": str(db.state_dir / "logs" / status.run_id),
        "state_dir": str(db.state_dir),
        "finished": status.finished,
        "stages": stages,
    }


def handle_html(handle: Any, timeline: bool | None = None) -> str:
    """The run's header, its stage table and — once it finished (``timeline`` None) — its timeline."""
    f = handle_facts(handle)
    head = (
        f"<b>phalanx run</b> <code>{esc(f['run_id'])}</code> · workflow <b>{esc(f['workflow'])}</b> "
        f"{badge(f['state'])} · {esc(seconds(f['elapsed']))}"
    )
    facts = (
        f'<div style="color:#555">site {esc(f["site"])} (executor {esc(f["executor"])}) · store session '
        f"<code>{esc(f['session'])}</code> · logs <code>{esc(f['log_dir'])}</code></div>"
    )
    rows = [
        [
            esc(s["stage"]),
            badge(s["state"]),
            esc(s["ranks"] or "—"),
            esc(s["attempts"] or ""),
            esc(seconds(s["seconds"])),
            esc(s["rows"]),
            esc(s["where"] or "—"),
            esc(s["error"][0]) if s["error"] else "",
        ]
        for s in f["stages"]
    ]
    parts = [
        f"<div>{head}</div>",
        facts,
        table(["stage", "state", "ranks", "attempt", "time", "rows out", "where (memory)", "error"], rows, "px-stages"),
    ]
    if timeline if timeline is not None else f["finished"]:
        parts.append(timeline_html(handle))
    parts.append(f'<div style="color:#777">phalanx status {esc(f["run_id"])} · phalanx report {esc(f["run_id"])}</div>')
    return box("".join(parts), "phalanx-handle")


def handle_text(handle: Any) -> str:
    f = handle_facts(handle)
    lines = [
        f"phalanx run {f['run_id']} · workflow {f['workflow']} · {f['state']} · {seconds(f['elapsed'])}",
        f"  site {f['site']} (executor {f['executor']}) · session {f['session']} · logs {f['log_dir']}",
    ]
    for s in f["stages"]:
        lines.append(
            f"  {s['stage']:<16} {s['state']:<10} ranks {s['ranks'] or '—'}  attempt {s['attempts'] or '-'}"
            f"  {seconds(s['seconds']):>8}  {s['rows']}" + (f"  {s['error'][0]}" if s["error"] else "")
        )
        if s["where"]:
            lines.append(f"      {s['where']}")
    return redact("\n".join(lines))


def timeline_html(handle: Any) -> str:
    """The run's timeline picture (the one ``phalanx report`` draws), inline."""
    from ...orchestrator.report import COLOURS, summary, timeline_svg

    svg = timeline_svg(summary(handle._db, handle.run_id))
    legend = "".join(
        f'<span style="margin-right:12px"><i style="display:inline-block;width:10px;height:10px;'
        f'background:{COLOURS[k]};margin-right:4px"></i>{k}</span>'
        for k in ("succeeded", "failed", "cancelled", "running", "lost")
    )
    return (
        f'<div class="px-timeline" style="margin-top:6px;overflow-x:auto">{svg}'
        f'<div style="color:#555;font-size:12px">{legend}thin bars: each rank running the app</div></div>'
    )
