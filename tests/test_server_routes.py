"""The server's own routes and front door, on real `kvbank serve` processes: /flush_cache with and
without an API key, a --pin-prompt shorter than one block, and the dashboard of a server with no
key; plus the limit flags generated from ServerLimits."""

import dataclasses
import time

import pytest
from browser import dump_dom, find_browser
from serving import request, start_server, stop_server, wait_healthy

from kvbank import cli
from kvbank.server.limits import ServerLimits

KEY = "sk-routes-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK_SIZE = 16
# A system prompt whose chat prefix is shorter than one block: nothing of it can be pinned.
SHORT_SYSTEM = "Be brief."
# About a hundred tokens, so a finished request leaves several full blocks in the prefix cache.
PROMPT = " ".join(["The library opens at nine, closes at five, and charges ten cents a day for late books."] * 5)


@pytest.fixture(scope="module")
def open_server(kvbank_env, tmp_path_factory):
    """A server with no API key, a host tier, and a --pin-prompt too short to pin: (url, log path)."""
    folder = tmp_path_factory.mktemp("open")
    pin_file = folder / "short.txt"
    pin_file.write_text(f"{SHORT_SYSTEM}\n")
    log_path = folder / "server.log"
    args = ["--dtype", "float32", "--kv-host-gb", "0.25", "--pin-prompt", str(pin_file), "--log-level", "warning"]
    process, url = start_server(args, kvbank_env, log_path)
    try:
        wait_healthy(process, url, log_path)
        yield url, log_path
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def keyed_server(kvbank_env, tmp_path_factory):
    """A server that needs the API key."""
    log_path = tmp_path_factory.mktemp("keyed") / "server.log"
    process, url = start_server(
        ["--dtype", "float32", "--api-key", KEY, "--log-level", "warning"], kvbank_env, log_path
    )
    try:
        wait_healthy(process, url, log_path)
        yield url
    finally:
        stop_server(process)


def _complete(url: str, headers: dict | None = None) -> dict:
    status, body, _ = request(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, headers)
    assert status == 200, body
    return body["usage"]


def _state(url: str, headers: dict | None = None) -> dict:
    status, state, _ = request(f"{url}/dashboard/state", headers=headers)
    assert status == 200, state
    return state


def _until(condition, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def test_pin_prompt_shorter_than_a_block_warns_and_serves(open_server):
    url, log_path = open_server
    log = log_path.read_text()
    assert "nothing pinned" in log and f"blocks of {BLOCK_SIZE} tokens" in log
    messages = [{"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": "Hi"}]
    status, body, _ = request(f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200, body
    assert _state(url)["counts"]["pinned"] == 0


def test_flush_cache_empties_the_pool_and_the_next_request_loads_from_the_host_tier(open_server):
    url, _ = open_server
    first = _complete(url)
    assert _complete(url)["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE
    _until(lambda: _state(url)["tiers"]["host"]["store_bytes"] > 0, "the host tier stored nothing")
    cached_before = _state(url)["counts"]["cached"]

    status, flushed, _ = request(f"{url}/flush_cache", b"")
    assert status == 200, flushed
    assert flushed["object"] == "cache.flush"
    assert flushed["blocks"] >= first["prompt_tokens"] // BLOCK_SIZE and flushed["blocks"] >= cached_before > 0
    assert flushed["tokens"] == flushed["blocks"] * BLOCK_SIZE
    assert _until(lambda: _state(url)["counts"]["cached"] == 0, "cached blocks left after the flush")

    reloaded = _complete(url)["prompt_tokens_details"]["cached_tokens"]
    assert reloaded >= BLOCK_SIZE, "the flushed prefix was computed again instead of loaded from the host tier"
    state = _until(lambda: (s := _state(url))["tier_totals"]["hits"] >= 1 and s, "no tier hit after the flush")
    rows = {name: row for name, row in state["tiers"].items() if name != "offload"}
    for key in ("hits", "misses", "load_bytes", "store_bytes"):
        assert state["tier_totals"][key] == sum(row[key] for row in rows.values()), key
    assert state["tier_totals"]["load_bytes"] > 0


def test_flush_cache_needs_the_api_key(keyed_server):
    _complete(keyed_server, AUTH)
    status, body, _ = request(f"{keyed_server}/flush_cache", b"")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, flushed, _ = request(f"{keyed_server}/flush_cache", b"", AUTH)
    assert status == 200 and flushed["blocks"] >= 1, flushed


def test_dashboard_of_a_keyed_server_has_its_login_form_hidden_until_asked(keyed_server):
    status, page, _ = request(f"{keyed_server}/dashboard")
    assert status == 200
    assert '<form id="login" hidden>' in page


def test_dashboard_without_a_key_shows_no_login_and_totals_the_tier_rows(open_server):
    url, _ = open_server
    status, page, _ = request(f"{url}/dashboard")
    assert status == 200
    assert 'id="login"' not in page and "API key" not in page
    browser = find_browser()
    _complete(url)
    state = _state(url)
    dom = dump_dom(browser, f"{url}/dashboard")
    assert 'id="login"' not in dom and "needs the API key" not in dom
    assert f"hits {state['tier_totals']['hits']}" in dom


def test_serve_limit_flags_default_to_server_limits(monkeypatch):
    monkeypatch.delenv("KVBANK_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve"])
    defaults = ServerLimits()
    for field in dataclasses.fields(ServerLimits):
        if field.metadata.get("cli", True):
            assert getattr(args, field.name) == getattr(defaults, field.name), field.name
    assert cli.build_parser().parse_args(["serve", "--stream-idle-timeout", "5"]).stream_idle_timeout_s == 5.0


def test_without_a_key_a_loopback_server_answers_only_to_loopback_names(open_server, keyed_server):
    """DNS rebinding: a page on rebind.example points its name at 127.0.0.1, and the browser then
    sends it same-origin requests to the local server, with Host: rebind.example."""
    url, _ = open_server
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert request(f"{url}/v1/models", headers={"Host": host})[0] == 200, host
    for path in ("/v1/models", "/health", "/dashboard", "/metrics"):
        status, body, _ = request(f"{url}{path}", headers={"Host": f"rebind.example:{port}"})
        assert status == 400 and body["error"]["code"] == "invalid_host", (path, body)
        assert "rebind.example" in body["error"]["message"] and "--allowed-hosts" in body["error"]["message"]
    completion = {"prompt": "Hi", "max_tokens": 1}
    assert request(f"{url}/v1/completions", completion, {"Host": "127.0.0.1.rebind.example"})[0] == 400
    # With a key the key guards every route, whatever name the request used.
    assert request(f"{keyed_server}/v1/models", headers={**AUTH, "Host": "rebind.example"})[0] == 200
    assert request(f"{keyed_server}/v1/models", headers={"Host": "rebind.example"})[0] == 401


def test_allowed_hosts_are_names_or_any():
    assert ServerLimits().host_allowlist("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert ServerLimits().host_allowlist("::1") == {"localhost", "127.0.0.1", "::1"}
    assert ServerLimits().host_allowlist("0.0.0.0") is None  # exposed by choice: its names are not known
    assert ServerLimits(api_key="sk-0123456789abcdef").host_allowlist("127.0.0.1") is None
    proxied = ServerLimits(allowed_hosts="proxy.lan").host_allowlist("127.0.0.1")
    assert proxied == {"localhost", "127.0.0.1", "::1", "proxy.lan"}  # added, not in place of localhost
    listed = ServerLimits(allowed_hosts="Box.lan., [fd00::1]").host_allowlist("0.0.0.0")
    assert listed == {"box.lan", "fd00::1", "localhost", "127.0.0.1", "::1", "0.0.0.0"}
    assert ServerLimits(allowed_hosts="*").host_allowlist("127.0.0.1") is None
    with pytest.raises(ValueError, match="allowed_hosts='a,,b' has an empty name"):
        ServerLimits(allowed_hosts="a,,b")
