"use strict";
const POLL_MS = 1000;
const WINDOW_S = 300;
const STATES = ["free", "used", "cached", "pinned"];
const SVG = "http://www.w3.org/2000/svg";
const CHARTS = [
  {id: "chart-hit-rate", title: "Prefix-cache hit rate", max: 1, format: percent,
   series: [{key: "hit_rate", label: "hit rate"}]},
  {id: "chart-throughput", title: "Generation throughput", format: perSecond,
   series: [{key: "tokens_per_s", label: "tokens/s"}]},
  {id: "chart-requests", title: "Requests", format: integer,
   series: [{key: "running", label: "running"}, {key: "waiting", label: "waiting"}]},
  {id: "chart-kv-usage", title: "KV usage", max: 1, format: percent,
   series: [{key: "kv_usage", label: "usage"}]},
];
// With --api-key, the page gets the key from its address (/dashboard#key=KEY: a fragment never
// reaches the server or its logs) or from the login form, which trades it for a cookie.
const FRAGMENT_KEY = new URLSearchParams(location.hash.slice(1)).get("key");
let samples = [];

function percent(x) { return (100 * x).toFixed(1) + " %"; }
function perSecond(x) { return x.toFixed(1) + " tok/s"; }
function integer(x) { return Math.round(x).toLocaleString("en-US"); }
function setText(id, text) { document.getElementById(id).textContent = text; }

function setStatus(live, text) {
  const status = document.getElementById("status");
  status.className = live ? "live" : "down";
  status.textContent = text;
}

function cellSize(count) {
  if (count <= 512) return [14, 2];
  if (count <= 4096) return [8, 1];
  return [4, 1];
}

function renderGrid(blocks) {
  const grid = document.getElementById("grid");
  if (grid.children.length !== blocks.length) {
    const [cell, gap] = cellSize(blocks.length);
    grid.style.setProperty("--cell", cell + "px");
    grid.style.setProperty("--gap", gap + "px");
    const cells = [];
    for (let i = 0; i < blocks.length; i++) {
      const div = document.createElement("div");
      div.className = "block";
      cells.push(div);
    }
    grid.replaceChildren(...cells);
  }
  for (let i = 0; i < blocks.length; i++) {
    const state = STATES[blocks.charCodeAt(i) - 48] || "free";
    const cell = grid.children[i];
    if (cell.dataset.state !== state) {
      cell.dataset.state = state;
      cell.title = "block " + i + ": " + state;
    }
  }
}

function renderCounts(counts, total, blockSize) {
  for (const state of STATES) setText("count-" + state, integer(counts[state] || 0));
  setText("count-total", integer(total));
  setText("pool-size", integer(total) + " blocks × " + blockSize + " tokens");
}

function renderNumbers(stats) {
  const latest = samples.length ? samples[samples.length - 1] : null;
  setText("stat-hit-rate", percent(stats.prefix_cache_hit_rate || 0));
  setText("stat-throughput", perSecond(latest ? latest.tokens_per_s : 0));
  setText("stat-running", integer(stats.num_requests_running || 0));
  setText("stat-waiting", integer(stats.num_requests_waiting || 0));
  setText("stat-kv-usage", percent(stats.kv_cache_usage || 0));
  setText("stat-preemptions", integer(stats.num_preemptions || 0));
  setText("stat-finished", integer(stats.finished_requests || 0));
  setText("stat-prompt-tokens", integer(stats.prompt_tokens || 0));
  setText("stat-generation-tokens", integer(stats.generation_tokens || 0));
  renderDocuments(stats);
}

// Documents blended into prompts: reused of all placed (the rest were computed alone first), and
// the share of the blended prompts' tokens placed from the cache rather than computed.
function renderDocuments(stats) {
  const reused = stats.blend_documents_reused || 0;
  const computed = stats.blend_documents_computed || 0;
  setText("stat-documents-reused", integer(reused) + " of " + integer(reused + computed));
  const placed = stats.blend_tokens_reused || 0;
  const recomputed = stats.blend_tokens_recomputed || 0;
  setText("stat-document-tokens", percent(placed + recomputed ? placed / (placed + recomputed) : 0));
  setText("label-document-tokens", "blended tokens placed (" + integer(placed) + " of "
          + integer(placed + recomputed) + ")");
}

// The share of steps carrying decodes that took longer than the target; with no target (0) nothing
// is paced, so the share would read 0 % where it means nothing.
function renderStepTarget(stats, targetMs) {
  if (!targetMs) {
    setText("stat-steps-over-target", "off");
    setText("label-steps-over-target", "step-time target (--max-step-ms 0)");
    return;
  }
  const paced = stats.num_paced_steps || 0;
  const over = stats.num_steps_over_target || 0;
  setText("stat-steps-over-target", percent(paced ? over / paced : 0));
  setText("label-steps-over-target", "steps over " + targetMs.toLocaleString("en-US") + " ms target ("
          + integer(over) + " of " + integer(paced) + ")");
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function seconds(x) { return (x || 0).toFixed(3) + " s"; }
// Columns of the tiers table: each a field of the tier's stats and how to show it.
const TIER_COLUMNS = [
  ["bytes_used", bytes], ["capacity_bytes", bytes], ["entries", integer], ["hits", integer],
  ["misses", integer], ["load_bytes", bytes], ["load_seconds", seconds], ["store_bytes", bytes],
  ["store_seconds", seconds], ["stores_dropped", integer], ["errors", integer], ["corrupt", integer],
];
// The footer under the rows: the rows' own counters summed over the tiers (by the server, in
// tier_totals), then the failures only the offload controller sees.
const TOTAL_COUNTERS = [
  ["hits", "hits", integer], ["misses", "misses", integer], ["load_bytes", "loaded", bytes],
  ["store_bytes", "stored", bytes], ["stores_dropped", "dropped", integer], ["errors", "errors", integer],
  ["corrupt", "corrupt", integer], ["load_timeouts", "load timeouts", integer],
  ["store_queue_full", "stores dropped (queue full)", integer], ["bad_entries", "bad entries", integer],
];

function renderTiers(tiers, totals) {
  const names = Object.keys(tiers || {}).filter(name => name !== "offload");
  document.getElementById("tiers").hidden = names.length === 0;
  const rows = names.map(name => {
    const row = document.createElement("tr");
    row.dataset.tier = name;
    const cells = [name, ...TIER_COLUMNS.map(([key, format]) => format(tiers[name][key]))];
    for (const text of cells) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    return row;
  });
  document.getElementById("tier-rows").replaceChildren(...rows);
  const shown = TOTAL_COUNTERS.map(([key, label, format]) => label + " " + format((totals || {})[key] || 0));
  setText("offload-counters", "all tiers: " + shown.join(" · "));
}

function niceMax(value) {
  if (value <= 0) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function buildChart(spec) {
  const box = document.getElementById(spec.id);
  const title = document.createElement("h3");
  title.append(spec.title);
  const now = document.createElement("span");
  now.className = "now";
  title.append(now);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 " + WINDOW_S + " 100");
  svg.setAttribute("preserveAspectRatio", "none");
  const key = document.createElement("div");
  key.className = "key";
  spec.lines = spec.series.map((series, i) => {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", i ? "b" : "a");
    svg.append(line);
    if (spec.series.length > 1) {
      const mark = document.createElement("i");
      mark.style.background = i ? "var(--chart-b)" : "var(--chart-a)";
      key.append(mark, series.label);
    }
    return line;
  });
  const axis = document.createElement("div");
  axis.className = "axis";
  spec.top = document.createElement("span");
  axis.append("5 min ago", spec.top, "now");
  box.append(title, svg, axis, key);
  spec.now = now;
}

function renderChart(spec, end) {
  const visible = samples.filter(p => p.time >= end - WINDOW_S);
  const peak = Math.max(0, ...visible.flatMap(p => spec.series.map(s => p[s.key])));
  const top = spec.max || niceMax(peak);
  spec.series.forEach((series, i) => {
    const points = visible.map(p => {
      const x = (p.time - (end - WINDOW_S)).toFixed(2);
      const y = (100 - 100 * Math.min(p[series.key], top) / top).toFixed(2);
      return x + "," + y;
    });
    spec.lines[i].setAttribute("points", points.join(" "));
  });
  spec.top.textContent = "max " + spec.format(top);
  const latest = visible.length ? visible[visible.length - 1] : null;
  spec.now.textContent = latest ? spec.series.map(s => spec.format(latest[s.key])).join(" / ") : "";
}

function merge(points, end) {
  const newest = samples.length ? samples[samples.length - 1].time : -Infinity;
  for (const p of points) if (p.time > newest) samples.push(p);
  samples = samples.filter(p => p.time >= end - WINDOW_S);
}

function render(state) {
  merge(state.history, state.time);
  renderGrid(state.blocks);
  renderCounts(state.counts, state.blocks.length, state.block_size);
  renderNumbers(state.stats);
  renderStepTarget(state.stats, state.max_step_ms);
  renderTiers(state.tiers, state.tier_totals);
  for (const spec of CHARTS) renderChart(spec, state.time);
  setStatus(true, "live · " + new Date(state.time * 1000).toLocaleTimeString());
}

async function poll() {
  try {
    const url = samples.length ? "/dashboard/state?since=" + samples[samples.length - 1].time : "/dashboard/state";
    const headers = FRAGMENT_KEY ? {Authorization: "Bearer " + FRAGMENT_KEY} : {};
    const response = await fetch(url, {cache: "no-store", headers});
    if (response.status === 401) {
      askForKey();
      return;  // polling resumes after a successful login
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (error) {
    setStatus(false, "disconnected (" + error.message + "), retrying");
  }
  setTimeout(poll, POLL_MS);
}

function askForKey() {
  setStatus(false, "needs the API key");
  document.getElementById("login").hidden = false;
  document.getElementById("login-key").focus();
}

async function logIn(event) {
  event.preventDefault();
  const key = document.getElementById("login-key").value;
  const response = await fetch("/dashboard/login", {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({key}),
  });
  if (!response.ok) {
    setText("login-error", response.status === 401 ? "wrong key" : "HTTP " + response.status);
    return;
  }
  setText("login-error", "");
  document.getElementById("login").hidden = true;
  poll();
}

// A server without an API key serves the page without the login form.
const loginForm = document.getElementById("login");
if (loginForm) loginForm.addEventListener("submit", logIn);
CHARTS.forEach(buildChart);
poll();
