"""The server's connections: a cap on how many are open, and a deadline for a request's headers.

uvicorn's h11 protocol waits forever for the first request on a new connection, and for the rest
of a request's headers once a few bytes have come (its keep-alive timeout runs only between
requests, and the first byte stops it), so a client that opens sockets and sends nothing, or
half a request, holds a file descriptor each until the process has none left. uvicorn's
`limit_concurrency` does not help: it answers 503 to requests over the limit but keeps accepting
and holding connections, and as it counts idle connections too, a flood of them turns /health
into 503 while nothing runs.

`GuardedH11Protocol` is uvicorn's h11 protocol with both:
- a connection that has not sent a request's complete headers `header_timeout_s` after it opened,
  or after its previous response, is closed;
- at `max_connections` open connections, a new one closes the connection that has waited longest
  for a request (a request in progress is never cut); only when every connection carries a request
  is the new one answered 503 and closed at once. Requests in progress are bounded by the engine's
  own limits (running sequences and the queue), so a cap above those always leaves room for
  /health, whatever idle sockets or long streams hold the rest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvbank.server.errors import error_body

DEFAULT_MAX_CONNECTIONS = 1024
#: file descriptors the process keeps for itself beside its connections (model, tiers, sessions, logs)
FD_RESERVE = 128


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a deadline for request headers."""

    def __init__(self, *args: Any, max_connections: int, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        #: when it began waiting for a request's headers; None while a request is in progress
        self.waiting_since: float | None = None
        self.header_deadline: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._close_longest_waiting():
            self.refused = True
            transport.write(_refusal(self.max_connections))
            transport.close()
            return
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if not self.refused:  # a refused connection never started uvicorn's bookkeeping
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are complete
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_headers()

    def _await_headers(self) -> None:
        self.waiting_since = time.monotonic()
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_late)

    def _stop_waiting(self) -> None:
        self.waiting_since = None
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_late(self) -> None:
        self.header_deadline = None
        if self.waiting_since is not None:
            self.waiting_since = None
            self.transport.close()

    def _close_longest_waiting(self) -> bool:
        waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.waiting_since is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda connection: connection.waiting_since)
        oldest._stop_waiting()  # not chosen again while it closes
        oldest.transport.close()
        return True


def guarded_protocol(max_connections: int, header_timeout_s: float) -> functools.partial:
    """The protocol factory to hand uvicorn as `Config(http=...)`."""
    return functools.partial(GuardedH11Protocol, max_connections=max_connections, header_timeout_s=header_timeout_s)


def connection_limit(requested: int | None) -> int:
    """The connections the server may hold open: `requested`, else DEFAULT_MAX_CONNECTIONS or fewer
    where the open-file limit leaves less room. The soft limit is raised toward the hard one as far
    as needed; a `requested` that still does not fit is a ValueError naming both."""
    wanted = (requested or DEFAULT_MAX_CONNECTIONS) + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # a system that caps it lower than it says (macOS: OPEN_MAX)
            pass
    room = wanted - FD_RESERVE if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
    if requested is None:
        return max(1, min(DEFAULT_MAX_CONNECTIONS, room))
    if requested > room:
        raise ValueError(
            f"--max-connections {requested} needs {wanted} file descriptors ({FD_RESERVE} for the rest of the "
            f"process), over this process's open-file limit of {soft} (ulimit -n; hard limit {hard})"
        )
    return requested


def _refusal(max_connections: int) -> bytes:
    message = (
        f"this server holds {max_connections} connections (--max-connections), all with a request in progress; "
        "retry shortly"
    )
    body = json.dumps(error_body(message, code="too_many_connections", error_type="service_unavailable")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
