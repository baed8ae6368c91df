"""Request bodies cannot stall or crash the server: every list in a body is counted against its
limit before any item is looked at, and text that is not valid Unicode (JSON's "\\ud800" escapes
without their pair) or a token id outside the vocabulary is a 400 naming the field, never a 500.
Every test talks HTTP to one real server process."""

import re

import pytest
from serving import request, served

LIMIT = 64  # --max-prompt-tokens
LONE = "\ud800"
#: one id over the limit, the last one out of range: only a count taken first names the count
OVER = [1] * LIMIT + [-1]
#: what an admitted request moves
ENGINE_COUNTERS = ("kvbank:prompt_tokens_total", "kvbank:prefix_cache_queries_total", "kvbank:request_success_total")


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bodies")
    log_path = folder / "server.log"
    with served(
        [
            "--log-level",
            "warning",
            "--max-model-len",
            "256",
            "--num-gpu-blocks",
            "64",
            "--max-prompt-tokens",
            str(LIMIT),
            "--session-dir",
            str(folder / "sessions"),
        ],
        kvbank_env,
        log_path,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def stream(server):
    status, body, _ = request(f"{server}/v1/streams", {"system": "You watch a feed."})
    assert status == 200, body
    return body["id"]


def _post(server: str, stream: str, path: str, body: dict) -> dict:
    """The 400 a body gets (sent with JSON's escapes, as `json.dumps` writes lone surrogates), in OpenAI's shape."""
    url = f"{server}/v1/streams/{stream}/{path}" if path in ("frames", "ask") else f"{server}{path}"
    status, answer, _ = request(url, body)
    assert status == 400, (path, body, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def _engine_counters(server: str) -> dict[str, float]:
    status, text, _ = request(f"{server}/metrics")
    assert status == 200
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(values[name]) for name in ENGINE_COUNTERS}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/sessions/save", {"session": "long", "prompt_token_ids": OVER}, "prompt_token_ids"),
        ("/v1/sessions/save", {"session": "long", "prompt": OVER}, "prompt"),
        ("/v1/completions", {"prompt": OVER, "echo": True, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], OVER], "max_tokens": 1}, "prompt.1"),
        ("/v1/streams", {"system": OVER}, "system"),
        ("frames", {"token_ids": OVER}, "token_ids"),
        ("ask", {"question": OVER, "max_tokens": 1}, "question"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}] * (LIMIT + 1)}, "messages"),
    ],
)
def test_a_list_one_over_the_prompt_limit_is_a_400_naming_count_and_limit(server, stream, path, body, param):
    before = _engine_counters(server)
    error = _post(server, stream, path, body)
    assert error["param"] == param
    assert f"has {LIMIT + 1} " in error["message"] and f"limit of {LIMIT} " in error["message"], error
    assert _engine_counters(server) == before, "the engine never saw the request"


def test_fixed_bounds_refuse_a_list_before_its_items_are_parsed(server, stream):
    error = _post(server, stream, "/v1/completions", {"prompt": "Hi", "stop": [LONE] * 65})
    assert error["param"] == "stop" and "has 65 strings; at most 64" in error["message"], error
    error = _post(server, stream, "/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(1025)}})
    assert error["param"] == "logit_bias" and "has 1025 entries; at most 1024" in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a" + LONE}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", LONE]}, "prompt.1"),
        ("/v1/completions", {"prompt": "Hi", "cache_salt": LONE}, "cache_salt"),
        ("/v1/completions", {"prompt": "Hi", "model": LONE}, "model"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["fine", LONE]}, "stop"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {LONE: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "Hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": LONE}]}, "messages.0.name"),
        ("/v1/sessions/save", {"session": "s", "prompt": LONE}, "prompt"),
        ("/v1/sessions/save", {"session": "s", "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        ("/v1/sessions/save", {"session": "s", "prompt": "Hi", "cache_salt": LONE}, "cache_salt"),
        ("/v1/sessions/restore", {"session": "s", "cache_salt": LONE}, "cache_salt"),
        ("/v1/streams", {"system": LONE}, "system"),
        ("/v1/streams", {"system": "Hi", "separator": LONE}, "separator"),
        ("frames", {"text": LONE}, "text"),
        ("ask", {"question": LONE, "max_tokens": 1}, "question"),
        ("ask", {"question": "Hi?", "max_tokens": 1, "cache_salt": LONE}, "cache_salt"),
    ],
)
def test_lone_surrogates_are_400s_naming_the_field(server, stream, path, body, param):
    error = _post(server, stream, path, body)
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_a_lone_surrogate_in_a_content_part_is_a_400(server, stream):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}
    error = _post(server, stream, "/v1/chat/completions", body)
    assert error["param"].startswith("messages.0.content") and "lone surrogate" in error["message"], error


@pytest.mark.parametrize("token", [-1, 2**64, 49152])
def test_echo_of_an_id_outside_the_vocabulary_is_a_400_naming_it(server, stream, token):
    body = {"prompt": [1, token], "echo": True, "logprobs": 1, "max_tokens": 1}
    error = _post(server, stream, "/v1/completions", body)
    assert error["param"] == "prompt", error
    assert re.search(rf"prompt\[1\]={token} is out of range \[0, \d+\)", error["message"]), error


def test_echo_of_ids_in_the_vocabulary_shows_their_text(server):
    ids = [504, 3032, 314, 260]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
    status, answer, _ = request(f"{server}/v1/completions", body)
    assert status == 200 and answer["usage"]["prompt_tokens"] == len(ids), answer
    choice = answer["choices"][0]
    shown = "".join(choice["logprobs"]["tokens"][: len(ids)])
    assert shown.strip() and choice["text"].startswith(shown), choice


def test_priority_is_a_request_field_and_a_bad_one_is_a_400_naming_it(server, stream):
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    status, answer, _ = request(f"{server}/v1/completions", {**body, "priority": -5})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    asked = request(f"{server}/v1/streams/{stream}/ask", {"question": "Seen?", "max_tokens": 1, "priority": 3})
    assert asked[0] == 200, asked[1]
    assert _post(server, stream, "/v1/completions", {**body, "priority": 2**40})["param"] == "priority"
    assert _post(server, stream, "/v1/completions", {**body, "priority": "high"})["param"] == "priority"
