"""What each way of storing int4's scales and minimums costs in bytes and in perplexity.

int4 spends 32 bytes per token per KV head (head dim 64) on key codes and 32 on value codes; what
separates a format from <= 0.28x of bfloat16's 256 bytes is the metadata around them (at most 7.7
bytes per token). This measures the engine's format against the ones it replaced, all in one
configuration (bfloat16 model; the PyTorch attention path, KVBANK_NATIVE_KERNELS=0, because the
native kernels read only the engine's own format):

- `f16-g32`, `f16-g64`: a float16 scale and minimum per key channel per 16-token block; values per
  token in groups of 32 or 64 channels with a float16 scale and minimum (the format before
  two-level ranges; g32 was its default);
- `f16+zp`: those keys, the engine's values (groups of 64, float16 scale, int8 zero point);
- `two-level` (the engine's format, `kv_cache_dtype="int4"`): each block's key scales and
  minimums as 4-bit indices into grids of three float16 numbers per block and head (scales in
  steps of 2^(1/3) down from the largest; minimums evenly spaced), the engine's values;
- `f16-block128`: the float16 format at 128-token blocks (key ranges over 128 tokens, the
  full-precision residual 128 tokens), g64: what a key-scale group of 8 blocks of 16 computes.

Bytes are what each format stores. Perplexity is over --ppl-tokens tokens of --corpus in
--window-token windows scored with prompt_logprobs, as in bench/kv_quant.py.

    KVBANK_NATIVE_KERNELS=0 python bench/int4_formats.py --ppl-tokens 16384

Results also go to bench/results/int4_formats.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.kv_quant import DEFAULT_CORPUS, perplexity  # noqa: E402
from kvbank import LLM  # noqa: E402
from kvbank.cache import quant  # noqa: E402
from kvbank.cache.quant import Codec, KiviKeys, KiviValues, pack, unpack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
F16 = torch.float16


def _ranges(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes along groups reduced over `dim`, with a float16 scale and minimum each."""
    top = (1 << bits) - 1
    x = x.float()
    low = x.amin(dim=dim, keepdim=True).to(F16)
    scale = ((x.amax(dim=dim, keepdim=True) - low.float()) / top).clamp_(min=2.0**-24).to(F16)
    codes = ((x - low.float()) / scale.float()).round_().clamp_(0, top).to(torch.uint8)
    return codes, scale, low


class F16Keys(Codec):
    """Keys per channel over a block, a float16 scale and minimum per channel."""

    kind = "kivi"

    def __init__(self, bits: int) -> None:
        self.bits, self.name = bits, f"int{bits}"

    def components(self, block_size: int, heads: int, dim: int) -> quant.Components:
        codes = ((block_size, heads, dim * self.bits // 8), torch.uint8)
        return {"codes": codes, "scale": ((heads, dim), F16), "min": ((heads, dim), F16)}

    def quantize(self, x: torch.Tensor) -> quant.Stored:
        codes, scale, low = _ranges(x, 1, self.bits)
        return {"codes": pack(codes, self.bits), "scale": scale.squeeze(1), "min": low.squeeze(1)}

    def dequantize(self, stored: quant.Stored, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(stored["codes"], self.bits).to(dtype)
        return torch.addcmul(stored["min"].to(dtype).unsqueeze(1), codes, stored["scale"].to(dtype).unsqueeze(1))


class F16Values(Codec):
    """Values per token in groups of channels, a float16 scale and minimum per group."""

    kind = "kivi"

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size, self.name = bits, group_size, f"int{bits}"

    def components(self, block_size: int, heads: int, dim: int) -> quant.Components:
        meta = ((block_size, heads, dim // self.group_size), F16)
        return {"codes": ((block_size, heads, dim * self.bits // 8), torch.uint8), "scale": meta, "min": meta}

    def quantize(self, x: torch.Tensor) -> quant.Stored:
        codes, scale, low = _ranges(x.reshape(*x.shape[:-1], -1, self.group_size), -1, self.bits)
        return {"codes": pack(codes.flatten(-2), self.bits), "scale": scale.squeeze(-1), "min": low.squeeze(-1)}

    def dequantize(self, stored: quant.Stored, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(stored["codes"], self.bits).to(dtype)
        scale = stored["scale"].to(dtype).repeat_interleave(self.group_size, dim=-1)
        return torch.addcmul(stored["min"].to(dtype).repeat_interleave(self.group_size, dim=-1), codes, scale)


#: name -> (codec pair factory, block size)
VARIANTS = {
    "f16-g32": (lambda: (F16Keys(4), F16Values(4, 32)), 16),
    "f16-g64": (lambda: (F16Keys(4), F16Values(4, 64)), 16),
    "f16+zp": (lambda: (F16Keys(4), KiviValues(4, 64)), 16),
    "two-level": (lambda: (KiviKeys(4), KiviValues(4, 64)), 16),
    "f16-block128": (lambda: (F16Keys(4), F16Values(4, 64)), 128),
}


def per_token_bytes(pair: tuple[Codec, Codec], block: int, dim: int = 64) -> float:
    """Bytes per token per KV head of a codec pair."""
    return sum(codec.bytes_per_block(block, 1, dim) for codec in pair) / block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if os.environ.get("KVBANK_NATIVE_KERNELS", "1") != "0":
        parser.error("run with KVBANK_NATIVE_KERNELS=0: the variants go through the PyTorch path")
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus} does not exist")
    rows: dict[str, dict] = {}
    tokens: list[int] = []
    for name in ["auto", *args.only]:
        factory, block = VARIANTS.get(name, (None, 16))
        per_token = per_token_bytes(factory(), block) if factory is not None else 256.0
        kv = "auto"
        if factory is not None:
            quant.CODECS["int4"] = lambda *_, f=factory: f()
            kv = "int4"
        llm = LLM(
            dtype="bfloat16", block_size=block, kv_cache_dtype=kv, kv_cache_memory_gb=1.0, enable_prefix_caching=False
        )
        if not tokens:
            tokens = llm.get_tokenizer().encode(args.corpus.read_text(errors="replace"))
            tokens = tokens[: args.ppl_tokens + args.ppl_tokens // (args.window - 1) + args.window]
        start = time.perf_counter()
        ppl, count = perplexity(llm, tokens, args.window)
        rows[name] = {
            "bytes_per_token": per_token,
            "ratio": per_token / 256,
            "perplexity": ppl,
            "ppl_tokens": count,
            "seconds": time.perf_counter() - start,
        }
        del llm
        print(name, rows[name], flush=True)
    base = rows["auto"]["perplexity"]
    print(
        f"\nperplexity over {rows['auto']['ppl_tokens']} tokens of {args.corpus.name}, "
        f"windows of {args.window}, bfloat16 model, PyTorch attention path\n"
    )
    print("| format | bytes/token/head (dim 64) | vs bfloat16 | perplexity | change |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| `{name}` | {row['bytes_per_token']:.3f} | {row['ratio']:.4f}x | {row['perplexity']:.3f} | "
            f"{(row['perplexity'] / base - 1) * 100:+.2f}% |"
        )
    out = ROOT / "bench" / "results" / "int4_formats.json"
    out.write_text(json.dumps({"corpus": args.corpus.name, "window": args.window, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
