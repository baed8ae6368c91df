"""Session files: a prefix's KV blocks saved to one file and loaded back into the pool (llama.cpp's slot save).

A session file is one entry of the tier form (cache/tiers/entry.py) with kind "session": the
header holds every token of the session, the payload the K/V of its whole blocks, the key the
chain key of the last whole block and the parent the chain's root. The root covers the cache
salt, so the file proves which salt it was saved under without holding the salt: loading
recomputes the chain from the tokens and refuses a file whose keys do not match.

Packing and installing touch the pool and run on the engine thread; reading, writing and
verifying a file touch neither, so a server does them off that thread.

A session file holds a conversation's tokens, so it is written 0600. A name may come from a
client, so reading opens only a regular file (never through a symlink), refuses one larger than
the pool could hold before allocating for it, and never echoes a refused file's bytes.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbank.cache.blocks import Block, BlockPool
from kvbank.cache.prefix import block_hash
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers.entry import PREFIX_BYTES, BadEntry, EntryFormat, EntryInfo, check_prefix, pack, unpack

SESSION_KIND = "session"
FILE_MODE = 0o600
#: no symlink followed, and no wait for a writer if the name is a FIFO
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PrefixNotCached(ValueError):
    """The pool lacks some of the session's whole blocks: compute the prefix, then save again."""


@dataclass(slots=True)
class Session:
    """A verified session: its tokens, their chain keys and the K/V of its whole blocks."""

    token_ids: list[int]
    root: bytes
    keys: list[bytes]
    views: list[torch.Tensor]


def chain_keys(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain key of every whole block of `token_ids`, from `root`."""
    keys: list[bytes] = []
    parent = root
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


def cached_chain(pool: BlockPool, keys: list[bytes], token_ids: Sequence[int], root: bytes, bs: int) -> list[Block]:
    """The indexed blocks holding the longest run of the chain `keys` (one per whole block of `bs` tokens)."""
    blocks: list[Block] = []
    parent: bytes | int = root
    for i, key in enumerate(keys):
        found = pool.lookup(key, tuple(token_ids[i * bs : (i + 1) * bs]), parent)
        if found is None:
            break
        blocks.append(found)
        parent = found.serial
    return blocks


def pack_session(
    fmt: EntryFormat, pool: BlockPool, storage: KVStorage, token_ids: list[int], root: bytes
) -> torch.Tensor:
    """The session entry of `token_ids`; raises PrefixNotCached unless every whole block is in the pool."""
    bs = fmt.block_size
    if len(token_ids) < bs:
        raise ValueError(f"a session of {len(token_ids)} tokens fills no block of {bs}; there is nothing to save")
    keys = chain_keys(root, token_ids, bs)
    blocks = cached_chain(pool, keys, token_ids, root, bs)
    if len(blocks) < len(keys):
        raise PrefixNotCached(
            f"only {len(blocks) * bs} of the session's {len(keys) * bs} whole-block tokens are cached; "
            "compute the prefix first"
        )
    info = EntryInfo(keys[-1], root, 0, len(keys), tuple(token_ids), SESSION_KIND)
    ids = [block.block_id for block in blocks]
    return pack(fmt, info, lambda views: storage.read_blocks(ids, views))


def write_session(path: str | Path, blob: torch.Tensor) -> int:
    """Write `blob` to `path` atomically (a temp file in the same folder, then a rename); returns its bytes."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's mode too, but this file must be private whatever Python does
        with os.fdopen(fd, "wb") as file:
            file.write(memoryview(blob.numpy()))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return blob.numel()


def read_session(path: str | Path, fmt: EntryFormat, root: bytes, name: str | None = None) -> Session:
    """Read and verify a session file for the chain starting at `root` (this model, format and salt).

    Raises FileNotFoundError for a missing file and ValueError naming the file (as `name`, by
    default "session file PATH") and the reason for anything else: a symlink or other non-regular
    file, an unreadable, oversized, truncated, corrupted, unsigned, foreign or wrongly salted one.
    """
    name = name or f"session file {path}"
    try:
        info, views = unpack(fmt, _read_entry(path, fmt))
    except BadEntry as error:
        raise ValueError(f"{name} cannot be loaded: {error}") from None
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        why = "a symbolic link" if error.errno == errno.ELOOP else os.strerror(error.errno or errno.EIO).lower()
        raise ValueError(f"{name} cannot be loaded: {why}") from None
    if info.kind != SESSION_KIND:
        raise ValueError(f"{name} holds a {info.kind!r} entry, not a session")
    keys = chain_keys(root, info.token_ids, fmt.block_size)
    if info.parent != root:
        raise ValueError(f"{name} was saved under another cache_salt: give the cache_salt it was saved with")
    if (info.position, info.num_blocks, info.key) != (0, len(keys), keys[-1] if keys else None):
        raise ValueError(f"{name} is inconsistent: its chain keys do not match its token ids")
    return Session(list(info.token_ids), root, keys, views)


def _read_entry(path: str | Path, fmt: EntryFormat) -> bytearray:
    """The file's bytes, once it is known to be a regular file whose prefix fits `fmt` (BadEntry if not)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadEntry("header", "not a regular file")
        check_prefix(fmt, os.pread(fd, PREFIX_BYTES, 0), st.st_size)
        blob = bytearray(st.st_size)
        with open(fd, "rb", buffering=0, closefd=False) as file:
            n = file.readinto(blob)
    finally:
        os.close(fd)
    del blob[n:]  # shorter than its size said (written meanwhile): unpack refuses it as truncated
    return blob


def install_session(pool: BlockPool, storage: KVStorage, session: Session) -> int:
    """Copy the session's blocks the pool lacks into free blocks and index them as cached; returns
    how many were copied. Refused (ValueError) when the pool has too few free blocks."""
    bs = storage.block_size
    tokens = session.token_ids
    have = cached_chain(pool, session.keys, tokens, session.root, bs)
    missing = len(session.keys) - len(have)
    for block in have:
        pool.share(block)  # so that taking free blocks cannot evict the head of the chain
    try:
        if missing > pool.num_free:
            raise ValueError(
                f"the session needs {missing} free KV blocks but the pool has {pool.num_free} of {pool.num_blocks} free"
            )
        blocks = [pool.take() for _ in range(missing)]
        storage.write_blocks([b.block_id for b in blocks], [v[len(have) :] for v in session.views])
        parent: bytes | int = have[-1].serial if have else session.root
        for i, block in enumerate(blocks):
            position = len(have) + i
            block_tokens = tuple(tokens[position * bs : (position + 1) * bs])
            serial = pool.register(block, session.keys[position], block_tokens, parent, position)
            if serial != block.serial:  # a hash collision: the rest of the chain stays unindexed
                break
            parent = serial
        for block in reversed(blocks):  # tails are released first, so they are evicted first
            pool.release(block)
    finally:
        for block in reversed(have):
            pool.release(block)
    return missing
