"""`POST /v1/sessions/save`, `/v1/sessions/restore` and `/v1/sessions/delete`: a prompt's KV kept
in a named file; `GET /v1/sessions` lists a tenant's.

Session names are per tenant (the request's `cache_salt`): the default tenant's files are in the
session folder itself, a salted tenant's in a subfolder named by a digest of its salt
(`bodies.tenant_of`), so two tenants can each keep a session called "shared", and one never reads,
replaces, deletes or lists another's. The folder is checked like the disk tier's (ours alone, not
writable by others) when the server starts and at every request, and everything below it is opened
without following a symlink (`cache.session.SessionFolder`): a planted link is refused, never followed.

Quotas (`quotas.SessionQuotas`): a tenant keeps at most `max_sessions_per_tenant` files (429 for a
new name beyond) and `max_session_gb_per_tenant` (507 for a save beyond); a client (`quotas.client_of`),
whatever salts it names, `max_sessions_per_client` and `max_session_gb_per_client`; the whole folder
`max_sessions` and `max_session_gb`. Saving over a session of the same name counts it once.

The pool is read and written on the engine thread (`AsyncEngine.call`), between two steps; files
are written, read and verified on a worker thread, so the engine never waits on the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from kvbank.cache.session import (
    SUFFIX,
    PrefixNotCached,
    Session,
    SessionFolder,
    UnsafeFolder,
    session_tokens,
    write_session,
)
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.bodies import (
    DEFAULT_TENANT,
    SessionDeleteRequest,
    SessionRestoreRequest,
    SessionSaveRequest,
    check_count,
    checked_token_ids,
    render_chat,
    tenant_of,
)
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits
from kvbank.server.quotas import Reservation, SessionQuotas, client_of

SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
#: a cache_salt in a URL's query (GET /v1/sessions), as access logs would show it
_SALT_IN_QUERY = re.compile(r"(?<=[?&]cache_salt=)[^&\s]*")

log = logging.getLogger("kvbank")


class Sessions:
    """Session files in one folder, a subfolder per salted tenant (no folder: the routes say how to
    turn sessions on). Raises ValueError at construction for a folder others own or may write."""

    #: a prompt whose blocks are evicted between computing and saving them is computed this often
    ATTEMPTS = 3

    def __init__(self, async_engine: AsyncEngine, directory: Path | None, limits: ServerLimits | None = None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.folder = SessionFolder(directory) if directory is not None else None
        self.limits = limits or ServerLimits()
        self.quotas = SessionQuotas(self.limits)
        # One save at a time per tenant: the quotas count the saves of other tenants still being written.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def save(self, body: SessionSaveRequest, client: str) -> dict:
        tenant, file = self._located(body.session, body.cache_salt)
        prompt = {"prompt_token_ids": await self._token_ids(body), "cache_salt": body.cache_salt}
        blob = await self._packed(prompt)
        async with self._lock(tenant):
            held = await self._in_folder(self._held)
            rid = self.quotas.reserve(held, Reservation(tenant, body.session, client, blob.numel()))
            saved = False
            try:
                size = await self._in_folder(self._write, tenant, file, blob)
                saved = True
            finally:
                self.quotas.settle(rid, saved)
        return {"session": body.session, "tokens": len(prompt["prompt_token_ids"]), "bytes": size}

    async def delete(self, body: SessionDeleteRequest) -> dict:
        tenant, file = self._located(body.session, body.cache_salt)
        try:
            async with self._lock(tenant):
                await self._in_folder(self._unlink, tenant, file)
        except FileNotFoundError:
            raise _not_found(body.session) from None
        self.quotas.forget(tenant, body.session)
        return {"session": body.session, "deleted": True}

    async def restore(self, body: SessionRestoreRequest) -> dict:
        tenant, file = self._located(body.session, body.cache_salt)
        try:
            session = await self._in_folder(self._read, tenant, file, body.cache_salt, f"session {body.session!r}")
        except FileNotFoundError:
            raise _not_found(body.session) from None
        except ValueError as error:
            raise APIError(str(error), status=422, param="session") from error
        try:
            tokens = await self.async_engine.call(lambda engine: engine.sessions.install(session))
        except ValueError as error:  # too few free blocks now: what streams and requests hold
            raise APIError(str(error), status=503, code="kv_pool_full") from error
        return {"session": body.session, "tokens": len(tokens)}

    async def listing(self, cache_salt: str | None) -> dict:
        """The tenant's sessions, by name: each one's name, bytes, tokens (as its header says; null for a file
        this engine cannot load) and modification time (Unix seconds)."""
        self._require_folder()
        return {"object": "list", "data": await self._in_folder(self._files_of, tenant_of(cache_salt))}

    def _located(self, name: str, cache_salt: str | None) -> tuple[str, str]:
        """The tenant of `cache_salt` and the file name of its session `name` (its folder may not exist yet)."""
        self._require_folder()
        if not SESSION_NAME.fullmatch(name) or name.startswith("."):
            raise APIError(
                f"session name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'",
                param="session",
            )
        return tenant_of(cache_salt), name + SUFFIX

    def _require_folder(self) -> None:
        if self.folder is None:
            raise APIError("sessions need --session-dir: this server was started without one")

    def _lock(self, tenant: str) -> asyncio.Lock:
        """The lock of a tenant's folder; it lives while someone holds or awaits it."""
        return self._locks.setdefault(tenant, asyncio.Lock())

    async def _in_folder(self, operation: Callable[..., Any], *args: Any) -> Any:
        """`operation(*args)` on a worker thread; a folder that fails its checks is a 500 whose details
        (paths) go to the log only."""
        try:
            return await asyncio.to_thread(operation, *args)
        except UnsafeFolder as error:
            log.warning("sessions: refused to use %s", error)
            raise APIError(
                "the session folder failed this server's safety checks; nothing was read or written "
                "(the server's log says why)",
                status=500,
                code="session_folder_unsafe",
            ) from None

    # --- on a worker thread ---------------------------------------------------------------------

    def _held(self) -> dict[str, dict[str, int]]:
        return {_tenant(sub): {f.name: f.size for f in files} for sub, files in self.folder.all_files().items()}

    def _write(self, tenant: str, file: str, blob: Any) -> int:
        with self.folder.opened(_sub(tenant), create=True) as fd:
            return write_session(file, blob, dir_fd=fd)

    def _read(self, tenant: str, file: str, cache_salt: str | None, label: str) -> Session:
        with self.folder.opened(_sub(tenant)) as fd:
            return self.engine.sessions.read(file, cache_salt, label, dir_fd=fd)

    def _unlink(self, tenant: str, file: str) -> None:
        with self.folder.opened(_sub(tenant)) as fd:
            os.unlink(file, dir_fd=fd)

    def _files_of(self, tenant: str) -> list[dict]:
        fmt = self.engine.sessions.entry_format
        try:
            with self.folder.opened(_sub(tenant)) as fd:
                return [
                    {
                        "session": f.name,
                        "bytes": f.size,
                        "tokens": session_tokens(f.name + SUFFIX, fmt, dir_fd=fd),
                        "modified_at": int(f.modified),
                    }
                    for f in self.folder.files(fd)
                ]
        except FileNotFoundError:  # a tenant that never saved has no folder
            return []

    async def _token_ids(self, body: SessionSaveRequest) -> list[int]:
        """The session's token ids, within the prompt limit and the vocabulary, before the engine sees them."""
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError(f"give exactly one of prompt, prompt_token_ids or messages (got {len(given)})")
        field = given[0]
        value = getattr(body, field)
        if isinstance(value, list) and field != "messages":
            return await checked_token_ids(self.async_engine, value, field)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send prompt_token_ids", param=field)
        if field == "messages":
            # The conversation so far, without the assistant's opening: the next turn's prompt starts with it.
            ids = await self.async_engine.run_tokenizer(render_chat, self.async_engine, value, False)
        else:
            try:
                self.async_engine.check_text_length([value])
            except ValueError as error:
                raise APIError(str(error), param=field) from error
            ids = await self.async_engine.run_tokenizer(tokenizer.encode, value)
        check_count(len(ids), field, "tokens", self.async_engine.max_prompt_tokens)
        return ids

    async def _packed(self, prompt: dict) -> Any:
        """The session entry, computing what the pool lacks first (as a one-token request among the others)."""
        for _ in range(self.ATTEMPTS):
            try:
                return await self.async_engine.call(lambda engine: engine.sessions.pack(prompt), queued=True)
            except PrefixNotCached:
                pass
            except ValueError as error:
                raise APIError(str(error)) from error
            try:
                async for _ in self.async_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1)):
                    pass
            except ValueError as error:
                raise APIError(str(error)) from error
        raise APIError("the pool evicted the session's blocks before they could be saved; retry later", status=503)


def _sub(tenant: str) -> str | None:
    """The subfolder of a tenant's files (None: the session folder itself)."""
    return None if tenant == DEFAULT_TENANT else tenant


def _tenant(sub: str | None) -> str:
    return DEFAULT_TENANT if sub is None else sub


def _not_found(name: str) -> APIError:
    return APIError(f"session {name!r} does not exist", status=404, param="session", code="session_not_found")


def install_sessions(app: FastAPI, sessions: Sessions) -> None:
    """The /v1/sessions routes."""

    @app.post("/v1/sessions/save")
    async def save_session(body: SessionSaveRequest, request: Request) -> dict:
        return await sessions.save(body, client_of(request))

    @app.post("/v1/sessions/restore")
    async def restore_session(body: SessionRestoreRequest) -> dict:
        return await sessions.restore(body)

    @app.post("/v1/sessions/delete")
    async def delete_session(body: SessionDeleteRequest) -> dict:
        return await sessions.delete(body)

    @app.get("/v1/sessions")
    async def list_sessions(cache_salt: str | None = None) -> dict:
        return await sessions.listing(cache_salt)

    access_log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _HideSalt) for f in access_log.filters):
        access_log.addFilter(_HideSalt())


class _HideSalt(logging.Filter):
    """Masks the cache_salt in the URLs of access log lines: a tenant's salt is what reaches its sessions."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "cache_salt=" in a for a in record.args):
            record.args = tuple(_SALT_IN_QUERY.sub("***", a) if isinstance(a, str) else a for a in record.args)
        return True
