"""`h2o`: heavy hitters (most accumulated attention) plus recent tokens, per layer and KV head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import ScoredPolicy, keep_top, require_int

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq


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
        require_int(self, "heavy", self.heavy, minimum=0)
        require_int(self, "recent", self.recent, minimum=1)

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
