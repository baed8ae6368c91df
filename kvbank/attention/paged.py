"""Reference paged attention: one sequence and one query at a time, in float32.

Slow and obviously right; the fast path is tested against it.
"""

from __future__ import annotations

import torch

from kvbank.attention.metadata import AttentionMetadata


def _gather(cache: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    rows = [cache[block_table[pos // block_size], pos % block_size] for pos in range(length)]
    return torch.stack(rows).float()


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[0] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), keys) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached past (K/V already written)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    tables = meta.decode_block_tables.tolist() if meta.num_decode_tokens else []
    lens = meta.decode_context_lens.tolist() if meta.num_decode_tokens else []
    for i in range(meta.num_decode_tokens):
        keys, values = _gather(k_cache, tables[i], lens[i]), _gather(v_cache, tables[i], lens[i])
        out[i] = _attend(q[i], keys, values, scale)
    for chunk in meta.prefills:
        table = chunk.block_table.tolist()
        keys, values = _gather(k_cache, table, chunk.kv_len), _gather(v_cache, table, chunk.kv_len)
        for j, t in enumerate(range(chunk.start, chunk.end)):
            visible = chunk.context_start + j + 1
            out[t] = _attend(q[t], keys[:visible], values[:visible], scale)
    return out.to(q.dtype)
