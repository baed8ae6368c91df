"""The one on-the-wire and on-disk form of KV blocks outside the pool: a self-describing entry.

    prefix  (40 bytes)  magic "KVBK", format version, header length, payload length,
                        xxh3-128 checksum of header + payload
    header  (JSON)      model fingerprint, dtype, KV format, block size, tensor layout, the chain
                        key and parent key, the first block's position and the token ids
    payload             for each tensor of the layout in turn, its rows for all the entry's blocks

Everything a reader needs to refuse an entry is in it: a truncated blob fails the lengths, a
flipped byte fails the checksum, another model or KV format fails the header. Disk files, Redis
values and session files all use this form, so there is no state where payload and metadata
disagree.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvbank.cache.tiers.base import Buffer

MAGIC = b"KVBK"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ16s")
PREFIX_BYTES = _PREFIX.size

#: (dtype name, shape of one block's slice) for every pool tensor, in storage order
Layout = tuple[tuple[str, tuple[int, ...]], ...]


class BadEntry(ValueError):
    """An entry that must not be served; `reason` is one of truncated, checksum, header, model, format, mismatch."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EntryFormat:
    """What this engine's pool looks like; an entry is served only if its header says the same."""

    model: str
    dtype: str
    kv_format: str
    block_size: int
    layout: Layout

    def payload_bytes(self, num_blocks: int) -> int:
        """Payload bytes of `num_blocks` blocks: each tensor's rows start 16-byte aligned."""
        return sum(_align(num_blocks * _numel(shape) * _itemsize(dtype)) for dtype, shape in self.layout)


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
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header), payload_len, xxhash.xxh3_128_digest(body))
    blob[:PREFIX_BYTES] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    return blob


def unpack(fmt: EntryFormat, blob: Buffer) -> tuple[EntryInfo, list[torch.Tensor]]:
    """The entry's description and per-tensor payload views; raises BadEntry for anything unservable."""
    view = memoryview(blob).cast("B")
    if len(view) < PREFIX_BYTES:
        raise BadEntry("truncated", f"{len(view)} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, _, header_len, payload_len, checksum = _PREFIX.unpack(view[:PREFIX_BYTES])
    if magic != MAGIC or version != VERSION:
        raise BadEntry("header", f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}")
    if len(view) != PREFIX_BYTES + header_len + payload_len:
        raise BadEntry(
            "truncated", f"{len(view)} bytes, but the prefix promises {PREFIX_BYTES + header_len + payload_len}"
        )
    if xxhash.xxh3_128_digest(view[PREFIX_BYTES:]) != checksum:
        raise BadEntry("checksum", "the header and payload do not match the checksum")
    try:
        header = json.loads(bytes(view[PREFIX_BYTES : PREFIX_BYTES + header_len]))
        info = EntryInfo(
            bytes.fromhex(header["key"]),
            bytes.fromhex(header["parent"]),
            int(header["position"]),
            int(header["num_blocks"]),
            tuple(int(t) for t in header["token_ids"]),
            str(header["kind"]),
        )
        layout = tuple((str(dtype), tuple(int(n) for n in shape)) for dtype, shape in header["layout"])
    except (ValueError, KeyError, TypeError) as e:
        raise BadEntry("header", f"unreadable header ({e})") from None
    if header["model"] != fmt.model:
        raise BadEntry("model", f"written by model {header['model']}, this is {fmt.model}")
    theirs = (header["dtype"], header["kv_format"], header["block_size"], layout)
    ours = (fmt.dtype, fmt.kv_format, fmt.block_size, fmt.layout)
    if theirs != ours:
        raise BadEntry("format", f"dtype/KV format/block size/layout {theirs[:3]} differ from {ours[:3]}")
    if payload_len != fmt.payload_bytes(info.num_blocks) or (PREFIX_BYTES + header_len) % _ALIGN:
        raise BadEntry("header", f"{payload_len} payload bytes do not hold {info.num_blocks} blocks")
    with warnings.catch_warnings():  # an immutable blob (bytes from Redis) is only ever read
        warnings.simplefilter("ignore", UserWarning)
        payload = torch.frombuffer(view, dtype=torch.uint8, offset=PREFIX_BYTES + header_len, count=payload_len)
    return info, payload_views(fmt, payload, info.num_blocks)


def payload_views(fmt: EntryFormat, payload: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The payload cut into one [num_blocks, *shape] tensor per layout entry (views, no copies)."""
    views = []
    offset = 0
    for dtype, shape in fmt.layout:
        size = num_blocks * _numel(shape) * _itemsize(dtype)
        views.append(payload[offset : offset + size].view(_DTYPES[dtype]).view(num_blocks, *shape))
        offset += _align(size)
    return views


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
