"""KV memory of a sliding-window model (Gemma 3): kvbank's hybrid cache against one that keeps every
token in every layer (`swa_full=True`), and against llama.cpp's SWA cache with --swa-full off and on.

For each context length (--contexts, default 8192 and 32768):
- kvbank's plan (the arithmetic `kvbank plan` prints and the engine sizes its pool by): bytes per
  token of one sequence that long, and how many such sequences fit in --memory-gb of KV.
- kvbank measured (--measure, default the first context): a real sequence of that many tokens of
  --corpus is prefilled and decoded a few tokens in the default configuration; the blocks it holds
  (full-attention table and window tables, read from the cache manager) times bytes per block.
- llama.cpp (with --llama-server PATH): llama-server started with 2 slots of that context
  (`-c 2*ctx -np 2`), its KV buffer sizes read from its log (the non-SWA and SWA caches; the
  first, zero-sized buffers are its dry run); per sequence = total / 2, sequences = budget / that.

    python bench/kv_memory.py --model gemma-3-270m-q4_k_m.gguf \\
        --llama-server ~/llama.cpp/build/bin/llama-server

Results go to bench/results/kv_memory.json.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.cache.blocks import blocks_for  # noqa: E402
from kvbank.cache.hybrid import kv_groups  # noqa: E402
from kvbank.cache.storage import plan_pool  # noqa: E402
from kvbank.config import EngineConfig  # noqa: E402
from kvbank.models.loader import describe_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "web_bible.txt"
RESULTS = ROOT / "bench" / "results"
MIB = 2**20


def kvbank_plan(model: str, context: int, memory: int) -> dict:
    config = describe_model(model).config
    engine = EngineConfig(model=model)
    rows = {}
    for name, groups in (("hybrid", kv_groups(config.layer_windows)), ("swa_full", None)):
        plan = plan_pool(config, engine.torch_dtype, memory, engine.block_size, groups=groups)
        rows[name] = {
            "bytes_per_token": plan.bytes_per_token_at(context),
            "bytes_per_sequence": plan.blocks_per_sequence(context) * plan.bytes_per_block,
            "sequences": plan.sequences_that_fit(context),
        }
    return rows


def kvbank_measured(model: str, context: int, corpus: Path, steps: int) -> dict:
    """Prefill `context - steps` tokens of `corpus`, decode `steps`; the blocks the sequence holds."""
    llm = LLM(model, enable_prefix_caching=False, max_model_len=max(context, 8192))
    text = corpus.read_text(encoding="utf-8", errors="replace")
    tokens = llm.get_tokenizer().encode(text[: context * 8])[: context - steps]
    assert len(tokens) == context - steps, f"{corpus} holds fewer than {context} tokens"
    engine = llm.engine
    engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), "long")
    held = (0, 0, 0)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            windows = sum(1 for table in seq.window_tables for block in table if block >= 0)
            held = (seq.num_computed_tokens, len(seq.block_table), windows)
    seconds = time.perf_counter() - started
    computed, full, windows = held
    per_block = engine.pool_plan.bytes_per_block
    return {
        "tokens": computed,
        "full_blocks": full,
        "window_blocks": windows,
        "bytes_per_block": per_block,
        "bytes_per_token": (full + windows) * per_block / computed,
        "full_blocks_expected": blocks_for(computed, engine.block_size),
        "seconds": seconds,
    }


def llama_server_kv(server: str, model: str, context: int, swa_full: bool) -> dict:
    """Total KV buffer bytes llama-server allocates for 2 slots of `context` tokens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # -v: llama.cpp logs its KV buffer sizes at the verbose level only
    args = [server, "-m", model, "-c", str(2 * context), "-np", "2", "-t", "2", "--port", str(port), "-v"]
    args += ["--host", "127.0.0.1", "--swa-full"] if swa_full else ["--host", "127.0.0.1"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line or "all slots are idle" in line:
                break
    finally:
        process.kill()
        process.wait()
    sizes = [float(m.group(1)) for m in re.finditer(r"KV buffer size =\s+([\d.]+) MiB", "".join(lines))]
    cells = [
        int(m.group(1)) for m in re.finditer(r"creating\s+(?:non-SWA|SWA) KV cache, size = (\d+) cells", "".join(lines))
    ]
    real = [s for s in sizes if s > 0]
    if not real:
        raise RuntimeError("llama-server printed no KV buffer size:\n" + "".join(lines[-20:]))
    return {"total_mib": sum(real), "buffers_mib": real, "cells": cells[len(cells) - len(real) :]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Gemma 3 GGUF")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--memory-gb", type=float, default=1.0)
    parser.add_argument("--measure", default="8192", help="contexts to run a real sequence at ('' for none)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--llama-server", help="llama-server binary (llama.cpp) to compare with")
    args = parser.parse_args()
    memory = int(args.memory_gb * 2**30)
    measure = {int(c) for c in args.measure.split(",") if c}
    out = {"model": args.model, "memory_bytes": memory, "contexts": {}}
    for context in map(int, args.contexts.split(",")):
        row = {"kvbank_plan": kvbank_plan(args.model, context, memory)}
        plan = row["kvbank_plan"]
        print(
            f"{context} tokens: kvbank hybrid {plan['hybrid']['bytes_per_token']:.0f} B/token "
            f"({plan['hybrid']['sequences']} sequences in {args.memory_gb:g} GiB), swa_full "
            f"{plan['swa_full']['bytes_per_token']:.0f} B/token ({plan['swa_full']['sequences']}); "
            f"ratio {plan['hybrid']['bytes_per_token'] / plan['swa_full']['bytes_per_token']:.3f}",
            flush=True,
        )
        if context in measure:
            row["kvbank_measured"] = m = kvbank_measured(args.model, context, args.corpus, args.steps)
            print(
                f"  measured: {m['tokens']} tokens hold {m['full_blocks']} full-attention + {m['window_blocks']} "
                f"window blocks of {m['bytes_per_block']} B = {m['bytes_per_token']:.0f} B/token "
                f"({m['seconds']:.0f} s)",
                flush=True,
            )
        if args.llama_server:
            for swa_full in (False, True):
                kv = llama_server_kv(args.llama_server, args.model, context, swa_full)
                per_seq = kv["total_mib"] * MIB / 2
                kv["bytes_per_token"] = per_seq / context
                kv["sequences"] = int(memory // per_seq)
                row[f"llama_cpp{'_swa_full' if swa_full else ''}"] = kv
                print(
                    f"  llama.cpp{' --swa-full' if swa_full else ''}: {kv['buffers_mib']} MiB for 2 x {context} "
                    f"(cells {kv['cells']}) = {kv['bytes_per_token']:.0f} B/token, {kv['sequences']} sequences",
                    flush=True,
                )
        out["contexts"][str(context)] = row
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_memory.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
