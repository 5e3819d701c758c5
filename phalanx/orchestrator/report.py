"""``phalanx report RUN``: one self-contained HTML page about a run.

The page needs nothing from the network and runs no script: inline CSS and an inline SVG.
It has the run's header; a timeline (one lane per stage, one bar per attempt coloured by its
state, inside it one thin bar per rank for the app's own run, and under them a line from when
the stage got its slots: the gap before an attempt's bar is its gang starting, the gaps around
the rank bars are handing the app over and collecting its results); a table per stage with
the rows and bytes of its outputs and inputs and each input's repartition path, and its
ranks' resources (the newest sample of each: CPU, memory, bytes sent and received, time in
collectives, the straggler marked; and each rank's memory over time); the failed
attempts' errors; and the run's events.  Everything taken from the workflow or the run (names,
errors, messages) is HTML-escaped, with any credential in it masked.
"""

from __future__ import annotations

import html
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..private import FILE_MODE, makedirs, opener
from ..redact import redact
from .retry import label
from .rundb import FINAL, RunDB
from .samples import comm_share, compute_s, latest_attempts, straggler

COLOURS = {
    "succeeded": "#2f9e55",
    "failed": "#d64545",
    "cancelled": "#e39b2d",
    "running": "#3b7dd8",
    "lost": "#8c8c8c",
    "skipped": "#c9a3a3",
    "pending": "#c8c8c8",
}

# Timeline geometry, in SVG user units (= CSS pixels at 100 %).
CROSSING = "#7b3fb0"  # an input crossing from another site's store
WIDTH, LABEL_W, RIGHT = 1000, 180, 36  # picture width, stage-name column, right margin
TOP, LANE_H, GAP, BOTTOM = 34, 34, 6, 12  # axis band, lane height, space between lanes, bottom margin
GROUP_H = 18  # the title of a site's group of lanes (a run over several sites)
PAD = 3  # attempt bar inside its lane; rank bars inside the attempt bar


class UnknownRun(KeyError):
    """No such run in the run database."""

    def __str__(self) -> str:  # the message itself, not KeyError's repr of it
        return str(self.args[0])


def esc(value: Any) -> str:
    """Text for the page: credentials masked (``phalanx.redact``), then HTML-escaped."""
    return html.escape(redact(str(value)), quote=True)


# ---- what the report shows ---------------------------------------------------------------
def summary(db: RunDB, run_id: str) -> dict:
    """The run, its stages (each with its attempts) and events, with times for the timeline.

    Attempts get ``until`` (where their bar ends: their end, or now while running); a running
    attempt of a run that is over is shown as lost (or cancelled): it will never end.
    """
    run = db.run(run_id)
    if run is None:
        raise UnknownRun(f"no run {run_id!r} in {db.path}")
    now = time.time()
    events = db.events(run_id)
    reused = {e["stage"] for e in events if e["kind"] in ("reused", "cached")}  # cached: an earlier run's outputs
    attempts = [_attempt(a, run, now) for a in db.attempts(run_id)]
    sampled = latest_attempts(db.samples(run_id, latest=False))  # its latest attempt's, by rank and time
    stages = []
    for s in db.stages(run_id):
        mine = sorted((a for a in attempts if a["stage"] == s["stage"]), key=lambda a: a["attempt"])
        stages.append(
            {
                **s,
                "attempt_list": mine,
                "reused": s["stage"] in reused,
                "samples": sampled.get(s["stage"], []),
                "crossings": _crossings(s, mine, events),
            }
        )
    ends = [run["ended"] or now] + [a["until"] for a in attempts] + [s["ended"] or 0 for s in stages]
    return {"run": run, "stages": stages, "events": events, "t0": run["started"], "t1": max(ends)}


def _crossings(stage: dict, attempts: list[dict], events: list[dict]) -> list[dict]:
    """The stage's inputs that crossed from another site's store before its gang started, each
    as (dataset, start, end, message): it ends at its event ``crossed``, and lasted what its
    record in the stage's inputs says (else since the attempt began: it is the attempt's first
    work).  A crossing found already done moved nothing: not drawn."""
    seconds = {
        i.get("dataset"): i["crossed"]["seconds"]
        for i in (stage.get("inputs") or {}).values()
        if isinstance(i, dict) and isinstance(i.get("crossed"), dict) and "seconds" in i["crossed"]
    }
    out = []
    for e in events:
        if e["stage"] != stage["stage"] or e["kind"] != "crossed" or " already crossed " in e["message"]:
            continue
        dataset = e["message"].split(":", 1)[0]
        began = [a["started"] for a in attempts if a["started"] <= e["ts"]]
        start = e["ts"] - seconds[dataset] if dataset in seconds else max(began, default=e["ts"])
        out.append({"dataset": dataset, "start": start, "end": e["ts"], "message": e["message"]})
    return out


def _attempt(a: dict, run: dict, now: float) -> dict:
    state, until = a["state"], a["ended"]
    if state == "running" and run["state"] in FINAL:
        state = "cancelled" if run["state"] == "cancelled" else "lost"
        until = until or run["ended"]
    return {**a, "state": state, "until": until or now}


# ---- the page ------------------------------------------------------------------------------
def write_report(db: RunDB, run_id: str, out: str | Path | None = None) -> Path:
    """Write the run's report; ``out`` is a file or a directory (default: <state>/reports/).

    Raises ``UnknownRun`` (a ``KeyError``) naming the run and the database when there is no
    such run.  Returns the file written.
    """
    page = render(summary(db, run_id))
    path = Path(out) if out is not None else db.state_dir / "reports"
    if out is None or path.is_dir():
        path = path / f"{run_id}.html"
    makedirs(path.parent)
    with open(path, "w", encoding="utf-8", opener=opener) as f:  # 0600, as the run DB and logs it shows
        if out is None:  # ours: one an older phalanx wrote 0644 is made private too
            os.fchmod(f.fileno(), FILE_MODE)
        f.write(page)
    return path


def render(s: dict) -> str:
    run = s["run"]
    body = [
        _header(s),
        "<h2>Timeline</h2>",
        timeline_svg(s),
        _legend(),
        "<h2>Stages</h2>",
        *(_stage_section(st, i, s["t0"]) for i, st in enumerate(s["stages"])),
        _failures(s),
        _events(s),
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>phalanx run {esc(run['id'])} — {esc(run['workflow'])}</title>\n"
        f"<style>{_CSS}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


def _header(s: dict) -> str:
    run = s["run"]
    took = (run["ended"] or time.time()) - run["started"]
    rows = [
        ("workflow", esc(run["workflow"])),
        ("run id", esc(run["id"])),
        ("state", _badge(run["state"])),
        ("file", esc(run["file"] or "-")),
        ("site", esc(run["site"] or "-")),
        ("session", esc(run["session"])),
        ("started", esc(_clock(run["started"]))),
        ("ended", esc(_clock(run["ended"]) if run["ended"] else "-")),
        ("total time", esc(_duration(took) + ("" if run["ended"] else " so far"))),
        ("driver", esc(f"pid {run.get('pid') or '-'} on {run.get('host') or '-'}")),
    ]
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return (
        f'<h1>phalanx run <span class="mono">{esc(run["id"])}</span></h1>\n<table class="kv" id="run">{table}</table>'
    )


def _badge(state: str) -> str:
    colour = COLOURS.get(state, "#999")
    return f'<span class="badge" style="background:{colour}">{esc(state)}</span>'


def _legend() -> str:
    items = "".join(
        f'<span><i style="background:{COLOURS[k]}"></i>{k}</span>'
        for k in ("succeeded", "failed", "cancelled", "running", "lost")
    )
    return (
        f'<p class="legend">{items}<span><i class="rank"></i>a rank running the app</span>'
        '<span><i class="span"></i>stage: placed → done (gang start, retries)</span>'
        '<span><i class="crossing"></i>an input crossing from another site</span></p>'
    )


# ---- the timeline ------------------------------------------------------------------------------
@dataclass
class Axis:
    """Seconds since the run started → x in the picture (clamped: clocks of other hosts drift)."""

    t0: float
    span: float
    x0: float = LABEL_W
    width: float = WIDTH - LABEL_W - RIGHT

    def x(self, t: float) -> float:
        return self.x0 + self.width * min(max((t - self.t0) / self.span, 0.0), 1.0)


def timeline_svg(s: dict) -> str:
    """One lane per stage; on a run over several sites the lanes are grouped by site, each
    group under its site's name."""
    axis = Axis(s["t0"], max(s["t1"] - s["t0"], 1e-3))
    groups: dict[str, list[dict]] = {}
    for st in s["stages"]:
        groups.setdefault(st.get("site") or "", []).append(st)
    titled = len(groups) > 1
    height = TOP + len(s["stages"]) * (LANE_H + GAP) + (len(groups) * GROUP_H if titled else 0) + BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        _ticks_svg(axis, height),
    ]
    y = TOP
    for site, stages in groups.items():
        if titled:
            parts.append(
                f'<text class="site-group" data-site="{esc(site)}" x="4" y="{y + GROUP_H - 4}" '
                f'font-weight="bold" fill="#333">site {esc(site)}</text>'
            )
            y += GROUP_H
        for st in stages:
            parts.append(_lane_svg(st, y, axis))
            y += LANE_H + GAP
    return "\n".join(parts + ["</svg>"])


def tick_step(span: float, most: int = 10) -> float:
    """The smallest round step (1-2-5 below a minute, whole minutes and hours above) giving at
    most ``most`` intervals over ``span`` seconds."""
    round_steps = [15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
    raw = span / most
    mag = 10 ** math.floor(math.log10(raw))
    for step in [m * mag for m in (1, 2, 5, 10)] if raw < 10 else round_steps:
        if step >= raw:
            return step
    return 86400 * math.ceil(raw / 86400)


def _tick_label(t: float, step: float) -> str:
    if step < 1:  # 0.5 → one decimal, 0.05 → two
        return f"{t:.{-math.floor(math.log10(step))}f}s"
    if t < 60:
        return f"{t:.0f}s"
    m, sec = divmod(int(round(t)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if sec else f"{m}m")


def _ticks_svg(axis: Axis, height: float) -> str:
    step = tick_step(axis.span)
    parts = ['<g class="axis">', f'<text x="6" y="{TOP - 12}" fill="#555">seconds since start</text>']
    for i in range(int(axis.span / step + 1e-9) + 1):
        t = i * step
        x = axis.x(axis.t0 + t)
        parts.append(
            f'<line class="tick" x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - BOTTOM}" stroke="#e3e3e3"/>'
        )
        parts.append(
            f'<text class="tick-label" x="{x:.1f}" y="{TOP - 12}" text-anchor="middle" '
            f'fill="#555">{_tick_label(t, step)}</text>'
        )
    return "\n".join(parts + ["</g>"])


def _lane_svg(st: dict, y: float, axis: Axis) -> str:
    name = st["stage"]
    short = name if len(name) <= 26 else name[:25] + "…"
    label_y = y + LANE_H / 2 + (0 if st["reused"] else 4)
    parts = [
        f'<g class="lane" data-stage="{esc(name)}" data-state="{esc(st["state"])}">',
        f'<rect class="lane-bg" x="0" y="{y}" width="{WIDTH}" height="{LANE_H}" fill="#eeeeee" fill-opacity="0.5"/>',
        f'<text class="stage-label" x="{LABEL_W - 8}" y="{label_y}" text-anchor="end">'
        f"<title>{esc(name)}</title>{esc(short)}</text>",
    ]
    if st["reused"]:  # under its name: its bars (if any) are from an earlier invocation of the run
        parts.append(
            f'<text class="lane-tag" x="{LABEL_W - 8}" y="{label_y + 12}" text-anchor="end" '
            f'fill="#666" font-size="10" font-style="italic">reused</text>'
        )
    if st["started"]:
        parts.append(_stage_span(st, y, axis))
    parts += [_attempt_svg(st, a, y, axis) for a in st["attempt_list"]]
    parts += [_crossing_svg(st, c, y, axis) for c in st.get("crossings", [])]
    if not st["attempt_list"]:  # an empty lane says why
        parts.append(
            f'<text class="lane-note" x="{axis.x0 + 6:.1f}" y="{y + LANE_H / 2 + 4}" fill="#666" '
            f'font-style="italic">{esc(_lane_note(st))}</text>'
        )
    return "\n".join(parts + ["</g>"])


def _lane_note(st: dict) -> str:
    if st["reused"]:
        return "reused: outputs sealed by an earlier attempt, or cached from an earlier run"
    if st["state"] == "skipped":
        return f"skipped: {st['error'] or 'an upstream stage failed'}"
    return f"{st['state']}: no attempt recorded" + (f" ({_first_line(st['error'])})" if st["error"] else "")


def _stage_span(st: dict, y: float, axis: Axis) -> str:
    """A thin line under the bars from when the stage got its slots to its end: before the first
    attempt bar the gang is starting; between attempts, the backoff and the next gang's start."""
    end = st["ended"] or max([a["until"] for a in st["attempt_list"]] + [st["started"]])
    x1, x2 = axis.x(st["started"]), axis.x(end)
    tip = f"stage {st['stage']}: {_duration(end - st['started'])} from placement to end"
    return (
        f'<rect class="stage-span" x="{x1:.1f}" y="{y + LANE_H - PAD + 0.5}" width="{max(x2 - x1, 1):.1f}" '
        f'height="2" fill="#9a9a9a"><title>{esc(tip)}</title></rect>'
    )


def _attempt_svg(st: dict, a: dict, y: float, axis: Axis) -> str:
    colour = COLOURS.get(a["state"], "#999")
    x1, x2 = axis.x(a["started"]), axis.x(a["until"])
    top, h = y + PAD, LANE_H - 2 * PAD
    why = f" ({label(a['cause'])})" if a.get("cause") else ""
    tip = (
        f"stage {st['stage']} · attempt {a['attempt']} · {a['state']}{why} · {_duration(a['until'] - a['started'])}"
        + (f"\n{_first_line(a['error'])}" if a["error"] else "")
    )
    parts = [
        f'<g class="attempt {esc(a["state"])}" data-attempt="{a["attempt"]}">',
        f'<rect class="attempt-bar" x="{x1:.1f}" y="{top}" width="{max(x2 - x1, 1):.1f}" height="{h}" '
        f'fill="{colour}" fill-opacity="0.3" stroke="{colour}"><title>{esc(tip)}</title></rect>',
    ]
    ranks = [r for r in a["rank_info"] if r.get("started") and r.get("ended")]
    band = (h - 2 * PAD) / max(len(ranks), 1)  # one band per rank inside the attempt bar
    for j, r in enumerate(sorted(ranks, key=lambda r: r["rank"])):
        rx1, rx2 = axis.x(r["started"]), axis.x(r["ended"])
        tip = (
            f"stage {st['stage']} · attempt {a['attempt']} · rank {r['rank']} · pid {r.get('pid')} · "
            f"host {r.get('host')} · app ran {_duration(r['ended'] - r['started'])}" + _gpu_text(r.get("gpu"))
        )
        parts.append(
            f'<rect class="rank" data-rank="{esc(r["rank"])}" x="{rx1:.1f}" y="{top + PAD + j * band:.2f}" '
            f'width="{max(rx2 - rx1, 1):.1f}" height="{max(band * 0.75, 0.5):.2f}" fill="{colour}">'
            f"<title>{esc(tip)}</title></rect>"
        )
    return "\n".join(parts + ["</g>"])


def _crossing_svg(st: dict, c: dict, y: float, axis: Axis) -> str:
    """An input crossing into the stage's site: a striped bar over the start of its attempt."""
    x1, x2 = axis.x(c["start"]), axis.x(c["end"])
    tip = f"stage {st['stage']} · input crossed · {c['message']}"
    return (
        f'<rect class="crossing" data-dataset="{esc(c["dataset"])}" x="{x1:.1f}" y="{y + 1}" '
        f'width="{max(x2 - x1, 1):.1f}" height="{PAD + 1}" fill="{CROSSING}"><title>{esc(tip)}</title></rect>'
    )


def _gpu_text(gpu: dict | None) -> str:
    """`` · cuda:0 (NVIDIA H100) peak 3.1 of 79.6 GiB`` for a rank that used CUDA, else ``""``."""
    if not gpu:
        return ""
    g = float(1 << 30)
    return f" · {gpu['device']} ({gpu.get('name', '?')}) peak GPU memory {gpu['peak'] / g:.2f} of {gpu['total'] / g:.2f} GiB"


# ---- tables --------------------------------------------------------------------------------
def _stage_section(st: dict, i: int, t0: float) -> str:
    took = _duration(st["ended"] - st["started"]) if st["started"] and st["ended"] else "-"
    facts = [
        ("state", _badge(st["state"]) + (" (reused)" if st["reused"] else "")),
        ("ranks", esc(st["ranks"] or "-")),
        ("attempts", esc(st["attempts"])),
        ("duration", esc(took)),
    ]
    if st["error"]:
        facts.append(("error", f'<span class="mono">{esc(_first_line(st["error"]))}</span>'))
    kv = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    return (
        f'<section class="stage" id="stage-{i}" data-stage="{esc(st["stage"])}">\n'
        f'<h3 class="stage-name">{esc(st["stage"])}</h3>\n<table class="kv">{kv}</table>\n'
        f"{_outputs_table(st['outputs'])}\n{_inputs_table(st['inputs'])}\n{_attempts_table(st, t0)}\n"
        f"{_ranks_table(st.get('samples') or [])}\n</section>"
    )


def _ranks_table(series: list[dict]) -> str:
    """Each rank's newest resource sample (``orchestrator.samples``), then its memory over time."""
    if not series:
        return ""
    latest = list({r["rank"]: r for r in series}.values())  # sorted by rank, then time: the last wins
    slow = straggler(latest)
    rows = "".join(
        f'<tr class="rank{" straggler" if slow and r["rank"] == slow.rank else ""}" data-rank="{r["rank"]}">'
        f'<td class="num">{r["rank"]}</td><td>{esc(r["host"] or "")}</td><td class="num">{r["cpu"] or 0:.0f}%</td>'
        f"{_bytes_cell(r['rss'] or 0, 'rss')}{_bytes_cell(r['peak_rss'] or 0, 'peak')}"
        f"{_bytes_cell(r['sent'] or 0, 'sent')}{_bytes_cell(r['received'] or 0, 'received')}"
        f'<td class="num">{comm_share(r):.0f}%</td><td class="num">{compute_s(r):.2f}s</td>'
        f'<td class="num">{r["elapsed"] or 0:.2f}s</td></tr>'
        for r in latest
    )
    note = f'<p class="straggler">{esc(str(slow))}</p>' if slow else ""
    return (
        '<table class="ranks"><caption>ranks (newest sample)</caption><tr><th>rank</th><th>host</th><th>cpu</th>'
        "<th>rss</th><th>peak rss</th><th>sent</th><th>received</th><th>in collectives</th><th>compute</th>"
        f"<th>elapsed</th></tr>{rows}</table>{note}{_rss_svg(series)}"
    )


def _rss_svg(series: list[dict], width: int = 480, height: int = 120) -> str:
    """Each rank's rss over the task's elapsed seconds: one line per rank (two samples at least)."""
    lines: dict[int, list[tuple[float, int]]] = {}
    for r in series:
        lines.setdefault(r["rank"], []).append((r["elapsed"] or 0.0, r["rss"] or 0))
    if max(len(points) for points in lines.values()) < 2:
        return ""
    span = max(t for points in lines.values() for t, _ in points) or 1.0
    top = max(m for points in lines.values() for _, m in points) or 1
    palette = ("#3b7dd8", "#d64545", "#2f9e55", "#e39b2d", "#8e44ad", "#16a085", "#7f8c8d", "#c0392b")
    polylines = "".join(
        f'<polyline class="rss" data-rank="{rank}" fill="none" stroke="{palette[i % len(palette)]}" points="'
        + " ".join(f"{40 + (width - 50) * t / span:.1f},{height - 20 - (height - 30) * m / top:.1f}" for t, m in points)
        + f'"><title>rank {rank}</title></polyline>'
        for i, (rank, points) in enumerate(sorted(lines.items()))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="rss" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">'
        f'<text x="4" y="12" fill="#555">rss per rank (max {esc(_size(top))}) over {esc(_duration(span))}</text>'
        f'<line x1="40" y1="{height - 20}" x2="{width - 10}" y2="{height - 20}" stroke="#bbb"/>{polylines}</svg>'
    )


def _outputs_table(outputs: dict[str, list[int]]) -> str:
    if not outputs:
        return '<p class="muted">no outputs recorded</p>'
    rows = "".join(
        f'<tr class="output" data-name="{esc(name)}"><td class="name">{esc(name)}</td>'
        f"{_rows_cell(rows)}{_bytes_cell(nbytes)}</tr>"
        for name, (rows, nbytes) in outputs.items()
    )
    return (
        f'<table class="io outputs"><caption>outputs</caption>'
        f"<tr><th>dataset</th><th>rows</th><th>bytes</th></tr>{rows}</table>"
    )


def _inputs_table(inputs: dict[str, dict]) -> str:
    if not inputs:
        return '<p class="muted">no inputs read</p>'
    rows = "".join(
        f'<tr class="input" data-name="{esc(local)}"><td class="name">{esc(local)}</td>'
        f'<td class="dataset">{esc(i["dataset"])}</td>{_rows_cell(i["rows"])}{_bytes_cell(i["bytes"])}'
        f'<td class="plan">{esc(i["plan"])}</td>'
        f"{_bytes_cell(i.get('read_here', 0), 'read_here')}{_bytes_cell(i.get('fetched', 0), 'fetched')}"
        f"{_crossed_cell(i.get('crossed'))}</tr>"
        for local, i in inputs.items()
    )
    return (
        f'<table class="io inputs"><caption>inputs</caption><tr><th>as</th><th>dataset</th><th>rows</th>'
        f'<th>bytes</th><th>repartition</th><th title="stored partitions read on the ranks\' own hosts">'
        f'read here</th><th title="stored partitions fetched from other hosts">fetched</th>'
        f'<th title="brought from another site\'s store before the stage ran">crossed</th></tr>{rows}</table>'
    )


def _crossed_cell(crossed: dict | None) -> str:
    if not crossed:
        return '<td class="crossed muted">—</td>'
    if crossed.get("already"):
        return f'<td class="crossed">from {esc(crossed["from"])}, earlier in this run</td>'
    return (
        f'<td class="crossed" data-bytes="{int(crossed["bytes"])}">from {esc(crossed["from"])} '
        f"({esc(crossed['path'])}, {crossed['bytes'] / 1e6:,.1f} MB in {crossed['seconds']:.2f} s)</td>"
    )


def _attempts_table(st: dict, t0: float) -> str:
    if not st["attempt_list"]:
        return ""
    rows = "".join(
        f'<tr class="attempt" data-attempt="{a["attempt"]}"><td class="num">{a["attempt"]}</td>'
        f'<td>{esc(a["state"])}</td><td class="cause">{esc(label(a.get("cause")))}</td>'
        f'<td class="num">+{a["started"] - t0:.1f}s</td>'
        f'<td class="num">{_duration(a["until"] - a["started"])}</td>'
        f'<td class="mono">{esc(a["gang_id"] or "-")}</td>'
        f'<td class="mono">{esc(a["log_dir"] or "-")}</td></tr>'
        for a in st["attempt_list"]
    )
    return (
        f'<table class="attempts"><caption>attempts</caption><tr><th>#</th><th>state</th><th>cause</th><th>started</th>'
        f"<th>took</th><th>gang</th><th>logs</th></tr>{rows}</table>"
    )


def _rows_cell(rows: int) -> str:
    return f'<td class="rows num">{rows:,}</td>'


def _bytes_cell(nbytes: int, cls: str = "bytes") -> str:
    return f'<td class="{cls} num">{nbytes:,} B <span class="muted">({_size(nbytes)})</span></td>'


def _failures(s: dict) -> str:
    """Each failed attempt's error in full; a failed stage without one (its gang never started)
    shows the stage's error."""
    blocks = []
    for st in s["stages"]:
        failed = [a for a in st["attempt_list"] if a["state"] == "failed" or a["error"]]
        for a in failed:
            blocks.append(
                _failure(
                    st["stage"],
                    f"attempt {a['attempt']} {a['state']} after {_duration(a['until'] - a['started'])}",
                    a["error"] or "(no error text)",
                    a["attempt"],
                )
            )
        if st["state"] == "failed" and st["error"] and not failed:
            blocks.append(_failure(st["stage"], "failed", st["error"], None))
    if not blocks:
        return ""
    return "<h2>Failures</h2>\n" + "\n".join(blocks)


def _failure(stage: str, what: str, error: str, attempt: int | None) -> str:
    data = f' data-attempt="{attempt}"' if attempt is not None else ""
    return (
        f'<div class="failure" data-stage="{esc(stage)}"{data}><h3>{esc(stage)} — {esc(what)}</h3>'
        f'<pre class="error">{esc(error)}</pre></div>'
    )


def _events(s: dict) -> str:
    rows = "".join(
        f'<tr class="event"><td class="num">+{e["ts"] - s["t0"]:.1f}s</td><td>{esc(_clock(e["ts"]))}</td>'
        f"<td>{esc(e['stage'] or '')}</td><td>{esc(e['kind'])}</td><td>{esc(e['message'] or '')}</td></tr>"
        for e in s["events"]
    )
    return (
        f'<h2>Events</h2>\n<table class="events"><tr><th>since start</th><th>time</th><th>stage</th>'
        f"<th>event</th><th>message</th></tr>{rows}</table>"
    )


# ---- formatting ------------------------------------------------------------------------------
def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(ts))


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 4px 0 10px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; font-weight: 600; }
table.kv th { width: 90px; }
caption { text-align: left; font-weight: 600; color: #555; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.mono, pre, .plan { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
.muted { color: #777; }
.badge { color: #fff; border-radius: 3px; padding: 0 6px; }
pre.error { background: #fff4f4; border: 1px solid #f0c8c8; padding: 8px; overflow-x: auto; white-space: pre-wrap; }
svg.timeline { border: 1px solid #ddd; max-width: 100%; height: auto; }
.legend span { margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
.legend i.rank { background: #555; height: 4px; vertical-align: 2px; }
.legend i.span { background: #9a9a9a; height: 2px; vertical-align: 3px; }
.legend i.crossing { background: #7b3fb0; height: 4px; vertical-align: 2px; }
table.events td:nth-child(5) { font-family: ui-monospace, Menlo, Consolas, monospace; }
tr.straggler td { background: #fff4e0; } p.straggler { color: #a05a00; }
"""
