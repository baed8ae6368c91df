"""How the server refuses: `APIError` and OpenAI's error shape, the app's error handlers, the Host
and Origin checks, and the API key every route but /health and the dashboard's public ones needs."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvbank.engine.outputs import RequestFailed
from kvbank.engine.streams import PoolFull
from kvbank.server.async_engine import QueueFullError
from kvbank.server.dashboard import (
    COOKIE_NAME,
    COOKIE_PATHS,
    PUBLIC_PATHS,
    DashboardLogin,
    client_address,
    too_many_failures,
)
from kvbank.server.limits import host_of, matching_key

logger = logging.getLogger(__name__)

#: methods that only read: no route answers them by changing state, so a page of another site may send them
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# SamplingParams and the engine start their errors with "<field>=", "<field>[<key>]=" or
# "<field> token id=".
_FIELD_AT_START = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]]*\]| token id)?=")


class APIError(Exception):
    """A request the server refuses, answered in OpenAI's error shape with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers

    @classmethod
    def from_value_error(cls, error: ValueError, prefix: str = "") -> APIError:
        """A 400 for a value SamplingParams or the engine refused, naming the field its message starts
        with; a 503 for work the KV pool has no room for now (PoolFull: streams hold it)."""
        message = str(error)
        if isinstance(error, PoolFull):
            return cls(f"{prefix}{message}", status=503, code="kv_pool_full")
        return cls(f"{prefix}{message}", param=named_field(message))


def named_field(message: str) -> str | None:
    """The request field an error message of SamplingParams or the engine is about, if it names one."""
    match = _FIELD_AT_START.match(message)
    return match.group(1) if match else None


def error_body(
    message: str, param: str | None = None, code: str | None = None, error_type: str = "invalid_request_error"
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    error_type: str = "invalid_request_error",
) -> JSONResponse:
    """OpenAI's error object as a response with `status`."""
    return JSONResponse(error_body(message, param, code, error_type), status_code=status)


class BodyTooLarge(Exception):
    """A request body over the server's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over this server's limit of {limit} bytes (--max-body-mb)")


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413, from its Content-Length before anything
    is read, or as soon as a streamed (chunked) body passes the limit."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            response = error_response(str(BodyTooLarge(self.limit)), 413, code="request_too_large")
            return await response(scope, receive, send)
        seen, too_large = 0, False

        async def counted():
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # The app sees a client that left (FastAPI would call a failed read a 400);
                    # what it answers is dropped and the 413 goes out instead.
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message) -> None:
            if not too_large:
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not too_large:
                raise
        if too_large:
            response = error_response(str(BodyTooLarge(self.limit)), 413, code="request_too_large")
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI, retry_after_s: int = 1) -> None:
    """Every failure, ours or the framework's, answered in OpenAI's error shape."""

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, error: QueueFullError) -> JSONResponse:
        response = error_response(str(error), 429, code="rate_limit_exceeded")
        response.headers["Retry-After"] = str(retry_after_s)
        return response

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        response = error_response(error.message, error.status, error.param, error.code)
        if error.status in (429, 503):  # refused for now, not for good: say when to come back
            response.headers["Retry-After"] = str(retry_after_s)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(PoolFull)
    async def pool_full(request: Request, error: PoolFull) -> JSONResponse:
        return await api_error(request, APIError.from_value_error(error))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(p["type"] == "json_invalid" for p in problems):
            return error_response("the request body is not valid JSON", 400)
        message = "; ".join(f"{_field_path(p['loc']) or 'body'}: {p['msg']}" for p in problems)
        return error_response(message, 400, _field_path(problems[0]["loc"]) if problems else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = str(error.detail)
        if error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed}"
        response = error_response(message, error.status_code)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return error_response(internal_error_message(error), 500, error_type="internal_server_error")


def internal_error_message(error: Exception) -> str:
    """What a client hears of a failure that is not its fault: the engine's own generic message
    for a request it failed, else a new incident id, with the details logged under it (never sent:
    they can name paths, internals or another request's data)."""
    if isinstance(error, RequestFailed):
        return str(error)
    incident = uuid.uuid4().hex[:16]
    logger.error("internal error (incident %s)", incident, exc_info=error)
    return f"internal error (incident {incident})"


def _field_path(loc: tuple | list) -> str | None:
    # Pydantic locations start with "body"; OpenAI names the field itself.
    parts = [str(part) for part in loc if part != "body"]
    return ".".join(parts) or None


def install_host_check(app: FastAPI, allowed: frozenset[str]) -> None:
    """Every route answers only requests whose Host header names one of `allowed` (see
    `ServerLimits.host_allowlist`); others get 400 `invalid_host`."""
    listed = ", ".join(sorted(allowed))

    @app.middleware("http")
    async def check_host(request: Request, call_next):
        header = request.headers.get("host", "")
        if host_of(header) not in allowed:
            return error_response(
                f"Host {header[:100]!r} is not a name this server answers to ({listed}); "
                "start it with --allowed-hosts to add names, or with --api-key",
                400,
                code="invalid_host",
            )
        return await call_next(request)


def install_origin_check(app: FastAPI) -> None:
    """Requests that change state (every method but `SAFE_METHODS`) sent by a browser page of another
    site get 403 `cross_origin_request` (`cross_site`); clients that send no Origin (curl, SDKs,
    routers) pass. With the Host check this covers both ways a page reaches a local server: through
    its address (here) and through a name of its own that points at it (`install_host_check`)."""

    @app.middleware("http")
    async def check_origin(request: Request, call_next):
        if request.method not in SAFE_METHODS:
            reason = cross_site(request.headers)
            if reason is not None:
                message = f"{request.method} {request.url.path} refused: {reason}"
                return error_response(message, 403, code="cross_origin_request")
        return await call_next(request)


def cross_site(headers: Mapping[str, str]) -> str | None:
    """Why a request comes from a browser page of another site, or None when it does not.

    The Origin's host must be the request's own Host; ports are not compared (browsers share cookies
    across them too, and a proxy in front may change the port)."""
    if headers.get("sec-fetch-site") == "cross-site":
        return "the browser marked it Sec-Fetch-Site: cross-site"
    origin = headers.get("origin")
    if origin is None:
        return None
    origin_host = host_of(urlsplit(origin).netloc)
    if not origin_host or origin_host != host_of(headers.get("host", "")):
        return f"a page of {origin[:100]!r}, another site than this server, may not change its state"
    return None


def install_api_key(app: FastAPI, api_keys: Sequence[str], login: DashboardLogin) -> None:
    """Every route but /health and the dashboard's public ones needs `Authorization: Bearer <key>` with
    one of `api_keys`, and the request then carries that key's tenant (`key_tenant`); the dashboard's
    state also takes a cookie `login` issued. A client address that sent too many wrong keys (bearer
    headers and dashboard logins together) gets 429 until the window passes."""
    expected = [f"Bearer {key}".encode() for key in api_keys]
    tenants = _key_tenants(api_keys)

    def needs_key(path: str) -> bool:
        return path != "/health" and path not in PUBLIC_PATHS

    def signed_in(request: Request) -> bool:
        return request.url.path in COOKIE_PATHS and login.valid(request.cookies.get(COOKIE_NAME, ""))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if not needs_key(request.url.path):
            return await call_next(request)
        client = client_address(request)
        refused = too_many_failures(login, client)
        if refused is not None:
            return refused
        header = request.headers.get("authorization")
        key = None if header is None else matching_key(header.encode(), expected)
        if key is not None:
            request.state.api_key_tenant = tenants[key]
        elif not signed_in(request):
            if header is not None:  # a key was tried; a request without one guessed nothing
                login.failed(client)
            return error_response(
                "invalid or missing API key: send 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )
        return await call_next(request)


def key_tenant(request: Request) -> str | None:
    """The tenant of the API key `request` came with (`install_api_key`); None without one."""
    return getattr(request.state, "api_key_tenant", None)


def _key_tenants(api_keys: Sequence[str]) -> list[str]:
    """Each key's tenant: a digest keyed with a secret of this process, since tenants may reach logs,
    where a plain digest of a weak key could be matched against guesses."""
    secret = secrets.token_bytes(16)
    return ["key-" + hashlib.blake2b(key.encode(), key=secret, digest_size=8).hexdigest() for key in api_keys]
