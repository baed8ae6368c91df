"""4-bit GGUF weights kept 4-bit for small batches.

A decode step of a small model on a CPU is bound by reading the weights. GGUF's Q4_0/Q4_1
blocks (32 weights, one scale, one offset) map exactly onto torch's grouped int4 matmul
(w = (q - 8) * scale + zero), so small batches read 4-bit weights while large batches
(prefill) use the dense copy, where compute, not memory, is the limit. The two round
differently, so a batch-invariant engine gives every batch the 4-bit path: each of the two
kernels alone gives a row the same result whatever the number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
Q8_BLOCK_BYTES = 34
#: the GGUF types whose integer weights and scales each block form holds exactly, with the form's
#: shape: with a minimum per block (Int4Blocks: q's bits, whether the scales need float32) and
#: without (Int8Blocks: q's bits, whether the scales are per 16 inputs)
INT4_FORMS = {"Q4_0": (4, False), "Q4_1": (4, False), "Q4_K": (4, True), "Q5_1": (5, False), "Q5_K": (5, True)}
INT8_FORMS = {"Q8_0": (8, False), "Q5_0": (5, False), "Q6_K": (6, True)}
INT4_TYPES, INT8_TYPES = tuple(INT4_FORMS), tuple(INT8_FORMS)


def _halves(cells: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of every block of `cells` ([rows, blocks, bytes]), as float32 [rows, blocks]."""
    return cells[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _five_bits(high: np.ndarray, low: np.ndarray, rows: int) -> np.ndarray:
    """Q5_0 / Q5_1 weights (uint8 [rows, in], 0..31) from each block's 4 bytes of fifth bits (a
    little-endian word, bit e for weight e) and 16 bytes of nibbles (weights e and e + 16)."""
    fifth = high.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [rows, nb, 32]
    nibbles = low.reshape(rows, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return ((nibbles & 0x0F).reshape(rows, -1, 32) | ((fifth & 1).astype(np.uint8) << 4)).reshape(rows, -1)


def _k_quant(raw: np.ndarray, rows: int, five: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks -> (q uint8 [rows, in], scale, minimum float32 [rows, in / 32]).

    A super-block holds fp16 d and dmin, eight 6-bit scales and minimums packed in 12 bytes, (Q5_K:
    32 bytes of fifth bits, bit j of byte e for weight e of sub-block j) and 256 4-bit weights;
    sub-block j's weights are d * sc_j * q - dmin * m_j. The products are exact in float32 (11 + 6
    significant bits), so scale = d * sc_j and minimum = -(dmin * m_j) hold the file's values and
    scale * q + minimum is gguf's arithmetic to the bit.
    """
    cells = np.asarray(raw).reshape(rows, -1, 176 if five else 144)
    nb = cells.shape[1]
    d, dmin = _halves(cells, 0)[..., None], _halves(cells, 2)[..., None]
    packed = cells[..., 4:16].reshape(rows, nb, 3, 4)
    low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    m = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], axis=-1)
    low = 48 if five else 16
    qs = cells[..., low:].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, nb, 8, 32)
    if five:
        high = cells[..., 16:48].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((high & 1) << 4)
    q = q.reshape(rows, -1)
    scale = (d * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin * m.astype(np.float32)).reshape(rows, -1)
    return q, scale, minimum


@dataclass
class Int4Blocks:
    """Weights w = scale * q + minimum, in groups of 32 along the input dimension (q in 0..15; Q5_K 0..31).

    Q4_1 stores the scale and minimum as fp16; Q4_0 has minimum = -8 * scale. Both are kept
    as float32 here, exactly.
    """

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in / 32]
    minimum: torch.Tensor  # float32 [out, in / 32]
    #: whether the scales need float32 (Q4_K's products of two scales), not only fp16
    wide: bool = False
    #: the bits q needs: 4, or 5 (Q5_K: 0..31)
    bits: int = 4

    @property
    def zero(self) -> torch.Tensor:
        """The offset of torch's int4 matmul, w = (q - 8) * scale + zero."""
        return self.minimum + 8 * self.scale

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str, rows: int) -> Int4Blocks:
        """Decode GGUF Q4_0 / Q4_1 / Q4_K / Q5_1 / Q5_K block bytes ([rows, blocks * bytes]), losing nothing."""
        bits, wide = INT4_FORMS[type_name]
        if wide:  # Q4_K, Q5_K
            parts = (torch.from_numpy(np.ascontiguousarray(a)) for a in _k_quant(raw, rows, bits == 5))
            return cls(*parts, wide=True, bits=bits)
        if type_name == "Q5_1":  # d, m, then Q5_0's fifth bits and nibbles; w = d * q + m
            cells = np.asarray(raw).reshape(rows, -1, 24)
            q, d, m = _five_bits(cells[..., 4:8], cells[..., 8:], rows), _halves(cells, 0), _halves(cells, 2)
            return cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), bits=5)
        blocks = np.asarray(raw).reshape(rows, -1, Q4_BLOCK_BYTES[type_name])
        d = _halves(blocks, 0)
        if type_name == "Q4_1":
            m = _halves(blocks, 2)
            nibbles = blocks[..., 4:]
        else:
            nibbles = blocks[..., 2:]
            m = -8 * d
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, -1)
        return cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: scale * q + minimum per group, in that order (GGUF's Q4_1 arithmetic)."""
        rows = self.q.shape[0]
        weight = self.q.view(rows, -1, GROUP_SIZE).float()  # in place from here: no second copy held
        return weight.mul_(self.scale.unsqueeze(-1)).add_(self.minimum.unsqueeze(-1)).view(rows, -1)

    @classmethod
    def meta(cls, shape: tuple[int, int], type_name: str) -> Int4Blocks:
        """The blocks `from_gguf` gives for a tensor of this shape and type, on the meta device."""
        (rows, cols), (bits, wide) = shape, INT4_FORMS[type_name]
        scales = (rows, cols // GROUP_SIZE)
        return cls(_meta(shape, torch.uint8), _meta(scales), _meta(scales), wide=wide, bits=bits)

    def map_rows(self, fn) -> Int4Blocks:
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.minimum), self.wide, self.bits)

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        fields = (torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "minimum"))
        return Int4Blocks(*fields, wide=any(p.wide for p in parts), bits=max(p.bits for p in parts))

    def as_int8(self) -> Int8Blocks | None:
        """The same weights as 8-bit blocks when they are symmetric (Q4_0: minimum = -8 * scale), else None."""
        if self.q.device.type == "meta" or not torch.equal(self.minimum, -8 * self.scale):
            return None
        return Int8Blocks((self.q.to(torch.int16) - 8).to(torch.int8), self.scale, 4)


@dataclass
class Int8Blocks:
    """Weights w = scale * q with integer q in -128..127 and one scale per group along the input
    dimension: 32 inputs (GGUF Q8_0; Q5_0 as q - 16; Q4_0 as q - 8), or 16 inputs (Q6_K: q - 32
    with the super-block scale times the sub-block's 8-bit scale, exact in float32). Blocks of at
    most 5 bits pack into 5-bit records (Q5_0's own size), the others into 8-bit ones."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in / 32] (fp16 values), or [out, in / 16]
    #: the bits q needs: 8 (Q8_0), 6 (Q6_K), 5 (Q5_0: -16..15), 4 (Q4_0: -8..7)
    bits: int = 8

    @property
    def halves(self) -> bool:
        """Whether the scales are per 16 inputs."""
        return self.scale.shape[1] * GROUP_SIZE // 2 == self.q.shape[1]

    @classmethod
    def from_gguf(cls, raw: np.ndarray, rows: int, type_name: str = "Q8_0") -> Int8Blocks:
        raw = np.asarray(raw)
        if type_name == "Q6_K":
            cells = raw.reshape(rows, -1, 210)
            shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
            low = (cells[..., :128].reshape(rows, -1, 2, 1, 64) >> shifts) & 0x0F
            shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
            high = (cells[..., 128:192].reshape(rows, -1, 2, 1, 32) >> shifts) & 0x03
            q = (low.reshape(rows, -1, 2, 4, 32) | (high << 4).reshape(rows, -1, 2, 4, 32)).astype(np.int8)
            d = cells[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
            scale = d * cells[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, nb, 16]
            return cls(torch.from_numpy((q - 32).reshape(rows, -1)), torch.from_numpy(scale.reshape(rows, -1)), 6)
        if type_name == "Q5_0":
            cells = raw.reshape(rows, -1, 22)
            q = _five_bits(cells[..., 2:6], cells[..., 6:], rows)
            return cls(torch.from_numpy(q.astype(np.int8) - 16), torch.from_numpy(_halves(cells, 0)), 5)
        blocks = raw.reshape(rows, -1, Q8_BLOCK_BYTES)
        d = _halves(blocks, 0)
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return cls(torch.from_numpy(q), torch.from_numpy(d))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: scale * q per group (GGUF's Q8_0, Q5_0 and Q6_K arithmetic)."""
        rows = self.q.shape[0]
        group = GROUP_SIZE // 2 if self.halves else GROUP_SIZE
        return self.q.view(rows, -1, group).float().mul_(self.scale.unsqueeze(-1)).view(rows, -1)

    @classmethod
    def meta(cls, shape: tuple[int, int], type_name: str) -> Int8Blocks:
        """The blocks `from_gguf` gives for a tensor of this shape and type, on the meta device."""
        (rows, cols), (bits, halves) = shape, INT8_FORMS[type_name]
        group = GROUP_SIZE // 2 if halves else GROUP_SIZE
        return cls(_meta(shape, torch.int8), _meta((rows, cols // group)), bits)

    def per_half(self) -> Int8Blocks:
        """The same weights with a scale per 16 inputs (each 32-input scale twice)."""
        return self if self.halves else Int8Blocks(self.q, self.scale.repeat_interleave(2, dim=1), self.bits)

    def map_rows(self, fn) -> Int8Blocks:
        return Int8Blocks(fn(self.q), fn(self.scale), self.bits)

    @staticmethod
    def cat(parts: list[Int8Blocks]) -> Int8Blocks:
        if len({p.halves for p in parts}) > 1:
            parts = [p.per_half() for p in parts]
        bits = max(p.bits for p in parts)
        return Int8Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), bits)


def packed_matmul_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class PackedLinear(nn.Module):
    """A linear layer on int4 blocks for batches of at most `max_rows` tokens, on its dense weight above.

    With `max_rows=None` every batch takes the int4 path, and the dense weight is not kept.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, blocks: Int4Blocks, max_rows: int | None
    ) -> None:
        super().__init__()
        self.weight = None if max_rows is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.max_rows = max_rows
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1))
        scales_zeros = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1)
        self.register_buffer("scales_zeros", scales_zeros.to(weight.dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)
        return out if self.bias is None else out + self.bias
