"""Streaming sessions and prompt_embeds over HTTP, against a real server process (bfloat16 default)."""

import asyncio
import base64
import json
import re
import socket
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import request, served

from kvbank import LLM

MAX_STREAMS = 3
PER_TENANT = 2
PER_CLIENT = 2
IDLE_TIMEOUT = 5
SYSTEM = "You watch a video of moving objects and answer questions about it briefly."


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("streams") / "server.log"
    with served(
        [
            "--log-level",
            "warning",
            "--max-streams",
            str(MAX_STREAMS),
            "--max-streams-per-tenant",
            str(PER_TENANT),
            "--max-streams-per-client",
            str(PER_CLIENT),
            "--stream-idle-timeout",
            str(IDLE_TIMEOUT),
            "--num-gpu-blocks",
            "256",
            "--max-model-len",
            "1024",
            "--kv-host-gb",
            "0.05",
        ],
        kvbank_env,
        log_path,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_gb=0.02, max_model_len=1024)  # for its tokenizer and token embeddings


def _embeds_body(tensor: torch.Tensor) -> dict:
    raw = tensor.contiguous().view(torch.int16 if tensor.dtype == torch.bfloat16 else tensor.dtype).numpy().tobytes()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"data": base64.b64encode(raw).decode(), "dtype": dtype, "shape": list(tensor.shape)}


def _open(url: str, **fields) -> str:
    status, body, _ = request(f"{url}/v1/streams", {"system": SYSTEM, **fields})
    assert status == 200, body
    return body["id"]


def _frame(i: int) -> str:
    return f"t={i * 0.4:.1f}s: id {i % 5} at ({20 + 7 * i},{40 + i}) moving right"


def _running(url: str) -> float:
    text = request(f"{url}/metrics")[1]
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvbank:num_requests_running ")
    )


def _delete(url: str, stream_id: str, salt: str | None = None) -> int:
    return httpx.delete(f"{url}/v1/streams/{stream_id}", headers=_salt_header(salt)).status_code


def _salt_header(salt: str | None) -> dict:
    return {} if salt is None else {"X-Cache-Salt": salt}


def test_a_stream_keeps_its_last_frames_and_answers_from_them(server):
    stream_id = _open(server, policy="frame_window(frames=4,sinks=4)")
    for i in range(7):
        status, frame, _ = request(f"{server}/v1/streams/{stream_id}/frames", {"text": _frame(i)})
        assert status == 200, frame
        assert (
            frame["index"] == i and frame["kept_frames"] == min(i + 1, 4) and frame["evicted_frames"] == max(0, i - 3)
        )
    status, before, _ = request(f"{server}/v1/streams/{stream_id}")
    assert status == 200 and before["frames"] == 7 and before["kept_frames"] == 4
    ask = {"question": "Which ids are in view?", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, answer, _ = request(f"{server}/v1/streams/{stream_id}/ask", ask)
    assert status == 200, answer
    assert answer["object"] == "text_completion" and answer["stream"] == stream_id
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == before["kept_tokens"]
    again = request(f"{server}/v1/streams/{stream_id}/ask", ask)[1]
    assert again["choices"][0]["text"] == answer["choices"][0]["text"], "temperature 0: one answer per question"
    after = request(f"{server}/v1/streams/{stream_id}")[1]
    assert (after["blocks"], after["kept_tokens"]) == (before["blocks"], before["kept_tokens"])
    chunks = []
    with httpx.stream("POST", f"{server}/v1/streams/{stream_id}/ask", json={**ask, "stream": True}) as response:
        assert response.status_code == 200
        chunks = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1] if json.loads(c[6:])["choices"])
    assert text == answer["choices"][0]["text"]
    assert "recalled_frames" not in answer
    status, recalled, _ = request(f"{server}/v1/streams/{stream_id}/ask", {**ask, "recall": 2})
    assert status == 200 and len(recalled["recalled_frames"]) == 2, recalled
    assert set(recalled["recalled_frames"]) <= {0, 1, 2}, "only evicted frames are recalled"
    assert request(f"{server}/v1/streams/{stream_id}")[1]["recall_recalled"] == 2
    assert _delete(server, stream_id) == 200
    status, gone, _ = request(f"{server}/v1/streams/{stream_id}/frames", {"text": "late"})
    assert status == 404 and gone["error"]["code"] == "stream_not_found"


def test_a_client_that_hangs_up_mid_answer_leaves_the_stream_intact(server):
    stream_id = _open(server)
    for i in range(3):
        assert request(f"{server}/v1/streams/{stream_id}/frames", {"text": _frame(i)})[0] == 200
    before = request(f"{server}/v1/streams/{stream_id}")[1]
    ask = {"question": "Describe everything.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/streams/{stream_id}/ask", json=ask) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 10
    while _running(server):
        assert time.monotonic() < deadline, "the abandoned answer kept running"
        time.sleep(0.05)
    after = request(f"{server}/v1/streams/{stream_id}")[1]
    assert (after["blocks"], after["kept_tokens"], after["frames"]) == (
        before["blocks"],
        before["kept_tokens"],
        before["frames"],
    )
    status, answer, _ = request(f"{server}/v1/streams/{stream_id}/ask", {"question": "Which ids?", "max_tokens": 4})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    assert _delete(server, stream_id) == 200


def test_stream_limits_per_tenant_client_and_server_and_idle_expiry(server):
    ids = [_open(server) for _ in range(PER_TENANT)]
    status, body, headers = request(f"{server}/v1/streams", {"system": SYSTEM})
    assert status == 429 and body["error"]["code"] == "too_many_tenant_streams", body
    assert "--max-streams-per-tenant" in body["error"]["message"] and "retry-after" in {k.lower() for k in headers}
    # a new salt is no new client: the client that filled its tenant is full too; another is not
    status, body, _ = request(f"{server}/v1/streams", {"system": SYSTEM, "cache_salt": "tenant-b"})
    assert status == 429 and body["error"]["code"] == "too_many_client_streams", body
    assert "--max-streams-per-client" in body["error"]["message"]
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
        opened = elsewhere.post(f"{server}/v1/streams", json={"system": SYSTEM, "cache_salt": "tenant-b"})
    assert opened.status_code == 200, opened.text
    other = opened.json()["id"]
    status, body, headers = request(f"{server}/v1/streams", {"system": SYSTEM, "cache_salt": "tenant-c"})
    assert (
        status == 429 and body["error"]["code"] == "too_many_streams" and "retry-after" in {k.lower() for k in headers}
    )
    listed = request(f"{server}/v1/streams")[1]["data"]
    assert {s["id"] for s in listed} == set(ids)
    # Keep one in use until the unused ones have expired, however long the server takes to notice: the
    # kept one is used again a fraction of a second after each use (a request in flight is use too),
    # the others not at all (looking one up is no use).
    unused = [(ids[1], None), (other, "tenant-b")]
    guard = time.monotonic() + 120
    while any(request(f"{server}/v1/streams/{i}", headers=_salt_header(salt))[0] == 200 for i, salt in unused):
        assert request(f"{server}/v1/streams/{ids[0]}/frames", {"text": "tick"})[0] == 200
        assert time.monotonic() < guard, "streams unused for the idle timeout were never closed"
        time.sleep(0.2)
    assert [request(f"{server}/v1/streams/{i}", headers=_salt_header(salt))[0] for i, salt in unused] == [404, 404]
    assert request(f"{server}/v1/streams/{ids[0]}")[0] == 200
    fresh = _open(server)  # the expired ones' places are free again
    for stream_id in (ids[0], fresh):
        assert _delete(server, stream_id) == 200
    assert _delete(server, fresh) == 404


def _every_route(url: str, stream_id: str, salt: str | None) -> list[tuple[int, str]]:
    """Describe, append, ask and close `stream_id` as the tenant of `salt`: each answer's status and
    body, the id in it replaced, so that answers about different ids compare."""
    in_body = {} if salt is None else {"cache_salt": salt}
    base = f"{url}/v1/streams/{stream_id}"
    answers = [
        request(base, headers=_salt_header(salt))[:2],
        request(f"{base}/frames", {"text": "intruder", **in_body})[:2],
        request(f"{base}/ask", {"question": "What did you see?", "max_tokens": 1, **in_body})[:2],
    ]
    closed = httpx.delete(base, headers=_salt_header(salt))
    answers.append((closed.status_code, closed.json()))
    return [(status, json.dumps(body).replace(stream_id, "ID")) for status, body in answers]


def _listed(url: str, salt: str | None) -> set[str]:
    return {s["id"] for s in request(f"{url}/v1/streams", headers=_salt_header(salt))[1]["data"]}


def test_a_stream_answers_only_its_own_tenant_and_as_if_missing_to_others(server):
    salted, unsalted = _open(server, cache_salt="tenant-a"), _open(server)
    assert re.fullmatch(r"stream-[0-9a-f]{32}", salted)
    missing = _every_route(server, "stream-" + "0" * 32, "tenant-b")
    assert [status for status, _ in missing] == [404] * 4
    assert _every_route(server, salted, "tenant-b") == missing
    assert _every_route(server, salted, None) == missing, "the default tenant reaches no salted stream"
    assert _every_route(server, unsalted, "tenant-a") == missing, "a salted tenant reaches no unsalted stream"
    assert (_listed(server, "tenant-a"), _listed(server, None), _listed(server, "tenant-b")) == (
        {salted},
        {unsalted},
        set(),
    )
    status, state, _ = request(f"{server}/v1/streams/{salted}", headers=_salt_header("tenant-a"))
    assert status == 200 and state["frames"] == 0, "no other tenant's frame reached the stream"
    status, frame, _ = request(f"{server}/v1/streams/{salted}/frames", {"text": _frame(0), "cache_salt": "tenant-a"})
    assert status == 200 and frame["index"] == 0, frame
    ask = {"question": "Which ids?", "max_tokens": 2, "cache_salt": "tenant-a"}
    status, answer, _ = request(f"{server}/v1/streams/{salted}/ask", ask)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    status, body, _ = request(f"{server}/v1/streams/{salted}/ask", ask, headers=_salt_header("tenant-b"))
    assert status == 400 and body["error"]["param"] == "cache_salt", "a salt header that disagrees is refused"
    assert (_delete(server, salted, "tenant-a"), _delete(server, unsalted)) == (200, 200)


def test_bad_stream_requests_get_400s_naming_the_field(server):
    status, body, _ = request(f"{server}/v1/streams", {"system": SYSTEM, "policy": "h2o(heavy=4,recent=4)"})
    assert status == 400 and "frame_window" in body["error"]["message"]
    stream_id = _open(server)
    frames = f"{server}/v1/streams/{stream_id}/frames"
    status, body, _ = request(frames, {"text": "a", "token_ids": [1, 2]})
    assert status == 400 and "exactly one of" in body["error"]["message"]
    status, body, _ = request(frames, {"token_ids": [10**9]})
    assert status == 400 and "out of range" in body["error"]["message"]
    status, body, _ = request(frames, {"text": "a", "colour": "red"})
    assert status == 400
    status, body, _ = request(f"{server}/v1/streams/{stream_id}/ask", {"question": "?", "max_tokens": 5000})
    assert status == 400 and "max_tokens=5000" in body["error"]["message"]
    status, body, _ = request(f"{server}/v1/streams/{stream_id}/ask", {"question": "?", "prompt_logprobs": 1})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    assert _delete(server, stream_id) == 200
    status, body, _ = request(f"{server}/v1/streams", {"system": SYSTEM, "reserve_tokens": 10**6})
    assert status == 400 and "reserve_tokens=1000000 exceeds max_model_len" in body["error"]["message"]
    status, opened, _ = request(f"{server}/v1/streams", {"system": SYSTEM, "reserve_tokens": 200})
    assert status == 200, opened
    status, stats, _ = request(f"{server}/v1/streams/{opened['id']}")
    assert status == 200 and stats["reserved_blocks"] > 200 // 16
    status, body, _ = request(f"{server}/v1/streams/{opened['id']}/frames", {"token_ids": list(range(100, 300))})
    assert status == 400 and "over its reserve_tokens=200" in body["error"]["message"]
    assert _delete(server, opened["id"]) == 200


def test_prompt_embeds_over_http_equal_the_text_path(server, llm):
    ids = llm.get_tokenizer().encode(SYSTEM + " The three primary colours are")
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = request(f"{server}/v1/completions", {**body, "prompt": ids})[1]
    status, embeds, _ = request(
        f"{server}/v1/completions", {**body, "prompt_embeds": _embeds_body(llm.embed_tokens(ids))}
    )
    assert status == 200, embeds
    assert embeds["choices"][0]["text"] == text["choices"][0]["text"]
    as_float32 = _embeds_body(llm.embed_tokens(ids).float())  # bfloat16 values are exact in float32
    assert (
        request(f"{server}/v1/completions", {**body, "prompt_embeds": [as_float32]})[1]["choices"][0]["text"]
        == (text["choices"][0]["text"])
    )
    # Embedding frames are hashed by content: the same frame again is recognised.
    stream_id = _open(server)
    frame_ids = llm.get_tokenizer().encode(_frame(1) + "\n")
    frame = {"prompt_embeds": _embeds_body(llm.embed_tokens(frame_ids))}
    first = request(f"{server}/v1/streams/{stream_id}/frames", frame)[1]
    second = request(f"{server}/v1/streams/{stream_id}/frames", {**frame, "skip_repeat": True})[1]
    assert first["repeat_of"] is None and second["skipped"] and second["repeat_of"] == first["index"]
    assert _delete(server, stream_id) == 200


def _bad(tensor: torch.Tensor, **override) -> dict:
    return {**_embeds_body(tensor), **override}


@pytest.mark.parametrize(
    "embeds, message",
    [
        (_bad(torch.zeros(3, 17)), r"shape=\[3, 17\] must be \[tokens, 576\]"),
        (_bad(torch.zeros(3, 576), shape=[2000, 576]), r"1 <= tokens <= 1024"),
        (_bad(torch.zeros(3, 576), data="not base64!"), "not valid base64"),
        (_bad(torch.zeros(3, 576), dtype="float64"), "dtype='float64' must be one of float32, bfloat16, float16"),
        (_bad(torch.zeros(3, 576), dtype="float16"), "3456 bytes"),
        (_bad(torch.full((3, 576), float("nan"))), "NaN or infinite"),
        ({"data": "", "dtype": "float32"}, "must be an object with data"),
    ],
    ids=["hidden", "too-long", "base64", "dtype", "size", "nan", "shape-missing"],
)
def test_malformed_prompt_embeds_get_400s(server, embeds, message):
    status, body, _ = request(f"{server}/v1/completions", {"prompt_embeds": embeds, "max_tokens": 2})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert re.search(message, body["error"]["message"]), body["error"]["message"]


def test_stream_texts_and_token_lists_are_bounded_by_the_prompt_limit(server):
    """--max-prompt-tokens (twice the 1,024-token context here) bounds what a stream is sent as it
    bounds a prompt: a text from its byte count before it is tokenized, then by its tokens."""
    big = "word " * 80_000  # 400,000 bytes: at least 4,879 tokens of at most 82 bytes
    status, body, _ = request(f"{server}/v1/streams", {"system": big})
    assert status == 400 and body["error"]["param"] == "system", body
    assert "system of 400000 bytes has at least" in body["error"]["message"]
    stream_id = _open(server)
    for path, field, payload in (
        ("frames", "text", {"text": big}),
        ("frames", "token_ids", {"token_ids": [7] * 2049}),
        ("frames", "text", {"text": "word " * 2100}),  # under the byte bound: tokenized, then counted
        ("ask", "question", {"question": big, "max_tokens": 1}),
    ):
        status, body, _ = request(f"{server}/v1/streams/{stream_id}/{path}", payload)
        assert status == 400 and body["error"]["param"] == field, (path, payload.keys(), body)
        assert "over this server's limit of 2048 (--max-prompt-tokens)" in body["error"]["message"]
    assert request(f"{server}/v1/streams/{stream_id}/frames", {"text": "word " * 100})[0] == 200
    assert _delete(server, stream_id) == 200


def test_a_client_that_hangs_up_while_a_stream_opens_leaves_no_stream_behind(server):
    """The id is the stream's only handle: a stream whose opener hung up while its system prompt was
    computed is closed (the open is cancelled). (A hang-up after the computation, before the answer
    is written, is caught by the route's disconnect check; that window is too short to hit here.)"""
    before = _listed(server, None)
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"system": " ".join(_frame(i) for i in range(60))}).encode()  # ~1,000 tokens to prefill
    head = f"POST /v1/streams HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    second = _open(server)  # queued behind the abandoned open on the engine thread: it has run by now
    deadline = time.monotonic() + 60
    while (listed := _listed(server, None)) != before | {second}:
        assert time.monotonic() < deadline, f"streams left open: {listed - before - {second}}"
        time.sleep(0.2)
    assert _delete(server, second) == 200


# --- failures stay with their request, and streams leave room for everyone else --------------------


def _ids(count: int, salt: int) -> list[int]:
    return [100 + (7 * i + salt) % 900 for i in range(count)]


async def _victim_text(url: str, salt: str) -> str:
    """Another tenant's greedy streaming completion, its text as received."""
    body = {"prompt": "The capital of France is", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "cache_salt": salt}
    pieces = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                pieces.extend(c["text"] for c in chunk["choices"])
    return "".join(pieces)


def test_frames_longer_than_half_the_context_are_computed_and_another_tenant_notices_nothing(server):
    """Frames of 600 tokens on a one-frame window over a context of 1024 ran past the rotary tables,
    failed the step and aborted every tenant's requests; now each frame is computed, and a greedy
    completion of another tenant running meanwhile gets the text it gets alone."""
    alone = asyncio.run(_victim_text(server, "tenant-victim"))
    stream_id = _open(server, policy="frame_window(frames=1,sinks=4)", cache_salt="tenant-frames")

    async def frames() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            codes = []
            for i in range(3):
                body = {"token_ids": _ids(600, i), "cache_salt": "tenant-frames"}
                codes.append((await client.post(f"{server}/v1/streams/{stream_id}/frames", json=body)).status_code)
            return codes

    async def both():
        return await asyncio.gather(frames(), _victim_text(server, "tenant-victim"))

    codes, during = asyncio.run(both())
    assert codes == [200, 200, 200]
    assert during == alone
    state = request(f"{server}/v1/streams/{stream_id}", headers=_salt_header("tenant-frames"))[1]
    assert state["kept_frames"] == 1 and state["evicted_frames"] == 2
    assert _delete(server, stream_id, "tenant-frames") == 200


def test_streams_filling_their_share_leave_another_tenants_completion_room(server):
    """Three tenants' streams grow until their share of the pool (half of it) refuses a frame with a
    503 naming it; a fourth tenant's 300-token completion then still runs, and nothing is a 500."""
    clients = [
        httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=120)
        for address in ["127.0.0.1", "127.0.0.1", "127.0.0.2"]
    ]
    opened, refusals = [], []
    try:
        for n, client in enumerate(clients):
            body = {"system": SYSTEM, "policy": "frame_window(frames=64,sinks=4)", "cache_salt": f"grower-{n}"}
            answer = client.post(f"{server}/v1/streams", json=body)
            assert answer.status_code == 200, answer.text
            opened.append((client, answer.json()["id"], f"grower-{n}"))
        # The streams grow in turn, so none of them sits idle long enough to expire (IDLE_TIMEOUT) and
        # give its blocks back while the others fill the pool.
        growing = list(opened)
        for i in range(24):
            for grower in list(growing):
                client, stream_id, salt = grower
                body = {"token_ids": _ids(36, i), "cache_salt": salt}
                frame = client.post(f"{server}/v1/streams/{stream_id}/frames", json=body)
                assert frame.status_code in (200, 400, 503), frame.text
                if frame.status_code != 200:
                    refusals.append(frame)
                    growing.remove(grower)
    finally:
        for client in clients:
            client.close()
    pool_refusals = [r for r in refusals if r.status_code == 503]
    assert pool_refusals, [r.text for r in refusals]
    error = pool_refusals[0].json()["error"]
    assert error["code"] == "kv_pool_full" and "max_stream_pool_fraction=0.5" in error["message"]
    assert "retry-after" in {k.lower() for k in pool_refusals[0].headers}
    body = {"prompt": _ids(300, 9), "max_tokens": 16, "temperature": 0, "cache_salt": "tenant-other"}
    status, completion, _ = request(f"{server}/v1/completions", body)
    assert status == 200, completion
    for _, stream_id, salt in opened:
        # 404: it sat idle past IDLE_TIMEOUT during the completion and expired, which frees it as well
        assert _delete(server, stream_id, salt) in (200, 404)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    window=st.integers(1, 3),
    sinks=st.sampled_from([0, 4, 64]),
    sizes=st.lists(st.integers(1, 1100), min_size=1, max_size=3),
)
def test_no_frame_size_window_or_sinks_gets_a_server_error(server, window, sinks, sizes):
    """Whatever frames a stream is sent, each gets a 200 or a 4xx/503 saying why, and a question
    after them is answered: never a 5xx other than a 503 for room."""
    salt = "tenant-fuzz"
    stream_id = _open(server, policy=f"frame_window(frames={window},sinks={sinks})", cache_salt=salt)
    try:
        for i, size in enumerate(sizes):
            body = {"token_ids": _ids(size, i), "cache_salt": salt}
            status, answer, _ = request(f"{server}/v1/streams/{stream_id}/frames", body)
            assert status in (200, 400, 503), answer
        ask = {"question": "What happened?", "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        status, answer, _ = request(f"{server}/v1/streams/{stream_id}/ask", ask)
        assert status in (200, 400), answer
    finally:
        assert _delete(server, stream_id, salt) == 200
