"""Long context on a fixed KV budget: what each kv_policy costs in accuracy and buys in memory.

Three parts, each in the default configuration (bfloat16, packed GGUF weights, batch-invariant):
- ppl: perplexity in --bucket-token buckets along >= --tokens tokens of --corpus, scored as one
  request with prompt_logprobs, for `full` (up to the trained context), sink_window with 4 sinks,
  a plain window without sinks, and context_shift. Prefill chunks are --chunk tokens, so a token
  sees between `window` and `window + chunk` recent tokens (StreamingLLM scores token by token).
- compress: H2O and SnapKV at 20%, 25% and 50% of --prompt-tokens-token prompts (--prompts of
  them, from different places in the corpus): perplexity of the text's next --continuation tokens,
  teacher-forced through the real decode path on the compressed cache, and top-1 agreement with
  `full` at each of those steps.
- decode: single-stream decode tok/s and the KV memory the sequence holds against history length
  (--histories), for `full` (within the trained context) and sink_window; median of --rounds
  rounds of --steps decode steps after the history is prefilled (the KV dtypes' engines taking
  the rounds in turn), and the median of that over --sweeps passes; each quantized pool also
  against the model-dtype pool round by round (its round over the adjacent bfloat16 round, median
  over every round of every sweep: the comparison the machine's drift does not move).
- rope: what keeping RoPE right after evictions costs per decoded token, three ways: rotating
  every cached key at attention time, re-rotating the window at every eviction, and kvbank's
  re-rotation of the sink block alone; against a decode step.

--kv-cache-dtype auto,int8,int4 repeats ppl (the shifting policies) and decode on each quantized KV
pool in the same run, each row against the same policy on the model-dtype pool (`auto`).

    python bench/long_context.py --corpus ../shared/data/austen_all.txt
    python bench/long_context.py --only decode --histories 1024,32768
    python bench/long_context.py --only ppl --only decode --kv-cache-dtype auto,int8,int4 --histories 1024,32768

Results go to bench/results/long_context.json, plots to bench/results/long_context_*.png.
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

import torch  # noqa: E402

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.engine.sampler import Sampled  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "austen_all.txt"
RESULTS = ROOT / "bench" / "results"

PPL_POLICIES = {
    "full": "full",
    "sink_window (4 sinks + 1020)": "sink_window(sinks=4,window=1020)",
    "window only (0 sinks + 1024)": "sink_window(sinks=0,window=1024)",
    "context_shift (keep 4)": "context_shift(keep=4)",
}
DECODE_POLICIES = {"full": "full", "sink_window (4 + 1020)": "sink_window(sinks=4,window=1020)"}


def corpus_tokens(llm: LLM, path: Path, count: int, skip: int = 0) -> list[int]:
    text = path.read_text(encoding="utf-8", errors="replace")
    ids: list[int] = []
    chunk = 200_000
    for start in range(0, len(text), chunk):
        ids += llm.get_tokenizer().encode(text[start : start + chunk])
        if len(ids) >= skip + count:
            break
    if len(ids) < skip + count:
        raise SystemExit(f"{path} has only {len(ids)} tokens; {skip + count} needed")
    return ids[skip : skip + count]


# --- perplexity along the text -------------------------------------------------------------------


def scored_logprobs(llm: LLM, tokens: list[int], policy: str) -> list[float]:
    out = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0, kv_policy=policy))[0]
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:])]


def bucket_ppl(logprobs: list[float], bucket: int) -> list[float]:
    # Position p + 1 is predicted by the first p + 1 tokens; bucket i holds positions [i*b, (i+1)*b).
    return [
        math.exp(-statistics.fmean(logprobs[i : i + bucket]))
        for i in range(0, len(logprobs) - bucket // 2, bucket)
        if logprobs[i : i + bucket]
    ]


def dtype_label(label: str, kv: str) -> str:
    return label if kv == "auto" else f"{label} [{kv}]"


def run_ppl(args, corpus: Path) -> dict:
    results = {}
    for kv in args.kv_cache_dtype:
        llm = LLM(max_num_batched_tokens=args.chunk, enable_prefix_caching=False, kv_cache_dtype=kv)
        context = llm.engine.max_model_len
        tokens = corpus_tokens(llm, corpus, args.tokens)
        # On a quantized pool, the policies that keep the model's positions: `full` is kv_quant's table.
        policies = PPL_POLICIES if kv == "auto" else {k: v for k, v in PPL_POLICIES.items() if v != "full"}
        results.update(ppl_rows(llm, tokens, context, policies, kv, args.bucket))
        del llm
    if "full" in results:
        full = results["full"]["bucket_ppl"]
        for row in results.values():
            shared = min(len(full), len(row["bucket_ppl"]))
            row["vs_full_within_context"] = [row["bucket_ppl"][i] / full[i] for i in range(shared)]
    for label, row in results.items():
        base = results.get(row["base"]) if row["kv_cache_dtype"] != "auto" else None
        if base is not None:
            row["ppl_change_vs_auto"] = row["ppl"] / base["ppl"] - 1
            print(f"  {label:40s} ppl {row['ppl_change_vs_auto']:+.3%} against {row['base']}")
    return {"bucket_tokens": args.bucket, "chunk_tokens": args.chunk, "context": context, "policies": results}


def ppl_rows(llm: LLM, tokens: list[int], context: int, policies: dict, kv: str, bucket: int) -> dict:
    results = {}
    for base_label, policy in policies.items():
        label = dtype_label(base_label, kv)
        scored = tokens[: context - 1] if policy == "full" else tokens
        started = time.perf_counter()
        logprobs = scored_logprobs(llm, scored, policy)
        seconds = time.perf_counter() - started
        buckets = bucket_ppl(logprobs, bucket)
        results[label] = {
            "policy": policy,
            "kv_cache_dtype": kv,
            "base": base_label,
            "tokens": len(scored),
            "bucket_ppl": buckets,
            "ppl": math.exp(-statistics.fmean(logprobs)),
            "ppl_within_context": math.exp(-statistics.fmean(logprobs[: context - 1])),
            "tokens_per_s": len(scored) / seconds,
        }
        print(
            f"  {label:40s} {len(scored):6d} tokens  ppl {results[label]['ppl']:8.4f}  "
            f"first 8k {results[label]['ppl_within_context']:8.3f}  last bucket {buckets[-1]:8.3f}  "
            f"({len(scored) / seconds:.0f} tok/s)",
            flush=True,
        )
    return results


# --- compressed prompts: teacher-forced perplexity and agreement ---------------------------------


class ForcedSampler:
    """Picks the text's next token (teacher forcing) and records its logprob and the argmax."""

    def __init__(self, forced: dict[str, list[int]]) -> None:
        self.forced = forced
        self.logprobs: dict[str, list[float]] = {key: [] for key in forced}
        self.argmax: dict[str, list[int]] = {key: [] for key in forced}

    def __call__(self, logits: torch.Tensor, seqs) -> list[Sampled]:
        out = []
        for row, seq in zip(logits.float().log_softmax(dim=-1), seqs):
            key = seq.request.request_id
            token = self.forced[key][len(self.logprobs[key])]
            self.logprobs[key].append(float(row[token]))
            self.argmax[key].append(int(row.argmax()))
            out.append(Sampled(token, float(row[token]), None))
        return out


def forced_run(llm: LLM, prompts: list[list[int]], continuations: list[list[int]], policy: str):
    engine = llm.engine
    sampler, original = ForcedSampler({str(i): c for i, c in enumerate(continuations)}), engine.decoder.sampler
    engine.decoder.sampler = sampler
    try:
        params = SamplingParams(max_tokens=len(continuations[0]), ignore_eos=True, kv_policy=policy)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        peak = 0  # blocks one sequence holds once its prompt is done (compressed)
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                if seq.num_computed_tokens > seq.num_prompt_tokens:
                    peak = max(peak, len(seq.block_table))
    finally:
        engine.decoder.sampler = original
    return sampler, peak


def run_compress(args, corpus: Path) -> dict:
    llm = LLM(enable_prefix_caching=False)
    n, cont = args.prompt_tokens, args.continuation
    stride = n + cont + 5000
    texts = [corpus_tokens(llm, corpus, n + cont, skip=i * stride) for i in range(args.prompts)]
    prompts, continuations = [t[:n] for t in texts], [t[n:] for t in texts]
    configs = {"full": "full"}
    for fraction in (0.2, 0.25, 0.5):
        budget = int(n * fraction)
        configs[f"h2o {fraction:.0%}"] = f"h2o(heavy={budget // 2},recent={budget - budget // 2})"
        configs[f"snapkv {fraction:.0%}"] = f"snapkv(budget={budget},window=64,kernel=5)"
    results, reference = {}, None
    for label, policy in configs.items():
        started = time.perf_counter()
        sampler, peak = forced_run(llm, prompts, continuations, policy)
        seconds = time.perf_counter() - started
        logprobs = [lp for key in sorted(sampler.logprobs) for lp in sampler.logprobs[key]]
        argmax = [a for key in sorted(sampler.argmax) for a in sampler.argmax[key]]
        if reference is None:
            reference = argmax
        ppl = math.exp(-statistics.fmean(logprobs))
        agree = sum(a == b for a, b in zip(argmax, reference)) / len(reference)
        results[label] = {
            "policy": policy,
            "ppl": ppl,
            "top1_agreement_with_full": agree,
            "blocks_per_seq": peak,
            "seconds": seconds,
        }
    base = results["full"]["ppl"]
    for label, row in results.items():
        row["ppl_change"] = row["ppl"] / base - 1
        print(
            f"  {label:12s} {row['policy']:42s} ppl {row['ppl']:7.3f} ({row['ppl_change']:+6.1%})  "
            f"top-1 agreement {row['top1_agreement_with_full']:6.1%}  blocks/seq {row['blocks_per_seq']:4d}  "
            f"({row['seconds']:.0f} s)",
            flush=True,
        )
    return {"prompt_tokens": n, "continuation_tokens": cont, "prompts": args.prompts, "configs": results}


# --- decode speed and memory against history ------------------------------------------------------


def start_decode(llm: LLM, history: list[int], policy: str, total: int):
    """A greedy request of `total` tokens after `history`, its prompt prefilled."""
    engine = llm.engine
    request = engine.add_request(
        history, SamplingParams(max_tokens=total, ignore_eos=True, temperature=0, kv_policy=policy)
    )
    seq = request.seqs[0]
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        engine.step()
    return request


def decode_rates(
    llms: dict[str, LLM], history: list[int], policy: str, rounds: int, steps: int
) -> dict[str, tuple[float, int, list[float]]]:
    """Per engine: decode tok/s (median over rounds of `steps` steps), the blocks the sequence
    holds, and each round's tok/s. Every engine's request is prefilled first, then the rounds
    alternate between engines, so that the machine's drift falls on all of them alike (and round i
    of two engines can be compared as a pair)."""
    total = rounds * steps + 8  # still running when the rounds end
    requests = {kv: start_decode(llm, history, policy, total) for kv, llm in llms.items()}
    times: dict[str, list[float]] = {kv: [] for kv in llms}
    for _ in range(rounds):
        for kv, llm in llms.items():
            started = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            times[kv].append((time.perf_counter() - started) / steps)
    rates = {}
    for kv, llm in llms.items():
        seq = requests[kv].seqs[0]
        blocks = len(seq.block_table) + len(seq.pristine_blocks)
        rates[kv] = (1.0 / statistics.median(times[kv]), blocks, [1.0 / t for t in times[kv]])
        llm.engine.abort_request(requests[kv].request_id)
    return rates


def run_decode(args, corpus: Path) -> dict:
    # One engine per KV dtype, all loaded up front so that the sweeps alternate between them.
    llms = {kv: LLM(enable_prefix_caching=False, kv_cache_dtype=kv) for kv in args.kv_cache_dtype}
    first = next(iter(llms.values()))
    context = first.engine.max_model_len
    histories = [int(h) for h in args.histories.split(",")]
    longest = corpus_tokens(first, corpus, max(histories))
    runs: dict[tuple[str, int], list[tuple[float, int]]] = {}
    # sink_window rounds, per KV dtype and history: tok/s over the model-dtype pool's adjacent round
    paired: dict[tuple[str, int], list[list[float]]] = {}
    block_bytes: dict[str, int] = {}
    # Sweeps alternately ascending and descending, so that drift over the run does not read as a trend.
    for sweep in [histories if i % 2 == 0 else histories[::-1] for i in range(args.sweeps)]:
        for history in sweep:
            for base_label, policy in DECODE_POLICIES.items():
                engines = {kv: llm for kv, llm in llms.items() if policy != "full" or kv == "auto"}
                if policy == "full" and history > context:
                    continue
                length = min(history, context - args.rounds * args.steps - 8) if policy == "full" else history
                rates = decode_rates(engines, longest[:length], policy, args.rounds, args.steps)
                if policy != "full" and "auto" in rates:
                    for kv in rates:
                        pairs = [r / a for r, a in zip(rates[kv][2], rates["auto"][2])]
                        paired.setdefault((kv, history), []).append(pairs)
                for kv, (rate, blocks, _) in rates.items():
                    label = dtype_label(base_label, kv)
                    block_bytes[label] = llms[kv].engine.kv_bytes_per_token * llms[kv].engine.block_size
                    runs.setdefault((label, history), []).append((rate, blocks))
                    print(f"  {label:34s} history {history:6d}  {rate:6.1f} tok/s", flush=True)
    results: dict[str, list[dict]] = {label: [] for label, _ in runs}
    for (label, history), measured in sorted(runs.items(), key=lambda item: item[0][1]):
        rate = statistics.median(r for r, _ in measured)
        mib = max(b for _, b in measured) * block_bytes[label] / 2**20
        results[label].append(
            {"history": history, "tok_s": rate, "tok_s_runs": [r for r, _ in measured], "kv_mib": mib}
        )
        print(f"  median: {label:34s} history {history:6d}  {rate:6.1f} tok/s  KV {mib:7.1f} MiB", flush=True)
    ratios: dict[str, dict[str, float]] = {}
    auto_sink = results.get("sink_window (4 + 1020)")
    for kv in llms:
        sink = results.get(dtype_label("sink_window (4 + 1020)", kv), [])
        if len(sink) < 2:
            continue
        ratios[kv] = {"last_over_first": sink[-1]["tok_s"] / sink[0]["tok_s"]}
        line = f"  sink_window [{kv}] tok/s at {sink[-1]['history']} / at {sink[0]['history']}: "
        line += f"{ratios[kv]['last_over_first']:.2f}x"
        if auto_sink and kv != "auto":
            ratios[kv]["last_over_auto"] = sink[-1]["tok_s"] / auto_sink[-1]["tok_s"]
            line += f"; medians' ratio to the model-dtype pool at {sink[-1]['history']}: "
            line += f"{ratios[kv]['last_over_auto']:.2f}x"
        print(line)
        for (pkv, history), sweeps in sorted(paired.items(), key=lambda item: item[0][1]):
            if pkv != kv or kv == "auto":
                continue
            # the drift-free comparison: each round against the model-dtype pool's round beside it
            every = [r for sweep in sweeps for r in sweep]
            ratios[kv][f"paired_over_auto_{history}"] = statistics.median(every)
            ratios[kv][f"paired_over_auto_{history}_sweeps"] = [statistics.median(sweep) for sweep in sweeps]
            per_sweep = ", ".join(f"{statistics.median(sweep):.3f}" for sweep in sweeps)
            print(
                f"  sink_window [{kv}] against the model-dtype pool at {history}, round by round: "
                f"median {statistics.median(every):.3f}x of {len(every)} rounds (per sweep {per_sweep})"
            )
    ratio = ratios.get("auto", {}).get("last_over_first")
    return {
        "rounds": args.rounds,
        "sweeps": args.sweeps,
        "steps": args.steps,
        "policies": results,
        "sink_ratio_last_first": ratio,
        "sink_ratios": ratios,
    }


# --- where RoPE goes: rotate at attention time, re-rotate the window, or re-rotate the sinks -------


def run_rope(args, corpus: Path) -> dict:
    llm = LLM(enable_prefix_caching=False)
    engine = llm.engine
    bs, window = engine.block_size, 1024
    window_blocks, sink_blocks = list(range(1, 1 + window // bs)), [0]
    rotation = engine.editor._rotation(bs)

    def seconds(blocks: list[int]) -> float:
        times = []
        for _ in range(20):
            started = time.perf_counter()
            engine.storage.rotate_keys(blocks, blocks, rotation)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    whole_window = seconds(window_blocks)  # every layer's window keys, once
    sinks = seconds(sink_blocks)
    history = corpus_tokens(llm, corpus, 2048)
    rate = decode_rates({"auto": llm}, history, "sink_window(sinks=4,window=1020)", 3, 32)["auto"][0]
    step = 1.0 / rate
    per_token = {
        # Pre-rotation keys: every decode step rotates the whole window in every layer.
        "rotate_at_attention_ms": whole_window * 1e3,
        # Re-rotating the window on every eviction (llama.cpp's K-shift), once per block of tokens.
        "rerotate_window_ms": whole_window / bs * 1e3,
        # kvbank: re-rotate the sink block (from its pristine copy) once per block of tokens.
        "rerotate_sinks_ms": sinks / bs * 1e3,
    }
    result = {"window": window, "decode_step_ms": step * 1e3, "per_token": per_token}
    for name, ms in per_token.items():
        print(f"  {name:24s} {ms:7.3f} ms per token ({ms / (step * 1e3):6.1%} of a {step * 1e3:.1f} ms decode step)")
    return result


# --- plots -----------------------------------------------------------------------------------------


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "ppl" in results:
        data = results["ppl"]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, row in data["policies"].items():
            xs = [(i + 0.5) * data["bucket_tokens"] / 1000 for i in range(len(row["bucket_ppl"]))]
            # `full` is drawn on top: context_shift is identical to it until the first shift.
            style = dict(color="black", linestyle="--", linewidth=2, zorder=5) if row["policy"] == "full" else {}
            ax.plot(xs, row["bucket_ppl"], marker="o", markersize=3, label=label, **style)
        ax.axvline(data["context"] / 1000, color="grey", linestyle=":", label="trained context")
        ax.set_yscale("log")
        ax.set_xlabel("position in the text (thousand tokens)")
        ax.set_ylabel(f"perplexity per {data['bucket_tokens']}-token bucket")
        ax.set_title("SmolLM2-135M on Austen: perplexity along the text by kv_policy")
        ax.legend()
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "long_context_ppl.png"))
    if "decode" in results:
        data = results["decode"]
        fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
        for label, rows in data["policies"].items():
            xs = [r["history"] / 1000 for r in rows]
            speed.plot(xs, [r["tok_s"] for r in rows], marker="o", label=label)
            memory.plot(xs, [r["kv_mib"] for r in rows], marker="o", label=label)
        for ax, name in ((speed, "decode tok/s (one stream)"), (memory, "KV memory held (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("history (thousand tokens)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend()
        speed.set_ylim(bottom=0)
        fig.suptitle("Decode against history length")
        written.append(_save(fig, out / "long_context_decode.png"))
    if "compress" in results:
        data = results["compress"]["configs"]
        labels = [label for label in data if label != "full"]
        fig, (ppl, agree) = plt.subplots(1, 2, figsize=(10, 4))
        ppl.bar(labels, [data[label]["ppl_change"] * 100 for label in labels])
        ppl.set_ylabel("perplexity change vs full (%)")
        agree.bar(labels, [data[label]["top1_agreement_with_full"] * 100 for label in labels])
        agree.set_ylabel("top-1 agreement with full (%)")
        for ax in (ppl, agree):
            ax.tick_params(axis="x", rotation=45)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle(f"H2O and SnapKV on {results['compress']['prompt_tokens']}-token prompts")
        written.append(_save(fig, out / "long_context_compress.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--only", choices=("ppl", "compress", "decode", "rope"), action="append")
    parser.add_argument("--tokens", type=int, default=24 * 1024, help="tokens scored for the perplexity curve")
    parser.add_argument("--bucket", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens) for ppl")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--histories", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sweeps",
        type=int,
        default=2,
        help="decode: passes over the histories (alternately up and down); medians over them",
    )
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated KV pool dtypes for ppl and decode (e.g. auto,int8,int4); auto comes first",
    )
    args = parser.parse_args()
    kvs = [kv.strip() for kv in args.kv_cache_dtype.split(",") if kv.strip()]
    args.kv_cache_dtype = ["auto"] + [kv for kv in kvs if kv != "auto"]
    torch.set_num_threads(torch.get_num_threads())
    parts = args.only or ["ppl", "compress", "decode", "rope"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "long_context.json"
    results = json.loads(path.read_text()) if path.exists() and args.only else {}
    for part, run in (("ppl", run_ppl), ("compress", run_compress), ("decode", run_decode), ("rope", run_rope)):
        if part in parts:
            print(f"{part}:", flush=True)
            results[part] = run(args, args.corpus)
            path.write_text(json.dumps(results, indent=1))
    for written in plot(results, args.out):
        print(f"wrote {written}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
