"""Documents reused anywhere, served (engine/blend.py): kvbank against itself without blending and
against llama-server with `--cache-reuse`, on the retrieval prompts of bench/blend.py, over HTTP.

Prompts: a system prompt, --per-prompt documents of ~--doc-tokens tokens drawn at random (in
random order) from a pool of --documents windows of the corpus, and a question; greedy answers of
--answer-tokens tokens (ignore_eos). Every server starts cold for each run; the systems alternate,
their order flipping every run, and each number is the median over --runs runs.

- `ttft`: one client. A warm-up pass sends prompts that hold every document of the pool once (in
  pool order), then --prompts fresh prompts are timed one at a time: the time to the first
  streamed token. kvbank blends (segments, ratio --ratio); kvbank-plain sends the same texts
  unmarked (its own full prefill, the system prompt a prefix-cache hit); llama-server gets the
  texts with `--cache-reuse 256` (its reuse of chunks that recur in one slot, shifted, not
  recomputed) in each of --peer-configs, and the best is reported.
- `clients`: --clients concurrent clients, each sending --per-client fresh prompts back to back
  after the same warm-up pass: output tok/s over the phase, TTFT p50/p99, inter-token p50/p99.
  llama-server runs with one slot per client.
- `replicas`: two kvbank servers sharing a real redis-server tier: a prompt's documents are
  computed on A (cold), a reordered prompt is timed on A (warm), then another order on B, which
  has never seen them (its documents come from Redis). B's TTFT over A's warm TTFT, median of
  --prompts prompt sets.

    python bench/blend_serve.py --llama-server ~/llama.cpp/build/bin/llama-server --runs 3 \
        --json bench/results/blend_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from blend import QUESTIONS, SYSTEM, machine  # noqa: E402
from serve_compare import free_port, stop, wait_ready  # noqa: E402

from kvbank.models.gguf_file import GGUFFile  # noqa: E402
from kvbank.models.loader import bundled_model_path  # noqa: E402
from kvbank.tokenizer import Tokenizer  # noqa: E402

#: llama-server configurations tried with --cache-reuse 256 (see bench/serve_compare.py on repacking)
PEER_CONFIGS = {"no-repack": ["--no-repack"], "no-repack+fa": ["--no-repack", "-fa", "on"]}


def document_texts(path: Path, count: int, length: int) -> list[str]:
    """`count` windows of `length` tokens of the corpus, as text."""
    tokenizer = Tokenizer.from_gguf(GGUFFile(bundled_model_path()))
    ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
    stride = max(length, (len(ids) - length) // count)
    return [tokenizer.decode(ids[i * stride : i * stride + length]) for i in range(count)]


def body(system: str, docs: list[str], question: str, args) -> dict:
    out = {"max_tokens": args.answer_tokens, "temperature": 0, "ignore_eos": True}
    if system == "kvbank":
        return {**out, "prompt": "", "segments": [SYSTEM, *({"document": d} for d in docs), question]}
    return {**out, "prompt": SYSTEM + "".join(docs) + question}


def complete(url: str, payload: dict) -> dict:
    """One streamed completion: TTFT, the times between chunks, tokens generated (the usage the
    server reports, else the chunks)."""
    data = json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    stamps, usage = [], None
    with urllib.request.urlopen(request, timeout=1800) as reply:
        for line in reply:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices"):  # a token's text may be empty (a special token, bytes held back)
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url}: no tokens came back")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"ttft": stamps[0] - start, "gaps": gaps, "tokens": tokens, "end": stamps[-1]}


def start_server(system: str, args, clients: int, extra: list[str], log: Path):
    port = free_port()
    if system.startswith("kvbank"):
        command = [sys.executable, "-m", "kvbank", "serve", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--kv-cache-memory-gb", str(args.kv_gb), "--blend-recompute-ratio", str(args.ratio), *extra]
    else:
        command = [args.llama_server, "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(clients)]
        command += ["-c", str(args.slot_context * clients), "--no-webui", "--cache-reuse", "256", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    return process, url


def warm_up(url: str, system: str, pool: list[str], args) -> None:
    """Prompts that hold every document of the pool once, in pool order."""
    for i in range(0, len(pool), args.per_prompt):
        complete(url, {**body(system, pool[i : i + args.per_prompt], QUESTIONS[0], args), "max_tokens": 1})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ttft_run(system: str, extra: list[str], pool, sets, args, log: Path) -> float:
    process, url = start_server(system, args, 1, extra, log)
    try:
        warm_up(url, system, pool, args)
        ttfts = [
            complete(url, {**body(system, docs, QUESTIONS[i % 4], args), "max_tokens": 1})["ttft"]
            for i, docs in enumerate(sets)
        ]
    finally:
        stop(process)
    return statistics.median(ttfts)


def clients_run(system: str, extra: list[str], pool, sets, args, log: Path) -> dict:
    process, url = start_server(system, args, args.clients, extra, log)
    results: list[dict] = []
    errors: list[str] = []
    try:
        warm_up(url, system, pool, args)

        def client(k: int) -> None:
            for j in range(args.per_client):
                docs = sets[(k * args.per_client + j) % len(sets)]
                try:
                    results.append(complete(url, body(system, docs, QUESTIONS[(k + j) % 4], args)))
                except Exception as error:  # counted and reported, never hidden
                    errors.append(repr(error))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = max(r["end"] for r in results) - started
    finally:
        stop(process)
    ttfts, gaps = [r["ttft"] for r in results], [g for r in results for g in r["gaps"]]
    return {
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        "itl_p50_ms": 1000 * percentile(gaps, 0.5),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "requests": len(results),
        "errors": errors,
    }


def replicas_run(pool, sets, args, folder: Path) -> dict:
    redis_port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=(folder / "redis.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    tier = ["--kv-redis-url", f"redis://127.0.0.1:{redis_port}/0", "--kv-tier-key", "blend-bench-key-0123456789abcdef"]
    servers = []
    try:
        servers = [start_server("kvbank", args, 1, tier, folder / f"replica-{name}.log") for name in "ab"]
        (_, a), (_, b) = servers
        warm_a, on_b = [], []
        for i, docs in enumerate(sets):
            question = QUESTIONS[i % 4]
            complete(a, {**body("kvbank", docs, question, args), "max_tokens": 1})  # computed on A, sent to Redis
            time.sleep(args.settle)  # the tier's writer thread stores them
            order = docs[1:] + docs[:1]
            warm_a.append(complete(a, {**body("kvbank", order, question, args), "max_tokens": 1})["ttft"])
            order = docs[2:] + docs[:2]
            on_b.append(complete(b, {**body("kvbank", order, question, args), "max_tokens": 1})["ttft"])
        stats = urllib.request.urlopen(f"{b}/metrics", timeout=30).read().decode()
    finally:
        for process, _ in servers:
            stop(process)
        redis.terminate()
        redis.wait(timeout=30)
    metric = "kvbank:blend_documents_computed_total"
    computed_b = next(float(line.split()[1]) for line in stats.splitlines() if line.startswith(metric))
    return {
        "a_warm_ms": 1000 * statistics.median(warm_a),
        "b_ms": 1000 * statistics.median(on_b),
        "b_over_a_warm": statistics.median(on_b) / statistics.median(warm_a),
        "documents_computed_on_b": computed_b,
        "raw": {"a_warm": warm_a, "b": on_b},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (left out: kvbank only)")
    parser.add_argument("--model", type=Path, default=None, help="GGUF for llama-server (default: the bundled model)")
    parser.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "data" / "austen_all.txt")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--per-prompt", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts timed one at a time")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slot-context", type=int, default=5120, help="llama-server context per slot")
    parser.add_argument("--kv-gb", type=float, default=3.0, help="kvbank's --kv-cache-memory-gb")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds for A's tier writes (replicas)")
    parser.add_argument("--phases", nargs="+", default=["ttft", "clients", "replicas"])
    parser.add_argument("--peer-configs", nargs="+", default=list(PEER_CONFIGS), choices=list(PEER_CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.model = args.model or bundled_model_path()
    corpus = args.corpus if args.corpus.is_file() else ROOT / "tests" / "data" / "austen_excerpt.txt"
    pool = document_texts(corpus, args.documents, args.doc_tokens)
    rng = random.Random(args.seed)
    sets = [rng.sample(pool, args.per_prompt) for _ in range(max(args.prompts, args.clients * args.per_client))]
    systems = {"kvbank": [], "kvbank-plain": []}
    if args.llama_server:
        systems |= {f"llama-server/{name}": extra for name, extra in PEER_CONFIGS.items() if name in args.peer_configs}
    folder = Path(tempfile.mkdtemp(prefix="blend_serve_"))
    result: dict = {
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "config": vars(args) | {"model": str(args.model), "corpus": corpus.name, "json": None},
    }
    for phase in ("ttft", "clients"):
        if phase not in args.phases:
            continue
        runs: dict[str, list] = {name: [] for name in systems}
        for run in range(args.runs):
            order = list(systems) if run % 2 == 0 else list(reversed(systems))
            for name in order:
                log = folder / f"{phase}-{name.replace('/', '-')}-{run}.log"
                if phase == "ttft":
                    value = ttft_run(name, systems[name], pool, sets[: args.prompts], args, log)
                else:
                    value = clients_run(name, systems[name], pool, sets, args, log)
                runs[name].append(value)
                print(phase, run, name, value if phase == "ttft" else {k: v for k, v in value.items() if k != "errors"})
        if phase == "ttft":
            medians = {name: 1000 * statistics.median(values) for name, values in runs.items()}
            peers = {n: v for n, v in medians.items() if n.startswith("llama")}
            best = min(peers, key=peers.get) if peers else None
            result["ttft"] = {
                "median_ms": medians,
                "speedup_vs_plain": medians["kvbank-plain"] / medians["kvbank"],
                "best_peer": best,
                "speedup_vs_best_peer": peers[best] / medians["kvbank"] if best else None,
                "raw_s": runs,
            }
        else:
            keys = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
            medians = {n: {k: statistics.median(v[k] for v in values) for k in keys} for n, values in runs.items()}
            peers = {n: v for n, v in medians.items() if n.startswith("llama")}
            best = max(peers, key=lambda n: peers[n]["output_tokens_per_s"]) if peers else None
            result["clients"] = {
                "median": medians,
                "throughput_vs_best_peer": medians["kvbank"]["output_tokens_per_s"] / peers[best]["output_tokens_per_s"]
                if best
                else None,
                "best_peer": best,
                "ttft_p99_vs_plain": medians["kvbank"]["ttft_p99_ms"] / medians["kvbank-plain"]["ttft_p99_ms"],
                "raw": runs,
            }
        print(json.dumps({k: v for k, v in result[phase].items() if not k.startswith("raw")}, indent=1))
    if "replicas" in args.phases:
        if shutil.which("redis-server") is None:
            sys.exit("blend_serve: the replicas phase needs redis-server on PATH")
        result["replicas"] = [replicas_run(pool, sets[: args.prompts], args, folder) for _ in range(args.runs)]
        ratios = [r["b_over_a_warm"] for r in result["replicas"]]
        result["replicas_median_b_over_a_warm"] = statistics.median(ratios)
        print("replicas", [{k: v for k, v in r.items() if k != "raw"} for r in result["replicas"]])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
