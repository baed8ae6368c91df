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
class WindowRun:
    """Rows `first`..`last - 1` of the step: consecutive positions of one sequence (a prefill chunk).

    Row first + i reads `slots[i : i + window]`, so the run's rows share one gather."""

    first: int
    last: int
    #: flat pool slots of positions p - window + 1 .. q, p and q the run's first and last positions
    slots: torch.Tensor
    #: float32 over the same positions: 0 where the key exists, -inf before position 0
    mask: torch.Tensor


@dataclass(slots=True)
class WindowRows:
    """Every new token's window, built once per step for all layers of one window size."""

    window: int
    #: [decodes, window] flat pool slots each decode reads, and their mask as in WindowRun
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor
    runs: list[WindowRun]


def window_rows(meta: AttentionMetadata, window: int) -> WindowRows:
    """The window of every new token of the step (decodes first, then each prefill chunk)."""
    assert window > 0
    bs, device = meta.block_size, meta.slot_mapping.device

    def slots_and_mask(positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clamped = positions.clamp(min=0)  # masked keys read a slot that exists
        slots = table.gather(-1, clamped // bs) * bs + clamped % bs
        return slots, torch.zeros(positions.shape, device=device).masked_fill_(positions < 0, float("-inf"))

    n = meta.num_decode_tokens
    if n:
        keys = (meta.decode_context_lens - 1).unsqueeze(1) + torch.arange(1 - window, 1, device=device)
        decode_slots, decode_mask = slots_and_mask(keys, meta.decode_block_tables)
    else:
        decode_slots = decode_mask = torch.zeros(0, window, device=device)
    runs = []
    for chunk in meta.prefills:
        positions = torch.arange(chunk.context_start - window + 1, chunk.kv_len, device=device)
        runs.append(WindowRun(chunk.start, chunk.end, *slots_and_mask(positions, chunk.block_table)))
    assert n + sum(run.last - run.first for run in runs) == meta.slot_mapping.shape[0]
    return WindowRows(window, decode_slots.long(), decode_mask, runs)


def window_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: WindowRows, scale: float
) -> torch.Tensor:
    """Attention of every new token (q: [T, heads, dim]) over its window of the dense caches
    ([num_blocks, block_size, kv_heads, dim], this step's K/V already written), in float32."""
    num_kv_heads, head_dim, window = k_cache.shape[2], k_cache.shape[3], rows.window
    keys_flat, values_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for first in range(0, rows.decode_slots.shape[0], WINDOW_ROWS):
        last = min(rows.decode_slots.shape[0], first + WINDOW_ROWS)
        slots = rows.decode_slots[first:last]
        keys = keys_flat[slots].float().permute(0, 2, 3, 1)  # [r, kv_heads, dim, window]
        values = values_flat[slots].float().permute(0, 2, 3, 1)
        out[first:last] = _attend(q[first:last], keys, values, rows.decode_mask[first:last], scale)
    for run in rows.runs:
        for first in range(run.first, run.last, WINDOW_ROWS):
            last = min(run.last, first + WINDOW_ROWS)
            span = slice(first - run.first, last - run.first + window - 1)
            # row i's window is the gathered slots i .. i + window - 1: a view, not a gather per row
            keys = keys_flat[run.slots[span]].float().unfold(0, window, 1)  # [r, kv_heads, dim, window]
            values = values_flat[run.slots[span]].float().unfold(0, window, 1)
            out[first:last] = _attend(q[first:last], keys, values, run.mask[span].unfold(0, window, 1), scale)
    return out


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    # keys and values [r, kv_heads, dim, window]: one row's arithmetic whatever rows share the call
    rows, num_kv_heads, head_dim = q.shape[0], keys.shape[1], keys.shape[2]
    queries = q.float().view(rows, num_kv_heads, -1, head_dim)
    scores = torch.matmul(queries, keys.contiguous()).mul_(scale).add_(mask[:, None, None, :])
    attended = torch.matmul(scores.softmax(dim=-1), values.transpose(2, 3).contiguous())
    return attended.view(rows, -1, head_dim).to(q.dtype)
