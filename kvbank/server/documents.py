"""Documents in HTTP requests (engine/blend.py): how a body marks them, and the warm-up route.

    /v1/completions        "segments" instead of "prompt": texts and {"document": text}, in order
    /v1/chat/completions   content parts {"type": "document", "text": ...} in any message: the chat
                           template renders the conversation with each document marked, and the
                           prompt is cut at the marks; with --blend-separator, a conversation
                           without document parts is cut where its rendered text holds the separator
    both                   "blend_recompute_ratio" (0 to 1) overrides --blend-recompute-ratio for
                           the request; refused for a prompt that marks no document
    POST /v1/documents     {"documents": [text, ...], "cache_salt"}: compute and cache each document
                           now, so the first prompt that holds it reuses it

An unmodified `openai` client sends all of these: `segments` and `blend_recompute_ratio` through
`extra_body`, document parts as they are (it does not check a content part's type). A document is
its tokens, the model and the `cache_salt`: one tenant's documents are never another's.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from kvbank.engine.blend_plan import rendered_prompt, tokenized_segments
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.bodies import Documents, RequestChecks, Text, chat_messages, check_count, checked_text
from kvbank.server.errors import APIError

_SEGMENT_SHAPE = "segments must be a non-empty list of texts and {'document': text} objects"


def completion_segments(async_engine: AsyncEngine, segments: Any) -> dict:
    """A completions body's `segments` as the engine's prompt, tokenized one by one; APIError 400
    naming the segment that is not a text or {"document": text}. Run it off the event loop."""
    if not isinstance(segments, list) or not segments:
        raise APIError(_SEGMENT_SHAPE, param="segments")
    check_count(len(segments), "segments", "segments", async_engine.max_prompt_tokens)
    texts = []
    for i, segment in enumerate(segments):
        text = segment.get("document") if isinstance(segment, dict) and set(segment) == {"document"} else segment
        if not isinstance(text, str):
            raise APIError(f"segments[{i}] is not a text or {{'document': text}}; {_SEGMENT_SHAPE}", param="segments")
        texts.append(checked_text(text, f"segments.{i}"))
    try:
        async_engine.check_text_length(texts, "segments")
    except ValueError as error:
        raise APIError(str(error), param="segments") from error
    return {"segments": tokenized_segments(segments, async_engine.info.tokenizer.encode)}


def chat_prompt(async_engine: AsyncEngine, messages: list[Any]) -> list[int] | dict:
    """The prompt of a chat's `messages` rendered by the model's chat template: token ids, or
    segments where document parts (or the server's separator) mark documents. Run it off the event loop."""
    tokenizer = async_engine.info.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    documents = Documents()
    rendered = chat_messages(async_engine, messages, documents)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except ValueError as error:
        raise APIError(f"cannot render the chat template: {error}", param="messages") from error
    if not documents.texts:
        return rendered_prompt(text, async_engine.info.config.blend_separator, tokenizer.encode)
    pieces = re.split(documents.pattern, text)
    if [int(i) for i in pieces[1::2]] != list(range(len(documents.texts))):
        raise APIError(
            "the chat template did not keep each document part once and in order, so the documents "
            "cannot be told apart in the prompt",
            param="messages",
        )
    segments: list = [pieces[0]]
    for index, after in zip(pieces[1::2], pieces[2::2]):
        segments += [{"document": documents.texts[int(index)]}, after]
    return {"segments": tokenized_segments(segments, tokenizer.encode, special=False)}


def with_ratio(prompt: Any, ratio: float | None) -> Any:
    """`prompt` as a dict with the request's `blend_recompute_ratio` (the engine refuses it for a
    prompt that marks no document), or as it is without one."""
    if ratio is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "blend_recompute_ratio": ratio}
    return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "blend_recompute_ratio": ratio}


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    #: texts, counted against --max-prompt-tokens and checked before any is tokenized
    documents: list[Any]
    cache_salt: Text | None = None


def install_documents(app: FastAPI, async_engine: AsyncEngine, checks: RequestChecks) -> None:
    """POST /v1/documents: the warm-up."""

    @app.post("/v1/documents")
    async def precompute(body: DocumentsRequest) -> dict:
        checks.check_model(body.model)
        if not body.documents:
            raise APIError("documents must be a non-empty list of texts", param="documents")
        check_count(len(body.documents), "documents", "documents", async_engine.max_prompt_tokens)
        for i, text in enumerate(body.documents):
            if not isinstance(text, str):
                raise APIError(f"documents[{i}] must be a text", param="documents")
            checked_text(text, f"documents.{i}")
        try:
            async_engine.check_text_length(body.documents, "documents")
        except ValueError as error:
            raise APIError(str(error), param="documents") from error
        encode = async_engine.info.tokenizer.encode
        ids = await async_engine.run_tokenizer(lambda: [encode(t, add_special_tokens=False) for t in body.documents])
        try:
            counts = await async_engine.call(lambda engine: engine.precompute_documents(ids, body.cache_salt), True)
        except ValueError as error:
            raise APIError.from_value_error(error) from error
        return {"object": "documents", **counts}
