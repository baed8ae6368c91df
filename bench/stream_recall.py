"""What recalling evicted frames costs a stream, and how often relevance finds the right ones.

A session with a host tier (`kv_host_gb`) archives every frame its window evicts. Into a stream of
tracking-log frames the script puts "needles" (frames that name a coloured object, each once,
long before the question), then asks about each needle with `ask(question, recall=k)` and checks
whether the needle is among the frames that came back. It also times, in the same process:

- appends with the tier (archiving each evicted frame) against appends without one;
- a question without recall against one with recall=k (probe forward, tier reads, the copy of
  the kept window into the question's blocks).

    python bench/stream_recall.py                 # 600 frames, window 64, 10 needles, recall 4
    python bench/stream_recall.py --recall 8 --frames 1200
    python bench/stream_recall.py --as-embeddings    # keys alone (frames without words)

Frames given as text are ranked by their mean keys and by the rare words they share with the
question; frames given as embeddings by their keys alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--frames", type=int, default=600, help="frames appended (default: %(default)s)")
parser.add_argument("--window", type=int, default=64, help="frames kept (default: %(default)s)")
parser.add_argument("--needles", type=int, default=10, help="needle frames, asked about one by one (default: 10)")
parser.add_argument("--recall", type=int, default=4, help="frames recalled per question (default: %(default)s)")
parser.add_argument("--max-tokens", type=int, default=8, help="tokens of every answer (default: %(default)s)")
parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads (default: all)")
parser.add_argument(
    "--as-embeddings",
    action="store_true",
    help="append every line as its tokens' embeddings: no words to match, frames ranked by their keys alone",
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--tag", default="", help="suffix of bench/results/stream_recall{tag}.json")
args = parser.parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

import torch

torch.set_num_threads(args.threads)

from kvbank import LLM, SamplingParams

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "pink", "brown", "grey", "cyan"]
SHAPES = ["balloon", "truck", "bicycle", "umbrella", "kite", "dog", "bus", "scooter", "boat", "ladder"]
SYSTEM = "You watch a street camera. Each line says what the tracker sees. Answer briefly."


def frames(rng: random.Random) -> tuple[list[str], dict[int, str]]:
    """The stream's lines, and needle index -> its object (placed in the first half, before the window)."""
    lines = []
    for i in range(args.frames):
        a, b = rng.randrange(1, 40), rng.randrange(1, 40)
        lines.append(f"t={i * 0.5:.1f}s: id {a} at ({rng.randrange(320)},{rng.randrange(240)}); id {b} moving left")
    spots = rng.sample(range(10, args.frames // 2), args.needles)
    needles = {}
    for n, spot in enumerate(sorted(spots)):
        thing = f"{COLOURS[n % len(COLOURS)]} {SHAPES[n % len(SHAPES)]}"
        lines[spot] = f"t={spot * 0.5:.1f}s: a {thing} entered from the left at ({rng.randrange(320)},120)"
        needles[spot] = thing
    return lines, needles


def run(llm: LLM, lines: list[str]) -> tuple[object, list[float]]:
    session = llm.open_stream(SYSTEM, policy=f"frame_window(frames={args.window},sinks=4)")
    times = []
    tokenizer = llm.get_tokenizer()
    for line in lines:
        frame = llm.embed_tokens(tokenizer.encode(line + "\n")) if args.as_embeddings else line
        start = time.perf_counter()
        session.append(frame)
        times.append(time.perf_counter() - start)
    return session, times


def main() -> None:
    lines, needles = frames(random.Random(args.seed))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM()
    tiered = LLM(kv_host_gb=1.0)
    session_plain, append_plain = run(plain, lines)
    session_tiered, append_tiered = run(tiered, lines)
    evicting = slice(args.window + 1, None)
    rows, found = [], 0
    for spot, thing in needles.items():
        question = f"Where did the {thing} enter?"
        timings = {}
        for name, session, recall in (("plain", session_plain, 0), ("tiered", session_tiered, 0)):
            start = time.perf_counter()
            session.ask(question, params, recall=recall)
            timings[name] = time.perf_counter() - start
        start = time.perf_counter()
        session_tiered.ask(question, params, recall=args.recall)
        timings["recall"] = time.perf_counter() - start
        recalled, seconds = session_tiered.last_recall()
        hit = spot in recalled
        found += hit
        rows.append({"needle": spot, "object": thing, "recalled": recalled, "hit": hit, "recall_s": seconds, **timings})
        print(f"  needle at frame {spot:4d} ({thing:15s}): recalled {recalled} {'HIT' if hit else 'miss'}", flush=True)
    median = lambda key: statistics.median(r[key] for r in rows) * 1000
    summary = {
        "append_ms_no_tier": statistics.median(append_plain[evicting]) * 1000,
        "append_ms_tier": statistics.median(append_tiered[evicting]) * 1000,
        "ask_ms_no_recall": median("tiered"),
        "ask_ms_recall": median("recall"),
        "recall_ms_before_answer": median("recall_s"),
        "needles_found": found,
        "needles": len(rows),
        "stats": session_tiered.stats(),
    }
    print(f"\n| | no tier | tier, recall={args.recall} |\n|---|---|---|")
    print(
        f"| append (median, window full) | {summary['append_ms_no_tier']:.1f} ms | {summary['append_ms_tier']:.1f} ms |"
    )
    print(
        f"| ask, {args.max_tokens} tokens (median) | {summary['ask_ms_no_recall']:.1f} ms "
        f"| {summary['ask_ms_recall']:.1f} ms |"
    )
    print(f"\nrecall before the answer starts (probe, tier reads, copy): {summary['recall_ms_before_answer']:.1f} ms")
    print(
        f"needles among the recalled frames: {found} of {len(rows)} "
        f"(recall={args.recall} of {args.frames - args.window} evicted)"
    )
    out = ROOT / "bench" / "results" / f"stream_recall{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
