"""A fleet end to end: a real sglang-router process in front of real `kvbank serve` replicas that
share a real redis-server tier (float32, greedy).

The router routes on what the replicas' worker routes tell it; which replica served a request is
read from each replica's own counters (/metrics). Three replicas start once for the module (two
serve the routing tests; the third is drained), and a test that kills one leaves the others be.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fleet import FAST_HEALTH, router_workers, start_router, stop_router
from redis_servers import start_redis_server
from serving import free_port, wait_healthy

from kvbank import cli

DATA = Path(__file__).parent / "data" / "austen_excerpt.txt"
CHUNK_TOKENS = 64
BLOCK = 16
REPLICA_ARGS = ["--dtype", "float32", "--log-level", "warning", "--num-gpu-blocks", "512"]
REPLICA_ARGS += ["--kv-tier-chunk-tokens", str(CHUNK_TOKENS)]
# Loads from Redis must not race the recompute estimate on a busy 2-core machine: these tests are
# about what the fleet shares, not about when a slow load is given up (tests/test_tiers.py is).
REPLICA_ARGS += ["--kv-tier-load-timeout", "30"]
DRAIN_GRACE_S = 2


@dataclass
class Replica:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def served(self) -> float:
        return _series(self, "kvbank:request_success_total")

    def redis_hits(self) -> float:
        return _series(self, 'kvbank:kv_tier_hits_total{tier="redis"}')


def _series(replica: Replica, name: str) -> float:
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {replica.name}'s /metrics")


@dataclass
class Fleet:
    replicas: list[Replica]
    redis: object
    model: str
    directory: Path

    def router(self, policy: str, replicas: list[Replica], name: str):
        return start_router([r.url for r in replicas], policy, self.directory / f"router-{name}.log", FAST_HEALTH)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, kvbank_env):
    directory = tmp_path_factory.mktemp("fleet")
    redis = start_redis_server(directory / "redis")
    replicas: list[Replica] = []
    try:
        for i in range(3):
            log_path = directory / f"replica{i}.log"
            port = free_port()
            args = [sys.executable, "-m", "kvbank", "serve", "--port", str(port), *REPLICA_ARGS]
            args += ["--kv-redis-url", redis.url, "--drain-grace", str(DRAIN_GRACE_S), "--shutdown-timeout", "20"]
            if i == 2:  # the one drained: a write-back pool, which stores only what it evicts, or spills
                args += ["--kv-tier-write-policy", "write_back"]
            with open(log_path, "w") as log:
                process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=kvbank_env)
            replicas.append(Replica(f"replica{i}", f"http://127.0.0.1:{port}", process, log_path))
        for replica in replicas:
            wait_healthy(replica.process, replica.url, replica.log_path)
        model = httpx.get(f"{replicas[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Fleet(replicas, redis, model, directory)
    finally:
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait()
        redis.kill()


def _chat(url: str, model: str, messages: list[dict], max_tokens: int = 8) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _complete(url: str, model: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _converse(url: str, model: str, turns: list[str], messages: list[dict] | None = None) -> tuple[list, list]:
    """Each user turn in order, the assistant's replies kept; returns (messages, answers)."""
    messages = list(messages or [])
    answers = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        answer = _chat(url, model, messages)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return messages, answers


def _turns(start: int, count: int, chars: int = 400) -> list[str]:
    text = DATA.read_text()
    return [f"Read this and answer briefly:\n{text[start + i * chars : start + (i + 1) * chars]}" for i in range(count)]


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _redis_keys(fleet: Fleet) -> int:
    with fleet.redis.client() as client:
        return len(client.keys("kvbank:*"))


def _wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.05)


def test_worker_routes_answer_as_sglang_does(fleet):
    replica = fleet.replicas[0]
    info = httpx.get(f"{replica.url}/server_info", timeout=10).json()
    assert info["served_model_name"] == fleet.model and info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["max_total_num_tokens"] == 512 * BLOCK and info["page_size"] == BLOCK
    assert "kv_tier_key" not in info and info["kv_redis_url"] == fleet.redis.url
    model_info = httpx.get(f"{replica.url}/model_info", timeout=10).json()
    assert model_info["is_generation"] is True and model_info["model_type"] == "llama"
    (load,) = httpx.get(f"{replica.url}/get_load", timeout=10).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_tokens"] == 0
    # what the router registered is what the routes said, and power_of_two's load is /get_load's
    router, url = fleet.router("power_of_two", fleet.replicas[:2], "probe")
    body = {"model": fleet.model, "prompt": "Count: one, two,", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        (worker,) = [w for w in router_workers(url) if w["url"] == replica.url]
        assert worker["model_id"] == fleet.model and worker["metadata"]["model_type"] == "llama"
        with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()  # kept: dropping the iterator would close the stream
            assert next(lines).startswith("data:")
            (running,) = httpx.get(f"{replica.url}/get_load", timeout=10).json()
            loads = httpx.get(f"{url}/get_loads", timeout=10).json()["workers"]
    finally:
        stop_router(router)
    assert running["num_running_reqs"] == 1 and running["num_tokens"] >= BLOCK
    assert {w["worker"]: w["load"] for w in loads}[replica.url] >= BLOCK  # the sum of num_tokens


def test_drain_grace_over_the_shutdown_timeout_is_refused(capsys):
    assert cli.main(["serve", "--drain-grace", "40", "--shutdown-timeout", "30"]) == 2
    assert "--drain-grace 40 must be between 0 and --shutdown-timeout 30" in capsys.readouterr().err


def test_cache_aware_keeps_a_conversation_on_one_replica_with_cached_tokens(fleet):
    pair = fleet.replicas[:2]
    router, url = fleet.router("cache_aware", pair, "cache-aware")
    try:
        before = [r.served() for r in pair]
        messages, answers = _converse(url, fleet.model, _turns(0, 3))
        served = [r.served() - b for r, b in zip(pair, before)]
    finally:
        stop_router(router)
    assert sorted(served) == [0, 3], served  # every turn on one replica
    assert _cached(answers[0]) == 0
    for previous, answer in zip(answers, answers[1:]):
        # the whole blocks of the previous turn's prompt were in that replica's pool
        assert _cached(answer) >= (previous["usage"]["prompt_tokens"] // BLOCK - 1) * BLOCK
    # a single server gives the same answers to the same turns (the other replica, asked directly)
    other = pair[served.index(0)]
    reference = [_chat(other.url, fleet.model, messages[: 2 * i + 1]) for i in range(3)]
    assert [a["choices"][0]["message"] for a in answers] == [r["choices"][0]["message"] for r in reference]


def test_round_robin_sends_the_second_replica_to_redis_instead_of_recomputing(fleet):
    pair = fleet.replicas[:2]
    prompt = DATA.read_text()[20000:23000]
    router, url = fleet.router("round_robin", pair, "round-robin")
    try:
        keys = _redis_keys(fleet)
        served = [r.served() for r in pair]
        first = _complete(url, fleet.model, prompt)
        chunks = first["usage"]["prompt_tokens"] // CHUNK_TOKENS
        _wait_for(lambda: _redis_keys(fleet) >= keys + chunks, "the first replica's chunks reaching Redis")
        first_on = [r.served() - s for r, s in zip(pair, served)].index(1)
        second_replica = pair[1 - first_on]
        hits = second_replica.redis_hits()
        second = _complete(url, fleet.model, prompt)
    finally:
        stop_router(router)
    assert second_replica.served() - served[1 - first_on] == 1  # round robin: the other replica
    assert second_replica.redis_hits() - hits >= chunks
    assert _cached(first) == 0
    assert _cached(second) >= second["usage"]["prompt_tokens"] - CHUNK_TOKENS
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_sigterm_drains_a_replica_without_failing_a_request(fleet):
    survivor, leaving = fleet.replicas[1], fleet.replicas[2]
    router, url = fleet.router("round_robin", [survivor, leaving], "drain")
    statuses: list[int | str] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            body = {"model": fleet.model, "prompt": f"Note {k}.{i}: the weather", "max_tokens": 6, "temperature": 0}
            try:
                statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)
            except httpx.HTTPError as error:
                statuses.append(repr(error))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    # A prompt only the leaving replica computed: its write-back pool holds it, Redis does not.
    prompt = DATA.read_text()[60000:61000]
    alone = _complete(leaving.url, fleet.model, prompt)
    try:
        for thread in threads:
            thread.start()
        _wait_for(lambda: len(statuses) >= 2, "the first requests")
        served = leaving.served()
        leaving.process.send_signal(signal.SIGTERM)
        # while it drains the replica still answers: /health and new work get 503 in OpenAI's shape
        _wait_for(lambda: httpx.get(f"{leaving.url}/health", timeout=5).status_code == 503, "/health failing")
        refused = httpx.post(f"{leaving.url}/v1/completions", json={"model": fleet.model, "prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_draining"
        assert leaving.process.wait(timeout=30) == 0
        time.sleep(0.5)  # traffic goes on after the replica left
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        stop_router(router)
    assert served > 0
    assert statuses and set(statuses) == {200}, [s for s in statuses if s != 200]
    log = leaving.log_path.read_text()
    assert "kvbank: stopped" in log and re.search(r"drained: \d+ cached chunks written to the tiers", log)
    # draining spilled the pool to Redis: the survivor loads the prompt instead of computing it
    hits = survivor.redis_hits()
    again = _complete(survivor.url, fleet.model, prompt)
    assert survivor.redis_hits() > hits
    assert _cached(again) >= again["usage"]["prompt_tokens"] - CHUNK_TOKENS
    assert again["choices"][0]["text"] == alone["choices"][0]["text"]


def test_sigkill_mid_conversation_loses_nothing_and_the_survivor_serves_from_redis(fleet):
    pair = fleet.replicas[:2]
    router, url = fleet.router("cache_aware", pair, "sigkill")
    try:
        before, keys = [r.served() for r in pair], _redis_keys(fleet)
        turns = _turns(30000, 4)
        messages, answers = _converse(url, fleet.model, turns[:2])
        victim_index = [r.served() - b for r, b in zip(pair, before)].index(2)
        victim, survivor = pair[victim_index], pair[1 - victim_index]
        # what the victim wrote reaches Redis before it dies (write-through, on its writer thread)
        chunks = answers[-1]["usage"]["prompt_tokens"] // CHUNK_TOKENS
        _wait_for(lambda: _redis_keys(fleet) >= keys + chunks, "the victim's chunks reaching Redis")
        hits, served = survivor.redis_hits(), survivor.served()
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        messages, later = _converse(url, fleet.model, turns[2:], messages)
    finally:
        stop_router(router)
    assert survivor.served() - served == 2  # both remaining turns, one retried away from the dead replica
    assert survivor.redis_hits() - hits >= chunks - 1
    assert _cached(later[0]) >= (chunks - 1) * CHUNK_TOKENS
    assert len(messages) == 8 and all(m["content"] for m in messages)
