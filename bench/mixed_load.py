"""Chat streams while long prompts arrive: do the chatting clients' tokens keep coming?

--clients clients each stream short greedy completions (--max-tokens tokens, a fresh prompt each
time) without pause; every --long-every seconds one more client sends a prompt of --long-tokens
token ids (never seen before, so nothing is cached) and waits for its first token. Reported: the
chatting clients' inter-token latency (gaps between streamed chunks) p50 / p99 / max and their
output tokens/s, and the long prompts' time to first token. With --long-every 0 no long prompt is
sent: the chat-only baseline. Works against any OpenAI-compatible /v1/completions.

    kvbank serve --port 8000 &                                    # the default step-time target
    python bench/mixed_load.py --label target --seconds 120
    python bench/mixed_load.py --label chat-only --seconds 60 --long-every 0
    kvbank serve --port 8000 --max-step-ms 0 &                    # no target: prompts take the budget
    python bench/mixed_load.py --label no-target --seconds 120

Long prompts arrive on a clock (open loop): one every --long-every seconds whether or not the last
one has its first token.

--scenario priority / fairness measure who is served first when prefill is the bottleneck:
--queue-clients clients keep --queue-tokens-token prompts (unique, so nothing is cached) queued
without pause, each asking --queue-max-tokens tokens; one more client sends a prompt of the same
size every --probe-every seconds, at priority --probe-priority (priority: the queue runs at 0) or as
its own tenant (fairness: the queue's requests carry cache_salt "busy", the probe's "lone").
Reported: TTFT p50 / p99 of the probe beside the queue's.

    python bench/mixed_load.py --scenario priority --label priority --seconds 120
    python bench/mixed_load.py --scenario fairness --label fairness --seconds 120
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float | None, list[float], int]:
    """(time to first token, gaps between later chunks, chunks) of one streamed completion."""
    sent, last, first, gaps, chunks = time.perf_counter(), None, None, [], 0
    async with open_stream(client, url, {**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not any(c.get("text") for c in choices):
                continue
            now = time.perf_counter()
            if first is None:
                first = now - sent
            else:
                gaps.append(now - last)
            last, chunks = now, chunks + 1
    if first is None:  # a reply whose one token decodes to no text: its end is its first token
        first = time.perf_counter() - sent
    return first, gaps, chunks


@contextlib.asynccontextmanager
async def open_stream(client: httpx.AsyncClient, url: str, body: dict) -> AsyncIterator[httpx.Response]:
    """The streamed response, sent again on a fresh connection when a kept-alive one was closed before
    any response (a server that closes connections after a few requests), as OpenAI's client does."""
    for attempt in range(3):
        answered = False
        try:
            async with client.stream("POST", url, json=body) as response:
                answered = True
                yield response
                return
        except httpx.RemoteProtocolError:
            if answered or attempt == 2:
                raise


async def chat_client(args, index: int, stop_at: float, gaps: list[float], tokens: list[int]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in itertools.count():
            if time.perf_counter() >= stop_at:
                return
            prompt = f"Client {index}, question {turn}: name three things a lighthouse keeper does each day."
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            _, got, chunks = await stream(client, f"{args.base_url}/completions", body | {"ignore_eos": True})
            gaps.extend(got)
            tokens.append(chunks)


async def long_prompt(args, n: int, ttfts: list[float]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        ids = [1000 + (7 * i + 9973 * n) % 40000 for i in range(args.long_tokens)]
        body = {"model": args.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        first, _, _ = await stream(client, f"{args.base_url}/completions", body)
        ttfts.append(first)


async def long_client(args, stop_at: float, ttfts: list[float]) -> int:
    """One long prompt every --long-every seconds, on the clock (each in its own connection); those
    without a first token --drain-s seconds after the run's end are given up. Returns how many were sent."""
    sent = []
    for n in itertools.count():
        if time.perf_counter() + args.long_every >= stop_at:
            break
        await asyncio.sleep(args.long_every)
        sent.append(asyncio.create_task(long_prompt(args, n, ttfts)))
    if sent:
        _, pending = await asyncio.wait(sent, timeout=max(0.0, stop_at + args.drain_s - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return len(sent)


def unique_prompt(args, tag: int) -> list[int]:
    """--queue-tokens token ids no other request shares (a distinct first token), so nothing is cached."""
    return [1000 + tag % 30000] + [1000 + (7 * i + 104729 * tag) % 40000 for i in range(args.queue_tokens - 1)]


async def timed_request(args, client: httpx.AsyncClient, tag: int, extra: dict) -> float | None:
    body = {"model": args.model, "prompt": unique_prompt(args, tag), "max_tokens": args.queue_max_tokens}
    first, _, _ = await stream(
        client, f"{args.base_url}/completions", body | {"temperature": 0, "ignore_eos": True, **extra}
    )
    return first


async def queue_client(args, index: int, stop_at: float, ttfts: list[float], extra: dict) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in itertools.count():
            if time.perf_counter() >= stop_at:
                return
            ttfts.append(await timed_request(args, client, 1 + index + 1000 * turn, extra))


async def probe_client(args, stop_at: float, ttfts: list[float], extra: dict) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for n in itertools.count():
            if time.perf_counter() + args.probe_every >= stop_at:
                return
            await asyncio.sleep(args.probe_every)
            ttfts.append(await timed_request(args, client, 999 + 1000 * n, extra))


def ttft_summary(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


async def main_async(args) -> dict:
    async with httpx.AsyncClient() as client:
        args.model = args.model or (await client.get(f"{args.base_url}/models")).json()["data"][0]["id"]
    if args.scenario != "chat":
        return await queue_scenario(args)
    gaps: list[float] = []
    tokens: list[int] = []
    ttfts: list[float] = []
    start = time.perf_counter()
    stop_at = start + args.seconds
    chats = asyncio.gather(*(chat_client(args, i, stop_at, gaps, tokens) for i in range(args.clients)))
    chats_done: list[float] = []
    chats.add_done_callback(lambda _: chats_done.append(time.perf_counter()))
    long_sent = await long_client(args, stop_at, ttfts) if args.long_every > 0 else 0
    await chats
    seconds = time.perf_counter() - start
    chat_seconds = chats_done[0] - start  # the chat rate counts the chats' time, not a long prompt's drain
    return {
        "label": args.label,
        "scenario": "chat",
        "clients": args.clients,
        "seconds": seconds,
        "long_every_s": args.long_every,
        "long_tokens": args.long_tokens,
        "chat_seconds": chat_seconds,
        "chat_output_tokens_per_s": sum(tokens) / chat_seconds,
        "chat_itl_p50_s": percentile(gaps, 50),
        "chat_itl_p99_s": percentile(gaps, 99),
        "chat_itl_max_s": max(gaps, default=None),
        "long_prompts_sent": long_sent,
        "long_prompts": len(ttfts),  # answered (a first token) by --drain-s after the end
        "long_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "long_ttft_p99_s": percentile(ttfts, 99),
        "long_ttft_max_s": max(ttfts, default=None),
    }


async def queue_scenario(args) -> dict:
    """The queue's clients and the probe, with the fields that set them apart."""
    if args.scenario == "priority":
        queue_extra, probe_extra = {}, {"priority": args.probe_priority}
    else:
        queue_extra, probe_extra = {"cache_salt": "busy"}, {"cache_salt": "lone"}
    queued: list[float] = []
    probed: list[float] = []
    start = time.perf_counter()
    stop_at = start + args.seconds
    tasks = [queue_client(args, i, stop_at, queued, queue_extra) for i in range(args.queue_clients)]
    await asyncio.gather(*tasks, probe_client(args, stop_at, probed, probe_extra))
    return {
        "label": args.label,
        "scenario": args.scenario,
        "seconds": time.perf_counter() - start,
        "queue_clients": args.queue_clients,
        "queue_tokens": args.queue_tokens,
        "queue_max_tokens": args.queue_max_tokens,
        "probe_every_s": args.probe_every,
        "probe": {**ttft_summary(probed), **probe_extra},
        "queue": {**ttft_summary(queued), **queue_extra},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first of GET /models")
    parser.add_argument("--label", default="mixed")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-every", type=float, default=10.0, help="seconds between long prompts (0: none)")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument(
        "--drain-s", type=float, default=60.0, help="seconds after the end a long prompt may still take"
    )
    parser.add_argument("--json", default=None, help="where the report goes (default: results/mixed_load_LABEL.json)")
    parser.add_argument("--scenario", choices=("chat", "priority", "fairness"), default="chat")
    parser.add_argument("--queue-clients", type=int, default=24, help="priority/fairness: clients keeping a queue")
    parser.add_argument("--queue-tokens", type=int, default=400, help="priority/fairness: prompt tokens per request")
    parser.add_argument("--queue-max-tokens", type=int, default=16)
    parser.add_argument("--probe-every", type=float, default=2.0, help="seconds between the probe's requests")
    parser.add_argument("--probe-priority", type=int, default=-1)
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    path = Path(args.json) if args.json else RESULTS / f"mixed_load_{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
