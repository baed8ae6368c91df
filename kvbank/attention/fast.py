"""Batched paged attention on top of scaled_dot_product_attention.

Decodes: all single-token sequences in one call. Where the native kernel runs (bfloat16 on an
AVX-512 BF16 CPU, kvbank/kernels/paged_decode.cpp), it reads each sequence's blocks in place
through the block table. Otherwise the cached blocks are gathered whole into a padded
[batch, heads, blocks*block_size, dim] view and padding is masked; query heads of one KV head are
laid along the query axis, so grouped-query attention needs no K/V expansion, and leading blocks
that several decodes share are read once (attention/cascade.py).
Prefills: one call per chunk; a chunk that starts at position 0 attends to its own fresh K/V with
the causal kernel, a chunk that continues a cached sequence gathers its blocks and uses a mask.
Batch-invariant steps (metadata `row_block_tables`) instead give every token, prefill or decode,
to the native kernel as a decode of its own sequence, after the step's K/V are written.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbank import kernels
from kvbank.attention.metadata import AttentionMetadata

_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

#: The CPU flash kernel compiles, and keeps for good, a kernel for every new tail shape of its
#: query and key blocks; with prompt lengths arbitrary, a server would keep compiling (~160 KB
#: each). Queries past this many rows are padded to a multiple of it, and keys to one of KEY_PAD,
#: so the shapes come from a small set (bench/serve_load.py --soak: memory stays flat).
QUERY_PAD = 32
KEY_PAD = 64


#: Decode contexts are split into pieces of this many tokens for the native kernel, so that a
#: few long sequences still give every thread work; the pieces merge by log-sum-exp.
DECODE_PARTITION = 256


def native_decode_kernel(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int):
    """The native decode-attention module if it has a fast path for this model and cache, else None."""
    if device.type != "cpu" or dtype != torch.bfloat16 or num_heads % num_kv_heads:
        return None
    if num_heads // num_kv_heads > 8 or head_dim not in (64, 128) or block_size > 64 or DECODE_PARTITION % block_size:
        return None
    module = kernels.native()
    return module if module is not None and module.has_bf16_fast_path() else None


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_query_rows(n: int) -> int:
    """Query rows for an attention call over `n` new tokens: short calls need no padding."""
    return n if n < QUERY_PAD else padded_length(n, QUERY_PAD)


def padded_key_length(n: int, block_size: int) -> int:
    """Keys for an attention call over `n` cached tokens: whole blocks, at least KEY_PAD at a time."""
    return padded_length(n, padded_length(KEY_PAD, block_size))


def chunk_visibility(start: int, end: int, block_size: int) -> torch.Tensor:
    """Which keys (0..end-1) the new tokens at start..end-1 see, padded for the kernel.

    Extra key columns are hidden; extra query rows see key 0 only, so that no row is empty.
    """
    rows, width = padded_query_rows(end - start), padded_key_length(end, block_size)
    positions = torch.arange(start, start + rows).unsqueeze(1)
    visible = torch.arange(width).unsqueeze(0) <= positions
    visible[end - start:] = False
    visible[end - start:, 0] = True
    return visible


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


def _cover(table: torch.Tensor, blocks: int) -> torch.Tensor:
    # Padding keys read any valid block; the mask hides them.
    return table if len(table) >= blocks else torch.cat((table, table[:1].expand(blocks - len(table))))


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [num_blocks, bs, H, D] -> [batch, H, n*bs, D]
    batch = block_tables.shape[0]
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, -1, *cache.shape[2:]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every new token (q, k, v: [T, heads, dim]) over its sequence's cached past."""
    if meta.row_block_tables is not None:
        return _attend_rows(q, k_cache, v_cache, meta, scale)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n:
        queries = q[:n].view(n, num_kv_heads, group, head_dim)
        if meta.decode_kernel is not None:
            attended = meta.decode_kernel.paged_decode_attention(
                queries, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                DECODE_PARTITION)
        elif meta.shared_prefixes:
            attended = _cascade_decode(queries, k_cache, v_cache, meta, scale)
        else:
            keys = _gather_blocks(k_cache, meta.decode_block_tables)
            values = _gather_blocks(v_cache, meta.decode_block_tables)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask, scale=scale)
        out[:n] = attended.reshape(n, -1, head_dim)
    for chunk in meta.prefills:
        n = chunk.end - chunk.start
        if chunk.context_start == 0:
            # Causal: padding rows at the end changes nothing for the rows before them.
            rows = padded_length(n, KEY_PAD)
            queries, keys, values = (_pad_rows(x[chunk.start:chunk.end], rows).transpose(0, 1).unsqueeze(0)
                                     for x in (q, k, v))
            attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                      enable_gqa=group > 1)
        else:
            rows, width = chunk.mask.shape[-2:]
            queries = _pad_rows(q[chunk.start:chunk.end], rows).transpose(0, 1).unsqueeze(0)
            table = _cover(chunk.block_table, -(-width // k_cache.shape[1])).unsqueeze(0)
            keys = _gather_blocks(k_cache, table)[:, :, :width]
            values = _gather_blocks(v_cache, table)[:, :, :width]
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale,
                                                      enable_gqa=group > 1)
        out[chunk.start:chunk.end] = attended.squeeze(0)[:, :n].transpose(0, 1)
    return out


def _attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
    # Every token as a decode of its own sequence, its K/V already in the pool: one fixed order
    # of arithmetic per token, whatever the chunking of its prompt and whatever else is batched.
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    queries = q.view(q.shape[0], num_kv_heads, -1, head_dim)
    attended = meta.decode_kernel.paged_decode_attention(queries, k_cache, v_cache, meta.row_block_tables,
                                                         meta.row_context_lens, scale, DECODE_PARTITION)
    return attended.view(q.shape)


def cascade_available(device: torch.device) -> bool:
    """Shared-prefix decoding merges partial results by log-sum-exp, which only the CPU flash kernel returns."""
    return device.type == "cpu" and _flash_with_lse is not None


def _cascade_decode(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # Decode attention (queries [n, kv_heads, group, dim]) with shared prefixes read once; float32 out.
    num_kv_heads, group, head_dim = queries.shape[1:]
    out, lse = _flash_with_lse(queries, _gather_blocks(k_cache, meta.suffix_block_tables),
                               _gather_blocks(v_cache, meta.suffix_block_tables), 0.0, False,
                               attn_mask=meta.suffix_mask, scale=scale)[:2]
    out = out.float()
    for prefix in meta.shared_prefixes:
        rows, m = prefix.rows, prefix.rows.numel()
        # All of the group's queries attend the shared blocks as one sequence: nothing is masked.
        together = queries[rows].transpose(1, 2).reshape(m * group, num_kv_heads, head_dim)
        together = _pad_rows(together, padded_query_rows(m * group)).transpose(0, 1).unsqueeze(0)
        table = prefix.block_table.unsqueeze(0)
        shared_out, shared_lse = _flash_with_lse(together, _gather_blocks(k_cache, table),
                                                 _gather_blocks(v_cache, table), 0.0, False, scale=scale)[:2]
        shared_out = shared_out[0, :, :m * group].view(num_kv_heads, m, group, head_dim).transpose(0, 1).float()
        shared_lse = shared_lse[0, :, :m * group].view(num_kv_heads, m, group).transpose(0, 1)
        own_lse = lse[rows]
        total = torch.logaddexp(shared_lse, own_lse)
        out[rows] = (shared_out * (shared_lse - total).exp_().unsqueeze(-1)
                     + out[rows] * (own_lse - total).exp_().unsqueeze(-1))
    return out


#: Quantized layers dequantize at most this many tokens of a sequence's context at a time; None
#: reads the whole context at once. int4/int2 ("block") dequantizing is several passes over the
#: data, which run faster on pieces that stay in cache; int8/fp8 ("token") is one pass, and there
#: the cost of merging outweighs that (bench/kv_quant.py, 16 x 2k-token decode).
DEQUANT_CHUNK_TOKENS: dict[str, int] | None = {"token": 2048, "block": 1024}


class _Merged:
    """Attention over key ranges taken one at a time, merged by their log-sum-exp."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> None:
        """queries [B, H, Lq, D]; keys, values [B, H, C, D]; mask additive, broadcastable to [B, H, Lq, C]."""
        out, lse = _flash_with_lse(queries, keys, values, 0.0, False, attn_mask=mask, scale=scale)
        # A query that sees nothing in this range contributes nothing (the kernel reports lse 0).
        hidden = torch.isinf(mask).all(dim=-1).expand(lse.shape)
        lse = lse.masked_fill(hidden, float("-inf"))
        out = out.float()
        if self.out is None:
            self.out, self.lse = out, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        # Where both sides are still empty (-inf - -inf), the weights are 0, not NaN.
        old = torch.exp(self.lse - merged).nan_to_num_(0.0).unsqueeze(-1)
        new = torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1)
        self.out = self.out * old + out * new
        self.lse = merged


def _chunk_blocks(device: torch.device, kind: str, block_size: int) -> int | None:
    if device.type != "cpu" or _flash_with_lse is None or DEQUANT_CHUNK_TOKENS is None:
        return None
    return max(1, DEQUANT_CHUNK_TOKENS[kind] // block_size)


def quantized_paged_attention(q: torch.Tensor, layer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a layer whose pool is quantized: blocks are dequantized as attention reads them.

    Only blocks in this step's block tables are dequantized, at most DEQUANT_CHUNK_TOKENS of each
    sequence's context at a time, into temporaries that live for one range of one layer; the
    ranges are merged by log-sum-exp (on CPU; elsewhere a sequence's context is read in one go).
    "block" layers also read their full-precision scratch blocks (see QuantizedView).
    """
    view = meta.views[layer.kind]
    num_kv_heads, head_dim = layer.heads, q.shape[2]
    group = q.shape[1] // num_kv_heads
    scratch = layer.scratch if layer.kind == "block" else None
    bs = layer.block_size
    step = _chunk_blocks(q.device, layer.kind, bs)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n:
        tables = meta.decode_block_tables
        queries = q[:n].view(n, num_kv_heads, group, head_dim)
        width = tables.shape[1]
        decode_step = step if step is not None and step < width else None  # one range: no merging
        merged = _Merged()
        for first in range(0, width, decode_step or width):
            last = min(width, first + (decode_step or width))
            keys, values = layer.read(tables[:, first:last])
            if scratch is not None:
                _overlay_own_blocks(keys, values, scratch, view.decode_own_blocks, first, last, n)
            mask = view.decode_mask[..., first * bs:last * bs]
            if decode_step is None:
                attended = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                          attn_mask=mask, scale=scale)
                break
            merged.add(queries, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
        else:
            attended = merged.out
        out[:n] = attended.reshape(n, -1, head_dim).to(q.dtype)
    for i, (chunk, mask) in enumerate(zip(meta.prefills, view.chunk_masks)):
        queries = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        table = chunk.block_table.unsqueeze(0)
        blocks = len(chunk.block_table)
        chunk_step = step if step is not None and step < blocks else None  # one range: concatenate
        ranges = [(layer.read(table[:, a:a + (chunk_step or blocks)]), a * bs)
                  for a in range(0, blocks, chunk_step or blocks)]
        if scratch is not None:
            first, last = view.chunk_rows[i]
            rows = (scratch[0][first:last].reshape(1, -1, num_kv_heads, head_dim),
                    scratch[1][first:last].reshape(1, -1, num_kv_heads, head_dim))
            ranges.append((rows, len(chunk.block_table) * bs))
        if chunk_step is None:
            keys, values = ranges[0][0]
            if len(ranges) > 1:
                keys = torch.cat([k for (k, _), _ in ranges], dim=1)
                values = torch.cat([v for (_, v), _ in ranges], dim=1)
            attended = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                      attn_mask=mask, scale=scale, enable_gqa=group > 1)
        else:
            merged = _Merged()
            for (keys, values), offset in ranges:
                columns = mask[..., offset:offset + keys.shape[1]]
                # The kernel wants as many K/V heads as query heads.
                merged.add(queries, keys.transpose(1, 2).repeat_interleave(group, dim=1),
                           values.transpose(1, 2).repeat_interleave(group, dim=1), columns, scale)
            attended = merged.out
        out[chunk.start:chunk.end] = attended.squeeze(0).transpose(0, 1).to(q.dtype)
    return out


def _overlay_own_blocks(keys: torch.Tensor, values: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor],
                        own_blocks: torch.Tensor, first: int, last: int, n: int) -> None:
    """Put each decode's full-precision scratch block in place of its own block, if in [first, last)."""
    inside = ((own_blocks >= first) & (own_blocks < last)).nonzero().squeeze(1)
    if inside.numel():
        shape = scratch[0].shape[1:]
        keys.view(n, -1, *shape)[inside, own_blocks[inside] - first] = scratch[0][inside]
        values.view(n, -1, *shape)[inside, own_blocks[inside] - first] = scratch[1][inside]
