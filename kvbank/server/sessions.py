"""`POST /v1/sessions/save` and `/v1/sessions/restore`: a prompt's KV kept in a named file.

The pool is read and written on the engine thread (`AsyncEngine.call`), between two steps; files
are written, read and verified on a worker thread, so the engine never waits on the disk.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from kvbank.cache.session import PrefixNotCached, write_session
from kvbank.engine.params import SamplingParams
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.bodies import SessionRestoreRequest, SessionSaveRequest, template_messages
from kvbank.server.errors import APIError

SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class Sessions:
    """Session files in one folder (none: the routes say how to turn sessions on)."""

    #: a prompt whose blocks are evicted between computing and saving them is computed this often
    ATTEMPTS = 3

    def __init__(self, async_engine: AsyncEngine, directory: Path | None) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.directory = directory

    async def save(self, body: SessionSaveRequest) -> dict:
        path = self._path(body.session)
        prompt = {"prompt_token_ids": await self._token_ids(body), "cache_salt": body.cache_salt}
        blob = await self._packed(prompt)
        size = await asyncio.to_thread(write_session, path, blob)
        return {"session": body.session, "tokens": len(prompt["prompt_token_ids"]), "bytes": size}

    async def restore(self, body: SessionRestoreRequest) -> dict:
        path = self._path(body.session)
        try:
            session = await asyncio.to_thread(
                self.engine.sessions.read, path, body.cache_salt, f"session {body.session!r}"
            )
        except FileNotFoundError:
            raise APIError(f"session {body.session!r} does not exist", status=404, param="session") from None
        except ValueError as error:
            raise APIError(str(error), status=422, param="session") from error
        try:
            tokens = await self.async_engine.call(lambda engine: engine.sessions.install(session))
        except ValueError as error:
            raise APIError(str(error), status=507) from error
        return {"session": body.session, "tokens": len(tokens)}

    def _path(self, name: str) -> Path:
        if self.directory is None:
            raise APIError("sessions need --session-dir: this server was started without one")
        if not SESSION_NAME.fullmatch(name) or name.startswith("."):
            raise APIError(
                f"session name {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'",
                param="session",
            )
        return self.directory / f"{name}.kv"

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
                return await self.async_engine.call(lambda engine: engine.sessions.pack(prompt))
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


def install_sessions(app: FastAPI, sessions: Sessions) -> None:
    """The /v1/sessions routes."""

    @app.post("/v1/sessions/save")
    async def save_session(body: SessionSaveRequest) -> dict:
        return await sessions.save(body)

    @app.post("/v1/sessions/restore")
    async def restore_session(body: SessionRestoreRequest) -> dict:
        return await sessions.restore(body)
