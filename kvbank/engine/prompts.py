"""What a prompt may be (text, token ids, or a dict with a tenant's cache salt) and its validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbank.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass(slots=True)
class ParsedPrompt:
    """A prompt as the engine runs it: token ids, the text if it came as text, the cache salt."""

    text: str | None
    token_ids: list[int]
    salt: str | None


def parse_prompt(prompt: PromptType, tokenizer: Tokenizer | None, vocab_size: int) -> ParsedPrompt:
    """Token ids of `prompt`, checked against the vocabulary; raises ValueError naming what is wrong.

    A dict takes "prompt" (text) or "prompt_token_ids", and optionally "cache_salt"; when it has
    both, the ids are what runs and the text is kept for display.
    """
    salt = None
    text = None
    if isinstance(prompt, dict):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt={salt!r} must be a string")
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            prompt = prompt["prompt_token_ids"]
        else:
            prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt is empty: it must have at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab_size})")
    return ParsedPrompt(text, token_ids, salt)
