"""What one server accepts: `ServerLimits`, the one place the server's options and their defaults live.

`kvbank serve` generates a flag for each field from its metadata, as it does for `EngineConfig`
(`help`, and optionally `flag` for a flag spelled other than the field, `metavar`, `default_text`
for a default that is not a value, `env` for an environment variable that overrides the default,
and `cli=False` for a field the command line does not set).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.config import option


@dataclass
class ServerLimits:
    """An optional API key, a queue bound, per-request caps and the streaming sessions' limits.

    `max_queued_requests`: requests accepted but still waiting for their first token (queued or
    being prefilled) beyond which new ones get 429 with Retry-After. `max_tokens_cap` bounds
    max_tokens (and is the default when a chat request names none); `max_n` bounds n. None means
    no limit.
    """

    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health",
        env="KVBANK_API_KEY",
        metavar="KEY",
        default_text="$KVBANK_API_KEY, else no key",
    )
    max_queued_requests: int | None = option(512, "requests waiting for a batch slot beyond which new ones get 429")
    max_tokens_cap: int | None = option(
        None,
        "largest max_tokens a request may ask for; also the default for chat requests that name none",
        default_text="no cap",
    )
    max_n: int | None = option(16, "largest n a request may ask for")
    retry_after_s: int = option(1, "seconds a refused client is told to wait (Retry-After)", cli=False)
    max_streams: int | None = option(16, "streaming sessions (/v1/streams) open at once; more get 429")
    stream_idle_timeout_s: float | None = option(
        600.0, "close a streaming session unused for this long", flag="--stream-idle-timeout", metavar="SECONDS"
    )

    def __post_init__(self) -> None:
        if self.stream_idle_timeout_s is not None and self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s={self.stream_idle_timeout_s} must be positive")
        for name in ("max_queued_requests", "max_tokens_cap", "max_n", "max_streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
