"""Session files (llama.cpp's slot save/restore) for one engine: a prompt's cached blocks to a file
and back into the prefix cache, through cache/session.py."""

from __future__ import annotations

import os

import torch

from kvbank.cache.manager import KVCacheManager
from kvbank.cache.prefix import root_hash
from kvbank.cache.session import Session, install_session, pack_session, read_session, write_session
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers.entry import EntryFormat
from kvbank.engine.admission import Admission
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.prompts import PromptType


class SessionFiles:
    """Packs, writes, reads and installs session files of one engine's pool."""

    def __init__(
        self,
        admission: Admission,
        manager: KVCacheManager,
        storage: KVStorage,
        entry_format: EntryFormat,
        namespace: bytes,
        enabled: bool,
    ) -> None:
        self.admission = admission
        self.manager = manager
        self.storage = storage
        self.entry_format = entry_format
        self.namespace = namespace
        self.enabled = enabled

    def prompt(self, tokens_or_request: PromptType | RequestOutput, cache_salt: str | None = None) -> dict:
        """What a session covers, as a prompt dict of token ids and cache salt.

        `tokens_or_request` is a prompt as `add_request` takes it, or a RequestOutput (its prompt
        and its first completion's tokens). `cache_salt`, when given, must agree with the prompt's.
        """
        self._require()
        if isinstance(tokens_or_request, RequestOutput):
            output = tokens_or_request
            tokens_or_request = [*output.prompt_token_ids, *(output.outputs[0].token_ids if output.outputs else ())]
        parsed = self.admission.parse(tokens_or_request)
        if None not in (cache_salt, parsed.salt) and cache_salt != parsed.salt:
            raise ValueError("cache_salt differs from the prompt's own cache_salt; give one of them")
        return {
            "prompt_token_ids": parsed.token_ids,
            "cache_salt": cache_salt if cache_salt is not None else parsed.salt,
        }

    def pack(self, tokens_or_request: PromptType | RequestOutput, cache_salt: str | None = None) -> torch.Tensor:
        """The session file's bytes for what `prompt` makes of the arguments, read from the pool.

        Raises PrefixNotCached (a ValueError) unless every whole block of it is cached: run the
        prompt first (one token is enough) and pack again.
        """
        prompt = self.prompt(tokens_or_request, cache_salt)
        root = root_hash(self.namespace, prompt["cache_salt"])
        return pack_session(self.entry_format, self.manager.pool, self.storage, prompt["prompt_token_ids"], root)

    def save(
        self, tokens_or_request: PromptType | RequestOutput, path: str | os.PathLike, cache_salt: str | None = None
    ) -> int:
        """Write the session's cached blocks (see `pack`) to one file at `path`, atomically;
        returns the bytes written."""
        return write_session(path, self.pack(tokens_or_request, cache_salt))

    def read(
        self,
        path: str | os.PathLike,
        cache_salt: str | None = None,
        name: str | None = None,
        dir_fd: int | None = None,
    ) -> Session:
        """Read and verify a session file, at `path` relative to the folder `dir_fd` when given (safe off
        the engine thread: it does not touch the pool).

        A missing file is FileNotFoundError; a corrupted, truncated, foreign or wrongly salted
        one a ValueError naming the file (as `name`, by default its path) and the reason.
        """
        self._require()
        return read_session(path, self.entry_format, root_hash(self.namespace, cache_salt), name, dir_fd)

    def install(self, session: Session) -> list[int]:
        """Put a read session's blocks in the pool as cached prefix blocks; returns its token ids.
        A later prompt starting with them finds all their whole blocks cached (until evicted)."""
        install_session(self.manager.pool, self.storage, session)
        return list(session.token_ids)

    def _require(self) -> None:
        if self.manager.groups is not None:
            raise ValueError(
                "session files are not supported with the hybrid sliding-window KV cache (a file holds every "
                "layer of every block); load the model with swa_full=True (--swa-full)"
            )
        if not self.enabled:
            raise ValueError(
                "sessions need enable_prefix_caching=True: a loaded session is found through the prefix cache"
            )
