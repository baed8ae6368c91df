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


@dataclass
class Int4Blocks:
    """Weights w = scale * q + minimum, in groups of 32 along the input dimension (q in 0..15).

    Q4_1 stores the scale and minimum as fp16; Q4_0 has minimum = -8 * scale. Both are kept
    as float32 here, exactly.
    """

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in / 32]
    minimum: torch.Tensor  # float32 [out, in / 32]

    @property
    def zero(self) -> torch.Tensor:
        """The offset of torch's int4 matmul, w = (q - 8) * scale + zero."""
        return self.minimum + 8 * self.scale

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str, rows: int) -> Int4Blocks:
        """Decode GGUF Q4_0 / Q4_1 block bytes ([rows, blocks * bytes]) without losing anything."""
        blocks = np.asarray(raw).reshape(rows, -1, Q4_BLOCK_BYTES[type_name])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
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

    def map_rows(self, fn) -> Int4Blocks:
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.minimum))

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "minimum")))


@dataclass
class Int8Blocks:
    """GGUF Q8_0 weights w = scale * q, q in -127..127, in groups of 32 along the input dimension."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in / 32], fp16 values

    @classmethod
    def from_gguf(cls, raw: np.ndarray, rows: int) -> Int8Blocks:
        blocks = np.asarray(raw).reshape(rows, -1, Q8_BLOCK_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return cls(torch.from_numpy(q), torch.from_numpy(d))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: scale * q per group (GGUF's Q8_0 arithmetic)."""
        rows = self.q.shape[0]
        return self.q.view(rows, -1, GROUP_SIZE).float().mul_(self.scale.unsqueeze(-1)).view(rows, -1)


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
