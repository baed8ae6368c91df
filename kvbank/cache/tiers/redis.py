"""The Redis tier: one prompt cache shared by every kvbank server pointed at the same Redis or Redis Cluster.

Each entry is one string value under `kvbank:{namespace}:{key hex}`; the namespace (model fingerprint
and KV format) keeps engines that could not use each other's entries apart, and an optional TTL lets
Redis forget entries nobody has written again. Redis enforces its own memory (maxmemory and its eviction
policy), so this tier has no byte budget of its own.

Redis is a remote service that comes and goes: every fault (refused, reset, timed out, cluster down)
is answered as a miss or a dropped store, counted, and logged once per outage; for a backoff interval
after a fault (0.5 s, doubling up to 8 s while it lasts) the tier answers without touching the network,
so a dead or stalled server costs one call a timeout or two per interval, not every call.

Loads take a direct read path (`direct_reads`, on by default): the GETs of a batch go out on one of
redis-py's pooled connections, and the replies are parsed here: each bulk string's `$<length>` header is
read from a small scratch buffer and its value is received straight into a buffer of exactly that length
(`socket.recv_into`), so a value is copied once, by the kernel, instead of once by the socket read and
again by the RESP parser. A Redis Cluster gets the same per master (keys routed by slot). Anything the
direct path cannot answer (a redirect of a migrating slot, an error reply, a dropped pooled socket) goes
the redis-py way for that batch; a timeout is an outage as before.

Whoever can write the Redis can put anything under a key, so a read never takes more than the caller can
use: given each key's largest acceptable entry (`max_bytes`), a load asks `GETRANGE key 0 max` instead of
`GET key`, in the same single pipeline (no extra round trip, the same on a cluster, where GETRANGE routes
by its one key like GET). A value of any size then costs at most one byte more than the largest entry,
and one over it is refused there, before its version, lengths or MAC are looked at: counted as corrupt,
answered as a miss and deleted. (GETRANGE answers an empty string for a missing key: no entry is empty.)
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import PipelineCommand, RedisCluster
from redis.connection import Connection, Encoder, PythonRespSerializer
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, RedisError, TryAgainError
from redis.retry import Retry

from kvbank.cache.tiers.base import Buffer, Tier, TierOption

log = logging.getLogger("kvbank.tiers")

SCHEMES = ("redis", "rediss", "unix")
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0

#: what counts as "Redis is unreachable or broken" rather than a bug in kvbank
FAULTS = (RedisError, RedisClusterException, OSError)
#: a cluster reply that means a master is gone, not that one command failed
_MASTER_LOST = (redis.ConnectionError, redis.TimeoutError, ClusterDownError)


class RedisTier(Tier):
    """Entries in Redis (`redis://`, `rediss://`, `unix://`), or a Redis Cluster found behind the same URL.

    The server need not be up at construction: the tier starts unreachable and connects on first use.
    `bytes_used` and `entries` describe the whole store (every namespace and every writer) as of the
    last `refresh_stats()`.
    """

    name = "redis"
    options = (
        TierOption("kv_redis_url", "str | None", None),
        TierOption("kv_redis_ttl", "float | None", None),
        TierOption("kv_redis_timeout", "float", 1.0),
    )

    @classmethod
    def from_options(cls, options: Any, namespace: bytes) -> RedisTier:
        # keys carry a short digest of the pool's namespace: printable, brace-free, the same on every server
        return cls(
            options.kv_redis_url,
            hashlib.blake2b(namespace, digest_size=8).hexdigest(),
            ttl_seconds=options.kv_redis_ttl,
            timeout_seconds=options.kv_redis_timeout,
        )

    def __init__(
        self,
        url: str,
        namespace: str,
        ttl_seconds: float | None = None,
        timeout_seconds: float = 1.0,
        direct_reads: bool = True,
    ):
        super().__init__()
        self.direct_reads = direct_reads
        self.url = redacted(url)
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"redis URL {self.url!r}: scheme {scheme!r} is not one of redis://, rediss://, unix://")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"redis TTL {ttl_seconds} s must be positive (or None for no expiry)")
        if timeout_seconds <= 0:
            raise ValueError(f"redis timeout {timeout_seconds} s must be positive")
        if "{" in namespace or "}" in namespace:  # a cluster would hash every key by the braces' content alone
            raise ValueError(f"redis namespace {namespace!r} must not contain braces")
        self.prefix = f"kvbank:{namespace}:"
        self.ttl_ms = None if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self._raw_url = url
        self._options = {
            "socket_timeout": timeout_seconds,
            "socket_connect_timeout": timeout_seconds,
            # One immediate retry on a dropped connection replaces a pooled socket that a restarted
            # server closed; a timeout is not retried, so one call waits at most one timeout per attempt.
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        }
        # from_url does not connect: a bad URL fails here, an absent server only on first use.
        try:
            self._client: redis.Redis | RedisCluster = redis.Redis.from_url(
                url, command_packer=_ZERO_COPY_PACKER, **self._options
            )
        except ValueError as e:  # redis-py's message may quote the URL
            raise ValueError(f"redis URL {self.url!r}: {redacted(str(e))}") from None
        self._mode_known = False
        self._connect_lock = threading.Lock()
        self._down = False
        self._backoff_s = BACKOFF_START_S
        self._retry_at = 0.0
        #: the clock the backoff is timed by (a test may put one it controls)
        self.clock: Callable[[], float] = time.monotonic

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        replies = self._pipelined([("EXISTS", self._name(key)) for key in keys])
        return [reply == 1 for reply in replies]

    def get(self, keys: Sequence[bytes], max_bytes: Sequence[int] | None = None) -> list[Buffer | None]:
        start = time.perf_counter()
        limits = max_bytes if max_bytes is not None else [None] * len(keys)
        commands = [_read_command(self._name(key), limit) for key, limit in zip(keys, limits)]
        replies = self._direct_gets(commands) if self.direct_reads and commands else None
        if replies is None:
            replies = self._pipelined(commands)
        blobs = [reply if isinstance(reply, (bytes, bytearray)) else None for reply in replies]
        oversize: list[bytes] = []
        for i, (blob, limit) in enumerate(zip(blobs, limits)):
            if blob is not None and limit is not None and (not blob or len(blob) > limit):
                blobs[i] = None
                if blob:
                    oversize.append(keys[i])
        elapsed = time.perf_counter() - start
        with self.lock:
            hits = sum(blob is not None for blob in blobs)
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.corrupt += len(oversize)
            self.stats.load_bytes += sum(len(blob) for blob in blobs if blob is not None)
            self.stats.load_seconds += elapsed
        if oversize:
            log.warning("redis tier: removed %d values larger than the entries asked for", len(oversize))
            self.delete(oversize)
        return blobs

    def put(self, entries: Sequence[tuple[bytes, Buffer]]) -> int:
        expiry = () if self.ttl_ms is None else ("PX", self.ttl_ms)
        blobs = [_bytes_view(blob) for _, blob in entries]
        start = time.perf_counter()
        replies = self._pipelined([("SET", self._name(key), blob, *expiry) for (key, _), blob in zip(entries, blobs)])
        elapsed = time.perf_counter() - start
        stored = [reply is True for reply in replies]
        with self.lock:
            self.stats.store_bytes += sum(len(blob) for blob, ok in zip(blobs, stored) if ok)
            self.stats.store_seconds += elapsed
            self.stats.stores_dropped += stored.count(False)
        return stored.count(True)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._pipelined([("DEL", self._name(key)) for key in keys])

    def refresh_stats(self) -> None:
        """Set `bytes_used` to Redis's used_memory and `entries` to its key count (summed over cluster masters).

        One INFO and one DBSIZE per master; while the tier is down the gauges keep their last values.
        """
        usage = self._guarded(_store_usage)
        if usage is not None:
            with self.lock:
                self.stats.bytes_used, self.stats.entries = usage

    def close(self) -> None:
        with self._connect_lock:
            self._client.close()

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _pipelined(self, commands: list[tuple]) -> list[Any]:
        """Each command's reply in one round trip (per cluster node); None for every command that failed."""
        if not commands:
            return []
        replies = self._guarded(lambda client: _execute(client, commands))
        if replies is None:
            return [None] * len(commands)
        failed = sum(isinstance(reply, Exception) for reply in replies)
        if failed:
            with self.lock:
                self.stats.errors += failed
        return [None if isinstance(reply, Exception) else reply for reply in replies]

    def _direct_gets(self, commands: list[tuple]) -> list[bytearray | None] | None:
        """Each read's value (a bytearray) or None, read by the direct path; None when the batch must go the
        redis-py way instead (an error reply, a redirect, a dropped pooled socket, a refused connection: that
        way retries and decides whether it is an outage) or the tier is backing off (it then skips the network).
        """
        with self.lock:
            if self.clock() < self._retry_at:
                return None
        try:
            replies = _direct_get(self._connected(), commands)
        except (TimeoutError, redis.TimeoutError) as e:  # a stalled server: the redis-py way would wait again
            self._fault(e)
            return None
        except FAULTS:
            return None
        if replies is None:
            return None
        self._recovered()
        return replies

    def _guarded(self, operation: Callable[[redis.Redis | RedisCluster], Any]) -> Any:
        """operation(client), or None while backing off after a fault or when it faults now."""
        with self.lock:
            if self.clock() < self._retry_at:
                return None
        try:
            result = operation(self._connected())
        except FAULTS as e:
            self._fault(e)
            return None
        self._recovered()
        return result

    def _connected(self) -> redis.Redis | RedisCluster:
        """The client, switched to a RedisCluster the first time the server says it is a cluster node."""
        if self._mode_known:
            return self._client
        with self._connect_lock:
            if not self._mode_known:
                if _is_cluster_node(self._client):
                    self._client.close()
                    self._client = RedisCluster.from_url(
                        self._raw_url, connection_class=_ZeroCopyConnection, **self._options
                    )
                self._mode_known = True
            return self._client

    def _fault(self, error: Exception) -> None:
        with self.lock:
            self.stats.errors += 1
            now = self.clock()
            outage_starts = not self._down
            if outage_starts:
                self._down, self._backoff_s = True, BACKOFF_START_S
            elif now >= self._retry_at:  # a failed retry, not a call that was already in flight
                self._backoff_s = min(2 * self._backoff_s, BACKOFF_MAX_S)
            self._retry_at = now + self._backoff_s
        if outage_starts:
            reason = redacted(f"{type(error).__name__}: {error}")
            log.warning("redis tier at %s unreachable (%s); serving by recompute until it is back", self.url, reason)

    def _recovered(self) -> None:
        with self.lock:
            was_down, self._down, self._backoff_s, self._retry_at = self._down, False, BACKOFF_START_S, 0.0
        if was_down:
            log.info("redis tier at %s is back", self.url)


def _is_cluster_node(client: redis.Redis) -> bool:
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except redis.ResponseError:  # INFO refused (an ACL, a proxy without it): not a cluster we could route for
        return False


def _execute(client: redis.Redis | RedisCluster, commands: list[tuple]) -> list[Any]:
    if isinstance(client, RedisCluster):
        return _execute_on_cluster(client, commands)
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return pipe.execute(raise_on_error=False)


def _execute_on_cluster(cluster: RedisCluster, commands: list[tuple]) -> list[Any]:
    """One pipeline per master, but without redis-py's fallback that resends a failed master's commands one
    by one, each waiting out its own timeout: a master that stays unreachable is an outage of the tier."""
    replies = _send(cluster, commands, follow_redirects=False)
    if any(isinstance(reply, redis.ConnectionError) for reply in replies):  # a socket to a restarted master
        replies = _send(cluster, commands, follow_redirects=False)
    lost = next((reply for reply in replies if isinstance(reply, _MASTER_LOST)), None)
    if lost is not None:
        raise lost
    # Slots being migrated: let redis-py follow the redirects and refresh its slot map.
    moved = [i for i, reply in enumerate(replies) if isinstance(reply, (AskError, TryAgainError))]
    if moved:
        for i, reply in zip(moved, _send(cluster, [commands[i] for i in moved], follow_redirects=True)):
            replies[i] = reply
    return replies


def _send(cluster: RedisCluster, commands: list[tuple], follow_redirects: bool) -> list[Any]:
    stack = [PipelineCommand(command, {}, position) for position, command in enumerate(commands)]
    pipe = cluster.pipeline(transaction=False)
    return pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=follow_redirects)


def _direct_get(client: redis.Redis | RedisCluster, commands: list[tuple]) -> list[bytearray | None] | None:
    """Send every read (GET or GETRANGE, `_read_command`) over pooled connections (one per cluster master),
    values received in place; None if any reply was not a value or nil (a redirect, an error): the caller then
    asks the redis-py way.

    A cluster's masters get all their reads before any reply is read, so they send in parallel."""
    if not isinstance(client, RedisCluster):
        groups = [(client.connection_pool, list(range(len(commands))))]
    else:
        by_node: dict[str, tuple[redis.ConnectionPool, list[int]]] = {}
        for i, command in enumerate(commands):
            node = client.get_node_from_key(command[1])
            if node.name not in by_node:
                by_node[node.name] = (client.get_redis_connection(node).connection_pool, [])
            by_node[node.name][1].append(i)
        groups = list(by_node.values())
    replies: list[bytearray | None] = [None] * len(commands)
    taken: list[tuple[redis.ConnectionPool, Any]] = []
    complete = True
    try:
        for pool, positions in groups:
            connection = pool.get_connection()
            taken.append((pool, connection))
            if connection._sock is None:
                connection.connect()
            connection._sock.sendall(b"".join(_resp_command(commands[i]) for i in positions))
        for (_, connection), (_, positions) in zip(taken, groups):
            got = _ReplyReader(connection._sock).values(len(positions))
            if got is None:
                complete = False
                continue
            for i, reply in zip(positions, got):
                replies[i] = reply
    except BaseException:
        for _, connection in taken:  # a stream may be inside a reply: no later command may use it
            connection.disconnect()
        raise
    finally:
        for pool, connection in taken:
            pool.release(connection)
    return replies if complete else None


def _read_command(name: str, max_bytes: int | None) -> tuple:
    """GET, or for a bounded read the value's first `max_bytes` + 1 bytes: one more than an entry may have
    tells a value over the bound from one exactly at it."""
    return ("GET", name) if max_bytes is None else ("GETRANGE", name, 0, max_bytes)


def _resp_command(command: tuple) -> bytes:
    parts = [str(part).encode() for part in command]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%b\r\n" % (len(part), part) for part in parts)


class _ReplyReader:
    """RESP replies to GETs (and GETRANGEs) from a socket: headers through a small scratch buffer, each value
    received into its own buffer of exactly its length, so the scratch never holds more than a header and a
    value's first bytes."""

    SCRATCH_BYTES = 64 * 1024
    MAX_LINE = 1024

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.scratch = bytearray(self.SCRATCH_BYTES)
        self.view = memoryview(self.scratch)
        self.start = self.end = 0

    def values(self, count: int) -> list[bytearray | None] | None:
        """`count` replies: a value, None for nil, and None for the whole batch if any reply is something else
        (every reply is still read, so the connection stays usable)."""
        out: list[bytearray | None] = []
        other = False
        for _ in range(count):
            line = self._line()
            kind = line[:1]
            if kind == b"$" and line != b"$-1":
                value = bytearray(_length(line))
                self._read_into(memoryview(value))
                if self._line() != b"":
                    raise redis.InvalidResponse("a bulk string longer than its length")
                out.append(value)
            elif kind in (b"$", b"_"):  # nil: RESP2 $-1, RESP3 _
                out.append(None)
            elif kind in (b"-", b"!"):
                other = True
                out.append(None)
            else:
                raise redis.InvalidResponse(f"unexpected reply {bytes(line[:32])!r} to GET")
        return None if other else out

    def _line(self) -> bytes:
        while True:
            i = self.scratch.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.view[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > self.MAX_LINE:
                raise redis.InvalidResponse(f"a reply line longer than {self.MAX_LINE} bytes")
            self._fill()

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.scratch):
            kept = self.end - self.start
            self.view[:kept] = self.view[self.start : self.end]
            self.start, self.end = 0, kept
        n = self.sock.recv_into(self.view[self.end :])
        if n == 0:
            raise redis.ConnectionError("the server closed the connection")
        self.end += n

    def _read_into(self, target: memoryview) -> None:
        have = min(len(target), self.end - self.start)
        target[:have] = self.view[self.start : self.start + have]
        self.start += have
        recv_into = self.sock.recv_into
        while have < len(target):
            n = recv_into(target[have:])
            if n == 0:
                raise redis.ConnectionError("the server closed the connection")
            have += n


def _length(line: bytes) -> int:
    try:
        length = int(line[1:])
    except ValueError:
        length = -2
    if length < 0:
        raise redis.InvalidResponse(f"bad bulk string length {bytes(line[:32])!r}")
    return length


def _store_usage(client: redis.Redis | RedisCluster) -> tuple[int, int]:
    if isinstance(client, RedisCluster):
        memory = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        keys = client.dbsize(target_nodes=RedisCluster.PRIMARIES)
        return sum(node["used_memory"] for node in memory.values()), keys
    return client.info("memory")["used_memory"], client.dbsize()


def _bytes_view(blob: Buffer) -> memoryview:
    """The blob as a flat byte view: redis-py sends memoryviews as they are, and len() must count bytes."""
    return memoryview(blob).cast("B")


def redacted(text: str) -> str:
    """`text` with the credentials of every URL in it masked: the password of `scheme://user:password@`
    (all of the user part when it has no password) and the value of a `password=`-like query parameter.

    The user part runs to the last `@` before the next space, so a password holding `@`, `/`, `?` or `#`
    is masked whole, however a URL parser would have split it. Every output that shows a URL (logs, error
    messages, /server_info) goes through here."""
    text = _USERINFO.sub(_mask_userinfo, text)
    return _SECRET_QUERY.sub(r"\g<1>***", text)


_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>\S*)@")
_SECRET_QUERY = re.compile(r"(?i)([?&;](?:password|passwd|pass|pwd|secret|token|key)=)[^&;#\s'\"]*")


def _mask_userinfo(match: re.Match) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    return f"{match['scheme']}{user}:***@" if colon else f"{match['scheme']}***@"


# With hiredis installed redis-py also packs commands with it, which copies every value twice (a 6 MB
# SET pipeline runs at ~2 GB/s instead of ~3.4 GB/s on loopback); the pure-Python packer hands large
# values to sendall as they are, while replies are still parsed by hiredis (~2x the pure-Python parser).
_ZERO_COPY_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


class _ZeroCopyConnection(Connection):
    """A cluster node connection with the zero-copy packer (RedisCluster does not pass `command_packer` on)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(command_packer=_ZERO_COPY_PACKER, **kwargs)
