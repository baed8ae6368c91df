"""The HTTP server's app: OpenAI-compatible routes over an `AsyncEngine`, and the server's own.

    GET  /health                 200 while the engine thread runs and the server is not draining (`worker`)
    GET  /model_info, /server_info, /get_load   SGLang's worker routes, for routers (`worker`)
    GET  /metrics                Prometheus text
    GET  /v1/models              POST /v1/completions, /v1/chat/completions   (`completions`)
    POST /v1/documents           computes and caches documents for blended prompts  (`documents`)
    POST /v1/sessions/save, /v1/sessions/restore, /v1/sessions/delete          (`sessions`)
    GET  /v1/sessions            a tenant's saved sessions                     (`sessions`)
    *    /v1/streams...                                                          (`streams`)
    POST /flush_cache            empties the prefix cache -> {"blocks", "tokens"}
    GET  /dashboard              the live cache page                           (`dashboard`)

Bodies, streamed chunks and errors follow OpenAI's shapes, so the official clients work unchanged.
A field is never silently dropped if dropping it changes the answer: `response_format` other than
{"type": "text"}, `tools`, `tool_choice` other than "none", `functions` and `function_call` are
refused with a 400 naming the field, and so is any field this server does not know. Only fields
that cannot change the answer (`bodies.HARMLESS_FIELDS`, e.g. `metadata`, `store`) are ignored,
with a warning in the log.

`app.state.drain` is the server's `worker.Drain`: `kvbank serve` starts it on SIGTERM, and from then
/health fails and new work is refused with 503 while running requests finish.

No route changes state on GET (a page of any site can make a browser send one): those that do take
POST or DELETE, and refuse them from a page of another site (`errors.install_origin_check`).

`/flush_cache` drops every cached prefix block that no request holds and no pin keeps (the tiers
below the pool keep theirs, so the next request for a flushed prefix loads it from a tier): the
way to show a tier hit without restarting. It runs on the engine thread between two steps, so
running requests keep their blocks. With `--api-key` it needs the key, like every route but
/health; without one, on an address other than loopback, it is open to anyone who can reach the
server, which `build_app` warns about.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from kvbank.server.async_engine import AsyncEngine
from kvbank.server.bodies import RequestChecks
from kvbank.server.completions import Completions, install_completions
from kvbank.server.dashboard import DashboardLogin, install_dashboard
from kvbank.server.documents import install_documents
from kvbank.server.errors import (
    BodyLimit,
    install_api_key,
    install_error_handlers,
    install_host_check,
    install_origin_check,
)
from kvbank.server.limits import ServerLimits, is_loopback
from kvbank.server.metrics import RequestTimer, render_metrics
from kvbank.server.sessions import Sessions, install_sessions
from kvbank.server.streams import Streams, install_streams
from kvbank.server.worker import Drain, DrainGate, install_worker_routes

__all__ = ["ServerLimits", "build_app"]

logger = logging.getLogger(__name__)


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    limits: ServerLimits | None = None,
    session_dir: str | os.PathLike | None = None,
    bind_host: str | None = None,
) -> FastAPI:
    """A FastAPI app serving `async_engine` under OpenAI's routes as model `served_model_name`;
    with `session_dir`, sessions are saved to and restored from files in that folder. `bind_host`
    (the address it will listen on) decides which Host headers it answers by default
    (`ServerLimits.host_allowlist`), and whether a server without a key is worth a warning."""
    limits = limits or ServerLimits()
    if limits.api_key is None and bind_host is not None and not is_loopback(bind_host):
        logger.warning(
            "no API key: every route, the admin ones included (/flush_cache, /v1/sessions, /v1/streams), "
            "is open to anyone who can reach %s, which is not a loopback address; start with --api-key KEY "
            "(or $KVBANK_API_KEY) to require one",
            bind_host,
        )
    app = FastAPI(title="kvbank", summary="OpenAI-compatible API of a kvbank engine")
    install_error_handlers(app, limits.retry_after_s)
    async_engine.max_queued = limits.max_queued_requests
    async_engine.max_prompt_tokens = limits.prompt_token_limit(async_engine.info.max_model_len)
    body_limit = limits.body_byte_limit(async_engine.info.max_model_len, async_engine.info.model_config.hidden_size)
    if body_limit is not None:
        app.add_middleware(BodyLimit, limit=body_limit)
    login = DashboardLogin(limits.api_keys()) if limits.api_key is not None else None
    if login is not None:
        install_api_key(app, limits.api_keys(), login)
    install_origin_check(app)  # added after the key check, so it runs before it
    allowed_hosts = limits.host_allowlist(bind_host)
    if allowed_hosts is not None:
        install_host_check(app, allowed_hosts)
    app.state.drain = drain = Drain()
    app.add_middleware(DrainGate, drain=drain, retry_after_s=limits.retry_after_s)
    checks = RequestChecks(limits, served_model_name, async_engine.info.model_config.vocab_size)
    install_worker_routes(app, async_engine, served_model_name, limits, drain)
    _install_server_routes(app, async_engine)
    install_completions(app, Completions(async_engine, checks, limits))
    install_documents(app, async_engine, checks)
    install_sessions(app, Sessions(async_engine, Path(session_dir) if session_dir is not None else None, limits))
    install_streams(app, Streams(async_engine, checks, limits))
    install_dashboard(app, async_engine, login)
    return app


def _install_server_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    """/metrics and /flush_cache: the server's own routes."""
    timer = RequestTimer()
    async_engine.observers.append(timer.observe)

    @app.get("/metrics")
    async def metrics() -> Response:
        page = render_metrics(
            async_engine.stats(), timer, memory=async_engine.memory(), tiers=async_engine.tier_stats()
        )
        return PlainTextResponse(page, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        blocks = await async_engine.call(lambda engine: engine.reset_prefix_cache())
        block_size = async_engine.info.block_size
        return {
            "object": "cache.flush",
            "blocks": blocks,
            "tokens": blocks * block_size,
            "message": f"dropped {blocks} cached prefix blocks ({blocks * block_size} tokens); "
            "blocks in use, pinned blocks and the tiers' entries are kept",
        }
