"""What each way of storing int4's scales and minimums costs in bytes and in perplexity.

int4 spends 32 bytes per token per KV head (head dim 64) on key codes and 32 on value codes; what
separates a format from <= 0.28x of bfloat16's 256 bytes is the metadata around them (at most 7.7
bytes per token). This measures the candidates on the bundled model, all in one configuration
(bfloat16 model; the PyTorch attention path, KVBANK_NATIVE_KERNELS=0, because the native kernels
read only the engine's own format):

- `g32`, `g64`: the engine's format (a float16 scale and minimum per key channel per 16-token
  block; values per token in groups of 32 or 64 channels, float16 scale and minimum);
- `g64+zp`: values' minimum as an int8 multiple of their scale (a zero point) instead of float16;
- `2level-lin+zp`, `2level-log+zp`: each block's key scales and minimums as 4-bit codes against
  three float16 numbers per block and head (minimums on a linear grid; scales on a linear grid, or
  on a grid of steps of 2^(1/3) down from the largest), values as `g64+zp`;
- `block128`: the engine's format at 128-token blocks (key ranges over 128 tokens, the
  full-precision residual 128 tokens): what a key-scale group of 8 blocks of 16 would compute.

The variants are simulated exactly: their scales and minimums are rounded to the candidate's grid
and the codes computed against the rounded values, then stored in the engine's float16 fields (the
rounded values are float16 numbers up to float16's own rounding). Bytes are what the candidate
format would store. Perplexity is over --ppl-tokens tokens of --corpus in --window-token windows
scored with prompt_logprobs, as in bench/kv_quant.py.

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
from kvbank.cache.quant import KiviKeys, KiviValues, pack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
F16 = torch.float16


def _f16_down(x: torch.Tensor) -> torch.Tensor:
    """x as float16, rounded toward -inf (so a range that starts there still covers x)."""
    y = x.to(F16)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -torch.inf)), y).float()


def _f16_up(x: torch.Tensor) -> torch.Tensor:
    y = x.to(F16)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, torch.inf)), y).float()


class TwoLevelKeys(KiviKeys):
    """Per-channel key ranges of a block stored as 4-bit codes against per-(block, head) numbers."""

    def __init__(self, bits: int, log_scales: bool) -> None:
        super().__init__(bits)
        self.log_scales = log_scales

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        top = (1 << self.bits) - 1
        x = x.float()  # [n, block, heads, dim]
        lo, hi = x.amin(dim=1), x.amax(dim=1)  # [n, heads, dim]
        # minimums: m0 + q * dm, q in 0..15, rounded down so the range still starts below lo
        m0 = _f16_down(lo.amin(dim=-1, keepdim=True))
        dm = _f16_up(((lo.amax(dim=-1, keepdim=True) - m0) / 15).clamp(min=2.0**-14))
        low = (m0 + ((lo - m0) / dm).floor().clamp(0, 15) * dm).to(F16).float()
        need = ((hi - low) / top).clamp(min=2.0**-14)
        top_scale = _f16_up(need.amax(dim=-1, keepdim=True))
        if self.log_scales:
            # s = top * 2^(-q/3), q in 0..15: the first grid point at or above what the channel needs
            q = (3 * torch.log2(top_scale / need)).floor().clamp(0, 15)
            scale = top_scale * torch.exp2(-q / 3)
        else:
            # s = top * q / 16, q in 1..16
            q = (need / top_scale * 16).ceil().clamp(1, 16)
            scale = top_scale * q / 16
        scale = scale.to(F16)
        codes = ((x - low.unsqueeze(1)) / scale.float().unsqueeze(1)).round().clamp(0, top).to(torch.uint8)
        return {"codes": pack(codes, self.bits), "scale": scale, "min": low.to(F16)}


class ZeroPointValues(KiviValues):
    """Per-token value groups whose minimum is an int8 multiple of the float16 scale."""

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        top = (1 << self.bits) - 1
        grouped = x.float().reshape(*x.shape[:-1], -1, self.group_size)
        lo, hi = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / top).clamp(min=2.0**-14).to(F16).float()
        zero = (lo / scale).round().clamp(-128, 127)
        codes = (grouped / scale - zero).round().clamp(0, top).to(torch.uint8)
        return {
            "codes": pack(codes.flatten(-2), self.bits),
            "scale": scale.squeeze(-1).to(F16),
            "min": (zero * scale).squeeze(-1).to(F16),
        }


def per_token_bytes(dim: int, block: int, group: int, keys: str, zero_point: bool) -> float:
    """Bytes per token per KV head of a candidate int4 format."""
    codes = 2 * dim / 2
    key_meta = dim * 4 / block if keys == "f16" else (dim * 1 + 3 * 2) / block
    value_meta = dim / group * (3 if zero_point else 4)
    return codes + key_meta + value_meta


#: name -> (codec pair factory, block size, bytes per token per KV head at head dim 64)
VARIANTS = {
    "g32": (lambda: (KiviKeys(4), KiviValues(4, 32)), 16, per_token_bytes(64, 16, 32, "f16", False)),
    "g64": (lambda: (KiviKeys(4), KiviValues(4, 64)), 16, per_token_bytes(64, 16, 64, "f16", False)),
    "g64+zp": (lambda: (KiviKeys(4), ZeroPointValues(4, 64)), 16, per_token_bytes(64, 16, 64, "f16", True)),
    "2level-lin+zp": (
        lambda: (TwoLevelKeys(4, False), ZeroPointValues(4, 64)),
        16,
        per_token_bytes(64, 16, 64, "2level", True),
    ),
    "2level-log+zp": (
        lambda: (TwoLevelKeys(4, True), ZeroPointValues(4, 64)),
        16,
        per_token_bytes(64, 16, 64, "2level", True),
    ),
    "block128": (lambda: (KiviKeys(4), KiviValues(4, 64)), 128, per_token_bytes(64, 128, 64, "f16", False)),
}


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
        factory, block, per_token = VARIANTS.get(name, (None, 16, 256.0))
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
