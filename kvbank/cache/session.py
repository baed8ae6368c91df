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

A server keeps its sessions in a `SessionFolder`: one private folder (checked like the disk tier's:
ours alone, not writable by others) with a private subfolder per tenant. Whoever could plant a symlink
there could send a save elsewhere or a load to another file, so every component below the folder is
opened relative to its parent's descriptor (`dir_fd`) with O_NOFOLLOW: a symlink anywhere under it is
refused, never followed, and a save replaces one planted under its name instead of writing through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbank.cache.blocks import Block, BlockPool
from kvbank.cache.prefix import block_hash
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers.disk import DIR_MODE, FILE_MODE, check_private, private_directory
from kvbank.cache.tiers.entry import (
    PREFIX_BYTES,
    BadEntry,
    EntryFormat,
    EntryInfo,
    check_prefix,
    pack,
    unpack,
    unverified_info,
)

SESSION_KIND = "session"
SUFFIX = ".kv"
#: no symlink followed, and no wait for a writer if the name is a FIFO
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def write_session(path: str | Path, blob: torch.Tensor, dir_fd: int | None = None) -> int:
    """Write `blob` to `path` (relative to the folder `dir_fd` when given) atomically: a temp file in the
    same folder, then a rename, which replaces whatever has the name (a symlink too) without following it;
    returns its bytes."""
    path = Path(path)
    temp = str(path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off: exact either way
        with os.fdopen(fd, "wb") as file:
            file.write(memoryview(blob.numpy()))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    return blob.numel()


def read_session(
    path: str | Path, fmt: EntryFormat, root: bytes, name: str | None = None, dir_fd: int | None = None
) -> Session:
    """Read and verify a session file (at `path` relative to the folder `dir_fd` when given) for the chain
    starting at `root` (this model, format and salt).

    Raises FileNotFoundError for a missing file and ValueError naming the file (as `name`, by
    default "session file PATH") and the reason for anything else: a symlink or other non-regular
    file, an unreadable, oversized, truncated, corrupted, unsigned, foreign or wrongly salted one.
    """
    name = name or f"session file {path}"
    try:
        info, views = unpack(fmt, _read_entry(path, fmt, dir_fd))
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


def _read_entry(path: str | Path, fmt: EntryFormat, dir_fd: int | None = None) -> bytearray:
    """The file's bytes, once it is known to be a regular file whose prefix fits `fmt` (BadEntry if not)."""
    fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
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


def session_tokens(path: str | Path, fmt: EntryFormat, dir_fd: int | None = None) -> int | None:
    """How many tokens a session file says it holds, from its prefix and header alone (not verified against
    its digest: for a listing, never for a load); None for a file that cannot be a session of `fmt`."""
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        header_len, _ = check_prefix(fmt, os.pread(fd, PREFIX_BYTES, 0), size)
        info = unverified_info(os.pread(fd, header_len, PREFIX_BYTES))
    except (OSError, BadEntry):
        return None
    finally:
        os.close(fd)
    return len(info.token_ids) if info.kind == SESSION_KIND else None


@dataclass(frozen=True, slots=True)
class SessionFile:
    """One session file as a folder lists it: its name (without the suffix), bytes and mtime (Unix seconds)."""

    name: str
    size: int
    modified: float


class UnsafeFolder(ValueError):
    """A folder under the session folder that is not a private directory of ours: a symlink, a file, or one
    others own or may write. Nothing is read from it or written to it."""


class SessionFolder:
    """Session files in one private folder (`directory` itself for the top level, `sub` for a subfolder of
    it); see the module docstring for how every path below `directory` is opened."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        private_directory(self.directory, "session directory")  # created 0700; refused if others may write it

    @contextlib.contextmanager
    def opened(self, sub: str | None, create: bool = False) -> Iterator[int]:
        """A descriptor of the folder `sub` (None: the top level), made 0700 if `create` and missing.

        FileNotFoundError when it is missing (and not `create`); UnsafeFolder when it, or the top level,
        is not a private directory of ours."""
        root = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._check(root, "session directory", self.directory)
            if sub is None:
                yield root
                return
            with self._subfolder(root, sub, create) as fd:
                yield fd
        finally:
            os.close(root)

    def files(self, dir_fd: int) -> list[SessionFile]:
        """The session files in the folder `dir_fd` (regular files with the suffix; temp files and anything
        else left out), by name."""
        found = []
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        found.append(SessionFile(name.removesuffix(SUFFIX), st.st_size, st.st_mtime))
        return sorted(found, key=lambda f: f.name)

    def all_files(self) -> dict[str | None, list[SessionFile]]:
        """Every session file in the folder and its subfolders, by subfolder (None: the top level); a
        subfolder that is not a private directory (a symlink included) is left out, not entered."""
        with self.opened(None) as root:
            out: dict[str | None, list[SessionFile]] = {None: self.files(root)}
            with os.scandir(root) as entries:
                subs = [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
            for sub in subs:
                with contextlib.suppress(FileNotFoundError, UnsafeFolder), self._subfolder(root, sub, False) as fd:
                    out[sub] = self.files(fd)
        return out

    @contextlib.contextmanager
    def _subfolder(self, root: int, sub: str, create: bool) -> Iterator[int]:
        assert "/" not in sub and not sub.startswith("."), sub
        created = False
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, DIR_MODE, dir_fd=root)
                created = True
        try:
            fd = os.open(sub, _DIR_FLAGS, dir_fd=root)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeFolder(f"{self.directory / sub} is not a directory (a symbolic link or a file)") from None
            raise
        try:
            if created:
                os.fchmod(fd, DIR_MODE)  # the umask may have taken bits off mkdir's mode
            self._check(fd, "session subfolder", self.directory / sub)
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _check(fd: int, what: str, path: Path) -> None:
        try:
            check_private(path, os.fstat(fd), what)
        except ValueError as e:
            raise UnsafeFolder(str(e)) from None


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
