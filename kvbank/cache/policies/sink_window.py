"""`sink_window`: StreamingLLM's attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import ShiftingPolicy, fits_pool, require_int

if TYPE_CHECKING:
    from kvbank.cache.editor import PolicySeq


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
        require_int(self, "sinks", self.sinks, minimum=0)
        require_int(self, "window", self.window, minimum=1)

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
        fits_pool(self, self._peak(limits), limits)

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
