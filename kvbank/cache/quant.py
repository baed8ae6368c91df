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
- `KiviKeys` / `KiviValues` (int4, int2): asymmetric, a float16 scale and a float16 minimum
  ("zero point") per group, codes packed 8/bits to a byte. Keys are grouped per channel along the
  tokens of one block (outlier channels get their own range); values per token in groups of
  `group_size` channels. They quantize whole blocks only: the engine keeps a block's tokens in
  full precision until the block is full (the residual window).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

DEFAULT_GROUP_SIZE = 32

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


def _asymmetric(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes in [0, 2**bits) along groups reduced over `dim`, with float16 scale and minimum."""
    top = (1 << bits) - 1
    x = x.float()
    low = x.amin(dim=dim, keepdim=True).to(_SCALE_DTYPE)
    scale = ((x.amax(dim=dim, keepdim=True) - low.float()) / top).clamp_(min=_TINY).to(_SCALE_DTYPE)
    codes = ((x - low.float()) / scale.float()).round_().clamp_(0, top).to(torch.uint8)
    return codes, scale.squeeze(dim), low.squeeze(dim)


class KiviKeys(Codec):
    """Keys per channel: one range per (block, head, channel), over the block's tokens."""

    kind = "kivi"

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}"

    def components(self, block_size: int, heads: int, dim: int) -> Components:
        if dim % (8 // self.bits):
            raise ValueError(f"head_dim={dim} is not a multiple of {8 // self.bits}, needed to pack int{self.bits}")
        return {
            "codes": ((block_size, heads, dim * self.bits // 8), torch.uint8),
            "scale": ((heads, dim), _SCALE_DTYPE),
            "min": ((heads, dim), _SCALE_DTYPE),
        }

    def quantize(self, x: torch.Tensor) -> Stored:
        codes, scale, low = _asymmetric(x, 1, self.bits)
        return {"codes": pack(codes, self.bits), "scale": scale, "min": low}

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(stored["codes"], self.bits).to(dtype)
        return torch.addcmul(stored["min"].to(dtype).unsqueeze(1), codes, stored["scale"].to(dtype).unsqueeze(1))


class KiviValues(Codec):
    """Values per token: one range per (token, head, group of `group_size` channels)."""

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
            "min": ((block_size, heads, groups), _SCALE_DTYPE),
        }

    def quantize(self, x: torch.Tensor) -> Stored:
        grouped = x.reshape(*x.shape[:-1], -1, self.group_size)
        codes, scale, low = _asymmetric(grouped, -1, self.bits)
        return {"codes": pack(codes.flatten(-2), self.bits), "scale": scale, "min": low}

    def dequantize(self, stored: Stored, dtype: torch.dtype) -> torch.Tensor:
        # Spreading the group scales over their channels first keeps addcmul on its fast path
        # (no broadcast along the innermost axis).
        codes = unpack(stored["codes"], self.bits).to(dtype)
        scale = stored["scale"].to(dtype).repeat_interleave(self.group_size, dim=-1)
        return torch.addcmul(stored["min"].to(dtype).repeat_interleave(self.group_size, dim=-1), codes, scale)


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
