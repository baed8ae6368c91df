"""What a prompt may be (text, token ids, or a dict with a tenant's cache salt) and its validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbank.config import check_ratio
from kvbank.engine.blend_plan import Document, segment_prompt
from kvbank.tokenizer import Tokenizer, check_unicode

PromptType = str | list[int] | dict[str, Any]

_PROMPT_KEYS = {
    "prompt", "prompt_token_ids", "prompt_embeds", "segments", "blend_recompute_ratio", "cache_salt", "tenant",
}  # fmt: skip
#: longest tenant a prompt may name (the scheduler keeps one entry per waiting tenant)
MAX_TENANT_CHARS = 256
#: dtypes accepted for embeddings, by the names the HTTP API takes; they are computed in the model's dtype
EMBED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the token id standing for each embedding row in a sequence's token ids (as vLLM does)
EMBED_PLACEHOLDER = 0


@dataclass(slots=True)
class ParsedPrompt:
    """A prompt as the engine runs it: token ids, the text if it came as text, the cache salt."""

    text: str | None
    token_ids: list[int]
    salt: str | None
    #: the prompt as embedding rows, when given so (`token_ids` are then placeholders)
    embeds: torch.Tensor | None = None
    #: whom the scheduler shares prefill among: the prompt's "tenant", else its cache salt
    tenant: str | None = None
    #: documents marked in the prompt (engine/blend.py): their spans, and the share recomputed (None:
    #: the engine's); None when it marks none
    documents: list[Document] | None = None
    blend_ratio: float | None = None


def check_embeds(embeds: Any, hidden_size: int, name: str = "prompt_embeds") -> torch.Tensor:
    """`embeds` as a [tokens, hidden_size] float tensor on the CPU; ValueError naming what is wrong."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [tokens, {hidden_size}], not {type(embeds).__name__}")
    if embeds.dtype not in EMBED_DTYPES.values():
        allowed = ", ".join(EMBED_DTYPES)
        raise ValueError(f"{name} has dtype {str(embeds.dtype).removeprefix('torch.')}; allowed: {allowed}")
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise ValueError(f"{name} has shape {list(embeds.shape)}; the model takes [tokens, {hidden_size}]")
    if embeds.shape[0] == 0:
        raise ValueError(f"{name} is empty: it must have at least one row")
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    return embeds.detach().cpu()


def parse_prompt(
    prompt: PromptType,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    hidden_size: int | None = None,
    tenant: bool = False,
) -> ParsedPrompt:
    """Token ids of `prompt`, checked against the vocabulary; raises ValueError naming what is wrong.

    A dict takes "prompt" (text), "prompt_token_ids", "prompt_embeds" (a [tokens, hidden_size]
    float tensor, when `hidden_size` is given) or "segments" (texts, token id lists and
    {"document": ...} parts, with "blend_recompute_ratio" optionally: engine/blend.py), and
    optionally "cache_salt" and, where `tenant` allows it (what is scheduled as a request of its
    own), "tenant"; when it has text and ids, the ids are what runs and the text is kept for display.
    """
    salt = owner = None
    text = None
    if isinstance(prompt, dict):
        allowed = set(_PROMPT_KEYS)
        if hidden_size is None:
            allowed.discard("prompt_embeds")
        if not tenant:
            allowed.discard("tenant")
        unknown = set(prompt) - allowed
        if unknown:
            raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt={salt!r} must be a string")
        if salt is not None:
            check_unicode(salt, "cache_salt")  # it is hashed as UTF-8 into every block's key
        owner = check_tenant(prompt.get("tenant"))
        if owner is None:
            owner = salt
        if "segments" in prompt or "blend_recompute_ratio" in prompt:
            return _segmented(prompt, tokenizer, vocab_size, salt, owner)
        if "prompt_embeds" in prompt:
            if "prompt_token_ids" in prompt or prompt.get("prompt") is not None:
                raise ValueError("give prompt_embeds alone, not with prompt or prompt_token_ids")
            embeds = check_embeds(prompt["prompt_embeds"], hidden_size)
            return ParsedPrompt(None, [EMBED_PLACEHOLDER] * embeds.shape[0], salt, embeds, owner)
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            prompt = prompt["prompt_token_ids"]
        else:
            prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        text, token_ids = check_unicode(prompt, "prompt"), tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")
    _check_ids(token_ids, vocab_size)
    return ParsedPrompt(text, token_ids, salt, tenant=owner)


def _check_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise ValueError("prompt is empty: it must have at least one token")
    # min and max run in C, and a server parses every prompt on its engine thread.
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is out of range [0, {vocab_size})")


def _segmented(
    prompt: dict, tokenizer: Tokenizer | None, vocab_size: int, salt: str | None, owner: str | None
) -> ParsedPrompt:
    """A prompt given as segments (documents marked among them)."""
    if "segments" not in prompt:
        raise ValueError("blend_recompute_ratio is given with segments, which this prompt has none of")
    others = sorted({"prompt", "prompt_token_ids", "prompt_embeds"} & set(prompt))
    if others:
        raise ValueError(f"give segments alone, not with {', '.join(others)}")
    ratio = prompt.get("blend_recompute_ratio")
    ratio = None if ratio is None else check_ratio(ratio)

    def encode(text: str, special: bool) -> list[int]:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give segments as token ids instead of text")
        return tokenizer.encode(check_unicode(text, "segments"), add_special_tokens=special)

    token_ids, documents = segment_prompt(prompt["segments"], encode)
    _check_ids(token_ids, vocab_size)
    return ParsedPrompt(None, token_ids, salt, tenant=owner, documents=documents, blend_ratio=ratio)


def check_tenant(tenant: Any) -> str | None:
    """`tenant` (whom the scheduler shares prefill among) if it is a string of 1 to `MAX_TENANT_CHARS`
    characters, None if None; ValueError otherwise."""
    if tenant is None:
        return None
    if not isinstance(tenant, str):
        raise ValueError(f"tenant must be a string, not {type(tenant).__name__}")
    if not 0 < len(tenant) <= MAX_TENANT_CHARS:
        raise ValueError(f"tenant has {len(tenant)} characters; it must have 1 to {MAX_TENANT_CHARS}")
    return tenant
