"""A live view of the KV cache at `GET /dashboard`, for a browser pointed at `kvbank serve`.

The page is `static/dashboard.html` with its script `static/dashboard.js` (package data; plain
JavaScript, nothing fetched from elsewhere). On load, and then once a second, it asks
`GET /dashboard/state` for a snapshot and draws:

* the block pool as a grid, one cell per KV block, coloured by state: free (empty), used (held by a
  running sequence), cached (a finished prefix kept for reuse, evictable) and pinned; with a legend
  that counts the blocks in each state, as /metrics does (`kvbank:num_free_blocks`, `num_used_blocks`,
  `num_cached_blocks`, `num_pinned_blocks`: they add up to the pool);
* headline numbers: prefix-cache hit rate, generation throughput, running and waiting requests,
  KV usage, preemptions, token counters, and the share of steps carrying decodes that overran the
  step-time target (`num_steps_over_target` of `num_paced_steps`; "off" with `--max-step-ms 0`),
  and documents blended into prompts: reused of all placed, and the share of blended prompts'
  tokens placed from the cache (`blend_*`, engine/blend.py);
* with KV tiers below the pool (host RAM, disk, Redis), a table of each tier's bytes used and
  capacity, entries, hits and misses, bytes and seconds loaded and stored, dropped stores, errors
  and corrupt entries; under it the rows' totals (`tier_totals`, summed from the same numbers the
  rows show) and the failures only the offload controller counts (timeouts, full queue, bad entries);
* line charts over the last five minutes of the hit rate, throughput (tokens/s, from successive
  `generation_tokens` counter values), running and waiting requests, and KV usage.

The server keeps those five minutes itself: a sampler task on the event loop records one point a
second from `AsyncEngine.stats()`, so a page opened late starts with full charts. The page passes
`since=<time of its newest point>` to receive only the points it lacks. Every handler only copies
snapshots the engine thread has already published, so none of them blocks the event loop.

With `--api-key`, the page and its script are public but the state is not. The page sends the key
given in its address (`/dashboard#key=KEY`) as a bearer header, or, when it has none, shows a login
form that posts the key to `/dashboard/login`, which answers with an HttpOnly cookie holding a
token derived from the key; the API's key check accepts that cookie for `/dashboard/state` only.
Wrong keys at the login and wrong bearer headers on the API count together, per client address
(`DashboardLogin.failed`): both guess the same key. A server without a key serves the page without
the login form.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel

from kvbank.server.async_engine import AsyncEngine
from kvbank.server.limits import matching_key

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 300.0
STATE_NAMES = ("free", "used", "cached", "pinned")
# `AsyncEngine.block_states()` bytes 0..3 become the characters "0".."3".
_STATE_DIGITS = bytes.maketrans(bytes(range(len(STATE_NAMES))), b"0123")
_NO_STORE = {"Cache-Control": "no-store"}
_STATIC = resources.files("kvbank.server") / "static"
#: routes that need no API key: the page, its script, and the login that checks the key itself
PUBLIC_PATHS = frozenset({"/dashboard", "/dashboard/dashboard.js", "/dashboard/login"})
#: routes that accept the login cookie instead of the bearer header
COOKIE_PATHS = frozenset({"/dashboard/state"})
COOKIE_NAME = "kvbank_dashboard"
#: tier counters the dashboard sums over the tiers, and the offload controller's own failure counters
TOTALED_TIER_FIELDS = ("hits", "misses", "load_bytes", "store_bytes", "stores_dropped", "errors", "corrupt")
OFFLOAD_FAILURE_FIELDS = ("load_timeouts", "store_queue_full", "bad_entries")
_LOGIN_FORM = re.compile(r"\s*<form id=\"login\".*?</form>", re.DOTALL)


#: how long a dashboard login lasts
LOGIN_TTL_S = 12 * 3600
#: wrong keys (logins or bearer headers) one client address may send within LOGIN_WINDOW_S before it gets 429
LOGIN_FAILURES = 5
LOGIN_WINDOW_S = 60.0
#: client addresses whose failures are remembered at once (the oldest are forgotten first)
LOGIN_CLIENTS = 4096


class DashboardLogin:
    """The dashboard's login for a server with API keys (any one signs in): every login issues a new cookie token
    (`expiry.nonce.mac`) that the browser keeps instead of the key; it expires after `ttl_s`, and
    dies with the process (the MAC key is drawn at start). Wrong keys, at the login or as the API's
    bearer header, are throttled per client address: `failures` within `window_s`, then 429
    (`too_many_failures`) until the oldest of them leaves the window."""

    def __init__(
        self,
        api_keys: str | Sequence[str],
        ttl_s: float = LOGIN_TTL_S,
        failures: int = LOGIN_FAILURES,
        window_s: float = LOGIN_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api_keys = [key.encode() for key in ((api_keys,) if isinstance(api_keys, str) else api_keys)]
        self._mac_key = secrets.token_bytes(32)
        self.ttl_s, self.failures, self.window_s = ttl_s, failures, window_s
        self._clock = clock
        self._failed: dict[str, deque[float]] = {}

    def key_matches(self, key: str) -> bool:
        return matching_key(key.encode(), self._api_keys) is not None

    def issue(self) -> str:
        expiry, nonce = str(int(self._clock() + self.ttl_s)), secrets.token_hex(16)
        return f"{expiry}.{nonce}.{self._mac(expiry, nonce)}"

    def valid(self, token: str) -> bool:
        """Whether `token` is one this process issued and it has not expired."""
        parts = token.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return False
        expiry, nonce, mac = parts
        return hmac.compare_digest(mac.encode(), self._mac(expiry, nonce).encode()) and int(expiry) > self._clock()

    def retry_after(self, client: str) -> int | None:
        """Seconds `client` must wait before its next attempt; None if it may try now."""
        times = self._recent(client)
        if len(times) < self.failures:
            return None
        return max(1, math.ceil(times[0] + self.window_s - self._clock()))

    def failed(self, client: str) -> None:
        """Count a wrong key from `client`."""
        times = self._recent(client)
        times.append(self._clock())
        self._failed[client] = times
        while len(self._failed) > LOGIN_CLIENTS:
            del self._failed[next(iter(self._failed))]

    def _recent(self, client: str) -> deque[float]:
        times = self._failed.pop(client, deque())  # re-inserted by `failed`: the dict keeps recency order
        while times and times[0] <= self._clock() - self.window_s:
            times.popleft()
        if times:
            self._failed[client] = times
        return times

    def _mac(self, expiry: str, nonce: str) -> str:
        return hmac.new(self._mac_key, f"{expiry}.{nonce}".encode(), hashlib.sha256).hexdigest()


class _Login(BaseModel):
    key: str


def install_dashboard(app: FastAPI, async_engine: AsyncEngine, login: DashboardLogin | None = None) -> None:
    """Serve the live cache page at `GET /dashboard`, its data at `GET /dashboard/state` and, for a
    server with an API key (`login`), the login that sets the cookie `/dashboard/state` accepts."""
    sampler = StatsSampler(async_engine.stats)
    _run_with_app(app, sampler)
    page = (_STATIC / "dashboard.html").read_text(encoding="utf-8")
    if login is None:
        page = _LOGIN_FORM.sub("", page)
    script = (_STATIC / "dashboard.js").read_text(encoding="utf-8")

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        sampler.ensure_running()
        return HTMLResponse(page, headers=_NO_STORE)

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript", headers=_NO_STORE)

    @app.post("/dashboard/login", include_in_schema=False)
    async def log_in(body: _Login, request: Request) -> Response:
        if login is None:
            return Response(status_code=204)
        client = client_address(request)
        refused = too_many_failures(login, client, param="key")
        if refused is not None:
            return refused
        if not login.key_matches(body.key):
            login.failed(client)
            return _key_error("wrong API key", 401, "invalid_api_key", "key")
        response = Response(status_code=204)
        response.set_cookie(
            COOKIE_NAME, login.issue(), max_age=int(login.ttl_s), httponly=True, samesite="strict", path="/dashboard"
        )
        return response

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state(since: float | None = None) -> JSONResponse:
        sampler.ensure_running()
        if not sampler.history():
            sampler.sample()
        return JSONResponse(dashboard_snapshot(async_engine, sampler, since), headers=_NO_STORE)


def client_address(request: Request) -> str:
    """The peer address a request came from, as failed keys are counted by."""
    return request.client.host if request.client is not None else ""


def too_many_failures(login: DashboardLogin, client: str, param: str | None = None) -> JSONResponse | None:
    """429 with Retry-After while `client` has sent its share of wrong keys; None while it may try.
    Its key is not even checked then (the right one too): an answer that told it apart would let a
    client go on guessing."""
    wait = login.retry_after(client)
    if wait is None:
        return None
    message = f"too many wrong API keys from this address: {login.failures} in {login.window_s:g} s; retry in {wait} s"
    return _key_error(message, 429, "too_many_wrong_keys", param, {"Retry-After": str(wait)})


def _key_error(
    message: str, status: int, code: str, param: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    # errors.error_response's shape; that module imports this one, so the body is built here.
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def dashboard_snapshot(async_engine: AsyncEngine, sampler: StatsSampler, since: float | None = None) -> dict:
    """The body of `/dashboard/state`: block states, their counts, the stats, the step-time target
    (`max_step_ms`, 0: none), the tiers' stats and the history after `since`."""
    states = async_engine.block_states()
    tiers = async_engine.tier_stats()
    return {
        "time": time.time(),
        "block_size": async_engine.info.block_size,
        "max_step_ms": async_engine.info.config.max_step_ms or 0,
        "blocks": encode_block_states(states),
        "counts": count_block_states(states),
        "stats": async_engine.stats(),
        "tiers": tiers,
        "tier_totals": tier_totals(tiers),
        "history": sampler.history(since),
    }


def tier_totals(tiers: dict[str, dict[str, float]]) -> dict[str, float]:
    """The tier rows' counters summed over the tiers, and the offload controller's failure counters
    (`LLMEngine.tier_stats()` shape: one entry per tier, the controller's under "offload")."""
    rows = [row for name, row in tiers.items() if name != "offload"]
    totals = {key: sum(row.get(key, 0) for row in rows) for key in TOTALED_TIER_FIELDS}
    offload = tiers.get("offload", {})
    return {**totals, **{key: offload.get(key, 0) for key in OFFLOAD_FAILURE_FIELDS}}


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

    def __init__(
        self,
        read_stats: Callable[[], dict[str, Any]],
        interval_s: float = SAMPLE_INTERVAL_S,
        history_s: float = HISTORY_S,
    ) -> None:
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
        self._points.append(
            {
                "time": round(time.time(), 3),
                "hit_rate": round(float(stats.get("prefix_cache_hit_rate", 0.0)), 4),
                "tokens_per_s": round(rate, 2),
                "running": int(stats.get("num_requests_running", 0)),
                "waiting": int(stats.get("num_requests_waiting", 0)),
                "kv_usage": round(float(stats.get("kv_cache_usage", 0.0)), 4),
            }
        )

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
