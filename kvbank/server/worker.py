"""A replica behind a router: SGLang's worker routes, and the drain that lets it leave a fleet cleanly.

    GET /health       200 while the engine thread runs and the server is not draining; else 503
    GET /model_info   the model (path, tokenizer, served name, architecture, context)
    GET /server_info  the server's settings and limits, and its load now (`internal_states`)
    GET /get_load     the load, one entry per data-parallel rank (one here), as SGLang answers it

Routers probe these under SGLang's names and shapes: sglang-router reads `served_model_name`,
`model_path`, `tp_size`, `dp_size` from /server_info and `model_type`, `architectures` from
/model_info when a worker registers, and its `power_of_two` policy polls /get_load, summing
`num_tokens` over the entries as the worker's load. Every number comes from the engine's own
counters as of its latest step (`AsyncEngine.stats()` and the other snapshots the engine thread
publishes), never a guess: `num_tokens` is the KV tokens live sequences hold plus the prompt tokens
still queued.

Draining (`Drain`): once started (by SIGTERM in `kvbank serve`), /health answers 503, so the router's
health checker takes the replica out of rotation, and every request that may start new work is
refused with 503, an OpenAI error body and Retry-After, which a router retries on another replica:
every POST, PUT or PATCH (a completion, a frame, a question, a session save or restore, a flush,
...). Reads (no route changes state on GET) and DELETE (closing a stream) pass. Requests already
running go on; `Drain.idle` says when none is left.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import kvbank
from kvbank.cache.tiers.redis import redacted
from kvbank.engine.llm_engine import EngineInfo
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.errors import SAFE_METHODS, error_response
from kvbank.server.limits import ServerLimits

#: methods a draining server still takes: reads, and DELETE, which only closes or cleans up
DRAIN_PASSES = SAFE_METHODS | {"DELETE"}
#: probes a router or a scraper sends; they are not work a drain waits for
PROBES = {"/health", "/metrics", "/model_info", "/server_info", "/get_load", "/get_model_info", "/get_server_info"}


class Drain:
    """Whether the server is draining, since when, and how many requests are in flight (HTTP)."""

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.in_flight = 0
        self.refused = 0

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self) -> bool:
        """Start draining; False if it had started already."""
        if self.started_at is not None:
            return False
        self.started_at = time.monotonic()
        return True

    def idle(self, async_engine: AsyncEngine) -> bool:
        """No request is in flight over HTTP and the engine has none running or waiting."""
        stats = async_engine.stats()
        return (
            self.in_flight == 0
            and async_engine.num_queued == 0
            and not stats.get("num_requests_running", 0)
            and not stats.get("num_requests_waiting", 0)
        )


class DrainGate:
    """ASGI middleware: counts requests in flight (probes aside) and, while draining, refuses every
    request whose method may start work (all but `DRAIN_PASSES`) with 503, an OpenAI error body and
    Retry-After. The rule is by method, not by route, so that a new route cannot slip past it."""

    def __init__(self, app, drain: Drain, retry_after_s: int = 1) -> None:
        self.app, self.drain, self.retry_after_s = app, drain, retry_after_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["method"] not in DRAIN_PASSES:
            self.drain.refused += 1
            response = error_response(
                "this server is draining (shutting down) and takes no new requests; retry on another replica",
                503,
                code="server_draining",
                error_type="service_unavailable",
            )
            response.headers["Retry-After"] = str(self.retry_after_s)
            return await response(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def install_worker_routes(
    app: FastAPI, async_engine: AsyncEngine, served_model_name: str, limits: ServerLimits, drain: Drain
) -> None:
    """/health, /model_info, /server_info and /get_load (with the deprecated /get_* spellings SGLang kept)."""
    info = async_engine.info

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return _unavailable("the engine thread has stopped", "engine_stopped")
        if drain.draining:
            return _unavailable("this server is draining (shutting down)", "server_draining")
        return JSONResponse({"status": "ok"})

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info() -> dict:
        config = info.model_config
        return {
            "model_path": info.model_path,
            "tokenizer_path": info.model_path,  # the tokenizer travels in the model file
            "served_model_name": served_model_name,
            "is_generation": True,
            "model_type": config.arch,
            "architectures": [config.arch],
            "context_length": info.max_model_len,
            "vocab_size": config.vocab_size,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info() -> dict:
        return {
            **_server_args(info),
            **_shown_options(limits),
            "model_path": info.model_path,
            "tokenizer_path": info.model_path,
            "served_model_name": served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "context_length": info.max_model_len,
            "max_total_num_tokens": info.num_blocks * info.block_size,
            "max_running_requests": info.config.max_num_seqs,
            "max_req_input_len": async_engine.max_prompt_tokens or info.max_model_len,
            "page_size": info.block_size,
            "draining": drain.draining,
            "internal_states": [load(async_engine, drain)],
            "version": kvbank.__version__,
        }

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        return [load(async_engine, drain)]


def load(async_engine: AsyncEngine, drain: Drain | None = None) -> dict[str, Any]:
    """The engine's load now, under SGLang's names (`num_reqs`, `num_waiting_reqs`, `num_tokens`) and
    the cache's (`token_usage`, `cached_tokens`, `cache_hit_rate`), with kvbank's counters."""
    stats, info = async_engine.stats(), async_engine.info
    running = int(stats.get("num_requests_running", 0))
    waiting = int(stats.get("num_requests_waiting", 0)) + async_engine.num_queued
    num_blocks = int(stats.get("num_blocks", info.num_blocks))
    usage = float(stats.get("kv_cache_usage", 0.0))
    used_tokens = round(usage * num_blocks * info.block_size)
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_tokens": used_tokens + async_engine.waiting_prompt_tokens(),
        "token_usage": usage,
        "num_used_tokens": used_tokens,
        "max_total_num_tokens": num_blocks * info.block_size,
        "cached_tokens": int(stats.get("prefix_cache_hits", 0)),
        "prompt_tokens": int(stats.get("prompt_tokens", 0)),
        "cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0.0)),
        "finished_requests": int(stats.get("finished_requests", 0)),
        "draining": drain is not None and drain.draining,
    }


#: chunks handed to the tiers' writer between two waits for it (below its queue's bound, so none is dropped)
SPILL_BATCH = 8


async def spill_to_tiers(async_engine: AsyncEngine, timeout: float) -> int:
    """Write-back: send every chunk the pool holds that never reached the tiers, as evicting it would,
    and wait until the writer has stored them; returns how many chunks were sent.

    A write-back pool stores a chunk only when it evicts it, so a replica that stops would take
    its cache with it; spilled, the fleet's other replicas load it instead of recomputing it.
    Nothing to do under write-through (everything left when computed) or without tiers.
    """
    if not async_engine.info.has_tiers:
        return 0
    deadline = time.monotonic() + timeout
    tried: set[int] = set()
    sent = 0
    batch = lambda engine: engine.spill_to_tiers(SPILL_BATCH, tried)  # on the engine thread
    while time.monotonic() < deadline:
        queued = await async_engine.call(batch)
        if queued < 0:
            break
        sent += queued
        await async_engine.flush_tiers(max(0.0, deadline - time.monotonic()))
    return sent


def _server_args(info: EngineInfo) -> dict[str, Any]:
    """The engine's settings as `_shown_options` shows them, with the step size the scheduler uses."""
    out = _shown_options(info.config)
    out["max_num_batched_tokens"] = info.max_num_batched_tokens
    return out


def _shown_options(options: Any) -> dict[str, Any]:
    """An options dataclass's fields (EngineConfig, ServerLimits) as a JSON object may show them: fields
    marked `secret=True` left out, and every text with the credentials of URLs in it masked (`redacted`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.metadata.get("secret") is True:
            continue
        value = getattr(options, f.name)
        if isinstance(value, str):
            value = redacted(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _unavailable(message: str, code: str) -> JSONResponse:
    return error_response(message, 503, code=code, error_type="service_unavailable")
