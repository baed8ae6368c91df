"""Requests that arrive together on a cold cache and share a long document: time to the first token
with the scheduler's wait for a shared running prefill, and without it.

--requests requests (default 8) of --doc-tokens tokens of real text (default 2,000, the same for
all) plus a short question each reach an empty prefix cache in the same step, greedy, --max-tokens
tokens each. With the wait, the first computes the document and the others wait for its blocks to
be cached, then compute only their question; without it (the scheduler as it was before: made so
by having KVCacheManager.computing report no blocks), each one admitted while the first still
prefills computes what is not cached yet beside it. Reported per run: the median and the largest
time to first token over the requests, the time until all finish, and the prompt tokens served
from the cache. Runs alternate between the two; medians of --repeats runs each.

    python bench/shared_arrivals.py [--requests 8] [--doc-tokens 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.cache.manager import KVCacheManager  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "austen_all.txt"


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    engine = llm.engine
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter() - started
        for request in requests:
            if request.request_id not in first and request.seqs[0].num_output_tokens:
                first[request.request_id] = now
    ttft = list(first.values())
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "all_done_s": time.perf_counter() - started,
        "cached_tokens": sum(r.num_cached_tokens for r in requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--corpus", default=str(DATA if DATA.exists() else ROOT / "tests" / "data" / "austen_excerpt.txt")
    )
    args = parser.parse_args()
    llm = LLM()
    tokenizer = llm.get_tokenizer()
    text = tokenizer.encode(Path(args.corpus).read_text(errors="replace"), add_special_tokens=False)
    if len(text) < args.doc_tokens:
        raise SystemExit(f"--corpus has {len(text)} tokens, fewer than --doc-tokens={args.doc_tokens}")
    doc = text[: args.doc_tokens]
    prompts = [
        doc + tokenizer.encode(f"\nQuestion {i}: who speaks first here?", add_special_tokens=False)
        for i in range(args.requests)
    ]
    computing = KVCacheManager.computing
    runs: dict[str, list[dict[str, float]]] = {"wait": [], "no wait": []}
    for _ in range(args.repeats):
        for name in ("no wait", "wait"):
            KVCacheManager.computing = computing if name == "wait" else (lambda self, seq: [])
            try:
                runs[name].append(run(llm, prompts, args.max_tokens))
            finally:
                KVCacheManager.computing = computing
            r = runs[name][-1]
            print(
                f"{name:8s} TTFT median {r['ttft_median_s']:.2f} s, max {r['ttft_max_s']:.2f} s; "
                f"all done {r['all_done_s']:.2f} s; {r['cached_tokens']} prompt tokens from the cache",
                flush=True,
            )
    for name, measured in runs.items():
        keys = measured[0].keys()
        medians = {k: statistics.median(r[k] for r in measured) for k in keys}
        print(f"median {name:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
