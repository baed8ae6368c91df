"""Streaming sessions over HTTP: a cached system prompt, frames appended to it, questions asked of it.

    POST   /v1/streams               {"system", "policy", "cache_salt", "separator", "chat",
                                      "reserve_tokens"} -> the stream
    POST   /v1/streams/{id}/frames   {"text" | "token_ids" | "prompt_embeds", "skip_repeat"} -> what it keeps
    POST   /v1/streams/{id}/ask      {"question", sampling fields, "stream"} -> a text completion (or SSE)
    GET    /v1/streams/{id}          what it holds;  GET /v1/streams lists them
    DELETE /v1/streams/{id}

A stream belongs to its tenant, the `cache_salt` it was opened with (none: the default tenant).
Its id is a secret handle (`stream-` and 128 random bits), and every route but the open also needs
the tenant: `cache_salt` in the body of a POST, the `X-Cache-Salt` header on GET and DELETE (none:
the default tenant). A stream of another tenant is answered exactly as a missing one (404), and a
tenant lists only its own streams.

A server holds at most `max_streams` streams, a tenant at most `tenant_stream_limit()`, and a client
(`quotas.client_of`) at most `client_stream_limit()` under all the tenants it names (a salt is free to
invent); the engine keeps their KV blocks within `max_stream_pool_fraction` of the pool. One unused
for `stream_idle_timeout_s` is closed. A question whose client hangs up is aborted, which frees
only the question's own blocks. Frames given as embeddings travel as `bodies.EmbedsBody` (raw
bytes, never a pickle).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbank.defaults import ASK_MAX_TOKENS
from kvbank.engine.streams import FrameOutput
from kvbank.server.async_engine import AsyncEngine, final_outputs
from kvbank.server.bodies import (
    AskRequest,
    FrameRequestBody,
    RequestChecks,
    StreamOpenRequest,
    check_count,
    checked_token_ids,
    decode_embeds,
    tenant_of,
    with_salt,
)
from kvbank.server.completions import scheduling_tenant
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits
from kvbank.server.quotas import client_of
from kvbank.server.responses import (
    Job,
    Usage,
    completion_choice,
    completion_chunks,
    event_stream,
    unless_disconnected,
    usage_json,
)

#: how often idle streams are looked for
EXPIRY_CHECK_S = 1.0
#: the header that names the tenant (its cache_salt) on the routes without a body
SALT_HEADER = "X-Cache-Salt"


@dataclass
class _StreamState:
    tenant: str
    #: who opened it (quotas.client_of): a client's streams are bounded whatever tenants it names
    client: str
    created: int
    policy: str
    separator: str
    question_suffix: str = ""
    last_used: float = field(default_factory=time.monotonic)
    #: requests (frames and questions) in flight: a stream in use is never expired
    busy: int = 0


class Streams:
    """The server's streams: limits, idle expiry, and each route's work."""

    def __init__(self, async_engine: AsyncEngine, checks: RequestChecks, limits: ServerLimits) -> None:
        self.async_engine = async_engine
        self.engine_info = async_engine.info
        self.checks = checks
        self.limits = limits
        self.streams: dict[str, _StreamState] = {}
        self._expiry: asyncio.Task | None = None

    # --- routes -------------------------------------------------------------------------------

    async def open(self, body: StreamOpenRequest, client: str, scheduled_as: str | None = None) -> dict:
        """Open a stream for `client`; its work is scheduled as the tenant `scheduled_as` (None: its salt's)."""
        self._start_expiry()
        # Before the room check: nothing may await between it and the new stream's entry.
        system: Any = await self._given("system", body.system)
        tenant = tenant_of(body.cache_salt)
        self._check_room(tenant, client)
        stream_id = f"stream-{secrets.token_hex(16)}"
        system = with_salt(system, body.cache_salt, scheduled_as)
        state = self.streams[stream_id] = _StreamState(
            tenant, client, int(time.time()), body.policy or "", body.separator
        )
        # Without a policy the engine's default applies; the answer spells out whichever it runs.
        policy = {} if body.policy is None else {"policy": body.policy}

        def start(engine):
            return engine.open_stream(
                system,
                separator=body.separator,
                stream_id=stream_id,
                request_id=f"{stream_id}-open",
                chat=body.chat,
                reserve_tokens=body.reserve_tokens,
                **policy,
            )

        try:
            output = await self._run(stream_id, start, f"{stream_id}-open")
        except BaseException:
            self.streams.pop(stream_id, None)
            await self._close_quietly(stream_id)
            raise
        state.last_used = time.monotonic()
        try:
            state.question_suffix, state.policy = await self.async_engine.call(
                lambda engine: (engine.stream(stream_id).question_suffix, str(engine.stream(stream_id).policy))
            )
        except BaseException:
            self.streams.pop(stream_id, None)
            await self._close_quietly(stream_id)
            raise
        return {
            "id": stream_id,
            "object": "stream",
            "created": state.created,
            "model": self.checks.model_name,
            "policy": state.policy,
            "system_tokens": len(output.prompt_token_ids),
            "cached_tokens": output.num_cached_tokens,
        }

    async def append(self, stream_id: str, body: FrameRequestBody) -> dict:
        state = self._state(stream_id, body.cache_salt)
        given = [name for name in ("text", "token_ids", "prompt_embeds") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError(f"give exactly one of text, token_ids or prompt_embeds (got {len(given)})")
        if body.prompt_embeds is not None:
            config = self.engine_info.model_config
            frame: Any = await self.async_engine.run_tokenizer(
                decode_embeds, body.prompt_embeds, config.hidden_size, self.engine_info.max_model_len
            )
        elif body.text is not None and self.engine_info.tokenizer is not None:
            # Tokenized here, off the engine thread; the engine adds the separator only to text.
            self._check_length("text", body.text)
            encode = self.engine_info.tokenizer.encode
            frame = await self.async_engine.run_tokenizer(encode, body.text + state.separator, False)
            self._check_length("text", frame)
        else:  # token ids, or text the engine refuses without a tokenizer
            frame = await self._given(given[0], getattr(body, given[0]))
        request_id = f"{stream_id}-frame-{uuid.uuid4().hex}"
        state.busy += 1
        try:
            output = await self._run(
                stream_id,
                lambda engine: engine.append_frame(stream_id, frame, body.skip_repeat, request_id),
                request_id,
            )
        finally:
            state.busy -= 1
            state.last_used = time.monotonic()
        if output.frame is None:
            raise APIError(f"stream {stream_id!r} was closed before the frame was computed", status=409)
        info = output.frame
        return {
            "stream": stream_id,
            "object": "stream.frame",
            "index": info.index,
            "num_tokens": info.num_tokens,
            "repeat_of": info.repeat_of,
            "skipped": info.skipped,
            "kept_frames": info.kept_frames,
            "kept_tokens": info.kept_tokens,
            "evicted_frames": info.evicted_frames,
        }

    async def ask(self, stream_id: str, body: AskRequest, request: Request) -> Response:
        state = self._state(stream_id, body.cache_salt)
        self.checks.check(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else ASK_MAX_TOKENS
        params = self.checks.sampling_params(
            body, self.checks.max_tokens(max_tokens, "max_tokens"), body.logprobs, None
        )
        if body.prompt_logprobs is not None or body.kv_policy is not None:
            name = "prompt_logprobs" if body.prompt_logprobs is not None else "kv_policy"
            raise APIError(f"{name} cannot be given for a stream question: it runs on the stream's cache", param=name)
        job = Job("ask", "text_completion", "text_completion", self.checks.model_name, params, body.include_usage)
        request_id = f"{job.id}-0"
        question = await self._given("question", body.question)
        if isinstance(question, str) and self.engine_info.tokenizer is not None:
            # Tokenized here, off the engine thread, with the end of turn the engine adds to text.
            text = question + state.question_suffix
            question = await self.async_engine.run_tokenizer(self.engine_info.tokenizer.encode, text, False)
            self._check_length("question", question)
        # The question's prefill is the asker's share (its key), whoever opened the stream.
        question = with_salt(question, None, scheduling_tenant(request, body.cache_salt))
        state.busy += 1
        try:
            stream = await self._submit(
                stream_id,
                lambda engine: engine.ask_stream(stream_id, question, params, request_id, body.recall),
                request_id,
            )
        except BaseException:
            state.busy -= 1
            raise
        if body.stream:
            return event_stream(self._released(state, completion_chunks(job, [stream], None)))
        try:
            finals = await unless_disconnected(request, final_outputs([stream]))
        finally:
            state.busy -= 1
            state.last_used = time.monotonic()
        output = finals[0]
        choices = [
            completion_choice(0, c, params.logprobs, None, None, output.prompt_token_ids) for c in output.outputs
        ]
        answer = {**job.body(choices, usage=usage_json([Usage().add(output)])), "stream": stream_id}
        if output.recalled_frames is not None:
            answer["recalled_frames"] = output.recalled_frames
        return JSONResponse(answer)

    async def describe(self, stream_id: str, cache_salt: str | None) -> dict:
        state = self._state(stream_id, cache_salt)
        stats = await self.async_engine.call(lambda engine: engine.stream(stream_id).stats())
        return {"id": stream_id, "object": "stream", "created": state.created, "policy": state.policy, **stats}

    async def list(self, cache_salt: str | None) -> dict:
        tenant = tenant_of(cache_salt)
        own = [stream_id for stream_id, state in self.streams.items() if state.tenant == tenant]
        return {"object": "list", "data": [await self.describe(stream_id, cache_salt) for stream_id in own]}

    async def close(self, stream_id: str, cache_salt: str | None) -> dict:
        self._state(stream_id, cache_salt)
        self.streams.pop(stream_id, None)
        await self._close_quietly(stream_id)
        return {"id": stream_id, "object": "stream", "deleted": True}

    # --- helpers ------------------------------------------------------------------------------

    def _check_length(self, field: str, value: str | list[int]) -> None:
        """A text or token list of a stream is bounded by --max-prompt-tokens as a prompt is: a text
        from its byte count before it is tokenized, a token list by its length."""
        if isinstance(value, list):
            check_count(len(value), field, "tokens", self.async_engine.max_prompt_tokens)
            return
        try:
            self.async_engine.check_text_length([value], what=field)
        except ValueError as error:
            raise APIError(str(error), param=field) from error

    async def _given(self, field: str, value: str | list) -> str | list[int]:
        """A text or token list as the client sent it, bounded (`_check_length`); token ids are then
        checked against the vocabulary off the event loop."""
        if isinstance(value, list):
            return await checked_token_ids(self.async_engine, value, field)
        self._check_length(field, value)
        return value

    def _check_room(self, tenant: str, client: str) -> None:
        """Refuse a new stream beyond the server's limit, the tenant's or the client's."""
        states = self.streams.values()
        limits = self.limits
        checks = (
            (len(self.streams), limits.max_streams, "this server", "--max-streams", "too_many_streams"),
            (
                sum(state.tenant == tenant for state in states),
                limits.tenant_stream_limit(),
                "this tenant (cache_salt)",
                "--max-streams-per-tenant",
                "too_many_tenant_streams",
            ),
            (
                sum(state.client == client for state in states),
                limits.client_stream_limit(),
                "this client (under every cache_salt it names)",
                "--max-streams-per-client",
                "too_many_client_streams",
            ),
        )
        for count, limit, holder, flag, code in checks:
            if limit is not None and count >= limit:
                raise APIError(
                    f"{holder} holds {count} streams, its limit ({flag}); close one first",
                    status=429,
                    code=code,
                    headers={"Retry-After": str(self.limits.retry_after_s)},
                )

    def _state(self, stream_id: str, cache_salt: str | None) -> _StreamState:
        """The stream, if it exists and belongs to the tenant of `cache_salt`; another tenant's is
        answered as a missing one, so that an id cannot be probed."""
        state = self.streams.get(stream_id)
        if state is None or not hmac.compare_digest(state.tenant, tenant_of(cache_salt)):
            raise _not_found(stream_id)
        return state

    async def _submit(self, stream_id: str, start, request_id: str):
        try:
            return await self.async_engine.submit(start, request_id)
        except KeyError:
            raise _not_found(stream_id) from None
        except ValueError as error:  # PoolFull among them: a 503
            raise APIError.from_value_error(error) from error

    async def _run(self, stream_id: str, start, request_id: str) -> FrameOutput:
        stream = await self._submit(stream_id, start, request_id)
        return (await final_outputs([stream]))[0]

    async def _released(self, state: _StreamState, chunks):
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            state.busy -= 1
            state.last_used = time.monotonic()

    async def _close_quietly(self, stream_id: str) -> None:
        def close(engine) -> None:
            if stream_id in engine.streams:
                engine.close_stream(stream_id)

        await self.async_engine.call(close)

    def _start_expiry(self) -> None:
        if self._expiry is None and self.limits.stream_idle_timeout_s is not None:
            self._expiry = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        timeout = self.limits.stream_idle_timeout_s
        while True:
            await asyncio.sleep(min(EXPIRY_CHECK_S, timeout / 2))
            now = time.monotonic()
            for stream_id, state in list(self.streams.items()):
                if state.busy == 0 and now - state.last_used > timeout:
                    self.streams.pop(stream_id, None)
                    await self._close_quietly(stream_id)


def _not_found(stream_id: str) -> APIError:
    return APIError(f"stream {stream_id!r} does not exist", status=404, param="stream_id", code="stream_not_found")


def _header_salt(request: Request) -> str | None:
    return request.headers.get(SALT_HEADER)


def _same_salt(request: Request, cache_salt: str | None) -> None:
    """A POST names its tenant in the body; a salt header that says otherwise is refused, not ignored."""
    header = _header_salt(request)
    if header is not None and header != cache_salt:
        raise APIError(
            f"the {SALT_HEADER} header differs from the body's cache_salt: a POST names its tenant in the body",
            param="cache_salt",
        )


def install_streams(app: FastAPI, streams: Streams) -> None:
    """The /v1/streams routes."""

    @app.post("/v1/streams")
    async def open_stream(body: StreamOpenRequest, request: Request) -> dict:
        _same_salt(request, body.cache_salt)
        opened = await streams.open(body, client_of(request), scheduling_tenant(request, body.cache_salt))
        if await request.is_disconnected():
            # The client hung up before it learned the id, the stream's only handle: nobody could
            # use or close it, and it would hold its blocks and a slot until the idle timeout.
            await streams.close(opened["id"], body.cache_salt)
        return opened

    @app.get("/v1/streams")
    async def list_streams(request: Request) -> dict:
        return await streams.list(_header_salt(request))

    @app.get("/v1/streams/{stream_id}")
    async def describe_stream(stream_id: str, request: Request) -> dict:
        return await streams.describe(stream_id, _header_salt(request))

    @app.post("/v1/streams/{stream_id}/frames")
    async def append_frame(stream_id: str, body: FrameRequestBody, request: Request) -> dict:
        _same_salt(request, body.cache_salt)
        return await streams.append(stream_id, body)

    @app.post("/v1/streams/{stream_id}/ask")
    async def ask(stream_id: str, body: AskRequest, request: Request) -> Response:
        _same_salt(request, body.cache_salt)
        return await streams.ask(stream_id, body, request)

    @app.delete("/v1/streams/{stream_id}")
    async def close_stream(stream_id: str, request: Request) -> dict:
        return await streams.close(stream_id, _header_salt(request))
