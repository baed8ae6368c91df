"""`context_shift`: llama.cpp's context shift."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import ShiftingPolicy, fits_pool, require_int

if TYPE_CHECKING:
    from kvbank.cache.editor import PolicySeq


@dataclass(frozen=True)
class ContextShift(ShiftingPolicy):
    """llama.cpp's context shift: once the context is full, drop half of what follows the first `keep`.

    `keep` is rounded up to whole blocks and the dropped half down to whole blocks.
    """

    name: ClassVar[str] = "context_shift"
    keep: int = 0

    def __post_init__(self) -> None:
        require_int(self, "keep", self.keep, minimum=0)

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
        fits_pool(self, limits.max_model_len, limits)

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
