"""The live cache page: its JSON state from a real in-process server that requires an API key, and the
page itself rendered by headless Chromium before and after a real completion request."""

import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser

import pytest
import uvicorn
from browser import dump_dom, find_browser
from serving import request, start_server, stop_server, wait_healthy

from kvbank import LLM
from kvbank.server import AsyncEngine, build_app
from kvbank.server.api import ServerLimits
from kvbank.server.dashboard import LOGIN_FAILURES, LOGIN_TTL_S, LOGIN_WINDOW_S, DashboardLogin

NUM_BLOCKS = 48
KEY = "sk-dashboard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
STARTUP_TIMEOUT_S = 30
# About a hundred tokens, so a finished request leaves several full blocks in the prefix cache.
PROMPT = " ".join(["The library opens at nine, closes at five, and charges ten cents a day for late books."] * 5)


@pytest.fixture(scope="module")
def base_url():
    """A uvicorn server on a free port, in a thread, serving the API and the dashboard of a tiny pool."""
    llm = LLM(dtype="float32", num_gpu_blocks=NUM_BLOCKS)
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, "m", ServerLimits(api_key=KEY))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="dashboard-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    async_engine.shutdown()


def _call(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict | None, dict]:
    """(status, JSON body or None, headers) of one request; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), error.headers
    return status, json.loads(raw) if raw else None, got


def _get_json(url: str) -> dict:
    status, body, _ = _call(url, headers=AUTH)
    assert status == 200, body
    return body


def _complete(base_url: str, prompt: str) -> dict:
    status, body, _ = _call(f"{base_url}/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}, AUTH)
    assert status == 200, body
    return body


def _settled_state(base_url: str) -> dict:
    """The dashboard state once no request runs (the engine publishes block states when idle)."""
    deadline = time.monotonic() + 10
    while True:
        state = _get_json(f"{base_url}/dashboard/state")
        if state["stats"]["num_requests_running"] == 0 and state["counts"]["used"] == 0:
            return state
        assert time.monotonic() < deadline, f"the engine did not go idle: {state['counts']}"
        time.sleep(0.1)


def test_state_json_of_an_idle_pool(base_url):
    state = _get_json(f"{base_url}/dashboard/state")
    assert state["tiers"] == {}
    assert len(state["blocks"]) == NUM_BLOCKS
    assert set(state["blocks"]) == {"0"}
    assert state["counts"] == {"free": NUM_BLOCKS, "used": 0, "cached": 0, "pinned": 0}
    assert sum(state["counts"].values()) == NUM_BLOCKS
    assert state["block_size"] > 0
    assert state["stats"]["num_blocks"] == NUM_BLOCKS
    assert state["max_step_ms"] == 200  # the default step-time target
    assert state["history"], "the first poll already has a sample to chart"
    newest = state["history"][-1]["time"]
    assert _get_json(f"{base_url}/dashboard/state?since={newest}")["history"] == []


def test_state_needs_the_key_by_header_or_by_the_login_cookie(base_url):
    assert _call(f"{base_url}/dashboard/state")[0] == 401
    status, body, _ = _call(f"{base_url}/dashboard/login", {"key": "wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, headers = _call(f"{base_url}/dashboard/login", {"key": KEY})
    assert status == 204
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and KEY not in cookie
    assert f"Max-Age={LOGIN_TTL_S}" in cookie
    as_cookie = {"Cookie": cookie.split(";", 1)[0]}
    status, state, _ = _call(f"{base_url}/dashboard/state", headers=as_cookie)
    assert status == 200 and len(state["blocks"]) == NUM_BLOCKS
    # The cookie opens the dashboard's state, not the API.
    assert _call(f"{base_url}/v1/models", headers=as_cookie)[0] == 401
    assert _call(f"{base_url}/v1/models", headers=AUTH)[0] == 200


def _login_from(base_url: str, address: str, key: str) -> tuple[int, str | None]:
    """(status, Retry-After) of a login sent from the loopback `address` (all of 127/8 is loopback)."""
    url = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, source_address=(address, 0), timeout=30)
    try:
        connection.request("POST", "/dashboard/login", json.dumps({"key": key}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader("Retry-After")
    finally:
        connection.close()


def test_failed_logins_are_throttled_per_client_address(base_url):
    for _ in range(LOGIN_FAILURES):
        assert _login_from(base_url, "127.0.0.2", "wrong") == (401, None)
    status, retry_after = _login_from(base_url, "127.0.0.2", KEY)  # the right key too, until the window passes
    assert status == 429 and 1 <= int(retry_after) <= LOGIN_WINDOW_S
    assert _login_from(base_url, "127.0.0.3", KEY) == (204, None)  # another address is not held up


def test_login_tokens_are_new_for_each_login_expire_and_die_with_the_process():
    now = [1000.0]
    login = DashboardLogin(KEY, ttl_s=60, failures=3, window_s=30, clock=lambda: now[0])
    first, second = login.issue(), login.issue()
    assert first != second and login.valid(first) and login.valid(second)
    assert not DashboardLogin(KEY).valid(first), "a restarted server draws another MAC key"
    expiry, nonce, mac = first.split(".")
    assert not login.valid(f"{int(expiry) + 3600}.{nonce}.{mac}"), "a longer expiry breaks the MAC"
    assert not any(login.valid(token) for token in ("", "a.b", KEY, f"x{expiry}.{nonce}.{mac}"))
    now[0] += 61
    assert not login.valid(first) and not login.valid(second)
    for _ in range(3):
        assert login.retry_after("10.0.0.1") is None
        login.failed("10.0.0.1")
        now[0] += 5
    # failures at 1061, 1066 and 1071, now 1076: the first leaves the 30 s window at 1091
    assert login.retry_after("10.0.0.1") == 15 and login.retry_after("10.0.0.2") is None
    now[0] += 15
    assert login.retry_after("10.0.0.1") is None  # the first failure left the window


class _PageReader(HTMLParser):
    """The block cells' states and the text of elements with an id, from a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []
        self.text: dict[str, str] = {}
        self.hidden: dict[str, bool] = {}
        self._open_ids: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("class") == "block":
            self.cells.append(attributes.get("data-state") or "")
        if attributes.get("id"):
            self.hidden[attributes["id"]] = "hidden" in attributes
        if tag not in ("br", "img", "input", "meta", "link", "hr"):
            self._open_ids.append(attributes.get("id"))
            if attributes.get("id"):
                self.text[attributes["id"]] = ""

    def handle_endtag(self, tag: str) -> None:
        if self._open_ids and tag not in ("br", "img", "input", "meta", "link", "hr"):
            self._open_ids.pop()

    def handle_data(self, data: str) -> None:
        for element_id in self._open_ids:
            if element_id:
                self.text[element_id] += data


def _rendered_page(browser: str, url: str) -> _PageReader:
    page = _PageReader()
    page.feed(dump_dom(browser, url))
    return page


def _number(text: str) -> int:
    return int(text.replace(",", "").strip())


def _assert_page_matches(page: _PageReader, state: dict) -> None:
    assert page.cells == [("free", "used", "cached", "pinned")[int(c)] for c in state["blocks"]]
    assert _number(page.text["count-total"]) == NUM_BLOCKS
    for name, count in state["counts"].items():
        assert _number(page.text[f"count-{name}"]) == count, name
    assert page.text["status"].startswith("live")


def test_page_without_the_key_asks_for_it(base_url):
    page = _rendered_page(find_browser(), f"{base_url}/dashboard")
    assert page.hidden["login"] is False
    assert page.text["status"].strip() == "needs the API key"
    assert page.cells == []


def test_page_in_headless_chromium(base_url):
    browser = find_browser()
    before = _settled_state(base_url)
    page = _rendered_page(browser, f"{base_url}/dashboard#key={KEY}")
    assert len(page.cells) == NUM_BLOCKS
    assert set(page.cells) == {"free"}
    _assert_page_matches(page, before)

    answer = _complete(base_url, PROMPT)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    after = _settled_state(base_url)
    block_size = after["block_size"]
    assert after["counts"]["cached"] >= prompt_tokens // block_size > 0
    assert sum(after["counts"].values()) == NUM_BLOCKS

    page = _rendered_page(browser, f"{base_url}/dashboard#key={KEY}")
    assert len(page.cells) == NUM_BLOCKS
    assert page.hidden["login"] is True
    assert page.cells.count("cached") == after["counts"]["cached"]
    _assert_page_matches(page, after)
    assert _number(page.text["stat-finished"]) == 1
    paced, over = after["stats"]["num_paced_steps"], after["stats"]["num_steps_over_target"]
    assert paced > 0  # the completion's decode steps
    assert page.text["label-steps-over-target"] == f"steps over 200 ms target ({over} of {paced})"
    assert page.text["stat-steps-over-target"] == f"{100 * over / paced:.1f} %"


def test_page_counts_the_documents_blended(base_url):
    notes = "The lighthouse keeper counted the ships that passed the point on each clear night. " * 3
    harbour = "Every February the harbour froze over and the ferry stopped running for weeks. " * 3
    for docs in ((notes, harbour), (harbour, notes)):  # computed alone, then reused in another order
        segments = ["Notes:\n", *({"document": d} for d in docs), "\nQuestion: when?"]
        status, body, _ = _call(
            f"{base_url}/v1/completions", {"prompt": "", "segments": segments, "max_tokens": 1}, AUTH
        )
        assert status == 200, body
    stats = _settled_state(base_url)["stats"]
    placed, recomputed = stats["blend_tokens_reused"], stats["blend_tokens_recomputed"]
    assert placed > 0 and recomputed > 0
    page = _rendered_page(find_browser(), f"{base_url}/dashboard#key={KEY}")
    assert page.text["stat-documents-reused"] == "2 of 4"
    assert page.text["label-document-tokens"] == f"blended tokens placed ({placed} of {placed + recomputed})"
    assert page.text["stat-document-tokens"] == f"{100 * placed / (placed + recomputed):.1f} %"


def test_latency_histograms_have_a_series_per_priority(base_url):
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "priority": 3}
    assert _call(f"{base_url}/v1/completions", body, AUTH)[0] == 200
    status, page, _ = request(f"{base_url}/metrics", headers=AUTH)
    assert status == 200, page
    for name in ("kvbank:time_to_first_token_seconds", "kvbank:e2e_request_latency_seconds"):
        assert f'{name}_count{{priority="3"}} 1\n' in page, name
        assert set(re.findall(rf'^{re.escape(name)}_count\{{priority="([^"]+)"\}}', page, re.M)) == {"0", "3"}


def _tier_metrics(url: str) -> dict[str, float]:
    status, page, _ = request(f"{url}/metrics")
    assert status == 200, page
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(("kvbank:kv_tier_", "kvbank:kv_offload_"))
    }


def test_tiers_show_on_metrics_and_the_dashboard(kvbank_env, tmp_path):
    log_path = tmp_path / "server.log"
    args = ["--dtype", "float32", "--kv-host-gb", "0.5", "--kv-disk-dir", str(tmp_path / "kv")]
    args += ["--max-step-ms", "0", "--log-level", "warning"]  # no step-time target: the page shows it off
    process, url = start_server(args, kvbank_env, log_path)
    try:
        wait_healthy(process, url, log_path)
        for _ in range(2):
            status, body, _ = request(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            assert status == 200, body
        deadline = time.monotonic() + 15  # stores are written by a background thread
        while (metrics := _tier_metrics(url))['kvbank:kv_tier_store_bytes_total{tier="disk"}'] == 0:
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        state = request(f"{url}/dashboard/state")[1]
        page = _rendered_page(find_browser(), f"{url}/dashboard")
    finally:
        stop_server(process)
    assert metrics['kvbank:kv_tier_store_bytes_total{tier="host"}'] > 0
    assert metrics['kvbank:kv_tier_capacity_bytes{tier="host"}'] == 0.5 * 2**30
    assert metrics['kvbank:kv_tier_entries{tier="host"}'] >= 1
    assert metrics["kvbank:kv_offload_stores_total"] >= 1
    assert metrics["kvbank:kv_offload_bad_entries_total"] == 0
    assert set(state["tiers"]) == {"host", "disk", "offload"}
    assert state["tiers"]["host"]["store_bytes"] > 0 and state["tiers"]["host"]["capacity_bytes"] == 2**29
    assert page.hidden["tiers"] is False
    assert page.text["tier-rows"].startswith("host") and "disk" in page.text["tier-rows"]
    assert state["max_step_ms"] == 0 and page.text["stat-steps-over-target"] == "off"
