"""What the integer decode kernels cost in accuracy: 8-bit activations against dense weights.

The default configuration (bfloat16, GGUF weights kept 4-bit and 8-bit, activations quantized to
8 bits per 32 values as llama.cpp does) against two references on the same file: the dense
bfloat16 path (`weight_format="dense"`: weights dequantized once, bfloat16 matmuls) and float32
(dense, float32 throughout). For each: perplexity over >= --ppl-tokens tokens of held-out text in
--window-token windows (prompt_logprobs), and greedy agreement with each reference over 128 tokens
of --prompts chat answers: teacher-forced top-1 agreement and how many tokens free-running greedy
output stays identical.

    python bench/weight_accuracy.py --corpus ../shared/data/web_bible.txt
    python bench/weight_accuracy.py --model gemma-3-270m-q4_k_m.gguf --transformers --ppl-tokens 16384

With --transformers, transformers (float32, loading the same GGUF with gguf_file=) scores the same
windows as a fourth reference (perplexity only). A model whose file has no chat template gets
the questions as plain text.

Results go to bench/results/weight_accuracy.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_quant import agreement, perplexity  # noqa: E402

from kvbank import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "web_bible.txt"
CONFIGS = {
    "integer (default)": {"dtype": "bfloat16"},
    "dense bfloat16": {"dtype": "bfloat16", "weight_format": "dense"},
    "float32": {"dtype": "float32"},
}
QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are three good habits for learning a new language?",
    "Summarise the plot of a detective story in a few sentences.",
    "Why do cats purr?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Describe a walk through a busy market.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--ppl-tokens", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--transformers", action="store_true", help="add transformers' float32 perplexity")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "weight_accuracy.json"))
    args = parser.parse_args()
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus} does not exist")
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    results: dict[str, dict] = {}
    references: dict[str, list[list[int]]] = {}
    tokens = prompts = kept = None
    for name, options in CONFIGS.items():
        llm = LLM(args.model, **options, num_gpu_blocks=512, enable_prefix_caching=False)
        if tokens is None:
            tokens = llm.get_tokenizer().encode(args.corpus.read_text())[: args.ppl_tokens + args.window]
            questions = (QUESTIONS * (1 + args.prompts // len(QUESTIONS)))[: args.prompts]
            prompts = [_prompt(llm, q) for q in questions]
        ppl, scored = perplexity(llm, tokens, args.window)
        results[name] = {"perplexity": ppl, "scored_tokens": scored}
        references[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        kept = kept or llm  # the default configuration, scored against the others below
        del llm
        gc.collect()
        print(f"{name:18s} perplexity {ppl:.4f} over {scored} tokens", flush=True)
    default = next(iter(CONFIGS))
    if args.transformers:
        ppl, scored = transformers_perplexity(kept.engine.model_path, tokens, args.window)
        results["transformers float32"] = {"perplexity": ppl, "scored_tokens": scored}
        change = results[default]["perplexity"] / ppl - 1
        results[default]["vs transformers float32"] = {"perplexity_change": change}
        print(f"transformers float32 perplexity {ppl:.4f} over {scored} tokens; {default}: {change:+.2%}", flush=True)
    for reference in list(CONFIGS)[1:]:
        top1, identical = agreement(kept, prompts, references[reference])
        change = results[default]["perplexity"] / results[reference]["perplexity"] - 1
        results[default][f"vs {reference}"] = {
            "perplexity_change": change,
            "top1_agreement": top1,
            "identical_greedy_tokens": identical,
        }
        print(
            f"{default} vs {reference}: perplexity {change:+.2%}, top-1 agreement {top1:.1%}, "
            f"greedy identical for {identical:.1f} of 128 tokens (mean over {len(prompts)} prompts)"
        )
    out = {"model": args.model or "bundled", "corpus": str(args.corpus), "window": args.window, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


def _prompt(llm: LLM, question: str) -> list[int]:
    try:
        return llm.render_chat([{"role": "user", "content": question}])
    except ValueError:  # no chat template in the file: the question as text
        return llm.get_tokenizer().encode(question)


def transformers_perplexity(path: str, tokens: list[int], window: int) -> tuple[float, int]:
    """Perplexity of transformers (float32) reading the same GGUF, over the same windows as `perplexity`."""
    import math

    import torch
    import transformers

    folder, name = str(Path(path).parent), Path(path).name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(tokens) - window + 1, window):
            ids = torch.tensor([tokens[i : i + window]])
            logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
            total += logprobs.gather(1, ids[0, 1:, None]).sum().item()
            count += window - 1
    return math.exp(-total / count), count


if __name__ == "__main__":
    main()
