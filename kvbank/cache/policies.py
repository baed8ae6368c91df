"""Long-context KV policies: which tokens a sequence keeps in the pool once it outgrows its budget.

One class per policy behind `KVPolicy`. A policy decides; the `KVEditor` (cache/editor.py) moves
blocks and tensors for it. Two families:

- shifting policies (`sink_window`, `context_shift`) keep the first whole blocks of a sequence
  (its sinks, or llama.cpp's `n_keep`) and a run of the most recent ones, dropping whole blocks in
  between. Positions are those of the cache: every kept key acts as if it sat at its slot, so a
  sequence can run past the model's context with constant memory.
- compressing policies (`h2o`, `snapkv`) keep, per layer and KV head, the tokens that attention
  scores rank highest, and compact them into the first slots of the sequence's blocks. Kept keys
  keep their own positions, so a sequence stays within the model's context.

Policies are spelled as strings everywhere: `full`, `sink_window(sinks=4,window=1024)`,
`h2o(heavy=256,recent=256)`, `snapkv(budget=1024,window=64,kernel=5)` (or
`snapkv(compression_ratio=0.75)`, kvpress's fraction removed), `context_shift(keep=256)`, and for
streaming sessions only (kvbank/engine/streams.py) `frame_window(frames=N,sinks=S)`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from kvbank.cache.limits import EDITS, TOKEN_EDITS, Limits
from kvbank.cache.manager import blocks_for

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq
    from kvbank.cache.frames import Frame


class KVPolicy(ABC):
    """What a sequence keeps in its KV cache, and when it lets the rest go.

    `after_step` runs once a step has computed new tokens of the sequence and evicts what the
    policy no longer keeps (through the editor); `peak_slots` bounds the cache slots the sequence
    ever holds, which is what admission reserves.
    """

    name: ClassVar[str]
    #: a sequence may run past the model's context (positions are assigned in the cache)
    unbounded: ClassVar[bool] = False
    #: the policy ranks tokens by accumulated attention (its sequences carry score buffers)
    scored: ClassVar[bool] = False
    #: what the policy does to a sequence's cache (cache/limits.py EDITS): the pool must be able to
    needs: ClassVar[frozenset[str]] = frozenset()

    def __str__(self) -> str:
        args = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)
        return f"{self.name}({args})" if args else self.name

    def check(self, limits: Limits) -> None:
        """Raise ValueError if the policy cannot run in this engine."""
        missing = sorted(self.needs - limits.kv_edits)
        if missing:
            raise ValueError(
                f"kv_policy={self} cannot run with kv_cache_dtype={limits.kv_cache_dtype!r}: the policy needs to "
                + " and to ".join(EDITS[edit] for edit in missing)
                + ", which that KV layout cannot (kv_cache_dtype='auto' can"
                + (", and so can int8 and fp8" if self.needs <= TOKEN_EDITS else "")
                + ")"
            )

    @abstractmethod
    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        """Most cache slots a sequence of this prompt and output length holds at once."""

    def pristine_blocks(self, block_size: int) -> int:
        """Blocks kept aside per sequence (unrotated copies of the kept leading blocks)."""
        return 0

    def chunk_room(self, block_size: int, max_model_len: int) -> int | None:
        """The longest prefill chunk `check` accepts in this context (None: no limit of its own)."""
        return None

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        """Prompt tokens that may come from the prefix cache instead of being computed."""
        return prompt_len

    def score_range(self, seq: PolicySeq) -> tuple[int, int] | None:
        """Token indices [first, last) whose attention over the cache the sequence accumulates."""
        return None

    @abstractmethod
    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        """Evict what the policy no longer keeps now that the step is done; returns tokens evicted."""


# --- shifting policies -------------------------------------------------------------------------


class ShiftingPolicy(KVPolicy):
    """Keeps leading whole blocks and the most recent ones; positions are assigned in the cache."""

    unbounded = True
    needs = frozenset({"rotate"})

    @abstractmethod
    def keep_tokens(self) -> int:
        """Leading tokens always kept (rounded up to whole blocks)."""

    @abstractmethod
    def blocks_to_drop(self, seq: PolicySeq, limits: Limits) -> int:
        """Whole blocks after the kept leading ones to drop now."""

    def keep_blocks(self, block_size: int) -> int:
        return blocks_for(self.keep_tokens(), block_size)

    def pristine_blocks(self, block_size: int) -> int:
        return self.keep_blocks(block_size)

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        limits = editor.limits
        keep = self.keep_blocks(limits.block_size)
        drop = self.blocks_to_drop(seq, limits)
        if drop <= 0:
            return 0
        editor.drop_blocks(seq, keep, drop)
        # Dropping shifts every later slot down; moving the leading blocks up instead keeps all
        # relative positions equal to those in the cache without touching the recent keys.
        editor.shift_leading(seq, keep, drop * limits.block_size)
        if editor.needs_rebase(seq, limits.chunk_tokens):
            editor.rebase(seq, keep)
        return drop * limits.block_size


@dataclass(frozen=True)
class Full(KVPolicy):
    """Keep everything; a sequence is limited by the model's context."""

    name: ClassVar[str] = "full"

    def check(self, limits: Limits) -> None:
        pass

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return prompt_len + max_tokens

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        return 0


@dataclass(frozen=True)
class SinkWindow(ShiftingPolicy):
    """StreamingLLM: the first `sinks` tokens plus the last `window`, block-granular.

    The sinks are the first ceil(sinks / block_size) blocks; the window is at least `window`
    tokens and less than `window + block_size` (whole blocks leave as they fall out of it). During a
    prefill chunk, its tokens also see the chunk's earlier tokens.
    """

    name: ClassVar[str] = "sink_window"
    sinks: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        _require(self, "sinks", self.sinks, minimum=0)
        _require(self, "window", self.window, minimum=1)

    def keep_tokens(self) -> int:
        return self.sinks

    def check(self, limits: Limits) -> None:
        super().check(limits)
        bs = limits.block_size
        span = self.keep_blocks(bs) * bs + self.window + bs + limits.chunk_tokens
        if span > limits.max_model_len:
            raise ValueError(
                f"kv_policy={self} with prefill chunks of {limits.chunk_tokens} tokens spans up to {span} positions, "
                f"past the model's context of {limits.max_model_len}; lower window or max_num_batched_tokens"
            )
        _fits_pool(self, self._peak(limits), limits)

    def chunk_room(self, block_size: int, max_model_len: int) -> int | None:
        return max_model_len - self.keep_blocks(block_size) * block_size - self.window - block_size

    def _peak(self, limits: Limits) -> int:
        bs = limits.block_size
        return self.keep_blocks(bs) * bs + self.window + bs + limits.chunk_tokens

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return min(prompt_len + max_tokens, self._peak(limits))

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        # Hits arrive before any eviction: with the next chunk they must fit the positions checked.
        return min(prompt_len, self._peak(limits) - limits.chunk_tokens)

    def blocks_to_drop(self, seq: PolicySeq, limits: Limits) -> int:
        recent = seq.num_slots - self.keep_blocks(limits.block_size) * limits.block_size
        return max(0, (recent - self.window) // limits.block_size)


@dataclass(frozen=True)
class ContextShift(ShiftingPolicy):
    """llama.cpp's context shift: once the context is full, drop half of what follows the first `keep`.

    `keep` is rounded up to whole blocks and the dropped half down to whole blocks.
    """

    name: ClassVar[str] = "context_shift"
    keep: int = 0

    def __post_init__(self) -> None:
        _require(self, "keep", self.keep, minimum=0)

    def keep_tokens(self) -> int:
        return self.keep

    def check(self, limits: Limits) -> None:
        super().check(limits)
        bs = limits.block_size
        kept = self.keep_blocks(bs) * bs
        # After a shift, half of what follows the kept tokens (and a block) stays; a chunk must fit beside it.
        room = (limits.max_model_len - kept) // 2 - bs
        if limits.chunk_tokens > room:
            raise ValueError(
                f"kv_policy={self} keeps {kept} tokens, which leaves room for prefill chunks of {max(room, 0)} tokens "
                f"after a shift in a context of {limits.max_model_len}, not {limits.chunk_tokens}; "
                "lower keep or max_num_batched_tokens"
            )
        _fits_pool(self, limits.max_model_len, limits)

    def chunk_room(self, block_size: int, max_model_len: int) -> int | None:
        return (max_model_len - self.keep_blocks(block_size) * block_size) // 2 - block_size

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return min(prompt_len + max_tokens, limits.max_model_len)

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        # Hits arrive before any shift: with the next chunk they must fit in the context.
        return min(prompt_len, limits.max_model_len - limits.chunk_tokens)

    def blocks_to_drop(self, seq: PolicySeq, limits: Limits) -> int:
        pending = max(1, min(seq.num_pending, limits.chunk_tokens))
        if seq.num_slots + pending <= limits.max_model_len:
            return 0
        movable = seq.num_slots - self.keep_blocks(limits.block_size) * limits.block_size
        return max(1, movable // 2 // limits.block_size)


@dataclass(frozen=True)
class FrameWindow(KVPolicy):
    """A stream's policy: its system prompt, its leading frames up to `sinks` tokens in all (whole
    frames; none when the system prompt has that many), and the last `frames` frames.

    A frame is the unit: it is kept or evicted whole, however many blocks it spans. The kept frames
    stay where they are and the leading tokens are written again just before them
    (`KVEditor.remove_tokens`), so the sequence may start a few slots into its first block.
    Positions are assigned in the cache as with sink_window. A sequence forked from a stream to
    answer a question keeps everything.
    """

    name: ClassVar[str] = "frame_window"
    unbounded: ClassVar[bool] = True
    #: frames leave from the middle of the sequence and recall brings them back in the model dtype
    needs: ClassVar[frozenset[str]] = frozenset({"rotate", "tokens", "gather"})
    frames: int = 64
    sinks: int = 4

    def __post_init__(self) -> None:
        _require(self, "frames", self.frames, minimum=1)
        _require(self, "sinks", self.sinks, minimum=0)

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return prompt_len + max_tokens  # a stream's frames vary in length: it is checked frame by frame

    def pristine_blocks(self, block_size: int) -> int:
        return 0  # the kept leading tokens are known only once the stream has its frames

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        return self.evict(seq, editor, self.victims(seq))

    def victims(self, seq: PolicySeq) -> list[Frame]:
        """The frames the window lets go now (a stream may archive them before `evict`)."""
        log = getattr(seq, "frames", None)
        return [] if log is None else log.evictable(seq.num_computed_tokens, self.frames)

    def evict(self, seq: PolicySeq, editor: KVEditor, victims: list[Frame]) -> int:
        """Remove `victims` (from `victims`) from the sequence and its cache; returns tokens evicted."""
        if not victims:
            return 0
        log = seq.frames
        first, count = victims[0].start, sum(frame.length for frame in victims)
        editor.remove_tokens(seq, first, count, keep=log.keep_tokens)
        log.evicted(victims)
        return count


# --- compressing policies ----------------------------------------------------------------------


class ScoredPolicy(KVPolicy):
    """Ranks tokens per layer and KV head by attention and compacts the kept ones."""

    scored = True
    needs = frozenset({"slots", "scores"})

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        return 0  # scores need every prompt token's attention

    def check(self, limits: Limits) -> None:
        super().check(limits)
        _fits_pool(self, self.budget_tokens(limits.max_model_len) + limits.block_size, limits)

    @abstractmethod
    def budget_tokens(self, prompt_len: int) -> int:
        """Tokens kept per KV head after compressing a prompt of `prompt_len`."""


@dataclass(frozen=True)
class H2O(ScoredPolicy):
    """Heavy hitters + recent tokens: the `heavy` tokens with the most accumulated attention and the
    `recent` last ones, per layer and KV head.

    The prompt is computed whole and compressed at its end; decoding then lets the cache grow by a
    block beyond the budget before it compacts back, so at most `heavy + recent + block_size - 1`
    tokens are held.
    """

    name: ClassVar[str] = "h2o"
    heavy: int = 256
    recent: int = 256

    def __post_init__(self) -> None:
        _require(self, "heavy", self.heavy, minimum=0)
        _require(self, "recent", self.recent, minimum=1)

    def budget_tokens(self, prompt_len: int) -> int:
        return self.heavy + self.recent

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return min(prompt_len + max_tokens, max(prompt_len, self.heavy + self.recent + limits.block_size))

    def score_range(self, seq: PolicySeq) -> tuple[int, int] | None:
        return 0, seq.num_tokens

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        budget, bs = self.heavy + self.recent, editor.limits.block_size
        if seq.num_computed_tokens < seq.num_prompt_tokens or seq.num_slots <= budget:
            return 0  # the prompt is scored whole first
        at_prompt_end = seq.num_computed_tokens == seq.num_prompt_tokens
        if not at_prompt_end and seq.num_slots < budget + bs:
            return 0
        scores = seq.kv_state.scores[..., : seq.num_slots - self.recent]
        return editor.compact(seq, keep_top(scores, self.heavy, self.recent))


@dataclass(frozen=True)
class SnapKV(ScoredPolicy):
    """SnapKV: at the end of the prompt, the last `window` prompt tokens vote (their attention,
    average-pooled over `kernel` neighbours) for the earlier tokens each KV head keeps; `budget`
    tokens per head are kept, the window included. `compression_ratio` instead keeps
    int(prompt_len * (1 - compression_ratio)) (kvpress's convention), never fewer than the window.
    Decoding runs on the compressed cache and appends to it.
    """

    name: ClassVar[str] = "snapkv"
    budget: int | None = None
    window: int = 64
    kernel: int = 5
    compression_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.budget is None and self.compression_ratio is None:
            object.__setattr__(self, "budget", 1024)
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(f"kv_policy={self} gives both budget and compression_ratio; give one")
        _require(self, "window", self.window, minimum=1)
        _require(self, "kernel", self.kernel, minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kv_policy={self}: kernel={self.kernel} must be odd (pooling is centred)")
        if self.budget is not None:
            _require(self, "budget", self.budget, minimum=self.window + 1)
        ratio = self.compression_ratio
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 <= ratio < 1.0):
            raise ValueError(f"kv_policy={self}: compression_ratio={ratio!r} must be in [0, 1)")

    def budget_tokens(self, prompt_len: int) -> int:
        if self.budget is not None:
            return self.budget
        return max(self.window, int(prompt_len * (1.0 - self.compression_ratio)))

    def peak_slots(self, prompt_len: int, max_tokens: int, limits: Limits) -> int:
        return max(prompt_len, min(prompt_len, self.budget_tokens(prompt_len)) + max_tokens)

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        return max(0, prompt_len - self.window)  # the window's queries must be computed

    def score_range(self, seq: PolicySeq) -> tuple[int, int] | None:
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            return None
        return max(0, seq.num_prompt_tokens - self.window), seq.num_prompt_tokens

    def after_step(self, seq: PolicySeq, editor: KVEditor) -> int:
        length = seq.num_prompt_tokens
        budget = self.budget_tokens(length)
        if seq.num_computed_tokens != length or seq.num_evicted or length <= budget:
            return 0
        window = min(self.window, budget)
        scores = seq.kv_state.scores[..., : length - window]
        return editor.compact(seq, snapkv_keep(scores, self.kernel, budget - window, window))


def snapkv_keep(votes: torch.Tensor, kernel: int, top: int, window: int) -> torch.Tensor:
    """SnapKV's choice: the window's votes for each earlier token ([..., heads, tokens]) pooled
    over `kernel` neighbours, then `keep_top` of them beside the window."""
    pooled = F.avg_pool1d(votes.flatten(0, -2).unsqueeze(1), kernel, 1, kernel // 2, False, False)
    return keep_top(pooled.view(votes.shape), top, window)


def keep_top(ranked: torch.Tensor, top: int, recent: int) -> torch.Tensor:
    """Slot indices to keep, in slot order, per row of `ranked` ([..., n]: the scores of the slots
    before the `recent` last ones): the `top` highest-scoring of those, then the `recent` last slots."""
    n = ranked.shape[-1]
    chosen = ranked.topk(min(top, n), dim=-1).indices.sort(dim=-1).values
    tail = torch.arange(n, n + recent, device=ranked.device).expand(*ranked.shape[:-1], recent)
    return torch.cat((chosen, tail), dim=-1)


# --- spelling ----------------------------------------------------------------------------------

POLICIES: dict[str, type[KVPolicy]] = {p.name: p for p in (Full, SinkWindow, H2O, SnapKV, ContextShift, FrameWindow)}
_SPEC = re.compile(r"^\s*([a-z_0-9]+)\s*(?:\((.*)\))?\s*$", re.S)


def parse_policy(spec: str | KVPolicy, stream: bool = False) -> KVPolicy:
    """A policy from its spelling (e.g. "sink_window(sinks=4,window=1024)"), or the policy itself.

    `frame_window` is a stream's policy (`stream=True`) and the only one a stream takes.
    """
    policy = _parse(spec)
    if stream and not isinstance(policy, FrameWindow):
        raise ValueError(f"a stream's policy={str(policy)!r} must be frame_window(frames=N,sinks=S)")
    if not stream and isinstance(policy, FrameWindow):
        raise ValueError(f"kv_policy={str(policy)!r} is a streaming session's policy: pass it to open_stream")
    return policy


def _parse(spec: str | KVPolicy) -> KVPolicy:
    if isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"kv_policy={spec!r} must be a string such as 'sink_window(sinks=4,window=1024)'")
    match = _SPEC.match(spec)
    if match is None or match.group(1) not in POLICIES:
        raise ValueError(f"kv_policy={spec!r} is not one of {', '.join(POLICIES)} (e.g. 'h2o(heavy=256,recent=256)')")
    cls = POLICIES[match.group(1)]
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in known:
            raise ValueError(
                f"kv_policy={spec!r}: {part!r} is not a parameter of {cls.name}; it takes "
                f"{', '.join(f'{name}=' for name in known) or 'none'}"
            )
        kwargs[key] = _number(spec, key, value)
    return cls(**kwargs)


def _number(spec: str, key: str, value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"kv_policy={spec!r}: {key}={value!r} must be a number") from None


def _require(policy: KVPolicy, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"kv_policy={policy.name}: {name}={value!r} must be an integer >= {minimum}")


def _fits_pool(policy: KVPolicy, tokens: int, limits: Limits) -> None:
    needed = blocks_for(tokens, limits.block_size) + policy.pristine_blocks(limits.block_size)
    if needed > limits.num_blocks:
        raise ValueError(
            f"kv_policy={policy} holds up to {tokens} tokens per sequence ({needed} KV blocks), "
            f"but the pool has only {limits.num_blocks} blocks"
        )


#: a stream's policy when none is given, spelled as users write it
DEFAULT_STREAM_POLICY = str(FrameWindow())
