"""What a store's writer, a client or a listener can get at: oversized Redis values refused before they are read,
session folders that refuse planted links and other users' folders, secrets kept out of every output and the
command line, session quotas per client and per folder, the session listing, and KV events kept to loopback."""

import dataclasses
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import redis
import zmq
from serving import free_port, start_server, stop_server, wait_healthy
from starlette.requests import Request

from kvbank import LLM, SamplingParams, cli
from kvbank.cache.events import build_events
from kvbank.cache.session import SessionFolder, UnsafeFolder
from kvbank.cache.tiers.disk import DiskTier
from kvbank.cache.tiers.entry import KEYED, EntryFormat, EntryInfo, pack, unpack
from kvbank.cache.tiers.redis import RedisTier, redacted
from kvbank.config import EngineConfig
from kvbank.server.bodies import tenant_of
from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits
from kvbank.server.quotas import Reservation, SessionQuotas, client_of

pytest_plugins = ["redis_servers"]  # redis_server, redis_cluster

FORMAT = EntryFormat("m", "bfloat16", "auto", 16, (("bfloat16", (16, 3, 64)),))
JUNK_BYTES = 8 * 2**20


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def entry_of(i: int, blocks: int = 2) -> bytes:
    info = EntryInfo(key(i), bytes(16), 0, blocks, tuple(range(blocks * 16)))
    return bytes(pack(FORMAT, info, lambda views: [v.fill_(i) for v in views]).numpy())


def sent_bytes(nodes) -> int:
    """What the Redis servers have sent to clients so far, over every node."""
    total = 0
    for node in nodes:
        with node.client() as client:
            total += client.info("stats")["total_net_output_bytes"]
    return total


# --- the Redis tier: a value larger than its entry is refused unread --------------------------------------------


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "redis-py"])
@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_a_redis_value_larger_than_its_entry_is_refused_before_it_is_read(server, direct_reads, request):
    servers = request.getfixturevalue(server)
    nodes = getattr(servers, "nodes", [servers])
    tier = RedisTier(servers.url, f"guard-{server}-{direct_reads}", timeout_seconds=5, direct_reads=direct_reads)
    try:
        good, planted = entry_of(1), entry_of(2)
        assert tier.put([(key(1), good), (key(2), planted)]) == 2
        name = tier.prefix + key(2).hex()
        with redis_client(servers) as client:
            client.append(name, b"\0" * JUNK_BYTES)  # an existing entry, grown by whoever can write the Redis
        limit = FORMAT.max_entry_bytes(2)
        before = sent_bytes(nodes)

        got = tier.get([key(1), key(2), key(3)], [limit] * 3)

        sent = sent_bytes(nodes) - before
        assert got[0] == good and got[1:] == [None, None]
        assert unpack(FORMAT, got[0])[0].key == key(1)
        # the good entry, at most one byte over the limit of the other, and the INFO replies that measure it
        assert sent < len(good) + limit + 64 * 1024, f"Redis sent {sent} bytes for a {JUNK_BYTES}-byte value"
        assert (tier.stats.hits, tier.stats.misses, tier.stats.corrupt) == (1, 2, 1)
        assert tier.contains([key(1), key(2)]) == [True, False], "the oversized value is deleted"
    finally:
        tier.close()


def redis_client(servers) -> redis.Redis | redis.RedisCluster:
    """A plain client of the server, or of the cluster (which routes each key to its node)."""
    return redis.RedisCluster.from_url(servers.url) if hasattr(servers, "nodes") else servers.client()


def test_engine_loads_refuse_an_oversized_chunk_and_warn_of_a_redis_without_a_key(redis_server, caplog):
    with caplog.at_level(logging.WARNING, logger="kvbank"):
        llm = LLM(num_gpu_blocks=32, kv_redis_url=redis_server.url, kv_tier_chunk_tokens=32)
    assert "the Redis tier has no tier key: whoever can write that Redis can change" in caplog.text
    prompt = "The harbour office opens at six and the ferry leaves at seven, " * 4
    params = SamplingParams(temperature=0, max_tokens=1)
    try:
        llm.generate(prompt, params)
        assert llm.engine.offload.flush()
        with redis_server.client() as client:
            names = client.keys("kvbank:*")
            assert names, "the chunks reached Redis"
            for name in names:
                client.append(name, b"\0" * JUNK_BYTES)
        llm.reset_prefix_cache()
        before = sent_bytes([redis_server])
        output = llm.generate(prompt, params)[0]
        sent = sent_bytes([redis_server]) - before
        stats = llm.tier_stats()["redis"]
    finally:
        llm.close()
    assert output.num_cached_tokens == 0, "nothing was loaded: the prompt was computed"
    assert stats["corrupt"] >= 1 and stats["load_bytes"] == 0
    assert sent < len(names) * 2 * 2**20, f"Redis sent {sent} bytes for values of {JUNK_BYTES} each"


def test_a_disk_file_larger_than_its_entry_is_removed_unread(tmp_path):
    tier = DiskTier(tmp_path / "tier", 2**30)
    tier.put([(key(1), entry_of(1, blocks=16))])
    assert tier.get([key(1)], [FORMAT.max_entry_bytes(2)]) == [None]
    assert tier.stats.corrupt == 1 and tier.contains([key(1)]) == [False]


# --- secrets: masked in every output, and not needed on the command line ----------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://app:p@ss@word@cache:6379", "redis://app:***@cache:6379"),  # '@' in the password
        ("rediss://app:pa/ss?w#rd@cache:6379", "rediss://app:***@cache:6379"),  # what a URL parser would split
        ("redis://hunter2@cache", "redis://***@cache"),
        ("unix:///run/redis.sock?db=1&password=hunter2", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_every_credential_of_a_url_is_masked(url, shown):
    assert redacted(url) == shown
    assert redacted(f"cannot reach {url} now") == f"cannot reach {shown} now"


def test_secrets_come_from_files_and_stay_out_of_repr(tmp_path):
    key_file, url_file = tmp_path / "tier.key", tmp_path / "redis.url"
    key_file.write_text("a-tier-key-of-32-characters-----\n")
    url_file.write_text("redis://:hunter2@127.0.0.1:1\n")
    config = EngineConfig(kv_tier_key_file=str(key_file), kv_redis_url_file=str(url_file))
    assert config.kv_tier_key == "a-tier-key-of-32-characters-----" and config.kv_tier_key_file is None
    assert config.kv_redis_url == "redis://:hunter2@127.0.0.1:1"
    assert "hunter2" not in repr(config) and "32-characters" not in repr(config)
    assert dataclasses.replace(config).kv_tier_key == config.kv_tier_key  # read once: a copy does not read again
    with pytest.raises(ValueError, match="kv_tier_key and kv_tier_key_file are both given"):
        EngineConfig(kv_tier_key="a-tier-key-of-32-characters-----", kv_tier_key_file=str(key_file))
    with pytest.raises(ValueError, match=r"api_key_file '.*missing' cannot be read: No such file"):
        ServerLimits(api_key_file=str(tmp_path / "missing"))
    assert "sk-" not in repr(ServerLimits(api_key="sk-secret"))


def test_help_says_command_line_secrets_are_visible_and_names_their_other_sources(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--api-key KEY", "--kv-tier-key KEY", "--kv-redis-url URL"):
        help_text = text[text.index(f"{flag} ") :][:700]  # its description (the usage line has "KEY]")
        assert "visible to other local users" in help_text and f"{flag.split()[0]}-file" in help_text, flag
    assert "$KVBANK_REDIS_URL" in text and "token ids to whoever connects" in text


# --- KV events: loopback unless public, hashes only on request ---------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.7:5557", "tcp://eth0:5557"])
def test_kv_events_beyond_loopback_need_public(endpoint):
    with pytest.raises(ValueError, match=re.escape(f"kv_events_endpoint='{endpoint}' is not a loopback address")):
        EngineConfig(kv_events_endpoint=endpoint)
    assert EngineConfig(kv_events_endpoint=endpoint, kv_events_public=True).kv_events_public
    for local in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557", "ipc:///tmp/kv.sock"):
        EngineConfig(kv_events_endpoint=local)


def test_hashes_only_events_keep_the_vllm_shape_without_token_ids():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = build_events(endpoint, None, "", 16, "cpu", token_ids=False)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        stored = None
        deadline = time.monotonic() + 30
        while stored is None:  # a PUB socket drops what it sends before the subscriber has joined
            assert time.monotonic() < deadline, "no event arrived"
            publisher.stored(key(7), key(6), list(range(16)))
            publisher.flush()
            while stored is None and sub.poll(200):
                _, _, payload = sub.recv_multipart()
                stored = next((e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"), None)
    finally:
        publisher.close()
        sub.close()
        context.term()
    _, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = stored
    assert hashes == [7] and parent == 6 and token_ids == [] and block_size == 16 and medium == "CPU"


# --- who a client is ---------------------------------------------------------------------------------------------


def _request(host: str, authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "client": (host, 4000)})


def test_a_client_is_its_address_and_the_fingerprint_of_its_key():
    alice, bob = client_of(_request("10.1.2.3", "Bearer sk-alice")), client_of(_request("10.1.2.3", "Bearer sk-bob"))
    assert alice != bob and alice.startswith("10.1.2.3 key ") and "sk-alice" not in alice
    assert client_of(_request("10.1.2.3", "Bearer sk-alice")) == alice
    assert client_of(_request("10.1.2.3")) == "10.1.2.3"
    assert client_of(_request("2001:db8::1")) == client_of(_request("2001:db8::ffff")) == "2001:db8::/64"
    assert client_of(_request("::ffff:10.1.2.3")) == "10.1.2.3"


def test_quotas_count_saves_still_being_written():
    quotas = SessionQuotas(ServerLimits(max_session_gb=1000 / 2**30))
    first = quotas.reserve({}, Reservation("tenant-a", "s", "alice", 600))
    with pytest.raises(APIError) as refused:  # another tenant, another client: only the folder's cap is shared
        quotas.reserve({"tenant-a": {"s": 100}}, Reservation("tenant-b", "s", "bob", 600))
    assert refused.value.status == 507 and "(--max-session-gb " in refused.value.message
    quotas.settle(first, saved=True)
    quotas.reserve({"tenant-a": {"s": 600}}, Reservation("tenant-a", "s", "bob", 900))  # replaces it: fits


# --- the session folder ------------------------------------------------------------------------------------------


def test_a_session_folder_others_may_write_is_refused_and_links_under_it_are_not_entered(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        SessionFolder(shared)
    folder = SessionFolder(tmp_path / "sessions")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (folder.directory / "tenant-x").symlink_to(elsewhere)
    with pytest.raises(UnsafeFolder, match="not a directory"), folder.opened("tenant-x", create=True):
        pass
    assert list(folder.all_files()) == [None]  # the link is not a tenant's folder


def test_serve_refuses_a_session_dir_others_may_write(kvbank_env, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    args = ["serve", "--session-dir", str(shared), "--num-gpu-blocks", "16", "--port", str(free_port())]
    result = subprocess.run(
        [sys.executable, "-m", "kvbank", *args], capture_output=True, text=True, env=kvbank_env, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"session directory '{shared}' is writable by group or others" in result.stderr


# --- a real server: secrets, planted links, quotas per client and per folder, the listing ------------------------

API_KEY = "sk-store-guard-api-key"
TIER_KEY = "store-guard-tier-key-32-chars---"
REDIS_PASSWORD = "p@ss-w0rd@redis"
SHORT = "Every ship that passes the northern rocks is logged by the lighthouse keeper at the harbour. " * 2
BIG = " ".join(["The harbour office opens at six, the ferry leaves at seven and returns at noon."] * 8)
CLIENT_GB = 0.004  # one BIG session (about 3 MB of bfloat16 K/V) fits a client, two do not
CLIENT_BYTES = int(CLIENT_GB * 2**30)


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    folder = tmp_path_factory.mktemp("guard")
    (folder / "api.key").write_text(API_KEY + "\n")
    (folder / "tier.key").write_text(TIER_KEY + "\n")
    redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}"  # nothing listens: the tier is down
    env = {**kvbank_env, "KVBANK_REDIS_URL": redis_url}
    log = folder / "server.log"
    flags = ["--session-dir", str(folder / "sessions"), "--api-key-file", str(folder / "api.key")]
    flags += ["--kv-tier-key-file", str(folder / "tier.key"), "--num-gpu-blocks", "128", "--max-model-len", "1024"]
    flags += ["--max-sessions-per-client", "2", "--max-session-gb-per-client", str(CLIENT_GB), "--max-sessions", "3"]
    process, url = start_server(flags, env, log)
    try:
        wait_healthy(process, url, log)
        yield {"url": url, "process": process, "log": log, "sessions": folder / "sessions", "outside": folder}
    finally:
        stop_server(process)


@pytest.fixture
def guard(server):
    """The server, with the session folder emptied after each test (quotas count the whole folder)."""
    yield server
    for path in server["sessions"].rglob("*"):
        if path.is_symlink() or path.is_file():
            path.unlink()


def call(server, method: str, path: str, body=None, source: str = "127.0.0.1", auth: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
    transport = httpx.HTTPTransport(local_address=source)  # another loopback address: another client
    with httpx.Client(transport=transport, timeout=120) as client:
        return client.request(method, f"{server['url']}{path}", json=body, headers=headers)


def save(server, name: str, prompt: str, salt: str | None = None, source: str = "127.0.0.1") -> httpx.Response:
    return call(server, "POST", "/v1/sessions/save", {"session": name, "prompt": prompt, "cache_salt": salt}, source)


def test_secrets_stay_off_the_command_line_and_out_of_server_info_and_the_log(guard):
    cmdline = Path(f"/proc/{guard['process'].pid}/cmdline").read_bytes().decode()
    assert all(secret not in cmdline for secret in (API_KEY, TIER_KEY, REDIS_PASSWORD))
    assert call(guard, "GET", "/server_info", auth=False).status_code == 401, "the key from the file is required"
    info = call(guard, "GET", "/server_info")
    assert info.status_code == 200
    shown = info.text
    assert all(secret not in shown for secret in (API_KEY, TIER_KEY, REDIS_PASSWORD, "w0rd"))
    assert info.json()["kv_redis_url"].startswith("redis://:***@127.0.0.1:")
    assert "api_key" not in info.json() and "kv_tier_key" not in info.json()
    saved = save(guard, "signed", SHORT)  # a request that tries the (unreachable) Redis tier, and a signed file
    assert saved.status_code == 200, saved.text
    assert (guard["sessions"] / "signed.kv").read_bytes()[6] & KEYED, "signed with the key from the file"
    log = guard["log"].read_text()
    assert "redis tier at redis://:***@127.0.0.1:" in log
    assert all(secret not in log for secret in (API_KEY, TIER_KEY, REDIS_PASSWORD, "w0rd"))


def test_a_planted_tenant_link_is_refused_and_nothing_is_written_through_it(guard):
    elsewhere = guard["outside"] / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (guard["sessions"] / tenant_of("planted")).symlink_to(elsewhere)
    refused = save(guard, "doc", SHORT, "planted")
    assert refused.status_code == 500 and refused.json()["error"]["code"] == "session_folder_unsafe"
    assert str(elsewhere) not in refused.text
    restore = call(guard, "POST", "/v1/sessions/restore", {"session": "doc", "cache_salt": "planted"})
    assert restore.status_code == 500 and not list(elsewhere.iterdir())


def test_a_planted_session_link_is_neither_read_nor_written_through(guard):
    target = guard["outside"] / "target.kv"
    target.write_bytes(b"not yours")
    link = guard["sessions"] / "linked.kv"
    link.symlink_to(target)
    restore = call(guard, "POST", "/v1/sessions/restore", {"session": "linked"})
    assert restore.status_code == 422 and "a symbolic link" in restore.json()["error"]["message"]
    assert save(guard, "linked", SHORT).status_code == 200
    assert not link.is_symlink() and link.stat().st_mode & 0o777 == 0o600 and target.read_bytes() == b"not yours"


def test_sessions_have_quotas_per_client_whatever_salt_it_names_and_per_folder(guard):
    alice, carol, bob = "127.0.0.2", "127.0.0.3", "127.0.0.4"
    first = save(guard, "s", SHORT, "alice-1", alice)
    assert first.status_code == 200 and save(guard, "s", SHORT, "alice-2", alice).status_code == 200
    over_count = save(guard, "s", SHORT, "alice-3", alice)  # a new salt is a new tenant, not a new client
    assert over_count.status_code == 429 and over_count.json()["error"]["code"] == "too_many_sessions"
    assert "(--max-sessions-per-client)" in over_count.json()["error"]["message"]

    big = save(guard, "big", BIG, "carol-1", carol)
    assert big.status_code == 200, big.text
    assert big.json()["bytes"] <= CLIENT_BYTES < 2 * big.json()["bytes"], "the quota this test needs"
    over_bytes = save(guard, "big", BIG, "carol-2", carol)
    assert over_bytes.status_code == 507 and over_bytes.json()["error"]["code"] == "session_quota_exceeded"
    assert "--max-session-gb-per-client" in over_bytes.json()["error"]["message"]

    full = save(guard, "s", SHORT, "bob-1", bob)  # the folder holds 3: its cap
    assert full.status_code == 429 and "(--max-sessions)" in full.json()["error"]["message"]
    deleted = call(guard, "POST", "/v1/sessions/delete", {"session": "s", "cache_salt": "alice-1"}, alice)
    assert deleted.status_code == 200
    assert save(guard, "s", SHORT, "bob-1", bob).status_code == 200
    assert save(guard, "s", SHORT, "alice-3", alice).status_code == 429, "the folder is full again"


def test_the_listing_shows_the_callers_tenant_only(guard):
    doc = save(guard, "doc", BIG, "lister")
    other = save(guard, "other", SHORT)
    assert doc.status_code == other.status_code == 200
    listed = call(guard, "GET", "/v1/sessions?cache_salt=lister")
    assert listed.status_code == 200
    (entry,) = listed.json()["data"]
    path = guard["sessions"] / tenant_of("lister") / "doc.kv"
    assert entry == {
        "session": "doc",
        "bytes": path.stat().st_size,
        "tokens": doc.json()["tokens"],
        "modified_at": int(path.stat().st_mtime),
    }
    assert [s["session"] for s in call(guard, "GET", "/v1/sessions").json()["data"]] == ["other"]
    assert call(guard, "GET", "/v1/sessions?cache_salt=nobody").json() == {"object": "list", "data": []}
    assert call(guard, "GET", "/v1/sessions", auth=False).status_code == 401
    log = guard["log"].read_text()
    assert "lister" not in log and "cache_salt=*** " in log, "the salt in the URL is masked in the access log"
