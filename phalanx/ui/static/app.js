// phalanx ui: runs, a run's DAG, stages, ranks and logs, live over server-sent events.
// Everything from the server is put in the page as text (textContent), never as markup,
// except the timeline SVG, which the server escapes (phalanx.orchestrator.report).
"use strict";

const main = document.getElementById("main");
const live = document.getElementById("live");
let stream = null; // the EventSource of the page shown
let timer = null; // the refresh of the runs or store page
let view = null; // the run shown, as the server last sent it
let selected = null; // the stage whose ranks are shown
let timelineAt = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const svgNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const node = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function badge(state) { return el("span", { class: `badge s-${state}`, "data-state": state }, state); }
function secs(s) {
  if (s === null || s === undefined) return "";
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
function size(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function clock(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : ""; }
function num(n) { return n === null || n === undefined ? "" : n.toLocaleString(); }

function stop() {
  if (stream) { stream.close(); stream = null; }
  if (timer) { clearInterval(timer); timer = null; }
  live.classList.remove("on");
}

async function getJSON(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.json().catch(() => ({}))).error || r.statusText}`);
  return r.json();
}

function route() {
  stop();
  const h = location.hash || "#/";
  let m;
  if ((m = h.match(/^#\/run\/([^/]+)(?:\/stage\/(.+))?$/))) {
    showRun(decodeURIComponent(m[1]), m[2] ? decodeURIComponent(m[2]) : null);
  } else if (h.startsWith("#/store")) {
    showStore();
  } else {
    showRuns();
  }
}

// ---- the runs --------------------------------------------------------------------------------
async function showRuns() {
  const draw = async () => {
    let runs;
    try { runs = await getJSON("/api/runs"); } catch (e) { main.replaceChildren(el("p", { class: "error" }, e.message)); return; }
    const rows = runs.map((r) =>
      el("tr", { class: "clickable", "data-run": r.id, onclick: () => { location.hash = `#/run/${encodeURIComponent(r.id)}`; } },
        el("td", {}, el("a", { href: `#/run/${encodeURIComponent(r.id)}` }, r.id)),
        el("td", {}, r.workflow), el("td", {}, badge(r.state)),
        el("td", {}, Object.entries(r.stages).map(([s, n]) => `${n} ${s}`).join(", ")),
        el("td", {}, clock(r.started)), el("td", { class: "num" }, secs(r.seconds)), el("td", { class: "muted" }, r.file || "")));
    main.replaceChildren(
      el("h1", {}, "Runs"),
      runs.length ? el("table", { id: "runs-table" },
        el("tr", {}, ["run", "workflow", "state", "stages", "started", "took", "file"].map((c) => el("th", {}, c))), rows)
        : el("p", { class: "muted" }, "no runs in this run database yet"));
  };
  await draw();
  timer = setInterval(draw, 3000);
  live.classList.add("on");
}

// ---- one run ---------------------------------------------------------------------------------
function showRun(id, stage) {
  selected = stage;
  view = null;
  main.replaceChildren(el("p", { class: "muted" }, `loading run ${id}…`));
  stream = new EventSource(`/api/runs/${encodeURIComponent(id)}/stream`);
  stream.addEventListener("open", () => live.classList.add("on"));
  stream.addEventListener("run", (ev) => { view = JSON.parse(ev.data); drawRun(); });
  stream.addEventListener("end", () => { stream.close(); stream = null; live.classList.remove("on"); });
  stream.addEventListener("error", async () => {
    if (view) return; // reconnects by itself; the view shown stays
    stop();
    try { await getJSON(`/api/runs/${encodeURIComponent(id)}`); } catch (e) { main.replaceChildren(el("p", { class: "error" }, e.message)); }
  });
}

function drawRun() {
  const v = view, r = v.run;
  if (!selected && v.stages.length) {
    const failed = v.stages.find((s) => s.state === "failed");
    const running = v.stages.find((s) => s.state === "running");
    selected = (running || failed || v.stages[0]).name;
  }
  const parts = [
    el("h1", {}, `run ${r.id} `, el("span", { id: "run-state" }, badge(r.state))),
    el("p", { class: "muted" }, `${r.workflow} · ${r.file || ""} · site ${r.site} · session ${r.session} · started ${clock(r.started)} · ${secs(r.seconds)}`),
    el("h2", {}, "Stages"), dag(v.dag), stagesTable(v.stages),
  ];
  const st = v.stages.find((s) => s.name === selected);
  if (st) parts.push(stageDetail(st));
  if (v.failures.length) parts.push(el("h2", {}, "Failures"), failures(v.failures));
  parts.push(el("h2", {}, "Timeline"), el("div", { class: "timeline-box", id: "timeline" }));
  parts.push(el("h2", {}, "Events"), events(v.events));
  const keep = document.getElementById("timeline");
  main.replaceChildren(...parts);
  if (keep) document.getElementById("timeline").replaceWith(keep);
  refreshTimeline(r.id, r.final);
}

async function refreshTimeline(id, final) {
  const now = Date.now();
  if (!final && now - timelineAt < 2000) return;
  timelineAt = now;
  const r = await fetch(`/api/runs/${encodeURIComponent(id)}/timeline.svg`, { credentials: "same-origin" });
  if (!r.ok) return;
  const doc = new DOMParser().parseFromString(await r.text(), "image/svg+xml");
  const box = document.getElementById("timeline");
  if (box && doc.documentElement.nodeName === "svg") box.replaceChildren(document.importNode(doc.documentElement, true));
}

const COLOURS = { succeeded: "#2f9e55", failed: "#d64545", running: "#3b7dd8", pending: "#9aa5b1", cancelled: "#e39b2d", lost: "#8c8c8c", skipped: "#c9a3a3", reused: "#2aa7b8", cached: "#2aa7b8" };

function dag(layout) {
  const pic = svg("svg", { class: "dag", id: "dag", width: layout.width, height: layout.height, viewBox: `0 0 ${layout.width} ${layout.height}` });
  const at = Object.fromEntries(layout.nodes.map((n) => [n.name, n]));
  for (const [a, b] of layout.edges) {
    const p = at[a], q = at[b];
    if (p && q) pic.append(svg("line", { x1: p.x + p.w, y1: p.y + p.h / 2, x2: q.x, y2: q.y + q.h / 2 }));
  }
  for (const n of layout.nodes) {
    const g = svg("g", { class: "node", "data-stage": n.name, "data-state": n.state });
    const rect = svg("rect", { x: n.x, y: n.y, width: n.w, height: n.h, fill: COLOURS[n.state] || "#999" });
    rect.addEventListener("click", () => selectStage(n.name));
    g.append(rect, svg("title", {}, `${n.name}: ${n.state}`));
    g.append(svg("text", { x: n.x + 8, y: n.y + 18 }, n.name.length > 24 ? n.name.slice(0, 23) + "…" : n.name));
    g.append(svg("text", { x: n.x + 8, y: n.y + 35 }, n.state));
    pic.append(g);
  }
  return pic;
}

function selectStage(name) {
  selected = name;
  history.replaceState(null, "", `#/run/${encodeURIComponent(view.run.id)}/stage/${encodeURIComponent(name)}`);
  drawRun();
}

function stagesTable(stages) {
  return el("table", { id: "stages-table" },
    el("tr", {}, ["stage", "state", "ranks", "attempts", "took", "rows out", "bytes out", ""].map((c) => el("th", {}, c))),
    stages.map((s) => {
      const rows = Object.values(s.outputs).reduce((a, o) => a + o.rows, 0);
      const bytes = Object.values(s.outputs).reduce((a, o) => a + o.bytes, 0);
      return el("tr", { class: `clickable${s.name === selected ? " selected" : ""}`, "data-stage": s.name, onclick: () => selectStage(s.name) },
        el("td", {}, s.name), el("td", {}, badge(s.state)), el("td", { class: "num" }, s.ranks),
        el("td", { class: "num" }, s.attempts.length), el("td", { class: "num" }, secs(s.seconds)),
        el("td", { class: "num" }, Object.keys(s.outputs).length ? num(rows) : ""),
        el("td", { class: "num" }, Object.keys(s.outputs).length ? size(bytes) : ""),
        el("td", { class: "error" }, s.error ? s.error.split("\n")[0].slice(0, 120) : ""));
    }));
}

function splitBar(r, longest) {
  // the rank's time: computing (blue) then in exchanges (orange), to the scale of the slowest rank
  const W = 160, H = 12;
  const pic = svg("svg", { width: W, height: H, class: "split", "data-rank": r.rank });
  if (!r.elapsed || !longest) return pic;
  const comm = Math.min(r.comm_s || 0, r.elapsed);
  const all = (W * r.elapsed) / longest, c = (W * comm) / longest;
  pic.append(svg("rect", { x: 0, y: 1, width: all - c, height: H - 2, fill: "#3b7dd8" }));
  pic.append(svg("rect", { x: all - c, y: 1, width: c, height: H - 2, fill: "#e39b2d" }));
  pic.append(svg("title", {}, `computing ${secs(r.elapsed - comm)}, in exchanges ${secs(comm)}`));
  return pic;
}

function stageDetail(st) {
  const last = st.attempts[st.attempts.length - 1];
  const slow = st.straggler;
  const longest = Math.max(0, ...st.rank_table.map((r) => r.elapsed || 0));
  const rows = st.rank_table.map((r) => {
    const comm = r.elapsed ? (100 * (r.comm_s || 0)) / r.elapsed : null;
    return el("tr", { class: r.rank === slow ? "straggler" : "", "data-rank": r.rank },
      el("td", { class: "num" }, r.rank), el("td", {}, r.host || ""),
      el("td", {}, r.failed ? badge("failed") : r.outcome === "stopped" ? badge("cancelled") : r.outcome === "ok" ? badge("succeeded") : st.state === "running" ? badge("running") : ""),
      el("td", { class: "num" }, r.cpu === null || r.cpu === undefined ? "" : `${r.cpu.toFixed(0)} %`),
      el("td", { class: "num" }, size(r.rss)), el("td", { class: "num" }, size(r.peak_rss)),
      el("td", { class: "num" }, size(r.sent)), el("td", { class: "num" }, size(r.received)),
      el("td", { class: "num" }, comm === null ? "" : `${comm.toFixed(0)} %`),
      el("td", { class: "num" }, secs(r.elapsed)),
      el("td", {}, splitBar(r, longest)),
      el("td", {}, r.rank === slow ? "straggler" : ""),
      el("td", {}, el("button", { class: "link", type: "button", "data-log": `${st.name}/${r.rank}`, onclick: () => openLog(st.name, r.rank, r.attempt) }, "log")),
      el("td", { class: "error" }, r.error || ""));
  });
  const inputs = Object.entries(st.inputs).map(([k, i]) => `${k} ← ${i.dataset}: ${num(i.rows)} rows, ${size(i.bytes)} (${i.plan})`);
  return el("section", { id: "stage-detail", "data-stage": st.name },
    el("h2", {}, `Stage ${st.name} `, badge(st.state), last ? ` attempt ${last.attempt}` : ""),
    inputs.length ? el("p", { class: "muted" }, inputs.join(" · ")) : null,
    st.attempts.length > 1 || (last && last.cause) ? el("p", {}, st.attempts.map((a) => `attempt ${a.attempt} ${a.state}${a.cause ? ": " + a.cause : ""}`).join("; ")) : null,
    rows.length ? el("table", { id: "rank-table" },
      el("tr", {}, ["rank", "host", "state", "CPU", "RSS", "peak RSS", "sent", "received", "in exchanges", "elapsed", "computing | exchanging", "", "", ""].map((c) => el("th", {}, c))), rows)
      : el("p", { class: "muted" }, "no ranks yet"));
}

function failures(list) {
  return el("table", { id: "failures" },
    el("tr", {}, ["stage", "attempt", "cause", "error", "logs"].map((c) => el("th", {}, c))),
    list.map((f) => el("tr", { "data-stage": f.stage },
      el("td", {}, f.stage), el("td", { class: "num" }, f.attempt), el("td", {}, f.cause || ""),
      el("td", { class: "error" }, f.error || ""),
      el("td", {}, (f.ranks.length ? f.ranks : [null]).map((rank) =>
        el("button", { class: "link", type: "button", "data-log": `${f.stage}/${rank === null ? "all" : rank}`, onclick: () => openLog(f.stage, rank, f.attempt) },
          rank === null ? "all ranks' logs " : `rank ${rank} log `))))));
}

function events(list) {
  return el("table", { class: "events" },
    list.slice().reverse().slice(0, 50).map((e) => el("tr", {},
      el("td", { class: "muted" }, clock(e.ts)), el("td", {}, e.stage || ""), el("td", {}, e.kind), el("td", {}, e.message || ""))));
}

// ---- a rank's log, streamed ----------------------------------------------------------------------
let logStream = null;
function openLog(stage, rank, attempt) {
  if (logStream) logStream.close();
  const panel = document.getElementById("logpanel"), out = document.getElementById("loglines");
  const state = document.getElementById("logstate");
  panel.hidden = false;
  out.replaceChildren();
  document.getElementById("logtitle").textContent =
    `${stage} · attempt ${attempt}` + (rank === null || rank === undefined ? " · every rank" : ` · rank ${rank}`);
  state.textContent = "following…";
  const q = new URLSearchParams({ stage, attempt });
  if (rank !== null && rank !== undefined) q.set("rank", rank);
  logStream = new EventSource(`/api/runs/${encodeURIComponent(view.run.id)}/logs?${q}`);
  logStream.addEventListener("lines", (ev) => {
    const atEnd = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
    for (const line of JSON.parse(ev.data)) {
      out.append(document.createTextNode((rank === null || rank === undefined ? `[rank ${line.rank}] ` : "") + line.text + "\n"));
    }
    if (atEnd) out.scrollTop = out.scrollHeight;
  });
  logStream.addEventListener("end", () => { logStream.close(); logStream = null; state.textContent = "(the run has ended)"; });
}
document.getElementById("logclose").addEventListener("click", () => {
  if (logStream) { logStream.close(); logStream = null; }
  document.getElementById("logpanel").hidden = true;
});

// ---- the store -----------------------------------------------------------------------------------
async function showStore() {
  let sets;
  try { sets = await getJSON("/api/store"); } catch (e) { main.replaceChildren(el("h1", {}, "Store"), el("p", { class: "error" }, e.message)); return; }
  main.replaceChildren(el("h1", {}, "Store"),
    sets.length ? el("table", { id: "store-table" },
      el("tr", {}, ["session", "dataset", "rows", "bytes", "partitioning", "producer", "partitions (rows · where)"].map((c) => el("th", {}, c))),
      sets.map((d) => el("tr", {},
        el("td", {}, d.session), el("td", { title: d.columns.join("\n") }, d.name), el("td", { class: "num" }, num(d.rows)),
        el("td", { class: "num" }, size(d.bytes)), el("td", {}, d.partitioning || ""), el("td", {}, d.producer || ""),
        el("td", {}, d.partitions.map((p) => `#${p.index}: ${num(p.rows)}${p.host ? " on " + p.host : ""}${p.copy ? " (+copy)" : ""}`).join(" · ")))))
      : el("p", { class: "muted" }, "no datasets in this store"));
}

window.addEventListener("hashchange", route);
route();
