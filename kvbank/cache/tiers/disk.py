"""The disk tier: one file per entry in a directory, LRU by last use within a byte budget.

Layout: `<dir>/<first key byte hex>/<key hex>.kv`. The entry already carries its own header and
checksum (entry.py), so a file is complete on its own: there is no sidecar that could disagree.
A file is written to a temp name in its final directory and renamed into place, so a reader (this
process or another one on the same directory) sees either the whole old file, the whole new one,
or none. A crash can leave only temp files, which the next constructor removes.

No fsync: measured on this machine's ext4, a 4 MiB write costs 1.5-3 ms without it and 3-3.6 ms
with it, and what it would protect is a cache entry. A file torn by a power loss fails the entry
checksum, which the engine checks on every load, deletes, and recomputes.

Last use survives restarts as the file's mtime: a hit sets it, a restart sorts by it.

Privacy: a header holds the prompt's token ids, so the directory is created 0700 and every file
0600, whatever the umask. A directory owned by another user, or writable by group or others, is
refused at startup (whoever can write it can plant or swap entries); one readable by others is
made 0700. A read opens only a regular file (no symlinks, FIFOs or devices) and checks its size
against the tier's capacity, and the largest entry the caller asked for, before allocating for it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbank.cache.tiers.base import GIB, Buffer, Tier, TierOption

log = logging.getLogger("kvbank.tiers")

SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
#: how long writes stay off after the disk reported full, unless a delete frees space first
DISK_FULL_PAUSE_S = 30.0
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: a temp file this old is stale even if its pid names a live process (the pid was reused)
_STALE_TEMP_S = 3600.0
DIR_MODE = 0o700
FILE_MODE = 0o600


class DiskTier(Tier):
    """Entries as files under `directory`, at most `capacity_bytes` in all, least recently used evicted first.

    Safe for several threads, and for several processes of one user on one directory: a file another
    process evicted reads as a miss. Each process enforces the budget over the files it knows of
    (those found at start plus its own writes).
    """

    name = "disk"
    options = (TierOption("kv_disk_dir", "str | None", None), TierOption("kv_disk_gb", "float", 16.0))

    @classmethod
    def from_options(cls, options: Any, namespace: bytes) -> DiskTier:
        return cls(options.kv_disk_dir, int(options.kv_disk_gb * GIB))

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes} bytes")
        self.directory = Path(directory)
        self._capacity = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._writing = 0  # bytes of puts in flight, already counted against the budget
        self._last_stamp = 0  # mtime (ns) of the latest use, kept strictly increasing
        self._paused_until = 0.0  # time.monotonic() before which puts are dropped: the disk was full
        self._warned_full = False
        private_directory(self.directory, "disk tier directory")
        _check_writable(self.directory)
        self._scan()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self.lock:
            return [key in self._index for key in keys]

    def get(self, keys: Sequence[bytes], max_bytes: Sequence[int] | None = None) -> list[Buffer | None]:
        limits = max_bytes if max_bytes is not None else [self._capacity] * len(keys)
        return [self._get_one(key, min(limit, self._capacity)) for key, limit in zip(keys, limits)]

    def put(self, entries: Sequence[tuple[bytes, Buffer]]) -> int:
        return sum(self._put_one(key, memoryview(blob).cast("B")) for key, blob in entries)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            forgotten = [key for key in keys if self._forget(key)]
            if forgotten:
                self._paused_until = 0.0
        self._unlink([self._path(key) for key in forgotten])

    def _get_one(self, key: bytes, max_bytes: int) -> bytearray | None:
        with self.lock:
            if key not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
            stamp = self._stamp()
        start = time.perf_counter()
        try:
            blob = self._read(self._path(key), stamp, max_bytes)
        except OSError as e:
            self._read_failed(key, e)
            return None
        except _NotAnEntry as e:
            self._refuse(key, str(e))
            return None
        with self.lock:
            self.stats.hits += 1
            self.stats.load_bytes += len(blob)
            self.stats.load_seconds += time.perf_counter() - start
            self._resize(key, len(blob))
        return blob

    def _read(self, path: Path, stamp: int, max_bytes: int) -> bytearray:
        try:  # O_NONBLOCK: opening a FIFO planted under the name must not wait for a writer
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _NotAnEntry(f"{path}, a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _NotAnEntry(f"{path}, not a regular file")
            if st.st_size > max_bytes:
                raise _NotAnEntry(f"{path} of {st.st_size} bytes, more than the {max_bytes} its entry can have")
            blob = bytearray(st.st_size)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                n = f.readinto(blob)
            with contextlib.suppress(OSError):  # a file of root's in the directory: still a hit
                os.utime(fd, ns=(stamp, stamp))
        finally:
            os.close(fd)
        del blob[n:]  # the file was shorter than its size said: the entry checksum will refuse it
        return blob

    def _refuse(self, key: bytes, why: str) -> None:
        """A file that cannot be an entry: counted as corrupt, removed, answered as a miss."""
        with self.lock:
            self.stats.misses += 1
            self.stats.corrupt += 1
            self._forget(key)
        log.warning("disk tier: removed %s", why)
        self._unlink([self._path(key)])

    def _read_failed(self, key: bytes, e: OSError) -> None:
        with self.lock:
            self.stats.misses += 1
            if isinstance(e, FileNotFoundError) and key not in self._index:
                return  # evicted or deleted by another thread between the lookup and the open
            self.stats.errors += 1
            if isinstance(e, FileNotFoundError):
                self._forget(key)  # another process evicted it
        log.debug("disk tier: cannot read %s: %s", self._path(key), e)

    def _put_one(self, key: bytes, blob: memoryview) -> bool:
        assert len(key) == 16, key
        with self.lock:
            victims = self._make_room(key, len(blob))
            if victims is None:
                self.stats.stores_dropped += 1
                return False
            self._writing += len(blob)
            stamp = self._stamp()
        self._unlink(victims)
        start = time.perf_counter()
        try:
            self._write(self._path(key), blob, stamp)
        except OSError as e:
            self._write_failed(len(blob), e)
            return False
        with self.lock:
            self._writing -= len(blob)
            self._forget(key)  # a put of the same key by another thread meanwhile: the last rename won
            self._index[key] = len(blob)
            self.stats.bytes_used += len(blob)
            self.stats.entries = len(self._index)
            self.stats.store_bytes += len(blob)
            self.stats.store_seconds += time.perf_counter() - start
            self._warned_full = False
        return True

    def _make_room(self, key: bytes, size: int) -> list[Path] | None:
        """Under the lock: forget the key's old entry and LRU ones until `size` fits; None to drop the put."""
        if time.monotonic() < self._paused_until or size + self._writing > self._capacity:
            return None
        victims = [self._path(key)] if self._forget(key) else []
        while self.stats.bytes_used + self._writing + size > self._capacity:
            oldest = next(iter(self._index))
            self._forget(oldest)
            victims.append(self._path(oldest))
        return victims

    def _write(self, path: Path, blob: memoryview, stamp: int) -> None:
        _mkdir_private(path.parent)
        temp = path.parent / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off, never added: exact either way
                _write_all(fd, blob)
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError:
            temp.unlink(missing_ok=True)
            raise

    def _write_failed(self, size: int, e: OSError) -> None:
        disk_full = e.errno in _DISK_FULL
        with self.lock:
            self._writing -= size
            self.stats.errors += 1
            self.stats.stores_dropped += 1
            warn = disk_full and not self._warned_full
            if disk_full:
                self._paused_until = time.monotonic() + DISK_FULL_PAUSE_S
                self._warned_full = True
        if not disk_full:
            log.debug("disk tier: cannot write under %s: %s", self.directory, e)
        if warn:
            log.warning(
                "disk tier: %s is full (%s); not writing until a delete frees space or %.0f s pass",
                self.directory,
                os.strerror(e.errno),
                DISK_FULL_PAUSE_S,
            )

    def _unlink(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                with self.lock:
                    self.stats.errors += 1
                log.debug("disk tier: cannot remove %s: %s", path, e)

    def _forget(self, key: bytes) -> bool:
        """Under the lock: drop the key from the index; whether it was there."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self.stats.bytes_used -= size
        self.stats.entries = len(self._index)
        return True

    def _resize(self, key: bytes, size: int) -> None:
        """Under the lock: record the key's file size (another process may have rewritten it)."""
        if key in self._index:
            self.stats.bytes_used += size - self._index[key]
            self._index[key] = size
        self.stats.entries = len(self._index)

    def _stamp(self) -> int:
        """Under the lock: a use time later than every earlier one, so that equal clock ticks keep their order."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key[0]:02x}" / f"{key.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Index the entry files by last use and remove temp files left by crashed writers."""
        found = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or sub.is_symlink():
                continue
            for path in sub.iterdir():
                if path.name.startswith(TEMP_PREFIX):
                    _remove_if_stale(path)
                elif (key := _key_of(path)) is not None and (st := _stat(path)) is not None and _regular(st):
                    found.append((st.st_mtime_ns, key, st.st_size))
        for mtime, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes_used += size
            self._last_stamp = mtime
        self.stats.entries = len(self._index)


class _NotAnEntry(Exception):
    """A file under an entry's name that cannot be one (not a regular file, larger than the tier)."""


def private_directory(directory: Path, what: str) -> None:
    """Create `directory` 0700 if missing; refuse (ValueError) one that others own or may write, and
    make one that others may read 0700."""
    try:
        _mkdir_private(directory, parents=True)
        st = directory.stat()
    except OSError as e:
        raise ValueError(f"{what} {str(directory)!r} is not a usable directory: {e}") from None
    check_private(directory, st, what)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        log.warning("%s %s was open to other users (mode %o); making it %o", what, directory, mode, DIR_MODE)
        os.chmod(directory, DIR_MODE)


def check_private(directory: Path, st: os.stat_result, what: str) -> None:
    """Refuse (ValueError) a directory, as `st` describes it, that is not ours alone to write."""
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {str(directory)!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"{what} {str(directory)!r} is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}: "
            "its owner could change what is served"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"{what} {str(directory)!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            "they could change what is served; chmod 700 it"
        )


def _mkdir_private(directory: Path, parents: bool = False) -> None:
    """Create `directory` (and, with `parents`, its missing parents) 0700, whatever the umask."""
    if parents and not directory.parent.exists():
        _mkdir_private(directory.parent, parents=True)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(directory, DIR_MODE)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _check_writable(directory: Path) -> None:
    try:
        probe = directory / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        raise ValueError(f"disk tier directory {str(directory)!r} is not a writable directory: {e}") from None


def _key_of(path: Path) -> bytes | None:
    """The key a file name stands for, or None for a file that is not an entry."""
    if path.suffix != SUFFIX or len(path.stem) != 32:
        return None
    try:
        key = bytes.fromhex(path.stem)
    except ValueError:
        return None
    return key if path.parent.name == f"{key[0]:02x}" else None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:  # evicted by another process during the scan
        return None


def _regular(st: os.stat_result) -> bool:
    """A regular file (anything else under an entry's name is refused when read: not worth a budget)."""
    return stat.S_ISREG(st.st_mode)


def _remove_if_stale(path: Path) -> None:
    """Remove a temp file unless a live process may still be writing it (pid in its name)."""
    try:
        pid = int(path.name.removeprefix(TEMP_PREFIX).split("-")[0])
        young = time.time() - path.stat().st_mtime < _STALE_TEMP_S
    except (ValueError, OSError):
        pid, young = 0, False
    if young and pid > 0 and _alive(pid):
        return
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
