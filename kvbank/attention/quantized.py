"""Attention over a quantized pool.

Where the native kernel runs (an x86 CPU with AVX2, bfloat16 or float32 model, head dim 64 or 128;
kvbank/kernels/quant_attention.cpp), tokens are attended as decodes of their own sequence and the
codes are read in place through the block table, dequantized in registers: every token in
batch-invariant mode (prefill included), the decodes otherwise.

The reference path (and the fallback) dequantizes blocks as attention reads them. Only blocks
in this step's block tables are dequantized, at most DEQUANT_CHUNK_TOKENS of each sequence's
context at a time, into temporaries that live for one range of one layer; the ranges
are merged by log-sum-exp (on CPU; elsewhere a sequence's context is read in one go). Layers
that keep a block's newest tokens in full precision (KIVI) also pass their scratch blocks.

Prefill calls are padded like the dense ones (fast.QUERY_PAD / KEY_PAD), so that the CPU flash
kernel meets few shapes and memory stays flat under varied prompt lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvbank import kernels
from kvbank.attention.fast import (
    DECODE_PARTITION,
    KEY_PAD,
    flash_with_lse,
    pad_rows,
    padded_length,
    padded_query_rows,
)
from kvbank.attention.metadata import AttentionMetadata

#: Quantized layers dequantize at most this many tokens of a sequence's context at a time; None
#: reads the whole context at once. int4/int2 ("kivi") dequantizing is several passes over the
#: data, which run faster on pieces that stay in cache; int8/fp8 ("token") is one pass, and there
#: the cost of merging outweighs that (bench/kv_quant.py, 16 x 2k-token decode).
DEQUANT_CHUNK_TOKENS: dict[str, int] | None = {"token": 2048, "kivi": 1024}


#: the quantized codecs the native kernels attend in place (their ids come from the module)
NATIVE_CODECS = ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")


@functools.cache
def native_formats(native) -> dict[str, int]:
    """The native module's KV format ids by codec name ("dense": a cache in the model dtype), as its
    kernels number them."""
    return dict(native.kv_formats())


def native_quant_kernel(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    value_group_size: int | None,
):
    """The native module if it attends this model's quantized cache in place, else None."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or num_heads % num_kv_heads:
        return None
    if num_heads // num_kv_heads > 8 or head_dim not in (64, 128) or block_size > 64 or DECODE_PARTITION % block_size:
        return None
    if value_group_size is not None and value_group_size % 16:
        return None
    module = kernels.native()
    return module if module is not None and module.has_quant_decode() else None


class BlockReader(Protocol):
    """A quantized layer as attention sees it."""

    heads: int
    block_size: int
    #: the native module and this layer's format id in it, when the kernel reads the layer in place
    native: object | None
    native_format: int | None
    #: per side (K, V): the stored tensors by name ("codes", "scale"; int4/int2 keys "ranges" and
    #: "grid" instead of "scale", values also "zero")
    sides: list[dict[str, torch.Tensor]]

    def read(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of whole blocks, [batch, blocks * block_size, heads, dim]."""


@dataclass
class QuantizedView:
    """Masks for layers that read K/V back from a quantized pool.

    "token" layers attend to the dequantized blocks of the whole context, the new tokens
    included. "kivi" layers see the quantized form of every block before a token's own block and
    the full-precision form of its own block. Decodes get that by putting their scratch block in
    place of block `decode_own_blocks[i]`; a prefill chunk attends to [dequantized blocks ;
    its scratch blocks] (`chunk_rows`) with a mask that picks the right copy per query.
    Chunk masks are padded (rows to padded_query_rows, columns to whole KEY_PAD units, see
    `pad_visibility`); attention pads queries and keys to match.
    """

    chunk_masks: list[torch.Tensor]
    chunk_rows: list[tuple[int, int]] = field(default_factory=list)
    decode_own_blocks: torch.Tensor | None = None
    #: when the native kernel attends every token: each token's block table and context length
    row_tables: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    #: where each row's keys begin (attention/fast.py row_starts), None when at slot 0
    row_starts: torch.Tensor | None = None
    #: for the native kernel, each attended row's scratch block row (int4/int2): every token's
    #: when row_tables is set, else the decodes'
    own_rows: torch.Tensor | None = None
    #: attention accumulated for policies that rank tokens (attention/fast.py ScoreJob)
    score_jobs: list = field(default_factory=list)


def native_rows(
    q: torch.Tensor,
    layer: BlockReader,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    own_rows: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of q ([n, heads, dim]) attended as decodes by the native kernel, reading codes in place
    (row i from slot starts[i] on, when given)."""
    n, heads, dim = q.shape
    k, v = layer.sides
    with_scratch = scratch is not None and own_rows is not None
    out = layer.native.quant_decode_attention(
        q.reshape(n, layer.heads, heads // layer.heads, dim),
        layer.native_format,
        k["codes"],
        k["ranges"] if "ranges" in k else k["scale"],
        k.get("grid"),
        v["codes"],
        v["scale"],
        v.get("zero"),
        tables,
        lens,
        scale,
        DECODE_PARTITION,
        scratch[0] if with_scratch else None,
        scratch[1] if with_scratch else None,
        own_rows if with_scratch else None,
        starts=starts,
    )
    return out.view(n, heads, dim)


def attend_quantized(
    q: torch.Tensor,
    layer: BlockReader,
    kind: str,
    view: QuantizedView,
    meta: AttentionMetadata,
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of every new token over a quantized layer: natively where the kernel runs."""
    if view.row_tables is not None:
        return native_rows(q, layer, view.row_tables, view.row_lens, scale, scratch, view.own_rows, view.row_starts)
    if layer.native is None or not meta.num_decode_tokens:
        return quantized_paged_attention(q, layer, kind, view, meta, scale, scratch)
    n = meta.num_decode_tokens
    out = quantized_paged_attention(q, layer, kind, view, meta, scale, scratch, decodes=False)
    out[:n] = native_rows(
        q[:n],
        layer,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
        scratch,
        view.own_rows,
        meta.decode_starts,
    )
    return out


def pad_visibility(visible: torch.Tensor) -> torch.Tensor:
    """A [queries, keys] visibility padded to kernel-friendly shapes; extra rows see key 0 only."""
    rows, width = visible.shape
    padded = torch.zeros(padded_query_rows(rows), padded_length(width, KEY_PAD), dtype=torch.bool)
    padded[:rows, :width] = visible
    padded[rows:, 0] = True
    return padded


class _Merged:
    """Attention over key ranges taken one at a time, merged by their log-sum-exp."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> None:
        """queries [B, H, Lq, D]; keys, values [B, H, C, D]; mask additive, broadcastable to [B, H, Lq, C]."""
        out, lse = flash_with_lse(queries, keys, values, 0.0, False, attn_mask=mask, scale=scale)
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
    if device.type != "cpu" or flash_with_lse is None or DEQUANT_CHUNK_TOKENS is None:
        return None
    return max(1, DEQUANT_CHUNK_TOKENS[kind] // block_size)


def _pad_keys(x: torch.Tensor, length: int) -> torch.Tensor:
    # x [1, L, heads, dim] -> [1, length, heads, dim]; the mask hides the zero keys
    return x if x.shape[1] == length else F.pad(x, (0, 0, 0, 0, 0, length - x.shape[1]))


def _pad_columns(mask: torch.Tensor, width: int) -> torch.Tensor:
    return mask if mask.shape[-1] == width else F.pad(mask, (0, width - mask.shape[-1]), value=float("-inf"))


def quantized_paged_attention(
    q: torch.Tensor,
    layer: BlockReader,
    kind: str,
    view: QuantizedView,
    meta: AttentionMetadata,
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    decodes: bool = True,
) -> torch.Tensor:
    """Attention of every new token (q: [T, heads, dim]) over a quantized layer's blocks: the
    reference path, which dequantizes blocks in PyTorch.

    `kind` picks the range length (DEQUANT_CHUNK_TOKENS); `scratch` is a KIVI layer's
    full-precision blocks of this step (see QuantizedView). With `decodes` false the decode rows
    are left for the caller.
    """
    num_kv_heads, head_dim = layer.heads, q.shape[2]
    group = q.shape[1] // num_kv_heads
    bs = layer.block_size
    step = _chunk_blocks(q.device, kind, bs)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decode_tokens
    if n and decodes:
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
            mask = meta.decode_mask[..., first * bs : last * bs]
            if decode_step is None:
                attended = F.scaled_dot_product_attention(
                    queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
                )
                break
            merged.add(queries, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)
        else:
            attended = merged.out
        out[:n] = attended.reshape(n, -1, head_dim).to(q.dtype)
    for i, (chunk, mask) in enumerate(zip(meta.prefills, view.chunk_masks)):
        rows = mask.shape[-2]
        queries = pad_rows(q[chunk.start : chunk.end], rows).transpose(0, 1).unsqueeze(0)
        table = chunk.block_table.unsqueeze(0)
        blocks = len(chunk.block_table)
        chunk_step = step if step is not None and step < blocks else None  # one range: concatenate
        ranges = [
            (layer.read(table[:, a : a + (chunk_step or blocks)]), a * bs)
            for a in range(0, blocks, chunk_step or blocks)
        ]
        if scratch is not None:
            first, last = view.chunk_rows[i]
            own = (
                scratch[0][first:last].reshape(1, -1, num_kv_heads, head_dim),
                scratch[1][first:last].reshape(1, -1, num_kv_heads, head_dim),
            )
            ranges.append((own, blocks * bs))
        if chunk_step is None:
            keys = torch.cat([k for (k, _), _ in ranges], dim=1) if len(ranges) > 1 else ranges[0][0][0]
            values = torch.cat([v for (_, v), _ in ranges], dim=1) if len(ranges) > 1 else ranges[0][0][1]
            keys, values = _pad_keys(keys, mask.shape[-1]), _pad_keys(values, mask.shape[-1])
            attended = F.scaled_dot_product_attention(
                queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        else:
            merged = _Merged()
            for (keys, values), offset in ranges:
                width = padded_length(keys.shape[1], KEY_PAD)
                columns = _pad_columns(mask[..., offset : offset + keys.shape[1]], width)
                # The kernel wants as many K/V heads as query heads.
                merged.add(
                    queries,
                    _pad_keys(keys, width).transpose(1, 2).repeat_interleave(group, dim=1),
                    _pad_keys(values, width).transpose(1, 2).repeat_interleave(group, dim=1),
                    columns,
                    scale,
                )
            attended = merged.out
        out[chunk.start : chunk.end] = attended.squeeze(0)[:, : chunk.end - chunk.start].transpose(0, 1).to(q.dtype)
    return out


def _overlay_own_blocks(
    keys: torch.Tensor,
    values: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
    own_blocks: torch.Tensor,
    first: int,
    last: int,
    n: int,
) -> None:
    """Put each decode's full-precision scratch block in place of its own block, if in [first, last)."""
    inside = ((own_blocks >= first) & (own_blocks < last)).nonzero().squeeze(1)
    if inside.numel():
        shape = scratch[0].shape[1:]
        keys.view(n, -1, *shape)[inside, own_blocks[inside] - first] = scratch[0][inside]
        values.view(n, -1, *shape)[inside, own_blocks[inside] - first] = scratch[1][inside]
