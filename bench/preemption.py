"""What a preemption costs: swapping a sequence's KV to host RAM and back against recomputing it.

For each length N: swap = copying N tokens' full blocks out of the pool into host memory and back
(what `Swapper.swap_out` + `swap_in` do); recompute = prefilling N tokens again. The crossover is
the shortest N where swapping is cheaper, which `auto` preemption uses (kvbank/cache/swap.py).
Medians of --repeats runs.

    python bench/preemption.py [--dtype bfloat16] [--lengths 16,64,256,512,2048,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.cache.manager import blocks_for  # noqa: E402
from kvbank.cache.swap import Swapper  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "preemption.json"
DEFAULT_LENGTHS = (16, 64, 256, 512, 2048, 8192)
REPORTED = {512: "512", 2048: "2k", 8192: "8k"}


class _Victim:
    """The part of a sequence a Swapper reads: its block table and computed tokens."""

    def __init__(self, num_tokens: int, block_size: int) -> None:
        self.num_computed_tokens = num_tokens
        self.block_table = list(range(blocks_for(num_tokens, block_size)))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _swap_ms(llm: LLM, num_tokens: int, repeats: int) -> float:
    engine = llm.engine
    swapper = Swapper(engine.storage, engine.manager, "swap", space_bytes=2**62)

    def swap_out_and_in() -> None:
        victim = _Victim(num_tokens, engine.block_size)
        swapper.swap_out(victim)
        victim.num_computed_tokens = 0  # as after a fresh allocation: every block is written back
        swapper.swap_in(victim)

    return _median_ms(swap_out_and_in, repeats)


def _recompute_ms(llm: LLM, num_tokens: int, repeats: int) -> float:
    # Room for the one sampled token: a prompt of max_model_len - 1 stands for a full-length one.
    prompt = [(7 * i + 11) % 1000 + 100 for i in range(min(num_tokens, llm.engine.max_model_len - 1))]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return _median_ms(lambda: llm.generate([prompt], params), repeats)


def preemption_costs(
    lengths: tuple[int, ...] = DEFAULT_LENGTHS, dtype: str = "bfloat16", repeats: int = 3, **options
) -> dict:
    """ms per preemption for swap (out + in) and recompute at each length, and the crossover length.

    `options` go to `LLM` (e.g. `device="cuda"`); the pool is sized for the longest length and
    prefix caching is off so that every recompute is a full prefill.
    """
    probe = max(lengths)
    llm = LLM(dtype=dtype, num_gpu_blocks=blocks_for(probe + 1, 16), enable_prefix_caching=False, **options)
    # The first calls start torch's thread pool and fault in buffers: seconds that no steady state pays.
    _swap_ms(llm, probe, 1)
    _recompute_ms(llm, min(lengths), 1)
    rows = {}
    for n in lengths:
        rows[n] = {"swap_ms": _swap_ms(llm, n, repeats), "recompute_ms": _recompute_ms(llm, n, repeats)}
    crossover = next((n for n in lengths if rows[n]["swap_ms"] < rows[n]["recompute_ms"]), None)
    return {
        "dtype": dtype,
        "device": str(llm.engine.device),
        "threads": torch.get_num_threads(),
        "bytes_per_token": llm.engine.kv_bytes_per_token,
        "lengths": rows,
        "crossover_tokens": crossover,
    }


def _report(result: dict) -> None:
    print(f"swap vs recompute preemption cost at 512/2k/8k tokens ({result['dtype']}, {result['device']}):")
    for n, row in result["lengths"].items():
        label = REPORTED.get(n, str(n))
        ratio = row["recompute_ms"] / row["swap_ms"]
        swap, recompute = row["swap_ms"], row["recompute_ms"]
        print(f"  {label:>5} tokens: swap {swap:9.2f} ms   recompute {recompute:9.2f} ms   ({ratio:.0f}x)")
    print(f"  crossover: swap is cheaper from {result['crossover_tokens']} tokens on")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", help="repeatable; default bfloat16 and float32")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    lengths = tuple(int(n) for n in args.lengths.split(","))
    results = []
    for dtype in args.dtype or ["bfloat16", "float32"]:
        result = preemption_costs(lengths, dtype, args.repeats, device=args.device)
        _report(result)
        results.append(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
