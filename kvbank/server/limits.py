"""What one server accepts: `ServerLimits`, the one place the server's options and their defaults live.

`kvbank serve` generates a flag for each field from its metadata, as it does for `EngineConfig`
(`help`, and optionally `flag` for a flag spelled other than the field, `metavar`, `default_text`
for a default that is not a value, `env` for an environment variable that overrides the default,
and `cli=False` for a field the command line does not set).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvbank.config import option


@dataclass
class ServerLimits:
    """An optional API key, a queue bound, per-request caps, and the streams' and sessions' limits.

    `max_queued_requests`: requests accepted but still waiting for their first token (queued or
    being prefilled) beyond which new ones get 429 with Retry-After. `max_tokens_cap` bounds
    max_tokens (and is the default when a chat request names none); `max_n` bounds n. None means
    no limit, except for `max_streams_per_tenant`, where it means a quarter of `max_streams`
    (`tenant_stream_limit`). A tenant is a `cache_salt` (no salt: the default tenant); its quotas
    keep one tenant from taking every stream slot or filling the session folder.
    """

    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health",
        env="KVBANK_API_KEY",
        metavar="KEY",
        default_text="$KVBANK_API_KEY, else no key",
    )
    allowed_hosts: str | None = option(
        None,
        "host names a request's Host header may carry, comma-separated ('*': any); others get 400, so a "
        "web page cannot reach a local server through a name it controls (DNS rebinding)",
        metavar="HOST,...",
        default_text="without --api-key on a loopback address: localhost, 127.0.0.1, ::1 and --host; else any",
    )
    max_queued_requests: int | None = option(512, "requests waiting for a batch slot beyond which new ones get 429")
    max_tokens_cap: int | None = option(
        4096,
        "largest max_tokens a request may ask for; also the default for chat requests that name none "
        "(a policy that evicts, e.g. sink_window, runs past the context, so without a cap one request "
        "could decode forever)",
    )
    max_prompt_tokens: int | None = option(
        None,
        "longest prompt (in tokens) a request may send; the engine already refuses prompts over the "
        "context unless a policy that evicts runs them, and this bounds those too. A list of token ids, "
        "chat messages or content parts is counted against it before any item is read",
        default_text="twice the model's context",
    )
    max_body_mb: float | None = option(
        None,
        "largest request body in MiB; a larger one gets 413 (checked from Content-Length and while reading)",
        metavar="MIB",
        default_text="room for the largest prompt_embeds the model accepts (context x hidden size float32, "
        "base64), at least 16",
    )
    max_n: int | None = option(16, "largest n a request may ask for")
    max_choices: int | None = option(
        64, "largest number of sequences (prompts x n) one request may start; each holds its own KV blocks"
    )
    retry_after_s: int = option(1, "seconds a refused client is told to wait (Retry-After)", cli=False)
    max_streams: int | None = option(16, "streaming sessions (/v1/streams) open at once; more get 429")
    max_streams_per_tenant: int | None = option(
        None,
        "streams one tenant (cache_salt) may hold open; more get 429",
        default_text="a quarter of --max-streams, at least 1",
    )
    max_sessions_per_tenant: int | None = option(
        64, "session files one tenant (cache_salt) may keep in --session-dir; a save of a new name beyond gets 429"
    )
    max_session_gb_per_tenant: float | None = option(
        4.0,
        "GiB of session files one tenant (cache_salt) may keep in --session-dir; a save beyond gets 507",
        metavar="GIB",
    )
    stream_idle_timeout_s: float | None = option(
        600.0, "close a streaming session unused for this long", flag="--stream-idle-timeout", metavar="SECONDS"
    )

    def __post_init__(self) -> None:
        if self.stream_idle_timeout_s is not None and self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s={self.stream_idle_timeout_s} must be positive")
        if self.max_body_mb is not None and self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb={self.max_body_mb} must be positive")
        if self.allowed_hosts is not None and not all(_host_name(n) for n in self.allowed_hosts.split(",")):
            raise ValueError(f"allowed_hosts={self.allowed_hosts!r} has an empty name")
        if self.max_session_gb_per_tenant is not None and self.max_session_gb_per_tenant <= 0:
            raise ValueError(f"max_session_gb_per_tenant={self.max_session_gb_per_tenant} must be positive")
        for name in (
            "max_queued_requests",
            "max_tokens_cap",
            "max_prompt_tokens",
            "max_n",
            "max_choices",
            "max_streams",
            "max_streams_per_tenant",
            "max_sessions_per_tenant",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")

    def host_allowlist(self, bind_host: str | None) -> frozenset[str] | None:
        """The host names a request may address (lower case, IPv6 without brackets); None: any.

        `allowed_hosts` when given. Otherwise a server bound to a loopback address without an API
        key answers only to loopback names: a page on a site the user visits can point its own DNS
        name at 127.0.0.1 and then send requests the browser treats as same-origin, and the Host
        header (its own name) is what tells them apart. With a key the key guards every route; on a
        non-loopback address the names the server is reached by are not known here (`bind_host`
        None: an app not started by `kvbank serve`, likewise)."""
        if self.allowed_hosts is not None:
            names = frozenset(_host_name(name) for name in self.allowed_hosts.split(","))
            return None if "*" in names else names
        if self.api_key is not None or bind_host is None or not _is_loopback(bind_host):
            return None
        return frozenset({"localhost", "127.0.0.1", "::1", _host_name(bind_host)})

    def tenant_stream_limit(self) -> int | None:
        """Streams one tenant may hold: `max_streams_per_tenant`, else a quarter of `max_streams`."""
        if self.max_streams_per_tenant is not None or self.max_streams is None:
            return self.max_streams_per_tenant
        return max(1, self.max_streams // 4)

    def prompt_token_limit(self, context: int) -> int | None:
        """Longest prompt a request may send: `max_prompt_tokens`, else twice `context` (a policy that
        evicts keeps at most the context, so a longer prompt is mostly prefill thrown away)."""
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else 2 * context

    def body_byte_limit(self, context: int, hidden_size: int) -> int | None:
        """`max_body_mb` in bytes; by default the base64 of a full context of float32 embeddings
        (the largest body a request needs) and 1 MiB for the rest, at least 16 MiB."""
        if self.max_body_mb is not None:
            return int(self.max_body_mb * 2**20)
        return max(16 * 2**20, context * hidden_size * 4 * 4 // 3 + 2**20)

    def session_bytes_per_tenant(self) -> int | None:
        """`max_session_gb_per_tenant` in bytes."""
        gb = self.max_session_gb_per_tenant
        return None if gb is None else int(gb * 2**30)


def _host_name(host: str) -> str:
    """A host as Host headers are compared: lower case, no brackets around an IPv6 address, no trailing dot."""
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def _is_loopback(host: str) -> bool:
    name = _host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host name of a Host header ("[::1]:8000" -> "::1", "Example.com:80" -> "example.com")."""
    header = header.strip()
    if header.startswith("["):
        return _host_name(header[: header.find("]") + 1] if "]" in header else header)
    return _host_name(header.rsplit(":", 1)[0] if header.count(":") == 1 else header)
