"""Several API keys, each a tenant of its own in the scheduler's fair share of prefill: a real `kvbank
serve` process started with two keys, the tenants an in-process server hands the engine, and the fair
queue interleaving the requests of two tenants named in prompt dicts."""

import asyncio

import httpx
import pytest
from serving import request, served

from kvbank import LLM, SamplingParams
from kvbank.engine.prompts import MAX_TENANT_CHARS, parse_prompt
from kvbank.server import AsyncEngine, build_app
from kvbank.server.api import ServerLimits

KEYS = ("sk-tenant-one", "sk-tenant-two")
MODEL = "tenants-model"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tenants") / "server.log"
    args = ["--served-model-name", MODEL, "--log-level", "warning", "--num-gpu-blocks", "64", "--max-num-seqs", "2"]
    with served([*args, "--api-key", KEYS[0], "--api-key", KEYS[1]], kvbank_env, log_path) as url:
        yield url


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One sequence at a time: the order requests finish in is the order they were admitted in."""
    return LLM(num_gpu_blocks=64, max_num_seqs=1)


def test_either_key_is_accepted_and_a_wrong_one_gets_401(server):
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    status, body, _ = request(f"{server}/v1/completions", completion, headers=_auth(KEYS[0]))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "cache_salt": "s"}
    status, body, _ = request(f"{server}/v1/chat/completions", chat, headers=_auth(KEYS[1]))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body, _ = request(f"{server}/v1/completions", completion, headers=_auth("sk-tenant-three"))
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key"


def test_the_dashboard_signs_in_with_either_key(server):
    for key in KEYS:
        status, _, headers = request(f"{server}/dashboard/login", {"key": key})
        assert status == 204 and "kvbank_dashboard=" in headers["set-cookie"]


def test_each_key_and_each_salt_within_it_reaches_the_scheduler_as_its_own_tenant(llm):
    """The tenant of every request the engine runs, read on the engine thread while it runs: completions,
    a stream opened with one key, and a question asked of it with the other."""
    async_engine = AsyncEngine(llm.engine)
    seen: dict[str, str | None] = {}

    def record(outputs) -> None:
        for output in outputs:
            running = llm.engine.requests.get(output.request_id)
            if running is not None:
                seen[output.request_id] = running.tenant

    async_engine.observers.append(record)
    app = build_app(async_engine, MODEL, ServerLimits(api_key=list(KEYS)))

    async def post(client: httpx.AsyncClient, path: str, key: str, body: dict) -> dict:
        response = await client.post(path, json=body, headers=_auth(key))
        assert response.status_code == 200, response.text
        return response.json()

    async def run() -> dict[str, str | None]:
        completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "ignore_eos": True}
        question = {"question": "What is it?", "max_tokens": 2, "ignore_eos": True, "cache_salt": "s"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvbank") as client:
            one = await post(client, "/v1/completions", KEYS[0], completion)
            one_salted = await post(client, "/v1/completions", KEYS[0], {**completion, "cache_salt": "s"})
            two = await post(client, "/v1/completions", KEYS[1], completion)
            stream = await post(client, "/v1/streams", KEYS[0], {"system": "A log.", "cache_salt": "s"})
            asked = await post(client, f"/v1/streams/{stream['id']}/ask", KEYS[1], question)
            opened = await async_engine.call(lambda engine: engine.stream(stream["id"]).seq.request.tenant)
        tenants = {name: seen[f"{body['id']}-0"] for name, body in (("one", one), ("one_salted", one_salted))}
        return {**tenants, "two": seen[f"{two['id']}-0"], "stream": opened, "asked": seen[f"{asked['id']}-0"]}

    try:
        tenants = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert len({tenants["one"], tenants["one_salted"], tenants["two"]}) == 3, "two keys, a salt in one: three tenants"
    assert tenants["one"].split("/")[0] == tenants["one_salted"].split("/")[0] != tenants["two"].split("/")[0]
    assert tenants["stream"] == tenants["one_salted"], "a stream is its opener's key's, and its salt's within it"
    assert tenants["asked"].split("/") == [tenants["two"].split("/")[0], tenants["one_salted"].split("/")[1]]
    assert not any(key in tenant for key in KEYS for tenant in tenants.values()), "a tenant never shows a key"


def _finish_order(llm: LLM, prompts: dict[str, dict]) -> list[str]:
    engine, params = llm.engine, SamplingParams(max_tokens=1)
    ids = {engine.add_request(prompt, params).request_id: name for name, prompt in prompts.items()}
    order = []
    while engine.has_unfinished_requests():
        order += [ids[output.request_id] for output in engine.step() if output.finished]
    return order


def test_the_fair_queue_interleaves_the_tenants_prompt_dicts_name(llm):
    def prompts(tenant_a: str, tenant_b: str) -> dict[str, dict]:
        queued = {f"a{i}": (tenant_a, 100 + 10 * i) for i in range(3)} | {"b0": (tenant_b, 200)}
        return {name: {"prompt_token_ids": list(range(f, f + 5)), "tenant": t} for name, (t, f) in queued.items()}

    alone = _finish_order(llm, prompts("solo", "solo"))
    assert alone == ["a0", "a1", "a2", "b0"], "one tenant: the queue's own order"
    shared = _finish_order(llm, prompts("a", "b"))
    assert shared == ["a0", "b0", "a1", "a2"], "b's turn comes before a's second request"


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        (7, "tenant must be a string, not int"),
        ("", f"tenant has 0 characters; it must have 1 to {MAX_TENANT_CHARS}"),
        ("t" * (MAX_TENANT_CHARS + 1), f"tenant has {MAX_TENANT_CHARS + 1} characters"),
    ],
)
def test_a_bad_tenant_is_refused_naming_it(tenant, message):
    with pytest.raises(ValueError, match=message):
        parse_prompt({"prompt_token_ids": [1, 2], "tenant": tenant}, None, 10, tenant=True)


def test_a_tenant_is_refused_where_nothing_is_scheduled_for_it(llm):
    with pytest.raises(ValueError, match=r"unknown keys \['tenant'\]"):
        llm.engine.unpin_prefix({"prompt_token_ids": [1, 2], "tenant": "a"})
