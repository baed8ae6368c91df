"""Streaming sessions: endless inputs (video frames, a transcript, a log) through a bounded KV cache.

A stream is one sequence that never samples and never finishes: its system prompt is computed
once, each appended frame computes only its own tokens, and between frames the sequence is
parked (it keeps its blocks but is not scheduled). Its policy, `frame_window` (cache/policies/frame_window.py),
keeps the system prompt, the sink frames and the last N frames, evicting whole frames.

A question forks the stream: a new sequence shares every block (copy-on-write), computes the
question's tokens after the kept frames, generates its answer and is freed, so the stream itself
is never touched and any number of questions, from any number of users, share its frames. A
question or frame sent while earlier frames are still computing waits for them.

The engine's stream host does this on the engine's thread (kvbank/engine/stream_host.py);
`StreamSession` (kvbank/engine/llm.py) is the blocking Python handle `LLM.open_stream` returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbank.cache.frames import Frame
from kvbank.cache.policies import FrameWindow
from kvbank.cache.recall import FrameArchive
from kvbank.engine.outputs import Reports, RequestMetrics, RequestOutput
from kvbank.engine.sequence import Request, Sequence

#: what a frame may be: text, token ids, embedding rows [tokens, hidden], or a prompt dict of one of them
FrameType = str | list[int] | torch.Tensor | dict[str, Any]


class PoolFull(ValueError):
    """A stream's frame or question that the KV pool cannot hold now, even by preempting others."""


@dataclass(slots=True)
class FrameInfo:
    """What an append did: the frame's index and tokens, an identical earlier frame still held
    (`repeat_of`), whether it was skipped as such a repeat, and what the stream keeps now."""

    index: int
    num_tokens: int
    repeat_of: int | None
    skipped: bool
    kept_frames: int
    kept_tokens: int
    evicted_frames: int


@dataclass
class FrameOutput(RequestOutput):
    """A frame request's only output, once the frame is computed (or skipped)."""

    frame: FrameInfo | None = None


@dataclass(eq=False)
class FrameRequest(Reports):
    """An appended frame (or a stream's system prompt, `frame=None`), finished once computed."""

    request_id: str
    stream: Stream
    frame: Frame | None
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    repeat_of: int | None = None
    skipped: bool = False
    num_cached_tokens: int = 0
    finished: bool = False
    output_type = FrameOutput

    def extra(self) -> dict:
        if self.frame is None:
            return {"frame": None}
        log = self.stream.seq.frames
        info = FrameInfo(
            self.frame.index,
            self.frame.length,
            self.repeat_of,
            self.skipped,
            log.kept_frames,
            self.stream.seq.num_computed_tokens,
            log.num_evicted,
        )
        return {"frame": info}


@dataclass(eq=False)
class Stream:
    """A stream inside the engine: its sequence, its frames still computing, its waiting questions."""

    stream_id: str
    seq: Sequence
    policy: FrameWindow
    #: appended to each text frame, so that frames do not run into each other
    separator: str
    #: appended to each text question (the chat template's end of turn and the assistant's start)
    question_suffix: str = ""
    pending: deque[FrameRequest] = field(default_factory=deque)
    waiting_asks: list[Request] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    #: evicted frames in a KV tier, recallable by relevance (None without a tier), and the mean
    #: queries of a question that asks nothing in particular (computed at the first recall)
    archive: FrameArchive | None = None
    neutral_queries: torch.Tensor | None = None
    #: the most tokens the stream may hold at once (None: no reservation, frames are checked one by
    #: one against the pool), and the KV blocks reserved for that when it opened
    reserve_tokens: int | None = None
    reserved_blocks: int = 0
    #: a fork: the blocks it still shares with its source are the source's in the promise, so it
    #: counts as its own only the blocks it holds alone (StreamHost.promised)
    forked: bool = False

    @property
    def held_blocks(self) -> int:
        """KV blocks the stream's own sequence holds (its window and the unrotated leading copies)."""
        return len(self.seq.block_table) + len(self.seq.pristine_blocks)

    @property
    def outstanding_blocks(self) -> int:
        """Reserved blocks the stream does not hold yet: promised to it, so not to other streams' work."""
        return max(0, self.reserved_blocks - self.held_blocks)

    def stats(self) -> dict[str, int]:
        """Frames appended, kept and evicted, tokens kept, and the KV blocks the stream holds."""
        log = self.seq.frames
        return {
            "frames": log.num_appended,
            "kept_frames": log.kept_frames,
            "evicted_frames": log.num_evicted,
            "kept_tokens": self.seq.num_computed_tokens,
            "system_tokens": log.system_len,
            "sink_tokens": log.keep_tokens,
            "blocks": self.held_blocks,
            "reserved_blocks": self.reserved_blocks,
            "rope_offset": self.seq.rope_offset,
            **({f"recall_{k}": v for k, v in vars(self.archive.stats).items()} if self.archive else {}),
            "recallable_frames": len(self.archive.frames) if self.archive else 0,
        }


def stream_room(seq: Sequence, max_model_len: int, rope_len: int) -> int:
    """Most tokens a stream's sequence (or a question forked from it) can hold: its positions start
    at its lead once they restart at the first slot, and run to the end of the rotary tables."""
    return min(max_model_len, rope_len - seq.lead)
