"""Load test of any OpenAI-compatible server: concurrent multi-turn streaming chats.

Each of N clients holds one HTTP connection and runs conversations of --turns turns through
streaming POST /chat/completions. Every conversation opens with the same system prompt (about
--system-prompt-tokens tokens of real text from --corpus); each turn appends the assistant's
streamed reply and a new user message (a fresh window of the corpus), so prompts grow and share
prefixes, within a conversation and across all of them, which is where prefix caching pays.
The workload is a pure function of (client, conversation, turn), so two servers get the same one.

Per client-count level: requests/s, output tok/s (usage.completion_tokens, else content chunks),
TTFT, inter-token latency (gaps between content chunks) and end-to-end latency at p50/p99, errors
(non-200s, exceptions, malformed streams: counted, never fatal) and the prefix-cache hit rate: the
delta of `kvbank:prefix_cache_hits_total / ..._queries_total` (any `ns:` prefix) on GET /metrics,
else the share of prompt tokens reported in usage.prompt_tokens_details.cached_tokens, else n/a.

--soak SECONDS runs the first --clients level without pause, samples /metrics every
--sample-interval s (errors, RSS, KV usage, running/waiting requests), then disconnects the
clients mid-request, waits for the server to drain and checks that no KV blocks leaked
(`kvbank:kv_cache_usage_perc` back to 0) and how much resident memory grew.

    python bench/serve_load.py --base-url http://127.0.0.1:8000/v1 --clients 1 8 32 64 --label kvbank
    python bench/serve_load.py --base-url http://127.0.0.1:8080/v1 --clients 1 8 --conversations 2 \\
        --max-tokens 48 --ignore-eos --label llama.cpp
    python bench/serve_load.py --base-url http://127.0.0.1:8000/v1 --soak 300 --clients 64 --label kvbank-soak

--hostile-share 0.1 (with --soak) mixes hostile requests into the soak (see `Hostile`): compare the
well-formed clients' errors, TTFT p99 and RSS with a soak without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # the venv ships the renamed fork that openai depends on
    import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "tests" / "data" / "austen_excerpt.txt"
QUESTIONS = [
    "Who is the most sensible person in this passage?",
    "Summarise what happens here in two sentences.",
    "What does the narrator think of the people involved?",
    "Which character would you trust, and why?",
    "What might happen next?",
    "Describe the mood of this scene.",
]
SYSTEM_INTRO = (
    "You are a careful literary assistant. Answer questions about passages of a novel. "
    "Here is a longer extract of the novel for background:\n\n"
)
METRIC_NAMES = {
    "hits": "prefix_cache_hits_total",
    "queries": "prefix_cache_queries_total",
    "preemptions": "num_preemptions_total",
    "kv_usage": "kv_cache_usage_perc",
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "rss": "process_resident_memory_bytes",
}
MAX_ERROR_SAMPLES = 8


# --- workload ------------------------------------------------------------------------------------


class Workload:
    """The shared system prompt and the user messages, cut from the corpus by an estimated token count."""

    def __init__(self, corpus: Path, system_tokens: int, user_tokens: int, chars_per_token: float) -> None:
        text = re.sub(r"\s+", " ", corpus.read_text(errors="replace")).strip()
        self.words = text.split(" ")
        self.chars_per_token = chars_per_token
        self.mean_word = sum(len(w) + 1 for w in self.words[:5000]) / max(1, min(5000, len(self.words)))  # + space
        system_words = self._window(0, system_tokens)
        self.system_prompt = SYSTEM_INTRO + " ".join(system_words)
        self.user_start = len(system_words)
        self.user_tokens = user_tokens
        self.user_span = max(1, len(self.words) - self.user_start - self._words_for(user_tokens))

    def _words_for(self, tokens: int) -> int:
        return max(1, round(tokens * self.chars_per_token / self.mean_word))

    def _window(self, start: int, tokens: int) -> list[str]:
        return self.words[start : start + self._words_for(tokens)]

    def user_message(self, client: int, conversation: int, turn: int) -> str:
        serial = (client * 7919 + conversation * 104729 + turn * 15485863) % 2_147_483_647
        offset = self.user_start + (serial * 613) % self.user_span
        passage = " ".join(self._window(offset, self.user_tokens))
        question = QUESTIONS[(client + conversation + turn) % len(QUESTIONS)]
        return f"[c{client}.{conversation}.{turn}] Passage: {passage}\n\n{question}"


# --- one streamed request ------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    start: float
    error: str | None = None
    detail: str = ""
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)
    content_chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    #: when the client saw the request end (a reply, an error, a closed connection or a timeout)
    ended: float | None = None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    """Send one streaming chat request and time it; any failure becomes an error Result."""
    result = Result(ok=False, start=time.perf_counter())
    try:
        return await _stream_chat(client, url, body, result)
    finally:
        result.ended = time.perf_counter()


async def _stream_chat(client: httpx.AsyncClient, url: str, body: dict, result: Result) -> Result:
    start = result.start
    pieces: list[str] = []
    last = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                result.error, result.detail = f"http_{response.status_code}", raw[:300].decode(errors="replace")
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event:/id: fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    result.error, result.detail = "malformed_json", data[:300]
                    return result
                if not isinstance(chunk, dict):
                    result.error, result.detail = "malformed_chunk", data[:300]
                    return result
                if "error" in chunk:
                    result.error, result.detail = "stream_error", json.dumps(chunk["error"])[:300]
                    return result
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    result.completion_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        result.cached_tokens = details["cached_tokens"]
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
                        result.content_chunks += 1
                        pieces.append(content)
    except Exception as error:  # noqa: BLE001 - transport errors, timeouts, odd shapes: counted, never fatal
        result.error, result.detail = type(error).__name__, str(error)[:300]
        return result
    if not done:
        result.error, result.detail = "no_done", "the stream ended without data: [DONE]"
        return result
    result.ok = True
    result.e2e = time.perf_counter() - start
    result.text = "".join(pieces)
    return result


# --- clients -------------------------------------------------------------------------------------


class Run:
    """What all clients of one level (or one soak) share: where to send, what to send, what came back."""

    def __init__(self, args, model: str, workload: Workload, stop_at: float | None, endless: bool = False) -> None:
        self.args, self.model, self.workload, self.stop_at, self.endless = args, model, workload, stop_at, endless
        self.url = args.base_url + "/chat/completions"
        self.results: list[Result] = []
        self.errors: dict[str, int] = {}
        self.error_samples: list[str] = []
        self.cancelled = 0
        self.stopping = False

    def expired(self) -> bool:
        return self.stopping or (self.stop_at is not None and time.perf_counter() >= self.stop_at)

    def body(self, messages: list[dict]) -> dict:
        args = self.args
        body = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        return body

    def record(self, result: Result) -> None:
        self.results.append(result)
        if not result.ok:
            self.errors[result.error] = self.errors.get(result.error, 0) + 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{result.error}: {result.detail}")

    async def client(self, index: int) -> None:
        async with make_client(self.args, connections=1) as http:
            conversation = 0
            while not self.expired() and (
                self.endless or self.stop_at is not None or conversation < self.args.conversations
            ):
                await self.conversation(http, index, conversation)
                conversation += 1

    async def conversation(self, http: httpx.AsyncClient, index: int, number: int) -> None:
        messages = [{"role": "system", "content": self.workload.system_prompt}]
        for turn in range(self.args.turns):
            if self.expired():
                return
            messages.append({"role": "user", "content": self.workload.user_message(index, number, turn)})
            try:
                result = await stream_chat(http, self.url, self.body(messages))
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            self.record(result)
            if not result.ok:
                await asyncio.sleep(self.args.error_backoff)  # never spin on a dead server
                return
            messages.append({"role": "assistant", "content": result.text})


class Hostile:
    """Requests a well-formed client never sends, mixed into a soak at `share` of all requests: an
    oversized body, max_tokens of 10^9 under an evicting policy, 400,000 stop_token_ids, an 8 MB text
    prompt, stream churn (open, a frame, close), frames longer than half the context on a one-frame
    window (`--hostile-frame-tokens`), a flood of streams under fresh salts, lone surrogates in a
    prompt and in a stream's system prompt, and half-open connections (request headers never
    finished) while /health is asked. kvbank answers each with a 4xx, or 200 / 429 / 503 where the
    server's limits or the pool's room decide (the churn, the frames, the flood, /health); what counts
    is that none is a 5xx or a dropped connection, and that the well-formed clients do not notice.
    Other servers may treat them differently: this is a kvbank soak."""

    KINDS = (
        "oversized_body",
        "huge_max_tokens",
        "stop_token_flood",
        "huge_text",
        "stream_churn",
        "long_frames",
        "stream_flood",
        "surrogates",
        "half_open",
    )
    #: streams one flood opens, each under a salt of its own (a salt is free to invent)
    FLOOD_STREAMS = 8
    #: connections one half-open burst holds while it asks /health
    HALF_OPEN = 64

    def __init__(self, args, model: str, run: Run, share: float) -> None:
        self.args, self.model, self.run, self.share = args, model, run, share
        self.root = re.sub(r"/v1/?$", "", args.base_url)
        self.statuses: dict[str, dict[str, int]] = {kind: {} for kind in self.KINDS}
        self.sent = 0
        #: streams opened and not closed yet, with their salts
        self.open_streams: dict[str, str | None] = {}
        self.leftovers_closed = 0
        self._big_body = b'{"model": "x", "prompt": "' + b"a" * (48 * 2**20) + b'"}'  # over any default body limit
        self._huge_text = "word " * (8 * 2**20 // 5)

    def _due(self) -> bool:
        """Whether one more hostile request keeps them at `share` of all requests sent."""
        return self.sent < self.share / (1 - self.share) * max(1, len(self.run.results))

    async def driver(self, index: int) -> None:
        async with make_client(self.args, connections=1) as http:
            while not self.run.expired():
                if not self._due():
                    await asyncio.sleep(0.05)
                    continue
                kind = self.KINDS[self.sent % len(self.KINDS)]
                self.sent += 1
                try:
                    status = await getattr(self, kind)(http)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # a dropped connection is a finding, not a crash of the bench
                    status = type(error).__name__
                counts = self.statuses[kind]
                counts[str(status)] = counts.get(str(status), 0) + 1

    def _v1(self, path: str) -> str:
        return f"{self.root}/v1{path}"

    async def oversized_body(self, http: httpx.AsyncClient) -> int:
        headers = {"Content-Type": "application/json"}
        return (await http.post(self._v1("/completions"), content=self._big_body, headers=headers)).status_code

    async def huge_max_tokens(self, http: httpx.AsyncClient) -> int:
        policy = "sink_window(sinks=4,window=256)"
        body = {"model": self.model, "prompt": "Hi", "max_tokens": 10**9, "kv_policy": policy}
        return (await http.post(self._v1("/completions"), json=body)).status_code

    async def stop_token_flood(self, http: httpx.AsyncClient) -> int:
        body = {"model": self.model, "prompt": "Hi", "max_tokens": 4, "stop_token_ids": list(range(400_000))}
        return (await http.post(self._v1("/completions"), json=body)).status_code

    async def huge_text(self, http: httpx.AsyncClient) -> int:
        body = {"model": self.model, "prompt": self._huge_text, "max_tokens": 4}
        return (await http.post(self._v1("/completions"), json=body)).status_code

    async def stream_churn(self, http: httpx.AsyncClient) -> int:
        opened = await http.post(self._v1("/streams"), json={"system": "You watch and answer briefly."})
        if opened.status_code != 200:
            return opened.status_code
        stream = opened.json()["id"]
        self.open_streams[stream] = None
        frame = await http.post(self._v1(f"/streams/{stream}/frames"), json={"text": "t=0.0s: id 1 at (3,4)"})
        closed = await http.delete(self._v1(f"/streams/{stream}"))
        self.open_streams.pop(stream, None)
        return frame.status_code if frame.status_code != 200 else closed.status_code

    async def long_frames(self, http: httpx.AsyncClient) -> int:
        """Two frames of --hostile-frame-tokens ids on a one-frame window, then close: the worst of
        the codes seen (a frame the stream cannot hold is a 4xx)."""
        body = {"system": "You watch a log.", "policy": "frame_window(frames=1,sinks=4)"}
        opened = await http.post(self._v1("/streams"), json=body)
        if opened.status_code != 200:
            return opened.status_code
        stream = opened.json()["id"]
        self.open_streams[stream] = None
        codes = []
        for i in range(2):
            ids = [100 + (7 * j + i) % 900 for j in range(self.args.hostile_frame_tokens)]
            codes.append((await http.post(self._v1(f"/streams/{stream}/frames"), json={"token_ids": ids})).status_code)
        codes.append((await http.delete(self._v1(f"/streams/{stream}"))).status_code)
        self.open_streams.pop(stream, None)
        return max(codes)

    async def stream_flood(self, http: httpx.AsyncClient) -> int:
        """FLOOD_STREAMS streams under fresh salts, then closed: the worst code (429s expected)."""
        codes, opened = [], []
        for _ in range(self.FLOOD_STREAMS):
            salt = f"flood-{uuid.uuid4().hex}"
            answer = await http.post(self._v1("/streams"), json={"system": "You watch.", "cache_salt": salt})
            codes.append(answer.status_code)
            if answer.status_code == 200:
                opened.append((answer.json()["id"], salt))
                self.open_streams[answer.json()["id"]] = salt
        for stream, salt in opened:
            closed = await http.delete(self._v1(f"/streams/{stream}"), headers={"X-Cache-Salt": salt})
            codes.append(closed.status_code)
            self.open_streams.pop(stream, None)
        return max(codes)

    async def surrogates(self, http: httpx.AsyncClient) -> int:
        headers = {"Content-Type": "application/json"}
        prompt = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}' % self.model.encode()
        system = b'{"system": "\\udfff watch"}'
        codes = [
            (await http.post(self._v1("/completions"), content=prompt, headers=headers)).status_code,
            (await http.post(self._v1("/streams"), content=system, headers=headers)).status_code,
        ]
        return max(codes)

    async def half_open(self, http: httpx.AsyncClient) -> int:
        """HALF_OPEN connections that send half a request's headers and wait, while /health is asked
        on a connection of its own: its code."""
        host, port = httpx.URL(self.root).host, httpx.URL(self.root).port or 80
        writers = []
        try:
            for _ in range(self.HALF_OPEN):
                _, writer = await asyncio.open_connection(host, port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Le")
                writers.append(writer)
            async with make_client(self.args, connections=1) as fresh:
                return (await fresh.get(f"{self.root}/health")).status_code
        finally:
            for writer in writers:
                writer.close()

    async def close_leftovers(self, http: httpx.AsyncClient) -> None:
        """Close the streams a churn opened but was cancelled before closing: a stream outlives its
        connection (until --stream-idle-timeout), so its blocks would read as a leak."""
        for stream, salt in sorted(self.open_streams.items()):
            headers = {} if salt is None else {"X-Cache-Salt": salt}
            closed = await http.delete(self._v1(f"/streams/{stream}"), headers=headers)
            self.leftovers_closed += closed.status_code == 200
        self.open_streams.clear()

    def report(self) -> dict:
        failures = sum(
            n for counts in self.statuses.values() for status, n in counts.items() if status[:1] not in "1234"
        )
        return {
            "share": self.share,
            "sent": self.sent,
            "by_kind": self.statuses,
            "server_errors_or_drops": failures,
            "leftover_streams_closed": self.leftovers_closed,
        }


def make_client(args, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    timeout = httpx.Timeout(connect=30.0, read=args.request_timeout, write=30.0, pool=args.request_timeout)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=60.0)
    # Plain-http targets skip loading the CA bundle (~50 ms of CPU per client).
    verify = not args.base_url.startswith("http://")
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=False, verify=verify)


# --- /metrics ------------------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets; comments and unparsable lines are skipped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


def pick(metrics: dict[str, float] | None, key: str) -> float | None:
    """The metric for `key`: kvbank's name first, then the same name under any other namespace."""
    if not metrics:
        return None
    name = METRIC_NAMES[key]
    if key == "rss":
        return metrics.get(name)
    if f"kvbank:{name}" in metrics:
        return metrics[f"kvbank:{name}"]
    for full, value in metrics.items():
        if full.endswith(":" + name):
            return value
    return None


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        response = await http.get(url)
    except (httpx.HTTPError, OSError):
        return None
    if response.status_code != 200:
        return None
    values = parse_prometheus(response.text)
    return values or None


# --- statistics ----------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * p / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(run: Run, seconds: float, before: dict | None, after: dict | None) -> dict:
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    e2es = [r.e2e for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "seconds": seconds,
        "requests": len(run.results),
        "ok": len(ok),
        "errors": sum(run.errors.values()),
        "errors_by_kind": dict(run.errors),
        "error_samples": list(run.error_samples),
        "cancelled": run.cancelled,
        "requests_per_s": len(ok) / seconds if seconds else 0.0,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds if seconds else 0.0,
        "output_tokens_source": "usage" if ok and all(r.completion_tokens is not None for r in ok) else "chunks",
        "empty_replies": sum(1 for r in ok if r.content_chunks == 0),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
    }
    for name, values in (("ttft", ttfts), ("itl", gaps), ("e2e", e2es)):
        for p in (50, 90, 99):
            summary[f"{name}_p{p}_s"] = percentile(values, p)
    summary.update(hit_rate(ok, before, after))
    preempt = [pick(m, "preemptions") for m in (before, after)]
    summary["preemptions"] = preempt[1] - preempt[0] if None not in preempt else None
    return summary


def hit_rate(ok: list[Result], before: dict | None, after: dict | None) -> dict:
    hits = [pick(m, "hits") for m in (before, after)]
    queries = [pick(m, "queries") for m in (before, after)]
    rate, source = None, "n/a"
    if None not in hits and None not in queries and queries[1] > queries[0]:
        rate, source = (hits[1] - hits[0]) / (queries[1] - queries[0]), "metrics"
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    usage_rate = (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)) if reported else None
    if rate is None and usage_rate is not None:
        rate, source = usage_rate, "usage"
    return {"hit_rate": rate, "hit_rate_source": source, "usage_cached_rate": usage_rate}


# --- output --------------------------------------------------------------------------------------

HEADER = (
    f"{'clients':>7s} {'reqs':>5s} {'err':>4s} {'req/s':>6s} {'out tok/s':>9s} {'TTFT p50':>9s} {'p99':>7s} "
    f"{'ITL p50':>8s} {'p99':>7s} {'E2E p50':>8s} {'p99':>7s} {'hit rate':>12s}"
)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def row(clients: int, s: dict) -> str:
    hit = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.1%} {s['hit_rate_source'][0]}"
    return (
        f"{clients:7d} {s['requests']:5d} {s['errors']:4d} {s['requests_per_s']:6.2f} "
        f"{s['output_tokens_per_s']:9.1f} {ms(s['ttft_p50_s']):>9s} {ms(s['ttft_p99_s']):>7s} "
        f"{ms(s['itl_p50_s']):>8s} {ms(s['itl_p99_s']):>7s} {secs(s['e2e_p50_s']):>8s} "
        f"{secs(s['e2e_p99_s']):>7s} {hit:>12s}"
    )


def print_level(clients: int, s: dict) -> None:
    print(HEADER)
    print(row(clients, s))
    if s["errors"]:
        print(f"  errors: {s['errors_by_kind']}")
        for sample in s["error_samples"]:
            print(f"    {sample}")
    notes = [f"output tokens from {s['output_tokens_source']}", f"{s['prompt_tokens']} prompt tokens"]
    if s["empty_replies"]:
        notes.append(f"{s['empty_replies']} empty replies")
    if s["preemptions"]:
        notes.append(f"{s['preemptions']:.0f} preemptions")
    if s["usage_cached_rate"] is not None and s["hit_rate_source"] == "metrics":
        notes.append(f"usage cached_tokens rate {s['usage_cached_rate']:.1%}")
    if s.get("client_cpu_s") is not None:
        notes.append(f"load generator CPU {s['client_cpu_s'] / s['seconds']:.0%} of one core")
    print(f"  ({'; '.join(notes)}; {s['seconds']:.1f} s)", flush=True)


# --- the two modes -------------------------------------------------------------------------------


async def run_levels(args, model: str, workload: Workload, metrics_url: str, report: dict) -> None:
    async with make_client(args, connections=2) as side:
        for clients in args.clients:
            stop_at = time.perf_counter() + args.duration if args.duration else None
            run = Run(args, model, workload, stop_at)
            before = await scrape(side, metrics_url)
            start, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(run.client(i) for i in range(clients)))
            seconds = time.perf_counter() - start
            after = await scrape(side, metrics_url)
            summary = summarize(run, seconds, before, after)
            summary["client_cpu_s"] = time.process_time() - cpu
            report["levels"].append({"clients": clients, **summary})
            save(args, report)  # after every level, so an interrupted run keeps the levels it finished
            print(f"\n{args.label}: {clients} client(s)")
            print_level(clients, summary)
            await asyncio.sleep(args.pause)


async def run_soak(args, model: str, workload: Workload, metrics_url: str, report: dict) -> None:
    clients = args.clients[0]
    stop_at = time.perf_counter() + args.soak
    run = Run(args, model, workload, None, endless=True)  # clients run until cancelled
    samples: list[dict] = []
    async with make_client(args, connections=2) as side:
        before = await scrape(side, metrics_url)
        start, cpu = time.perf_counter(), time.process_time()
        tasks = [asyncio.create_task(run.client(i)) for i in range(clients)]
        hostile = Hostile(args, model, run, args.hostile_share) if args.hostile_share else None
        if hostile is not None:
            tasks += [asyncio.create_task(hostile.driver(i)) for i in range(max(1, round(clients * hostile.share)))]
        print(
            f"\n{args.label}: soak, {clients} clients, {args.soak:.0f} s, a sample every {args.sample_interval:.0f} s"
            + (f", {args.hostile_share:.0%} of requests hostile" if hostile is not None else "")
        )
        print(
            f"{'t':>6s} {'reqs':>6s} {'err':>5s} {'tok/s':>7s} {'RSS MiB':>8s} {'KV use':>7s} {'run':>4s} {'wait':>5s}"
        )
        last_tokens, last_t = 0, start
        while True:
            remaining = stop_at - time.perf_counter()
            if remaining <= 0:
                break
            await asyncio.sleep(min(args.sample_interval, remaining))
            now = time.perf_counter()
            tokens = sum(r.output_tokens for r in run.results if r.ok)
            metrics = await scrape(side, metrics_url)
            sample = {
                "t": now - start,
                "requests": len(run.results),
                "errors": sum(run.errors.values()),
                "output_tokens_per_s": (tokens - last_tokens) / (now - last_t),
                **{k: pick(metrics, k) for k in ("rss", "kv_usage", "running", "waiting")},
            }
            samples.append(sample)
            last_tokens, last_t = tokens, now
            print(soak_row(sample), flush=True)
        seconds = time.perf_counter() - start
        # Hang up on whatever is in flight: the server must abort those requests and free their blocks.
        run.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if hostile is not None:
            await hostile.close_leftovers(side)
        drained, drain_s, final = await wait_drained(side, metrics_url, args.drain_timeout)
        summary = summarize(run, seconds, before, final)
        summary["client_cpu_s"] = time.process_time() - cpu
    rss = [s["rss"] for s in samples if s["rss"] is not None]
    final_rss = pick(final, "rss")
    kv_final = pick(final, "kv_usage")
    summary["soak"] = {
        "samples": samples,
        "drained": drained,
        "drain_seconds": drain_s,
        "final_kv_cache_usage_perc": kv_final,
        "final_running": pick(final, "running"),
        "final_waiting": pick(final, "waiting"),
        "leak_check": "n/a" if kv_final is None or not drained else ("ok" if kv_final == 0 else "LEAK"),
        "rss_first": rss[0] if rss else None,
        "rss_last_sample": rss[-1] if rss else None,
        "rss_final": final_rss,
        "rss_max": max(rss) if rss else None,
        "rss_growth_bytes": (rss[-1] - rss[0]) if len(rss) >= 2 else None,
        # After warm-up: caches and allocator pools fill early; a leak keeps growing.
        "rss_growth_second_half_bytes": (rss[-1] - rss[len(rss) // 2]) if len(rss) >= 4 else None,
    }
    if hostile is not None:
        summary["hostile"] = hostile.report()
    report["levels"].append({"clients": clients, **summary})
    print(f"\n{args.label}: soak totals, {clients} clients")
    print_level(clients, summary)
    if hostile is not None:
        h = summary["hostile"]
        print(
            f"  hostile: {h['sent']} sent ({h['sent'] / max(1, h['sent'] + len(run.results)):.1%} of all), "
            f"5xx or dropped: {h['server_errors_or_drops']}; by kind: {json.dumps(h['by_kind'])}; "
            f"streams a cancelled churn left open, closed before the drain: {h['leftover_streams_closed']}"
        )
    soak = summary["soak"]
    growth, late = soak["rss_growth_bytes"], soak["rss_growth_second_half_bytes"]
    print(
        f"  hung up on {run.cancelled} in-flight request(s) at the end; drained: "
        f"{'yes' if drained else 'NO' if drained is False else 'n/a (no /metrics)'} in {drain_s:.1f} s; "
        f"final KV usage {fmt(kv_final, '{:.4f}')} -> leak check {soak['leak_check']}; "
        f"RSS first {mib(soak['rss_first'])}, last {mib(soak['rss_last_sample'])}, after drain {mib(final_rss)}, "
        f"growth {'n/a' if growth is None else f'{growth / 2**20:+.1f} MiB'}, in the second half "
        f"{'n/a' if late is None else f'{late / 2**20:+.1f} MiB'}"
    )


async def wait_drained(side: httpx.AsyncClient, url: str, timeout: float) -> tuple[bool | None, float, dict | None]:
    """Poll /metrics until nothing runs or waits; (drained, seconds, last metrics). None when no /metrics."""
    start = time.perf_counter()
    metrics = None
    while True:
        metrics = await scrape(side, url)
        running, waiting = pick(metrics, "running"), pick(metrics, "waiting")
        if running is None or waiting is None:
            return None, time.perf_counter() - start, metrics
        if running == 0 and waiting == 0:
            await asyncio.sleep(0.5)  # let the engine thread finish its step's bookkeeping
            return True, time.perf_counter() - start, await scrape(side, url) or metrics
        if time.perf_counter() - start > timeout:
            return False, time.perf_counter() - start, metrics
        await asyncio.sleep(1.0)


def fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else pattern.format(value)


def mib(value: float | None) -> str:
    return fmt(None if value is None else value / 2**20, "{:.0f} MiB")


def soak_row(s: dict) -> str:
    return (
        f"{s['t']:6.0f} {s['requests']:6d} {s['errors']:5d} {s['output_tokens_per_s']:7.1f} "
        f"{fmt(None if s['rss'] is None else s['rss'] / 2**20, '{:.0f}'):>8s} "
        f"{fmt(s['kv_usage'], '{:.3f}'):>7s} {fmt(s['running'], '{:.0f}'):>4s} {fmt(s['waiting'], '{:.0f}'):>5s}"
    )


# --- setup ---------------------------------------------------------------------------------------


async def discover_model(args) -> tuple[str, dict | None]:
    """The model to ask for, and the /models answer; waits up to --wait-ready s for the server."""
    deadline = time.perf_counter() + args.wait_ready
    async with make_client(args, connections=1) as http:
        while True:
            try:
                response = await http.get(args.base_url + "/models")
                if response.status_code == 200:
                    listing = response.json()
                    break
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
            except (httpx.HTTPError, OSError, ValueError) as error:
                problem = f"{type(error).__name__}: {error}"
            if time.perf_counter() >= deadline:
                if args.model:
                    return args.model, None
                sys.exit(f"serve_load: GET {args.base_url}/models failed ({problem}); is the server up?")
            await asyncio.sleep(1.0)
    if args.model:
        return args.model, listing
    try:
        return listing["data"][0]["id"], listing
    except (KeyError, IndexError, TypeError):
        sys.exit(f"serve_load: no model id in GET /models: {json.dumps(listing)[:300]}; pass --model")


async def warm_up(args, model: str, workload: Workload) -> None:
    run = Run(args, model, workload, None)
    body = run.body([{"role": "system", "content": workload.system_prompt}, {"role": "user", "content": "Say hello."}])
    body["max_tokens"] = 4
    async with make_client(args, connections=1) as http:
        result = await stream_chat(http, run.url, body)
    if result.ok:
        print(
            f"warm-up: TTFT {ms(result.ttft)}, {result.prompt_tokens} prompt tokens "
            f"(system prompt ~{args.system_prompt_tokens} tokens requested)",
            flush=True,
        )
    else:
        print(f"warm-up failed: {result.error}: {result.detail}", flush=True)


async def main_async(args) -> dict:
    model, listing = await discover_model(args)
    workload = Workload(Path(args.corpus), args.system_prompt_tokens, args.user_tokens, args.chars_per_token)
    metrics_url = re.sub(r"/v1/?$", "", args.base_url) + "/metrics"
    async with make_client(args, connections=1) as http:
        has_metrics = await scrape(http, metrics_url) is not None
    if args.soak:
        amount = f"soak of {args.soak:.0f} s"
    else:
        amount = f"{args.duration:.0f} s" if args.duration else f"{args.conversations} conversation(s)"
        amount += " per client"
    print(
        f"{args.label}: {args.base_url}, model {model}, /metrics {'found' if has_metrics else 'absent'}; "
        f"{amount} x {args.turns} turns, max_tokens {args.max_tokens}, temperature {args.temperature}"
        f"{', ignore_eos' if args.ignore_eos else ''}",
        flush=True,
    )
    report = {
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "models": listing,
        "has_metrics": has_metrics,
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "system_prompt_chars": len(workload.system_prompt),
        "levels": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    await warm_up(args, model, workload)
    if args.soak:
        await run_soak(args, model, workload, metrics_url, report)
    else:
        await run_levels(args, model, workload, metrics_url, report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API root, ending in /v1")
    parser.add_argument("--model", default=None, help="model to request (default: the first of GET /models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--label", default=None, help="the system under test, for the table and JSON name")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrency levels, in turn")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each turn")
    parser.add_argument("--conversations", type=int, default=2, help="conversations per client and level")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per level instead of --conversations (no turn starts after it)",
    )
    parser.add_argument("--system-prompt-tokens", type=int, default=600, help="shared system prompt size (approx.)")
    parser.add_argument("--user-tokens", type=int, default=80, help="corpus tokens per user message (approx.)")
    parser.add_argument("--chars-per-token", type=float, default=4.2, help="for sizing text without a tokenizer")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="text for the system prompt and user messages")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (a vLLM/llama.cpp/kvbank extension) so every turn is max_tokens long",
    )
    parser.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run the first --clients level this long, sampling /metrics, then check for leaks",
    )
    parser.add_argument(
        "--hostile-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="with --soak: this share of all requests is hostile (oversized bodies, max_tokens 10^9 under an "
        "evicting policy, stop_token_ids floods, 8 MB prompts, stream churn, long frames, stream floods under "
        "fresh salts, lone surrogates, half-open connections), counted apart from the clients'",
    )
    parser.add_argument(
        "--hostile-frame-tokens",
        type=int,
        default=4800,
        help="token ids in each of the two frames a long_frames hostile sends (more than half the context)",
    )
    parser.add_argument("--sample-interval", type=float, default=10.0)
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="longest wait for a byte (s)")
    parser.add_argument("--error-backoff", type=float, default=0.5, help="pause after a failed request (s)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between levels")
    parser.add_argument("--wait-ready", type=float, default=0.0, help="wait this long for the server to come up")
    parser.add_argument("--json", default=None, help="default: bench/results/serve_load_<label>.json")
    args = parser.parse_args()
    args.base_url = args.base_url.rstrip("/")
    args.label = args.label or re.sub(r"^https?://", "", args.base_url)
    if args.soak and len(args.clients) > 1:
        print(f"--soak uses one level: {args.clients[0]} clients", file=sys.stderr)
    report = asyncio.run(main_async(args))
    if not args.soak and len(report["levels"]) > 1:
        print(f"\n{args.label}: all levels")
        print(HEADER)
        for level in report["levels"]:
            print(row(level["clients"], level))
    print(f"wrote {save(args, report)}")


def save(args, report: dict) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", args.label)
    path = Path(args.json or ROOT / "bench" / "results" / f"serve_load_{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


if __name__ == "__main__":
    main()
