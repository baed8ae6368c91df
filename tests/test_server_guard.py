"""The server against a hostile client, over HTTP to real `kvbank serve` processes: wrong API keys are
throttled per client address, a browser page of another site cannot change anything and no route
changes state on GET, a server without a key on a public address says so at start, and a draining
server refuses every kind of new work alike."""

import http.client
import json
import signal
import time

import pytest
from serving import served, start_server, stop_server, wait_healthy

from kvbank.server.dashboard import LOGIN_FAILURES, LOGIN_WINDOW_S

KEY = "sk-guard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WRONG = {"Authorization": "Bearer sk-guess"}
FOREIGN = {"Origin": "http://pages.example"}
ERROR_FIELDS = {"message", "type", "param", "code"}
# All of 127/8 is loopback on Linux: each address is a client of its own, so that the throttle one
# test provokes holds up no other.
GUESSER, NEIGHBOUR, KEYLESS = "127.0.0.3", "127.0.0.4", "127.0.0.5"


def _call(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None, source: str = ""):
    """(status, JSON body, headers) of one request sent from the loopback address `source`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), source_address=(source, 0) if source else None, timeout=60)
    try:
        data = json.dumps(body) if body is not None else None
        connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None, {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


def _refused(reply: tuple, status: int, code: str) -> dict:
    got, body, _ = reply
    assert got == status and set(body["error"]) == ERROR_FIELDS and body["error"]["code"] == code, reply
    return body["error"]


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    """A server that needs the API key, on loopback: its URL."""
    log_path = tmp_path_factory.mktemp("guard") / "server.log"
    args = ["--api-key", KEY, "--num-gpu-blocks", "64", "--log-level", "warning"]
    with served(args, kvbank_env, log_path) as url:
        yield url


def test_wrong_keys_are_throttled_per_client_address(server):
    for _ in range(LOGIN_FAILURES):
        _refused(_call(server, "GET", "/v1/models", headers=WRONG, source=GUESSER), 401, "invalid_api_key")
    reply = _call(server, "GET", "/v1/models", headers=WRONG, source=GUESSER)
    _refused(reply, 429, "too_many_wrong_keys")
    assert 1 <= int(reply[2]["retry-after"]) <= LOGIN_WINDOW_S
    # The right key waits too: answering it would tell it from the wrong ones, and the guessing went on.
    _refused(_call(server, "GET", "/v1/models", headers=AUTH, source=GUESSER), 429, "too_many_wrong_keys")
    # One budget for both doors to the key: the dashboard's login is closed to this address as well.
    login = _call(server, "POST", "/dashboard/login", {"key": KEY}, source=GUESSER)
    assert _refused(login, 429, "too_many_wrong_keys")["param"] == "key"
    # Another client is not held up, with the right key or the wrong one.
    assert _call(server, "GET", "/v1/models", headers=AUTH, source=NEIGHBOUR)[0] == 200
    _refused(_call(server, "GET", "/v1/models", headers=WRONG, source=NEIGHBOUR), 401, "invalid_api_key")


def test_requests_without_a_key_guess_nothing_and_are_not_throttled(server):
    for _ in range(LOGIN_FAILURES + 1):
        _refused(_call(server, "GET", "/v1/models", source=KEYLESS), 401, "invalid_api_key")
    assert _call(server, "GET", "/v1/models", headers=AUTH, source=KEYLESS)[0] == 200


def test_flush_cache_takes_post_only(server):
    reply = _call(server, "GET", "/flush_cache", headers=AUTH)
    assert reply[0] == 405 and reply[2]["allow"] == "POST"
    assert set(reply[1]["error"]) == ERROR_FIELDS and "POST" in reply[1]["error"]["message"]
    status, flushed, _ = _call(server, "POST", "/flush_cache", headers=AUTH)
    assert status == 200 and flushed["object"] == "cache.flush"


def test_a_page_of_another_site_cannot_change_state_even_with_the_key(server):
    stream = "stream-" + "0" * 32
    for method, path, body in (
        ("POST", "/flush_cache", None),
        ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ("POST", "/v1/streams", {"system": "Watch."}),
        ("DELETE", f"/v1/streams/{stream}", None),
        ("POST", "/v1/sessions/save", {"session": "s", "prompt": "Hi"}),
        ("POST", "/dashboard/login", {"key": KEY}),
    ):
        error = _refused(_call(server, method, path, body, {**AUTH, **FOREIGN}), 403, "cross_origin_request")
        assert FOREIGN["Origin"] in error["message"] and path in error["message"]
    for marks in ({"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        _refused(_call(server, "POST", "/flush_cache", headers={**AUTH, **marks}), 403, "cross_origin_request")
    # Reads pass (the page cannot read the answer: no CORS), and so do pages of the server's own host.
    assert _call(server, "GET", "/v1/models", headers={**AUTH, **FOREIGN})[0] == 200
    own_host = f"{server.rsplit(':', 1)[0]}:1"  # another port of the same host
    for origin in (server, own_host):
        assert _call(server, "POST", "/flush_cache", headers={**AUTH, "Origin": origin})[0] == 200
    assert _call(server, "DELETE", f"/v1/streams/{stream}", headers=AUTH)[0] == 404  # the 403 was the origin's


@pytest.fixture(scope="module")
def exposed_server(kvbank_env, tmp_path_factory):
    """A server without a key listening on every address (0.0.0.0), with a session folder and a drain
    long enough to look at: (process, url, log path)."""
    folder = tmp_path_factory.mktemp("exposed")
    log_path = folder / "server.log"
    args = ["--host", "0.0.0.0", "--num-gpu-blocks", "64", "--session-dir", str(folder / "sessions")]
    args += ["--drain-grace", "60", "--shutdown-timeout", "60", "--log-level", "warning"]
    process, url = start_server(args, kvbank_env, log_path)
    try:
        wait_healthy(process, url, log_path)
        yield process, url, log_path
    finally:
        stop_server(process)


def test_a_keyless_server_on_a_public_address_warns_that_every_route_is_open(exposed_server):
    _, _, log_path = exposed_server
    warning = next(line for line in log_path.read_text().splitlines() if line.startswith("no API key"))
    assert "0.0.0.0" in warning and "/flush_cache" in warning and "--api-key" in warning


def test_a_keyless_server_cannot_be_flushed_by_a_cross_site_get(exposed_server):
    _, url, _ = exposed_server
    reply = _call(url, "GET", "/flush_cache", headers=FOREIGN)
    assert reply[0] == 405 and reply[2]["allow"] == "POST" and set(reply[1]["error"]) == ERROR_FIELDS


def test_a_draining_server_refuses_every_kind_of_new_work(exposed_server):
    process, url, _ = exposed_server
    status, stream, _ = _call(url, "POST", "/v1/streams", {"system": "You watch and answer briefly."})
    assert status == 200, stream
    stream_path = f"/v1/streams/{stream['id']}"
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _call(url, "GET", "/health")[0] != 503:
        assert time.monotonic() < deadline and process.poll() is None, "the server did not start draining"
        time.sleep(0.1)
    for path, body in (
        (f"{stream_path}/frames", {"text": "A cat walks in."}),
        (f"{stream_path}/ask", {"question": "Who came in?", "max_tokens": 2}),
        ("/v1/sessions/save", {"session": "kept", "prompt": "Hi"}),
        ("/v1/sessions/restore", {"session": "kept"}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        ("/v1/streams", {"system": "Watch."}),
        ("/flush_cache", None),
    ):
        reply = _call(url, "POST", path, body)
        _refused(reply, 503, "server_draining")
        assert reply[2]["retry-after"] == "1", path
    # Reads that start nothing pass, and so does closing what is open.
    assert _call(url, "GET", stream_path)[0] == 200
    status, closed, _ = _call(url, "DELETE", stream_path)
    assert status == 200 and closed["deleted"] is True
