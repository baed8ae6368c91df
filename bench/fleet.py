"""A fleet of kvbank replicas behind sglang-router, sharing one Redis tier, against one server.

Workload: --users users in multi-turn chats over --docs shared documents of about --doc-tokens
tokens each (public-domain text from /work/shared/data, cut by the bundled model's tokenizer).
User u reads document u % docs: its system message is the document, and it asks --turns
questions about it, each turn carrying the conversation so far; replies end at EOS or at
--max-tokens (greedy). Users arrive --arrival-gap seconds apart and run at once from then on.
Requests stream, so TTFT is the first content chunk as the client sees it.

Configurations (every request goes through a real router, the single server too, so each pays
the same hop):

- `single`: one replica with --single-threads (2) threads;
- `round_robin`, `cache_aware`: two replicas with --replica-threads (1) thread each;
- `cache_aware+redis`, `round_robin+redis`: the same with one shared `redis-server` tier
  (`kvbank serve --kv-redis-url`), so a prefix one replica computed is loaded by the other;
- `cache_aware+redis+kill` (--kill-at-half): as `cache_aware+redis`, and once half of the
  requests have been sent the busier replica gets SIGKILL. Counted: failed requests, split into
  streams the kill cut mid-reply (no router can resend half a stream) and requests sent after the
  kill (the router retries one it could not deliver, --router-retries, and its health check drops
  the dead replica), and the TTFT p99 of requests sent in the --after-kill-s seconds after it.

First (unless --skip-calibration) one replica alone measures its prefill tok/s (a cold
document) and decode tok/s (a batch of --users / 2 replies of --max-tokens tokens), which
bench/fleet_sim.py reads. Every run starts each configuration cold: new replicas (warmed by one
short request each, which caches nothing), a new router and a new, empty redis-server.
Configurations alternate and their order flips every run; the table shows medians over --runs
runs. Per configuration: prefix hit rate as the share of prompt tokens the replicas reported as
cached (`usage.prompt_tokens_details.cached_tokens`) and from /metrics (prefix-cache hits over
queries, summed over the replicas; the Redis share is `kv_offload_load_tokens_total` over the
same queries: tokens loaded from the tier instead of computed), TTFT p50/p99, output tok/s over
the run's wall time, failed requests. TTFT p99 covers the cold start (each document's first
prefill); "p99 t>1" is the p99 of later turns only, where routing decides whether the
conversation's prefix is at hand. Targets: `cache_aware+redis` keeps >= 90% of the single
server's hit rate, and its TTFT p99 is <= 0.5 of `round_robin`'s (no Redis); the kill costs no
request that had not received its first token, and every reply it cuts ends at the client with an
error event within 5 s (counted: replies cut after their first token, those ending with an error
event, those ending within 5 s of the kill).

    python bench/fleet.py --quick                     # ~3 minutes on 2 cores, a smoke run
    python bench/fleet.py --kill-at-half              # the default sizes, 3 runs
    python bench/fleet.py --users 32 --docs 8 --turns 4 --runs 5 --kill-at-half

Needs `redis-server` on PATH and sglang-router (`pip install -e .[fleet]`). Results go to
bench/results/fleet.json; server, router and Redis logs stay in a temporary folder (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

print = functools.partial(print, flush=True)  # noqa: A001 -- progress lines appear as runs finish
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from serve_load import Result, make_client, parse_prometheus, percentile, scrape, stream_chat  # noqa: E402
from serving import free_port, start_server, stop_server, wait_healthy  # noqa: E402

DATA = Path(os.environ.get("KVBANK_DATA", ROOT.parent / "shared" / "data"))
CORPORA = ("austen_all.txt", "web_bible.txt")
DOC_STRIDE_CHARS = 250_000  # documents from one corpus start this far apart
SYSTEM_INTRO = "You are a careful reading assistant. Answer the user's questions about this document.\n\n"
QUESTIONS = [
    "Who are the main people in this document, and how are they related?",
    "Summarise the document in three sentences.",
    "What is the most surprising thing that happens here?",
    "Which person would you trust most, and why?",
    "What does the narrator seem to think about the events?",
    "Describe the mood of the opening lines.",
    "What might happen after the end of this document?",
    "Quote one sentence you find important and explain it.",
]
CONFIGS = {
    "single": {"replicas": 1, "redis": False, "policy": "round_robin", "kill": False},
    "round_robin": {"replicas": 2, "redis": False, "policy": "round_robin", "kill": False},
    "cache_aware": {"replicas": 2, "redis": False, "policy": "cache_aware", "kill": False},
    "cache_aware+redis": {"replicas": 2, "redis": True, "policy": "cache_aware", "kill": False},
    "round_robin+redis": {"replicas": 2, "redis": True, "policy": "round_robin", "kill": False},
}
KILL_CONFIG = "cache_aware+redis+kill"
CONFIGS_WITH_KILL = {**CONFIGS, KILL_CONFIG: {**CONFIGS["cache_aware+redis"], "kill": True}}
QUICK = {"users": 8, "docs": 2, "doc_tokens": 1000, "turns": 3, "max_tokens": 16, "runs": 1, "arrival_gap": 0.25}
#: (name, lowest, highest) of the size options
BOUNDS = (
    ("users", 1, 1024),
    ("docs", 1, 32),
    ("doc_tokens", 16, 6000),
    ("turns", 1, 64),
    ("max_tokens", 1, 4096),
    ("runs", 1, 100),
)
STARTUP_TIMEOUT_S = 120
JSON_HEADERS = {"Content-Type": "application/json"}


# --- workload ------------------------------------------------------------------------------------


def build_docs(count: int, tokens: int) -> list[str]:
    """`count` documents of `tokens` tokens of the bundled tokenizer, alternating between the corpora."""
    from kvbank.models.gguf_file import GGUFFile
    from kvbank.models.loader import bundled_model_path
    from kvbank.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(bundled_model_path()))
    texts = {}
    for name in CORPORA:
        path = DATA / name
        if not path.is_file():
            sys.exit(f"fleet: corpus {path} is missing (set KVBANK_DATA to the folder holding {', '.join(CORPORA)})")
        texts[name] = path.read_text(errors="replace")
    docs = []
    for i in range(count):
        text = texts[CORPORA[i % len(CORPORA)]]
        start = (1 + i // len(CORPORA)) * DOC_STRIDE_CHARS
        window = text[start : start + tokens * 8]
        ids = tokenizer.encode(window, add_special_tokens=False)
        if len(ids) < tokens or start + tokens * 8 > len(text):
            sys.exit(f"fleet: document {i} needs {tokens} tokens past character {start} of {CORPORA[i % 2]}")
        docs.append(tokenizer.decode(ids[:tokens]))
    return docs


def question(user: int, turn: int) -> str:
    return QUESTIONS[(user * 3 + turn) % len(QUESTIONS)]


# --- processes -----------------------------------------------------------------------------------


@dataclass
class Fleet:
    """What one configuration's run started: replicas, router, maybe Redis; stopped by `stop`."""

    replicas: list[tuple[subprocess.Popen, str]] = field(default_factory=list)
    router: subprocess.Popen | None = None
    router_url: str = ""
    redis: subprocess.Popen | None = None
    redis_url: str | None = None
    killed: int | None = None

    def stop(self) -> None:
        if self.router is not None:
            _stop(self.router)
        for process, _ in self.replicas:  # all drain at once
            if process.poll() is None:
                process.terminate()
        for process, _ in self.replicas:
            _wait_or_kill(process)
        if self.redis is not None:
            _stop(self.redis)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    _wait_or_kill(process)


def _wait_or_kill(process: subprocess.Popen, timeout: float = 30) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    """An empty redis-server (no persistence) on a free loopback port, answering PING."""
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(10):
        port = free_port()
        command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory)]
        command += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        with open(directory / "redis.log", "a") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                return process, f"redis://127.0.0.1:{port}"
            time.sleep(0.05)
        _stop(process)  # another listener took the port first: try another
    sys.exit(f"fleet: redis-server did not start; see {directory / 'redis.log'}")


def start_router(urls: list[str], policy: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    """sglang-router in front of `urls`, returned once it reports every worker healthy."""
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn"]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    # Retries back off 0.1, 0.2, 0.4, 0.8, then 1 s: together longer than a health-check interval,
    # so a request sent to a replica that just died is still being retried when the check drops it.
    command += ["--retry-max-retries", str(args.router_retries), "--retry-initial-backoff-ms", "100"]
    command += ["--retry-backoff-multiplier", "2", "--retry-max-backoff-ms", "1000"]
    # A replica answers /health late while a long prefill step holds the GIL (seconds on one thread):
    # with the router's 5 s default one slow answer would take a busy, healthy replica out of
    # rotation. A dead one refuses the connection at once, so a long timeout does not hide it.
    command += ["--health-check-interval-secs", str(args.health_interval)]
    command += ["--health-check-timeout-secs", str(args.health_timeout)]
    command += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"fleet: the router exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/readiness", timeout=2) as reply:
                if json.loads(reply.read()).get("healthy_workers") == len(urls):
                    return process, url
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    _stop(process)
    sys.exit(f"fleet: the router did not report {len(urls)} healthy workers in {STARTUP_TIMEOUT_S} s: {log}")


def start_fleet(name: str, spec: dict, args, logs: Path) -> Fleet:
    fleet = Fleet()
    try:
        if spec["redis"]:
            fleet.redis, fleet.redis_url = start_redis(logs / f"{name}_redis")
        threads = args.single_threads if spec["replicas"] == 1 else args.replica_threads
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        serve_args = ["--log-level", "warning", *args.serve_args]
        if fleet.redis_url:
            serve_args += ["--kv-redis-url", fleet.redis_url]
        paths = [logs / f"{name}_replica{i}.log" for i in range(spec["replicas"])]
        for path in paths:  # all load the model at once
            fleet.replicas.append(start_server(serve_args, env, path))
        for (process, url), path in zip(fleet.replicas, paths, strict=True):
            wait_healthy(process, url, path)
            warm_up(url)
        fleet.router, fleet.router_url = start_router(
            [url for _, url in fleet.replicas], spec["policy"], args, logs / f"{name}_router.log"
        )
    except BaseException:
        fleet.stop()
        raise
    return fleet


def warm_up(url: str) -> None:
    """One short completion straight to a replica: first-request costs paid, no prefix cached."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
        return json.loads(reply.read())["data"][0]["id"]


# --- calibration: one replica's rates, for bench/fleet_sim.py ------------------------------------


def calibrate(args, docs: list[str], logs: Path) -> dict:
    """Prefill tok/s (a cold document, max_tokens 1) and decode tok/s (a batch of short prompts,
    every reply --max-tokens long) of one replica with --replica-threads threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.replica_threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = logs / "calibration_replica.log"
    process, url = start_server(["--log-level", "warning", *args.serve_args], env, log)
    try:
        wait_healthy(process, url, log)
        warm_up(url)
        prefill = []
        for doc in docs[:2]:
            start = time.perf_counter()
            reply = complete(url, {"prompt": doc, "max_tokens": 1, "temperature": 0})
            prefill.append(reply["usage"]["prompt_tokens"] / (time.perf_counter() - start))
        batch = max(1, args.users // 2)
        bodies = [
            {"prompt": f"{i}. {question(i, 0)}", "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
            for i in range(batch)
        ]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            replies = list(pool.map(lambda body: complete(url, body), bodies))
        seconds = time.perf_counter() - start
        decoded = sum(r["usage"]["completion_tokens"] for r in replies)
    finally:
        stop_server(process)
    return {
        "threads": args.replica_threads,
        "prefill_tok_s": statistics.median(prefill),
        "prefill_prompt_tokens": args.doc_tokens,
        "decode_tok_s": decoded / seconds,
        "decode_batch": batch,
        "note": "decode_tok_s includes the batch's short prefills; a larger batch decodes faster",
    }


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), JSON_HEADERS)
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


# --- one run of one configuration ----------------------------------------------------------------


@dataclass
class Turn:
    user: int
    turn: int
    result: Result


class Load:
    """The users of one run: their turns, and (with a kill) when and which replica died."""

    def __init__(self, args, fleet: Fleet, model: str, docs: list[str], kill: bool) -> None:
        self.args, self.fleet, self.model, self.docs, self.kill = args, fleet, model, docs, kill
        self.turns: list[Turn] = []
        self.half = max(1, args.users * args.turns // 2)
        self.started = 0
        self.half_sent = asyncio.Event()
        self.kill_at: float | None = None
        self.client_args = types.SimpleNamespace(
            api_key=None, request_timeout=args.request_timeout, base_url=fleet.router_url
        )

    async def user(self, index: int) -> None:
        await asyncio.sleep(index * self.args.arrival_gap)
        doc = self.docs[index % len(self.docs)]
        messages = [{"role": "system", "content": SYSTEM_INTRO + doc}]
        url = self.fleet.router_url + "/v1/chat/completions"
        async with make_client(self.client_args, connections=1) as http:
            for turn in range(self.args.turns):
                messages.append({"role": "user", "content": question(index, turn)})
                body = {
                    "model": self.model,
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": self.args.max_tokens,
                    "temperature": 0,
                    "seed": self.args.seed,
                }
                self.started += 1
                if self.started > self.half:  # half of all requests went out before this one
                    self.half_sent.set()
                result = await stream_chat(http, url, body)
                self.turns.append(Turn(index, turn, result))
                if result.ok:
                    messages.append({"role": "assistant", "content": result.text})
                else:
                    messages.pop()  # the user asks the next question instead
                if self.args.think_time:
                    await asyncio.sleep(self.args.think_time)

    async def killer(self) -> None:
        await self.half_sent.wait()
        victim = await busiest(self.fleet)
        process = self.fleet.replicas[victim][0]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        self.kill_at = time.perf_counter()
        self.fleet.killed = victim


async def busiest(fleet: Fleet) -> int:
    """The replica with the most requests running or waiting now (the first on a tie or no /metrics)."""
    loads = []
    async with make_client(types.SimpleNamespace(api_key=None, request_timeout=10, base_url="http://x"), 2) as http:
        for _, url in fleet.replicas:
            metrics = await scrape(http, f"{url}/metrics") or {}
            running = metrics.get("kvbank:num_requests_running", 0) + metrics.get("kvbank:num_requests_waiting", 0)
            loads.append(running)
    return max(range(len(loads)), key=lambda i: (loads[i], -i))


def scrape_all(fleet: Fleet) -> list[dict | None]:
    """Each replica's /metrics (None for a dead one)."""
    pages = []
    for process, url in fleet.replicas:
        if process.poll() is not None:
            pages.append(None)
            continue
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
                pages.append(parse_prometheus(reply.read().decode()))
        except OSError:
            pages.append(None)
    return pages


def metric_delta(before: list[dict | None], after: list[dict | None], name: str) -> float | None:
    """`name` summed over the replicas that answered both times (None when none did)."""
    pairs = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and a is not None]
    if not pairs:
        return None
    return sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in pairs)


def run_one(name: str, spec: dict, args, docs: list[str], logs: Path) -> dict:
    fleet = start_fleet(name, spec, args, logs)
    try:
        model = model_name(fleet.replicas[0][1])
        before = scrape_all(fleet)
        load = Load(args, fleet, model, docs, spec["kill"])

        async def drive() -> float:
            start = time.perf_counter()
            tasks = [load.user(i) for i in range(args.users)]
            if spec["kill"]:
                tasks.append(load.killer())
            await asyncio.gather(*tasks)
            return start

        start = asyncio.run(drive())
        seconds = time.perf_counter() - start
        after = scrape_all(fleet)
    finally:
        fleet.stop()
    return summarize(load, fleet, start, seconds, before, after)


def summarize(load: Load, fleet: Fleet, start: float, seconds: float, before: list, after: list) -> dict:
    results = [t.result for t in load.turns]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok if r.prompt_tokens)
    queries = metric_delta(before, after, "kvbank:prefix_cache_queries_total")
    hits = metric_delta(before, after, "kvbank:prefix_cache_hits_total")
    tier_tokens = metric_delta(before, after, "kvbank:kv_offload_load_tokens_total")
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "seconds": seconds,
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "failed_by_kind": errors,
        "error_samples": [f"{r.error}: {r.detail}" for r in results if not r.ok][:5],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "metrics_hit_rate": hits / queries if queries else None,
        "tier_hit_share": tier_tokens / queries if queries and tier_tokens is not None else None,
        "redis_entry_hits": metric_delta(before, after, "kvbank:kv_tier_hits_total") if fleet.redis else None,
        "redis_entry_misses": metric_delta(before, after, "kvbank:kv_tier_misses_total") if fleet.redis else None,
        # finished requests per replica (None: dead at the end): how the router spread the load
        "requests_per_replica": [
            None
            if b is None or a is None
            else a.get("kvbank:request_success_total", 0) - b.get("kvbank:request_success_total", 0)
            for b, a in zip(before, after, strict=True)
        ],
        "metrics_replicas": sum(1 for b, a in zip(before, after, strict=True) if b is not None and a is not None),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        # later turns only: what routing decides once every document has been computed somewhere
        "ttft_p99_later_turns_s": percentile([t.result.ttft for t in load.turns if t.turn and t.result.ok], 99),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds if seconds else 0.0,
        "empty_replies": sum(1 for r in ok if r.content_chunks == 0),
    }
    if load.kill:
        window = load.args.after_kill_s
        kill_at = load.kill_at
        after_kill = [r for r in results if kill_at is not None and kill_at <= r.start < kill_at + window]
        in_flight = [
            r
            for r in results
            if load.kill_at is not None and r.start < load.kill_at and (r.e2e is None or r.start + r.e2e > load.kill_at)
        ]
        summary["kill"] = {
            "killed_replica": fleet.killed,
            "kill_at_s": None if load.kill_at is None else load.kill_at - start,
            "in_flight_at_kill": len(in_flight),
            "failed_in_flight": sum(1 for r in in_flight if not r.ok),
            "requests_after_kill": len(after_kill),
            "failed_after_kill": sum(1 for r in after_kill if not r.ok),
            # failed before their first token: the router could have sent them elsewhere
            "failed_before_first_token": sum(1 for r in results if not r.ok and r.ttft is None),
            # replies the kill cut after their first token: how their client learned it, and how soon
            "cut_after_first_token": len(cut := [r for r in results if not r.ok and r.ttft is not None]),
            "cut_with_error_event": sum(1 for r in cut if r.error == "stream_error"),
            "cut_ended_within_5s": sum(1 for r in cut if kill_at is not None and r.ended - kill_at <= 5.0),
            "cut_slowest_end_s": max((r.ended - kill_at for r in cut if kill_at is not None), default=None),
            "cut_kinds": {kind: sum(1 for r in cut if r.error == kind) for kind in {r.error for r in cut}},
            "ttft_p99_after_kill_s": percentile([r.ttft for r in after_kill if r.ok and r.ttft is not None], 99),
        }
    return summary


# --- report --------------------------------------------------------------------------------------

MEDIAN_KEYS = (
    "hit_rate",
    "metrics_hit_rate",
    "tier_hit_share",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_p99_later_turns_s",
    "output_tokens_per_s",
    "failed",
    "seconds",
)


def median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(samples: list[dict]) -> dict:
    out = {key: median([s[key] for s in samples]) for key in MEDIAN_KEYS}
    kills = [s["kill"] for s in samples if "kill" in s]
    if kills:
        out["kill_failed_max"] = max(s["failed"] for s in samples)
        out["kill_failed_in_flight_max"] = max(k["failed_in_flight"] for k in kills)
        out["kill_failed_after_kill_max"] = max(k["failed_after_kill"] for k in kills)
        out["kill_ttft_p99_after_kill_s"] = median([k["ttft_p99_after_kill_s"] for k in kills])
        out["kill_requests_after_kill"] = median([k["requests_after_kill"] for k in kills])
        for key in ("failed_before_first_token", "cut_after_first_token", "cut_slowest_end_s"):
            out[f"kill_{key}_max"] = max((k[key] for k in kills if k[key] is not None), default=None)
        for key in ("cut_with_error_event", "cut_ended_within_5s"):
            out[f"kill_{key}_min"] = min(k[key] for k in kills)
    return out


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def print_table(summary: dict) -> None:
    print(
        f"\n{'configuration':24s} {'hit (usage)':>11s} {'hit (/metrics)':>14s} {'from Redis':>10s} "
        f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'p99 t>1':>8s} {'out tok/s':>9s} {'failed':>6s} {'run s':>6s}"
    )
    for name, m in summary.items():
        failed = "-" if m["failed"] is None else f"{m['failed']:.0f}"
        print(
            f"{name:24s} {pct(m['hit_rate']):>11s} {pct(m['metrics_hit_rate']):>14s} "
            f"{pct(m['tier_hit_share']):>10s} {ms(m['ttft_p50_s']):>9s} {ms(m['ttft_p99_s']):>9s} "
            f"{ms(m['ttft_p99_later_turns_s']):>8s} "
            f"{m['output_tokens_per_s'] or 0:9.1f} {failed:>6s} {m['seconds'] or 0:6.1f}"
        )


def targets(summary: dict, after_kill_s: float) -> dict:
    found = {}
    single, shared, plain = summary.get("single"), summary.get("cache_aware+redis"), summary.get("round_robin")
    if single and shared and single["hit_rate"] and shared["hit_rate"] is not None:
        ratio = shared["hit_rate"] / single["hit_rate"]
        found["hit_rate_vs_single"] = {"value": ratio, "target": ">= 0.90", "met": ratio >= 0.9}
    if plain and shared and plain["ttft_p99_s"] and shared["ttft_p99_s"] is not None:
        ratio = shared["ttft_p99_s"] / plain["ttft_p99_s"]
        found["ttft_p99_vs_round_robin"] = {"value": ratio, "target": "<= 0.5", "met": ratio <= 0.5}
    if plain and shared and plain["ttft_p99_later_turns_s"] and shared["ttft_p99_later_turns_s"] is not None:
        ratio = shared["ttft_p99_later_turns_s"] / plain["ttft_p99_later_turns_s"]
        found["ttft_p99_later_turns_vs_round_robin"] = {"value": ratio, "target": "<= 0.333", "met": ratio <= 1 / 3}
    kill = summary.get(KILL_CONFIG)
    if kill:
        failed = kill["kill_failed_max"]
        found["failed_with_kill"] = {
            "value": failed,
            "cut_mid_stream": kill["kill_failed_in_flight_max"],
            "sent_after_kill": kill["kill_failed_after_kill_max"],
            "target": "0",
            "met": failed == 0,
        }
        found["ttft_p99_after_kill_s"] = {"value": kill["kill_ttft_p99_after_kill_s"], "window_s": after_kill_s}
        found["cut_replies"] = {
            "failed_before_first_token": kill["kill_failed_before_first_token_max"],
            "cut": kill["kill_cut_after_first_token_max"],
            "with_error_event": kill["kill_cut_with_error_event_min"],
            "within_5s": kill["kill_cut_ended_within_5s_min"],
            "slowest_end_s": kill["kill_cut_slowest_end_s_max"],
        }
    return found


def print_targets(found: dict) -> None:
    if "hit_rate_vs_single" in found:
        t = found["hit_rate_vs_single"]
        print(f"cache_aware+redis hit rate / single's: {t['value']:.2f} (target >= 0.90): {verdict(t['met'])}")
    if "ttft_p99_vs_round_robin" in found:
        t = found["ttft_p99_vs_round_robin"]
        print(f"cache_aware+redis TTFT p99 / round_robin's: {t['value']:.2f} (target <= 0.5): {verdict(t['met'])}")
    if "ttft_p99_later_turns_vs_round_robin" in found:
        t = found["ttft_p99_later_turns_vs_round_robin"]
        print(
            f"  the same past the cold start (later turns only): {t['value']:.2f} (target <= 0.33): {verdict(t['met'])}"
        )
    if "failed_with_kill" in found:
        t, after = found["failed_with_kill"], found["ttft_p99_after_kill_s"]
        print(
            f"replica killed at half time: {t['value']:.0f} failed request(s) in the worst run (target 0): "
            f"{verdict(t['met'])}; {t['cut_mid_stream']:.0f} stream(s) cut mid-reply, {t['sent_after_kill']:.0f} "
            f"failed of those sent after the kill; TTFT p99 in the {after['window_s']:.0f} s after the kill "
            f"{ms(after['value'])}"
        )
        c = found["cut_replies"]
        print(
            f"  failed before their first token (the router could resend them): {c['failed_before_first_token']:.0f} "
            f"(target 0): {verdict(c['failed_before_first_token'] == 0)}; replies cut after their first token: "
            f"{c['cut']:.0f}, of which ended with an error event {c['with_error_event']:.0f} and within 5 s "
            f"{c['within_5s']:.0f} (slowest {ms(c['slowest_end_s'])} after the kill) (target: all): "
            f"{verdict(c['with_error_event'] == c['cut'] and c['within_5s'] == c['cut'])}"
        )


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one run, the kill included (~3 min)")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--docs", type=int, default=4, help="shared documents; user u reads document u %% docs")
    parser.add_argument("--doc-tokens", type=int, default=2000, help="tokens per document (bundled tokenizer)")
    parser.add_argument("--turns", type=int, default=3, help="questions each user asks")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every reply (else EOS)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--arrival-gap", type=float, default=0.5, help="seconds between two users' first turns")
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds a user waits between turns")
    parser.add_argument(
        "--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="configurations to compare"
    )
    parser.add_argument("--kill-at-half", action="store_true", help=f"add {KILL_CONFIG}")
    parser.add_argument("--after-kill-s", type=float, default=60.0, help="the window after the kill for TTFT p99")
    parser.add_argument("--single-threads", type=int, default=2, help="threads of the single server")
    parser.add_argument("--replica-threads", type=int, default=1, help="threads of each fleet replica")
    parser.add_argument("--router-retries", type=int, default=8, help="the router's --retry-max-retries")
    parser.add_argument("--health-interval", type=int, default=1, help="the router's health-check interval (s)")
    parser.add_argument("--health-timeout", type=int, default=30, help="the router's health-check timeout (s)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument(
        "--skip-calibration", action="store_true", help="skip measuring one replica's prefill and decode tok/s"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-args", nargs=argparse.REMAINDER, default=[], help="more `kvbank serve` options, last on the line"
    )
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "fleet.json"))
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:  # an explicit size beats the preset
                setattr(args, key, value)
        args.kill_at_half = True
    if min(args.router_retries, args.health_interval, args.health_timeout) < 1:
        parser.error(
            f"--router-retries {args.router_retries}, --health-interval {args.health_interval}, "
            f"--health-timeout {args.health_timeout}: each must be >= 1"
        )
    for name, low, high in BOUNDS:
        value = getattr(args, name)
        if not low <= value <= high:
            parser.error(f"--{name.replace('_', '-')} {value} is outside [{low}, {high}]")
    if args.docs > args.users:
        parser.error(f"--docs {args.docs} is more than --users {args.users}: a document nobody reads")
    for name in ("arrival_gap", "think_time"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is negative")
    if args.after_kill_s <= 0:
        parser.error(f"--after-kill-s {args.after_kill_s} must be positive")
    most_threads = (os.cpu_count() or 1) * 4
    for name in ("single_threads", "replica_threads"):
        if not 1 <= getattr(args, name) <= most_threads:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is outside [1, {most_threads}]")
    return args


def check_binaries() -> None:
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    if missing:
        sys.exit(f"fleet: {' and '.join(missing)} not on PATH (Debian: apt-get install redis-server redis-tools)")
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        sys.exit("fleet: sglang-router is not installed (pip install -e '.[fleet]')")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_binaries()
    names = list(args.configs) + ([KILL_CONFIG] if args.kill_at_half else [])
    docs = build_docs(args.docs, args.doc_tokens)
    logs = Path(tempfile.mkdtemp(prefix="fleet_"))
    print(
        f"fleet: {args.users} users x {args.turns} turns over {args.docs} documents of {args.doc_tokens} tokens, "
        f"max_tokens {args.max_tokens}, {args.runs} run(s) of {', '.join(names)}; logs in {logs}"
    )
    report = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "samples": {name: [] for name in names},
    }
    began = time.perf_counter()
    if not args.skip_calibration:
        report["calibration"] = calibrate(args, docs, logs)
        c = report["calibration"]
        print(
            f"  one replica, {c['threads']} thread(s): prefill {c['prefill_tok_s']:.0f} tok/s, "
            f"decode {c['decode_tok_s']:.1f} tok/s at batch {c['decode_batch']}"
        )
    for run in range(args.runs):
        order = names if run % 2 == 0 else names[::-1]
        for name in order:
            sample = run_one(name, CONFIGS_WITH_KILL[name], args, docs, logs)
            sample["run"] = run
            report["samples"][name].append(sample)
            kill = sample.get("kill")
            extra = (
                f", killed replica {kill['killed_replica']} at {kill['kill_at_s']:.1f} s, "
                f"{kill['failed_in_flight']}/{kill['in_flight_at_kill']} in flight failed, TTFT p99 after "
                f"{ms(kill['ttft_p99_after_kill_s'])}"
                if kill and kill["kill_at_s"] is not None
                else ""
            )
            print(
                f"  run {run} {name:24s} hit {pct(sample['hit_rate'])} (/metrics {pct(sample['metrics_hit_rate'])}, "
                f"Redis {pct(sample['tier_hit_share'])}), TTFT p50 {ms(sample['ttft_p50_s'])} p99 "
                f"{ms(sample['ttft_p99_s'])} (later turns {ms(sample['ttft_p99_later_turns_s'])}), "
                f"{sample['output_tokens_per_s']:.1f} out tok/s, "
                f"{sample['failed']}/{sample['requests']} failed, {sample['seconds']:.1f} s, per replica "
                f"{'/'.join('-' if n is None else f'{n:.0f}' for n in sample['requests_per_replica'])}{extra}"
            )
            for line in sample["error_samples"][:2]:
                print(f"      {line[:200]}")
            save(args, report)  # after every sample, so an interrupted run keeps what it measured
    report["summary"] = {name: medians(samples) for name, samples in report["samples"].items()}
    report["targets"] = targets(report["summary"], args.after_kill_s)
    report["seconds"] = time.perf_counter() - began
    print_table(report["summary"])
    print_targets(report["targets"])
    print(f"wrote {save(args, report)} ({report['seconds'] / 60:.1f} min; logs in {logs})")


def save(args, report: dict) -> Path:
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


if __name__ == "__main__":
    main()
