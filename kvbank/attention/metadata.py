"""What attention needs to know about one step's batch, built once and shared by every layer.

The batch is flat: T new tokens. The first `num_decode_tokens` belong to sequences that compute a
single token this step (one token each); each prefill chunk after them is a contiguous run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    """A run of new tokens of one sequence that already has `context_start` tokens cached.

    `mask` is additive ([new, context_start + new]; 0 where visible, -inf elsewhere), or None
    for a chunk that starts at position 0 and so needs only the causal kernel.
    """

    start: int
    end: int
    context_start: int
    block_table: torch.Tensor
    mask: torch.Tensor | None

    @property
    def kv_len(self) -> int:
        return self.context_start + self.end - self.start


@dataclass
class AttentionMetadata:
    """Slot mapping plus the decode and prefill views of the batch.

    `decode_mask` is additive ([decodes, 1, 1, blocks * block_size]) and hides the padding of
    shorter sequences in the gathered block tables.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots; caches are [num_blocks, block_size, heads, dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
