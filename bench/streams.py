"""Streaming sessions: append and answer latency, and memory, against history length.

A session (`LLM.open_stream`) keeps a system prompt and the last --window frames of a stream in
the KV cache: each append computes only the new frame's tokens and evicts the oldest frames, and
a question is answered from the cached state. The recompute baseline is what a stateless server
does instead: prefill the whole kept history (session.kept_token_ids(), the same tokens the
session's cache holds) from scratch, on a second LLM with prefix caching off.

--frames frames (default 5,000) of varied-length tracking-log text (15-40 tokens each,
deterministic from --seed) are appended one by one; every append is timed. At 100 frames, every
--sample-every frames and at the last frame the script measures (medians of --repeats runs):
- append, recompute: prefilling the kept history, the new frame included, from scratch
  (max_tokens=1);
- answer, both ways: session.ask(question) against generate(kept history + the question's tokens),
  the same SamplingParams (temperature 0, --max-tokens tokens, ignore_eos, so both produce the same
  number of tokens): time to first token (from the output's metrics) and the whole answer (wall
  time of the call);
- KV blocks the session holds (session.stats()["blocks"]) and process RSS; these two are also
  sampled every --memory-every frames. RSS is the whole process: both LLMs (the baseline's pool is
  sized to its longest prompt and touched in full before the run), and KV pool pages count from
  their first use.

Targets (from the spec), printed as PASS/FAIL from the unrounded numbers:
- answer latency at 5,000 frames >= 20x faster than recompute (whole answer; TTFT shown too);
- flatness: over the last 10% of frames, the median append latency, and the peak KV blocks and
  peak RSS, are within 1.2x of the first 10%, where the first 10% starts at the first append that
  evicted a frame (the window's first fill, a warm-up, is left out).

    python bench/streams.py                                  # 5,000 frames, window 64, 4 sinks
    python bench/streams.py --frames 120 --sample-every 60   # a smoke run
    python bench/streams.py --window 256 --tag _w256
    python bench/streams.py --kv-cache-dtype int4 --tag _int4  # on a 4-bit KV pool

Results go to bench/results/streams{tag}.json, plots to bench/results/streams{tag}_*.png.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))


def all_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=5000, help="frames appended (default: %(default)s)")
    parser.add_argument("--window", type=int, default=64, help="frames the session keeps (default: %(default)s)")
    parser.add_argument(
        "--sinks",
        type=int,
        default=4,
        help="frame_window sinks: leading frames kept, up to this many tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--policy", help="the session's policy, verbatim (default: frame_window(frames=WINDOW,sinks=SINKS))"
    )
    parser.add_argument(
        "--sample-every", type=int, default=500, help="frames between recompute/answer samples (default: %(default)s)"
    )
    parser.add_argument("--memory-every", type=int, default=10, help="frames between memory samples")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of every answer (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per sample point, median (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache format of both LLMs: auto, int8, fp8_e4m3, int4, int2, ... (default: %(default)s)",
    )
    parser.add_argument("--model", help="a .gguf file or HF folder (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig option for both LLMs, e.g. --option batch_invariant=False (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=all_cores(), help="threads (default: all cores, %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the frame generator")
    parser.add_argument("--tag", default="", help="suffix of the results file names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: bench/results)")
    return parser


if __name__ == "__main__":
    # Threads are set before torch is imported, so that every pool (OpenMP, MKL) starts with them.
    _threads = build_parser().parse_known_args()[0].threads
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_name] = str(_threads)

import torch  # noqa: E402

SYSTEM = (
    "You watch a live log from a tracking camera above a parking lot. Each line starts with the time in "
    "seconds, then says what the tracked objects did: an object is named by its id, its position is in "
    "pixels (x,y) on a 640x480 image, and the log says which way it moves and when it enters or leaves "
    "the view. Answer questions about the current state of the scene briefly and precisely, from the log only."
)
QUESTIONS = [
    "Which ids are in view right now?",
    "Where is the object with the highest id now?",
    "Which id entered the view most recently?",
    "Which way are most of the objects moving?",
]
MIN_TOKENS, MAX_TOKENS = 15, 40

# --- frames ----------------------------------------------------------------------------------------


class Scene:
    """A deterministic tracking scene whose log lines are the stream's frames.

    Objects enter from a side, move, turn, stop and leave; every frame reports the time, what
    happened, and the positions of some objects, within MIN_TOKENS..MAX_TOKENS tokens (a target
    length drawn per frame, so the lengths vary).
    """

    WIDTH, HEIGHT = 640, 480
    HEADINGS = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
    INWARD = {"left": "right", "right": "left", "top": "down", "bottom": "up"}
    REMARKS = [
        "no other motion",
        "light steady",
        "lot quiet",
        "gate open",
        "headlights on",
        "rain on lens",
        "shadow moving",
        "camera steady",
    ]

    def __init__(self, count_tokens: Callable[[str], int], seed: int = 0) -> None:
        self.count_tokens = count_tokens
        self.rng = random.Random(seed)
        self.time = 0.0
        self.next_id = 1
        self.objects: dict[int, list] = {}  # id -> [x, y, heading or None (stopped), speed px/s]

    def _enter(self) -> str:
        rng, side = self.rng, self.rng.choice(list(self.INWARD))
        x = {"left": 0, "right": self.WIDTH}.get(side, rng.randrange(40, self.WIDTH - 40, 10))
        y = {"top": 0, "bottom": self.HEIGHT}.get(side, rng.randrange(40, self.HEIGHT - 40, 10))
        ident, self.next_id = self.next_id, self.next_id + 1
        self.objects[ident] = [x, y, self.INWARD[side], rng.randrange(20, 160, 10)]
        return f"id {ident} entered {side}"

    def _move(self, dt: float) -> list[str]:
        events = []
        for ident, state in list(self.objects.items()):
            x, y, heading, speed = state
            if heading is not None:
                dx, dy = self.HEADINGS[heading]
                x, y = round(x + dx * speed * dt), round(y + dy * speed * dt)
            if not (0 <= x <= self.WIDTH and 0 <= y <= self.HEIGHT):
                side = "left" if x < 0 else "right" if x > self.WIDTH else "top" if y < 0 else "bottom"
                events.append(f"id {ident} left {side}")
                del self.objects[ident]
                continue
            state[:2] = x, y
            roll = self.rng.random()
            if roll < 0.06:
                state[2] = self.rng.choice(list(self.HEADINGS))
                events.append(f"id {ident} turned {state[2]}")
            elif roll < 0.09 and heading is not None:
                state[2] = None
                events.append(f"id {ident} stopped")
        return events

    def _report(self, ident: int) -> str:
        x, y, heading, _ = self.objects[ident]
        motion = f"moving {heading}" if heading else "standing"
        return f"id {ident} at ({x},{y}) {motion}"

    def frame(self) -> str:
        rng = self.rng
        dt = rng.choice((0.1, 0.2, 0.2, 0.3, 0.4, 0.5))
        self.time += dt
        events = self._move(dt)
        if rng.random() < (0.5 if len(self.objects) < 2 else 0.15 if len(self.objects) < 6 else 0.03):
            events.append(self._enter())
        reports = [self._report(i) for i in rng.sample(sorted(self.objects), len(self.objects))]
        candidates = events + reports
        head = f"t={self.time:.1f}s: "
        target = rng.randint(MIN_TOKENS, MAX_TOKENS)
        chosen: list[str] = []
        for item in candidates:  # the longest run of events and reports that fits the target
            if chosen and self.count_tokens(head + "; ".join([*chosen, item])) > target:
                break
            chosen.append(item)
        while len(chosen) > 1 and self.count_tokens(head + "; ".join(chosen)) > MAX_TOKENS:
            chosen.pop()
        remarks = rng.sample(self.REMARKS, len(self.REMARKS))
        while self.count_tokens(head + "; ".join(chosen)) < MIN_TOKENS:
            chosen.append(remarks.pop() if remarks else f"frame {rng.randrange(10**6)}")
        return head + "; ".join(chosen)


def make_frames(count_tokens: Callable[[str], int], frames: int, seed: int) -> list[str]:
    scene = Scene(count_tokens, seed)
    return [scene.frame() for _ in range(frames)]


# --- statistics ------------------------------------------------------------------------------------


def sample_points(frames: int, every: int) -> list[int]:
    """History lengths (frames appended) where recompute, answers and memory are measured."""
    points = set(range(every, frames + 1, every)) | {frames}
    if frames >= 100:
        points.add(100)
    return sorted(points)


def decile_ranges(frames: int, first_evicting: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The first and last 10% of appends, as inclusive ranges of history length (1-based append
    numbers): the first starts at the first append that evicted (the window's first fill is a
    warm-up); None when the run is too short for the two to be apart."""
    decile = frames // 10
    first = (first_evicting, first_evicting + decile - 1)
    last = (frames - decile + 1, frames)
    if decile < 1 or first[1] >= last[0]:
        return None
    return first, last


def flatness(
    points: Sequence[tuple[int, float]], ranges, reduce: Callable[[list[float]], float], limit: float = 1.2
) -> dict:
    """`reduce` of the values whose history length falls in the first and last ranges, their ratio
    and whether it is within `limit` (compared unrounded)."""
    if ranges is None:
        return {"ok": None, "why": "too few frames for a first and a last 10% after the window's first fill"}
    (a0, a1), (b0, b1) = ranges
    first = [v for n, v in points if a0 <= n <= a1 and v is not None]
    last = [v for n, v in points if b0 <= n <= b1 and v is not None]
    if not first or not last:
        return {"ok": None, "why": "no samples in the first or the last 10%"}
    head, tail = reduce(first), reduce(last)
    ratio = tail / head if head > 0 else float("inf")
    return {
        "first_range": [a0, a1],
        "last_range": [b0, b1],
        "first": head,
        "last": tail,
        "ratio": ratio,
        "samples": [len(first), len(last)],
        "limit": limit,
        "ok": ratio <= limit,
    }


def rolling_median(values: Sequence[float], width: int) -> list[float]:
    out, half = [], width // 2
    for i in range(len(values)):
        out.append(statistics.median(values[max(0, i - half) : i + half + 1]))
    return out


def rss_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


TABLE_COLUMNS = [
    "history frames",
    "append ms session",
    "append ms recompute",
    "answer ms session",
    "answer ms recompute",
    "ratio",
    "blocks",
    "RSS MiB",
    "TTFT ms session",
    "TTFT ms recompute",
    "kept frames",
    "kept tokens",
]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "|".join("---:" for _ in TABLE_COLUMNS) + "|"]
    for r in rows:
        cells = [
            str(r["frames"]),
            fmt(r.get("append_ms_session"), 2),
            fmt(r.get("append_ms_recompute")),
            fmt(r.get("answer_ms_session")),
            fmt(r.get("answer_ms_recompute")),
            "-" if r.get("answer_ratio") is None else f"{r['answer_ratio']:.1f}x",
            str(r.get("blocks", "-")),
            fmt(r.get("rss_mib")),
            fmt(r.get("ttft_ms_session")),
            fmt(r.get("ttft_ms_recompute")),
            str(r.get("kept_frames", "-")),
            str(r.get("kept_tokens", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------------


def plot(results: dict, out: Path, tag: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_frame, rows = results["per_frame"], results["rows"]
    xs = list(range(1, len(per_frame["append_ms"]) + 1))
    ranges = results["flatness"].get("ranges")
    first_evicting = results["flatness"].get("first_evicting_append")
    title = f"{results['config']['policy']}, {results['config']['dtype']}, {results['config']['threads']} threads"
    written = []

    def mark(ax) -> None:
        if first_evicting:
            ax.axvline(first_evicting, color="grey", linestyle=":", label="window full (first eviction)")
        if ranges:
            for (lo, hi), label in zip(ranges, ("first and last 10% (flatness)", None)):
                ax.axvspan(lo, hi, color="tab:green", alpha=0.08, label=label)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.scatter(xs, per_frame["append_ms"], s=2, alpha=0.25, color="tab:blue", label="session, per frame")
    width = max(5, min(101, len(xs) // 50 * 2 + 1))
    ax.plot(xs, rolling_median(per_frame["append_ms"], width), color="tab:blue", label=f"session, median of {width}")
    points = [r for r in rows if r.get("append_ms_recompute") is not None]
    ax.plot(
        [r["frames"] for r in points],
        [r["append_ms_recompute"] for r in points],
        marker="o",
        color="tab:red",
        label="recompute (prefill of the kept history)",
    )
    mark(ax)
    ax.set_yscale("log")
    ax.set_xlabel("frames appended")
    ax.set_ylabel("append latency (ms)")
    ax.set_title(f"Append latency against history: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / f"streams{tag}_append.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    answered = [r for r in rows if r.get("answer_ms_session") is not None]
    fx = [r["frames"] for r in answered]
    for key, label, style in (
        ("answer_ms_session", "session, whole answer", dict(color="tab:blue", marker="o")),
        ("ttft_ms_session", "session, first token", dict(color="tab:blue", marker="x", linestyle="--")),
        ("answer_ms_recompute", "recompute, whole answer", dict(color="tab:red", marker="o")),
        ("ttft_ms_recompute", "recompute, first token", dict(color="tab:red", marker="x", linestyle="--")),
    ):
        ys = [r.get(key) for r in answered]
        if any(y is not None for y in ys):
            ax.plot(fx, [float("nan") if y is None else y for y in ys], label=label, **style)
    ax.set_yscale("log")
    ax.set_xlabel("frames appended")
    ax.set_ylabel("answer latency (ms)")
    ax.set_title(f"Answer latency ({results['config']['max_tokens']} tokens): {title}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / f"streams{tag}_answer.png"))

    memory = results["memory"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    mx = [m["frames"] for m in memory]
    ax.plot(mx, [m["blocks"] for m in memory], color="tab:blue", label="KV blocks held by the session")
    ax.set_xlabel("frames appended")
    ax.set_ylabel("KV blocks")
    ax.set_ylim(bottom=0)
    mark(ax)
    rss = ax.twinx()
    rss.plot(mx, [m["rss_mib"] for m in memory], color="tab:orange", label="process RSS")
    rss.set_ylabel("RSS (MiB)")
    rss.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = rss.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    ax.set_title(f"Memory against history: {title}")
    written.append(_save(fig, out / f"streams{tag}_memory.png"))
    plt.close("all")
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# --- the run ---------------------------------------------------------------------------------------


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r} is not KEY=VALUE")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


class Timer:
    """Wall time of a call, the device synchronized before and after."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn: Callable, *args, **kwargs):
        self.sync()
        started = time.perf_counter()
        value = fn(*args, **kwargs)
        self.sync()
        return value, (time.perf_counter() - started) * 1e3


def ttft_ms(out) -> float | None:
    metrics = getattr(out, "metrics", None)
    if metrics is None or metrics.first_token_time is None:
        return None
    return (metrics.first_token_time - metrics.arrival_time) * 1e3


def recompute_prompt(kept: list[int], out, question: list[int]) -> tuple[list[int], str]:
    """The prompt a stateless server prefills to answer what session.ask answered: the ask's own
    prompt when it holds the history, else the kept history + the question's tokens."""
    asked = list(getattr(out, "prompt_token_ids", None) or [])
    if len(asked) > len(kept):
        return asked, "the ask's prompt_token_ids (kept history + question)"
    return kept + question, "kept_token_ids() + the question's tokens"


def main() -> None:
    args = build_parser().parse_args()
    if args.frames < 1 or args.window < 1 or args.sample_every < 1 or args.memory_every < 1 or args.repeats < 1:
        raise SystemExit("--frames, --window, --sample-every, --memory-every and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    from kvbank import LLM, SamplingParams

    policy = args.policy or f"frame_window(frames={args.window},sinks={args.sinks})"
    options = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, **parse_options(args.option)}
    if args.model:
        options["model"] = args.model
    llm = LLM(**options)
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    timer = Timer(engine.device)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    frames = make_frames(count_tokens, args.frames, args.seed)
    frame_tokens = [count_tokens(f) for f in frames]
    question_tokens = max(count_tokens(q) for q in QUESTIONS)
    spelled = re.search(r"frames\s*=\s*(\d+)", policy)
    kept_frames = int(spelled.group(1)) if spelled else args.window
    # The baseline's pool holds its longest prompt (the system prompt, sink tokens and one more
    # frame than the window, each of the longest length plus its separator) and little more, and the
    # warm-up below touches all of it, so that its pages do not show up as RSS growth during the run.
    longest = count_tokens(SYSTEM) + args.sinks + (MAX_TOKENS + 4) * (kept_frames + 1)
    longest = min(longest + question_tokens + args.max_tokens + 64, engine.max_model_len)
    blocks = -(-longest // engine.block_size) + 2
    baseline = LLM(**{**options, "enable_prefix_caching": False, "num_gpu_blocks": blocks})
    print(
        f"frames: {args.frames}, {min(frame_tokens)}-{max(frame_tokens)} tokens "
        f"(median {statistics.median(frame_tokens)}); policy {policy}; {args.threads} threads; "
        f"device {engine.device}; baseline pool {blocks} blocks",
        flush=True,
    )

    answer_params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prefill_params = SamplingParams(temperature=0, max_tokens=1)
    warm_text = tokenizer.encode(SYSTEM + "\n" + "\n".join(frames[: 2 * kept_frames]))
    warm_length = min(blocks * engine.block_size, engine.max_model_len) - args.max_tokens - engine.block_size
    warm_prompt = (warm_text * -(-warm_length // len(warm_text)))[:warm_length]
    _, warm_ms = timer(baseline.generate, [warm_prompt], answer_params)
    session, open_ms = timer(llm.open_stream, system=SYSTEM, policy=policy)
    _, warm_ask_ms = timer(session.ask, QUESTIONS[0], answer_params)
    print(
        f"warm-up: baseline {len(warm_prompt)} tokens {warm_ms:.0f} ms; open_stream {open_ms:.0f} ms; "
        f"first ask {warm_ask_ms:.0f} ms",
        flush=True,
    )

    per_frame = {k: [] for k in ("append_ms", "num_tokens", "kept_frames", "kept_tokens", "evicted_frames")}
    repeats_seen = 0
    memory: list[dict] = []
    rows: list[dict] = []
    points = sample_points(args.frames, args.sample_every)
    prompt_mode = None
    results: dict = {}
    path = args.out / f"streams{args.tag}.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def record_memory(n: int) -> dict:
        sample = {"frames": n, "blocks": session.stats()["blocks"], "rss_mib": rss_mib()}
        memory.append(sample)
        return sample

    record_memory(0)
    previous = 0
    started = time.perf_counter()
    for n, frame in enumerate(frames, start=1):
        info, ms = timer(session.append, frame)
        per_frame["append_ms"].append(ms)
        for key in ("num_tokens", "kept_frames", "kept_tokens", "evicted_frames"):
            per_frame[key].append(getattr(info, key, None))
        repeats_seen += getattr(info, "repeat_of", None) is not None
        is_point = n in points
        if n % args.memory_every == 0 or is_point:
            sample = record_memory(n)
        if not is_point:
            continue
        row = {
            "frames": n,
            "append_ms_session": statistics.median(per_frame["append_ms"][previous:n]),
            "append_ms_session_range": [previous + 1, n],
            "blocks": sample["blocks"],
            "rss_mib": sample["rss_mib"],
            "kept_frames": getattr(info, "kept_frames", None),
            "kept_tokens": getattr(info, "kept_tokens", None),
        }
        previous = n
        kept = session.kept_token_ids()
        row["kept_token_ids"] = len(kept)
        if row["kept_tokens"] is not None and len(kept) != row["kept_tokens"]:
            print(f"  warning: kept_token_ids() has {len(kept)} tokens, the append said {row['kept_tokens']} are kept")
        times = [timer(baseline.generate, [kept], prefill_params)[1] for _ in range(args.repeats)]
        row["append_ms_recompute"] = statistics.median(times)
        question = QUESTIONS[len(rows) % len(QUESTIONS)]
        session_runs, recompute_runs, prompt = [], [], None
        # S R, R S, S R, ...: the session goes first, and its ask tells what the recompute prefills.
        for r in range(args.repeats):
            for which in ("session", "recompute") if r % 2 == 0 else ("recompute", "session"):
                if which == "session":
                    asked, ms = timer(session.ask, question, answer_params)
                    session_runs.append((ms, ttft_ms(asked), list(asked.outputs[0].token_ids)))
                    if prompt is None:
                        prompt, prompt_mode = recompute_prompt(kept, asked, tokenizer.encode(question))
                    continue
                (redone,), ms = timer(baseline.generate, [prompt], answer_params)
                recompute_runs.append((ms, ttft_ms(redone), list(redone.outputs[0].token_ids)))
        row["question"] = question
        row["recompute_prompt_tokens"] = len(prompt)
        for name, runs in (("session", session_runs), ("recompute", recompute_runs)):
            row[f"answer_ms_{name}"] = statistics.median(ms for ms, _, _ in runs)
            ttfts = [t for _, t, _ in runs if t is not None]
            row[f"ttft_ms_{name}"] = statistics.median(ttfts) if ttfts else None
            row[f"answer_{name}"] = tokenizer.decode(runs[0][2])
        row["answer_tokens"] = [len(session_runs[0][2]), len(recompute_runs[0][2])]
        row["same_answer"] = session_runs[0][2] == recompute_runs[0][2]
        row["answer_ratio"] = row["answer_ms_recompute"] / row["answer_ms_session"]
        row["ttft_ratio"] = (
            row["ttft_ms_recompute"] / row["ttft_ms_session"]
            if row["ttft_ms_session"] and row["ttft_ms_recompute"]
            else None
        )
        rows.append(row)
        print(
            f"  {n:5d} frames ({time.perf_counter() - started:6.0f} s): append {row['append_ms_session']:.2f} ms "
            f"vs recompute {row['append_ms_recompute']:.1f} ms; answer {row['answer_ms_session']:.1f} ms vs "
            f"{row['answer_ms_recompute']:.1f} ms ({row['answer_ratio']:.1f}x); {row['kept_frames']} frames, "
            f"{len(kept)} tokens kept, {row['blocks']} blocks, RSS {row['rss_mib']:.0f} MiB",
            flush=True,
        )
        results = summarize(args, policy, engine, per_frame, memory, rows, prompt_mode, repeats_seen)
        results["config"]["baseline_pool_blocks"] = blocks
        results["timing"] = {"baseline_warmup_ms": warm_ms, "open_stream_ms": open_ms, "first_ask_ms": warm_ask_ms}
        path.write_text(json.dumps(results, indent=1))
    final_stats = session.stats()
    session.close()

    results["session_stats_at_end"] = final_stats
    path.write_text(json.dumps(results, indent=1))
    print()
    print(markdown_table(rows))
    print()
    print(
        "append ms session: median over the appends since the previous row; recompute: prefill of "
        f"kept_token_ids() from scratch (max_tokens=1); answers: {args.max_tokens} tokens (ignore_eos, greedy), "
        f"median of {args.repeats}; ratio = answer ms recompute / answer ms session; recompute prompt: {prompt_mode}"
    )
    same = sum(r["same_answer"] for r in rows)
    print(f"identical answers (session vs recompute): {same} of {len(rows)} sample points")
    report_targets(results)
    for written in plot(results, args.out, args.tag):
        print(f"wrote {written}")
    print(f"wrote {path}")


def summarize(args, policy, engine, per_frame, memory, rows, prompt_mode, repeats_seen) -> dict:
    evicted = per_frame["evicted_frames"]
    first_evicting = next((i + 1 for i, e in enumerate(evicted) if e), None)
    ranges = decile_ranges(args.frames, first_evicting) if first_evicting else None
    latency = list(enumerate(per_frame["append_ms"], start=1))
    flat = {
        "definition": (
            "first 10% = the frames/10 appends from the first append that evicted a frame (the window's first "
            "fill is a warm-up and left out); last 10% = the last frames/10 appends; append latency: median "
            "of each; KV blocks and RSS: peak of the samples (every --memory-every frames) in each; "
            "within 1.2x: last / first <= 1.2, unrounded"
        ),
        "first_evicting_append": first_evicting,
        "ranges": ranges,
        "append_latency": flatness(latency, ranges, statistics.median),
        "kv_blocks": flatness([(m["frames"], m["blocks"]) for m in memory], ranges, max),
        "rss": flatness([(m["frames"], m["rss_mib"]) for m in memory], ranges, max),
    }
    if first_evicting is None:
        flat["append_latency"] = flat["kv_blocks"] = flat["rss"] = {"ok": None, "why": "no append evicted a frame"}
    last = rows[-1] if rows else None
    answer_target = {
        "definition": "answer latency (whole answer) at 5,000 frames: recompute / session >= 20",
        "frames": last["frames"] if last else None,
        "ratio": last["answer_ratio"] if last else None,
        "ttft_ratio": last["ttft_ratio"] if last else None,
        "ok": (last["answer_ratio"] >= 20) if last else None,
        "at_spec_length": bool(last and last["frames"] >= 5000),
    }
    kept = [k for k in per_frame["kept_frames"][(first_evicting or len(evicted) + 1) - 1 :] if k is not None]
    return {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "policy": policy,
            "device": str(engine.device),
            "block_size": engine.block_size,
            "session_pool_blocks": engine.num_blocks,
            "kv_mib_per_block": engine.kv_bytes_per_token * engine.block_size / 2**20,
            "model_path": str(engine.model_path),
            "system": SYSTEM,
            "questions": QUESTIONS,
        },
        "recompute_prompt": prompt_mode,
        "frames_marked_repeat": repeats_seen,
        "kept_frames_after_fill": [min(kept), max(kept)] if kept else None,
        "rows": rows,
        "flatness": flat,
        "answer_target": answer_target,
        "memory": memory,
        "per_frame": {k: [round(v, 4) if isinstance(v, float) else v for v in vs] for k, vs in per_frame.items()},
    }


def report_targets(results: dict) -> None:
    flat, answer = results["flatness"], results["answer_target"]
    print(f"\nflatness: {flat['definition']}")
    if flat["first_evicting_append"]:
        print(f"  the window first evicted at append {flat['first_evicting_append']}")
    for key, label, unit in (
        ("append_latency", "append latency (median)", "ms"),
        ("kv_blocks", "KV blocks (peak)", "blocks"),
        ("rss", "RSS (peak)", "MiB"),
    ):
        f = flat[key]
        if f["ok"] is None:
            print(f"  {label:24s} n/a: {f['why']}")
            continue
        print(
            f"  {label:24s} first 10% (appends {f['first_range'][0]}-{f['first_range'][1]}) {f['first']:.4g} {unit}, "
            f"last 10% (appends {f['last_range'][0]}-{f['last_range'][1]}) {f['last']:.4g} {unit}: "
            f"{f['ratio']:.4f}x (limit 1.2x) {verdict(f['ok'])}"
        )
    if answer["ok"] is None:
        print("  answer latency            n/a: no sample point")
    else:
        note = "" if answer["at_spec_length"] else f" (at {answer['frames']} frames, not the spec's 5,000)"
        ttft = "" if answer["ttft_ratio"] is None else f"; first token {answer['ttft_ratio']:.2f}x"
        print(
            f"  answer latency{note}: recompute / session {answer['ratio']:.2f}x (target >= 20x){ttft} "
            f"{verdict(answer['ok'])}"
        )
    config = results["config"]
    pool_mib = config["session_pool_blocks"] * config["kv_mib_per_block"]
    print(
        f"  (RSS counts pool pages once touched: the session's pool is {config['session_pool_blocks']} blocks, "
        f"{pool_mib:.0f} MiB; the baseline's pool and weights are in the same process)"
    )
    kept = results["kept_frames_after_fill"]
    if kept:
        print(f"  kept frames after the first eviction: {kept[0]}-{kept[1]}")


if __name__ == "__main__":
    main()
