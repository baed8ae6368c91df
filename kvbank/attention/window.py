"""Sliding-window attention over dense paged K/V (Gemma 3's local layers).

A token at position p attends to positions p - window + 1 .. p, itself included: transformers'
mask (key > query - window). Every query row reads a run of exactly `window` key slots gathered
through its sequence's block table, positions before 0 masked, so a row's arithmetic depends on
its own sequence alone: the same in a prefill chunk or a decode step, alone or in a batch. The
pool keeps every token; only what a row reads is windowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.attention.metadata import AttentionMetadata

#: Query rows attended at once: bounds the gathered [rows, window, kv_heads, dim] keys in memory.
WINDOW_ROWS = 64


@dataclass(slots=True)
class WindowRows:
    """Every new token's window, built once per step for all layers of one window size."""

    window: int
    #: [T, window] flat pool slots each row reads (masked ones point at a valid slot)
    slots: torch.Tensor
    #: [T, window] float32, 0 where the key is visible and -inf before position 0
    mask: torch.Tensor


def window_rows(meta: AttentionMetadata, window: int) -> WindowRows:
    """The window of every new token of the step (decodes first, then each prefill chunk)."""
    assert window > 0
    bs, device = meta.block_size, meta.slot_mapping.device
    offsets = torch.arange(1 - window, 1, device=device)
    parts = []
    if meta.num_decode_tokens:
        keys = (meta.decode_context_lens - 1).unsqueeze(1) + offsets
        parts.append((keys, meta.decode_block_tables))
    for chunk in meta.prefills:
        positions = torch.arange(chunk.context_start, chunk.kv_len, device=device)
        keys = positions.unsqueeze(1) + offsets
        parts.append((keys, chunk.block_table.unsqueeze(0).expand(len(positions), -1)))
    slots, masks = [], []
    for keys, tables in parts:
        clamped = keys.clamp(min=0)
        blocks = tables.gather(1, clamped // bs)
        slots.append(blocks * bs + clamped % bs)
        masks.append(torch.zeros(keys.shape, device=device).masked_fill_(keys < 0, float("-inf")))
    rows = WindowRows(window, torch.cat(slots), torch.cat(masks))
    assert rows.slots.shape[0] == meta.slot_mapping.shape[0]
    return rows


def window_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: WindowRows, scale: float
) -> torch.Tensor:
    """Attention of every new token (q: [T, heads, dim]) over its window of the dense caches
    ([num_blocks, block_size, kv_heads, dim], this step's K/V already written), in float32."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys_flat, values_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for first in range(0, T, WINDOW_ROWS):
        last = min(T, first + WINDOW_ROWS)
        slots = rows.slots[first:last]
        keys = keys_flat[slots].float().permute(0, 2, 3, 1)  # [r, kv_heads, dim, window]
        values = values_flat[slots].float().transpose(1, 2)  # [r, kv_heads, window, dim]
        queries = q[first:last].float().view(last - first, num_kv_heads, -1, head_dim)
        scores = torch.matmul(queries, keys).mul_(scale).add_(rows.mask[first:last, None, None, :])
        attended = torch.matmul(scores.softmax(dim=-1), values)
        out[first:last] = attended.view(last - first, num_heads, head_dim).to(q.dtype)
    return out
