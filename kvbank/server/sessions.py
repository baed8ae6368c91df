"""`POST /v1/sessions/save`, `/v1/sessions/restore` and `/v1/sessions/delete`: a prompt's KV kept
in a named file.

Session names are per tenant (the request's `cache_salt`): the default tenant's files are in the
session folder itself, a salted tenant's in a subfolder named by a digest of its salt
(`bodies.tenant_of`), so two tenants can each keep a session called "shared", and one never reads,
replaces or deletes another's. A tenant keeps at most `max_sessions_per_tenant` files (429 for a
new name beyond) and `max_session_gb_per_tenant` (507 for a save beyond); saving over one's own
session of the same name counts it once.

The pool is read and written on the engine thread (`AsyncEngine.call`), between two steps; files
are written, read and verified on a worker thread, so the engine never waits on the disk.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from kvbank.cache.session import PrefixNotCached, write_session
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.bodies import (
    DEFAULT_TENANT,
    SessionDeleteRequest,
    SessionRestoreRequest,
    SessionSaveRequest,
    template_messages,
    tenant_of,
)
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits

SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class Sessions:
    """Session files in one folder, a subfolder per salted tenant (no folder: the routes say how to
    turn sessions on)."""

    #: a prompt whose blocks are evicted between computing and saving them is computed this often
    ATTEMPTS = 3

    def __init__(self, async_engine: AsyncEngine, directory: Path | None, limits: ServerLimits | None = None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.directory = directory
        self.limits = limits or ServerLimits()
        # One save at a time per tenant, so that two cannot both fit the quota and together exceed it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def save(self, body: SessionSaveRequest) -> dict:
        path = self._path(body.session, body.cache_salt)
        prompt = {"prompt_token_ids": await self._token_ids(body), "cache_salt": body.cache_salt}
        blob = await self._packed(prompt)
        async with self._lock(path.parent):
            kept = await asyncio.to_thread(_kept_sizes, path.parent)
            self._check_quota(kept, body.session, blob.numel())
            await asyncio.to_thread(path.parent.mkdir, mode=0o700, exist_ok=True)
            size = await asyncio.to_thread(write_session, path, blob)
        return {"session": body.session, "tokens": len(prompt["prompt_token_ids"]), "bytes": size}

    async def delete(self, body: SessionDeleteRequest) -> dict:
        path = self._path(body.session, body.cache_salt)
        try:
            async with self._lock(path.parent):
                await asyncio.to_thread(path.unlink)
        except FileNotFoundError:
            raise _not_found(body.session) from None
        return {"session": body.session, "deleted": True}

    async def restore(self, body: SessionRestoreRequest) -> dict:
        path = self._path(body.session, body.cache_salt)
        try:
            session = await asyncio.to_thread(
                self.engine.sessions.read, path, body.cache_salt, f"session {body.session!r}"
            )
        except FileNotFoundError:
            raise _not_found(body.session) from None
        except ValueError as error:
            raise APIError(str(error), status=422, param="session") from error
        try:
            tokens = await self.async_engine.call(lambda engine: engine.sessions.install(session))
        except ValueError as error:
            raise APIError(str(error), status=507) from error
        return {"session": body.session, "tokens": len(tokens)}

    def _path(self, name: str, cache_salt: str | None) -> Path:
        """The file of the tenant's session `name` (its folder may not exist yet)."""
        if self.directory is None:
            raise APIError("sessions need --session-dir: this server was started without one")
        if not SESSION_NAME.fullmatch(name) or name.startswith("."):
            raise APIError(
                f"session name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'",
                param="session",
            )
        tenant = tenant_of(cache_salt)
        folder = self.directory if tenant == DEFAULT_TENANT else self.directory / tenant
        return folder / f"{name}.kv"

    def _lock(self, folder: Path) -> asyncio.Lock:
        """The lock of a tenant's folder; it lives while someone holds or awaits it."""
        return self._locks.setdefault(str(folder), asyncio.Lock())

    def _check_quota(self, kept: dict[str, int], name: str, size: int) -> None:
        """Refuse a save that would take the tenant past its session count or bytes; the session it
        replaces (same name) is not counted."""
        others = {other: kept_size for other, kept_size in kept.items() if other != name}
        count_limit = self.limits.max_sessions_per_tenant
        if count_limit is not None and len(others) >= count_limit:
            raise APIError(
                f"this tenant (cache_salt) keeps {len(others)} sessions, its limit (--max-sessions-per-tenant); "
                "delete one (POST /v1/sessions/delete) or save over one of the same name",
                status=429,
                param="session",
                code="too_many_sessions",
            )
        byte_limit = self.limits.session_bytes_per_tenant()
        used = sum(others.values())
        if byte_limit is not None and used + size > byte_limit:
            raise APIError(
                f"this session needs {size} bytes and this tenant (cache_salt) keeps {used} in other sessions, "
                f"over its limit of {byte_limit} (--max-session-gb-per-tenant "
                f"{self.limits.max_session_gb_per_tenant}); delete a session first",
                status=507,
                param="session",
                code="session_quota_exceeded",
            )

    async def _token_ids(self, body: SessionSaveRequest) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(body, name) is not None]
        if len(given) != 1:
            raise APIError(f"give exactly one of prompt, prompt_token_ids or messages (got {len(given)})")
        tokenizer = self.engine.tokenizer
        if body.prompt_token_ids is not None or isinstance(body.prompt, list):
            return list(body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt)
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send prompt_token_ids", param=given[0])
        if body.messages is not None:
            # The conversation so far, without the assistant's opening: the next turn's prompt starts with it.
            messages = template_messages(body.messages)
            return await self.async_engine.run_tokenizer(
                lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
            )
        return await self.async_engine.run_tokenizer(tokenizer.encode, body.prompt)

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


def _kept_sizes(folder: Path) -> dict[str, int]:
    """The sessions in a tenant's folder, by name, and their bytes."""
    if not folder.is_dir():
        return {}
    return {path.stem: path.stat().st_size for path in folder.glob("*.kv") if path.is_file()}


def _not_found(name: str) -> APIError:
    return APIError(f"session {name!r} does not exist", status=404, param="session", code="session_not_found")


def install_sessions(app: FastAPI, sessions: Sessions) -> None:
    """The /v1/sessions routes."""

    @app.post("/v1/sessions/save")
    async def save_session(body: SessionSaveRequest) -> dict:
        return await sessions.save(body)

    @app.post("/v1/sessions/restore")
    async def restore_session(body: SessionRestoreRequest) -> dict:
        return await sessions.restore(body)

    @app.post("/v1/sessions/delete")
    async def delete_session(body: SessionDeleteRequest) -> dict:
        return await sessions.delete(body)
