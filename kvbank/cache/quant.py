"""KV codecs: how one layer's keys or values are stored in the pool.

Each codec turns full-precision K or V into a dict of stored tensors and back:

- `quantize(x) -> stored` and `dequantize(stored, dtype) -> x`; per-token codecs take any
  leading shape [..., heads, dim], block codecs take whole blocks [n, block_size, heads, dim].
- `components(block_size, heads, dim)`: the shape (per block) and dtype of every stored tensor.
  The pool allocates exactly these, so `bytes_per_block` / `bytes_per_token` are the memory the
  pool really uses, scales and zero points included.

Codecs:
- `FullPrecision`: the model dtype (or an explicit float dtype), no scales.
- `PerTokenInt8`: symmetric int8, one float16 scale per token per KV head.
- `PerTokenFP8`: float8 (e4m3 or e5m2) with one dynamic float16 scale per token per KV head,
  stored as uint8 because index_copy_ is not implemented for float8.
- `KiviKeys` / `KiviValues` (int4, int2): asymmetric, codes packed 8/bits to a byte. Keys are
  grouped per channel along the tokens of one block (outlier channels get their own range), the
  ranges two-level: 4-bit indices into per-(block, head) grids of 16 scales and 16 minimums.
  Values per token in groups of `group_size` channels, a float16 scale and an int8 zero point
  each. At head dim 64, 16-token blocks and groups of 64, int4 holds 71.4 bytes per token and KV
  head (0.279x bfloat16), int2 39.4 (0.154x). They quantize whole blocks only: the engine keeps a
  block's tokens in full precision until the block is full (the residual window).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

DEFAULT_GROUP_SIZE = 64

Components = dict[str, tuple[tuple[int, ...], torch.dtype]]
Stored = dict[str, torch.Tensor]

_SCALE_DTYPE = torch.float16
_TINY = 2.0**-24  # the smallest positive float16


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class Codec:
    """Stores K or V of one layer; subclasses define the format."""

    name = "codec"
    #: the storage kind (kvbank.cache.layers.KINDS) that keeps a layer stored through this codec
    kind = "token"

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> Stored:
        raise NotImplementedError

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def bytes_per_block(self, block_size: int, heads: int, dim: int) -> int:
        return sum(
            math.prod(shape) * _element_size(dtype) for shape, dtype in self.components(block_size, heads, dim).values()
        )


class FullPrecision(Codec):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        return {"data": ((block_size, heads, dim), self.dtype)}

    def quantize(self, x: torch.Tensor) -> Stored:
        return {"data": x.to(self.dtype)}

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        return stored["data"].to(dtype)


def _scales(amax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 scales (never zero, rounded up so no value clips) and their float32 values."""
    wanted = (amax.float() / top).clamp(min=_TINY)
    scale = wanted.to(_SCALE_DTYPE)
    scale = torch.where(scale.float() < wanted, torch.nextafter(scale, scale.new_tensor(math.inf)), scale)
    return scale, scale.float()


class PerTokenInt8(Codec):
    name = "int8"

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        return {"codes": ((block_size, heads, dim), torch.int8), "scale": ((block_size, heads), _SCALE_DTYPE)}

    def quantize(self, x: torch.Tensor) -> Stored:
        scale, exact = _scales(x.abs().amax(dim=-1), 127.0)
        codes = (x.float() / exact.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
        return {"codes": codes, "scale": scale}

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        # One mixed-dtype pass: the int8 codes are converted inside the multiply.
        return torch.mul(stored["codes"], stored["scale"].to(dtype).unsqueeze(-1))


class PerTokenFP8(Codec):
    def __init__(self, fp8: torch.dtype) -> None:
        self.fp8 = fp8
        self.top = torch.finfo(fp8).max
        self.name = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[fp8]

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        return {"codes": ((block_size, heads, dim), torch.uint8), "scale": ((block_size, heads), _SCALE_DTYPE)}

    def quantize(self, x: torch.Tensor) -> Stored:
        scale, exact = _scales(x.abs().amax(dim=-1), self.top)
        scaled = (x.float() / exact.unsqueeze(-1)).clamp_(-self.top, self.top)
        return {"codes": scaled.to(self.fp8).view(torch.uint8), "scale": scale}

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        scale = stored["scale"].float().unsqueeze(-1)
        codes = stored["codes"]
        if (
            self.fp8 == torch.float8_e4m3fn
            and codes.device.type == "cpu"
            and dtype in (torch.bfloat16, torch.float32)
            and scale.max() < 2.0**7
        ):
            # PyTorch's e4m3 -> bfloat16 conversion is scalar on CPU. Moving the exponent and
            # mantissa bits into a bfloat16 gives the same number times 2**-120 (subnormals
            # included), which the scale multiply undoes: 2.5x faster, and exact.
            codes = codes.to(torch.int16)
            bits = ((codes & 0x7F) << 4) | ((codes >> 7) * -32768)
            return torch.mul(bits.view(torch.bfloat16), (scale * 2.0**120).to(dtype))
        return stored["codes"].view(self.fp8).to(dtype) * scale.to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last axis, 8 // bits to a byte.

    The layout is planar: byte i holds codes i, i + n, i + 2n, ... (n = last axis / (8 // bits)),
    lowest bits first, so unpacking is a few whole-tensor shifts and one concatenation.
    """
    planes = codes.chunk(8 // bits, dim=-1)
    packed = planes[0].clone()
    for i, plane in enumerate(planes[1:], start=1):
        packed |= plane << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    mask = (1 << bits) - 1
    if bits == 4:
        return torch.cat((packed & mask, packed >> 4), dim=-1)
    return torch.cat([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)


def _f16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x as float16, rounded toward +inf (`up`) or -inf, returned as float32 values."""
    y = x.to(_SCALE_DTYPE)
    wrong = y.float() < x if up else y.float() > x
    step = torch.nextafter(y, torch.full_like(y, math.inf if up else -math.inf))
    return torch.where(wrong, step, y).float()


#: 2^(-k/3) for k = 0, 1, 2 as float16 numbers, so a float16 scale times one of them is exact in float32
_THIRDS = (1.0, 1625 / 2048, 1290 / 2048)
_GRID_STEPS = 16  # 4-bit range codes


def key_scale_grid(top: torch.Tensor) -> torch.Tensor:
    """The 16 key scales a block and head may use: top * 2^(-q/3) (q = 0..15), exactly in float32.

    `top` [...] float32 (a float16 number); returns [..., 16], largest first.
    """
    q = torch.arange(_GRID_STEPS, device=top.device)
    step = top.new_tensor(_THIRDS)[q % 3] * torch.exp2(-(q // 3).float())
    return top.unsqueeze(-1) * step


def key_min_grid(start: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The 16 key minimums: start + q * step (q = 0..15; the product is exact), [..., 16]."""
    q = torch.arange(_GRID_STEPS, device=start.device, dtype=torch.float32)
    return start.unsqueeze(-1) + q * step.unsqueeze(-1)


class KiviKeys(Codec):
    """Keys per channel over one block's tokens: a range (scale, minimum) per (block, head, channel).

    The ranges are two-level: each block and head stores three float16 numbers (the largest
    scale, the smallest minimum, a minimum step) and each channel one byte, a 4-bit index into
    16 scales top * 2^(-q/3) (low nibble) and one into 16 minimums start + q * step (high
    nibble). A channel's minimum is the grid's largest at or below its smallest key, its scale the
    grid's smallest that still spans its keys, so no key clips. Outlier channels keep their own
    range, at 1 byte per channel per block instead of 4.
    """

    kind = "kivi"

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}"

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        if dim % (8 // self.bits):
            raise ValueError(f"head_dim={dim} is not a multiple of {8 // self.bits}, needed to pack int{self.bits}")
        return {
            "codes": ((block_size, heads, dim * self.bits // 8), torch.uint8),
            "ranges": ((heads, dim), torch.uint8),
            "grid": ((heads, 3), _SCALE_DTYPE),
        }

    def quantize(self, x: torch.Tensor) -> Stored:
        top_code = (1 << self.bits) - 1
        x = x.float()  # [n, block, heads, dim]
        lo, hi = x.amin(dim=1), x.amax(dim=1)  # [n, heads, dim]
        start = _f16_toward(lo.amin(dim=-1), up=False)
        step = _f16_toward((lo.amax(dim=-1) - start) / (_GRID_STEPS - 1), up=True)
        mins = key_min_grid(start, step)  # [n, heads, 16], ascending
        q_min = (mins.unsqueeze(-2) <= lo.unsqueeze(-1)).sum(dim=-1) - 1  # the largest at or below lo
        low = mins.gather(-1, q_min)
        width = hi - low
        top = _f16_toward((width.amax(dim=-1) / top_code).clamp(min=_TINY), up=True)
        scales = key_scale_grid(top)  # descending
        q_scale = ((scales.unsqueeze(-2) * top_code >= width.unsqueeze(-1)).sum(dim=-1) - 1).clamp(min=0)
        scale = scales.gather(-1, q_scale)
        codes = ((x - low.unsqueeze(1)) / scale.unsqueeze(1)).round_().clamp_(0, top_code).to(torch.uint8)
        ranges = (q_scale | (q_min << 4)).to(torch.uint8)
        grid = torch.stack((top, start, step), dim=-1).to(_SCALE_DTYPE)
        return {"codes": pack(codes, self.bits), "ranges": ranges, "grid": grid}

    @staticmethod
    def ranges(stored: Stored) -> tuple[torch.Tensor, torch.Tensor]:
        """Every channel's float32 scale and minimum, [n, heads, dim] each."""
        grid = stored["grid"].float()
        ranges = stored["ranges"].long()
        scale = key_scale_grid(grid[..., 0]).gather(-1, ranges & 15)
        low = key_min_grid(grid[..., 1], grid[..., 2]).gather(-1, ranges >> 4)
        return scale, low

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(stored["codes"], self.bits).to(dtype)
        scale, low = self.ranges(stored)
        return torch.addcmul(low.to(dtype).unsqueeze(1), codes, scale.to(dtype).unsqueeze(1))


class KiviValues(Codec):
    """Values per token: one range per (token, head, group of `group_size` channels).

    A float16 scale and an int8 zero point: the group's values are (code + zero) * scale. The
    scale spans the group's values, rounded up, and is at least |minimum| / 127 so the zero point
    fits its byte.
    """

    kind = "kivi"

    def __init__(self, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.bits = bits
        self.group_size = group_size
        self.name = f"int{bits}"

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        if dim % self.group_size:
            raise ValueError(f"kv_quant_group_size={self.group_size} does not divide head_dim={dim}")
        if dim % (8 // self.bits):
            raise ValueError(f"head_dim={dim} is not a multiple of {8 // self.bits}, needed to pack int{self.bits}")
        groups = dim // self.group_size
        return {
            "codes": ((block_size, heads, dim * self.bits // 8), torch.uint8),
            "scale": ((block_size, heads, groups), _SCALE_DTYPE),
            "zero": ((block_size, heads, groups), torch.int8),
        }

    def quantize(self, x: torch.Tensor) -> Stored:
        top_code = (1 << self.bits) - 1
        grouped = x.float().reshape(*x.shape[:-1], -1, self.group_size)
        lo, hi = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
        want = torch.maximum((hi - lo) / top_code, lo.abs() / 127).clamp_(min=_TINY)
        scale = _f16_toward(want, up=True)
        zero = (lo / scale).round_().clamp_(-128, 127)
        codes = (grouped / scale - zero).round_().clamp_(0, top_code).to(torch.uint8)
        return {
            "codes": pack(codes.flatten(-2), self.bits),
            "scale": scale.squeeze(-1).to(_SCALE_DTYPE),
            "zero": zero.squeeze(-1).to(torch.int8),
        }

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        # Codes plus zero points are small integers, exact in any float dtype. Spreading the group
        # scales over their channels first keeps the multiply on its fast path (no broadcast
        # along the innermost axis).
        codes = unpack(stored["codes"], self.bits).to(dtype)
        zero = stored["zero"].to(dtype).repeat_interleave(self.group_size, dim=-1)
        scale = stored["scale"].to(dtype).repeat_interleave(self.group_size, dim=-1)
        return (codes + zero).mul_(scale)


CodecPair = tuple[Codec, Codec]

#: kv_cache_dtype name -> (key, value) codecs, given the model dtype and the int4/int2 group size.
CODECS: dict[str, Callable[[torch.dtype, int], CodecPair]] = {
    "auto": lambda model_dtype, _: (FullPrecision(model_dtype), FullPrecision(model_dtype)),
    "bfloat16": lambda *_: (FullPrecision(torch.bfloat16), FullPrecision(torch.bfloat16)),
    "float32": lambda *_: (FullPrecision(torch.float32), FullPrecision(torch.float32)),
    "fp8_e4m3": lambda *_: (PerTokenFP8(torch.float8_e4m3fn), PerTokenFP8(torch.float8_e4m3fn)),
    "fp8_e5m2": lambda *_: (PerTokenFP8(torch.float8_e5m2), PerTokenFP8(torch.float8_e5m2)),
    "int8": lambda *_: (PerTokenInt8(), PerTokenInt8()),
    "int4": lambda _, group_size: (KiviKeys(4), KiviValues(4, group_size)),
    "int2": lambda _, group_size: (KiviKeys(2), KiviValues(2, group_size)),
}
KV_CACHE_DTYPES = tuple(CODECS)


def codecs_for(kv_cache_dtype: str, model_dtype: torch.dtype, group_size: int = DEFAULT_GROUP_SIZE) -> CodecPair:
    """The (key, value) codecs of one quantized layer for a `kv_cache_dtype` name."""
    if kv_cache_dtype not in CODECS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return CODECS[kv_cache_dtype](model_dtype, group_size)
