"""GGUF weights laid out for kvbank's integer matmul kernels (kvbank/kernels/matmul.h).

A CPU decode step is bound by reading weights. These layers keep the GGUF's bytes (4-bit Q4_0 /
Q4_1 projections, the 8-bit Q8_0 embedding table that is also the LM head) and multiply them with
activations quantized to 8 bits per 32 values, with integer dot products, as llama.cpp does.
Weights are rearranged once at load into records of 16 output rows x 32 inputs, so one 512-bit
VNNI instruction serves 16 rows; the byte count stays the file's (5 bits per 4-bit weight, 8.5
per 8-bit one). Packing is plain tensor ops, so it also runs on meta tensors (memory prediction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbank.models.packed import GROUP_SIZE, Int4Blocks, Int8Blocks

#: output rows interleaved in one record
GROUP_ROWS = 16
#: the kernels' record kinds: 4-bit with fp16 scales (Q4_0, Q4_1) or float32 ones (Q4_K); 5-bit
#: (Q5_0; Q4_0) or 5-bit with float32 scales and minimums (Q5_K); 8-bit with an fp16 scale per 32
#: inputs (Q8_0, and Q5_0 / Q4_0 fused with Q8_0) or float32 scales per 16 (Q6_K)
KIND_Q4, KIND_Q5, KIND_Q8, KIND_Q4F, KIND_Q5F, KIND_Q8H = 4, 5, 8, 41, 51, 81


def packable(out_features: int, in_features: int) -> bool:
    return out_features % GROUP_ROWS == 0 and in_features % GROUP_SIZE == 0


def _halves_as_bytes(values: torch.Tensor, groups: int, blocks: int) -> torch.Tensor:
    """[out, blocks] float32 (fp16 values) -> uint8 [groups, blocks, 32]: each record's 16 rows as fp16."""
    per_record = values.to(torch.float16).reshape(groups, GROUP_ROWS, blocks).transpose(1, 2).contiguous()
    return per_record.view(torch.uint8).reshape(groups, blocks, 2 * GROUP_ROWS)


def _floats_as_bytes(values: torch.Tensor, groups: int, blocks: int, per_block: int = 1) -> torch.Tensor:
    """[out, blocks * per_block] float32 -> uint8 [groups, blocks, 64 * per_block]: for each block,
    its `per_block` values of the record's 16 rows, one value's 16 rows after the other."""
    cells = values.reshape(groups, GROUP_ROWS, blocks, per_block).permute(0, 2, 3, 1).contiguous()
    return cells.view(torch.uint8).reshape(groups, blocks, 4 * GROUP_ROWS * per_block)


def pack_q4(blocks: Int4Blocks) -> torch.Tensor:
    """uint8 [out / 16, in / 32, 320] records (see kvbank/kernels/matmul.h) of 4-bit weights; 384-byte records
    with float32 scales and minimums when `blocks.wide` (kind 41)."""
    out_features, in_features = blocks.q.shape
    groups, nb = out_features // GROUP_ROWS, in_features // GROUP_SIZE
    # q[g, r, b, half, j, e] is the weight at input b*32 + half*16 + 4j + e of row 16g + r.
    q = blocks.q.reshape(groups, GROUP_ROWS, nb, 2, 4, 4)
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).to(torch.uint8)  # [g, r, b, j, e]
    quads = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, nb, 4 * GROUP_ROWS * 4)
    values = _floats_as_bytes if blocks.wide else _halves_as_bytes
    scale = values(blocks.scale, groups, nb)
    minimum = values(blocks.minimum, groups, nb)
    return torch.cat([quads, scale, minimum], dim=-1).contiguous()


def pack_q8(blocks: Int8Blocks) -> torch.Tensor:
    """uint8 [out / 16, in / 32, 544] records (see kvbank/kernels/matmul.h) of 8-bit weights, stored as w + 128;
    640-byte records with two float32 scales per block when the scales are per 16 inputs (kind 81)."""
    out_features, in_features = blocks.q.shape
    groups, nb = out_features // GROUP_ROWS, in_features // GROUP_SIZE
    q = (blocks.q.to(torch.int16) + 128).to(torch.uint8).reshape(groups, GROUP_ROWS, nb, 8, 4)
    quads = q.permute(0, 2, 3, 1, 4).reshape(groups, nb, 8 * GROUP_ROWS * 4)
    if blocks.halves:
        return torch.cat([quads, _floats_as_bytes(blocks.scale, groups, nb, 2)], dim=-1).contiguous()
    return torch.cat([quads, _halves_as_bytes(blocks.scale, groups, nb)], dim=-1).contiguous()


def _q5_bits(u: torch.Tensor, groups: int, nb: int) -> torch.Tensor:
    """uint8 [groups, nb, 320]: weights u (0..31) as a Q4 record's nibble pairs of their low four
    bits, then one 64-bit mask of fifth bits per 64-byte chunk and nibble half."""
    q = u.reshape(groups, GROUP_ROWS, nb, 2, 4, 4)
    nibbles = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).to(torch.uint8)  # [g, r, b, j, e]
    quads = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, nb, 4 * GROUP_ROWS * 4)
    # bit r * 4 + e of the mask for nibble half `half` of chunk j is row r's weight 16 * half + 4j + e
    bits = (q >> 4).permute(0, 2, 3, 4, 1, 5).reshape(groups, nb, 2, 4, 8, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=u.device)
    masks = (bits * weights).sum(-1, dtype=torch.uint8).reshape(groups, nb, 64)
    return torch.cat([quads, masks], dim=-1)


def pack_q5(blocks: Int8Blocks) -> torch.Tensor:
    """uint8 [out / 16, in / 32, 352] records (see kvbank/kernels/matmul.h) of weights in -16..15, stored as
    q + 16 (_q5_bits), then the fp16 scales."""
    out_features, in_features = blocks.q.shape
    groups, nb = out_features // GROUP_ROWS, in_features // GROUP_SIZE
    u = (blocks.q.to(torch.int16) + 16).to(torch.uint8)
    return torch.cat([_q5_bits(u, groups, nb), _halves_as_bytes(blocks.scale, groups, nb)], dim=-1).contiguous()


def pack_q5f(blocks: Int4Blocks) -> torch.Tensor:
    """uint8 [out / 16, in / 32, 448] records (see kvbank/kernels/matmul.h) of weights q in 0..31 (Q5_K) as
    _q5_bits, then float32 scales and minimums."""
    out_features, in_features = blocks.q.shape
    groups, nb = out_features // GROUP_ROWS, in_features // GROUP_SIZE
    scale, minimum = (_floats_as_bytes(v, groups, nb) for v in (blocks.scale, blocks.minimum))
    return torch.cat([_q5_bits(blocks.q.to(torch.uint8), groups, nb), scale, minimum], dim=-1).contiguous()


def pack(blocks: Int4Blocks | Int8Blocks) -> tuple[torch.Tensor, int]:
    """(records, kind) of 4-, 5- or 8-bit blocks for the integer kernels."""
    if isinstance(blocks, Int4Blocks):
        if blocks.bits == 5:
            return pack_q5f(blocks), KIND_Q5F
        return pack_q4(blocks), KIND_Q4F if blocks.wide else KIND_Q4
    if blocks.halves:
        return pack_q8(blocks), KIND_Q8H
    return (pack_q5(blocks), KIND_Q5) if blocks.bits <= 5 else (pack_q8(blocks), KIND_Q8)


def unpack_q8_rows(records: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight rows `rows` (int64 [n]) of Q8 records, as `dtype` (an embedding lookup)."""
    _, nb, _ = records.shape
    picked = records[rows // GROUP_ROWS]  # [n, nb, 544]
    lane = (rows % GROUP_ROWS).view(-1, 1, 1, 1, 1)
    quads = picked[..., : 8 * GROUP_ROWS * 4].reshape(-1, nb, 8, GROUP_ROWS, 4)
    q = quads.gather(3, lane.expand(-1, nb, 8, 1, 4)).reshape(-1, nb, GROUP_SIZE)
    scales = picked[..., 8 * GROUP_ROWS * 4 :].reshape(-1, nb, GROUP_ROWS, 2)
    d = scales.gather(2, lane.view(-1, 1, 1, 1).expand(-1, nb, 1, 2)).reshape(-1, nb, 2).contiguous()
    d = d.view(torch.float16).float()  # [n, nb, 1]
    return ((q.to(torch.int16) - 128).float() * d).reshape(len(rows), -1).to(dtype)


class QuantLinear(nn.Module):
    """A linear layer on packed GGUF records (any kind above) through the native integer kernel.

    For batches of more than `max_rows` tokens it uses its dense weight instead; with
    `max_rows=None` every batch takes the integer path and no dense copy is kept.
    """

    #: kvbank's native module; set by the model when it packs (there is no path without it)
    native = None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, records: torch.Tensor, kind: int, max_rows: int | None
    ) -> None:
        super().__init__()
        self.weight = None if max_rows is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.max_rows = max_rows
        #: the records' kind (KIND_Q4, KIND_Q5, KIND_Q8, KIND_Q4F, KIND_Q5F, KIND_Q8H)
        self.kind = kind
        self.out_features, self.in_features = weight.shape
        self.register_buffer("records", records)

    def integer_path(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def segments(self) -> tuple[list[torch.Tensor], list[int]]:
        """The records and kinds the fused native calls take (one segment)."""
        return [self.records], [self.kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.integer_path(x.shape[0]):
            return F.linear(x, self.weight, self.bias)
        out = self.native.qlinear(x, self.records, self.kind)
        return out if self.bias is None else out + self.bias


class SplitLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose tensors have no record kind in common (Q4_K q/k
    with a Q6_K v, as Q4_K_M files mix them): each part on the integer kernels in its own
    records, the outputs side by side. Each part gives a row the same bits in any batch, so the
    whole does too."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.max_rows = parts[0].max_rows
        self.bias = None

    def integer_path(self, rows: int) -> bool:
        return all(p.integer_path(rows) for p in self.parts)

    def segments(self) -> tuple[list[torch.Tensor], list[int]]:
        """The parts' records and kinds, side by side, as the fused native calls take them."""
        return [p.records for p in self.parts], [p.kind for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """An embedding table read from Q8 records, the same bytes the LM head multiplies with.

    A row comes out exactly as the dense table (dequantized in float32, then cast) would give it.
    """

    native = None

    def __init__(self, records: torch.Tensor, num_embeddings: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", records)
        self.num_embeddings = num_embeddings
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.native is not None and flat.device.type == "cpu":
            rows = self.native.q8_rows(self.weight, flat, self.dtype)
        else:
            rows = unpack_q8_rows(self.weight, flat, self.dtype)
        return rows.reshape(*ids.shape, -1)


class QuantHead(nn.Module):
    """The LM head on packed records (Q8 when tied to a Q8_0 table; an untied head in its own
    type's records): float32 logits of the final norm's output, in one native call."""

    native = None

    def __init__(self, records: torch.Tensor, kind: int, out_features: int) -> None:
        super().__init__()
        self.register_buffer("weight", records)
        self.kind = kind
        self.out_features = out_features

    def logits(self, hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.native.qhead(hidden, norm_weight, eps, self.weight, self.kind)
