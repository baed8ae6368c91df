"""A stream's frames: where each lies among its sequence's tokens, and which leave next.

Plain bookkeeping for `FrameWindow` (cache/policies/frame_window.py) and the streams (engine/streams.py). A
stream sequence's token ids are exactly what its cache holds (the system prompt, then its kept
frames) followed by frames not computed yet. Token i sits at slot `seq.lead + i`: when a frame
leaves, the kept frames stay where they are and the leading tokens (system prompt and sinks) are
written again right before them, so the sequence then starts `lead` slots into its first block
(`KVEditor.remove_tokens`; attention starts each row there).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import deque

import torch


def token_slots(table: list[int], lo: int, hi: int, block_size: int, lead: int = 0) -> torch.Tensor:
    """Flat pool slots of tokens lo..hi-1 of a sequence with block table `table` whose token i is
    at slot `lead + i`."""
    index = torch.arange(lo, hi) + lead
    return torch.tensor(table, dtype=torch.long)[index // block_size] * block_size + index % block_size


@dataclasses.dataclass(slots=True)
class Frame:
    """One appended frame: its place among the stream sequence's tokens and its content hash."""

    index: int
    start: int
    length: int
    digest: bytes
    #: embedding rows of a frame given as embeddings, until they are computed
    embeds: torch.Tensor | None
    #: kept for good as part of the stream's sinks
    sink: bool
    #: its tokens are in the cache (or were, before it was evicted)
    done: bool = False
    #: given as embeddings: its token ids are placeholders
    embedded: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


def frame_digest(token_ids: list[int], embeds: torch.Tensor | None) -> bytes:
    """A frame's content hash: its embedding bytes (little-endian float32) or its token ids."""
    h = hashlib.blake2b(digest_size=16)
    if embeds is not None:
        h.update(b"embeds" + str(tuple(embeds.shape)).encode())
        h.update(embeds.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes())
    else:
        h.update(b"tokens" + b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


class FrameLog:
    """The frames a stream holds in its cache (and those still to compute), oldest first."""

    def __init__(self, system_len: int, sinks: int) -> None:
        self.system_len = system_len
        self.sinks = sinks
        self.frames: deque[Frame] = deque()
        self.num_appended = 0
        self.num_evicted = 0
        #: leading tokens never evicted: the system prompt and the sink frames
        self.keep_tokens = system_len

    def add(self, start: int, length: int, digest: bytes, embeds: torch.Tensor | None) -> Frame:
        """Record a frame appended at token index `start`."""
        sink = self.keep_tokens < self.sinks and all(f.sink for f in self.frames)
        frame = Frame(self.num_appended, start, length, digest, embeds, sink, embedded=embeds is not None)
        if sink:
            self.keep_tokens += length
        self.frames.append(frame)
        self.num_appended += 1
        return frame

    def repeat_of(self, digest: bytes) -> int | None:
        """The index of the newest held frame with this content, if any."""
        for frame in reversed(self.frames):
            if frame.digest == digest:
                return frame.index
        return None

    def evictable(self, computed: int, window: int) -> list[Frame]:
        """The oldest computed non-sink frames beyond the newest `window` of them."""
        done = [f for f in self.frames if not f.sink and f.end <= computed]
        return done[: max(0, len(done) - window)]

    def pending_ends(self, computed: int) -> list[int]:
        """Where each part not computed yet ends (token counts): the system prompt, then each frame."""
        ends = [self.system_len] if computed < self.system_len else []
        return ends + [f.end for f in self.frames if f.end > computed]

    def evicted(self, victims: list[Frame]) -> None:
        """Forget `victims` (the oldest non-sink frames); later frames move down by their tokens."""
        count = sum(f.length for f in victims)
        gone = {id(f) for f in victims}
        kept = [f for f in self.frames if id(f) not in gone]
        for frame in kept:
            if frame.start >= victims[0].start:
                frame.start -= count
        self.frames = deque(kept)
        self.num_evicted += len(victims)
        for frame in victims:
            frame.done, frame.embeds = True, None

    def computed(self, num_computed: int) -> None:
        """Mark frames now in the cache done and drop their embedding rows (a stream is never recomputed)."""
        for frame in self.frames:
            if not frame.done and frame.end <= num_computed:
                frame.done, frame.embeds = True, None

    def input_embeds(self, start: int, count: int) -> list[tuple[int, torch.Tensor]]:
        """(row offset, rows) of embedding frames among tokens [start, start + count)."""
        rows = []
        for frame in self.frames:
            if frame.embeds is None:
                continue
            lo, hi = max(start, frame.start), min(start + count, frame.end)
            if lo < hi:
                rows.append((lo - start, frame.embeds[lo - frame.start : hi - frame.start]))
        return rows

    def embedded_spans(self) -> list[tuple[int, int]]:
        """[start, end) token ranges of the held frames given as embeddings (placeholder ids)."""
        return [(f.start, f.end) for f in self.frames if f.embedded]

    def copy(self) -> FrameLog:
        """An independent log of the same frames (a forked stream's)."""
        log = FrameLog(self.system_len, self.sinks)
        log.frames = deque(dataclasses.replace(f) for f in self.frames)
        log.num_appended, log.num_evicted, log.keep_tokens = self.num_appended, self.num_evicted, self.keep_tokens
        return log

    @property
    def kept_frames(self) -> int:
        return len(self.frames)
