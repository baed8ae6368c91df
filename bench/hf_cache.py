"""kvbank's KV formats inside transformers: parity with the engine, and against transformers' caches.

The bundled model loaded by transformers from its GGUF (--dtype, bfloat16 by default), text from
--corpus.

- parity: for each kvbank codec, the perplexity of --windows windows of --window tokens scored by
  the kvbank engine (prompt_logprobs, same dtype, same GGUF) and by transformers with
  `KVBankQuantizedCache(codec, residual_length=0)`, the windows fed in 16-token chunks (the
  engine's block: int4/int2 tokens attend to earlier blocks stored and their own block exactly),
  and the ratio of the two.
- compare: DynamicCache, transformers' `QuantizedCache` (quanto and HQQ at 4 and 2 bits, its
  defaults otherwise) and kvbank's caches, each with --residual exact recent tokens: perplexity
  of the same windows fed in 16-token chunks (so later chunks attend to what the cache stored),
  the cache's bytes after a greedy `generate` of --new tokens from a --prompt-token prompt, and
  decode tok/s of that generate (batch 1; (new - 1) tokens over the time beyond a 1-token
  generate), median of --rounds rounds, caches timed in alternation.

    python bench/hf_cache.py
    python bench/hf_cache.py --dtype float32 --only parity

Needs the bench extra (transformers, accelerate, gguf; optimum-quanto and hqq for their caches).
Results go to bench/results/hf_cache[_<dtype>].json (a part not run keeps its last results).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache  # noqa: E402

from bench.kv_quant import perplexity as engine_perplexity  # noqa: E402
from kvbank import LLM  # noqa: E402
from kvbank.integrations.hf import KVBankQuantizedCache  # noqa: E402
from kvbank.models.loader import BUNDLED_FILE, BUNDLED_PACKAGE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "austen_all.txt"
CODECS = ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"]
CHUNK = 16


def hf_perplexity(model, windows: list[list[int]], make_cache, chunk: int = CHUNK) -> float:
    """Perplexity of every window, each fed through a fresh cache `chunk` tokens at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            cache = make_cache()
            for start in range(0, len(ids), chunk):
                piece = torch.tensor([ids[start : start + chunk]])
                logits = model(input_ids=piece, past_key_values=cache, use_cache=True).logits[0].float()
                targets = torch.tensor(ids[start + 1 : start + chunk + 1])
                scored = logits[: len(targets)].log_softmax(-1)
                total += scored[torch.arange(len(targets)), targets].sum().item()
                count += len(targets)
    return math.exp(-total / count)


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor an object holds (quanto's tensor subclasses and HQQ's meta included)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.nn.Parameter:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name), seen) for name in names)
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def cache_factories(model, residual: int) -> dict[str, object]:
    caches = {"DynamicCache": DynamicCache}
    for backend, package in (("quanto", "optimum.quanto"), ("hqq", "hqq")):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            print(f"skipping transformers QuantizedCache({backend!r}): {package} is not installed", file=sys.stderr)
            continue
        for bits in (4, 2):
            caches[f"QuantizedCache {backend} int{bits}"] = lambda b=backend, n=bits: QuantizedCache(
                b, model.config, nbits=n, residual_length=residual
            )
            if backend == "hqq":  # transformers' docs advise axis 1 for HQQ
                caches[f"QuantizedCache hqq int{bits} axis 1"] = lambda n=bits: QuantizedCache(
                    "hqq", model.config, nbits=n, residual_length=residual, axis_key=1, axis_value=1
                )
    for kv in ("int8", "fp8_e4m3", "int4", "int2"):
        caches[f"KVBankQuantizedCache {kv}"] = lambda kv=kv: KVBankQuantizedCache(kv, residual_length=residual)
    return caches


def decode_run(model, prompt: torch.Tensor, make_cache, new: int) -> tuple[float, float, int]:
    """(seconds of a 1-token generate, seconds of a `new`-token generate, cache bytes after it)."""
    times = []
    for count in (1, new):
        cache = make_cache()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False, past_key_values=cache)
        times.append(time.perf_counter() - start)
    return times[0], times[1], tensor_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--residual", type=int, default=64, help="exact recent tokens in compare")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=["parity", "compare"], choices=["parity", "compare"])
    parser.add_argument("--codecs", nargs="*", default=CODECS, choices=CODECS)
    parser.add_argument("--caches", nargs="*", help="compare only the caches whose names contain one of these")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    folder = os.path.dirname(importlib.util.find_spec(BUNDLED_PACKAGE).origin)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=BUNDLED_FILE, dtype=dtype).eval()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch_threads": torch.get_num_threads()}

    engine_args = {"dtype": args.dtype, "kv_cache_memory_gb": 1.0, "enable_prefix_caching": False}
    base = LLM(**engine_args)
    text = args.corpus.read_text(encoding="utf-8", errors="replace")[:400_000]
    tokens = base.get_tokenizer().encode(text)
    del base
    needed = args.windows * args.window
    if len(tokens) < needed + args.prompt:
        parser.error(
            f"--corpus has {len(tokens)} tokens in its first 400,000 characters, fewer than {needed + args.prompt}"
        )
    windows = [tokens[i * args.window : (i + 1) * args.window] for i in range(args.windows)]

    if "parity" in args.only:
        rows = results["parity"] = {}
        results["parity_args"] = results["args"]
        print(
            f"perplexity of {args.windows} x {args.window} tokens, {args.dtype}: kvbank engine, transformers + kvbank"
        )
        print("(engine: the default batch-invariant attention; engine, other path: --no-batch-invariant,")
        print(" the same format attended by the reference path, for the spread rounding alone makes)")
        print(f"{'codec':<10}{'engine':>9}{'other path':>12}{'transformers':>14}{'vs engine':>11}{'paths':>9}")
        for kv in ["auto", *args.codecs]:
            engine = []
            for invariant in (True, False):
                llm = LLM(**engine_args, kv_cache_dtype=kv, batch_invariant=invariant)
                engine.append(engine_perplexity(llm, [t for w in windows for t in w], args.window)[0])
                del llm
            make = DynamicCache if kv == "auto" else (lambda kv=kv: KVBankQuantizedCache(kv, residual_length=0))
            ours = hf_perplexity(model, windows, make)
            rows[kv] = {"engine": engine[0], "engine_other_path": engine[1], "transformers": ours}
            print(
                f"{kv:<10}{engine[0]:>9.3f}{engine[1]:>12.3f}{ours:>14.3f}{ours / engine[0] - 1:>+11.3%}"
                f"{engine[1] / engine[0] - 1:>+9.3%}",
                flush=True,
            )

    if "compare" in args.only:
        factories = {
            name: make
            for name, make in cache_factories(model, args.residual).items()
            if name == "DynamicCache" or not args.caches or any(part in name for part in args.caches)
        }
        rows = results["compare"] = {name: {} for name in factories}
        results["compare_args"] = results["args"]
        for name, make in factories.items():
            rows[name]["perplexity"] = hf_perplexity(model, windows, make)
        prompt = torch.tensor([tokens[needed : needed + args.prompt]])
        runs: dict[str, list[float]] = {name: [] for name in factories}
        for _ in range(args.rounds):
            for name, make in factories.items():
                one, many, nbytes = decode_run(model, prompt, make, args.new)
                runs[name].append((args.new - 1) / max(many - one, 1e-9))
                rows[name]["bytes"] = nbytes
        base_ppl, base_bytes = rows["DynamicCache"]["perplexity"], rows["DynamicCache"]["bytes"]
        print(
            f"\n{args.dtype}, residual {args.residual}: perplexity ({args.windows} x {args.window} tokens, "
            f"{CHUNK}-token chunks); bytes after {args.prompt} + {args.new} tokens; decode tok/s, "
            f"median of {args.rounds}"
        )
        versus = f"{'vs dynamic':>12}"
        print(f"{'cache':<32}{'ppl':>9}{versus}{'KV bytes':>12}{versus}{'tok/s':>8}{versus}")
        for name, row in rows.items():
            row["tok_s"] = statistics.median(runs[name])
            row["tok_s_vs_dynamic"] = row["tok_s"] / statistics.median(runs["DynamicCache"])  # this run's
            print(
                f"{name:<32}{row['perplexity']:>9.3f}{row['perplexity'] / base_ppl - 1:>+12.2%}"
                f"{row['bytes']:>12,}{row['bytes'] / base_bytes:>11.3f}x{row['tok_s']:>8.1f}"
                f"{row['tok_s_vs_dynamic']:>11.2f}x",
                flush=True,
            )

    out = ROOT / "bench" / "results" / f"hf_cache{'' if args.dtype == 'bfloat16' else '_' + args.dtype}.json"
    if out.exists():  # keep the parts and rows this run did not measure
        old = json.loads(out.read_text())
        for part in ("parity", "compare"):
            if part in results and part in old:
                results[part] = {**old[part], **results[part]}
        results = {**old, **results}
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
