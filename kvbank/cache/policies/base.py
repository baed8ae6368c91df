"""The policy seam: `KVPolicy`, its two families (shifting and scored) and the helpers they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import fields
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbank.cache.limits import EDITS, TOKEN_EDITS, Limits
from kvbank.cache.manager import blocks_for

if TYPE_CHECKING:
    from kvbank.cache.editor import KVEditor, PolicySeq


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


class ScoredPolicy(KVPolicy):
    """Ranks tokens per layer and KV head by attention and compacts the kept ones."""

    scored = True
    needs = frozenset({"slots", "scores"})

    def prefix_limit(self, prompt_len: int, limits: Limits) -> int:
        return 0  # scores need every prompt token's attention

    def check(self, limits: Limits) -> None:
        super().check(limits)
        fits_pool(self, self.budget_tokens(limits.max_model_len) + limits.block_size, limits)

    @abstractmethod
    def budget_tokens(self, prompt_len: int) -> int:
        """Tokens kept per KV head after compressing a prompt of `prompt_len`."""


def keep_top(ranked: torch.Tensor, top: int, recent: int) -> torch.Tensor:
    """Slot indices to keep, in slot order, per row of `ranked` ([..., n]: the scores of the slots
    before the `recent` last ones): the `top` highest-scoring of those, then the `recent` last slots."""
    n = ranked.shape[-1]
    chosen = ranked.topk(min(top, n), dim=-1).indices.sort(dim=-1).values
    tail = torch.arange(n, n + recent, device=ranked.device).expand(*ranked.shape[:-1], recent)
    return torch.cat((chosen, tail), dim=-1)


def require_int(policy: KVPolicy, name: str, value: object, minimum: int) -> None:
    """Refuse a policy parameter that is not an integer of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"kv_policy={policy.name}: {name}={value!r} must be an integer >= {minimum}")


def fits_pool(policy: KVPolicy, tokens: int, limits: Limits) -> None:
    """Refuse a policy whose sequences hold `tokens` (plus its pristine blocks) in more blocks than the pool has."""
    needed = blocks_for(tokens, limits.block_size) + policy.pristine_blocks(limits.block_size)
    if needed > limits.num_blocks:
        raise ValueError(
            f"kv_policy={policy} holds up to {tokens} tokens per sequence ({needed} KV blocks), "
            f"but the pool has only {limits.num_blocks} blocks"
        )
