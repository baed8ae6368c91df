"""OpenAI-compatible HTTP routes over an `AsyncEngine`: completions, chat completions, models, health.

Bodies, streamed chunks and errors follow OpenAI's shapes, so the official clients work unchanged.
Sampling extras that vLLM accepts (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, prompt_logprobs, cache_salt) are
accepted too, and `prompt_logprobs` come back per choice as vLLM returns them.

A field is never silently dropped if dropping it changes the answer: `response_format` other than
{"type": "text"}, `tools`, `tool_choice` other than "none", `functions` and `function_call` are
refused with a 400 naming the field, and so is any field this server does not know. Only fields
that cannot change the answer (`HARMLESS_FIELDS`, e.g. `metadata`, `store`) are ignored, with a
warning in the log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from kvbank import memory
from kvbank.cache.session import PrefixNotCached, write_session
from kvbank.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import AsyncEngine, RequestStream
from kvbank.server.dashboard import COOKIE_NAME, COOKIE_PATHS, PUBLIC_PATHS, cookie_token, install_dashboard
from kvbank.server.metrics import RequestTimer, render_metrics
from kvbank.tokenizer import Tokenizer

logger = logging.getLogger("kvbank.server")

T = TypeVar("T")
PromptInput = str | list[int]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: unknown request fields that are ignored (with a warning) because they cannot change the answer
HARMLESS_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})
CHAT_ROLES = ("system", "developer", "user", "assistant")
LOGIT_BIAS_LIMIT = 100.0
SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class APIError(Exception):
    """A request the server refuses, answered in OpenAI's error shape with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers


@dataclass
class ServerLimits:
    """What one server accepts: an optional API key, a queue bound and per-request caps.

    `max_queued_requests`: requests accepted but still waiting for their first token (queued or
    being prefilled) beyond which new ones get 429 with Retry-After. `max_tokens_cap` bounds
    max_tokens (and is the default when a chat request names none); `max_n` bounds n. None means
    no limit.
    """

    api_key: str | None = None
    max_queued_requests: int | None = None
    max_tokens_cap: int | None = None
    max_n: int | None = None
    retry_after_s: int = 1
    #: streaming sessions open at once, and seconds after which an unused one is closed
    max_streams: int | None = 16
    stream_idle_timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        if self.stream_idle_timeout_s is not None and self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s={self.stream_idle_timeout_s} must be positive")
        for name in ("max_queued_requests", "max_tokens_cap", "max_n", "max_streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")


def system_prompt_prefix(tokenizer: Tokenizer, system_prompt: str) -> list[int]:
    """The token ids every chat request that opens with `system_prompt` as its system message starts
    with, rendered by the chat template exactly as `/v1/chat/completions` renders it (BOS only
    where the template writes one): what `--pin-prompt` pins."""
    system = {"role": "system", "content": system_prompt}
    alone = tokenizer.apply_chat_template([system], add_generation_prompt=False, tokenize=True)
    # A template may end a conversation differently from a turn followed by more turns; only what
    # both renderings share is a prefix of real requests.
    followed = tokenizer.apply_chat_template([system, {"role": "user", "content": "?"}], tokenize=True)
    shared = next((i for i, (a, b) in enumerate(zip(alone, followed)) if a != b), min(len(alone), len(followed)))
    return alone[:shared]


# --- request bodies ------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by both generation routes; None means "the default"."""

    # Extra fields are kept (not rejected by pydantic) so that `_check_extra_fields` can name them
    # in an OpenAI-shaped error, or in a warning if they are harmless.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    kv_policy: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams for this body; raises APIError 400 for a value SamplingParams refuses."""
        fields = {
            name: getattr(self, name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "stop",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "stop_token_ids",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "kv_policy",
            )
        }
        if self.logit_bias:
            fields["logit_bias"] = _logit_bias(self.logit_bias)
        try:
            return SamplingParams(
                **{k: v for k, v in fields.items() if v is not None},
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as error:
            raise APIError(str(error), param=_named_field(str(error))) from error


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias} as {token id: bias}; ids and the [-100, 100] range are checked."""
    parsed = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(f"logit_bias key {key!r} must be a token id (a non-negative integer)", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise APIError(
                f"logit_bias[{key}]={value} must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
                param="logit_bias",
            )
        parsed[int(key)] = value
    return parsed


def _named_field(message: str) -> str | None:
    # SamplingParams errors start with "<field>=<value>".
    name = message.split("=", 1)[0]
    return name if name.isidentifier() else None


class CompletionRequest(_SamplingBody):
    # Checked by `_completion_prompts`, which can say in one sentence what is allowed.
    prompt: Any = None
    #: instead of prompt: {"data": base64 raw little-endian bytes, "dtype", "shape"} or a list of them
    prompt_embeds: Any = None
    logprobs: int | None = None
    echo: bool | None = False

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """Echoing the prompt with logprobs needs the prompt's logprobs, as many as `logprobs`."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) go through to the chat template untouched.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Accepted only in the values that mean "plain text, no tools"; see `_refuse_unsupported`.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def unsupported_field(self) -> str | None:
        """The first field asking for what this server cannot do (structured output, tool calls)."""
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                return name
        return None


class SessionSaveRequest(BaseModel):
    """`POST /v1/sessions/save`: one of prompt (text or token ids), prompt_token_ids or messages."""

    model_config = ConfigDict(extra="forbid")

    session: str
    prompt: str | list[int] | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None


class SessionRestoreRequest(BaseModel):
    """`POST /v1/sessions/restore`."""

    model_config = ConfigDict(extra="forbid")

    session: str
    cache_salt: str | None = None


# --- the app -------------------------------------------------------------------------------------


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    limits: ServerLimits | None = None,
    session_dir: str | os.PathLike | None = None,
) -> FastAPI:
    """A FastAPI app serving `async_engine` under OpenAI's routes as model `served_model_name`;
    with `session_dir`, sessions are saved to and restored from files in that folder."""
    limits = limits or ServerLimits()
    app = FastAPI(title="kvbank", summary="OpenAI-compatible API of a kvbank engine")
    server = _Server(async_engine, served_model_name, limits)
    sessions = _Sessions(async_engine, Path(session_dir) if session_dir is not None else None)
    timer = RequestTimer()
    async_engine.observers.append(timer.observe)
    _install_error_handlers(app)
    if limits.api_key is not None:
        _install_api_key(app, limits.api_key)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            raise APIError("the engine thread has stopped", status=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return server.model_list()

    @app.get("/metrics")
    async def metrics() -> Response:
        page = render_metrics(
            async_engine.stats(), timer, memory=memory.current(async_engine.engine), tiers=async_engine.tier_stats()
        )
        return PlainTextResponse(page, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(body, request)

    @app.post("/v1/sessions/save")
    async def save_session(body: SessionSaveRequest) -> dict:
        return await sessions.save(body)

    @app.post("/v1/sessions/restore")
    async def restore_session(body: SessionRestoreRequest) -> dict:
        return await sessions.restore(body)

    from kvbank.server.streams import install_streams  # its routes reuse this module's response shapes

    install_streams(app, server, limits)
    install_dashboard(app, async_engine, limits.api_key)
    return app


def _install_api_key(app: FastAPI, api_key: str) -> None:
    """Every route but /health and the dashboard's public ones needs `Authorization: Bearer <api_key>`;
    the dashboard's state also takes its login cookie."""
    expected = f"Bearer {api_key}".encode()
    expected_cookie = cookie_token(api_key).encode()

    def authorized(request: Request) -> bool:
        path = request.url.path
        if path == "/health" or path in PUBLIC_PATHS:
            return True
        if hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return True
        cookie = request.cookies.get(COOKIE_NAME, "").encode()
        return path in COOKIE_PATHS and hmac.compare_digest(cookie, expected_cookie)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if not authorized(request):
            return _error_response(
                "invalid or missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )
        return await call_next(request)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        response = _error_response(error.message, error.status, error.param, error.code)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(p["type"] == "json_invalid" for p in problems):
            return _error_response("the request body is not valid JSON", 400)
        message = "; ".join(f"{_field_path(p['loc']) or 'body'}: {p['msg']}" for p in problems)
        return _error_response(message, 400, _field_path(problems[0]["loc"]) if problems else None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return _error_response(str(error.detail), error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return _error_response(f"internal error: {error}", 500, error_type="internal_server_error")


def _error_body(
    message: str, param: str | None = None, code: str | None = None, error_type: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_response(
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    error_type: str = "invalid_request_error",
) -> JSONResponse:
    return JSONResponse(_error_body(message, param, code, error_type), status_code=status)


def _field_path(loc: tuple | list) -> str | None:
    # Pydantic locations start with "body"; OpenAI names the field itself.
    parts = [str(part) for part in loc if part != "body"]
    return ".".join(parts) or None


# --- the routes' work ----------------------------------------------------------------------------


class _Server:
    """What the routes do, with the engine and model name they share."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str, limits: ServerLimits) -> None:
        self.limits = limits
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.model_name = served_model_name
        self.created = int(time.time())

    def model_list(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvbank",
            "root": str(self.engine.model_path),
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_body(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        params = body.sampling_params(
            self._cap_max_tokens(max_tokens, "max_tokens"), body.logprobs, body.effective_prompt_logprobs
        )
        prompts = await self._completion_inputs(body)
        job = _Job("cmpl", "text_completion", "text_completion", self.model_name, params, body.include_usage)
        echoes = [await self._echo(p) for p in prompts] if body.echo else None
        streams = await self._start([_with_salt(p, body.cache_salt) for p in prompts], params, job.id)
        if body.stream:
            return _event_stream(_completion_chunks(job, streams, echoes))
        finals = await _unless_disconnected(request, _final_outputs(streams))
        choices = []
        for i, output in enumerate(finals):
            echo = echoes[i] if echoes else None
            for c in output.outputs:
                choice = _completion_choice(
                    job.choice_index(i, c), c, params.logprobs, echo, output.prompt_logprobs, output.prompt_token_ids
                )
                choices.append({**choice, "prompt_logprobs": _prompt_logprobs_json(output.prompt_logprobs)})
        return JSONResponse(job.body(choices, usage=_usage([_Usage().add(o) for o in finals])))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_body(body)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise APIError(
                f"{unsupported} is not supported by this server: it answers in plain text and calls no tools",
                param=unsupported,
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._cap_max_tokens(getattr(body, field), field)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs, body.prompt_logprobs)
        messages = _template_messages(body.messages)
        prompt = _with_salt(await self.async_engine.run_tokenizer(self._render_chat, messages), body.cache_salt)
        job = _Job("chatcmpl", "chat.completion", "chat.completion.chunk", self.model_name, params, body.include_usage)
        streams = await self._start([prompt], params, job.id)
        if body.stream:
            return _event_stream(_chat_chunks(job, streams))
        finals = await _unless_disconnected(request, _final_outputs(streams))
        prompt_logprobs = _prompt_logprobs_json(finals[0].prompt_logprobs)
        choices = [{**_chat_choice(c, logprobs), "prompt_logprobs": prompt_logprobs} for c in finals[0].outputs]
        return JSONResponse(job.body(choices, usage=_usage([_Usage().add(o) for o in finals])))

    async def _completion_inputs(self, body: CompletionRequest) -> list[Any]:
        """The prompts of a completions body: text or token ids, or embeddings given as raw bytes."""
        if body.prompt_embeds is None:
            return _completion_prompts(body.prompt)
        from kvbank.server.streams import EmbedsBody, decode_embeds

        if body.prompt not in (None, "", []):
            raise APIError("give prompt or prompt_embeds, not both", param="prompt_embeds")
        if body.echo:
            raise APIError("echo cannot show prompt_embeds: they have no text", param="echo")
        items = body.prompt_embeds if isinstance(body.prompt_embeds, list) else [body.prompt_embeds]
        if not items:
            raise APIError("prompt_embeds must not be an empty list", param="prompt_embeds")
        hidden, limit = self.engine.model_config.hidden_size, self.engine.max_model_len
        prompts = []
        for i, item in enumerate(items):
            name = "prompt_embeds" if len(items) == 1 else f"prompt_embeds.{i}"
            try:
                parsed = EmbedsBody.model_validate(item)
            except ValueError:
                raise APIError(f"{name} must be an object with data (base64), dtype and shape", param=name) from None
            prompts.append(
                {"prompt_embeds": await self.async_engine.run_tokenizer(decode_embeds, parsed, hidden, limit, name)}
            )
        return prompts

    def _cap_max_tokens(self, max_tokens: int | None, field: str) -> int | None:
        cap = self.limits.max_tokens_cap
        if cap is None:
            return max_tokens
        if max_tokens is None:
            return cap
        if max_tokens > cap:
            raise APIError(f"{field}={max_tokens} is over this server's limit of {cap} (--max-tokens-cap)", param=field)
        return max_tokens

    def _check_body(self, body: _SamplingBody) -> None:
        if self.limits.max_n is not None and body.n is not None and body.n > self.limits.max_n:
            raise APIError(f"n={body.n} is over this server's limit of {self.limits.max_n} (--max-n)", param="n")
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )
        self._check_token_ids(body)
        _check_extra_fields(body)

    def _check_token_ids(self, body: _SamplingBody) -> None:
        vocab = self.engine.model_config.vocab_size
        for name in ("logit_bias", "stop_token_ids"):
            # Malformed ids are left for `sampling_params`, which names what is wrong with them.
            ids = [int(t) for t in getattr(body, name) or () if str(t).isdigit()]
            if any(t >= vocab for t in ids):
                raise APIError(f"{name} names token id {max(ids)}; this model's vocabulary is [0, {vocab})", param=name)

    def _render_chat(self, messages: list[dict]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (ValueError, jinja2.TemplateError) as error:
            raise APIError(f"cannot render the chat template: {error}", param="messages") from error

    async def _echo(self, prompt: PromptInput) -> _Echo:
        """The prompt as `echo` shows it (token ids are decoded off the event loop)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError("echo needs a tokenizer, and this model has none", param="echo")
        text = prompt if isinstance(prompt, str) else await self.async_engine.run_tokenizer(tokenizer.decode, prompt)
        return _Echo(text, tokenizer.token_text)

    async def _start(self, prompts: list[Any], params: SamplingParams, job_id: str) -> list[RequestStream]:
        """Submit every prompt; if the engine refuses one, abort those already accepted."""
        limit = self.limits.max_queued_requests
        if limit is not None and self.async_engine.num_queued + len(prompts) > limit:
            raise APIError(
                f"the server is busy: {self.async_engine.num_queued} requests are queued and the limit "
                f"is {limit} (--max-queued-requests); retry later",
                status=429,
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.async_engine.add_request(prompt, params, f"{job_id}-{i}"))
        except ValueError as error:
            which = f"prompt {len(streams)}: " if len(prompts) > 1 else ""
            raise APIError(f"{which}{error}", param=_named_field(str(error))) from error
        finally:
            if len(streams) < len(prompts):
                for stream in streams:
                    stream.close()
        return streams


class _Sessions:
    """Session files in one folder: a prompt's KV saved under a name, and restored into the prefix cache.

    The pool is read and written on the engine thread (`AsyncEngine.call`), between two steps;
    files are written, read and verified on a worker thread, so the engine never waits on the disk.
    """

    #: a prompt whose blocks are evicted between computing and saving them is computed this often
    ATTEMPTS = 3

    def __init__(self, async_engine: AsyncEngine, directory: Path | None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.directory = directory

    async def save(self, body: SessionSaveRequest) -> dict:
        path = self._path(body.session)
        prompt = {"prompt_token_ids": await self._token_ids(body), "cache_salt": body.cache_salt}
        blob = await self._packed(prompt)
        size = await asyncio.to_thread(write_session, path, blob)
        return {"session": body.session, "tokens": len(prompt["prompt_token_ids"]), "bytes": size}

    async def restore(self, body: SessionRestoreRequest) -> dict:
        path = self._path(body.session)
        try:
            session = await asyncio.to_thread(
                self.engine.read_session, path, body.cache_salt, f"session {body.session!r}"
            )
        except FileNotFoundError:
            raise APIError(f"session {body.session!r} does not exist", status=404, param="session") from None
        except ValueError as error:
            raise APIError(str(error), status=422, param="session") from error
        try:
            tokens = await self.async_engine.call(lambda engine: engine.install_session(session))
        except ValueError as error:
            raise APIError(str(error), status=507) from error
        return {"session": body.session, "tokens": len(tokens)}

    def _path(self, name: str) -> Path:
        if self.directory is None:
            raise APIError("sessions need --session-dir: this server was started without one")
        if not SESSION_NAME.fullmatch(name) or name.startswith("."):
            raise APIError(
                f"session name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'",
                param="session",
            )
        return self.directory / f"{name}.kv"

    async def _token_ids(self, body: SessionSaveRequest) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError(f"give exactly one of prompt, prompt_token_ids or messages (got {len(given)})")
        tokenizer = self.engine.tokenizer
        if body.prompt_token_ids is not None or isinstance(body.prompt, list):
            return list(body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt)
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send prompt_token_ids", param=given[0])
        if body.messages is not None:
            # The conversation so far, without the assistant's opening: the next turn's prompt starts with it.
            messages = _template_messages(body.messages)
            return await self.async_engine.run_tokenizer(
                lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
            )
        return await self.async_engine.run_tokenizer(tokenizer.encode, body.prompt)

    async def _packed(self, prompt: dict) -> Any:
        """The session entry, computing what the pool lacks first (as a one-token request among the others)."""
        for _ in range(self.ATTEMPTS):
            try:
                return await self.async_engine.call(lambda engine: engine.pack_session(prompt))
            except PrefixNotCached:
                pass
            except ValueError as error:
                raise APIError(str(error)) from error
            try:
                async for _ in self.async_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1)):
                    pass
            except ValueError as error:
                raise APIError(str(error)) from error
        raise APIError("the pool evicted the session's blocks before they could be saved; retry later", status=503)


def _check_extra_fields(body: _SamplingBody) -> None:
    """Refuse fields this server does not know; only `HARMLESS_FIELDS` are ignored, with a warning."""
    unknown = set(body.model_extra or ()) - HARMLESS_FIELDS
    if unknown:
        raise APIError(f"unsupported request field(s): {', '.join(sorted(unknown))}", param=min(unknown))
    if body.model_extra:
        logger.warning("ignoring request fields that cannot change the answer: %s", ", ".join(sorted(body.model_extra)))


def _completion_prompts(prompt: Any) -> list[PromptInput]:
    """The prompts of a completions body: one string or token-id list, or a non-empty list of them."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return prompt
    raise APIError("prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _with_salt(prompt: PromptInput | dict, cache_salt: str | None) -> PromptInput | dict:
    if cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": cache_salt}


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template sees them; raises APIError for a role or content it must not see."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _template_message(position: int, message: ChatMessage) -> dict:
    if message.role not in CHAT_ROLES:
        raise APIError(
            f"messages[{position}].role={message.role!r} is not supported; use one of {', '.join(CHAT_ROLES)}",
            param=f"messages.{position}.role",
        )
    # An assistant turn may carry no text (OpenAI allows it); anything else without text is a mistake.
    if message.content is None and message.role != "assistant":
        raise APIError(
            f"messages[{position}].content must not be null in a {message.role} message",
            param=f"messages.{position}.content",
        )
    rendered = message.model_dump(exclude_none=True)
    # Chat templates know "system"; OpenAI's "developer" role is its newer name.
    rendered["role"] = "system" if message.role == "developer" else message.role
    rendered["content"] = _message_text(position, message.content)
    return rendered


def _message_text(position: int, content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                f"content part of type {part.type!r} is not supported; only text parts are",
                param=f"messages.{position}.content",
            )
    return "\n".join(part.text for part in content)


# --- running requests ----------------------------------------------------------------------------

_END = object()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs (deltas) of several streams as they arrive, tagged with the stream's position.

    Leaving early (or being cancelled) closes every stream, which aborts its request. A reader
    that falls behind (a slow client) holds up the pumps rather than growing a queue here, so
    the steps it missed pile up merged in each stream's mailbox.
    """
    events: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await events.put((index, output))
        except Exception as error:
            await events.put((index, error))
        await events.put((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await events.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's deltas folded into one whole output."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in _merged(streams):
        if finals[index] is None:
            finals[index] = output
        else:
            finals[index].add(output)
    return finals


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its requests) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        # Nobody is listening; the status only shows up in the access log.
        raise APIError("client disconnected", status=499)
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the response's end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- response shapes -----------------------------------------------------------------------------


@dataclass
class _Job:
    """One API call: its id, object type and the choices' numbering."""

    prefix: str
    object: str
    chunk_object: str
    model: str
    params: SamplingParams
    include_usage: bool

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.params.n + completion.index

    def body(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        body = {
            "id": self.id,
            "object": self.chunk_object if chunk else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if not chunk or self.include_usage:
            body["usage"] = usage
        return body


@dataclass
class _Echo:
    """A completions prompt as `echo` shows it: its text, and how to name a token that has no
    logprob entry to take its text from (the prompt's first)."""

    text: str
    token_text: Callable[[int], str]


@dataclass
class _Usage:
    """Token counts of one request, added up from its deltas."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> _Usage:
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        return self


def _usage(counts: list[_Usage]) -> dict:
    prompt_tokens = sum(c.prompt_tokens for c in counts)
    completion_tokens = sum(c.completion_tokens for c in counts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in counts)},
    }


def _top(entry: TokenLogprobs, k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)


def _completion_logprobs(
    token_ids: list[int],
    entries: list[TokenLogprobs | None],
    k: int,
    text_offset: int,
    token_text: Callable[[int], str] = str,
) -> dict:
    """Completions-style logprobs of `token_ids`, the first one at `text_offset` in the text.

    An entry of None (the prompt's first token, when echoed) has no logprob; `token_text` names it.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            text, logprob, top = token_text(token_id), None, None
        else:
            chosen = entry[token_id]
            text, logprob, top = (
                chosen.decoded_token,
                chosen.logprob,
                {lp.decoded_token: lp.logprob for lp in _top(entry, k)},
            )
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _joined_logprobs(parts: list[dict]) -> dict:
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def _completion_choice(
    index: int,
    completion: CompletionOutput,
    k: int | None,
    echo: _Echo | None,
    prompt_logprobs: list[TokenLogprobs | None] | None,
    prompt_token_ids: list[int] | None = None,
    text_offset: int = 0,
) -> dict:
    """One completions choice (or a streamed chunk's): `echo`, when given, is prepended to it."""
    text, logprobs = completion.text, None
    if k is not None and completion.logprobs is not None:
        parts = []
        if echo is not None:
            parts.append(_completion_logprobs(prompt_token_ids, prompt_logprobs, k, text_offset, echo.token_text))
            text_offset += len(echo.text)
        parts.append(_completion_logprobs(completion.token_ids, completion.logprobs, k, text_offset))
        logprobs = _joined_logprobs(parts)
    if echo is not None:
        text = echo.text + text
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _prompt_logprobs_json(entries: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
    """vLLM's shape: per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def _chat_logprobs(completion: CompletionOutput, k: int | None) -> dict | None:
    if k is None or completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        content.append({**_chat_token(entry[token_id]), "top_logprobs": [_chat_token(lp) for lp in _top(entry, k)]})
    return {"content": content}


def _chat_token(logprob: Logprob) -> dict:
    token = logprob.decoded_token
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode("utf-8"))}


def _chat_choice(completion: CompletionOutput, k: int | None) -> dict:
    return {
        "index": completion.index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": _chat_logprobs(completion, k),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


# --- streaming -----------------------------------------------------------------------------------


@dataclass
class _Sent:
    """How much of one choice has been streamed so far."""

    started: bool = False
    finished: bool = False
    text_offset: int = 0

    def has_news(self, delta: CompletionOutput) -> bool:
        """Whether `delta` has anything to send: text, tokens, or the (first) finish reason."""
        return not self.finished and bool(delta.text or delta.token_ids or delta.finish_reason is not None)


async def _completion_chunks(
    job: _Job, streams: list[RequestStream], echoes: list[_Echo] | None
) -> AsyncIterator[dict]:
    sent: dict[int, _Sent] = {}
    usage = [_Usage() for _ in streams]
    prompt_logprobs: list[list[TokenLogprobs | None]] = [[] for _ in streams]
    k = job.params.logprobs
    async for prompt_index, output in _merged(streams):
        usage[prompt_index].add(output)
        prompt_logprobs[prompt_index] += output.prompt_logprobs or []
        for completion in output.outputs:
            index = job.choice_index(prompt_index, completion)
            state = sent.setdefault(index, _Sent())
            if not state.has_news(completion):
                continue
            first = not state.started
            echo = echoes[prompt_index] if echoes and first else None
            choice = _completion_choice(
                index, completion, k, echo, prompt_logprobs[prompt_index], output.prompt_token_ids, state.text_offset
            )
            if first and job.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_json(prompt_logprobs[prompt_index])
            state.started, state.finished = True, completion.finish_reason is not None
            state.text_offset += len(choice["text"])
            yield job.body([choice], chunk=True)
    if job.include_usage:
        yield job.body([], usage=_usage(usage), chunk=True)


async def _chat_chunks(job: _Job, streams: list[RequestStream]) -> AsyncIterator[dict]:
    role = {"role": "assistant", "content": ""}
    yield job.body(
        [{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(job.params.n)], chunk=True
    )
    sent: dict[int, _Sent] = {}
    usage = _Usage()
    prompt_logprobs: list[TokenLogprobs | None] = []
    async for _, output in _merged(streams):
        usage.add(output)
        prompt_logprobs += output.prompt_logprobs or []
        for completion in output.outputs:
            state = sent.setdefault(completion.index, _Sent())
            if not state.has_news(completion):
                continue
            choice = {
                "index": completion.index,
                "delta": {"content": completion.text},
                "logprobs": _chat_logprobs(completion, job.params.logprobs),
                "finish_reason": completion.finish_reason,
            }
            if not state.started and job.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_json(prompt_logprobs)
            state.started, state.finished = True, completion.finish_reason is not None
            yield job.body([choice], chunk=True)
    if job.include_usage:
        yield job.body([], usage=_usage([usage]), chunk=True)


def _event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_server_sent_events(chunks), media_type="text/event-stream")


async def _server_sent_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except Exception as error:
        # The status line is long gone, so a failure mid-stream is reported in-band.
        logger.exception("stream failed")
        yield _sse(_error_body(f"internal error: {error}", error_type="internal_server_error"))
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
