"""Documents reused at any position (engine/blend.py): TTFT and answer agreement of retrieval prompts.

A pool of --documents documents of --doc-tokens tokens (windows of --corpus); each prompt is a
system prompt, --per-prompt documents drawn at random in random order, and a question. For each
prompt, alternating, on one engine (the default configuration):
- full: the prompt's tokens as a plain prompt (no documents marked): kvbank's own full prefill
  (the system prompt is a prefix-cache hit in every configuration);
- cold: the prompt with its documents marked, none cached (each is computed alone, then blended);
- warm: the same once every document of the pool is cached (computed by an earlier prompt).
TTFT is the time to the first token (max_tokens=1), median over the prompts. Beside the measured
speedup: the ideal of the check-layer design, the ratio of the layer-token work of the full prefill
to the blend's (every token in layers 0 and 1, the recomputed share in the rest).

Quality: greedy answers of --answer-tokens tokens at each --ratios, against the full prefill's:
the share of prompts whose answer is identical, the mean share of answer tokens equal at the same
position, and the perplexity of the full prefill's answer under the blended cache against under
the full prefill's (the change; target <= +3%).

    python bench/blend.py --quality-prompts 8 --json bench/results/blend.json
    python bench/blend.py --quality-prompts 8 --ratios 0.15 --skip-ttft --random-selection \
        --json bench/results/blend_random_selection.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.engine.blend_plan import CHECK_LAYER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful assistant. Answer the question from the documents below.\n\n"
QUESTIONS = [
    "\n\nQuestion: Which people are named in these passages?\nAnswer:",
    "\n\nQuestion: What happens in the third passage?\nAnswer:",
    "\n\nQuestion: Summarise the passages in one sentence.\nAnswer:",
    "\n\nQuestion: Where does the first passage take place?\nAnswer:",
]


def machine() -> dict:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in cpu.splitlines() if line.startswith("Flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {"cpu": model, "flags": [f for f in wanted if f in flags], "python": platform.python_version()}


def documents(llm: LLM, path: Path, count: int, length: int) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(path.read_text(errors="replace"), add_special_tokens=False)
    stride = max(length, (len(ids) - length) // count)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def prompts(pool: list[list[int]], count: int, per_prompt: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [rng.sample(pool, per_prompt) for _ in range(count)]


def marked(docs: list[list[int]], question: str, ratio: float | None = None) -> dict:
    prompt = {"segments": [SYSTEM, *({"document": d} for d in docs), question]}
    if ratio is not None:
        prompt["blend_recompute_ratio"] = ratio
    return prompt


def plain(llm: LLM, docs: list[list[int]], question: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(SYSTEM)
    for d in docs:
        ids += d
    return ids + tokenizer.encode(question, add_special_tokens=False)


def ttft(llm: LLM, prompt) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start


def ideal_speedup(num_layers: int, ratio: float, doc_tokens: int, other_tokens: int) -> float:
    """Layer-token work of the full prefill over the blend's (attention's quadratic part aside)."""
    full = num_layers * (doc_tokens + other_tokens)
    blend = (CHECK_LAYER + 1) * doc_tokens + (num_layers - CHECK_LAYER - 1) * ratio * doc_tokens
    return full / (blend + num_layers * other_tokens)


def answer_nll(llm: LLM, prompt, answer: list[int]) -> float:
    """Mean negative log-likelihood of `answer` after `prompt` (a token list, or marked segments
    that the answer's tokens are appended to as a last plain segment)."""
    if isinstance(prompt, dict):
        prompt = {**prompt, "segments": [*prompt["segments"], answer]}
    else:
        prompt = prompt + answer
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    scored = out.prompt_logprobs[-len(answer) :]
    return -statistics.mean(entry[t].logprob for entry, t in zip(scored, answer))


def agreement(reference: list[int], answer: list[int]) -> float:
    return sum(a == b for a, b in zip(reference, answer)) / len(reference)


#: planted facts: sentences put into documents, a question each answer needs (the last two need
#: two documents), as a chat (the bundled model answers chats, not bare completions)
FACTS = [
    (["The gardener at Hartfield was a man named Tobias Lark."], "What was the name of the gardener at Hartfield?"),
    (["The new carriage cost exactly four hundred pounds."], "How much did the new carriage cost?"),
    (["Miss Bates kept a grey parrot called Pompey."], "What was Miss Bates's parrot called?"),
    (["The ball at the Crown Inn was held on the ninth of May."], "When was the ball at the Crown Inn held?"),
    (["Colonel Brandon's horse was named Thunder."], "What was Colonel Brandon's horse named?"),
    (["The vicar's study was painted a pale green."], "What colour was the vicar's study?"),
    (["The letter from London arrived on a Tuesday."], "On what day did the letter from London arrive?"),
    (["Mr. Knightley planted forty apple trees in the orchard."], "How many apple trees did Mr. Knightley plant?"),
    (["The piano was bought in Bath."], "Where was the piano bought?"),
    (["Captain Wentworth's ship was called the Laconia."], "What was Captain Wentworth's ship called?"),
    (
        ["Anne Elliot was twenty-seven years old.", "Her sister Mary was nineteen years old."],
        "How old was Anne Elliot's sister Mary?",
    ),
    (
        ["The picnic was held at Box Hill.", "Box Hill lies in the county of Surrey."],
        "In which county was the picnic held?",
    ),
]


def planted_qa(llm: LLM, corpus: Path, ratios: list[float], per_prompt: int, seed: int, tokens: int) -> dict:
    """Greedy answers to questions about facts planted in documents of ~150 tokens (the rest of each
    prompt's documents are plain passages), blended at each ratio, against the full prefill's: the
    share of questions whose answer is identical."""
    rng = random.Random(seed)
    sentences = [s.strip() + "." for s in corpus.read_text(errors="replace").replace("\n", " ").split(".")]
    sentences = [s for s in sentences if len(s) > 20]
    head = "<|im_start|>system\nAnswer the question using the passages below.<|im_end|>\n<|im_start|>user\n"
    greedy = SamplingParams(temperature=0, max_tokens=tokens)
    answers: dict[float, list[str]] = {r: [] for r in ratios}
    references = []
    for facts, question in FACTS:
        passages = []
        for _ in range(per_prompt):
            start = rng.randrange(len(sentences) - 6)
            passages.append(sentences[start : start + 6])
        docs = []
        for i, passage in enumerate(passages):
            if i < len(facts):
                k = rng.randrange(1, len(passage))
                passage = passage[:k] + [facts[i]] + passage[k:]
            docs.append(" ".join(passage) + "\n\n")
        rng.shuffle(docs)
        tail = f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"
        llm.reset_prefix_cache()
        references.append(llm.generate([{"segments": [head, *docs, tail]}], greedy)[0].outputs[0].text)
        for ratio in ratios:
            llm.reset_prefix_cache()
            prompt = {"segments": [head, *({"document": d} for d in docs), tail], "blend_recompute_ratio": ratio}
            answers[ratio].append(llm.generate([prompt], greedy)[0].outputs[0].text)
    return {
        "questions": len(FACTS),
        "identical_answers": {str(r): sum(a == b for a, b in zip(answers[r], references)) / len(FACTS) for r in ratios},
        "answers": {"full": references, **{str(r): answers[r] for r in ratios}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "data" / "austen_all.txt")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--per-prompt", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6, help="prompts timed (TTFT)")
    parser.add_argument("--quality-prompts", type=int, default=12, help="prompts whose answers are compared")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--ratio", type=float, default=0.15, help="the ratio TTFT is measured at")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-selection", action="store_true", help="recompute random tokens instead of the largest deviations"
    )
    parser.add_argument(
        "--lead-bos", action="store_true", help="documents computed after the BOS token (blend_plan.LEAD_WITH_BOS)"
    )
    parser.add_argument("--qa", action="store_true", help="also the planted-facts questions (FACTS)")
    parser.add_argument("--skip-ttft", action="store_true", help="quality only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    corpus = args.corpus if args.corpus.is_file() else ROOT / "tests" / "data" / "austen_excerpt.txt"

    if args.lead_bos:
        from kvbank.engine import blend_plan

        blend_plan.LEAD_WITH_BOS = True
    if args.random_selection:
        from kvbank.engine import blend

        blend.kv_deviation = lambda k, *_: torch.rand(k.shape[0], generator=torch.Generator().manual_seed(args.seed))
    llm = LLM(kv_cache_memory_gb=2.0)
    pool = documents(llm, corpus, args.documents, args.doc_tokens)
    timed = prompts(pool, args.prompts, args.per_prompt, args.seed)
    config = llm.engine.model_config
    llm.generate([SYSTEM], SamplingParams(max_tokens=1))  # the system prompt cached for every configuration

    full, cold, warm = [], [], []
    for i, docs in enumerate([] if args.skip_ttft else timed):
        question = QUESTIONS[i % len(QUESTIONS)]
        llm.reset_prefix_cache()
        llm.generate([SYSTEM], SamplingParams(max_tokens=1))
        full.append(ttft(llm, plain(llm, docs, question)))
        llm.reset_prefix_cache()
        llm.generate([SYSTEM], SamplingParams(max_tokens=1))
        cold.append(ttft(llm, marked(docs, question, args.ratio)))
        # every document cached now; the same prompt again, and a fresh order of them
        warm.append(ttft(llm, marked(list(reversed(docs)), question, args.ratio)))
    prompt_tokens = len(plain(llm, timed[0], QUESTIONS[0]))
    doc_tokens = args.per_prompt * args.doc_tokens
    ttft_result = (
        {}
        if args.skip_ttft
        else {
            "prompt_tokens": prompt_tokens,
            "ratio": args.ratio,
            "full_ms": 1000 * statistics.median(full),
            "cold_ms": 1000 * statistics.median(cold),
            "warm_ms": 1000 * statistics.median(warm),
            "warm_speedup": statistics.median(full) / statistics.median(warm),
            "cold_speedup": statistics.median(full) / statistics.median(cold),
            "ideal_speedup": ideal_speedup(config.num_layers, args.ratio, doc_tokens, prompt_tokens - doc_tokens),
            "raw": {"full": full, "cold": cold, "warm": warm},
        }
    )
    print(json.dumps({k: v for k, v in ttft_result.items() if k != "raw"}, indent=1))

    quality = {}
    checked = prompts(pool, args.quality_prompts, args.per_prompt, args.seed + 1)
    greedy = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    references = [
        llm.generate([plain(llm, docs, QUESTIONS[i % len(QUESTIONS)])], greedy)[0].outputs[0].token_ids
        for i, docs in enumerate(checked)
    ]
    full_nll = statistics.mean(
        [
            answer_nll(llm, plain(llm, docs, QUESTIONS[i % len(QUESTIONS)]), r)
            for i, (docs, r) in enumerate(zip(checked, references))
        ]
        or [0.0]
    )
    for ratio in args.ratios if checked else []:
        answers, nll = [], []
        for i, docs in enumerate(checked):
            llm.reset_prefix_cache()  # else the reference's own blocks are a (exact) prefix hit for it all
            prompt = marked(docs, QUESTIONS[i % len(QUESTIONS)], ratio)
            answers.append(llm.generate([prompt], greedy)[0].outputs[0].token_ids)
            nll.append(answer_nll(llm, prompt, references[i]))
        quality[str(ratio)] = {
            "identical_answers": sum(a == r for a, r in zip(answers, references)) / len(answers),
            "token_agreement": statistics.mean(agreement(r, a) for r, a in zip(references, answers)),
            "answer_perplexity_change": math.exp(statistics.mean(nll) - full_nll) - 1,
        }
        print(ratio, quality[str(ratio)])

    qa = {}
    if args.qa:
        qa = planted_qa(llm, corpus, args.ratios, 4, args.seed, 8)
        print("planted facts, identical answers:", qa["identical_answers"])

    result = {
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "corpus")} | {"corpus": corpus.name},
        "ttft": ttft_result,
        "quality": quality,
        "planted_qa": qa,
        "stats": {k: v for k, v in llm.stats().items() if k.startswith("blend_")},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
