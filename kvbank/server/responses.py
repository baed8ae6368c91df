"""OpenAI's response shapes: completion and chat choices, logprobs, usage, streamed chunks as
server-sent events, and answering only while the client still listens."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvbank.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import RequestStream, merged
from kvbank.server.errors import APIError, error_body, internal_error_message

logger = logging.getLogger("kvbank.server")

T = TypeVar("T")


@dataclass
class Job:
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
        """Choices are numbered prompt by prompt, `n` to a prompt."""
        return prompt_index * self.params.n + completion.index

    def body(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        """The response (or, with `chunk`, one streamed chunk) holding `choices`."""
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
class Echo:
    """A completions prompt as `echo` shows it: its text, and how to name a token that has no
    logprob entry to take its text from (the prompt's first)."""

    text: str
    token_text: Callable[[int], str]


@dataclass
class Usage:
    """Token counts of one request, added up from its deltas."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> Usage:
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        return self


def usage_json(counts: list[Usage]) -> dict:
    """OpenAI's usage object over several requests' counts."""
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


def completion_choice(
    index: int,
    completion: CompletionOutput,
    k: int | None,
    echo: Echo | None,
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


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
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


def chat_choice(completion: CompletionOutput, k: int | None) -> dict:
    """One chat choice, with the top-`k` logprobs of its tokens when `k` is given."""
    return {
        "index": completion.index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": _chat_logprobs(completion, k),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


# --- streaming ---------------------------------------------------------------------------------


@dataclass
class _Sent:
    """How much of one choice has been streamed so far."""

    started: bool = False
    finished: bool = False
    text_offset: int = 0

    def has_news(self, delta: CompletionOutput) -> bool:
        """Whether `delta` has anything to send: text, tokens, or the (first) finish reason."""
        return not self.finished and bool(delta.text or delta.token_ids or delta.finish_reason is not None)


async def completion_chunks(job: Job, streams: list[RequestStream], echoes: list[Echo] | None) -> AsyncIterator[dict]:
    """The chunks of a streamed completion over `streams` (one per prompt)."""
    sent: dict[int, _Sent] = {}
    usage = [Usage() for _ in streams]
    prompt_logprobs: list[list[TokenLogprobs | None]] = [[] for _ in streams]
    k = job.params.logprobs
    async for prompt_index, output in merged(streams):
        usage[prompt_index].add(output)
        prompt_logprobs[prompt_index] += output.prompt_logprobs or []
        for completion in output.outputs:
            index = job.choice_index(prompt_index, completion)
            state = sent.setdefault(index, _Sent())
            if not state.has_news(completion):
                continue
            first = not state.started
            echo = echoes[prompt_index] if echoes and first else None
            choice = completion_choice(
                index, completion, k, echo, prompt_logprobs[prompt_index], output.prompt_token_ids, state.text_offset
            )
            if first and job.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs[prompt_index])
            state.started, state.finished = True, completion.finish_reason is not None
            state.text_offset += len(choice["text"])
            yield job.body([choice], chunk=True)
    if job.include_usage:
        yield job.body([], usage=usage_json(usage), chunk=True)


async def chat_chunks(job: Job, streams: list[RequestStream]) -> AsyncIterator[dict]:
    """The chunks of a streamed chat completion: the role first, then each choice's text."""
    role = {"role": "assistant", "content": ""}
    yield job.body(
        [{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(job.params.n)], chunk=True
    )
    sent: dict[int, _Sent] = {}
    usage = Usage()
    prompt_logprobs: list[TokenLogprobs | None] = []
    async for _, output in merged(streams):
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
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs)
            state.started, state.finished = True, completion.finish_reason is not None
            yield job.body([choice], chunk=True)
    if job.include_usage:
        yield job.body([], usage=usage_json([usage]), chunk=True)


def event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """`chunks` as server-sent events, ended by `data: [DONE]`."""
    return StreamingResponse(_server_sent_events(chunks), media_type="text/event-stream")


async def _server_sent_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except Exception as error:
        # The status line is long gone, so a failure mid-stream is reported in-band, generically:
        # the details (which may be another request's) stay in the log.
        yield _sse(error_body(internal_error_message(error), error_type="internal_server_error"))
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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
