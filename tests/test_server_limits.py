"""`kvbank serve` in production shape: API key, admission control, caps, /metrics, many concurrent
streaming clients, disconnects, graceful shutdown and a property-based fuzz of request bodies.
Every test talks HTTP to a real server process."""

import asyncio
import json
import re
import signal
import socket
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import request, served, start_server, wait_healthy

from kvbank.defaults import COMPLETIONS_MAX_TOKENS

KEY = "sk-kvbank-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "limits-model"
MAX_NUM_SEQS = 4
MAX_QUEUED = 40
MAX_TOKENS_CAP = 48
MAX_N = 3
MAX_CHOICES = 6
#: the name a reverse proxy in front of the server forwards in the Host header
PROXY_HOST = "kvbank.proxy.internal"


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("limits") / "server.log"
    with served(
        [  # the default dtype (bfloat16, packed 4-bit weights): what users run
            "--served-model-name",
            MODEL,
            "--log-level",
            "warning",
            "--api-key",
            KEY,
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-queued-requests",
            str(MAX_QUEUED),
            "--max-tokens-cap",
            str(MAX_TOKENS_CAP),
            "--max-n",
            str(MAX_N),
            "--max-choices",
            str(MAX_CHOICES),
            "--max-body-mb",
            "1",
            "--allowed-hosts",
            PROXY_HOST,
            "--num-gpu-blocks",
            "256",
            "--session-dir",
            str(log_path.parent / "sessions"),
        ],
        kvbank_env,
        log_path,
    ) as url:
        yield url


def _metrics(url: str) -> dict[str, float]:
    status, text, headers = request(f"{url}/metrics", headers=AUTH)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _until_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = _metrics(url)
        if metrics["kvbank:num_requests_running"] == metrics["kvbank:num_requests_waiting"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"server still busy: {metrics}")
        time.sleep(0.05)


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_api_key_guards_every_route_but_health(server):
    assert request(f"{server}/health")[0] == 200
    for path in ("/v1/models", "/metrics"):
        status, body, _ = request(f"{server}{path}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = request(
        f"{server}/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"Authorization": "Bearer wrong"}
    )
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert _client(server).models.list().data[0].id == MODEL


def test_allowed_hosts_add_a_proxy_name_to_the_loopback_names(server):
    """Behind a proxy the server answers to its name and still to the names local clients and
    health checks use; any other name is refused."""
    port = server.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"{PROXY_HOST}:{port}", PROXY_HOST.upper()):
        assert request(f"{server}/v1/models", headers={**AUTH, "Host": host})[0] == 200, host
    status, body, _ = request(f"{server}/v1/models", headers={**AUTH, "Host": f"rebind.example:{port}"})
    assert status == 400 and body["error"]["code"] == "invalid_host" and PROXY_HOST in body["error"]["message"]


def test_caps_on_max_tokens_and_n_are_400s_naming_value_and_limit(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_TOKENS_CAP + 1)
    assert f"max_tokens={MAX_TOKENS_CAP + 1}" in raised.value.message and str(MAX_TOKENS_CAP) in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=MAX_N + 1, max_tokens=2
        )
    assert raised.value.param == "n" and f"n={MAX_N + 1}" in raised.value.message
    # A chat request naming no max_tokens gets the cap, not the whole context.
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long story."}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == MAX_TOKENS_CAP
    # A completion naming none gets OpenAI's default for completions.
    completion = client.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == COMPLETIONS_MAX_TOKENS


def test_per_token_checks_are_bounded_over_http(server):
    """A flood of stop ids, stop strings or biases is a 400 naming the field and its limit, not a
    slower engine thread for everyone."""
    client = _client(server)
    for extra, param, message in (
        ({"stop_token_ids": list(range(100_000))}, "stop_token_ids", "at most 1024"),
        ({"stop": ["a"] * 65}, "stop", "at most 64"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert message in raised.value.message and param in raised.value.message, raised.value.message


def test_metrics_use_the_documented_names_and_move(server):
    before = _metrics(server)
    for name in (
        "kvbank:kv_cache_usage_perc",
        "kvbank:prefix_cache_queries_total",
        "kvbank:prefix_cache_hits_total",
        "kvbank:num_preemptions_total",
        "kvbank:num_requests_running",
        "kvbank:num_requests_waiting",
        "kvbank:prompt_tokens_total",
        "kvbank:generation_tokens_total",
        'kvbank:time_to_first_token_seconds_count{priority="0"}',
        'kvbank:inter_token_latency_seconds_count{priority="0"}',
        'kvbank:e2e_request_latency_seconds_count{priority="0"}',
        "process_resident_memory_bytes",
    ):
        assert name in before, name
    assert before["kvbank:batch_invariant"] == 1  # the default configuration keeps it
    _client(server).completions.create(
        model=MODEL, prompt="The sea is", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = _metrics(server)
    assert after["kvbank:generation_tokens_total"] - before["kvbank:generation_tokens_total"] == 5
    for name, more in (("e2e_request_latency", 1), ("time_to_first_token", 1), ("inter_token_latency", 4)):
        count = f'kvbank:{name}_seconds_count{{priority="0"}}'
        assert after[count] == before[count] + more, name
    assert (
        after['kvbank:time_to_first_token_seconds_bucket{priority="0",le="+Inf"}']
        == after['kvbank:time_to_first_token_seconds_count{priority="0"}']
    )


def test_kv_policy_is_a_request_field_with_400s_naming_it(server):
    client = _client(server)
    for policy, message in (
        ("lru", "is not one of full, sink_window"),
        ("sink_window(window=-1)", "window=-1 must be an integer >= 1"),
        ("h2o(heavy=5000,recent=64)", "but the pool has only 256 blocks"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"kv_policy": policy})
        assert raised.value.param == "kv_policy" and message in raised.value.message, raised.value.message
    before = _metrics(server)
    prompt = " ".join(f"word{i}" for i in range(300))  # over 600 tokens through a 256-token window
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"kv_policy": "sink_window(sinks=4,window=256)", "ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 600
    after = _metrics(server)
    evicted = 'kvbank:kv_policy_evicted_tokens_total{policy="sink_window"}'
    assert after[evicted] - before[evicted] >= reply.usage.prompt_tokens - 256 - 2 * 16
    assert (
        after['kvbank:kv_policy_evicted_tokens_total{policy="h2o"}']
        == before['kvbank:kv_policy_evicted_tokens_total{policy="h2o"}']
    )


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_32_concurrent_streaming_clients_get_what_they_get_alone_and_free_everything(server):
    prompts = [f"Item {i}: a short note about the number {i * 7}." for i in range(32)]

    async def run(together: bool) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            if together:
                return await asyncio.gather(*(_stream_text(client, p) for p in prompts))
            return [await _stream_text(client, p) for p in prompts]
        finally:
            await client.close()

    alone = asyncio.run(run(together=False))
    together = asyncio.run(run(together=True))
    assert together == alone
    metrics = _until_idle(server)
    assert metrics["kvbank:kv_cache_usage_perc"] == 0


def test_identical_greedy_chats_get_one_answer_alone_together_and_after_a_busy_period(server):
    """Temperature 0 gives one answer per request whatever else runs (the default configuration)."""
    messages = [{"role": "user", "content": "Describe a lighthouse at night in two sentences."}]

    async def chat(client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    async def run(copies: int) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(chat(client) for _ in range(copies)))
        finally:
            await client.close()

    alone = asyncio.run(run(1))[0]
    assert alone
    assert asyncio.run(run(16)) == [alone] * 16
    assert asyncio.run(run(1)) == [alone]


def test_full_queue_is_a_429_with_retry_after_and_nothing_is_lost(server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as http:
            body = {"prompt": "A list of fruits:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(2 * MAX_QUEUED)))

    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= MAX_QUEUED
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and str(MAX_QUEUED) in error["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses if r.status_code == 200)
    assert _until_idle(server)["kvbank:kv_cache_usage_perc"] == 0


def test_stream_frames_pass_the_same_queue_bound_as_completions(server):
    """Every kind of work that queues on the engine is admitted by one check, not only completions."""
    status, opened, _ = request(f"{server}/v1/streams", {"system": "You watch a feed."}, headers=AUTH)
    assert status == 200, opened
    frames = f"/v1/streams/{opened['id']}/frames"

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as http:
            return await asyncio.gather(
                *(http.post(frames, json={"text": f"frame {i}"}) for i in range(2 * MAX_QUEUED + 8))
            )

    try:
        responses = asyncio.run(run())
    finally:
        httpx.delete(f"{server}/v1/streams/{opened['id']}", headers=AUTH, timeout=60)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert _until_idle(server)["kvbank:num_requests_waiting"] == 0


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_retry(server):
    status, body, _ = request(
        f"{server}/v1/completions", {"prompt": ["Hi"] * (MAX_QUEUED + 1), "max_tokens": 1}, headers=AUTH
    )
    assert status == 400, body
    assert str(MAX_QUEUED + 1) in body["error"]["message"] and str(MAX_QUEUED) in body["error"]["message"]


def test_prompts_times_n_is_capped_by_max_choices(server):
    status, body, _ = request(
        f"{server}/v1/completions", {"prompt": ["Hi", "Ho", "Ha"], "n": MAX_N, "max_tokens": 1}, headers=AUTH
    )
    assert status == 400 and body["error"]["param"] == "n", body
    assert str(3 * MAX_N) in body["error"]["message"] and str(MAX_CHOICES) in body["error"]["message"]
    status, body, _ = request(
        f"{server}/v1/completions", {"prompt": ["Hi", "Ho"], "n": MAX_N, "max_tokens": 1}, headers=AUTH
    )
    assert status == 200 and len(body["choices"]) == 2 * MAX_N


def test_bodies_over_max_body_mb_are_413_before_and_while_reading(server):
    # Content-Length alone is refused: the answer comes before any of the body is sent.
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {2 * 2**20}\r\n\r\n".encode()
        )
        answer = ""
        while "}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk.decode()
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer, answer

    def chunks():
        for _ in range(3):
            yield b" " * 2**19  # a chunked body (no Content-Length) that passes 1 MiB while read

    response = httpx.post(f"{server}/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert response.status_code == 413 and "--max-body-mb" in response.json()["error"]["message"]
    assert request(f"{server}/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers=AUTH)[0] == 200


def test_client_that_disconnects_mid_stream_is_aborted_and_frees_its_blocks(server):
    body = {"prompt": "Write a very long story.", "max_tokens": MAX_TOKENS_CAP, "stream": True, "ignore_eos": True}
    finished = _until_idle(server)["kvbank:request_success_total"]
    with (
        httpx.Client(base_url=server, headers=AUTH, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        running = _metrics(server)["kvbank:num_requests_running"]
        assert running == 1, (running, _metrics(server))
    metrics = _until_idle(server, timeout=120)
    # Aborted when the client left, not run out to its max_tokens: an abort is the one end that
    # request_success_total does not count.
    assert metrics["kvbank:request_success_total"] == finished
    assert metrics["kvbank:kv_cache_usage_perc"] == 0
    assert metrics["kvbank:generation_tokens_total"] > 0


# Text as JSON can carry it: "\ud800" escapes without their pair decode to lone surrogates.
_surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800x"])
# Token ids, and ids no vocabulary (nor a 64-bit integer) holds.
_ids = st.integers(-5, 60000) | st.sampled_from([-1, 2**64])
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 70)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=8)
    | _surrogates,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | _surrogates, inner, max_size=3),
    max_leaves=6,
)
_fields = {
    "model": st.just(MODEL) | st.text(max_size=5) | _surrogates,
    "max_tokens": st.integers(-2, 6) | _json_values,
    "temperature": st.floats(-1, 3) | _json_values,
    "top_p": st.floats(-0.5, 1.5) | _json_values,
    "n": st.integers(-1, 4) | _json_values,
    "stop": st.text(max_size=3) | _surrogates | st.lists(st.text(max_size=3) | _surrogates, max_size=5),
    "seed": st.integers(-5, 2**70) | _json_values,
    "presence_penalty": st.floats(-3, 3) | _json_values,
    "frequency_penalty": st.floats(-3, 3) | _json_values,
    "logprobs": st.integers(-1, 30) | _json_values,
    "stream": st.booleans() | _json_values,
    "top_k": st.integers(-2, 50) | _json_values,
    "min_p": st.floats(-1, 2) | _json_values,
    "repetition_penalty": st.floats(-1, 3) | _json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json_values,
    "user": _json_values,
    "cache_salt": st.text(max_size=4) | _json_values,
    "min_tokens": st.integers(-1, 9),
}
_completion_bodies = st.fixed_dictionaries(
    {"prompt": st.text(max_size=20) | st.lists(_ids, max_size=6) | _json_values},
    optional={**_fields, "echo": st.booleans()},
)
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": st.text(max_size=20) | _json_values,
        }
    ),
    max_size=3,
)
_chat_bodies = st.fixed_dictionaries(
    {"messages": _messages | _json_values},
    optional={
        **_fields,
        "max_completion_tokens": st.integers(-1, 6) | _json_values,
        "top_logprobs": st.integers(-1, 25) | _json_values,
    },
)


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_fuzzed_request_bodies_never_cause_a_server_error(server, route, data):
    body = data.draw(_completion_bodies if route == "/v1/completions" else _chat_bodies)
    for field in ("max_tokens", "max_completion_tokens"):  # keep generations short; other values stay
        if type(body.get(field)) is int and body[field] > 4:
            body[field] = 4
    body.setdefault("max_tokens", 4)
    status, response, _ = request(f"{server}{route}", json.dumps(body).encode(), headers=AUTH)
    assert status < 500, (body, response)
    if status >= 400:
        assert set(response["error"]) == {"message", "type", "param", "code"}, response


_token_lists = st.lists(_ids, max_size=6)
_embeds = st.fixed_dictionaries(
    {
        "data": st.sampled_from(["", "AAAA", "AACAPw==", "not base64!", "A" * 4 * 576]) | _json_values,
        "dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "x"]) | _json_values,
        "shape": st.lists(st.integers(-2, 600), max_size=3) | _json_values,
    },
    optional={"extra": _json_values},
)
_salts = st.none() | st.sampled_from(["tenant-a", "tenant-b", ""]) | _json_values
_other_bodies = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt_embeds": _embeds | st.lists(_embeds, max_size=2) | _json_values},
        optional={"prompt": st.just("") | _json_values, "echo": st.booleans(), "max_tokens": st.integers(0, 4)},
    ),
    "/v1/streams": st.fixed_dictionaries(
        {"system": st.text(max_size=20) | _token_lists | _json_values},
        optional={
            "policy": st.sampled_from(["frame_window(frames=4,sinks=4)", "full", "h2o(heavy=4,recent=4)", "x("])
            | _json_values,
            "cache_salt": _salts,
            "separator": st.text(max_size=3) | _json_values,
            "chat": st.booleans() | _json_values,
        },
    ),
    "frames": st.fixed_dictionaries(
        {},
        optional={
            "text": st.text(max_size=20) | _json_values,
            "token_ids": _token_lists | _json_values,
            "prompt_embeds": _embeds | _json_values,
            "skip_repeat": st.booleans() | _json_values,
            "cache_salt": _salts,
        },
    ),
    "ask": st.fixed_dictionaries(
        {"question": st.text(max_size=20) | _token_lists | _json_values},
        optional={**_fields, "recall": st.integers(-2, 3) | _json_values, "max_tokens": st.integers(-1, 4)},
    ),
    "/v1/sessions/save": st.fixed_dictionaries(
        {"session": st.sampled_from(["s1", "../up", "a/b", "", "." * 300]) | _json_values},
        optional={
            "prompt": st.text(max_size=20) | _token_lists | _json_values,
            "prompt_token_ids": _token_lists | _json_values,
            "messages": _messages | _json_values,
            "cache_salt": _salts,
        },
    ),
    "/v1/sessions/restore": st.fixed_dictionaries(
        {"session": st.sampled_from(["s1", "../up", "missing", "\x00"]) | _json_values}, optional={"cache_salt": _salts}
    ),
    "/v1/sessions/delete": st.fixed_dictionaries(
        {"session": st.sampled_from(["s1", "../up", "missing"]) | _json_values}, optional={"cache_salt": _salts}
    ),
}


@pytest.fixture(scope="module")
def fuzz_stream(server):
    """A stream (the default tenant's) that the frame and question bodies are sent to."""
    status, body, _ = request(f"{server}/v1/streams", {"system": "You watch and answer briefly."}, headers=AUTH)
    assert status == 200, body
    return body["id"]


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(_other_bodies)), data=st.data())
def test_fuzzed_stream_session_and_embeds_bodies_never_cause_a_server_error(server, fuzz_stream, route, data):
    body = data.draw(_other_bodies[route])
    path = f"/v1/streams/{fuzz_stream}/{route}" if route in ("frames", "ask") else route
    status, response, _ = request(f"{server}{path}", json.dumps(body).encode(), headers=AUTH)
    assert status < 500, (path, body, response)
    if status >= 400:
        assert set(response["error"]) == {"message", "type", "param", "code"}, response
    elif route == "/v1/streams":  # an opened stream is closed again: the fuzz holds no stream slots
        salt = body.get("cache_salt")
        headers = {**AUTH, **({"X-Cache-Salt": salt} if isinstance(salt, str) else {})}
        assert httpx.delete(f"{server}/v1/streams/{response['id']}", headers=headers, timeout=60).status_code == 200


def test_sigterm_finishes_running_streams_then_exits_0(kvbank_env, tmp_path):
    log_path = tmp_path / "server.log"
    process, url = start_server(
        ["--dtype", "float32", "--log-level", "warning", "--shutdown-timeout", "30"], kvbank_env, log_path
    )
    try:
        wait_healthy(process, url, log_path)
        body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True, "ignore_eos": True}
        texts = []
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            texts.append(next(line for line in lines if line.startswith("data:")))
            process.send_signal(signal.SIGTERM)
            texts += [line for line in lines if line.startswith("data:")]
        assert texts[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in texts[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
        assert re.search(r"kvbank: stopped", log_path.read_text())
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
