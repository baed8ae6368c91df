"""Tiers below the pool, end to end with the real model: a prefix that left the pool (eviction,
restart, another engine) comes back from host RAM, disk or Redis and gives the same tokens as
computing it; bad entries and outages only ever cost a recompute."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from serving import start_server, stop_server, wait_healthy

from kvbank import LLM, SamplingParams
from kvbank.cache.tiers.entry import PREFIX_BYTES, EntryFormat, pack, unpack

pytest_plugins = ["redis_servers"]

DATA = Path(__file__).parent / "data" / "austen_excerpt.txt"  # a fresh clone has no ../shared
GREEDY = SamplingParams(max_tokens=6, temperature=0)
# Small pool and chunks: a 600-token prompt is ten chunks, and two fillers evict everything.
SMALL = dict(dtype="float32", num_gpu_blocks=96, kv_tier_chunk_tokens=64)


def _doc_tokens(llm: LLM, start: int, count: int) -> list[int]:
    text = DATA.read_text()[start * 8 : start * 8 + count * 8]
    return llm.get_tokenizer().encode(text)[:count]


def _run(llm: LLM, ids: list[int], salt: str | None = None) -> tuple[list[int], int]:
    prompt: dict = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    out = llm.generate(prompt, GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _evict_pool(llm: LLM) -> None:
    """Fill the pool with unrelated prompts so nothing of earlier prompts stays in it."""
    for k in range(2):
        llm.generate({"prompt_token_ids": [100 + k] * 1200}, SamplingParams(max_tokens=1))
    assert llm.stats()["num_blocks"] == SMALL["num_gpu_blocks"]


def _flush(llm: LLM) -> None:
    """Wait until the writer thread has handed every queued entry to the tiers."""
    assert llm.engine.offload.flush()


@pytest.fixture(scope="module")
def cold():
    """Reference outputs computed with no cache at all."""
    llm = LLM(**SMALL, enable_prefix_caching=False)
    ids = _doc_tokens(llm, 0, 600)
    tokens, cached = _run(llm, ids)
    assert cached == 0
    return ids, tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_host_tier_serves_an_evicted_prefix_with_identical_output(cold, kv_cache_dtype):
    ids, _ = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_cache_dtype=kv_cache_dtype) as llm:
        first, cached = _run(llm, ids)
        assert cached == 0
        _flush(llm)
        _evict_pool(llm)
        again, cached = _run(llm, ids)
        stats = llm.tier_stats()
    if kv_cache_dtype == "auto":
        assert first == cold[1]
    assert again == first
    assert cached == (len(ids) - 1) // 16 * 16  # every whole block but the one holding the last token
    assert stats["host"]["hits"] >= 9 and stats["offload"]["loads"] == 1
    assert stats["offload"]["load_tokens"] >= 512


def test_disk_tier_survives_a_restart_and_refuses_bad_entries(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 0)
        fmt = llm.engine.offload.format
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) == 10  # nine chunks of 64 tokens and the part-chunk the prompt ends with
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 592)
        assert llm.tier_stats()["disk"]["hits"] == 10

    first_chunk = next(f for f in files if unpack(fmt, f.read_bytes())[0].position == 0)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        for n, spoil in enumerate((_flip_byte, _truncate, lambda path: _rewrite_for_another_model(fmt, path))):
            spoil(first_chunk)
            assert _run(llm, ids) == (expected, 0)  # the first chunk is bad: nothing can chain after it
            assert llm.tier_stats()["offload"]["bad_entries"] == n + 1
            _flush(llm)
            unpack(fmt, first_chunk.read_bytes())  # deleted, then written anew by the recompute
            _evict_pool(llm)
        assert _run(llm, ids) == (expected, 592)
        assert llm.tier_stats()["disk"]["corrupt"] == 3


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _rewrite_for_another_model(fmt: EntryFormat, path: Path) -> None:
    """The same key and tokens, validly checksummed, but written by another model."""
    info, views = unpack(fmt, path.read_bytes())
    other = EntryFormat("0" * 32, fmt.dtype, fmt.kv_format, fmt.block_size, fmt.layout)

    def fill(out):
        for dst, src in zip(out, views):
            dst.copy_(src)

    path.write_bytes(pack(other, info, fill).numpy().tobytes())


def test_disk_full_stops_writing_and_keeps_serving(cold, tmp_path):
    ids, expected = cold
    entry_bytes = 4 * 30 * 2 * 16 * 3 * 64 * 4  # one 64-token chunk of float32 K/V
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_disk_gb=2.5 * entry_bytes / 2**30) as llm:
        assert _run(llm, ids) == (expected, 0)
        _flush(llm)
        disk = llm.tier_stats()["disk"]
        assert 0 < disk["bytes_used"] <= 2.5 * entry_bytes and disk["entries"] < 10
        _evict_pool(llm)
        assert _run(llm, ids)[0] == expected


def test_salted_entries_never_reach_another_salt(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids, salt="tenant-a") == (expected, 0)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids, salt="tenant-b") == (expected, 0)
        assert _run(llm, ids, salt=None)[1] == 0
        assert llm.tier_stats()["disk"]["hits"] == 0
        _evict_pool(llm)
        assert _run(llm, ids, salt="tenant-a") == (expected, 592)


def test_write_back_offloads_only_what_the_pool_evicts(cold):
    ids, expected = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_tier_write_policy="write_back") as llm:
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["offload"]["stores"] == 0
        _evict_pool(llm)
        assert llm.tier_stats()["offload"]["stores"] >= 9
        _flush(llm)
        assert _run(llm, ids) == (expected, 592)


def test_min_hits_delays_offload_until_a_prefix_is_reused(cold):
    ids, expected = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_offload_min_hits=1) as llm:
        _run(llm, ids)
        assert llm.tier_stats()["offload"]["stores"] == 0
        assert _run(llm, ids) == (expected, 592)  # a pool hit: now the chunks are worth keeping
        assert llm.tier_stats()["offload"]["stores"] == 10


@pytest.mark.parametrize("store", ["redis_server", "redis_cluster"])
def test_engines_share_a_prefix_through_redis(cold, store, request):
    ids, expected = cold
    url = request.getfixturevalue(store).url
    with LLM(**SMALL, kv_redis_url=url) as first:
        assert _run(first, ids) == (expected, 0)
        _flush(first)
    with LLM(**SMALL, kv_redis_url=url) as second:
        assert _run(second, ids) == (expected, 592)
        assert second.tier_stats()["redis"]["hits"] == 10


def test_redis_outage_costs_only_recompute_and_hits_resume(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_redis_timeout=0.5) as llm:
        redis_server.kill()
        assert _run(llm, ids) == (expected, 0)
        _flush(llm)
        _evict_pool(llm)
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["redis"]["errors"] >= 1
        redis_server.start()
        # Chunks offered while the tier backs off (at most 8 s) are dropped, and the backoff may end
        # halfway through a prompt's chunks: send new prompts until one is stored with none dropped.
        deadline = time.monotonic() + 60
        for shift in range(1, 100):
            other = ids[shift * 7 :] + ids[: shift * 7]
            before = llm.tier_stats()["redis"]
            _run(llm, other)
            _flush(llm)
            after = llm.tier_stats()["redis"]
            if after["store_bytes"] > before["store_bytes"] and after["stores_dropped"] == before["stores_dropped"]:
                break
            assert time.monotonic() < deadline, f"no prompt was stored whole after the restart: {after}"
        _evict_pool(llm)
        assert _run(llm, other)[1] == 592


def test_redis_killed_while_a_request_runs_costs_nothing_but_the_counted_error(cold, redis_server):
    # The tier answers when the request starts; it dies between two of the request's steps, before
    # the chunk its generated tokens complete (tokens 600..640) is written through.
    ids, _ = cold
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = LLM(**SMALL, enable_prefix_caching=False).generate({"prompt_token_ids": ids}, params)[0]
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_redis_timeout=0.5) as llm:
        killed_after = None
        for partial in llm.stream({"prompt_token_ids": ids}, params):
            if killed_after is None:
                killed_after = len(partial.outputs[0].token_ids)
                redis_server.kill()
        _flush(llm)
        stats = llm.tier_stats()["redis"]
    assert killed_after is not None and killed_after < 40
    assert partial.outputs[0].token_ids == expected.outputs[0].token_ids
    assert partial.outputs[0].finish_reason == "length"
    assert stats["errors"] >= 1


def test_bad_redis_entries_are_deleted_and_never_served(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url) as llm:
        _run(llm, ids)
        _flush(llm)
        fmt = llm.engine.offload.format
    client = redis_server.client()
    keys = sorted(client.keys("kvbank:*"))
    by_position = {unpack(fmt, client.get(k))[0].position: k for k in keys}
    value = bytearray(client.get(by_position[0]))
    value[PREFIX_BYTES + 5000] ^= 1
    client.set(by_position[0], bytes(value))
    with LLM(**SMALL, kv_redis_url=redis_server.url) as llm:
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["redis"]["corrupt"] == 1
        _flush(llm)
        unpack(fmt, client.get(by_position[0]))  # deleted, then written anew by the recompute
        _evict_pool(llm)
        client.set(by_position[4], client.get(by_position[4])[:-10])
        assert _run(llm, ids) == (expected, 64)  # the truncated second chunk ends the run
        assert llm.tier_stats()["redis"]["corrupt"] == 2


def test_overdue_load_is_abandoned_for_recompute(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_redis_timeout=30.0) as llm:
        _run(llm, ids)
        _flush(llm)
        _evict_pool(llm)
        os.kill(redis_server.process.pid, signal.SIGSTOP)  # a server that hangs rather than fails
        try:
            start = time.monotonic()
            assert _run(llm, ids) == (expected, 0)
            waited = time.monotonic() - start
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert llm.tier_stats()["offload"]["load_timeouts"] == 1
    assert waited < 15.0  # abandoned at the recompute estimate, not after the 30 s socket timeout


def test_two_servers_share_a_long_prompt_through_redis(redis_server, kvbank_env, tmp_path):
    args = ["--kv-redis-url", redis_server.url, "--kv-tier-chunk-tokens", "64"]
    servers = [start_server(args, kvbank_env, tmp_path / f"server{i}.log") for i in range(2)]
    try:
        for i, (process, url) in enumerate(servers):
            wait_healthy(process, url, tmp_path / f"server{i}.log")
        prompt = DATA.read_text()[:4000]
        first = _complete(servers[0][1], prompt)
        # The write-through entries leave on the writer thread: wait until every chunk is in Redis.
        chunks = -(-first["usage"]["prompt_tokens"] // 64)
        _wait_for(lambda: len(redis_server.client().keys("kvbank:*")) >= chunks, "the first server's chunks")
        second = _complete(servers[1][1], prompt)
    finally:
        for process, _ in servers:
            stop_server(process)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= second["usage"]["prompt_tokens"] - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_restarted_server_serves_its_disk_tier_with_the_same_output(kvbank_env, tmp_path):
    # Two real processes, one after the other, on one --kv-disk-dir: the second starts with an
    # empty pool, so every cached token it reports came from the files the first one wrote.
    args = ["--kv-disk-dir", str(tmp_path / "kv"), "--kv-tier-chunk-tokens", "64"]
    prompt = DATA.read_text()[:3000]
    answers = []
    for run in range(2):
        log = tmp_path / f"run{run}.log"
        process, url = start_server(args, kvbank_env, log)
        try:
            wait_healthy(process, url, log)
            answers.append(_complete(url, prompt))
            if run == 0:
                chunks = -(-answers[0]["usage"]["prompt_tokens"] // 64)
                _wait_for(lambda n=chunks: len(list((tmp_path / "kv").glob("*/*.kv"))) >= n, "the chunk files")
        finally:
            stop_server(process)
    first, second = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"] - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def _wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not arrive in {timeout_s} s"
        time.sleep(0.1)


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
