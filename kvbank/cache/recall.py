"""Recall of a stream's evicted frames by relevance (ReKV's idea), from a KV tier.

When a stream with a tier evicts frames, each frame's K/V leaves the pool for the tier, with its
keys rotated back to no position, in the pool's own format (each layer through its codecs, the
frame taken as one block of its tokens: int8 or fp8 codes and scales, about half a bfloat16 copy's
bytes; int4/int2 codes with one key range per channel over the frame), and the stream keeps
a summary of it in RAM: the mean of its keys per layer and KV head. A question may then recall the
`k` frames whose mean keys best match the question's mean queries and, for frames given as tokens,
that share the question's rarer words (see `FrameArchive.choose`); they
are loaded, rotated to the places they take, and put back between the sinks and the kept frames of
the question's own copy of the cache. The stream itself never changes.

What it costs: per evicted frame, one read of its K/V from the pool and one tier write (on the
offload's store thread, so a slow tier does not stall the engine); per
question with recall, a forward of the question alone (for its queries), the tier reads, and a
copy of the whole kept window into the question's blocks (positions are reassigned there).

Entries are self-describing and checksummed like every other tier entry (signed with the tier
key when the engine has one, see entry.py): a frame whose bytes do not match its digest, its
stream's namespace, its signing or its recorded length is skipped, counted and deleted.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from kvbank.attention.rope import apply_rope, rotation_tables
from kvbank.cache.frames import Frame, token_slots
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.offload import KVOffload
from kvbank.cache.quant import CodecPair
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers.entry import KEYED, digest

MAGIC = b"KVBFRAME"
#: 2: a flags field (KEYED), and the digest covers the header too; 3: each layer in its codecs' format
VERSION = 3
# magic, version, flags, namespace, digest, layers, tokens, heads, dim; the digest covers the rest
_HEADER = struct.Struct("<8sHH16s16sIIII")
_DIGEST_AT = 28


@dataclass(slots=True)
class Archived:
    """An evicted frame the stream can recall: where it is, its tokens and its mean keys."""

    index: int
    key: bytes
    token_ids: list[int]
    mean_keys: torch.Tensor  # [layers, kv_heads, head_dim], float16
    #: given as embeddings: its token ids are placeholders
    embedded: bool = False
    #: the namespace of the archive that stored it (a fork's archive also holds its source's frames)
    namespace: bytes = b""

    def words(self) -> frozenset[int]:
        """The distinct token ids it was given as (none for a frame given as embeddings)."""
        return frozenset() if self.embedded else frozenset(self.token_ids)


@dataclass
class RecallStats:
    archived: int = 0
    recalled: int = 0
    missing: int = 0
    corrupt: int = 0
    #: questions that asked to recall but ran on the kept frames alone (nothing came back, or no room)
    fallbacks: int = 0


def rotate(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """keys [layers, n, heads, dim] rotated by `positions` [n] (float32)."""
    cos, sin = rotation_tables(positions, inv_freq)
    return apply_rope(keys.float(), cos[None, :, None], sin[None, :, None])


class RecallSource(Protocol):
    """What recall reads of a stream's sequence."""

    token_ids: list[int]
    block_table: list[int]
    pristine_blocks: list[int]
    num_computed_tokens: int
    rope_offset: int
    lead: int


def splice_recalled(
    manager: KVCacheManager,
    storage: KVStorage,
    source: RecallSource,
    keep: int,
    loaded: list[tuple[Archived, torch.Tensor, torch.Tensor]],
    inv_freq: torch.Tensor,
) -> list[int]:
    """A fresh block table holding the sinks (the first `keep` tokens), the recalled frames, then the
    kept frames, at positions 0, 1, ... (every key re-rotated once from where it was)."""
    bs, kept = storage.block_size, source.num_computed_tokens
    recalled = sum(k.shape[1] for _, k, _ in loaded)
    sink_k, sink_v = storage.gather_tokens(token_slots(source.pristine_blocks, 0, keep, bs))  # unrotated
    keys, values, position = [sink_k.float()], [sink_v], keep
    for _, k, v in loaded:
        keys.append(rotate(k, torch.arange(position, position + k.shape[1]), inv_freq))
        values.append(v)
        position += k.shape[1]
    recent_k, recent_v = storage.gather_tokens(token_slots(source.block_table, keep, kept, bs, source.lead))
    # a kept token at slot lead + i sits at position lead + i + rope_offset; here at i + recalled
    keys.append(rotate(recent_k, torch.full((kept - keep,), recalled - source.rope_offset - source.lead), inv_freq))
    values.append(recent_v)
    table = manager.take_blocks(blocks_for(kept + recalled, bs))
    if (kept + recalled) % bs:
        storage.open_block(table[-1])
    storage.scatter_tokens(token_slots(table, 0, kept + recalled, bs), torch.cat(keys, 1), torch.cat(values, 1))
    return table


class FrameArchive:
    """A stream's evicted frames in a tier, and their summaries in RAM (the newest `limit` of them)."""

    def __init__(
        self,
        offload: KVOffload,
        namespace: bytes,
        inv_freq: torch.Tensor,
        limit: int,
        codecs: list[CodecPair],
        holders: dict[bytes, int] | None = None,
    ) -> None:
        #: writes and deletes go through the offload's store thread; reads wait for them to land
        self.offload = offload
        self.tier = offload.tiers[0]
        self.key = offload.format.key
        #: each layer's (key, value) codecs: frames are stored as the pool stores them
        self.codecs = codecs
        self.namespace = hashlib.blake2b(namespace, digest_size=16).digest()
        # the layers' formats, part of every entry's key and header: one stored in another format is
        # never read as this one
        self.formats = ",".join(f"{k.name}/{v.name}" for k, v in codecs).encode()
        self.inv_freq = inv_freq.float().cpu()
        self.limit = limit
        self.frames: deque[Archived] = deque()
        #: tier key -> how many archives hold that entry (shared between a stream and its forks)
        self.holders = holders if holders is not None else {}
        self.stats = RecallStats()

    def store(self, frame: Frame, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Archive a frame whose keys [layers, n, heads, dim] sit rotated at positions first..first+n-1."""
        plain = rotate(keys, -torch.arange(first, first + keys.shape[1]), self.inv_freq).to(keys.dtype)
        key = hashlib.blake2b(self._tag(self.namespace) + frame.digest + struct.pack("<Q", frame.index), digest_size=16)
        key = key.digest()
        if self.offload.store_later(self.tier, key, self._pack(plain, values)):
            mean = plain.float().mean(dim=1).half()
            self.frames.append(Archived(frame.index, key, list(token_ids), mean, frame.embedded, self.namespace))
            self.holders[key] = self.holders.get(key, 0) + 1
            self.stats.archived += 1
        while len(self.frames) > self.limit:
            self._let_go(self.frames.popleft())

    def inherit(self, source: FrameArchive) -> None:
        """Hold every frame `source` holds (a fork's archive: frames its source evicted before it)."""
        for archived in source.frames:
            self.frames.append(archived)
            self.holders[archived.key] = self.holders.get(archived.key, 0) + 1
        while len(self.frames) > self.limit:
            self._let_go(self.frames.popleft())

    def _let_go(self, archived: Archived) -> None:
        """This archive no longer holds `archived`; its tier entry goes when no archive does."""
        left = self.holders.get(archived.key, 1) - 1
        if left > 0:
            self.holders[archived.key] = left
        else:
            self.holders.pop(archived.key, None)
            self.offload.delete_later(self.tier, [archived.key])

    def archive(self, storage: KVStorage, seq: RecallSource, frames: list[Frame]) -> None:
        """Archive `frames` of `seq`, about to be evicted, from the pool."""
        for frame in frames:
            slots = token_slots(seq.block_table, frame.start, frame.end, storage.block_size, seq.lead)
            keys, values = storage.gather_tokens(slots)
            first = frame.start + seq.lead + seq.rope_offset  # positions are slots + rope_offset
            self.store(frame, seq.token_ids[frame.start : frame.end], keys, values, first)

    def choose(
        self, queries: torch.Tensor, baseline: torch.Tensor, count: int, question: list[int] | None = None
    ) -> list[Archived]:
        """The `count` archived frames most relevant to a question, in stream order.

        `queries` and `baseline` are mean queries [layers, kv_heads, head_dim] of the question and
        of a question that asks nothing in particular. Every frame's keys share a large common part,
        and every question's queries another: scored raw, frames rank by those parts alone. So the
        keys are centred on all archived frames' mean and the queries on the baseline's, and a
        frame scores the dot product of what is its own with what is the question's own, averaged
        over layers and heads.

        With the question's token ids (`question`), frames given as tokens also score the words
        they share with it (`word_scores`), and the two scores, each scaled to [0, 1] over the
        archive, are averaged: keys rank frames by what they are about, words find the one that
        names what was asked. Where no frame shares a rare word with the question (or every frame
        was given as embeddings) the keys rank alone.
        """
        if not self.frames or count <= 0:
            return []
        means = torch.stack([a.mean_keys for a in self.frames]).float()
        centred = means - means.mean(dim=0, keepdim=True)
        asked = (queries.float() - baseline.float()).unsqueeze(0)
        scores = (centred * asked).sum(dim=-1).mean(dim=(1, 2))
        frames = list(self.frames)
        words = word_scores(frames, question) if question else None
        if words is not None and words.max() > 0:
            spread = scores.max() - scores.min()
            keys = (scores - scores.min()) / spread if spread > 0 else torch.zeros_like(scores)
            scores = 0.5 * keys + 0.5 * words / words.max()
        top = scores.topk(min(count, len(frames))).indices.tolist()
        return sorted((frames[i] for i in top), key=lambda a: a.index)

    def load(self, chosen: list[Archived], layout: tuple[int, int, int], dtype: torch.dtype):
        """(archived, unrotated keys, values) of each chosen frame the tier still holds intact."""
        found = []
        self.offload.flush()  # frames evicted just now may still be on their way to the tier
        shapes = [(layout[0], len(archived.token_ids), *layout[1:]) for archived in chosen]
        sizes = [self._frame_bytes(shape) for shape in shapes]  # a longer value is refused before it is read
        for archived, shape, blob in zip(chosen, shapes, self.tier.get([a.key for a in chosen], sizes)):
            if blob is None:
                self.stats.missing += 1
                continue
            unpacked = self._unpack(blob, shape, dtype, archived.namespace)
            if unpacked is None:
                self.stats.corrupt += 1
                self.offload.delete_later(self.tier, [archived.key])
                continue
            found.append((archived, *unpacked))
            self.stats.recalled += 1
        return found

    def close(self) -> None:
        """Forget every archived frame (the stream is closed); entries a fork still holds stay."""
        while self.frames:
            self._let_go(self.frames.popleft())

    def _tag(self, namespace: bytes) -> bytes:
        """What an entry's header names: the storing stream's namespace and this archive's formats."""
        return hashlib.blake2b(namespace + b"\0" + self.formats, digest_size=16).digest()

    def _pack(self, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        parts = []
        for (k_codec, v_codec), k, v in zip(self.codecs, keys, values):
            for codec, x in ((k_codec, k), (v_codec, v)):
                stored = codec.quantize(x.unsqueeze(0))  # the frame as one block of its tokens
                parts.extend(_raw(stored[name]) for name in sorted(stored))
        payload = b"".join(parts)
        flags = KEYED if self.key is not None else 0
        header = bytearray(_HEADER.pack(MAGIC, VERSION, flags, self._tag(self.namespace), bytes(16), *keys.shape))
        header[_DIGEST_AT : _DIGEST_AT + 16] = digest(self.key, _undigested(header), payload)
        return bytes(header) + payload

    def _parts(self, shape: tuple[int, ...]) -> list[list[tuple]]:
        """Each codec's components in name order, as _pack writes them: (name, shape, dtype, bytes)."""
        _, tokens, heads, dim = shape
        return [
            [(name, size, kind, torch.Size(size).numel() * kind.itemsize) for name, (size, kind) in sorted(c.items())]
            for c in (codec.components(tokens, heads, dim) for pair in self.codecs for codec in pair)
        ]

    def _frame_bytes(self, shape: tuple[int, ...]) -> int:
        """The bytes of a frame of `shape` as _pack writes it."""
        return _HEADER.size + sum(part[3] for side in self._parts(shape) for part in side)

    def _unpack(self, blob, shape: tuple[int, ...], dtype: torch.dtype, namespace: bytes):
        data = memoryview(blob).cast("B")
        codecs = [codec for pair in self.codecs for codec in pair]  # K, V of layer 0, then layer 1, ...
        if len(codecs) != 2 * shape[0] or len(data) != self._frame_bytes(shape):
            return None
        magic, version, flags, tag, stored_digest, *stored = _HEADER.unpack_from(data)
        ours = (MAGIC, VERSION, KEYED if self.key is not None else 0, self._tag(namespace), shape)
        if (magic, version, flags, tag, tuple(stored)) != ours:
            return None
        payload = data[_HEADER.size :]
        if not hmac.compare_digest(digest(self.key, _undigested(data[: _HEADER.size]), payload), stored_digest):
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sides, at = [], 0
        for codec, side in zip(codecs, self._parts(shape)):
            stored = {}
            for name, size, kind, count in side:
                piece = raw[at : at + count]
                if at % kind.itemsize:  # after an odd number of bytes (int4 zero points): realign
                    piece = piece.clone()
                stored[name] = piece.view(kind).view(1, *size)
                at += count
            sides.append(codec.dequantize(stored, torch.float32)[0].to(dtype))
        return torch.stack(sides[0::2]), torch.stack(sides[1::2])


def word_scores(frames: list[Archived], question: list[int]) -> torch.Tensor:
    """Per frame, the rarity of the question's tokens it holds: each distinct token of the question
    found in the frame adds log(n / m), n the frames given as tokens and m those holding it, so a
    token every frame holds adds nothing and one only this frame holds adds the most (the inverse
    document frequency of text retrieval, counting presence, not repeats)."""
    held = [a.words() for a in frames]
    asked = set(question)
    texts = sum(1 for a in frames if not a.embedded)
    counts: dict[int, int] = {}
    for words in held:
        for token in asked & words:
            counts[token] = counts.get(token, 0) + 1
    rarity = {token: math.log(texts / m) for token, m in counts.items()}
    return torch.tensor([sum(rarity[t] for t in asked & words) for words in held], dtype=torch.float32)


def _undigested(header) -> bytes:
    """The header's bytes that its digest covers: all but the digest."""
    return bytes(header[:_DIGEST_AT]) + bytes(header[_DIGEST_AT + 16 : _HEADER.size])


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes()
