"""A live view of the KV cache at `GET /dashboard`, for a browser pointed at `kvbank serve`.

The page is one self-contained HTML document (inline CSS and plain JavaScript, nothing fetched from
elsewhere). On load, and then once a second, it asks `GET /dashboard/state` for a snapshot and draws:

* the block pool as a grid, one cell per KV block, coloured by state: free (empty), used (held by a
  running sequence), cached (a finished prefix kept for reuse, evictable) and pinned; with a legend
  that counts the blocks in each state;
* headline numbers: prefix-cache hit rate, generation throughput, running and waiting requests,
  KV usage, preemptions and token counters;
* line charts over the last five minutes of the hit rate, throughput (tokens/s, from successive
  `generation_tokens` counter values), running and waiting requests, and KV usage.

The server keeps those five minutes itself: a sampler task on the event loop records one point a
second from `AsyncEngine.stats()`, so a page opened late starts with full charts. The page passes
`since=<time of its newest point>` to receive only the points it lacks. Every handler only copies
snapshots the engine thread has already published, so none of them blocks the event loop.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from kvbank.server.async_engine import AsyncEngine

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 300.0
STATE_NAMES = ("free", "used", "cached", "pinned")
# `AsyncEngine.block_states()` bytes 0..3 become the characters "0".."3".
_STATE_DIGITS = bytes.maketrans(bytes(range(len(STATE_NAMES))), b"0123")
_NO_STORE = {"Cache-Control": "no-store"}


def install_dashboard(app: FastAPI, async_engine: AsyncEngine) -> None:
    """Serve the live cache page at `GET /dashboard` and its data at `GET /dashboard/state`."""
    sampler = StatsSampler(async_engine.stats)
    _run_with_app(app, sampler)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        sampler.ensure_running()
        return HTMLResponse(DASHBOARD_HTML, headers=_NO_STORE)

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state(since: float | None = None) -> JSONResponse:
        sampler.ensure_running()
        if not sampler.history():
            sampler.sample()
        return JSONResponse(dashboard_snapshot(async_engine, sampler, since), headers=_NO_STORE)


def dashboard_snapshot(async_engine: AsyncEngine, sampler: StatsSampler, since: float | None = None) -> dict:
    """The body of `/dashboard/state`: block states, their counts, the stats and the history after `since`."""
    states = async_engine.block_states()
    return {
        "time": time.time(),
        "block_size": async_engine.engine.block_size,
        "blocks": encode_block_states(states),
        "counts": count_block_states(states),
        "stats": async_engine.stats(),
        "history": sampler.history(since),
    }


def encode_block_states(states: bytes) -> str:
    """One digit per block, "0" free, "1" used, "2" cached, "3" pinned."""
    return states.translate(_STATE_DIGITS).decode("ascii")


def count_block_states(states: bytes) -> dict[str, int]:
    """How many blocks are in each state, by state name."""
    return {name: states.count(code) for code, name in enumerate(STATE_NAMES)}


class StatsSampler:
    """A ring buffer of the last `HISTORY_S` seconds of engine stats, one point per `SAMPLE_INTERVAL_S`.

    Each point holds the cumulative prefix-cache hit rate, the generation throughput since the
    previous point, the running and waiting request counts and the KV usage. Points are taken by a
    task on the serving event loop, started with the app (or lazily by the first dashboard request).
    """

    def __init__(self, read_stats: Callable[[], dict[str, Any]], interval_s: float = SAMPLE_INTERVAL_S,
                 history_s: float = HISTORY_S) -> None:
        self.read_stats = read_stats
        self.interval_s = interval_s
        self._points: deque[dict[str, float]] = deque(maxlen=math.ceil(history_s / interval_s) + 1)
        self._last_clock: float | None = None
        self._last_generated = 0.0
        self._task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        """Start the sampling task on the running loop unless it is already running."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample_forever(), name="kvbank-dashboard")

    def stop(self) -> None:
        """Cancel the sampling task, if any."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def sample_if_due(self) -> None:
        """Record a point unless the previous one is less than an interval old."""
        if self._last_clock is None or time.monotonic() - self._last_clock >= self.interval_s:
            self.sample()

    def sample(self) -> None:
        """Record one point from the current stats."""
        stats = self.read_stats()
        clock = time.monotonic()
        generated = float(stats.get("generation_tokens", 0))
        elapsed = clock - self._last_clock if self._last_clock is not None else 0.0
        rate = max(0.0, generated - self._last_generated) / elapsed if elapsed > 0 else 0.0
        self._last_clock, self._last_generated = clock, generated
        self._points.append({
            "time": round(time.time(), 3),
            "hit_rate": round(float(stats.get("prefix_cache_hit_rate", 0.0)), 4),
            "tokens_per_s": round(rate, 2),
            "running": int(stats.get("num_requests_running", 0)),
            "waiting": int(stats.get("num_requests_waiting", 0)),
            "kv_usage": round(float(stats.get("kv_cache_usage", 0.0)), 4),
        })

    def history(self, since: float | None = None) -> list[dict[str, float]]:
        """The recorded points, oldest first; only those later than `since` when given."""
        return [p for p in self._points if since is None or p["time"] > since]

    async def _sample_forever(self) -> None:
        while True:
            self.sample_if_due()
            await asyncio.sleep(self.interval_s)


def _run_with_app(app: FastAPI, sampler: StatsSampler) -> None:
    """Start `sampler` when the app starts and stop it when the app shuts down."""
    inner: Callable[[Any], AbstractAsyncContextManager] = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(asgi_app: Any) -> AsyncIterator[Any]:
        async with inner(asgi_app) as state:
            sampler.ensure_running()
            try:
                yield state
            finally:
                sampler.stop()

    app.router.lifespan_context = lifespan


DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvbank · KV cache</title>
<style>
  :root {
    --bg: #f6f7f9; --panel: #ffffff; --text: #1f2328; --muted: #656d76; --line: #d8dee4;
    --free: #e3e7ec; --used: #2f6fde; --cached: #1f9d6a; --pinned: #e0932b;
    --chart-a: #2f6fde; --chart-b: #e0932b;
  }
  @media (prefers-color-scheme: dark) {
    :root {
      --bg: #0f1216; --panel: #171b21; --text: #e6e8eb; --muted: #8b949e; --line: #2b323b;
      --free: #262d36; --used: #4c8dff; --cached: #2fbf85; --pinned: #f0a640;
      --chart-a: #4c8dff; --chart-b: #f0a640;
    }
  }
  * { box-sizing: border-box; }
  body { margin: 0; background: var(--bg); color: var(--text);
         font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
  header { display: flex; align-items: baseline; gap: 16px; padding: 14px 24px;
           border-bottom: 1px solid var(--line); background: var(--panel); }
  header h1 { margin: 0; font-size: 18px; font-weight: 600; }
  #status { margin-left: auto; color: var(--muted); font-size: 13px; }
  #status::before { content: ""; display: inline-block; width: 8px; height: 8px; margin-right: 6px;
                    border-radius: 50%; background: var(--muted); }
  #status.live::before { background: var(--cached); }
  #status.down::before { background: #d1242f; }
  main { max-width: 1200px; margin: 0 auto; padding: 20px 24px; display: grid; gap: 20px; }
  section { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: 16px; }
  h2 { margin: 0 0 12px; font-size: 14px; font-weight: 600; color: var(--muted);
       text-transform: uppercase; letter-spacing: .04em; }
  .numbers { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 12px; }
  .number .value { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .number .label { color: var(--muted); font-size: 12px; }
  .legend { display: flex; flex-wrap: wrap; gap: 18px; margin-bottom: 12px; align-items: center; }
  .legend span { display: inline-flex; align-items: center; gap: 6px; }
  .legend b { font-variant-numeric: tabular-nums; }
  .swatch { width: 12px; height: 12px; border-radius: 2px; display: inline-block; }
  #grid { display: flex; flex-wrap: wrap; gap: var(--gap, 2px); }
  .block { width: var(--cell, 14px); height: var(--cell, 14px); border-radius: 2px; background: var(--free); }
  [data-state="free"] { background: var(--free); }
  [data-state="used"] { background: var(--used); }
  [data-state="cached"] { background: var(--cached); }
  [data-state="pinned"] { background: var(--pinned); }
  .charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(260px, 1fr)); gap: 16px; }
  .chart h3 { margin: 0 0 4px; font-size: 13px; font-weight: 600; display: flex; justify-content: space-between; }
  .chart h3 .now { font-variant-numeric: tabular-nums; color: var(--muted); font-weight: 500; }
  .chart svg { width: 100%; height: 90px; display: block; border-left: 1px solid var(--line);
               border-bottom: 1px solid var(--line); }
  .chart polyline { fill: none; stroke-width: 1.5; vector-effect: non-scaling-stroke; }
  .chart .a { stroke: var(--chart-a); }
  .chart .b { stroke: var(--chart-b); }
  .chart .axis { display: flex; justify-content: space-between; color: var(--muted); font-size: 11px; }
  .key { color: var(--muted); font-size: 11px; }
  .key i { display: inline-block; width: 10px; height: 2px; vertical-align: middle; margin: 0 4px 0 8px; }
</style>
</head>
<body>
<header>
  <h1>kvbank · KV cache</h1>
  <span id="pool-size"></span>
  <span id="status">connecting…</span>
</header>
<main>
  <section>
    <h2>Now</h2>
    <div class="numbers">
      <div class="number">
        <div class="value" id="stat-hit-rate">–</div><div class="label">prefix-cache hit rate</div>
      </div>
      <div class="number">
        <div class="value" id="stat-throughput">–</div><div class="label">generated tokens/s</div>
      </div>
      <div class="number">
        <div class="value" id="stat-running">–</div><div class="label">running requests</div>
      </div>
      <div class="number">
        <div class="value" id="stat-waiting">–</div><div class="label">waiting requests</div>
      </div>
      <div class="number">
        <div class="value" id="stat-kv-usage">–</div><div class="label">KV usage</div>
      </div>
      <div class="number">
        <div class="value" id="stat-preemptions">–</div><div class="label">preemptions</div>
      </div>
      <div class="number">
        <div class="value" id="stat-finished">–</div><div class="label">finished requests</div>
      </div>
      <div class="number">
        <div class="value" id="stat-prompt-tokens">–</div><div class="label">prompt tokens</div>
      </div>
      <div class="number">
        <div class="value" id="stat-generation-tokens">–</div><div class="label">generated tokens</div>
      </div>
    </div>
  </section>
  <section>
    <h2>Block pool</h2>
    <div class="legend">
      <span><i class="swatch" data-state="free"></i>free <b id="count-free">–</b></span>
      <span><i class="swatch" data-state="used"></i>used <b id="count-used">–</b></span>
      <span><i class="swatch" data-state="cached"></i>cached <b id="count-cached">–</b></span>
      <span><i class="swatch" data-state="pinned"></i>pinned <b id="count-pinned">–</b></span>
      <span>total <b id="count-total">–</b></span>
    </div>
    <div id="grid"></div>
  </section>
  <section>
    <h2>Last five minutes</h2>
    <div class="charts">
      <div class="chart" id="chart-hit-rate"></div>
      <div class="chart" id="chart-throughput"></div>
      <div class="chart" id="chart-requests"></div>
      <div class="chart" id="chart-kv-usage"></div>
    </div>
  </section>
</main>
<script>
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
  for (const spec of CHARTS) renderChart(spec, state.time);
  setStatus(true, "live · " + new Date(state.time * 1000).toLocaleTimeString());
}

async function poll() {
  try {
    const url = samples.length ? "/dashboard/state?since=" + samples[samples.length - 1].time : "/dashboard/state";
    const response = await fetch(url, {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (error) {
    setStatus(false, "disconnected (" + error.message + "), retrying");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

CHARTS.forEach(buildChart);
poll();
</script>
</body>
</html>
"""
