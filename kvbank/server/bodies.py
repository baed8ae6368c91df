"""Request bodies of every route, and the checks a body passes before the engine sees it.

A value SamplingParams or the engine can judge is judged there, once: the ValueError it raises
becomes a 400 naming the field (`APIError.from_value_error`). What only the server knows is
checked here: its own limits (`ServerLimits`), the model it serves, fields it does not know.

Embeddings travel as {"data": base64 of the raw little-endian bytes, "dtype": "float32" |
"bfloat16" | "float16", "shape": [tokens, hidden]}: never a pickle, whose loading runs code.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import sys
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from kvbank.engine.params import SamplingParams
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits

logger = logging.getLogger("kvbank.server")

PromptInput = str | list[int]
#: unknown request fields that are ignored (with a warning) because they cannot change the answer
HARMLESS_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})
#: SGLang's extensions with the values sglang-router writes into every request it forwards: at
#: these values they change nothing here and are ignored silently; any other value is refused
ROUTER_DEFAULTS = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
CHAT_ROLES = ("system", "developer", "user", "assistant")
#: the tenant of requests without a cache_salt
DEFAULT_TENANT = "default"
EMBED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAMPLING_FIELDS = (
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


# --- generation --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """Fields shared by the generation routes; None means "the default"."""

    # Extra fields are kept (not rejected by pydantic) so that `RequestChecks.check` can name them
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

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets; OpenAI's string token ids in `logit_bias` become
        ints, and keys that are not ids are left for SamplingParams to refuse by name."""
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias:
            fields["logit_bias"] = {_token_id(key): bias for key, bias in self.logit_bias.items()}
        return fields


def _token_id(key: str) -> int | str:
    return int(key) if key.isascii() and key.isdigit() else key


class CompletionRequest(SamplingBody):
    # Checked by `completion_prompts`, which can say in one sentence what is allowed.
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


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Accepted only in the values that mean "plain text, no tools"; see `unsupported_field`.
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


class RequestChecks:
    """What a generation body is checked against: this server's limits, its model and vocabulary."""

    def __init__(self, limits: ServerLimits, model_name: str, vocab_size: int) -> None:
        self.limits = limits
        self.model_name = model_name
        self.vocab_size = vocab_size

    def check(self, body: SamplingBody) -> None:
        """Refuse a body over `max_n`, for another model, or with a field this server does not know."""
        max_n = self.limits.max_n
        if max_n is not None and body.n is not None and body.n > max_n:
            raise APIError(f"n={body.n} is over this server's limit of {max_n} (--max-n)", param="n")
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )
        _check_extra_fields(body)

    def max_tokens(self, max_tokens: int | None, field: str) -> int | None:
        """`max_tokens` within `max_tokens_cap`, which is also the default when none is given."""
        cap = self.limits.max_tokens_cap
        if cap is None:
            return max_tokens
        if max_tokens is None:
            return cap
        if max_tokens > cap:
            raise APIError(f"{field}={max_tokens} is over this server's limit of {cap} (--max-tokens-cap)", param=field)
        return max_tokens

    def sampling_params(
        self, body: SamplingBody, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams for `body`, its token ids checked against the vocabulary; a value
        SamplingParams refuses is an APIError 400 naming the field."""
        try:
            params = SamplingParams(
                **body.sampling_fields(), max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )
            params.check_token_ids(self.vocab_size)
        except ValueError as error:
            raise APIError.from_value_error(error) from error
        return params


def _check_extra_fields(body: SamplingBody) -> None:
    """Refuse fields this server does not know; only `HARMLESS_FIELDS` are ignored, with a warning."""
    extra = {k: v for k, v in (body.model_extra or {}).items() if ROUTER_DEFAULTS.get(k, ...) is not v}
    unknown = set(extra) - HARMLESS_FIELDS
    if unknown:
        raise APIError(f"unsupported request field(s): {', '.join(sorted(unknown))}", param=min(unknown))
    if extra:
        logger.warning("ignoring request fields that cannot change the answer: %s", ", ".join(sorted(extra)))


def completion_prompts(prompt: Any) -> list[PromptInput]:
    """The prompts of a completions body: one string or token-id list, or a non-empty list of them."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return prompt
    raise APIError("prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def with_salt(prompt: PromptInput | dict, cache_salt: str | None) -> PromptInput | dict:
    """The prompt as the engine takes it with `cache_salt` (a prompt dict), or as it is without one."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": cache_salt}


def tenant_of(cache_salt: str | None) -> str:
    """The tenant a request belongs to, by its `cache_salt`: "default" without one, else a digest of
    the salt, safe in a path and in logs (the salt itself is never kept by the server's routes)."""
    if cache_salt is None:
        return DEFAULT_TENANT
    return "tenant-" + hashlib.sha256(b"kvbank tenant\0" + cache_salt.encode()).hexdigest()[:32]


def template_messages(messages: list[ChatMessage]) -> list[dict]:
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


# --- embeddings --------------------------------------------------------------------------------


class EmbedsBody(BaseModel):
    """Embedding rows as raw little-endian bytes (base64), their dtype and shape."""

    model_config = ConfigDict(extra="forbid")

    data: str
    dtype: str
    shape: list[int]


def decode_embeds(body: EmbedsBody, hidden_size: int, max_tokens: int, param: str = "prompt_embeds") -> torch.Tensor:
    """The tensor `body` describes; APIError 400 naming what is wrong (the bytes are checked against
    the shape before any decoding, so a huge shape cannot make the server allocate for it)."""
    dtype = EMBED_DTYPES.get(body.dtype)
    if dtype is None:
        raise APIError(f"{param}.dtype={body.dtype!r} must be one of {', '.join(EMBED_DTYPES)}", param=f"{param}.dtype")
    if len(body.shape) != 2 or body.shape[1] != hidden_size or not 1 <= body.shape[0] <= max_tokens:
        raise APIError(
            f"{param}.shape={body.shape} must be [tokens, {hidden_size}] with 1 <= tokens <= {max_tokens}",
            param=f"{param}.shape",
        )
    expected = body.shape[0] * body.shape[1] * dtype.itemsize
    if len(body.data) > 4 * (expected // 3 + 3):
        raise APIError(f"{param}.data holds more than the {expected} bytes its shape needs", param=f"{param}.data")
    try:
        raw = base64.b64decode(body.data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{param}.data is not valid base64", param=f"{param}.data") from None
    if len(raw) != expected:
        raise APIError(
            f"{param}.data holds {len(raw)} bytes; shape {body.shape} in {body.dtype} needs {expected}",
            param=f"{param}.data",
        )
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).view(body.shape)
    if sys.byteorder != "little":
        tensor = tensor.view(torch.uint8).view(-1, dtype.itemsize).flip(1).contiguous().view(dtype).view(body.shape)
    if not bool(torch.isfinite(tensor).all()):
        raise APIError(f"{param} holds NaN or infinite values", param=f"{param}.data")
    return tensor


# --- sessions and streams ----------------------------------------------------------------------


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


class SessionDeleteRequest(SessionRestoreRequest):
    """`POST /v1/sessions/delete`: the tenant's own session of that name."""


class StreamOpenRequest(BaseModel):
    """`POST /v1/streams`; without a policy the stream keeps what the engine's default keeps."""

    model_config = ConfigDict(extra="forbid")

    system: str | list[int]
    policy: str | None = None
    cache_salt: str | None = None
    separator: str = "\n"
    chat: bool = True
    #: the most tokens the stream holds at once, promised to it in the KV pool when it opens
    reserve_tokens: int | None = None


class FrameRequestBody(BaseModel):
    """`POST /v1/streams/{id}/frames`: one of text, token_ids or prompt_embeds."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    token_ids: list[int] | None = None
    prompt_embeds: EmbedsBody | None = None
    skip_repeat: bool = False
    #: the stream's tenant: the cache_salt it was opened with
    cache_salt: str | None = None


class AskRequest(SamplingBody):
    """`POST /v1/streams/{id}/ask`: a question and the sampling fields of a completion; `cache_salt`
    names the stream's tenant (the salt it was opened with)."""

    question: str | list[int]
    logprobs: int | None = None
    #: evicted frames to bring back from the stream's tier before answering
    recall: int = 0
