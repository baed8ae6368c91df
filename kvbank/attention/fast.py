"""Batched paged attention on top of scaled_dot_product_attention.

Decodes: all single-token sequences in one call. Where the native kernel runs (bfloat16 on an x86
CPU with AVX2 or above, kvbank/kernels/dense_attention.cpp), it reads each sequence's blocks in place
through the block table. Otherwise the cached blocks are gathered whole into a padded
[batch, heads, blocks*block_size, dim] view and padding is masked; query heads of one KV head are
laid along the query axis, so grouped-query attention needs no K/V expansion, and leading blocks
that several decodes share are read once (attention/cascade.py).
Prefills: one call per chunk; a chunk that starts at position 0 attends to its own fresh K/V with
the causal kernel, a chunk that continues a cached sequence gathers its blocks and uses a mask.
Batch-invariant steps (DenseStep.row_block_tables) instead give every token, prefill or decode,
to the native kernel as a decode of its own sequence, after the step's K/V are written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvbank import kernels
from kvbank.attention.metadata import AttentionMetadata, SharedPrefix, index_tensor, table_tensor

#: PyTorch's CPU flash attention, which also returns each row's log-sum-exp (None where absent)
flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

#: The CPU flash kernel compiles, and keeps for good, a kernel for every new tail shape of its
#: query and key blocks; with prompt lengths arbitrary, a server would keep compiling (~160 KB
#: each). Queries past this many rows are padded to a multiple of it, and keys to one of KEY_PAD,
#: so the shapes come from a small set (bench/serve_load.py --soak: memory stays flat).
QUERY_PAD = 32
KEY_PAD = 64


#: Decode contexts are split into pieces of this many tokens for the native kernel, so that a
#: few long sequences still give every thread work; the pieces merge by log-sum-exp.
DECODE_PARTITION = 256


def native_decode_kernel(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
):
    """The native decode-attention module if it has a vector variant for this model and cache at the
    active instruction-set level (avx2 and above, kvbank/kernels/isa.h), else None."""
    if device.type != "cpu" or dtype != torch.bfloat16 or num_heads % num_kv_heads:
        return None
    # head dims 64, 128 and 256 (Gemma 3) each have the kernel's vector variants
    if (
        num_heads // num_kv_heads > 8
        or head_dim not in (64, 128, 256)
        or block_size > 64
        or DECODE_PARTITION % block_size
    ):
        return None
    module = kernels.native()
    return module if module is not None and module.dense_attention_isa() != "scalar" else None


def row_tables(spans: list[tuple[int, int, list[int]]], block_size: int, device: torch.device):
    """Every new token's block table and context length (its slot + 1), for sequences given as
    (start, end, block_table) in batch order: what the decode kernels need to attend by rows."""
    tables = [table[: -(-end // block_size)] for _, end, table in spans]
    if all(end - start == 1 for start, end, _ in spans):  # decodes only: one row per sequence
        return table_tensor(tables, device), index_tensor([end for _, end, _ in spans], device)
    per_seq = table_tensor(tables)
    owner = torch.repeat_interleave(index_tensor([end - start for start, end, _ in spans]))
    lens = torch.cat([torch.arange(start + 1, end + 1) for start, end, _ in spans])
    return per_seq.index_select(0, owner).to(device), lens.to(device)


def row_starts(steps, device: torch.device) -> torch.Tensor | None:
    """Where each new token's keys begin, as `row_tables` lists its rows (StepSeq.lead: a stream
    after evictions), or None when every row starts at slot 0."""
    if not any(s.lead for s in steps):
        return None
    if all(s.end - s.start == 1 for s in steps):
        return index_tensor([s.lead for s in steps], device)
    return torch.cat([torch.full((s.end - s.start,), s.lead, dtype=torch.long) for s in steps]).to(device)


@dataclass
class ScoreJob:
    """Attention of batch rows `rows` (at cache slots `row_slots`) over their sequence's slots
    `key_slots` (flat pool slot ids, slot order), summed over queries and the heads of each KV
    head, is added to `buffer[layer, kv_head, :len(key_slots)]`."""

    rows: torch.Tensor
    row_slots: torch.Tensor
    key_slots: torch.Tensor
    buffer: torch.Tensor


#: Query rows scored at once: bounds the [rows, heads, keys] probabilities in memory.
SCORE_ROWS = 256


def accumulate_scores(q: torch.Tensor, keys: torch.Tensor, job: ScoreJob, layer: int, scale: float) -> None:
    """Add one layer's attention probabilities for `job` (computed in float32, causal by slot);
    `keys` are the float32 keys of `job.key_slots`, [slots, kv_heads, head_dim]."""
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    positions = torch.arange(keys.shape[0], device=keys.device)
    total = torch.zeros(num_kv_heads, keys.shape[0], device=keys.device)
    for i in range(0, job.rows.numel(), SCORE_ROWS):
        rows = job.rows[i : i + SCORE_ROWS]
        queries = q.index_select(0, rows).float().view(rows.numel(), num_kv_heads, -1, head_dim)
        scores = torch.einsum("rkgd,nkd->rkgn", queries, keys).mul_(scale)
        hidden = positions.unsqueeze(0) > job.row_slots[i : i + SCORE_ROWS].unsqueeze(1)
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        total += scores.softmax(dim=-1).sum(dim=(0, 2))
    job.buffer[layer, :, : keys.shape[0]] += total.to(job.buffer.device)


@dataclass
class DenseStep:
    """What dense attention needs this step beyond AttentionMetadata (built by cache/layers/dense.py).

    `decode_kernel`, when set, is the native module that reads decodes straight from the blocks.
    `chunk_masks[i]` is prefill chunk i's additive mask (None for a chunk that starts at position 0
    and so needs only the causal kernel); it is [new, context_start + new] or larger, padded rows
    and columns (chunk_visibility) being ignored. When decodes share leading blocks,
    `shared_prefixes` lists the groups, and `suffix_block_tables` / `suffix_mask` describe every
    decode's blocks after its group's shared ones (attention/cascade.py). `row_block_tables` /
    `row_context_lens`, when set, give every new token its sequence's blocks and its slot + 1:
    every token, prefill or decode, is then attended by the decode kernel, so its result depends on
    its own sequence alone (batch-invariant mode).
    """

    decode_kernel: object | None
    chunk_masks: list[torch.Tensor | None]
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    #: sliding window -> where each row's window begins (row_context_lens - window, at least 0)
    window_starts: dict[int, torch.Tensor] = field(default_factory=dict)
    suffix_block_tables: torch.Tensor | None = None
    suffix_mask: torch.Tensor | None = None
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None
    #: where each row's keys begin (row_starts), None when at slot 0
    row_starts: torch.Tensor | None = None
    #: attention scores that long-context policies accumulate this step
    score_jobs: list[ScoreJob] = field(default_factory=list)


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_query_rows(n: int) -> int:
    """Query rows for an attention call over `n` new tokens: short calls need no padding."""
    return n if n < QUERY_PAD else padded_length(n, QUERY_PAD)


def padded_key_length(n: int, block_size: int) -> int:
    """Keys for an attention call over `n` cached tokens: whole blocks, at least KEY_PAD at a time."""
    return padded_length(n, padded_length(KEY_PAD, block_size))


def chunk_visibility(start: int, end: int, block_size: int, lead: int = 0) -> torch.Tensor:
    """Which keys (lead..end-1) the new tokens at start..end-1 see, padded for the kernel.

    Extra key columns are hidden; extra query rows see key 0 only, so that no row is empty.
    """
    rows, width = padded_query_rows(end - start), padded_key_length(end, block_size)
    positions = torch.arange(start, start + rows).unsqueeze(1)
    keys = torch.arange(width).unsqueeze(0)
    visible = (keys <= positions) & (keys >= lead)
    visible[end - start :] = False
    visible[end - start :, 0] = True
    return visible


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` ([tokens, heads, dim]) with zero rows added up to `rows` tokens."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


def _cover(table: torch.Tensor, blocks: int) -> torch.Tensor:
    # Padding keys read any valid block; the mask hides them.
    return table if len(table) >= blocks else torch.cat((table, table[:1].expand(blocks - len(table))))


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [num_blocks, bs, H, D] -> [batch, H, n*bs, D]
    batch = block_tables.shape[0]
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, -1, *cache.shape[2:]).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    step: DenseStep,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token (q, k, v: [T, heads, dim]) over its sequence's cached past."""
    if step.row_block_tables is not None:
        return _attend_rows(q, k_cache, v_cache, step, scale)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n:
        queries = q[:n].view(n, num_kv_heads, group, head_dim)
        if step.decode_kernel is not None:
            attended = step.decode_kernel.paged_decode_attention(
                queries,
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                DECODE_PARTITION,
                meta.decode_starts,
            )
        elif step.shared_prefixes:
            attended = _cascade_decode(queries, k_cache, v_cache, step, scale)
        else:
            keys = _gather_blocks(k_cache, meta.decode_block_tables)
            values = _gather_blocks(v_cache, meta.decode_block_tables)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask, scale=scale)
        out[:n] = attended.reshape(n, -1, head_dim)
    for chunk, mask in zip(meta.prefills, step.chunk_masks):
        n = chunk.end - chunk.start
        if chunk.context_start == 0:
            # Causal: padding rows at the end changes nothing for the rows before them.
            rows = padded_length(n, KEY_PAD)
            queries, keys, values = (
                pad_rows(x[chunk.start : chunk.end], rows).transpose(0, 1).unsqueeze(0) for x in (q, k, v)
            )
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            rows, width = mask.shape[-2:]
            queries = pad_rows(q[chunk.start : chunk.end], rows).transpose(0, 1).unsqueeze(0)
            table = _cover(chunk.block_table, -(-width // k_cache.shape[1])).unsqueeze(0)
            keys = _gather_blocks(k_cache, table)[:, :, :width]
            values = _gather_blocks(v_cache, table)[:, :, :width]
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        out[chunk.start : chunk.end] = attended.squeeze(0)[:, :n].transpose(0, 1)
    return out


def _attend_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: DenseStep, scale: float
) -> torch.Tensor:
    # Every token as a decode of its own sequence, its K/V already in the pool: one fixed order
    # of arithmetic per token, whatever the chunking of its prompt and whatever else is batched.
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    queries = q.view(q.shape[0], num_kv_heads, -1, head_dim)
    attended = step.decode_kernel.paged_decode_attention(
        queries,
        k_cache,
        v_cache,
        step.row_block_tables,
        step.row_context_lens,
        scale,
        DECODE_PARTITION,
        step.row_starts,
    )
    return attended.view(q.shape)


def window_row_starts(context_lens: torch.Tensor, starts: torch.Tensor | None, window: int) -> torch.Tensor:
    """Where each row's keys begin when it sees only the last `window` positions up to its own
    (and never before `starts`, where a row's sequence begins)."""
    window_starts = (context_lens - window).clamp_(min=0)
    return window_starts if starts is None else torch.maximum(window_starts, starts)


def attend_window_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: DenseStep, scale: float, window: int
) -> torch.Tensor:
    """As _attend_rows, each row reading only the last `window` positions up to its own (itself
    included): the kernel starts the row there, so no other key is read."""
    starts = step.window_starts.get(window)
    if starts is None:
        starts = step.window_starts[window] = window_row_starts(step.row_context_lens, step.row_starts, window)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    queries = q.view(q.shape[0], num_kv_heads, -1, head_dim)
    attended = step.decode_kernel.paged_decode_attention(
        queries, k_cache, v_cache, step.row_block_tables, step.row_context_lens, scale, DECODE_PARTITION, starts
    )
    return attended.view(q.shape)


def cascade_available(device: torch.device) -> bool:
    """Shared-prefix decoding merges partial results by log-sum-exp, which only the CPU flash kernel returns."""
    return device.type == "cpu" and flash_with_lse is not None


def _cascade_decode(
    queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: DenseStep, scale: float
) -> torch.Tensor:
    # Decode attention (queries [n, kv_heads, group, dim]) with shared prefixes read once; float32 out.
    num_kv_heads, group, head_dim = queries.shape[1:]
    out, lse = flash_with_lse(
        queries,
        _gather_blocks(k_cache, step.suffix_block_tables),
        _gather_blocks(v_cache, step.suffix_block_tables),
        0.0,
        False,
        attn_mask=step.suffix_mask,
        scale=scale,
    )[:2]
    out = out.float()
    for prefix in step.shared_prefixes:
        rows, m = prefix.rows, prefix.rows.numel()
        # All of the group's queries attend the shared blocks as one sequence: nothing is masked.
        together = queries[rows].transpose(1, 2).reshape(m * group, num_kv_heads, head_dim)
        together = pad_rows(together, padded_query_rows(m * group)).transpose(0, 1).unsqueeze(0)
        table = prefix.block_table.unsqueeze(0)
        shared_out, shared_lse = flash_with_lse(
            together, _gather_blocks(k_cache, table), _gather_blocks(v_cache, table), 0.0, False, scale=scale
        )[:2]
        shared_out = shared_out[0, :, : m * group].view(num_kv_heads, m, group, head_dim).transpose(0, 1).float()
        shared_lse = shared_lse[0, :, : m * group].view(num_kv_heads, m, group).transpose(0, 1)
        own_lse = lse[rows]
        total = torch.logaddexp(shared_lse, own_lse)
        out[rows] = shared_out * (shared_lse - total).exp_().unsqueeze(-1) + out[rows] * (
            own_lse - total
        ).exp_().unsqueeze(-1)
    return out
