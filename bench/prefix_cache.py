"""What prompt caching buys: cached-prefix TTFT, a multi-turn chat workload, and its overhead.

1. TTFT of a 2,048-token prompt whose first 1,920 tokens are cached, against the same kind of
   prompt cold (target: >= 15x faster), beside the ratio of the arithmetic the two do (weight
   matmuls plus causal attention): a system that spends the same time per operation on both
   reaches exactly that ratio, so it is the ceiling unless the cached step is more efficient.
2. A chat workload: 16 conversations x 4 turns sharing a 600-token system prompt, 64 new tokens a
   turn, 8 conversations at a time; total time and prefix hit rate with caching on and off.
3. A workload with no sharing (distinct 512-token prompts): time with caching on vs off
   (target: < 3% overhead).
All prompts are real text from --corpus (default: the excerpt in tests/data). Medians of
--repeats runs; on and off runs are interleaved so drift hits both alike.

    python bench/prefix_cache.py [--corpus ../shared/data/austen_all.txt] [--dtype bfloat16]
    python bench/prefix_cache.py --only-ttft --kv-cache-dtype int8 --json bench/results/prefix_cache_int8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbank import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Who is the most sensible person in this story?",
    "Summarise the last scene in two sentences.",
    "What does the narrator think of money?",
    "Which character would you trust, and why?",
]


class Corpus:
    """Windows of real text, each opened by a unique marker so no two ever share a first block."""

    def __init__(self, llm: LLM, path: Path) -> None:
        self.tokenizer = llm.get_tokenizer()
        self.tokens = self.tokenizer.encode(path.read_text(errors="replace"))
        self.offset = 0
        self.serial = 0

    def take(self, n: int) -> list[int]:
        self.serial += 1
        marker = self.tokenizer.encode(f"#{self.serial}: ")
        n -= len(marker)
        if self.offset + n > len(self.tokens):
            self.offset = 0
        window = self.tokens[self.offset : self.offset + n]
        self.offset += n
        return marker + window


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill_flops(config, new: int, cached: int = 0) -> float:
    """Floating-point operations of a prefill of `new` tokens after `cached` ones: the decoder's
    weight matmuls for every new token, causal attention (QK and PV) over each one's keys, and the
    LM head for the last token."""
    h, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = config.hidden_size * (2 * h + 2 * kv) + 3 * config.hidden_size * config.intermediate_size
    keys = new * cached + new * (new + 1) // 2  # the new tokens attend to the cached ones and causally
    attention = 2 * config.num_heads * config.head_dim * keys
    return 2.0 * (config.num_layers * (per_token * new + attention) + config.hidden_size * config.vocab_size)


def cached_ttft(llm: LLM, corpus: Corpus, repeats: int) -> dict:
    one = SamplingParams(temperature=0, max_tokens=1)
    cold, warm = [], []
    for _ in range(repeats + 1):
        prompt = corpus.take(2048)
        out = []
        cold.append(timed(lambda out=out, prompt=prompt: out.append(llm.generate([prompt], one)[0])))
        assert out[0].num_cached_tokens == 0
        prompt = corpus.take(2048)
        llm.generate([prompt[:1920] + corpus.take(64)], one)  # caches the first 1,920 tokens
        out.clear()
        warm.append(timed(lambda out=out, prompt=prompt: out.append(llm.generate([prompt], one)[0])))
        assert out[0].num_cached_tokens == 1920, out[0].num_cached_tokens
    cold_s, warm_s = statistics.median(cold[1:]), statistics.median(warm[1:])
    config = llm.engine.model_config
    cold_flops, warm_flops = prefill_flops(config, 2048), prefill_flops(config, 128, 1920)
    return {
        "cold_ttft_s": cold_s,
        "cached_ttft_s": warm_s,
        "speedup": cold_s / warm_s,
        "cold_gflop": cold_flops / 1e9,
        "cached_gflop": warm_flops / 1e9,
        "arithmetic_ratio": cold_flops / warm_flops,
    }


def ttft_breakdown(llm: LLM, corpus: Corpus, repeats: int) -> dict:
    """Where the cached prompt's time goes: 128 tokens with no context (the weight matmuls, almost
    no attention) against the same 128 tokens after 1,920 cached ones (the difference is attention
    over the cached keys), and each part's speed in GFLOP/s (prefill_flops' terms)."""
    one = SamplingParams(temperature=0, max_tokens=1)
    alone, after = [], []
    for _ in range(repeats + 1):
        alone.append(timed(lambda: llm.generate([corpus.take(128)], one)))
        prompt = corpus.take(2048)
        llm.generate([prompt[:1920] + corpus.take(64)], one)
        after.append(timed(lambda prompt=prompt: llm.generate([prompt], one)))
    alone_s, after_s = statistics.median(alone[1:]), statistics.median(after[1:])
    config = llm.engine.model_config
    weights = prefill_flops(config, 128)
    attention = prefill_flops(config, 128, 1920) - weights
    return {
        "alone_128_s": alone_s,
        "after_1920_s": after_s,
        "weights_gflop_per_s": weights / alone_s / 1e9,
        "attention_over_cached_s": after_s - alone_s,
        "attention_gflop_per_s": attention / (after_s - alone_s) / 1e9,
    }


def chat_workload(llm: LLM, corpus: Corpus, system_tokens: list[int]) -> dict:
    tok = llm.get_tokenizer()
    system = tok.decode(system_tokens)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    before = llm.stats()
    start = time.perf_counter()
    for wave in range(2):
        conversations = [
            llm.render_chat(
                [{"role": "system", "content": system}, {"role": "user", "content": f"({wave}.{c}) {QUESTIONS[0]}"}]
            )
            for c in range(8)
        ]
        for turn in range(4):
            outputs = llm.generate(conversations, params)
            if turn == 3:
                break
            question = QUESTIONS[turn + 1]
            follow = tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
            conversations = [ids + out.outputs[0].token_ids + follow for ids, out in zip(conversations, outputs)]
    elapsed = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {
        "seconds": elapsed,
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "hit_rate": hits / queries if queries else 0.0,
    }


def no_sharing(llm: LLM, corpus: Corpus) -> float:
    prompts = [corpus.take(512) for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hits = llm.stats()["prefix_cache_hits"]
    seconds = timed(lambda: [llm.generate(prompts[i : i + 8], params) for i in (0, 8)])
    assert llm.stats()["prefix_cache_hits"] == hits, "the no-sharing workload shared a prefix"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--corpus", default=str(ROOT / "tests" / "data" / "austen_excerpt.txt"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype of both engines")
    parser.add_argument("--only-ttft", action="store_true", help="measure part 1 only")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "prefix_cache.json"))
    args = parser.parse_args()
    systems = {
        on: LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=on,
            kv_cache_memory_gb=1.0,
        )
        for on in (True, False)
    }
    corpus = Corpus(systems[True], Path(args.corpus))
    report = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "corpus": args.corpus}

    report["ttft"] = cached_ttft(systems[True], corpus, args.repeats)
    t = report["ttft"]
    print(
        f"TTFT 2048 tokens: cold {t['cold_ttft_s'] * 1000:.0f} ms, 1920 cached {t['cached_ttft_s'] * 1000:.0f} ms "
        f"-> {t['speedup']:.1f}x (target >= 15x); arithmetic {t['cold_gflop']:.0f} vs {t['cached_gflop']:.1f} GFLOP "
        f"-> {t['arithmetic_ratio']:.1f}x at equal efficiency",
        flush=True,
    )
    report["breakdown"] = b = ttft_breakdown(systems[True], corpus, args.repeats)
    print(
        f"128 tokens alone {b['alone_128_s'] * 1000:.0f} ms ({b['weights_gflop_per_s']:.0f} GFLOP/s), after 1,920 "
        f"cached {b['after_1920_s'] * 1000:.0f} ms: attention over the cached keys "
        f"{b['attention_over_cached_s'] * 1000:.0f} ms ({b['attention_gflop_per_s']:.0f} GFLOP/s)",
        flush=True,
    )
    if args.only_ttft:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        return

    system_tokens = corpus.take(600)
    chat = {on: chat_workload(systems[on], corpus, system_tokens) for on in (True, False)}
    report["chat"] = {"on": chat[True], "off": chat[False], "speedup": chat[False]["seconds"] / chat[True]["seconds"]}
    print(
        f"chat 16x4 turns: caching on {chat[True]['seconds']:.1f} s (hit rate {chat[True]['hit_rate']:.1%}), "
        f"off {chat[False]['seconds']:.1f} s -> {report['chat']['speedup']:.2f}x",
        flush=True,
    )

    runs = {True: [], False: []}
    for _ in range(args.repeats + 1):
        for on in (True, False):
            runs[on].append(no_sharing(systems[on], corpus))
    on_s, off_s = statistics.median(runs[True][1:]), statistics.median(runs[False][1:])
    report["no_sharing"] = {"on_s": on_s, "off_s": off_s, "overhead": on_s / off_s - 1, "runs": runs}
    print(f"no sharing: on {on_s:.2f} s, off {off_s:.2f} s -> overhead {on_s / off_s - 1:+.1%} (target < 3%)")

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
