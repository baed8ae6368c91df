"""What attention needs to know about one step's batch, built once and shared by every layer.

The batch is flat: T new tokens. The first `num_decode_tokens` belong to sequences that compute a
single token this step (one token each); each prefill chunk after them is a contiguous run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """A run of new tokens of one sequence that already has `context_start` tokens cached.

    `mask` is additive (0 where visible, -inf elsewhere), or None for a chunk that starts at
    position 0 and so needs only the causal kernel. It is [new, context_start + new], or larger:
    padded rows and columns (fast.chunk_visibility) are ignored.
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
class SharedPrefix:
    """Decodes `rows` (indices among the decodes) all begin with the blocks of `block_table`."""

    rows: torch.Tensor
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Slot mapping plus the decode and prefill views of the batch.

    `decode_mask` is additive ([decodes, 1, 1, blocks * block_size]) and hides the padding of
    shorter sequences in the gathered block tables (None where only the native kernel reads decodes). When decodes share leading blocks,
    `shared_prefixes` lists the groups, and `suffix_block_tables` / `suffix_mask` describe every
    decode's blocks after its group's shared ones (see attention/cascade.py). `decode_kernel`,
    when set, is the native module that reads decodes straight from the blocks (attention/fast.py).
    `row_block_tables` / `row_context_lens`, when set, give every new token its sequence's blocks
    and its position + 1: dense layers then attend every token, prefill or decode, with the decode
    kernel, so a token's result depends on its own sequence alone (batch-invariant mode).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    views: dict[str, QuantizedView] = field(default_factory=dict)
    residual_plan: ResidualPlan | None = None
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    suffix_block_tables: torch.Tensor | None = None
    suffix_mask: torch.Tensor | None = None
    decode_kernel: object | None = None
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None


@dataclass
class QuantizedView:
    """Masks for layers that read K/V back from a quantized pool (`kind` "token" or "block").

    "token" layers attend to the dequantized blocks of the whole context, the new tokens
    included. "block" layers see the quantized form of every block before a token's own block and
    the full-precision form of its own block. Decodes get that by putting their scratch block in
    place of block `decode_own_blocks[i]`; a prefill chunk attends to [dequantized blocks ;
    its scratch blocks] (`chunk_rows`) with a mask that picks the right copy per query.
    """

    decode_mask: torch.Tensor | None
    chunk_masks: list[torch.Tensor]
    chunk_rows: list[tuple[int, int]] = field(default_factory=list)
    decode_own_blocks: torch.Tensor | None = None


@dataclass
class ResidualPlan:
    """How this step's new K/V reach "block" layers (int4/int2).

    Every block that receives tokens gets a scratch row: its earlier tokens are loaded from its
    residual slot, the new tokens are written in, and then blocks that are now full are quantized
    into the pool while the others go back to their residual slots.
    """

    rows: int
    scratch_slots: torch.Tensor
    preload_rows: torch.Tensor | None
    preload_slots: torch.Tensor | None
    full_rows: torch.Tensor | None
    full_blocks: torch.Tensor | None
    keep_rows: torch.Tensor | None
    keep_slots: torch.Tensor | None

    def write(self, layer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, heads, dim]) for `layer`; returns its scratch blocks (K, V)."""
        residual = layer.residual
        stores = (residual.k[layer.residual_index], residual.v[layer.residual_index])
        scratch = []
        for x, store in zip((k, v), stores):
            rows = x.new_zeros(self.rows, *store.shape[1:])
            if self.preload_rows is not None:
                rows.index_copy_(0, self.preload_rows, store.index_select(0, self.preload_slots))
            rows.view(-1, *x.shape[1:]).index_copy_(0, self.scratch_slots, x)
            scratch.append(rows)
        if self.full_rows is not None:
            layer.store_blocks(self.full_blocks, scratch[0].index_select(0, self.full_rows),
                               scratch[1].index_select(0, self.full_rows))
        if self.keep_rows is not None:
            for rows, store in zip(scratch, stores):
                store.index_copy_(0, self.keep_slots, rows.index_select(0, self.keep_rows))
        return scratch[0], scratch[1]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots; caches are [num_blocks, block_size, heads, dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
