"""How many tokens a request generates when it names no `max_tokens`: each surface's default, defined once.

The surfaces follow different APIs, so their defaults differ: each is what a user of the API it
follows expects. `SamplingParams`, the HTTP routes, the `kvbank` command, their help and
docs/options.md read them from here; `MAX_TOKENS_DEFAULTS` says why each is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

#: `SamplingParams()`: the Python API (`LLM.generate`, `LLM.stream`, `StreamSession.ask`)
SAMPLING_MAX_TOKENS = 16
#: POST /v1/completions
COMPLETIONS_MAX_TOKENS = 16
#: POST /v1/streams/{id}/ask
ASK_MAX_TOKENS = 64
#: `kvbank generate` and `kvbank chat`
CLI_MAX_TOKENS = 256
#: `ServerLimits.max_tokens_cap` (--max-tokens-cap): the most a request may ask for, and a chat request's default
MAX_TOKENS_CAP = 4096


@dataclass(frozen=True, slots=True)
class RequestDefault:
    """One surface's default `max_tokens`: where it applies, its value (a text where it is another
    option's), and why it is that."""

    surface: str
    value: int | str
    why: str


MAX_TOKENS_DEFAULTS = (
    RequestDefault(
        "Python: `SamplingParams`",
        SAMPLING_MAX_TOKENS,
        "vLLM's default, so code written for vLLM generates as much; `None` runs up to the context",
    ),
    RequestDefault("HTTP: `POST /v1/completions`", COMPLETIONS_MAX_TOKENS, "OpenAI's default for completions"),
    RequestDefault(
        "HTTP: `POST /v1/chat/completions`",
        f"`--max-tokens-cap` ({MAX_TOKENS_CAP})",
        "OpenAI's chat API has none (a reply runs until it ends); the cap keeps a reply finite where a "
        "policy that evicts (e.g. `sink_window`) runs past the context",
    ),
    RequestDefault(
        "HTTP: `POST /v1/streams/{id}/ask`",
        ASK_MAX_TOKENS,
        "a question about what a stream has seen wants a sentence or two, and its blocks are never preempted: "
        "a short answer holds them briefly",
    ),
    RequestDefault(
        "CLI: `kvbank generate`, `kvbank chat`",
        CLI_MAX_TOKENS,
        "a reply a person reads in the terminal: a paragraph or two",
    ),
)
