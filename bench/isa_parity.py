"""Greedy tokens and logprobs of the bundled model at every ISA level this CPU has, in this checkout
and (with --against DIR) in another one, compared level by level.

Each level runs in a process of its own with KVBANK_ISA set, in the default configuration (bfloat16,
packed GGUF weights, batch-invariant): chat prompts of varied length generate greedily up to
--max-tokens (or EOS) with the chosen token's logprob, and the prompt's logprobs are scored too. Two
runs agree when every token is the same and every logprob has the same float32 bits.

    python bench/isa_parity.py                                   # levels against each other
    python bench/isa_parity.py --against ../old-checkout --json bench/results/isa_parity.json

The other checkout is run with its own sources and its own native build (its bench/ need not have
this script: the child code is run from here with that checkout first on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, for a child of six who keeps asking why.",
    "List three uses of a paperclip.",
    "Summarise: It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on his "
    "first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.",
    "hi",
)

CHILD = """
import json, struct, sys
sys.path.insert(0, sys.argv[1])
from kvbank import LLM, SamplingParams, kernels
from kvbank.kernels import isa
questions, max_tokens = json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(dtype="bfloat16")
prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in questions]
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0)
bits = lambda x: struct.unpack("<I", struct.pack("<f", x))[0]
out = []
for request in llm.generate(prompts, params):
    c = request.outputs[0]
    chosen = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
    scored = [e[t].logprob for t, e in zip(request.prompt_token_ids[1:], request.prompt_logprobs[1:])]
    out.append({"tokens": c.token_ids, "finish": c.finish_reason, "logprobs": [bits(x) for x in chosen],
                "prompt_logprobs": [bits(x) for x in scored], "values": chosen})
print(json.dumps({"active": isa.report(kernels.native())["active"], "runs": out}))
"""


def cpu_level() -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(HERE)!r}); from kvbank import kernels; "
            "from kvbank.kernels import isa; print(isa.report(kernels.native())['cpu'])",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return out[-1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def run(repo: Path, level: str, max_tokens: int) -> dict:
    env = {**os.environ, "KVBANK_ISA": level}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(repo), json.dumps(QUESTIONS), str(max_tokens)],
        cwd=repo,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(a: dict, b: dict) -> dict:
    """Whether two runs gave the same tokens and logprob bits, and how far the logprobs are apart."""
    same_tokens = all(x["tokens"] == y["tokens"] for x, y in zip(a["runs"], b["runs"]))
    same_bits = all(
        x["logprobs"] == y["logprobs"] and x["prompt_logprobs"] == y["prompt_logprobs"]
        for x, y in zip(a["runs"], b["runs"])
    )
    gap = max((abs(p - q) for x, y in zip(a["runs"], b["runs"]) for p, q in zip(x["values"], y["values"])), default=0.0)
    return {"same_tokens": same_tokens, "same_logprob_bits": same_bits, "max_logprob_gap": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="another checkout to compare with, level by level")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    top = cpu_level()
    levels = [level for level in LEVELS if LEVELS.index(level) <= LEVELS.index(top)]
    result: dict = {"cpu": cpu_name(), "cpu_level": top, "levels": {}}
    for level in levels:
        ours = run(HERE, level, args.max_tokens)
        row: dict = {"active": ours["active"], "tokens": sum(len(r["tokens"]) for r in ours["runs"])}
        row["finish"] = [r["finish"] for r in ours["runs"]]
        if args.against is not None:
            theirs = run(args.against.resolve(), level, args.max_tokens)
            row["against"] = compare(ours, theirs)
        row["against_scalar"] = compare(ours, result["levels"]["scalar"]["run"]) if level != "scalar" else None
        row["run"] = ours
        result["levels"][level] = row
        print(level, {k: v for k, v in row.items() if k not in ("run",)}, flush=True)
    result["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    if args.json is not None:
        for row in result["levels"].values():
            row.pop("run")
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
