"""The status page a compute peer serves at ``/``: one HTML file, its style and script inline.

It holds no data: its script reads ``/status.json`` every {{refresh}} milliseconds and draws the
hosted devices, one row per session, throughput as an SVG chart and the recent errors. A peer that
asks for a token answers 401; the page then shows a form, keeps the token in the tab's session
storage and sends it as a bearer header (429, after too many wrong tokens: the page says how long
to wait). A client's own view (not the admin's) has no memory in use and no throughput samples:
the page shows its sessions and the budget. Text from the peer is set as text, never as HTML.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ember peer</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 22px 0 6px; }
.muted { color: #777; } .bad { color: #b00020; }
table { border-collapse: collapse; background: #fff; min-width: 60%; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 4px 10px; text-align: left; white-space: nowrap; }
td.n { text-align: right; font-variant-numeric: tabular-nums; } td.err { white-space: normal; max-width: 420px; }
#chart { background: #fff; border: 1px solid #e3e3e3; }
#chart .ops { fill: none; stroke: #d9480f; stroke-width: 2; } #chart .bytes { fill: none; stroke: #1971c2; stroke-width: 1.5; }
#chart text { font-size: 11px; fill: #555; } #chart line { stroke: #ddd; }
.bar { display: inline-block; width: 200px; height: 10px; background: #e9ecef; vertical-align: middle; }
.bar span { display: block; height: 100%; background: #2b8a3e; }
form { margin: 20px 0; } input { font: inherit; padding: 4px; width: 320px; }
</style></head>
<body>
<h1>ember compute peer</h1>
<div id="summary" class="muted">loading…</div>
<form id="login" hidden>
  <p>This peer asks for a token (the one its clients present).</p>
  <input id="token" type="password" autocomplete="off" placeholder="token"> <button type="submit">Show the status</button>
  <p id="refused" class="bad" hidden>The peer did not accept that token.</p>
</form>
<div id="status" hidden>
  <h2>Sessions</h2>
  <table id="sessions"><thead><tr><th>client</th><th>address</th><th>device</th><th>age</th><th>tensors</th>
    <th>live bytes</th><th>ops</th><th>round trips</th><th>last error</th></tr></thead><tbody></tbody></table>
  <h2>Throughput, last minutes <span class="muted">(<span style="color:#d9480f">ops/s</span>,
    <span style="color:#1971c2">tensor bytes/s in + out</span>)</span></h2>
  <svg id="chart" width="640" height="180" viewBox="0 0 640 180" role="img" aria-label="throughput"></svg>
  <h2>Recent errors</h2>
  <ul id="errors"></ul>
</div>
<script>
"use strict";
const REFRESH = {{refresh}};
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function age(s) { return s < 90 ? s.toFixed(0) + " s" : s < 5400 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h"; }
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
function node(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const k in attrs) el.setAttribute(k, attrs[k]);
  if (text !== undefined) el.textContent = text;
  return el;
}
function rates(history, key) {
  const out = [];
  for (let i = 1; i < history.length; i++) {
    const dt = history[i].time - history[i - 1].time;
    if (dt > 0) out.push([history[i].time, (history[i][key] - history[i - 1][key]) / dt]);
  }
  return out;
}
function chart(history) {
  const svg = $("chart"), W = 640, H = 180, L = 56, R = 70, B = 20;
  svg.replaceChildren();
  const ops = rates(history, "ops");
  const io = rates(history.map((h) => ({time: h.time, io: h.bytes_in + h.bytes_out})), "io");
  const end = history.length ? history[history.length - 1].time : 0;
  const span = Math.max(60, Math.min(300, history.length ? end - history[0].time : 0));
  const x = (t) => L + (W - L - R) * Math.max(0, 1 - (end - t) / span);
  svg.appendChild(node("line", {x1: L, x2: W - R, y1: 10, y2: 10}));
  svg.appendChild(node("line", {x1: L, x2: W - R, y1: H - B, y2: H - B}));
  for (const [series, cls, label, at, color] of [[ops, "ops", (v) => v.toFixed(v < 10 ? 1 : 0) + " ops/s", 4, "#d9480f"],
                                                  [io, "bytes", (v) => bytes(Math.round(v)) + "/s", W - R + 4, "#1971c2"]]) {
    const top = Math.max(1, ...series.map((p) => p[1]));
    const y = (v) => H - B - (H - B - 10) * v / top;
    const points = series.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
    svg.appendChild(node("polyline", {class: cls, points: points}));
    svg.appendChild(node("text", {x: at, y: 14, style: "fill:" + color}, label(top)));
  }
  svg.appendChild(node("text", {x: L, y: H - 4}, "−" + (span >= 120 ? (span / 60).toFixed(0) + " min" : span.toFixed(0) + " s")));
  svg.appendChild(node("text", {x: W - R - 22, y: H - 4}, "now"));
}
function draw(s) {
  const t = s.totals, own = s.view && s.view.sessions === "own";
  $("summary").textContent = `${s.devices.join(", ")} (${s.backend}) · up ${age(s.uptime_seconds)} · ` +
    (own ? `the sessions of ${s.view.client} only: ` : "") +
    `${t.sessions} session(s), ${t.live_tensors} tensors, ${bytes(t.live_bytes)} live · ` +
    (own ? `memory budget ${bytes(s.memory.budget_bytes)} ` :
           `memory ${bytes(s.memory.used_bytes)} of ${bytes(s.memory.budget_bytes)} `);
  const used = own ? 0 : Math.min(1, s.memory.used_bytes / s.memory.budget_bytes);
  const bar = document.createElement("span"); bar.className = "bar"; bar.hidden = own;
  const fill = document.createElement("span"); fill.style.width = Math.max(0.5, 100 * used).toFixed(1) + "%";
  bar.appendChild(fill);
  const counts = document.createElement("div");
  counts.textContent = `${t.ops} ops, ${t.round_trips} round trips, ${bytes(t.bytes_in)} in, ${bytes(t.bytes_out)} out, ` +
    `${t.graphs_registered} graphs registered, ${t.graph_runs} graph runs, ` +
    `${Object.values(t.errors).reduce((a, b) => a + b, 0)} errors`;
  $("summary").append(bar, counts);
  const body = $("sessions").tBodies[0]; body.replaceChildren();
  for (const r of s.sessions) {
    const row = body.insertRow(); row.dataset.session = r.session;
    cell(row, r.client); cell(row, r.address); cell(row, r.device); cell(row, age(r.age_seconds), "n");
    cell(row, r.live_tensors, "n"); cell(row, bytes(r.live_bytes), "n"); cell(row, r.ops, "n"); cell(row, r.round_trips, "n");
    cell(row, r.last_error ? r.last_error.kind + ": " + r.last_error.message : "", "err bad");
  }
  if (!s.sessions.length) cell(body.insertRow(), "no sessions", "muted");
  chart(s.history);
  const list = $("errors"); list.replaceChildren();
  for (const e of s.recent_errors.slice().reverse()) {
    const li = document.createElement("li");
    li.textContent = `${new Date(e.time * 1000).toLocaleTimeString()} ${e.client}: ${e.kind}: ${e.message}`;
    list.appendChild(li);
  }
  if (!s.recent_errors.length) {
    list.appendChild(Object.assign(document.createElement("li"), {textContent: "none", className: "muted"}));
  }
}
async function refresh() {
  const token = sessionStorage.getItem("ember-token");
  try {
    const reply = await fetch("status.json", {cache: "no-store", headers: token ? {Authorization: "Bearer " + token} : {}});
    if (reply.status === 429) {  // too many wrong tokens from this address: the text says how long to wait
      $("summary").textContent = (await reply.text()).trim();
      return;
    }
    if (reply.status === 401) {
      $("login").hidden = false; $("status").hidden = true; $("summary").textContent = "";
      $("refused").hidden = !token;
      return;
    }
    $("login").hidden = true; $("status").hidden = false;
    draw(await reply.json());
  } catch (error) {
    $("summary").textContent = "the peer does not answer (" + error + ")";
  } finally {
    if ($("login").hidden) setTimeout(refresh, REFRESH);
  }
}
$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("ember-token", $("token").value.trim());
  $("token").value = "";
  refresh();
});
refresh();
</script>
</body></html>
"""
