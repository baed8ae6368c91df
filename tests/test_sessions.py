"""Session files (llama.cpp's slot save): a conversation's KV saved to one file, loaded into a fresh
engine and served from the prefix cache with identical outputs; damaged or foreign files refused."""

import asyncio
import dataclasses
import json
import os
import struct

import httpx
import pytest
from fastapi.testclient import TestClient
from serving import request, start_server, stop_server, wait_healthy

from kvbank import LLM, SamplingParams
from kvbank.cache import session
from kvbank.cache.prefix import root_hash
from kvbank.cache.session import read_session
from kvbank.cache.tiers import entry
from kvbank.server import AsyncEngine, build_app

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# About 140 tokens with the reply: eight whole blocks of 16 and a part block.
DOCUMENT = " ".join(
    [
        "The harbour office opens at six, the ferry leaves at seven and returns at noon,",
        "and the lighthouse keeper logs every ship that passes the northern rocks.",
    ]
    * 4
)


@pytest.fixture(scope="module")
def saver():
    return LLM(dtype="float32", num_gpu_blocks=64)


@pytest.fixture(scope="module")
def conversation(saver):
    return saver.generate(DOCUMENT, GREEDY)[0]


@pytest.fixture(scope="module")
def session_file(saver, conversation, tmp_path_factory):
    path = tmp_path_factory.mktemp("sessions") / "harbour.kv"
    saved = saver.save_session(conversation, path, cache_salt="tenant-a")
    assert saved == len(conversation.prompt_token_ids) + len(conversation.outputs[0].token_ids)
    return path


@pytest.fixture(scope="module")
def loader():
    """A second engine: nothing of the saver's pool is in it."""
    return LLM(dtype="float32", num_gpu_blocks=64)


def _tokens(output) -> list[int]:
    return [*output.prompt_token_ids, *output.outputs[0].token_ids]


def test_loaded_session_is_served_from_the_cache_with_identical_output(saver, conversation, session_file, loader):
    tokens = loader.load_session(session_file, cache_salt="tenant-a")
    assert tokens == _tokens(conversation)
    follow_up = {"prompt_token_ids": [*tokens, *saver.get_tokenizer().encode(" What time is it?")]}
    saver.engine.manager.enable_prefix_caching = False
    try:
        cold = saver.generate(follow_up, GREEDY)[0]
    finally:
        saver.engine.manager.enable_prefix_caching = True
    warm = loader.generate({**follow_up, "cache_salt": "tenant-a"}, GREEDY)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == len(tokens) // 16 * 16


def test_loading_twice_copies_nothing_new(session_file, loader):
    loader.load_session(session_file, cache_salt="tenant-a")
    free = loader.engine.manager.num_free_blocks
    states = loader.engine.block_states()
    loader.load_session(session_file, cache_salt="tenant-a")
    assert loader.engine.block_states() == states and loader.engine.manager.num_free_blocks == free


def test_saving_computes_a_prefix_the_pool_lacks(saver, tmp_path):
    text = "A prompt nobody has sent before, long enough to fill a couple of blocks of sixteen tokens each."
    tokens = saver.get_tokenizer().encode(text)
    assert saver.save_session(text, tmp_path / "fresh.kv") == len(tokens)
    assert saver.load_session(tmp_path / "fresh.kv") == tokens


def test_wrong_salt_is_refused(session_file, loader):
    for salt in (None, "tenant-b"):
        with pytest.raises(ValueError, match="another cache_salt"):
            loader.load_session(session_file, cache_salt=salt)


def test_flipped_byte_is_refused_naming_the_file(session_file, loader, tmp_path):
    blob = bytearray(session_file.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    damaged = tmp_path / "flipped.kv"
    damaged.write_bytes(blob)
    with pytest.raises(ValueError, match=f"{damaged}.*checksum"):
        loader.load_session(damaged, cache_salt="tenant-a")


def test_truncated_file_is_refused_naming_the_file(session_file, loader, tmp_path):
    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(session_file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{truncated}.*truncated"):
        loader.load_session(truncated, cache_salt="tenant-a")


def test_a_file_of_another_model_or_kv_format_is_refused(session_file, loader):
    engine = loader.engine
    root = root_hash(engine.cache_namespace, "tenant-a")
    for field, value, reason in (("model", "0" * 32, "model"), ("kv_format", "int8", "format")):
        foreign = dataclasses.replace(engine.entry_format, **{field: value})
        with pytest.raises(ValueError, match=f"{session_file} cannot be loaded: {reason}"):
            read_session(session_file, foreign, root)


@pytest.fixture(scope="module")
def small():
    return LLM(dtype="float32", num_gpu_blocks=4)


def test_a_pool_too_small_for_the_session_refuses_it_before_reading_it(session_file, small):
    with pytest.raises(ValueError, match=r"cannot be loaded: oversize: \d+ bytes, more than a pool of 4 blocks"):
        small.load_session(session_file, cache_salt="tenant-a")
    assert small.engine.manager.num_free_blocks == 4


def test_a_prompt_shorter_than_a_block_has_nothing_to_save(saver, tmp_path):
    with pytest.raises(ValueError, match="fills no block"):
        saver.save_session([1, 2, 3], tmp_path / "short.kv")


# --- files as untrusted input, and the tier key ---------------------------------------------------

SECRET = b"root:x:0:0:secret-bytes-of-another-file\n"


def test_a_session_file_is_written_0600_whatever_the_umask(saver, conversation, tmp_path):
    old = os.umask(0)
    try:
        saver.save_session(conversation, tmp_path / "private.kv")
    finally:
        os.umask(old)
    assert (tmp_path / "private.kv").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("target", ["secret", "session"])
def test_a_symlinked_session_file_is_refused_without_echoing_its_target(session_file, loader, tmp_path, target):
    secret = tmp_path / "passwd"
    secret.write_bytes(SECRET)
    link = tmp_path / "pw.kv"
    link.symlink_to(secret if target == "secret" else session_file)  # even a valid session is not followed
    with pytest.raises(ValueError, match=f"{link} cannot be loaded: a symbolic link") as refused:
        loader.load_session(link, cache_salt="tenant-a")
    assert "x:0:0" not in str(refused.value) and "secret-bytes" not in str(refused.value)


def test_a_file_that_is_no_session_is_refused_without_echoing_its_bytes(loader, tmp_path):
    other = tmp_path / "passwd.kv"
    other.write_bytes(SECRET * 10)
    with pytest.raises(ValueError, match="cannot be loaded: header: not a kvbank entry$") as refused:
        loader.load_session(other, cache_salt="tenant-a")
    assert "x:0:0" not in str(refused.value) and "secret-bytes" not in str(refused.value)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_is_refused_at_once(loader, tmp_path, kind):
    path = tmp_path / "odd.kv"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()  # a FIFO would block a plain open
    with pytest.raises(ValueError, match="cannot be loaded: header: not a regular file"):
        loader.load_session(path, cache_salt="tenant-a")


def test_an_oversized_file_is_refused_before_it_is_allocated(session_file, loader, tmp_path, monkeypatch):
    huge = tmp_path / "huge.kv"
    huge.write_bytes(session_file.read_bytes())
    os.truncate(huge, 1 << 40)  # sparse: a terabyte that takes no disk, with a valid prefix
    allocated = []
    monkeypatch.setattr(session, "bytearray", lambda n: allocated.append(n) or bytearray(n), raising=False)
    with pytest.raises(ValueError, match="cannot be loaded: oversize"):
        loader.load_session(huge, cache_salt="tenant-a")
    assert allocated == []
    loader.load_session(session_file, cache_salt="tenant-a")
    assert allocated == [session_file.stat().st_size]  # the spy sees the allocations it should


def _reheader(blob: bytes, edit) -> bytes:
    """The session file with its header changed by `edit` and a valid unkeyed checksum."""
    header_len, payload_len = struct.unpack_from("<IQ", blob, 8)
    text = edit(blob[entry.PREFIX_BYTES : entry.PREFIX_BYTES + header_len])
    text += b" " * (-(entry.PREFIX_BYTES + len(text)) % 16)
    fields = struct.pack("<4sHHIQ", entry.MAGIC, entry.VERSION, 0, len(text), payload_len)
    body = text + blob[entry.PREFIX_BYTES + header_len :]
    return fields + entry.digest(None, fields, body) + body


def _edit_json(change):
    def edit(text: bytes) -> bytes:
        header = json.loads(text)
        change(header)
        return json.dumps(header).encode()

    return edit


HOSTILE_HEADERS = {
    "missing model": _edit_json(lambda h: h.pop("model")),
    "nested 10,000 deep": lambda text: b"[" * 10_000 + b"]" * 10_000,
    "token ids as text": _edit_json(lambda h: h.update(token_ids=[str(t) for t in h["token_ids"]])),
    "kind as a list": _edit_json(lambda h: h.update(kind=["session"])),
    "position as null": _edit_json(lambda h: h.update(position=None)),
}


@pytest.mark.parametrize("name", HOSTILE_HEADERS)
def test_a_hostile_header_with_a_valid_checksum_is_a_value_error(session_file, loader, tmp_path, name):
    hostile = tmp_path / "hostile.kv"
    hostile.write_bytes(_reheader(session_file.read_bytes(), HOSTILE_HEADERS[name]))
    with pytest.raises(ValueError, match=f"{hostile} cannot be loaded: header: "):
        loader.load_session(hostile, cache_salt="tenant-a")


def test_reheadering_alone_keeps_a_session_loadable(session_file, loader, tmp_path):
    """The hostile headers above are refused for their flaw, not for how they are rewritten."""
    same = tmp_path / "same.kv"
    same.write_bytes(_reheader(session_file.read_bytes(), _edit_json(lambda h: None)))
    assert loader.load_session(same, cache_salt="tenant-a") == loader.load_session(session_file, cache_salt="tenant-a")


TIER_KEY = "a-tier-key-of-32-characters-----"


@pytest.fixture(scope="module")
def keyed():
    return LLM(dtype="float32", num_gpu_blocks=64, kv_tier_key=TIER_KEY)


@pytest.fixture(scope="module")
def keyed_file(keyed, conversation, tmp_path_factory):
    path = tmp_path_factory.mktemp("keyed") / "harbour.kv"
    keyed.save_session(_tokens(conversation), path)
    return path


def test_a_keyed_engine_loads_its_own_signed_session(keyed, keyed_file, conversation):
    assert keyed.load_session(keyed_file) == _tokens(conversation)


def test_signed_and_unsigned_sessions_are_refused_by_the_other_kind_of_engine(keyed, keyed_file, loader, session_file):
    with pytest.raises(ValueError, match="mac: the entry is signed with a tier key, and this engine has no tier key"):
        loader.load_session(keyed_file)
    with pytest.raises(ValueError, match="mac: the entry is not signed, and this engine has a tier key"):
        keyed.load_session(session_file, cache_salt="tenant-a")


def test_a_signed_session_is_refused_under_another_key(keyed, keyed_file):
    root = root_hash(keyed.engine.cache_namespace, None)
    other = dataclasses.replace(keyed.engine.entry_format, key=entry.tier_key("another-key-of-enough-characters"))
    with pytest.raises(ValueError, match="mac: the MAC does not match the tier key"):
        read_session(keyed_file, other, root)
    read_session(keyed_file, keyed.engine.entry_format, root)


def test_a_signed_session_rewritten_without_the_key_is_refused(keyed, keyed_file, tmp_path):
    blob = bytearray(keyed_file.read_bytes())
    header_len, payload_len = struct.unpack_from("<IQ", blob, 8)
    blob[entry.PREFIX_BYTES + header_len :] = bytes(payload_len)  # zeroed K/V
    for flags in (entry.KEYED, 0):  # still claiming the key, or an honest unkeyed checksum
        fields = struct.pack("<4sHHIQ", entry.MAGIC, entry.VERSION, flags, header_len, payload_len)
        blob[: entry.PREFIX_BYTES] = fields + entry.digest(None, fields, blob[entry.PREFIX_BYTES :])
        forged = tmp_path / "forged.kv"
        forged.write_bytes(blob)
        with pytest.raises(ValueError, match=f"{forged} cannot be loaded: mac: "):
            keyed.load_session(forged)


# --- the server ----------------------------------------------------------------------------------

KEY = "sk-sessions-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


# A float32 session of DOCUMENT is about 6 MB: a tenant fits one and a short one, not two of them.
MAX_SESSIONS = 2
QUOTA_GB = 0.008
QUOTA_BYTES = int(QUOTA_GB * 2**30)
SALT_A, SALT_B = "salt-of-tenant-a", "salt-of-tenant-b"
SHORT = (
    "Every ship that passes the northern rocks is logged by the lighthouse keeper, who opens the harbour office at six."
)


def _start(kvbank_env, session_dir, log_path, *flags: str):
    return start_server(
        ["--dtype", "float32", "--api-key", KEY, "--session-dir", str(session_dir), "--log-level", "warning", *flags],
        kvbank_env,
        log_path,
    )


def _post(url: str, body: dict, headers: dict | None = AUTH) -> tuple[int, dict]:
    status, response, _ = request(url, body, headers)
    return status, response


def test_session_saved_on_one_server_is_a_cache_hit_after_a_restart(kvbank_env, tmp_path, request):
    sessions = tmp_path / "sessions"
    # The second server loads while the first one serves (a server process loads on one core); it is
    # asked nothing until the first has stopped, as after a restart.
    first, second = (_start(kvbank_env, sessions, tmp_path / f"{name}.log") for name in ("first", "second"))
    request.addfinalizer(lambda: stop_server(second[0]))
    process, url = first
    try:
        wait_healthy(process, url, tmp_path / "first.log")
        assert _post(f"{url}/v1/sessions/save", {"session": "doc", "prompt": DOCUMENT}, headers=None)[0] == 401
        status, saved = _post(f"{url}/v1/sessions/save", {"session": "doc", "prompt": DOCUMENT, "cache_salt": "t"})
    finally:
        stop_server(process)
    assert status == 200, saved
    assert saved["session"] == "doc" and saved["tokens"] > 100
    (doc,) = sessions.glob("*/doc.kv")  # the salted tenant's folder, not named after the salt
    assert doc.parent.name != "t" and saved["bytes"] == doc.stat().st_size
    (doc.parent / "bad.kv").write_bytes(doc.read_bytes()[:-1])

    process, url = second
    try:
        wait_healthy(process, url, tmp_path / "second.log")
        restore = f"{url}/v1/sessions/restore"
        missing = _post(restore, {"session": "nope"})
        truncated = _post(restore, {"session": "bad", "cache_salt": "t"})
        wrong_salt = _post(restore, {"session": "doc", "cache_salt": "u"})
        bad_name = _post(restore, {"session": ".hidden"})
        no_prompt = _post(f"{url}/v1/sessions/save", {"session": "x"})
        restored = _post(restore, {"session": "doc", "cache_salt": "t"})
        completion = _post(
            f"{url}/v1/completions", {"prompt": DOCUMENT, "max_tokens": 1, "temperature": 0, "cache_salt": "t"}
        )
    finally:
        stop_server(process)
    assert missing[0] == 404 and "'nope' does not exist" in missing[1]["error"]["message"]
    assert truncated[0] == 422 and "session 'bad' cannot be loaded: truncated" in truncated[1]["error"]["message"]
    assert wrong_salt[0] == 404 and wrong_salt[1]["error"]["message"] == "session 'doc' does not exist"
    assert bad_name[0] == 400 and bad_name[1]["error"]["param"] == "session"
    assert no_prompt[0] == 400 and "exactly one of prompt" in no_prompt[1]["error"]["message"]
    assert restored == (200, {"session": "doc", "tokens": saved["tokens"]})
    assert completion[0] == 200, completion
    assert completion[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (saved["tokens"] - 1) // 16 * 16


def test_without_a_session_dir_the_routes_say_so(small):
    async_engine = AsyncEngine(small.engine)
    try:
        with TestClient(build_app(async_engine, "m")) as client:
            for route, body in (("save", {"session": "doc", "prompt": "Hi"}), ("restore", {"session": "doc"})):
                response = client.post(f"/v1/sessions/{route}", json=body)
                assert response.status_code == 400
                assert "sessions need --session-dir" in response.json()["error"]["message"]
    finally:
        async_engine.shutdown()


def test_a_save_while_another_request_runs_leaves_that_request_exact(saver, loader, tmp_path):
    """The save runs on the engine thread between steps, computing its prefix as one more request."""
    busy = {"prompt": "Count slowly: one, two, three,", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = saver.generate(busy["prompt"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    async_engine = AsyncEngine(loader.engine)

    async def both() -> tuple[httpx.Response, httpx.Response]:
        app = build_app(async_engine, "m", session_dir=tmp_path)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            running = asyncio.create_task(client.post("/v1/completions", json=busy))
            await asyncio.sleep(0.5)
            saved = await client.post("/v1/sessions/save", json={"session": "s", "prompt": DOCUMENT + " Again."})
            chat = await client.post("/v1/sessions/save", json={"session": "chat", "messages": messages})
            return await running, saved, chat

    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "When does the ferry leave?"}]
    try:
        completion, saved, chat = asyncio.run(both())
    finally:
        async_engine.shutdown()
    # The conversation so far, without the assistant's opening: the next turn's prompt starts with it.
    assert chat.json()["tokens"] == len(loader.render_chat(messages, add_generation_prompt=False)), chat.text
    assert saved.status_code == 200, saved.text
    assert saved.json()["bytes"] == (tmp_path / "s.kv").stat().st_size
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == alone.outputs[0].text


@pytest.fixture(scope="module")
def tenant_server(kvbank_env, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    flags = ("--max-sessions-per-tenant", str(MAX_SESSIONS), "--max-session-gb-per-tenant", str(QUOTA_GB))
    process, url = _start(kvbank_env, folder / "sessions", folder / "server.log", *flags)
    try:
        wait_healthy(process, url, folder / "server.log")
        yield url, folder / "sessions"
    finally:
        stop_server(process)


def _save(url: str, name: str, prompt: str, salt: str | None) -> tuple[int, dict]:
    return _post(f"{url}/v1/sessions/save", {"session": name, "prompt": prompt, "cache_salt": salt})


def _restore(url: str, name: str, salt: str | None) -> tuple[int, dict]:
    return _post(f"{url}/v1/sessions/restore", {"session": name, "cache_salt": salt})


def test_two_tenants_each_keep_and_restore_their_own_session_of_one_name(tenant_server):
    url, folder = tenant_server
    status_a, a = _save(url, "shared", DOCUMENT, SALT_A)
    status_b, b = _save(url, "shared", SHORT, SALT_B)
    assert (status_a, status_b) == (200, 200), (a, b)
    assert a["tokens"] != b["tokens"]
    assert _restore(url, "shared", SALT_A) == (200, {"session": "shared", "tokens": a["tokens"]})
    assert _restore(url, "shared", SALT_B) == (200, {"session": "shared", "tokens": b["tokens"]})
    status, missing = _restore(url, "shared", None)  # the default tenant has no session of that name
    assert status == 404 and missing["error"]["message"] == "session 'shared' does not exist"
    assert not any(salt in str(path) for path in folder.rglob("*") for salt in (SALT_A, SALT_B))
    tenants = [path for path in folder.iterdir() if path.is_dir()]
    assert len(tenants) >= 2 and all(path.stat().st_mode & 0o777 == 0o700 for path in tenants)  # private
    assert _post(f"{url}/v1/sessions/delete", {"session": "shared", "cache_salt": SALT_B}) == (
        200,
        {"session": "shared", "deleted": True},
    )
    assert _restore(url, "shared", SALT_B)[0] == 404
    assert _restore(url, "shared", SALT_A) == (200, {"session": "shared", "tokens": a["tokens"]})
    assert _post(f"{url}/v1/sessions/delete", {"session": "shared", "cache_salt": SALT_B})[0] == 404


def test_a_tenant_past_its_session_count_or_bytes_is_refused_and_others_are_not(tenant_server):
    url, _ = tenant_server
    salt = "salt-of-tenant-c"
    status, big = _save(url, "big", DOCUMENT, salt)
    assert status == 200, big
    status, short = _save(url, "short", SHORT, salt)
    assert status == 200, short
    assert big["bytes"] + short["bytes"] <= QUOTA_BYTES < 2 * big["bytes"], "the quota this test needs"
    status, over_count = _save(url, "third", SHORT, salt)
    assert status == 429 and over_count["error"]["code"] == "too_many_sessions", over_count
    assert "--max-sessions-per-tenant" in over_count["error"]["message"]
    assert _save(url, "big", DOCUMENT, salt)[0] == 200, "saving over one's own session counts it once"
    assert _save(url, "third", SHORT, "salt-of-tenant-d")[0] == 200, "another tenant's quota is its own"
    assert _post(f"{url}/v1/sessions/delete", {"session": "short", "cache_salt": salt})[0] == 200
    status, over_bytes = _save(url, "big2", DOCUMENT, salt)
    assert status == 507 and over_bytes["error"]["code"] == "session_quota_exceeded", over_bytes
    assert "--max-session-gb-per-tenant" in over_bytes["error"]["message"]
    assert _restore(url, "big", salt)[0] == 200 and _restore(url, "big2", salt)[0] == 404
