"""Decode and prefill throughput of kvbank against Hugging Face transformers and llama.cpp.

All run the same GGUF (the bundled SmolLM2-135M-Instruct unless --model), with the same threads;
kvbank and transformers in one process and the same dtype, llama.cpp (with --llama-bench PATH)
as its own tools: `llama-bench` for batch 1 and prefill, `llama-batched-bench` (found beside it)
for B parallel sequences. Decode: B prompts of 16 tokens, each generating --new-tokens tokens
(EOS ignored), tok/s = B * new_tokens / wall time. Prefill: one prompt of L tokens, one output
token, tok/s = L / time to first token (prefix caching is off so nothing is reused).
Each number is the median of --repeats runs after a warm-up; the systems' runs alternate.

The same run measures the machine's read bandwidth (a 2-thread sum over a buffer of the size the
model's decode step reads, and over 1 GiB, beyond any cache) and reports, for batch-1 decode,
bytes read per token x tok/s against it (the roofline: a decode step reads every weight once).

    python bench/throughput.py                      # full table, JSON to bench/results/
    python bench/throughput.py --dtypes bfloat16 --batches 1 --no-hf --profile
    python bench/throughput.py --dtypes bfloat16 --no-hf --llama-bench ~/llama.cpp/build/bin/llama-bench
    python bench/throughput.py --dtypes bfloat16 --no-hf --no-batch-invariant   # the faster mixed kernels
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.models.loader import bundled_model_path  # noqa: E402

PROMPT_LEN = 16


def distinct_prompts(count: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(salt)
    return torch.randint(100, vocab - 100, (count, length), generator=generator).tolist()


class KvbankRunner:
    name = "kvbank"

    def __init__(self, model: str, dtype: str, batch_invariant: bool = True) -> None:
        self.llm = LLM(
            model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=64, batch_invariant=batch_invariant
        )
        self.vocab = self.llm.engine.model_config.vocab_size
        self.calls = 0
        #: per decode metric, tok/s counting only the generation after the first token
        self.generation_only: dict[str, list[float]] = {}

    def decode(self, batch: int, new_tokens: int) -> float:
        self.calls += 1
        prompts = distinct_prompts(batch, PROMPT_LEN, self.vocab, self.calls)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
        # As llama-bench's tg counts: the tokens after the first, over the time after the first.
        first = min(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.finished_time for o in outputs)
        self.generation_only.setdefault(f"decode_b{batch}", []).append(batch * (new_tokens - 1) / (last - first))
        return batch * new_tokens / elapsed

    def prefill(self, length: int) -> float:
        self.calls += 1
        prompt = distinct_prompts(1, length, self.vocab, self.calls)[0]
        start = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return length / (time.perf_counter() - start)


class TransformersRunner:
    name = "transformers"

    def __init__(self, model: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        folder, file = os.path.split(model)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=getattr(torch, dtype)).eval()
        self.vocab = self.model.config.vocab_size
        self.calls = 0

    @torch.inference_mode()
    def decode(self, batch: int, new_tokens: int) -> float:
        self.calls += 1
        ids = torch.tensor(distinct_prompts(batch, PROMPT_LEN, self.vocab, self.calls))
        start = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == PROMPT_LEN + new_tokens
        return batch * new_tokens / elapsed

    @torch.inference_mode()
    def prefill(self, length: int) -> float:
        self.calls += 1
        ids = torch.tensor(distinct_prompts(1, length, self.vocab, self.calls))
        start = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)
        return length / (time.perf_counter() - start)


class LlamaCppRunner:
    """llama.cpp's own benchmark tools, a fresh process per run (each loads the model cold).

    Each metric runs with llama.cpp's weight repacking (its default; on CPUs with AMX it puts the
    weights in the AMX buffer type, whose batch-1 kernels are its fastest) and falls back to
    `--repack 0` where that crashes (AMX tiles the machine does not enable, SIGILL): the best
    configuration that runs, recorded per metric in `configs`.
    """

    name = "llama.cpp"

    def __init__(self, bench: str, model: str, threads: int) -> None:
        self.bench = Path(bench).expanduser()
        self.batched = self.bench.with_name("llama-batched-bench")
        self.model, self.threads = model, threads
        self.configs: dict[str, str] = {}
        if not self.bench.exists():
            sys.exit(f"throughput: --llama-bench {self.bench} does not exist")

    def _run(self, metric: str, command: list[str], no_repack: list[str]) -> str:
        for extra in ([] if self.configs.get(metric) == "no repack" else [[]]) + [no_repack]:
            done = subprocess.run(command + extra, capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                self.configs[metric] = "no repack" if extra else "repack"
                return done.stdout
            failure = f"{' '.join(command + extra)} failed ({done.returncode}): {done.stderr[-800:]}"
            print(f"  llama.cpp: {failure[:300]}", flush=True)
        sys.exit(f"throughput: {failure}")

    def _llama_bench(self, metric: str, prompt: int, gen: int) -> float:
        command = [str(self.bench), "-m", self.model, "-t", str(self.threads), "-p", str(prompt), "-n", str(gen)]
        out = self._run(metric, command + ["-r", "1", "-o", "json"], ["--repack", "0"])
        return float(json.loads(out)[0]["avg_ts"])

    def decode(self, batch: int, new_tokens: int) -> float:
        if batch == 1:
            return self._llama_bench("decode_b1", 0, new_tokens)
        if not self.batched.exists():
            sys.exit(f"throughput: batch {batch} needs {self.batched} beside --llama-bench")
        context = batch * (PROMPT_LEN + new_tokens) + 64
        command = [str(self.batched), "-m", self.model, "-t", str(self.threads), "-c", str(context), "-b", "2048"]
        command += ["-ub", "512", "-npp", str(PROMPT_LEN), "-ntg", str(new_tokens), "-npl", str(batch)]
        out = self._run(f"decode_b{batch}", command + ["--output-format", "jsonl"], ["--no-repack"])
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return float(rows[-1]["speed_tg"])

    def prefill(self, length: int) -> float:
        return self._llama_bench(f"prefill_{length}", length, 0)


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """GB/s of a float32 sum over `nbytes` on this process's threads (the best of `repeats`)."""
    buffer = torch.ones(nbytes // 4)
    buffer.sum()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def decode_bytes_per_token(llm: LLM) -> int:
    """What one batch-1 decode step reads: every weight the layers and the LM head multiply with."""
    parts = llm.engine.memory
    head = 0 if parts.tied_embeddings else parts.lm_head
    return parts.packed_weights + parts.dense_weights + parts.embeddings + head


def measure(runners: list, args) -> dict[str, dict[str, float]]:
    """Every metric for every system; runs of the systems alternate so drift hits all alike."""
    jobs = [(f"decode_b{b}", lambda r, b=b: r.decode(b, args.new_tokens)) for b in args.batches]
    jobs += [(f"prefill_{n}", lambda r, n=n: r.prefill(n)) for n in args.prefill_lens]
    results: dict[str, dict[str, float]] = {r.name: {} for r in runners}
    for metric, job in jobs:
        samples: dict[str, list[float]] = {r.name: [] for r in runners}
        for r in runners:
            job(r)  # warm-up
        for _ in range(args.repeats):
            for r in runners:
                samples[r.name].append(job(r))
        for r in runners:
            results[r.name][metric] = statistics.median(samples[r.name])
            print(
                f"  {r.name:12s} {metric:14s} {results[r.name][metric]:8.1f} tok/s  "
                f"(runs: {', '.join(f'{x:.0f}' for x in samples[r.name])})",
                flush=True,
            )
    return results


def profile_decode(runner: KvbankRunner, batch: int, new_tokens: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    runner.decode(batch, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.decode(batch, new_tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill-lens", default="512,2048")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    parser.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench binary (llama-batched-bench beside it serves batches > 1): adds llama.cpp",
    )
    parser.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="run kvbank with batch_invariant=False (output may depend on the batch)",
    )
    parser.add_argument("--profile", action="store_true", help="print a kvbank decode profile per batch size")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "throughput.json"))
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]
    model = args.model or bundled_model_path()
    report = {
        "model": model,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "batch_invariant": args.batch_invariant,
        "results": {},
    }
    for dtype in args.dtypes.split(","):
        print(f"{dtype}:", flush=True)
        runners = [KvbankRunner(model, dtype, args.batch_invariant)] + (
            [] if args.no_hf else [TransformersRunner(model, dtype)]
        )
        if args.llama_bench:
            runners.append(LlamaCppRunner(args.llama_bench, model, torch.get_num_threads()))
        step_bytes = decode_bytes_per_token(runners[0].llm)
        report["results"][dtype] = measure(runners, args)
        generation = {m: statistics.median(v[1:]) for m, v in runners[0].generation_only.items()}  # v[0]: warm-up
        report.setdefault("kvbank_generation_only", {})[dtype] = generation
        print("kvbank, generation after the first token only (llama-bench's tg):")
        for metric, value in generation.items():
            print(f"  {metric:14s} {value:8.1f} tok/s")
        for runner in runners:
            if isinstance(runner, LlamaCppRunner):
                report.setdefault("llama_cpp_configs", {})[dtype] = runner.configs
                print(f"llama.cpp configurations: {runner.configs}")
        report.setdefault("roofline", {})[dtype] = roofline(report["results"][dtype], step_bytes, model)
        if args.profile:
            for batch in args.batches:
                print(f"kvbank {dtype} decode batch {batch} profile:\n{profile_decode(runners[0], batch, 32)}")
        del runners
    print_table(report["results"], args.batches)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


def roofline(results: dict, kvbank_bytes: int, model: str) -> dict:
    """Batch-1 decode bytes/token x tok/s against the read bandwidth measured now."""
    from gguf import GGUFReader

    peer_bytes = sum(int(t.n_bytes) for t in GGUFReader(model).tensors)  # llama.cpp reads the file's tensors
    bandwidth = {"step_size": read_bandwidth(kvbank_bytes), "1GiB": read_bandwidth(1 << 30)}
    out = {"read_bandwidth_gbps": bandwidth, "systems": {}}
    print(
        f"\nread bandwidth: {bandwidth['step_size']:.1f} GB/s over {kvbank_bytes / 1e6:.1f} MB (one step's weights), "
        f"{bandwidth['1GiB']:.1f} GB/s over 1 GiB"
    )
    for name, per_bytes in (("kvbank", kvbank_bytes), ("llama.cpp", peer_bytes)):
        tok_s = results.get(name, {}).get("decode_b1")
        if tok_s is None:
            continue
        gbps = per_bytes * tok_s / 1e9
        out["systems"][name] = {"bytes_per_token": per_bytes, "gbps": gbps}
        print(
            f"  {name:10s} {per_bytes / 1e6:6.1f} MB/token x {tok_s:6.1f} tok/s = {gbps:5.1f} GB/s: "
            f"{gbps / bandwidth['step_size']:4.0%} of the step-size bandwidth, "
            f"{gbps / bandwidth['1GiB']:4.0%} of 1 GiB's"
        )
    return out


def print_table(results: dict, batches: list[int]) -> None:
    peers = [p for p in ("transformers", "llama.cpp") if any(p in r for r in results.values())]
    header = "".join(f" {p:>13s} {'ratio':>7s}" for p in peers)
    print(f"\n{'dtype':9s} {'metric':14s} {'kvbank':>10s}{header}")
    for dtype, by_system in results.items():
        ours = by_system["kvbank"]
        for metric, value in ours.items():
            cells = ""
            for peer in peers:
                ref = by_system.get(peer, {}).get(metric)
                cells += f" {ref:13.1f} {value / ref:6.2f}x" if ref else f" {'-':>13s} {'-':>7s}"
            print(f"{dtype:9s} {metric:14s} {value:10.1f}{cells}")
        if f"decode_b{batches[0]}" in ours and batches[0] == 1:
            for batch in batches[1:]:
                print(
                    f"{dtype:9s} {'b' + str(batch) + ' / b1':14s} {ours[f'decode_b{batch}'] / ours['decode_b1']:9.2f}x"
                )


if __name__ == "__main__":
    main()
