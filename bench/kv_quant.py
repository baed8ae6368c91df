"""What each KV cache dtype costs and buys: memory, accuracy, capacity and decode speed.

For every --kv-cache-dtype (bundled model unless --model):
- bytes/token of the pool (scales and zero points included) and the ratio to bfloat16;
- perplexity over >= --ppl-tokens tokens of --corpus, in --window-token windows scored with
  prompt_logprobs, and its change against full precision (auto);
- greedy agreement over 128 tokens: teacher-forced top-1 agreement with full precision's greedy
  continuation of --prompts prompts, and how many tokens free-running greedy output stays identical;
- how many 2,048-token sequences fit at once in a 256 MiB pool (the engine's own block count with
  max_num_seqs set to that number);
- decode tok/s with --seqs sequences (16) of --context (2,048) distinct tokens each, and its ratio
  to full precision's (above 1: faster): all engines stay loaded and are timed in alternation,
  --rounds rounds of --steps steps, median step time.

    python bench/kv_quant.py --corpus ../shared/data/austen_all.txt
    python bench/kv_quant.py --only int4 --profile int4     # where quantized decode spends its time
    python bench/kv_quant.py --skip ppl agreement capacity --seqs 4 --context 8064 --tag _4x8k

Results also go to bench/results/kv_quant.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.cache.format import KVFormat  # noqa: E402
from kvbank.cache.quant import DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES  # noqa: E402
from kvbank.cache.storage import plan_pool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "austen_all.txt"
CONTEXT = 2048
POOL_BYTES = 256 * 2**20


def perplexity(llm: LLM, tokens: list[int], window: int) -> tuple[float, int]:
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - window + 1, window)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    total, count = 0.0, 0
    for out, ids in zip(outs, windows):
        for scored, token in zip(out.prompt_logprobs[1:], ids[1:]):
            total += scored[token].logprob
            count += 1
    return math.exp(-total / count), count


def agreement(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    identical = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), len(r)) for r, f in zip(reference, free)]
    forced = llm.generate([p + r for p, r in zip(prompts, reference)], SamplingParams(max_tokens=1, prompt_logprobs=0))
    top1 = total = 0
    for out, prompt, ref in zip(forced, prompts, reference):
        for scored, token in zip(out.prompt_logprobs[len(prompt) :], ref):
            top1 += scored[token].rank == 1
            total += 1
    return top1 / total, statistics.mean(identical)


def capacity(llm_args: dict, kv: str, model_config, dtype, block_size: int, group: int) -> tuple[int, int]:
    """Sequences of CONTEXT tokens that fit in POOL_BYTES: planned, and the engine's block count."""
    planned = plan_pool(model_config, dtype, POOL_BYTES, block_size, KVFormat(kv, group_size=group)).sequences_that_fit(
        CONTEXT
    )
    engine = LLM(
        **llm_args, kv_cache_dtype=kv, kv_cache_memory_gb=POOL_BYTES / 2**30, max_num_seqs=max(planned, 1)
    ).engine
    return planned, min(planned, engine.num_blocks // -(-CONTEXT // block_size))


class DecodeRun:
    """Sequences with distinct contexts, prefilled once and decoded on demand."""

    def __init__(self, llm_args: dict, kv: str, corpus: list[int], seqs: int, budget_steps: int, context: int) -> None:
        if len(corpus) < seqs * context:
            raise ValueError(f"the corpus leaves {len(corpus)} tokens for decoding, {seqs} x {context} are needed")
        blocks = seqs * -(-(context + budget_steps + seqs + 16) // llm_args["block_size"])
        self.llm = LLM(**llm_args, kv_cache_dtype=kv, num_gpu_blocks=blocks, max_num_seqs=seqs)
        engine = self.llm.engine
        # Sequences prefilled first decode while the others prefill: leave room for that too.
        params = SamplingParams(max_tokens=budget_steps + seqs + 8, temperature=0, ignore_eos=True)
        for i in range(seqs):
            engine.add_request(corpus[i * context : (i + 1) * context], params)
        while any(not r.seqs[0].output_token_ids for r in engine.requests.values()):
            engine.step()
        self.seqs = seqs
        self.step_times: list[float] = []

    def run(self, steps: int) -> None:
        engine = self.llm.engine
        for _ in range(steps):
            start = time.perf_counter()
            outs = engine.step()
            self.step_times.append(time.perf_counter() - start)
            assert len(outs) == self.seqs, "every sequence must decode in every timed step"

    @property
    def tokens_per_s(self) -> float:
        return self.seqs / statistics.median(self.step_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file or HF folder (default: bundled SmolLM2-135M)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-quant-group-size", type=int, default=DEFAULT_GROUP_SIZE)
    parser.add_argument(
        "--only",
        nargs="*",
        default=[d for d in KV_CACHE_DTYPES if d != "auto"],
        help="kv cache dtypes to measure besides auto",
    )
    parser.add_argument("--ppl-tokens", type=int, default=51200)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens of each decoding sequence")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip", nargs="*", default=[], choices=["ppl", "agreement", "capacity", "speed"])
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--profile", help="profile decode steps of this kv cache dtype and print the top ops")
    args = parser.parse_args()
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus} does not exist")
    llm_args = {
        "model": args.model,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "kv_quant_group_size": args.kv_quant_group_size,
    }
    bs, group = args.block_size, args.kv_quant_group_size
    dtypes = ["auto"] + [d for d in args.only if d != "auto"]
    base = LLM(**llm_args, num_gpu_blocks=64)
    tokens = base.get_tokenizer().encode(args.corpus.read_text(errors="replace"))
    model_config, model_dtype = base.engine.model_config, base.engine.dtype
    ppl_tokens = tokens[: args.ppl_tokens + args.ppl_tokens // (args.window - 1) + args.window]
    rest = tokens[len(ppl_tokens) :]
    prompts = [rest[i * 256 : i * 256 + 256] for i in range(args.prompts)]
    decode_corpus = rest[args.prompts * 256 :]
    del base
    rows: dict[str, dict] = {}
    full_bytes = plan_pool(model_config, model_dtype, POOL_BYTES, bs).bytes_per_token
    reference: list[list[int]] = []
    for kv in dtypes:
        row = rows[kv] = {
            "bytes_per_token": plan_pool(
                model_config, model_dtype, POOL_BYTES, bs, KVFormat(kv, group_size=group)
            ).bytes_per_token
        }
        row["ratio"] = row["bytes_per_token"] / full_bytes
        llm = LLM(**llm_args, kv_cache_dtype=kv, kv_cache_memory_gb=1.0, enable_prefix_caching=False)
        if "ppl" not in args.skip:
            start = time.perf_counter()
            row["perplexity"], row["ppl_tokens"] = perplexity(llm, ppl_tokens, args.window)
            row["ppl_seconds"] = time.perf_counter() - start
        if "agreement" not in args.skip:
            if kv == "auto":
                greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
                reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            row["top1_agreement"], row["identical_tokens"] = agreement(llm, prompts, reference)
        if "capacity" not in args.skip:
            row["planned_seqs"], row["engine_seqs"] = capacity(llm_args, kv, model_config, model_dtype, bs, group)
        del llm
        print(kv, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if "speed" not in args.skip:
        runs = {
            kv: DecodeRun(llm_args, kv, decode_corpus, args.seqs, args.steps * (args.rounds + 1), args.context)
            for kv in dtypes
        }
        for run in runs.values():
            run.run(2)  # warm-up
            run.step_times.clear()
        for _ in range(args.rounds):
            for run in runs.values():
                run.run(args.steps)
        for kv, run in runs.items():
            rows[kv]["decode_tok_s"] = run.tokens_per_s
            rows[kv]["decode_vs_auto"] = run.tokens_per_s / runs["auto"].tokens_per_s
        if args.profile in runs:
            from torch.profiler import profile

            with profile() as prof:
                runs[args.profile].run(args.steps)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    auto = rows["auto"]
    print(
        f"\nmodel dtype {args.dtype}, blocks of {bs} tokens, int4/int2 value groups of {group}; "
        f"perplexity on {auto.get('ppl_tokens', 0)} tokens of {args.corpus.name}; "
        f"decode: {args.seqs} sequences x {args.context} tokens"
    )
    print(
        f"{'kv_cache_dtype':<14}{'bytes/tok':>10}{'vs bf16':>8}{'ppl':>9}{'delta':>8}{'top-1':>7}{'same':>6}"
        f"{'2k seqs/256MiB':>15}{'decode tok/s':>13}{'vs bf16':>8}"
    )
    for kv, row in rows.items():
        delta = row["perplexity"] / auto["perplexity"] - 1 if "perplexity" in row else float("nan")
        print(
            f"{kv:<14}{row['bytes_per_token']:>10.0f}{row['ratio']:>7.3f}x{row.get('perplexity', float('nan')):>9.3f}"
            f"{delta:>+8.2%}{row.get('top1_agreement', float('nan')):>7.1%}{row.get('identical_tokens', 0):>6.0f}"
            f"{row.get('engine_seqs', 0):>15}{row.get('decode_tok_s', float('nan')):>13.1f}"
            f"{row.get('decode_vs_auto', float('nan')):>7.2f}x"
        )
    out = ROOT / "bench" / "results" / f"kv_quant{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
