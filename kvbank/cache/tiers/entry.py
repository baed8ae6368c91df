"""The one on-the-wire and on-disk form of KV blocks outside the pool: a self-describing entry.

    prefix  (40 bytes)  magic "KVBK", format version, flags, header length, payload length,
                        and a 16-byte digest of everything else: the prefix's first 24 bytes,
                        the header and the payload
    header  (JSON)      model fingerprint, dtype, KV format, block size, tensor layout, the chain
                        key and parent key, the first block's position and the token ids
    payload             for each tensor of the layout in turn, its rows for all the entry's blocks

Everything a reader needs to refuse an entry is in it: a truncated blob fails the lengths, a
flipped byte fails the digest, another model or KV format fails the header. Disk files, Redis
values and session files all use this form, so there is no state where payload and metadata
disagree.

The digest is an xxh3-128 checksum, which only detects accidents: anyone who can write the store
can change K/V and recompute it. With a tier key (`EntryFormat.key`) it is a keyed BLAKE2b MAC
instead and the KEYED flag is set, so an entry changed by anyone without the key is refused. A
reader accepts only entries written the way it writes them: keyed with its key, or unkeyed.

A header is parsed only after the digest matched, and even then as untrusted input: its size is
bounded by what the payload's blocks can need, its nesting and its fields' types are checked, and
every way it can be wrong is a BadEntry.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import json
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from kvbank.cache.tiers.base import Buffer

MAGIC = b"KVBK"
#: 2: the digest covers the prefix's fields too, and may be a keyed MAC (flag KEYED)
VERSION = 2
KEYED = 0x1
_PREFIX = struct.Struct("<4sHHIQ16s")
PREFIX_BYTES = _PREFIX.size
_DIGESTED = PREFIX_BYTES - 16  # the prefix's bytes before the digest
#: header bytes beyond the token ids: field names, keys, layout (a few dozen tensors at most)
_HEADER_BASE_BYTES = 64 * 1024
#: most bytes one token id takes in the header ("-2147483648,")
_TOKEN_BYTES = 12
#: deepest nesting a valid header has: {"layout": [[dtype, [dims]]]}
_HEADER_DEPTH = 4

#: (dtype name, shape of one block's slice) for every pool tensor, in storage order
Layout = tuple[tuple[str, tuple[int, ...]], ...]


class BadEntry(ValueError):
    """An entry that must not be served; `reason` is one of truncated, oversize, checksum, mac, header, model,
    format, mismatch."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EntryFormat:
    """What this engine's pool looks like; an entry is served only if its header says the same.

    `key` (32 bytes, from `tier_key`) signs every entry written and is required of every entry read;
    None writes and accepts unkeyed checksums only. `max_blocks` (the pool's size) bounds what an
    entry may hold, so that a reader can refuse an oversized file before it allocates for it.
    """

    model: str
    dtype: str
    kv_format: str
    block_size: int
    layout: Layout
    key: bytes | None = field(default=None, repr=False)
    max_blocks: int | None = None

    def payload_bytes(self, num_blocks: int) -> int:
        """Payload bytes of `num_blocks` blocks: each tensor's rows start 16-byte aligned."""
        return _offsets(self.layout, num_blocks)[-1]

    def max_header_bytes(self, payload_len: int) -> int:
        """The largest header an entry with `payload_len` payload bytes can need (a session also keeps the
        tokens of an unfinished last block)."""
        tokens = (payload_len // max(1, _block_bytes(self.layout)) + 1) * self.block_size
        return _HEADER_BASE_BYTES + _TOKEN_BYTES * tokens

    def max_entry_bytes(self, num_blocks: int | None = None) -> int | None:
        """The largest entry of at most `num_blocks` blocks, by default `max_blocks` (None: no bound)."""
        blocks = self.max_blocks if num_blocks is None else num_blocks
        if blocks is None:
            return None
        payload = self.payload_bytes(blocks)
        return PREFIX_BYTES + self.max_header_bytes(payload) + payload


def tier_key(secret: str | bytes | None) -> bytes | None:
    """The 32-byte MAC key for a tier key as configured (any length of text; None: no key)."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.blake2b(raw, digest_size=32, person=b"kvbank-tier-key").digest()


def digest(key: bytes | None, *parts: Buffer) -> bytes:
    """The 16-byte digest of `parts`: a BLAKE2b MAC under `key`, else an xxh3-128 checksum."""
    h = hashlib.blake2b(key=key, digest_size=16) if key is not None else xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class EntryInfo:
    """Which blocks an entry holds: `num_blocks` blocks from chain position `position`.

    `token_ids` are the entry's tokens (whole blocks for a chunk; a session also keeps the tokens
    of its unfinished last block), `key` the chain key of the last whole block, `parent` the chain
    key before the first (the root key at position 0).
    """

    key: bytes
    parent: bytes
    position: int
    num_blocks: int
    token_ids: tuple[int, ...]
    kind: str = "chunk"


def pack(
    fmt: EntryFormat, info: EntryInfo, fill: Callable[[list[torch.Tensor]], None], pin: bool = False
) -> torch.Tensor:
    """One entry as a uint8 tensor; `fill` writes the blocks into the per-tensor views it is given."""
    header = json.dumps(
        {
            "model": fmt.model,
            "dtype": fmt.dtype,
            "kv_format": fmt.kv_format,
            "block_size": fmt.block_size,
            "layout": [[dtype, list(shape)] for dtype, shape in fmt.layout],
            "kind": info.kind,
            "key": info.key.hex(),
            "parent": info.parent.hex(),
            "position": info.position,
            "num_blocks": info.num_blocks,
            "token_ids": list(info.token_ids),
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (_align(PREFIX_BYTES + len(header)) - PREFIX_BYTES - len(header))  # aligned payload views
    payload_len = fmt.payload_bytes(info.num_blocks)
    blob = torch.empty(PREFIX_BYTES + len(header) + payload_len, dtype=torch.uint8, pin_memory=pin)
    blob[PREFIX_BYTES : PREFIX_BYTES + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    fill(payload_views(fmt, blob[PREFIX_BYTES + len(header) :], info.num_blocks))
    body = memoryview(blob.numpy())[PREFIX_BYTES:]
    flags = KEYED if fmt.key is not None else 0
    fields = _PREFIX.pack(MAGIC, VERSION, flags, len(header), payload_len, bytes(16))[:_DIGESTED]
    prefix = fields + digest(fmt.key, fields, body)
    blob[:PREFIX_BYTES] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    return blob


def unpack(fmt: EntryFormat, blob: Buffer) -> tuple[EntryInfo, list[torch.Tensor]]:
    """The entry's description and per-tensor payload views; raises BadEntry for anything unservable."""
    view = memoryview(blob).cast("B")
    header_len, payload_len = check_prefix(fmt, view[:PREFIX_BYTES], len(view))
    if not hmac.compare_digest(digest(fmt.key, view[:_DIGESTED], view[PREFIX_BYTES:]), view[_DIGESTED:PREFIX_BYTES]):
        if fmt.key is not None:
            raise BadEntry("mac", "the MAC does not match the tier key: another key wrote it, or it was changed")
        raise BadEntry("checksum", "the header and payload do not match the checksum")
    header = _parse_header(bytes(view[PREFIX_BYTES : PREFIX_BYTES + header_len]))
    info = _info(header)
    if header["model"] != fmt.model:
        raise BadEntry("model", f"written by model {header['model']}, this is {fmt.model}")
    theirs = (header["dtype"], header["kv_format"], header["block_size"])
    ours = (fmt.dtype, fmt.kv_format, fmt.block_size)
    # the layout as JSON gives it: equal lists, or a layout checked for its shape and then compared
    if theirs != ours or (header["layout"] != _layout_json(fmt.layout) and _layout(header["layout"]) != fmt.layout):
        raise BadEntry("format", f"dtype/KV format/block size/layout {theirs} differ from {ours}")
    if payload_len != fmt.payload_bytes(info.num_blocks) or (PREFIX_BYTES + header_len) % _ALIGN:
        raise BadEntry("header", f"{payload_len} payload bytes do not hold {info.num_blocks} blocks")
    if not info.num_blocks * fmt.block_size <= len(info.token_ids) < (info.num_blocks + 1) * fmt.block_size:
        raise BadEntry("header", f"{len(info.token_ids)} token ids for {info.num_blocks} blocks of {fmt.block_size}")
    with warnings.catch_warnings():  # an immutable blob (bytes from Redis) is only ever read
        warnings.simplefilter("ignore", UserWarning)
        payload = torch.frombuffer(view, dtype=torch.uint8, offset=PREFIX_BYTES + header_len, count=payload_len)
    return info, payload_views(fmt, payload, info.num_blocks)


def check_prefix(fmt: EntryFormat, prefix: Buffer, size: int) -> tuple[int, int]:
    """(header length, payload length) of an entry of `size` bytes that starts with `prefix`, if they can
    be this reader's: raises BadEntry before anything is read beyond the prefix, or allocated for it."""
    if size < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        raise BadEntry("truncated", f"{size} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, flags, header_len, payload_len, _ = _PREFIX.unpack(prefix[:PREFIX_BYTES])
    if magic != MAGIC:
        raise BadEntry("header", "not a kvbank entry")  # says nothing of what the bytes are: they may be a secret
    if version != VERSION:
        raise BadEntry("header", f"format version {version}, this kvbank reads version {VERSION}")
    if flags & ~KEYED:
        raise BadEntry("header", f"unknown flags {flags:#x}")
    if bool(flags & KEYED) != (fmt.key is not None):
        signed = "signed with a tier key" if flags & KEYED else "not signed"
        mine = "has a tier key" if fmt.key is not None else "has no tier key"
        raise BadEntry("mac", f"the entry is {signed}, and this engine {mine}")
    if (most := fmt.max_entry_bytes()) is not None and size > most:
        raise BadEntry("oversize", f"{size} bytes, more than a pool of {fmt.max_blocks} blocks can hold ({most})")
    if size != PREFIX_BYTES + header_len + payload_len:
        raise BadEntry("truncated", f"{size} bytes, but the prefix promises {PREFIX_BYTES + header_len + payload_len}")
    if header_len > fmt.max_header_bytes(payload_len):
        raise BadEntry("header", f"a {header_len}-byte header is more than {payload_len} payload bytes can need")
    return header_len, payload_len


def unverified_info(header: bytes) -> EntryInfo:
    """What an entry's header (the `check_prefix` header length of bytes after its prefix) says it holds,
    parsed as untrusted input but not checked against the digest: for listing entries, never for serving."""
    return _info(_parse_header(header))


def _parse_header(text: bytes) -> dict:
    """The header's fields, type-checked; refused before parsing if it nests deeper than a valid one."""
    brackets = _STRINGS.sub(b'""', text).translate(None, _NOT_BRACKETS)  # JSON nests by brackets outside strings
    if brackets and max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets))) > _HEADER_DEPTH:
        raise BadEntry("header", f"the header nests deeper than {_HEADER_DEPTH} levels")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadEntry("header", f"unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise BadEntry("header", f"the header is a JSON {type(header).__name__}, not an object")
    for name, kind in _HEADER_FIELDS.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise BadEntry("header", f"header field {name!r} is missing or not a {kind.__name__}")
    return header


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEP = [1 if chr(b) in "[{" else -1 for b in range(256)]  # by byte value
_HEADER_FIELDS = {
    "model": str,
    "dtype": str,
    "kv_format": str,
    "block_size": int,
    "layout": list,
    "kind": str,
    "key": str,
    "parent": str,
    "position": int,
    "num_blocks": int,
    "token_ids": list,
}


def _info(header: dict) -> EntryInfo:
    key, parent = _hex16(header["key"]), _hex16(header["parent"])
    token_ids = header["token_ids"]
    if token_ids and not (set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < 2**31):
        raise BadEntry("header", "the token ids are not all integers in [0, 2**31)")
    if header["position"] < 0 or header["num_blocks"] < 1:
        raise BadEntry("header", f"position {header['position']} and {header['num_blocks']} blocks")
    return EntryInfo(key, parent, header["position"], header["num_blocks"], tuple(token_ids), header["kind"])


def _hex16(text: str) -> bytes:
    """A chain key from its hex (the message does not echo it: header bytes are not for error messages)."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise BadEntry("header", "a chain key is not 16 bytes in hex")
    return key


def _layout(layout: list) -> Layout:
    def valid(item) -> bool:
        return (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], list)
            and all(type(n) is int for n in item[1])
        )

    if not all(valid(item) for item in layout):
        raise BadEntry("header", "the layout is not a list of [dtype, [dims]]")
    return tuple((dtype, tuple(shape)) for dtype, shape in layout)


def payload_views(fmt: EntryFormat, payload: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The payload cut into one [num_blocks, *shape] tensor per layout entry (views, no copies)."""
    offsets = _offsets(fmt.layout, num_blocks)
    dtype = _single_dtype(fmt.layout)
    if dtype is not None:
        # One typed view of the payload and a strided window per tensor, one call each (the offsets
        # are 16-byte aligned, so whole elements of any dtype).
        typed = payload.view(_DTYPES[dtype])
        base, itemsize = typed.storage_offset(), typed.element_size()
        return [
            typed.as_strided((num_blocks, *shape), _contiguous_strides((num_blocks, *shape)), base + offset // itemsize)
            for (_, shape), offset in zip(fmt.layout, offsets)
        ]
    views = []
    for (dtype, shape), offset in zip(fmt.layout, offsets):
        size = num_blocks * _numel(shape) * _itemsize(dtype)
        views.append(payload[offset : offset + size].view(_DTYPES[dtype]).view(num_blocks, *shape))
    return views


@functools.lru_cache(maxsize=256)
def _offsets(layout: Layout, num_blocks: int) -> tuple[int, ...]:
    """Where each tensor's rows start in the payload of `num_blocks` blocks, and the payload's length."""
    offsets = [0]
    for dtype, shape in layout:
        offsets.append(offsets[-1] + _align(num_blocks * _numel(shape) * _itemsize(dtype)))
    return tuple(offsets)


@functools.lru_cache(maxsize=64)
def _single_dtype(layout: Layout) -> str | None:
    """The dtype of every tensor of the layout, if they share one."""
    dtypes = {dtype for dtype, _ in layout}
    return dtypes.pop() if len(dtypes) == 1 else None


@functools.lru_cache(maxsize=64)
def _block_bytes(layout: Layout) -> int:
    return sum(_numel(shape) * _itemsize(dtype) for dtype, shape in layout)


@functools.lru_cache(maxsize=64)
def _layout_json(layout: Layout) -> list:
    """The layout as an entry's parsed header holds it (compared, never changed)."""
    return [[dtype, list(shape)] for dtype, shape in layout]


@functools.lru_cache(maxsize=256)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1]
    for n in reversed(shape[1:]):
        strides.append(strides[-1] * n)
    return tuple(reversed(strides))


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float32,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int32,
        torch.int16,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """How a layout names a dtype."""
    name = str(dtype).removeprefix("torch.")
    assert name in _DTYPES, name
    return name


_ALIGN = 16


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _itemsize(dtype: str) -> int:
    return _DTYPES[dtype].itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
