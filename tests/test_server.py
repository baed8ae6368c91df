"""The OpenAI-compatible server: a real `kvbank serve` process driven by the official `openai` client,
checked against the offline engine's greedy output; plus AsyncEngine's contract, in process."""

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest
import torch
from serving import request, start_server, stop_server, wait_healthy
from tiny_models import tiny_llama_config

from kvbank import LLM, SamplingParams
from kvbank.server import AsyncEngine, build_app

MODEL_NAME = "kvbank-test-model"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PINNED_SYSTEM = (
    "You are the librarian of a small town. Answer in one short sentence about opening hours, loans and late fees."
)


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    """A `kvbank serve` subprocess: yields its base URL once /health answers, kills it at the end."""
    folder = tmp_path_factory.mktemp("server")
    log_path = folder / "server.log"
    pin_file = folder / "system.txt"
    pin_file.write_text(f"{PINNED_SYSTEM}\n")
    process, url = start_server(
        [
            "--dtype",
            "float32",
            "--served-model-name",
            MODEL_NAME,
            "--log-level",
            "warning",
            "--pin-prompt",
            str(pin_file),
        ],
        kvbank_env,
        log_path,
    )
    yield process, url, log_path
    stop_server(process)


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
    wait_healthy(process, url, log_path)
    return url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, body: bytes | dict) -> tuple[int, dict]:
    status, response, _ = request(url, body)
    return status, response


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
    assert models[0].root == MODEL_NAME  # the name, never the model's filesystem path


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
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == expected.finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_chat_equals_offline_greedy(client, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.chat(messages, GREEDY)[0]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    # The first request of this conversation: no block of it is cached yet (the pinned system
    # prompt differs from the template's default one within the first block).
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_starts_with_the_role_and_equals_offline_greedy(client, reference):
    messages = [{"role": "user", "content": "Name a color."}]
    expected = reference.chat(messages, GREEDY)[0].outputs[0]
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_n_choices_logprobs_and_stop_strings_equal_offline(client, reference):
    prompt = "The three primary colours are"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2, logprobs=2, stop=["."])
    expected = reference.generate(prompt, params)[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2, logprobs=2, stop=["."]
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice, completion in zip(response.choices, expected.outputs):
        assert choice.text == completion.text and "." not in choice.text
        assert choice.finish_reason == completion.finish_reason
        wanted = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert choice.logprobs.token_logprobs == pytest.approx(wanted, abs=1e-4)
        assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * len(completion.token_ids)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)


def test_chat_logprobs_and_streamed_usage(client, reference):
    messages = [{"role": "user", "content": "Count to five."}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3))[0].outputs[0]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [lp[t].logprob for lp, t in zip(expected.logprobs, expected.token_ids)], abs=1e-4
    )
    assert all(len(c.top_logprobs) == 3 for c in content)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected.text


def test_async_client_streams_concurrent_requests(base_url, reference):
    prompts = ["Once upon a time", "The best way to learn is", "In the year 2050,"]
    expected = [o.outputs[0].text for o in reference.generate(prompts, GREEDY)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected


def test_repeated_chat_prompt_is_served_from_the_prefix_cache(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    first, second = (
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
        for _ in range(2)
    )
    block_size = 16
    assert second.usage.prompt_tokens_details.cached_tokens >= block_size
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_both(base_url, client, reference):
    limit = reference.engine.max_model_len
    # max_tokens under --max-tokens-cap (default 4096), prompt + max_tokens over the context
    status, body = _post(f"{base_url}/v1/completions", {"prompt": [1] * (limit - 50), "max_tokens": 100})
    assert status == 400
    message = _assert_openai_error(body)["message"]
    assert str(limit + 50) in message and str(limit) in message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=limit)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hi", "temperature": -1},
        {"prompt": "Hi", "n": "many"},
        {"prompt": [[]]},
        {"max_tokens": 4},
        b'{"prompt": "Hi"',
    ],
)
def test_invalid_bodies_are_a_400_in_openai_shape(base_url, body):
    status, response = _post(f"{base_url}/v1/completions", body)
    assert status == 400
    assert _assert_openai_error(response)["type"] == "invalid_request_error"


def test_bad_temperature_names_the_field(base_url):
    status, response = _post(
        f"{base_url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}
    )
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


def test_async_engine_streams_deltas_until_finished(async_engine, reference):
    prompt = "The capital of France is"
    expected = reference.generate(prompt, GREEDY)[0]

    async def run() -> list:
        return [output async for output in async_engine.generate(prompt, GREEDY)]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.outputs[0].text for o in outputs) == expected.outputs[0].text
    assert [t for o in outputs for t in o.outputs[0].token_ids] == expected.outputs[0].token_ids
    assert all(o.prompt == prompt and o.prompt_token_ids == expected.prompt_token_ids for o in outputs)


def test_stalled_reader_gets_merged_deltas_and_at_most_one_pending_output(async_engine, reference):
    long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
    expected = reference.generate("Once upon a time", long)[0].outputs[0]

    async def run() -> tuple[list, int]:
        stream = await async_engine.add_request("Once upon a time", long)
        outputs = [await anext(stream)]
        await _until_idle(async_engine, timeout=60)  # the reader stalls while every other step runs
        pending = stream.num_pending
        outputs += [output async for output in stream]
        return outputs, pending

    outputs, pending = asyncio.run(run())
    assert pending == 1 and len(outputs) == 2, "the unread steps' deltas were merged into one output"
    merged = outputs[0]
    for output in outputs[1:]:
        merged.add(output)
    completion = merged.outputs[0]
    assert completion.token_ids == expected.token_ids and completion.text == expected.text
    assert [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)] == pytest.approx(
        [lp[t].logprob for lp, t in zip(expected.logprobs, expected.token_ids)], abs=1e-4
    )
    assert merged.finished and completion.finish_reason == "length"


def test_text_is_tokenized_on_the_tokenizer_threads(async_engine, monkeypatch):
    tokenizer = async_engine.engine.tokenizer
    threads = []
    encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)

    async def run() -> None:
        async for _ in async_engine.generate({"prompt": "Hello there", "cache_salt": "s"}, GREEDY):
            pass

    asyncio.run(run())
    assert threads and all(name.startswith("kvbank-tokenizer") for name in threads), threads
    threads.clear()
    asyncio.run(_chat_in_process(async_engine, [{"role": "user", "content": "Hi"}]))
    assert threads and all(name.startswith("kvbank-tokenizer") for name in threads), threads


async def _chat_in_process(async_engine: AsyncEngine, messages: list[dict]) -> dict:
    app = build_app(async_engine, MODEL_NAME)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvbank") as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    return response.json()


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
    assert stats["num_used_blocks"] == 0  # its blocks are free again, or cached for a later prompt


def test_pinned_system_prompt_is_cached_on_first_use_and_salts_isolate(client):
    messages = [{"role": "system", "content": PINNED_SYSTEM}, {"role": "user", "content": "When do you open?"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens >= 16
    salted = [
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-x"}
        )
        for _ in range(2)
    ]
    assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
    assert salted[1].usage.prompt_tokens_details.cached_tokens >= 16
    assert salted[0].choices[0].message.content == first.choices[0].message.content


# --- request validation and the fields passed through ----------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "wizard", "content": "Hi"}], "messages.0.role"),
        ([{"role": "system", "content": "Be brief."}, {"role": "tool", "content": "42"}], "messages.1.role"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "user"}], "messages.0.content"),
    ],
)
def test_unknown_role_or_null_user_content_is_a_400_naming_the_field(base_url, messages, param):
    status, body = _post(f"{base_url}/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400
    assert _assert_openai_error(body)["param"] == param


def test_developer_role_is_accepted_as_the_system_message(client, reference):
    user = {"role": "user", "content": "Name a fruit."}
    expected = reference.chat([{"role": "system", "content": "Be brief."}, user], GREEDY)[0].outputs[0]
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "developer", "content": "Be brief."}, user],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.choices[0].message.content == expected.text


def test_seed_out_of_range_is_a_400_stating_the_range(base_url, client):
    status, body = _post(f"{base_url}/v1/completions", {"prompt": "Hi", "max_tokens": 2, "seed": 2**64})
    assert status == 400
    error = _assert_openai_error(body)
    assert error["param"] == "seed" and str(-(2**63)) in error["message"] and str(2**64 - 1) in error["message"]
    # Large seeds in range used to overflow when seeding the n completions.
    response = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, n=2, seed=2**64 - 1)
    assert len(response.choices) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("guided_json", {"type": "object"}),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"999999": 1}),
        ("stop_token_ids", [999999]),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(base_url, field, value):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
    status, response = _post(f"{base_url}/v1/chat/completions", body)
    assert status == 400
    assert _assert_openai_error(response)["param"] == field


def test_harmless_fields_and_plain_text_format_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        metadata={"k": "v"},
        store=False,
        response_format={"type": "text"},
        tool_choice="none",
    )
    assert response.choices[0].finish_reason == "length"


def test_stop_token_ids_min_tokens_and_special_tokens_pass_through(client, reference):
    prompt = "The capital of France is"
    greedy = reference.generate(prompt, GREEDY)[0].outputs[0].token_ids
    fields = dict(
        stop_token_ids=[greedy[3]], min_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True, stop=["."]
    )
    expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **fields))[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=fields
    )
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "stop" and choice.stop_reason == expected.outputs[0].stop_reason
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids) < len(greedy)


def _expected_prompt_logprobs(expected) -> list:
    return [None] + [
        entry[token].logprob for entry, token in zip(expected.prompt_logprobs[1:], expected.prompt_token_ids[1:])
    ]


def test_prompt_logprobs_come_back_per_choice(base_url, reference):
    prompt = "Paris is the capital of"
    expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    for route, body in (
        ("completions", {"prompt": prompt}),
        ("chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    ):
        status, response = _post(
            f"{base_url}/v1/{route}", {**body, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2}
        )
        assert status == 200, response
        for choice in response["choices"]:
            entries = choice["prompt_logprobs"]
            assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:])
            if route == "completions":
                tokens = expected.prompt_token_ids
                got = [None] + [e[str(t)]["logprob"] for e, t in zip(entries[1:], tokens[1:])]
                assert got == pytest.approx(_expected_prompt_logprobs(expected), abs=1e-4)
    status, events, _ = request(
        f"{base_url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    )
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    assert len(chunks[0]["choices"][0]["prompt_logprobs"]) == len(expected.prompt_token_ids)
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])


def test_echo_prepends_the_prompt_and_its_logprobs(client, reference):
    prompt = "The sky is"
    expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=1))[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = response.choices[0]
    assert choice.text == prompt + expected.outputs[0].text
    completion = expected.outputs[0]
    wanted = _expected_prompt_logprobs(expected) + [
        lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)
    ]
    assert choice.logprobs.token_logprobs == pytest.approx(wanted, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[len(expected.prompt_token_ids)] == len(prompt)
    streamed = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    assert streamed[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [lp for c in streamed for lp in c.choices[0].logprobs.token_logprobs] == pytest.approx(wanted, abs=1e-4)
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == choice.logprobs.text_offset


# --- --pin-prompt on a model whose tokenizer adds BOS ---------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bos_adding_checkpoint(tmp_path_factory):
    """A tiny random Llama whose tokenizer prepends BOS to text while its chat template writes none."""
    import transformers

    from kvbank.models.gguf_file import GGUFFile
    from kvbank.models.loader import bundled_model_path
    from kvbank.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("bos-model")
    tokenizer = Tokenizer.from_gguf(GGUFFile(bundled_model_path()))
    tokenizer.save(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(bos_token="<|endoftext|>", add_bos_token=True, chat_template=CHATML)
    config_path.write_text(json.dumps(config))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=tokenizer.vocab_size)).save_pretrained(folder)
    return folder


def test_pin_prompt_hits_chat_requests_on_a_bos_adding_model(bos_adding_checkpoint, kvbank_env, tmp_path):
    from kvbank.tokenizer import Tokenizer

    assert Tokenizer.from_folder(bos_adding_checkpoint).encode("a")[0] == 0, "the checkpoint must add BOS"
    pin_file = tmp_path / "system.txt"
    pin_file.write_text(f"{PINNED_SYSTEM}\n")
    log_path = tmp_path / "server.log"
    process, url = start_server(
        ["--model", str(bos_adding_checkpoint), "--dtype", "float32", "--pin-prompt", str(pin_file)],
        kvbank_env,
        log_path,
    )
    try:
        wait_healthy(process, url, log_path)
        pinned = int(re.search(r"pinned (\d+) tokens", log_path.read_text()).group(1))
        messages = [{"role": "system", "content": PINNED_SYSTEM}, {"role": "user", "content": "When do you open?"}]
        status, body = _post(f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    finally:
        stop_server(process)
    assert status == 200, body
    assert pinned >= 16
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == pinned


def test_evicting_policy_requests_are_bounded_by_default(base_url, reference):
    """A policy that evicts runs past the context, so the default --max-tokens-cap and the default
    prompt bound (twice the context) are what keep one request finite."""
    policy = "sink_window(sinks=4,window=64)"
    status, body = _post(
        f"{base_url}/v1/completions", {"prompt": "Hi", "max_tokens": 1_000_000_000, "kv_policy": policy}
    )
    assert status == 400 and _assert_openai_error(body)["param"] == "max_tokens", body
    assert "4096" in body["error"]["message"] and "--max-tokens-cap" in body["error"]["message"]
    limit = 2 * reference.engine.max_model_len
    status, body = _post(
        f"{base_url}/v1/completions", {"prompt": [1] * (limit + 1), "max_tokens": 1, "kv_policy": policy}
    )
    assert status == 400, body
    message = _assert_openai_error(body)["message"]
    assert str(limit + 1) in message and str(limit) in message and "--max-prompt-tokens" in message


def test_a_text_too_long_for_the_prompt_limit_is_refused_before_it_is_tokenized(base_url, reference):
    """8 MB of text: its byte count proves it over the limit (no token stands for more than
    `max_token_bytes` bytes), so it is refused at once rather than after the ~5 s its tokenizing takes."""
    limit = 2 * reference.engine.max_model_len
    per_token = reference.get_tokenizer().max_token_bytes
    assert per_token is not None and 2 <= per_token <= 200
    text = "word " * (8 * 2**20 // 5)
    assert len(text) > limit * per_token
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ):
        status, answer = _post(f"{base_url}{path}", body)
        assert status == 400, (path, answer)
        message = _assert_openai_error(answer)["message"]
        # the bound's own message (a count after tokenizing would be exact, 1,677,722 tokens)
        assert f"prompt of {len(text)} bytes has at least {-(-len(text) // per_token)} tokens" in message
        assert str(limit) in message and "--max-prompt-tokens" in message
    # Just under the bound it proves nothing: the text is tokenized and its real count decides.
    short = "word " * (limit * per_token // 5 - 1)
    status, answer = _post(f"{base_url}/v1/completions", {"prompt": short, "max_tokens": 1})
    assert status == 400 and "tokens, over this server's limit" in _assert_openai_error(answer)["message"]


def test_the_longest_token_bound_holds_for_what_the_tokenizer_produces(reference):
    tokenizer = reference.get_tokenizer()
    per_token = tokenizer.max_token_bytes
    for text in ("   " * 300, "a" * 5000, "😀" * 500, "<|im_start|>" * 100, "\n" * 1000, "ab12" * 900):
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text.encode()) / per_token
