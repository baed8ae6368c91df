"""`snapkv`: the prompt's last tokens vote for the earlier ones each KV head keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvbank.cache.limits import Limits
from kvbank.cache.policies.base import ScoredPolicy, keep_top, require_int

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq


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
        require_int(self, "window", self.window, minimum=1)
        require_int(self, "kernel", self.kernel, minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kv_policy={self}: kernel={self.kernel} must be odd (pooling is centred)")
        if self.budget is not None:
            require_int(self, "budget", self.budget, minimum=self.window + 1)
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
