"""What one server accepts: `ServerLimits`, the one place the server's options and their defaults live.

`kvbank serve` generates a flag for each field from its metadata, as it does for `EngineConfig`
(`help`, and optionally `flag` for a flag spelled other than the field, `metavar`, `default_text`
for a default that is not a value, `env` for an environment variable that overrides the default,
and `cli=False` for a field the command line does not set).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.config import COMMAND_LINE_SECRET, load_secret_file, option
from kvbank.defaults import MAX_TOKENS_CAP

#: the names a request from this machine addresses a server by, which every allowlist keeps
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass
class ServerLimits:
    """Optional API keys, a queue bound, per-request caps, the streams' and sessions' limits, and
    the connections' (`kvbank.server.connections`).

    `max_queued_requests`: requests accepted but still waiting for their first token (queued or
    being prefilled) beyond which new ones get 429 with Retry-After. `max_tokens_cap` bounds
    max_tokens (and is the default when a chat request names none); `max_n` bounds n. None means
    no limit, except for `max_streams_per_tenant`, where it means a quarter of `max_streams`
    (`tenant_stream_limit`), and `max_connections`, where it means 1024 or what the open-file limit
    leaves (`connections.connection_limit`). A tenant is a `cache_salt` (no salt: the default tenant); its quotas
    keep one tenant from taking every stream slot or filling the session folder. A client may name any
    salt, so the sessions also have quotas per client (`quotas.client_of`) and caps over the whole folder.

    `api_key` is one key or a list of them (`api_keys`), any of which authenticates; `api_key_file`
    holds one a line. The scheduler shares prefill among tenants of its own: with keys, a request's
    key, and within it its salt (`completions.scheduling_tenant`); without, its salt.
    """

    api_key: str | list[str] | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health; repeat it to accept any of several "
        "keys, each its own tenant in the fair share of prefill; 5 wrong keys in 60 s from one address get it "
        f"429; {COMMAND_LINE_SECRET}: prefer $KVBANK_API_KEY (one key) or --api-key-file",
        env="KVBANK_API_KEY",
        metavar="KEY",
        default_text="$KVBANK_API_KEY, else no key",
        secret=True,
    )
    api_key_file: str | None = option(
        None, "a file holding --api-key: one key a line (blank lines are skipped)", metavar="PATH", default_text="none"
    )
    allowed_hosts: str | None = option(
        None,
        "host names a request's Host header may carry besides localhost, 127.0.0.1, ::1 and --host, which are "
        "always answered (e.g. a reverse proxy's), comma-separated ('*': any); others get 400, so a web page "
        "cannot reach a local server through a name it controls (DNS rebinding)",
        metavar="HOST,...",
        default_text="none: without --api-key on a loopback address only localhost, 127.0.0.1, ::1 and --host "
        "are answered, else any name",
    )
    max_queued_requests: int | None = option(512, "requests waiting for a batch slot beyond which new ones get 429")
    max_tokens_cap: int | None = option(
        MAX_TOKENS_CAP,
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
    max_streams_per_client: int | None = option(
        None,
        "streams one client (its address, and its API key when it sends one) may hold open under all the tenants "
        "(cache_salt) it names; more get 429",
        default_text="half of --max-streams, at least --max-streams-per-tenant",
    )
    max_sessions_per_tenant: int | None = option(
        64, "session files one tenant (cache_salt) may keep in --session-dir; a save of a new name beyond gets 429"
    )
    max_session_gb_per_tenant: float | None = option(
        4.0,
        "GiB of session files one tenant (cache_salt) may keep in --session-dir; a save beyond gets 507",
        metavar="GIB",
    )
    max_sessions_per_client: int | None = option(
        64,
        "session files one client (its address, and its bearer key when it sends one) may have saved, "
        "whatever cache_salts it names; a save of a new name beyond gets 429",
    )
    max_session_gb_per_client: float | None = option(
        4.0, "GiB of session files one client may have saved; a save beyond gets 507", metavar="GIB"
    )
    max_sessions: int | None = option(1024, "session files --session-dir may hold in all; a save beyond gets 429")
    max_session_gb: float | None = option(
        64.0, "GiB of session files --session-dir may hold in all; a save beyond gets 507", metavar="GIB"
    )
    stream_idle_timeout_s: float | None = option(
        600.0, "close a streaming session unused for this long", flag="--stream-idle-timeout", metavar="SECONDS"
    )
    max_connections: int | None = option(
        None,
        "HTTP connections open at once (each holds a file descriptor); at the limit a new connection closes "
        "the one that has waited longest for a request, or, when every one carries a request, gets 503; keep "
        "it above --max-num-seqs + --max-queued-requests so /health always gets through",
        default_text="1024, or what the open-file limit (ulimit -n) leaves",
    )
    header_timeout_s: float = option(
        10.0,
        "close a connection that has not sent a request's complete headers this long after it opened or "
        "after its previous response",
        flag="--header-timeout",
        metavar="SECONDS",
    )
    keep_alive_timeout_s: float = option(
        5.0,
        "close a kept-alive connection that sends nothing this long after a response (behind a load balancer: "
        "longer than its idle timeout)",
        flag="--keep-alive-timeout",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        if self.stream_idle_timeout_s is not None and self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s={self.stream_idle_timeout_s} must be positive")
        if self.max_body_mb is not None and self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb={self.max_body_mb} must be positive")
        if self.allowed_hosts is not None and not all(_host_name(n) for n in self.allowed_hosts.split(",")):
            raise ValueError(f"allowed_hosts={self.allowed_hosts!r} has an empty name")
        self._load_api_keys()
        for name in ("max_session_gb_per_tenant", "max_session_gb_per_client", "max_session_gb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in (
            "max_queued_requests",
            "max_tokens_cap",
            "max_prompt_tokens",
            "max_n",
            "max_choices",
            "max_streams",
            "max_streams_per_tenant",
            "max_streams_per_client",
            "max_sessions_per_tenant",
            "max_sessions_per_client",
            "max_sessions",
            "max_connections",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")

    def api_keys(self) -> tuple[str, ...]:
        """The keys any of which authenticates a request (none: the server needs no key)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    def _load_api_keys(self) -> None:
        """Read `api_key_file` (one key a line), then refuse keys that could never be sent or are given
        twice; the message names a key by its place, never by its value."""
        from_file = self.api_key_file is not None
        load_secret_file(self, "api_key")
        if from_file:
            self.api_key = [line.strip() for line in self.api_key.splitlines() if line.strip()]
        if self.api_key is not None and not isinstance(self.api_key, (str, list, tuple)):
            raise ValueError(f"api_key must be a string or a list of strings, not {type(self.api_key).__name__}")
        keys = self.api_keys()
        if self.api_key is not None and not keys:
            raise ValueError("api_key is an empty list: give at least one key, or None for no key")
        for i, key in enumerate(keys):
            which = "api_key" if len(keys) == 1 else f"api_key {i + 1} of {len(keys)}"
            if not isinstance(key, str):
                raise ValueError(f"{which} must be a string, not {type(key).__name__}")
            if not key.strip():
                raise ValueError(f"{which} is empty: a client could never send it")
            first = keys.index(key)
            if first != i:
                raise ValueError(f"api_key {first + 1} and {i + 1} of {len(keys)} are the same key: give each once")

    def host_allowlist(self, bind_host: str | None) -> frozenset[str] | None:
        """The host names a request may address (lower case, IPv6 without brackets); None: any.

        A server bound to a loopback address without an API key answers only to the loopback names
        and `bind_host`: a page on a site the user visits can point its own DNS name at 127.0.0.1
        and then send requests the browser treats as same-origin, and the Host header (its own name)
        is what tells them apart. With a key the key guards every route; on a non-loopback address
        the names the server is reached by are not known here (`bind_host` None: an app not started
        by `kvbank serve`, likewise): any name. `allowed_hosts` adds names to the loopback ones and
        `bind_host` (a proxy's name must not cost the local clients and health checks theirs), and
        makes every server check them."""
        own = LOOPBACK_NAMES | ({_host_name(bind_host)} if bind_host is not None else set())
        if self.allowed_hosts is not None:
            names = frozenset(_host_name(name) for name in self.allowed_hosts.split(","))
            return None if "*" in names else own | names
        if self.api_key is not None or bind_host is None or not is_loopback(bind_host):
            return None
        return own

    def tenant_stream_limit(self) -> int | None:
        """Streams one tenant may hold: `max_streams_per_tenant`, else a quarter of `max_streams`."""
        if self.max_streams_per_tenant is not None or self.max_streams is None:
            return self.max_streams_per_tenant
        return max(1, self.max_streams // 4)

    def client_stream_limit(self) -> int | None:
        """Streams one client may hold: `max_streams_per_client`, else half of `max_streams` (at
        least a tenant's limit: a client that names one tenant is bounded by that)."""
        if self.max_streams_per_client is not None or self.max_streams is None:
            return self.max_streams_per_client
        return max(self.max_streams // 2, self.tenant_stream_limit() or 1)

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
        return _bytes(self.max_session_gb_per_tenant)

    def session_bytes_per_client(self) -> int | None:
        """`max_session_gb_per_client` in bytes."""
        return _bytes(self.max_session_gb_per_client)

    def session_bytes(self) -> int | None:
        """`max_session_gb` in bytes."""
        return _bytes(self.max_session_gb)


def matching_key(given: bytes, keys: Sequence[bytes]) -> int | None:
    """The index of the key in `keys` that `given` is, or None. Every key is compared, each in
    constant time, so how long it takes says nothing of which key matched."""
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key):
            found = i
    return found


def _bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * 2**30)


def _host_name(host: str) -> str:
    """A host as Host headers are compared: lower case, no brackets around an IPv6 address, no trailing dot."""
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address to listen on) is this machine's loopback: only local clients reach it."""
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
