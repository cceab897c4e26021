// kvfabric's dashboard: polls /dashboard/state every second and draws it. No library; every
// value from the server goes in through textContent (worker names are not trusted markup).
"use strict";

const COLORS = ["#3b6fd8", "#d8793b", "#2f9e5b", "#a83bd8", "#c9a227", "#d83b6f"];
const TIERS = ["G1", "G2", "G3", "G4"];
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function num(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? x.toLocaleString("en-US") : x.toFixed(2);
}

function ms(s) {
  if (s === null || s === undefined) return "–";
  return s * 1000 >= 100 ? (s * 1000).toFixed(0) + " ms" : (s * 1000).toFixed(1) + " ms";
}

function bytes(b) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1000 && i < units.length - 1) { b /= 1000; i++; }
  return (i === 0 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
}

function setMetric(name, text) {
  for (const cell of document.querySelectorAll(`[data-metric="${name}"]`)) cell.textContent = text;
}

// Line chart of `series` ([{name, points: [[t, v]]}]) in an <svg>, values formatted by `fmt`.
function chart(svg, series, fmt) {
  const W = svg.clientWidth || 400, H = svg.clientHeight || 160;
  const L = 56, R = 8, T = 8, B = 30;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  if (pts.length === 0) {
    mk("text", { x: L, y: H / 2 }, "no data yet");
    return;
  }
  const t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...pts.map((p) => p[0]));
  const vmax = Math.max(...pts.map((p) => p[1]), 1e-12);
  const x = (t) => L + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (W - L - R);
  const y = (v) => T + (1 - v / vmax) * (H - T - B);
  mk("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "axis" });
  mk("line", { x1: L, y1: T, x2: L, y2: y(0), class: "axis" });
  mk("text", { x: 2, y: T + 8 }, fmt(vmax));
  mk("text", { x: 2, y: y(0) }, fmt(0));
  mk("text", { x: L, y: H - 16 }, `${Math.round(t1 - t0)} s`);
  let lx = L;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const p = s.points.filter((q) => q[1] !== null && q[1] !== undefined);
    if (p.length) {
      mk("polyline", { points: p.map((q) => `${x(q[0]).toFixed(1)},${y(q[1]).toFixed(1)}`).join(" "), stroke: color });
    }
    mk("rect", { x: lx, y: H - 10, width: 8, height: 8, fill: color });
    const label = mk("text", { x: lx + 11, y: H - 2 }, s.name);
    lx += 16 + 6.5 * s.name.length;
    label.setAttribute("data-series", s.name);
  });
}

function tierCell(t, attrs) {
  if (!t || !t.capacity) return el("td", attrs, "–");
  const pct = Math.min(100, (100 * t.used) / t.capacity);
  const bar = el("span", { class: "bar" }, el("span", { style: `width:${pct.toFixed(0)}%` }));
  return el("td", { ...attrs, title: `${t.used} of ${t.capacity} blocks` }, bar, `${num(t.used)}/${num(t.capacity)}`);
}

function renderWorkers(workers) {
  const body = $("#workers tbody");
  body.replaceChildren(...workers.map((w) => {
    const s = w.stats || {};
    const tiers = s.tiers || [];
    return el("tr", { "data-worker": w.name },
      el("td", {}, w.name), el("td", { "data-col": "role" }, w.role),
      el("td", { "data-col": "state", class: "state-" + w.state }, w.state),
      el("td", { "data-col": "requests" }, num(w.requests)),
      el("td", {}, num(s.running)), el("td", {}, num(s.waiting)),
      el("td", {}, num(w.load.active_blocks)), el("td", {}, num(w.load.queued_prefill_tokens)),
      ...TIERS.map((_, i) => tierCell(tiers[i])),
      el("td", { "data-col": "indexed" }, num(w.indexed_blocks)),
      el("td", {}, w.report_age_s === null ? "–" : w.report_age_s.toFixed(1) + " s"));
  }));
  $("#no-workers").hidden = workers.length > 0;
}

function renderFabric(nodes) {
  $("#fabric-box").hidden = nodes.length === 0;
  $("#fabric tbody").replaceChildren(...nodes.map((n) => {
    const s = n.stats || {};
    const tiers = s.tiers || [];
    const moved = (s.transfers || []).reduce((a, t) => a + t.bytes, 0);
    return el("tr", { "data-worker": n.name },
      el("td", {}, n.name, n.note ? el("div", { class: "note", "data-col": "note" }, n.note) : ""),
      el("td", { "data-col": "addr" }, n.addr || "–"),
      tierCell(tiers[1], { "data-col": "host" }), tierCell(tiers[2], { "data-col": "disk" }),
      el("td", { "data-col": "indexed" }, num(n.indexed_blocks)),
      el("td", { "data-col": "moved" }, s.transfers ? bytes(moved) : "–"),
      el("td", {}, n.report_age_s === null ? "–" : n.report_age_s.toFixed(1) + " s"));
  }));
}

function renderDeparted(departed) {
  $("#departed tbody").replaceChildren(...departed.map((w) => el("tr", { "data-worker": w.name },
    el("td", {}, w.name), el("td", {}, w.role),
    el("td", { "data-col": "state", class: "state-" + w.state }, w.state),
    el("td", {}, `${w.left_s_ago.toFixed(0)} s ago`), el("td", {}, num(w.requests)))));
}

function kvRows(table, rows) {
  table.querySelector("tbody").replaceChildren(...rows.map(([k, v, attrs]) =>
    el("tr", {}, el("th", {}, k), el("td", attrs || {}, v))));
}

function renderControl(c) {
  if (!c) {
    kvRows($("#control"), [["control plane", "none: one engine in this process"]]);
    return;
  }
  const st = (s) => (s.up ? `${s.component}: connected` : `${s.component}: disconnected (${s.error || "?"})`);
  kvRows($("#control"), [
    ["discovery", st(c.discovery), { "data-metric": "discovery", class: c.discovery.up ? "state-serving" : "state-lost" }],
    ["event bus", st(c.bus), { "data-metric": "bus", class: c.bus.up ? "state-serving" : "state-lost" }],
    ["routing", c.routing],
    ["KV events applied", num(c.kv_events), { "data-metric": "kv_events" }],
    ["event gaps", num(c.kv_event_gaps)],
    ["dump requests", num(c.dump_requests), { "data-metric": "dump_requests" }],
    ["dumps applied", num(c.kv_dumps)],
    ["malformed / unknown worker", `${num(c.kv_events_malformed)} / ${num(c.kv_events_unknown_worker)}`],
    ["bus lag (load reports)", c.bus_lag_ms === null ? "–" : c.bus_lag_ms.toFixed(0) + " ms"],
  ]);
}

function renderClasses(cs) {
  $("#classes-box").hidden = !cs || cs.length === 0;
  if (!cs) return;
  $("#classes tbody").replaceChildren(...cs.map((c) => {
    const all = c.met + c.missed;
    const att = all ? `${(100 * c.met / all).toFixed(1)}% (${num(c.met)})` : "–";
    return el("tr", { "data-class": c.class },
      el("td", {}, c.class), el("td", {}, ms(c.ttft_target_s)), el("td", {}, ms(c.itl_target_s)),
      el("td", { "data-col": "attainment" }, att), el("td", {}, num(c.missed)),
      el("td", { "data-col": "shed" }, num(c.shed)), el("td", {}, num(c.expired)),
      el("td", {}, num(c.waiting)));
  }));
}

function renderPlanner(p) {
  $("#planner-box").hidden = !p;
  if (!p) return;
  const pools = (p.pools || []).length > 1
    ? p.pools.map((q) => [`${q.pool} workers (desired)`, `${q.workers} (${q.desired})`]) : [];
  kvRows($("#planner"), [
    ["workers (desired)", `${p.workers} (${p.desired})`], ...pools, ["draining", num(p.draining)],
    ["observed / predicted req/s", `${num(p.observed_rate)} / ${num(p.predicted_rate)}`],
    ["observed TTFT / ITL", `${ms(p.observed_ttft_s)} / ${ms(p.observed_itl_s)}`],
    ["decisions up / down / hold", p.decisions.join(" / ")], ["scale failures", num(p.scale_failures)],
  ]);
}

let models = [];

function render(s) {
  $("#server").textContent = `${s.server.name} · ${s.server.models.join(", ") || "no model"}`;
  const status = $("#status");
  status.textContent = s.server.status;
  status.className = "badge " + (s.server.status === "ok" ? "ok" : s.server.status === "degraded" ? "degraded" : "bad");
  // The health document's reasons (docs/health.schema.json): what is wrong, what still works.
  $("#reasons").textContent = (s.health.reasons || []).join(" · ");
  $("#updated").textContent = `up ${Math.round(s.uptime_s)} s`;
  const r = s.requests;
  for (const k of ["ok", "client_errors", "server_errors", "cancelled", "prompt_tokens", "cached_prompt_tokens", "generated_tokens"]) {
    setMetric(k, num(r[k]));
  }
  setMetric("ttft_count", num(r.ttft_s.count));
  setMetric("ttft_p50", ms(r.ttft_s.p50)); setMetric("ttft_p99", ms(r.ttft_s.p99));
  setMetric("itl_p50", ms(r.itl_s.p50)); setMetric("itl_p99", ms(r.itl_s.p99));
  setMetric("remote_prefills", num(s.transfers.remote_prefills));
  setMetric("prefill_fallbacks", num(s.transfers.prefill_fallbacks));
  $("#transports tbody").replaceChildren(...Object.entries(s.transfers.bytes).map(([k, v]) =>
    el("tr", { "data-transport": k }, el("td", {}, k), el("td", {}, bytes(v)))));
  renderWorkers(s.workers);
  renderDeparted(s.departed);
  renderFabric(s.fabric || []);
  renderControl(s.control);
  renderPlanner(s.planner);
  renderClasses(s.classes);

  const pts = s.series.points;
  const line = (name, f) => ({ name, points: pts.map((p) => [p.t, f(p)]) });
  chart($("#chart-rate"), [line("requests/s", (p) => p.requests_per_s), line("errors/s", (p) => p.errors_per_s)], (v) => v.toFixed(1));
  chart($("#chart-ttft"), ["p50", "p90", "p99"].map((q) => line(q, (p) => p.ttft_s[q])), ms);
  chart($("#chart-itl"), ["p50", "p90", "p99"].map((q) => line(q, (p) => p.itl_s[q])), ms);
  chart($("#chart-hits"), TIERS.map((t) => line(t, (p) => p.hit_rate[t])), (v) => (100 * v).toFixed(0) + "%");
  const transports = [...new Set(pts.flatMap((p) => Object.keys(p.kv_bytes_per_s)))];
  chart($("#chart-kv"), transports.map((k) => line(k + " bytes/s", (p) => p.kv_bytes_per_s[k] ?? 0)), (v) => bytes(v) + "/s");

  if (JSON.stringify(models) !== JSON.stringify(s.server.models)) {
    models = s.server.models;
    $("#cm-model").replaceChildren(...models.map((m) => el("option", { value: m }, m)));
  }
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/state", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const s = await resp.json();
    if (s.version !== 1) throw new Error(`state version ${s.version}; this page reads version 1`);
    render(s);
    document.body.dataset.updated = String(s.now_s);
  } catch (e) {
    console.error("dashboard:", e);
    $("#status").textContent = "unreachable";
    $("#status").className = "badge bad";
    $("#updated").textContent = String(e.message || e);
  }
  setTimeout(poll, 1000);
}

async function explain(ev) {
  ev.preventDefault();
  const text = $("#cm-prompt").value;
  let prompt = text;
  try {
    const ids = JSON.parse(text);
    if (Array.isArray(ids) && ids.every(Number.isInteger)) prompt = ids;
  } catch (_) { /* text */ }
  const headers = { "content-type": "application/json" };
  const key = $("#cm-key").value.trim();
  if (key) headers.authorization = "Bearer " + key;
  const reason = $("#cm-reason");
  const body = $("#cm-result tbody");
  try {
    const resp = await fetch("/v1/route", { method: "POST", headers, body: JSON.stringify({ model: $("#cm-model").value, prompt }) });
    const v = await resp.json();
    if (!resp.ok) throw new Error(v.error ? v.error.message : `HTTP ${resp.status}`);
    reason.className = "";
    reason.textContent = `${v.prompt_tokens} tokens, ${v.blocks} full blocks of ${v.block_tokens}; ${v.mode} routing → ${v.worker}. ${v.reason}`;
    const rows = [...v.workers].sort((a, b) => a.cost - b.cost);
    body.replaceChildren(...rows.map((w) => el("tr", { "data-worker": w.worker, class: w.worker === v.worker ? "chosen" : "" },
      el("td", {}, w.worker === v.worker ? "★" : ""), el("td", {}, w.worker),
      el("td", { "data-col": "cached" }, num(w.cached_blocks)),
      ...["device", "host", "disk", "remote"].map((t) => el("td", { "data-col": t }, num(w.cached_blocks_per_tier[t]))),
      el("td", {}, w.cost_terms.prefill_blocks.toFixed(1)), el("td", {}, w.cost_terms.decode_load.toFixed(1)),
      el("td", {}, w.cost_terms.queued_prefill.toFixed(1)), el("td", {}, w.cost.toFixed(1)))));
  } catch (e) {
    reason.className = "error";
    reason.textContent = String(e.message || e);
    body.replaceChildren();
  }
}

$("#cm-form").addEventListener("submit", explain);
poll();
