"""`/v1/models`, `/v1/completions` and `/v1/chat/completions`: OpenAI's generation routes.

Sampling extras that vLLM accepts (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, prompt_logprobs, cache_salt) are
accepted too, and `prompt_logprobs` come back per choice as vLLM returns them.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbank.defaults import COMPLETIONS_MAX_TOKENS
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import AsyncEngine, RequestStream, final_outputs
from kvbank.server.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbedsBody,
    PromptInput,
    RequestChecks,
    check_prompts,
    completion_prompts,
    decode_embeds,
    tenant_of,
    with_salt,
)
from kvbank.server.documents import chat_prompt, completion_segments, with_ratio
from kvbank.server.errors import APIError, key_tenant
from kvbank.server.limits import ServerLimits
from kvbank.server.responses import (
    Echo,
    Job,
    Usage,
    chat_choice,
    chat_chunks,
    completion_choice,
    completion_chunks,
    event_stream,
    prompt_logprobs_json,
    unless_disconnected,
    usage_json,
)
from kvbank.tokenizer import Tokenizer


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


def scheduling_tenant(request: Request, cache_salt: str | None) -> str | None:
    """Whom the scheduler shares prefill among for `request`: its API key's tenant, and within it the
    tenant of its `cache_salt` (one key may serve many salted tenants). None on a server without
    keys: the engine then goes by the salt alone."""
    key = key_tenant(request)
    return None if key is None else f"{key}/{tenant_of(cache_salt)}"


class Completions:
    """The generation routes' work, over one engine served as one model name."""

    def __init__(self, async_engine: AsyncEngine, checks: RequestChecks, limits: ServerLimits) -> None:
        self.async_engine = async_engine
        self.engine_info = async_engine.info
        self.checks = checks
        self.limits = limits
        self.model_name = checks.model_name
        self.created = int(time.time())

    def model_list(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvbank",
            "root": self.model_name,  # never a filesystem path: it tells a client nothing it needs
            "max_model_len": self.engine_info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.checks.check(body)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_MAX_TOKENS
        params = self.checks.sampling_params(
            body, self.checks.max_tokens(max_tokens, "max_tokens"), body.logprobs, body.effective_prompt_logprobs
        )
        inputs = await self._completion_inputs(body, params.n)
        job = Job("cmpl", "text_completion", "text_completion", self.model_name, params, body.include_usage)
        echoes = [await self._echo(p) for p in inputs] if body.echo else None
        prompts = [with_ratio(p, body.blend_recompute_ratio) for p in inputs]
        tenant = scheduling_tenant(request, body.cache_salt)
        streams = await self._start([with_salt(p, body.cache_salt, tenant) for p in prompts], params, job.id)
        if body.stream:
            return event_stream(completion_chunks(job, streams, echoes))
        finals = await unless_disconnected(request, final_outputs(streams))
        choices = []
        for i, output in enumerate(finals):
            echo = echoes[i] if echoes else None
            for c in output.outputs:
                choice = completion_choice(
                    job.choice_index(i, c), c, params.logprobs, echo, output.prompt_logprobs, output.prompt_token_ids
                )
                choices.append({**choice, "prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs)})
        return JSONResponse(job.body(choices, usage=usage_json([Usage().add(o) for o in finals])))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.checks.check(body)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise APIError(
                f"{unsupported} is not supported by this server: it answers in plain text and calls no tools",
                param=unsupported,
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.checks.max_tokens(getattr(body, field), field)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.checks.sampling_params(body, max_tokens, logprobs, body.prompt_logprobs)
        self._check_prompt_count(1, params.n)
        rendered = await self.async_engine.run_tokenizer(chat_prompt, self.async_engine, body.messages)
        rendered = with_ratio(rendered, body.blend_recompute_ratio)
        prompt = with_salt(rendered, body.cache_salt, scheduling_tenant(request, body.cache_salt))
        job = Job("chatcmpl", "chat.completion", "chat.completion.chunk", self.model_name, params, body.include_usage)
        streams = await self._start([prompt], params, job.id)
        if body.stream:
            return event_stream(chat_chunks(job, streams))
        finals = await unless_disconnected(request, final_outputs(streams))
        prompt_logprobs = prompt_logprobs_json(finals[0].prompt_logprobs)
        choices = [{**chat_choice(c, logprobs), "prompt_logprobs": prompt_logprobs} for c in finals[0].outputs]
        return JSONResponse(job.body(choices, usage=usage_json([Usage().add(o) for o in finals])))

    async def _completion_inputs(self, body: CompletionRequest, n: int) -> list[Any]:
        """The prompts of a completions body: text or token ids, or embeddings given as raw bytes;
        counted first, then checked one by one off the event loop."""
        if body.segments is not None:
            if body.prompt not in (None, "", []) or body.prompt_embeds is not None:
                raise APIError("give segments alone, not with prompt or prompt_embeds", param="segments")
            self._check_prompt_count(1, n)
            return [await self.async_engine.run_tokenizer(completion_segments, self.async_engine, body.segments)]
        if body.prompt_embeds is None:
            prompts = completion_prompts(body.prompt)
            self._check_prompt_count(len(prompts), n)
            limit, vocab_size = self.async_engine.max_prompt_tokens, self.engine_info.model_config.vocab_size
            return await self.async_engine.run_tokenizer(check_prompts, prompts, limit, vocab_size)
        if body.prompt not in (None, "", []):
            raise APIError("give prompt or prompt_embeds, not both", param="prompt_embeds")
        if body.echo:
            raise APIError("echo cannot show prompt_embeds: they have no text", param="echo")
        items = body.prompt_embeds if isinstance(body.prompt_embeds, list) else [body.prompt_embeds]
        if not items:
            raise APIError("prompt_embeds must not be an empty list", param="prompt_embeds")
        self._check_prompt_count(len(items), n)
        hidden, limit = self.engine_info.model_config.hidden_size, self.engine_info.max_model_len
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

    async def _echo(self, prompt: PromptInput | dict) -> Echo:
        """The prompt as `echo` shows it (token ids, checked against the vocabulary already, are decoded
        off the event loop)."""
        tokenizer = self.engine_info.tokenizer
        if tokenizer is None:
            raise APIError("echo needs a tokenizer, and this model has none", param="echo")
        if isinstance(prompt, dict):  # segments: their token ids in order
            prompt = [t for part in prompt["segments"] for t in (part["document"] if isinstance(part, dict) else part)]
        text = prompt if isinstance(prompt, str) else await self.async_engine.run_tokenizer(tokenizer.decode, prompt)
        return Echo(text, tokenizer.token_text)

    def _check_prompt_count(self, count: int, n: int) -> None:
        """Refuse more prompts, or prompts x n sequences, than one request may start, by the count alone."""
        limit = self.limits.max_queued_requests
        if limit is not None and count > limit:
            raise APIError(
                f"{count} prompts in one request can never fit in this server's queue of {limit} "
                "(--max-queued-requests); send fewer prompts per request",
                param="prompt",
            )
        choices, max_choices = count * n, self.limits.max_choices
        if max_choices is not None and choices > max_choices:
            raise APIError(
                f"{count} prompts x n={n} would start {choices} sequences, over this server's "
                f"limit of {max_choices} per request (--max-choices)",
                param="n",
            )

    async def _start(self, prompts: list[Any], params: SamplingParams, job_id: str) -> list[RequestStream]:
        """Submit every prompt (counted by `_check_prompt_count`); if the engine refuses one, abort those
        already accepted."""
        self.async_engine.admit(len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.async_engine.add_request(prompt, params, f"{job_id}-{i}"))
        except ValueError as error:
            which = f"prompt {len(streams)}: " if len(prompts) > 1 else ""
            raise APIError.from_value_error(error, which) from error
        finally:
            if len(streams) < len(prompts):
                for stream in streams:
                    stream.close()
        return streams


def install_completions(app: FastAPI, completions: Completions) -> None:
    """The /v1/models, /v1/completions and /v1/chat/completions routes."""

    @app.get("/v1/models")
    async def models() -> dict:
        return completions.model_list()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.completions(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await completions.chat_completions(body, request)
