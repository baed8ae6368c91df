"""Request bodies of every route, and the checks a body passes before the engine sees it.

A value SamplingParams or the engine can judge is judged there, once: the ValueError it raises
becomes a 400 naming the field (`APIError.from_value_error`). What only the server knows is
checked here: its own limits (`ServerLimits`), the model it serves, fields it does not know.

Embeddings travel as {"data": base64 of the raw little-endian bytes, "dtype": "float32" |
"bfloat16" | "float16", "shape": [tokens, hidden]}: never a pickle, whose loading runs code.

Beyond decoding its JSON (which --max-body-mb bounds), a body costs work in proportion to what the
server's limits allow, not to its size: every list in it is counted before any item is looked at.
Lists with a fixed bound (stop strings, stop ids, biases, a shape) are refused while the body is
parsed; token ids, chat messages and a completion's prompts reach the routes unvalidated
(`TokenIds`, `list[Any]`, `Any`), which count them against the limits and then check their items
on the tokenizer pool, never on the engine thread (where it would stall every running request).
Every text is valid Unicode: a typed field is `Text`, and the untyped parts (a completion's prompt,
chat messages) pass `check_unicode` when their items are checked; JSON's "\\ud800" escapes decode
to lone surrogates that no tokenizer, hash or answer could take.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import secrets
import sys
from typing import Annotated, Any

import jinja2
import torch
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError

from kvbank.engine.params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from kvbank.engine.prompts import EMBED_DTYPES
from kvbank.models.loader import same_model
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits
from kvbank.tokenizer import check_unicode

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
    "priority",
)
_PROMPT_SHAPE = "prompt must be a string, a list of token ids, or a non-empty list of either"


def _unicode(value: Any) -> Any:
    # Only a text is looked at: the other types a field may take (token ids, parts) are checked apart.
    if isinstance(value, str):
        check_unicode(value, "the text")
    return value


def _unicode_each(value: Any) -> Any:
    # A text, or the texts of a list or the keys of a dict whose length `_at_most` bounded.
    for item in [value] if isinstance(value, str) else value or ():
        _unicode(item)
    return value


def _at_most(limit: int, unit: str) -> BeforeValidator:
    """Refuses a list or dict of more than `limit` items before pydantic validates any of them."""

    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"has {len(value)} {unit}; at most {limit} are allowed")
        return value

    return BeforeValidator(check)


# On a union it goes outside: pydantic would name the member that failed in the error's field path.
_UNICODE = AfterValidator(_unicode)
#: a body's text, refused unless it is valid Unicode
Text = Annotated[str, _UNICODE]
#: token ids as a body holds them, items unchecked: `checked_token_ids` counts them first
TokenIds = list[Any]
TextOrIds = Annotated[str | TokenIds, _UNICODE]


# --- generation --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """Fields shared by the generation routes; None means "the default"."""

    # Extra fields are kept (not rejected by pydantic) so that `RequestChecks.check` can name them
    # in an OpenAI-shaped error, or in a warning if they are harmless.
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Annotated[str | list[str] | None, _at_most(MAX_STOP_STRINGS, "strings"), AfterValidator(_unicode_each)] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    cache_salt: Text | None = None
    stop_token_ids: Annotated[list[int] | None, _at_most(MAX_STOP_TOKEN_IDS, "ids")] = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    logit_bias: Annotated[
        dict[str, float] | None, _at_most(MAX_LOGIT_BIAS, "entries"), AfterValidator(_unicode_each)
    ] = None
    kv_policy: Text | None = None
    priority: int | None = None
    #: the share of each document's tokens recomputed (server/documents.py); only with documents
    blend_recompute_ratio: float | None = None

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
    # Checked by `completion_prompts` and `check_prompts`, which can say in one sentence what is allowed.
    prompt: Any = None
    #: instead of prompt: {"data": base64 raw little-endian bytes, "dtype", "shape"} or a list of them
    prompt_embeds: Any = None
    logprobs: int | None = None
    echo: bool | None = False
    #: instead of prompt: texts and {"document": text} (server/documents.py)
    segments: Any = None

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """Echoing the prompt with logprobs needs the prompt's logprobs, as many as `logprobs`."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) go through to the chat template untouched.
    model_config = ConfigDict(extra="allow")

    role: Text
    content: Annotated[str | list[TextPart] | None, _UNICODE] = None


class ChatCompletionRequest(SamplingBody):
    #: ChatMessage items, validated by `chat_messages` once it has counted them
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Accepted only in the values that mean "plain text, no tools"; see `unsupported_field`.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Annotated[str | dict[str, Any] | None, _UNICODE] = None
    functions: list[Any] | None = None
    function_call: Annotated[str | dict[str, Any] | None, _UNICODE] = None

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
        self.check_model(body.model)
        _check_extra_fields(body)

    def check_model(self, model: str | None) -> None:
        """Refuse (404) a body for a model this server does not serve."""
        if model is not None and not same_model(model, self.model_name):
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                param="model",
                code="model_not_found",
            )

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


def check_count(count: int, field: str, unit: str, limit: int | None) -> None:
    """Refuse a list of more than the prompt limit's items (--max-prompt-tokens) by its count alone,
    before any item is looked at."""
    if limit is not None and count > limit:
        raise APIError(
            f"{field} has {count} {unit}, over this server's limit of {limit} (--max-prompt-tokens)", param=field
        )


def check_token_range(ids: list, field: str, vocab_size: int) -> list[int]:
    """`ids`, if each is an integer in [0, vocab_size); else APIError naming the first that is not.
    It looks at every id: count them first (`check_count`), and run it off the event loop."""
    for position, token in enumerate(ids):
        if type(token) is not int:
            raise APIError(
                f"{field}[{position}] must be a token id (an integer), not {type(token).__name__}", param=field
            )
        if not 0 <= token < vocab_size:
            raise APIError(f"{field}[{position}]={token} is out of range [0, {vocab_size})", param=field)
    return ids


async def checked_token_ids(async_engine: AsyncEngine, ids: list, field: str) -> list[int]:
    """`ids` counted against the server's prompt limit, then checked against the model's vocabulary
    on the tokenizer pool; APIError 400 naming `field` otherwise."""
    check_count(len(ids), field, "tokens", async_engine.max_prompt_tokens)
    vocab_size = async_engine.info.model_config.vocab_size
    return await async_engine.run_tokenizer(check_token_range, ids, field, vocab_size)


def checked_text(text: str, field: str) -> str:
    """`text`, if it is valid Unicode; else APIError 400 naming `field`."""
    try:
        return check_unicode(text, field)
    except ValueError as error:
        raise APIError(str(error), param=field) from None


def completion_prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions body told apart by shape alone (one string or token-id list, or a
    non-empty list of them), so that they are counted before `check_prompts` looks into each."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise APIError(_PROMPT_SHAPE, param="prompt")


def _is_token_list(value: Any) -> bool:
    # By its first item: `check_prompts` refuses a list whose other items are not token ids.
    return isinstance(value, list) and bool(value) and type(value[0]) is int


def check_prompts(prompts: list[Any], limit: int | None, vocab_size: int) -> list[PromptInput]:
    """The prompts of `completion_prompts`, each valid Unicode text or at most `limit` token ids of the
    vocabulary; APIError 400 naming the prompt otherwise. It looks at every item: run it off the event loop."""
    return [
        _check_prompt(prompt, "prompt" if len(prompts) == 1 else f"prompt.{i}", limit, vocab_size)
        for i, prompt in enumerate(prompts)
    ]


def _check_prompt(prompt: Any, field: str, limit: int | None, vocab_size: int) -> PromptInput:
    if isinstance(prompt, str):
        return checked_text(prompt, field)
    if not isinstance(prompt, list) or not prompt:
        raise APIError(_PROMPT_SHAPE, param="prompt")
    check_count(len(prompt), field, "tokens", limit)
    return check_token_range(prompt, field, vocab_size)


def with_salt(prompt: PromptInput | dict, cache_salt: str | None, tenant: str | None = None) -> PromptInput | dict:
    """The prompt as the engine takes it with `cache_salt` and the scheduler's `tenant` (a prompt dict),
    or as it is without either."""
    keys = {name: value for name, value in (("cache_salt", cache_salt), ("tenant", tenant)) if value is not None}
    if not keys:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, **keys}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, **keys}


def tenant_of(cache_salt: str | None) -> str:
    """The tenant a request belongs to, by its `cache_salt`: "default" without one, else a digest of
    the salt, safe in a path and in logs (the salt itself is never kept by the server's routes)."""
    if cache_salt is None:
        return DEFAULT_TENANT
    return "tenant-" + hashlib.sha256(b"kvbank tenant\0" + cache_salt.encode()).hexdigest()[:32]


def chat_messages(async_engine: AsyncEngine, messages: list[Any], documents: Documents | None = None) -> list[dict]:
    """`template_messages`, once the messages (and their content parts in all) are counted against the
    prompt limit, refused if their texts' byte count alone proves them over it (before the template
    and the tokenizer spend time on them). It validates every message: run it off the event loop."""
    limit = async_engine.max_prompt_tokens
    check_count(len(messages), "messages", "messages", limit)
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    check_count(parts, "messages", "content parts in all", limit)
    rendered = template_messages(messages, documents)
    try:
        async_engine.check_text_length([m["content"] for m in rendered if isinstance(m.get("content"), str)])
    except ValueError as error:
        raise APIError(str(error), param="messages") from error
    return rendered


def render_chat(async_engine: AsyncEngine, messages: list[Any], add_generation_prompt: bool) -> list[int]:
    """The token ids of `messages` (see `chat_messages`) rendered by the model's chat template; APIError
    400 for what the template refuses. Run it off the event loop."""
    tokenizer = async_engine.info.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    rendered = chat_messages(async_engine, messages)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=True)
    except (ValueError, jinja2.TemplateError) as error:
        raise APIError(f"cannot render the chat template: {error}", param="messages") from error


class Documents:
    """The document parts of a chat's messages ({"type": "document", "text": ...}), each written
    into the message's text as a mark the rendered prompt is cut at (server/documents.py): a
    private-use character pair around a nonce of this rendering and the document's index, which
    no message's text can forge."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.nonce = secrets.token_hex(8)

    def mark(self, text: str) -> str:
        self.texts.append(text)
        return f"\ue000{self.nonce}:{len(self.texts) - 1}\ue001"

    @property
    def pattern(self) -> str:
        return f"\ue000{self.nonce}:(\\d+)\ue001"


def template_messages(messages: list[Any], documents: Documents | None = None) -> list[dict]:
    """The messages (`ChatMessage` items) as the chat template sees them; raises APIError for a role
    or content it must not see, or text that is not valid Unicode. Document parts are allowed where
    `documents` collects them. It validates every message: count them first (as `chat_messages`
    does), and run it off the event loop."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    return [_template_message(i, _chat_message(i, m), documents) for i, m in enumerate(messages)]


def _chat_message(position: int, item: Any) -> ChatMessage:
    try:
        return ChatMessage.model_validate(item)
    except ValidationError as error:
        # Answered as the rest of the body's validation errors are (`errors.install_error_handlers`).
        problems = [{**p, "loc": ("body", "messages", position, *p["loc"])} for p in error.errors()]
        raise RequestValidationError(problems) from None


def _template_message(position: int, message: ChatMessage, documents: Documents | None) -> dict:
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
    for key, value in (message.model_extra or {}).items():
        _check_json_text(value, f"messages.{position}.{key}")
    rendered = message.model_dump(exclude_none=True)
    # Chat templates know "system"; OpenAI's "developer" role is its newer name.
    rendered["role"] = "system" if message.role == "developer" else message.role
    rendered["content"] = _message_text(position, message.content, documents)
    return rendered


def _message_text(position: int, content: str | list[TextPart] | None, documents: Documents | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = ("text", "document") if documents is not None else ("text",)
    for part in content:
        if part.type not in kinds or part.text is None:
            raise APIError(
                f"content part of type {part.type!r} is not supported; only {' and '.join(kinds)} parts "
                "with a text are",
                param=f"messages.{position}.content",
            )
    return "\n".join(documents.mark(part.text) if part.type == "document" else part.text for part in content)


def _check_json_text(value: Any, field: str) -> None:
    """Refuse a string that is not valid Unicode anywhere in `value` (keys too): a message's extra
    keys go to the chat template as they are. A loop, not recursion: a body may nest about as deep
    as Python's recursion limit."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            checked_text(item, field)
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item


# --- embeddings --------------------------------------------------------------------------------


class EmbedsBody(BaseModel):
    """Embedding rows as raw little-endian bytes (base64), their dtype and shape."""

    model_config = ConfigDict(extra="forbid")

    data: Text
    dtype: Text
    shape: Annotated[list[int], _at_most(2, "dimensions")]


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

    session: Text
    prompt: TextOrIds | None = None
    prompt_token_ids: TokenIds | None = None
    #: ChatMessage items (see `ChatCompletionRequest.messages`)
    messages: list[Any] | None = None
    cache_salt: Text | None = None


class SessionRestoreRequest(BaseModel):
    """`POST /v1/sessions/restore`."""

    model_config = ConfigDict(extra="forbid")

    session: Text
    cache_salt: Text | None = None


class SessionDeleteRequest(SessionRestoreRequest):
    """`POST /v1/sessions/delete`: the tenant's own session of that name."""


class StreamOpenRequest(BaseModel):
    """`POST /v1/streams`; without a policy the stream keeps what the engine's default keeps."""

    model_config = ConfigDict(extra="forbid")

    system: TextOrIds
    policy: Text | None = None
    cache_salt: Text | None = None
    separator: Text = "\n"
    chat: bool = True
    #: the most tokens the stream holds at once, promised to it in the KV pool when it opens
    reserve_tokens: int | None = None


class FrameRequestBody(BaseModel):
    """`POST /v1/streams/{id}/frames`: one of text, token_ids or prompt_embeds."""

    model_config = ConfigDict(extra="forbid")

    text: Text | None = None
    token_ids: TokenIds | None = None
    prompt_embeds: EmbedsBody | None = None
    skip_repeat: bool = False
    #: the stream's tenant: the cache_salt it was opened with
    cache_salt: Text | None = None


class AskRequest(SamplingBody):
    """`POST /v1/streams/{id}/ask`: a question and the sampling fields of a completion; `cache_salt`
    names the stream's tenant (the salt it was opened with)."""

    question: TextOrIds
    logprobs: int | None = None
    #: evicted frames to bring back from the stream's tier before answering
    recall: int = 0
