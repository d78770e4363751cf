"""The HTML of the status page: one self-contained document (inline CSS and script, no external assets).

The first snapshot is embedded as JSON; the script renders it at once, then fetches `status.json` every
`refresh_s` seconds and renders again (DOM built with textContent: worker ids never become markup).
`body[data-refreshes]` counts the fetches rendered, and `#updated` says when the last one was.
"""

from __future__ import annotations

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pdserve status</title>
<link rel="icon" href="data:,">
<noscript><meta http-equiv="refresh" content="__REFRESH__"></noscript>
<style>
:root { --bg:#f6f7f9; --card:#fff; --ink:#1d2430; --dim:#6a7383; --line:#e3e6eb; --ok:#1f9d55; --warn:#d69e2e;
        --bad:#d64545; --bar:#4c6ef5; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; background:var(--bg);
       color:var(--ink); }
header { display:flex; align-items:baseline; gap:16px; padding:12px 24px; background:#1d2430; color:#fff; }
header h1 { font-size:18px; margin:0; }
header .meta { color:#b8c0cc; font-size:13px; }
header #updated { margin-left:auto; }
main { padding:16px 24px; max-width:1320px; }
.cards { display:grid; grid-template-columns:repeat(6, minmax(0, 1fr)); gap:12px; margin-bottom:16px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
.card .label { color:var(--dim); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .value { font-size:22px; font-weight:600; font-variant-numeric:tabular-nums; }
.card .sub { color:var(--dim); font-size:12px; font-variant-numeric:tabular-nums; }
h2 { font-size:15px; margin:18px 0 8px; }
table { width:100%; border-collapse:collapse; background:var(--card); border:1px solid var(--line);
        border-radius:8px; overflow:hidden; }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); white-space:nowrap; }
th { color:var(--dim); font-weight:500; font-size:12px; background:#fafbfc; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
tr:last-child td { border-bottom:none; }
.pill { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px; color:#fff; }
.ok { background:var(--ok); } .draining, .late { background:var(--warn); } .unreachable { background:var(--bad); }
.bar { display:inline-block; width:90px; height:8px; background:var(--line); border-radius:4px; vertical-align:middle;
       margin-right:6px; overflow:hidden; }
.bar span { display:block; height:100%; background:var(--bar); }
.policies { color:var(--dim); margin-top:14px; font-size:13px; }
#error { color:var(--bad); font-weight:600; }
</style>
</head>
<body data-refreshes="0">
<header><h1>pdserve</h1><span class="meta" id="model"></span><span class="meta" id="uptime"></span>
<span class="meta" id="error"></span><span class="meta" id="updated"></span></header>
<main>
<section class="cards">
  <div class="card"><div class="label">TTFT p50 / p99</div><div class="value" id="ttft-p50"></div>
    <div class="sub" id="ttft-p99"></div></div>
  <div class="card"><div class="label">TPOT p50 / p99</div><div class="value" id="tpot-p50"></div>
    <div class="sub" id="tpot-p99"></div></div>
  <div class="card"><div class="label">E2E p50 / p99</div><div class="value" id="e2e-p50"></div>
    <div class="sub" id="e2e-p99"></div></div>
  <div class="card"><div class="label">Requests (window)</div><div class="value" id="req-count"></div>
    <div class="sub" id="req-rate"></div></div>
  <div class="card"><div class="label">Prefix cache hits</div><div class="value" id="cache-recent"></div>
    <div class="sub" id="cache-total"></div></div>
  <div class="card"><div class="label">Responses</div><div class="value" id="resp-ok"></div>
    <div class="sub" id="resp-errors"></div></div>
</section>
<h2>Pools</h2>
<table><thead><tr><th>pool</th><th class="num">workers</th><th class="num">taking work</th><th class="num">queued</th>
<th class="num">running</th><th class="num">routed, unfinished</th><th class="num">KV blocks used</th></tr></thead>
<tbody id="pools"></tbody></table>
<h2>Workers</h2>
<table><thead><tr><th>worker</th><th>role</th><th>health</th><th class="num">queued</th><th class="num">running</th>
<th class="num">waiting</th><th class="num">routed, unfinished</th><th>KV usage</th><th class="num">prefix hits</th>
<th class="num">last report</th><th>address</th></tr></thead>
<tbody id="workers"></tbody></table>
<div class="policies" id="policies"></div>
</main>
<script id="initial-data" type="application/json">__DATA__</script>
<script>
"use strict";
const REFRESH_MS = __REFRESH__ * 1000;
const $ = (id) => document.getElementById(id);
function ms(s) {
  if (s === null || s === undefined) return "\\u2013";
  return s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(1) + " ms";
}
function pct(x) { return x === null || x === undefined ? "\\u2013" : (x * 100).toFixed(1) + " %"; }
function duration(s) {
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  return (h ? h + " h " : "") + (h || m ? m + " min " : "") + sec + " s";
}
function cell(text, cls) {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  if (text instanceof Node) td.appendChild(text); else td.textContent = String(text);
  return td;
}
function bar(fraction) {
  const wrap = document.createElement("span");
  const outer = document.createElement("span"); outer.className = "bar";
  const inner = document.createElement("span");
  inner.style.width = Math.round(Math.min(1, fraction || 0) * 100) + "%";
  outer.appendChild(inner); wrap.appendChild(outer);
  wrap.appendChild(document.createTextNode(pct(fraction)));
  return wrap;
}
function pill(health) {
  const span = document.createElement("span");
  span.className = "pill " + health; span.textContent = health;
  return span;
}
function role(roles) { return roles.length === 2 ? "both" : roles.join(", "); }
function rows(tbody, items) {
  tbody.replaceChildren(...items.map((cells) => { const tr = document.createElement("tr"); tr.append(...cells); return tr; }));
}
function render(d) {
  $("model").textContent = d.model;
  $("uptime").textContent = "up " + duration(d.uptime_s);
  const l = d.latency;
  $("ttft-p50").textContent = ms(l.ttft_p50_s); $("ttft-p99").textContent = "p99 " + ms(l.ttft_p99_s);
  $("tpot-p50").textContent = ms(l.tpot_p50_s); $("tpot-p99").textContent = "p99 " + ms(l.tpot_p99_s);
  $("e2e-p50").textContent = ms(l.e2e_p50_s); $("e2e-p99").textContent = "p99 " + ms(l.e2e_p99_s);
  $("req-count").textContent = l.count;
  $("req-rate").textContent = l.requests_per_s.toFixed(2) + " req/s over " + Math.round(l.window_s) + " s";
  $("cache-recent").textContent = pct(d.cache.hit_rate_recent);
  $("cache-total").textContent = "since start " + pct(d.cache.hit_rate_total) + " of " +
    d.cache.prompt_tokens_total + " prompt tokens";
  const ok = d.requests["200"] || 0;
  const errors = Object.entries(d.requests).filter(([k]) => k !== "200").reduce((a, [, v]) => a + v, 0);
  $("resp-ok").textContent = ok + " ok"; $("resp-errors").textContent = errors + " errors";
  rows($("pools"), Object.entries(d.pools).map(([name, p]) => [cell(name), cell(p.workers, "num"),
    cell(p.available, "num"), cell(p.queue_len, "num"), cell(p.num_running, "num"), cell(p.inflight, "num"),
    cell(p.kv_total ? p.kv_used + " / " + p.kv_total + " (" + pct(p.kv_usage) + ")" : "\\u2013", "num")]));
  rows($("workers"), d.workers.map((w) => [cell(w.worker_id), cell(role(w.roles)), cell(pill(w.health)),
    cell(w.queue_len, "num"), cell(w.num_running, "num"), cell(w.num_waiting, "num"), cell(w.inflight, "num"),
    cell(bar(w.kv_usage)), cell(pct(w.prefix_hit_rate), "num"),
    cell(w.static ? "polled" : w.silent_s.toFixed(1) + " s ago", "num"), cell(w.url)]));
  const c = d.policies.cache;
  $("policies").textContent = "routing: prefill " + d.policies.prefill + ", decode " + d.policies.decode +
    " \\u00b7 cache: write " + c.write + ", device " + c.device_eviction + ", host " + c.host_eviction;
  $("updated").textContent = "updated " + new Date(d.generated_at * 1000).toLocaleTimeString();
}
async function refresh() {
  try {
    const response = await fetch("status.json", { cache: "no-store" });
    if (!response.ok) throw new Error("status.json answered " + response.status);
    render(await response.json());
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
    $("error").textContent = "";
  } catch (err) {
    $("error").textContent = "router unreachable: " + err.message;
  }
}
render(JSON.parse($("initial-data").textContent));
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""


def render_page(snapshot_json: str, refresh_s: int) -> str:
    """The page with `snapshot_json` embedded ('<' escaped so no string in it can close the script tag)."""
    page = _PAGE.replace("__REFRESH__", str(refresh_s))
    return page.replace("__DATA__", snapshot_json.replace("<", "\\u003c"))
