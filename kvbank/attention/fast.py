"""Batched paged attention on top of scaled_dot_product_attention.

Decodes: all single-token sequences in one call; their cached blocks are gathered whole into a
padded [batch, heads, blocks*block_size, dim] view and padding is masked. Query heads of one KV
head are laid along the query axis, so grouped-query attention needs no K/V expansion.
Prefills: one call per chunk; a chunk that starts at position 0 attends to its own fresh K/V with
the causal kernel, a chunk that continues a cached sequence gathers its blocks and uses a mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbank.attention.metadata import AttentionMetadata


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [num_blocks, bs, H, D] -> [batch, H, n*bs, D]
    batch = block_tables.shape[0]
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, -1, *cache.shape[2:]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every new token (q, k, v: [T, heads, dim]) over its sequence's cached past."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n:
        keys = _gather_blocks(k_cache, meta.decode_block_tables)
        values = _gather_blocks(v_cache, meta.decode_block_tables)
        queries = q[:n].view(n, num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask, scale=scale)
        out[:n] = attended.reshape(n, -1, head_dim)
    for chunk in meta.prefills:
        queries = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.context_start == 0:
            keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                      enable_gqa=group > 1)
        else:
            table = chunk.block_table.unsqueeze(0)
            keys = _gather_blocks(k_cache, table)[:, :, :chunk.kv_len]
            values = _gather_blocks(v_cache, table)[:, :, :chunk.kv_len]
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale,
                                                      enable_gqa=group > 1)
        out[chunk.start:chunk.end] = attended.squeeze(0).transpose(0, 1)
    return out


def quantized_paged_attention(q: torch.Tensor, layer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a layer whose pool is quantized: blocks are dequantized as they are gathered.

    Only the blocks in this step's block tables are dequantized, into a temporary that lives
    for one layer. "block" layers add their full-precision scratch blocks (see QuantizedView).
    """
    view = meta.views[layer.kind]
    num_kv_heads, head_dim = layer.heads, q.shape[2]
    group = q.shape[1] // num_kv_heads
    scratch = layer.scratch if layer.kind == "block" else None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n:
        keys, values = layer.read(meta.decode_block_tables)
        if scratch is not None:
            # Each decode's own block is the full-precision scratch block, in place of its
            # (not yet or just) quantized copy.
            rows = torch.arange(n, device=q.device)
            keys.view(n, -1, *scratch[0].shape[1:])[rows, view.decode_own_blocks] = scratch[0][:n]
            values.view(n, -1, *scratch[1].shape[1:])[rows, view.decode_own_blocks] = scratch[1][:n]
        queries = q[:n].view(n, num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=view.decode_mask, scale=scale)
        out[:n] = attended.reshape(n, -1, head_dim)
    for i, (chunk, mask) in enumerate(zip(meta.prefills, view.chunk_masks)):
        keys, values = layer.read(chunk.block_table.unsqueeze(0))
        if scratch is not None:
            first, last = view.chunk_rows[i]
            keys = torch.cat((keys, scratch[0][first:last].reshape(1, -1, num_kv_heads, head_dim)), dim=1)
            values = torch.cat((values, scratch[1][first:last].reshape(1, -1, num_kv_heads, head_dim)), dim=1)
        queries = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[chunk.start:chunk.end] = attended.squeeze(0).transpose(0, 1)
    return out
