"""The OpenAI-compatible server: a real `kvbank serve` process driven by the official `openai` client,
checked against the offline engine's greedy output; plus AsyncEngine's contract, in process."""
import asyncio
import itertools
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from kvbank import LLM, SamplingParams
from kvbank.server import AsyncEngine

MODEL_NAME = "kvbank-test-model"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
STARTUP_TIMEOUT_S = 120
PINNED_SYSTEM = ("You are the librarian of a small town. Answer in one short sentence about opening hours, "
                 "loans and late fees.")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    """A `kvbank serve` subprocess: yields its base URL once /health answers, kills it at the end."""
    port = _free_port()
    folder = tmp_path_factory.mktemp("server")
    log_path = folder / "server.log"
    pin_file = folder / "system.txt"
    pin_file.write_text(f"<|im_start|>system\n{PINNED_SYSTEM}<|im_end|>\n")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvbank", "serve", "--port", str(port), "--dtype", "float32",
             "--served-model-name", MODEL_NAME, "--log-level", "warning", "--pin-prompt", str(pin_file)],
            stdout=log, stderr=subprocess.STDOUT, env=kvbank_env)
    yield process, f"http://127.0.0.1:{port}", log_path
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def reference(server):
    """The offline engine, loaded while the server process loads its own copy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see kvbank_env: sharing the CPU with the server, one thread is faster
    yield LLM(dtype="float32")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_url(server, reference):
    process, url, log_path = server
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kvbank serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return url
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"kvbank serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _assert_openai_error(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- the server ----------------------------------------------------------------------------------

def test_health_and_models_list_the_served_model(base_url, client, reference):
    with urllib.request.urlopen(f"{base_url}/health") as response:
        assert response.status == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == reference.engine.max_model_len


def test_completion_equals_offline_greedy(client, reference):
    prompt = "The capital of France is"
    expected = reference.generate(prompt, GREEDY)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert response.object == "text_completion"
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    usage = response.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_equals_offline_greedy(client, reference):
    prompt = "Water boils at"
    expected = reference.generate(prompt, GREEDY)[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == expected.finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_chat_equals_offline_greedy(client, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.chat(messages, GREEDY)[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=MAX_TOKENS,
                                              temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.prompt_tokens_details.cached_tokens is not None


def test_streamed_chat_starts_with_the_role_and_equals_offline_greedy(client, reference):
    messages = [{"role": "user", "content": "Name a color."}]
    expected = reference.chat(messages, GREEDY)[0].outputs[0]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_repeated_chat_prompt_is_served_from_the_prefix_cache(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    first, second = (client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
                     for _ in range(2))
    block_size = 16
    assert second.usage.prompt_tokens_details.cached_tokens >= block_size
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_both(base_url, client, reference):
    limit = reference.engine.max_model_len
    status, body = _post(f"{base_url}/v1/completions", {"prompt": "Hi", "max_tokens": limit + 100})
    assert status == 400
    message = _assert_openai_error(body)["message"]
    assert str(limit + 100) in message and str(limit) in message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=limit)


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "temperature": -1},
    {"prompt": "Hi", "n": "many"},
    {"prompt": [[]]},
    {"max_tokens": 4},
    b'{"prompt": "Hi"',
])
def test_invalid_bodies_are_a_400_in_openai_shape(base_url, body):
    status, response = _post(f"{base_url}/v1/completions", body)
    assert status == 400
    assert _assert_openai_error(response)["type"] == "invalid_request_error"


def test_bad_temperature_names_the_field(base_url):
    status, response = _post(f"{base_url}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1})
    assert status == 400
    assert "temperature" in _assert_openai_error(response)["message"]


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert raised.value.code == "model_not_found"
    assert raised.value.param == "model"


# --- AsyncEngine, in process ---------------------------------------------------------------------

@pytest.fixture
def async_engine(reference):
    """The reference engine, lent to an AsyncEngine's thread for one test and then handed back."""
    engine = AsyncEngine(reference.engine)
    yield engine
    engine.shutdown()
    assert not engine.is_running


async def _until_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_requests_running"] == stats["num_requests_waiting"] == 0:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_async_engine_raises_the_engines_value_error(async_engine, reference):
    too_long = SamplingParams(max_tokens=reference.engine.max_model_len + 1)

    async def run() -> None:
        async for _ in async_engine.generate("Hi", too_long):
            pass

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(run())


def test_async_engine_streams_cumulative_outputs_until_finished(async_engine):
    async def run() -> list:
        return [output async for output in async_engine.generate("The capital of France is", GREEDY)]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    texts = [o.outputs[0].text for o in outputs]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert len(outputs[-1].outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize("stop_by", ["break", "cancel"])
def test_async_engine_aborts_a_request_whose_consumer_stops(async_engine, reference, stop_by):
    endless = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def run() -> dict:
        if stop_by == "break":
            async for _ in async_engine.generate("Once upon a time", endless):
                break
        else:
            first_output = asyncio.Event()

            async def consume() -> None:
                async for _ in async_engine.generate("Once upon a time", endless):
                    first_output.set()

            task = asyncio.create_task(consume())
            await first_output.wait()
            task.cancel()
        return await _until_idle(async_engine)

    stats = asyncio.run(run())
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_pinned_system_prompt_is_cached_on_first_use_and_salts_isolate(client):
    messages = [{"role": "system", "content": PINNED_SYSTEM}, {"role": "user", "content": "When do you open?"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens >= 16
    salted = [client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                             extra_body={"cache_salt": "tenant-x"}) for _ in range(2)]
    assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
    assert salted[1].usage.prompt_tokens_details.cached_tokens >= 16
    assert salted[0].choices[0].message.content == first.choices[0].message.content
