"""The decode attention kernels alone: one row over a paged KV cache, per KV format and variant.

Times `quant_decode_attention` (int8, fp8, int4, int2) at every variant this CPU runs
(`quant_decode_isas()`) and `paged_decode_attention` over a bfloat16 cache, for one decoding row
of --tokens tokens with the bundled model's shape (3 KV heads, 3 query heads each, head dim 64,
16-token blocks laid out at random), on --threads threads. Every call is one layer's attention;
the median of --rounds rounds of --calls calls, the variants alternating round by round. The
pool is small enough to stay in cache, so this is the kernels' arithmetic, not memory.

    python bench/quant_attention.py
    python bench/quant_attention.py --tokens 4096 --formats int4 --threads 1

Results also go to bench/results/quant_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbank import kernels  # noqa: E402
from kvbank.attention.fast import DECODE_PARTITION  # noqa: E402
from kvbank.attention.quantized import NATIVE_FORMATS  # noqa: E402
from kvbank.cache.quant import DEFAULT_GROUP_SIZE, codecs_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def quant_call(native, kv: str, tokens: int, kv_heads: int, group: int, dim: int, block: int, isa: str):
    """A call of the quantized kernel on a random pool: keys with an outlier channel, as real ones."""
    generator = torch.Generator().manual_seed(0)
    width = -(-tokens // block)
    blocks = width + 3
    key_codec, value_codec = codecs_for(kv, torch.bfloat16, DEFAULT_GROUP_SIZE)
    keys = torch.randn(blocks, block, kv_heads, dim, generator=generator) * 2
    keys[..., 5] += 6
    k = key_codec.quantize(keys)
    v = value_codec.quantize(torch.randn(blocks, block, kv_heads, dim, generator=generator))
    tables = torch.randperm(blocks, generator=generator)[:width].view(1, width)
    q = torch.randn(1, kv_heads, group, dim, generator=generator).bfloat16()
    extra = {}
    if "grid" in k:  # int4/int2 read the row's newest block from the step's full-precision scratch
        extra = {
            "scratch_k": torch.randn(2, block, kv_heads, dim, generator=generator).bfloat16(),
            "scratch_v": torch.randn(2, block, kv_heads, dim, generator=generator).bfloat16(),
            "own_rows": torch.zeros(1, dtype=torch.int64),
        }
    args = (
        q,
        NATIVE_FORMATS[kv],
        k["codes"],
        k.get("ranges", k.get("scale")),
        k.get("grid"),
        v["codes"],
        v["scale"],
        v.get("zero"),
        tables,
        torch.tensor([tokens]),
        dim**-0.5,
        DECODE_PARTITION,
    )
    return lambda: native.quant_decode_attention(*args, **extra, isa=isa)


def dense_call(native, tokens: int, kv_heads: int, group: int, dim: int, block: int):
    generator = torch.Generator().manual_seed(0)
    width = -(-tokens // block)
    blocks = width + 3
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=generator).bfloat16()
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=generator).bfloat16()
    tables = torch.randperm(blocks, generator=generator)[:width].view(1, width)
    q = torch.randn(1, kv_heads, group, dim, generator=generator).bfloat16()
    lens = torch.tensor([tokens])
    return lambda: native.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, DECODE_PARTITION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--formats", default="int8,fp8_e4m3,int4,int2")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quant_attention.json")
    args = parser.parse_args()
    native = kernels.native()
    if native is None or not native.has_quant_decode():
        sys.exit(f"the native kernels are not available here: {kernels.failure()}")
    torch.set_num_threads(args.threads)
    shape = (args.tokens, args.kv_heads, args.group, args.dim, args.block_size)
    calls = {"bfloat16 dense": dense_call(native, *shape)}
    for kv in args.formats.split(","):
        for isa in native.quant_decode_isas():
            calls[f"{kv} {isa}"] = quant_call(native, kv, *shape, isa)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(20):
            call()
    for _ in range(args.rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(args.calls):
                call()
            times[name].append((time.perf_counter() - started) / args.calls * 1e6)
    results = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"one row, {args.tokens} tokens, {args.kv_heads} KV heads x {args.group} query heads, head dim {args.dim}, "
        f"{args.threads} thread(s), level {native.isa_report()['active']}: us per call (one layer)"
    )
    for name, us in results.items():
        print(f"  {name:24s} {us:8.1f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "us_per_call": results}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
