"""What a new user meets first, against a real `kvbank serve`: the startup lines and the curl they
suggest, the model's one name and its aliases, block counts that add up, and connections that idle
or half-open sockets cannot use up; and the startup log of `LLM()` in Python."""

import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
from serving import request, served

from kvbank import LLM
from kvbank.engine.llm import startup_log

KEY = "sk-first-run"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "SmolLM2-135M-Instruct.Q4_1"
MAX_CONNECTIONS = 8
# Several full blocks, so a finished request leaves cached blocks behind.
PROMPT = " ".join(["The library opens at nine, closes at five, and charges ten cents a day for late books."] * 4)


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("first-run") / "server.log"
    with served(
        [
            "--api-key",
            KEY,
            "--max-num-seqs",
            "2",
            "--max-queued-requests",
            "4",
            "--max-connections",
            str(MAX_CONNECTIONS),
            "--header-timeout",
            "1",
            "--num-gpu-blocks",
            "64",
            "--max-model-len",
            "512",
        ],
        kvbank_env,
        log_path,
    ) as url:
        yield url, log_path


def _complete(url: str, model: str = NAME, prompt: str = "The capital of France is", **fields) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    status, answer, _ = request(f"{url}/v1/completions", body, headers=AUTH)
    return status, answer


def test_startup_names_the_model_once_and_prints_a_curl_that_works_as_printed(server):
    url, log_path = server
    log = log_path.read_text()
    assert f"model: {NAME}, " in log and f"serving {NAME!r} " in log
    assert "memory: total" in log and "KV cache: 64 blocks" in log
    assert KEY not in log
    assert f"dashboard: {url}/dashboard (sign in with the API key)" in log
    curl = next(line.removeprefix("try: ") for line in log.splitlines() if line.startswith("try: curl "))
    assert '"Authorization: Bearer $KVBANK_API_KEY"' in curl
    done = subprocess.run(
        ["bash", "-c", curl], env={**os.environ, "KVBANK_API_KEY": KEY}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["model"] == NAME and "Paris" in answer["choices"][0]["text"], answer
    status, models, _ = request(f"{url}/v1/models", headers=AUTH)
    assert status == 200 and [model["id"] for model in models["data"]] == [NAME]


def test_requests_may_name_the_model_as_users_do_and_other_models_are_404(server):
    url, _ = server
    for alias in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct.q4_1.gguf"):
        status, answer = _complete(url, alias)
        assert status == 200 and answer["model"] == NAME, (alias, answer)
    for other in ("SmolLM2-135M-Instruct.Q8_0", "SmolLM2-360M-Instruct", "gpt-4o"):
        status, answer = _complete(url, other)
        assert status == 404 and answer["error"]["code"] == "model_not_found", (other, answer)


def _metrics(url: str) -> dict[str, float]:
    status, text, _ = request(f"{url}/metrics", headers=AUTH)
    assert status == 200
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    }


def _idle_dashboard_state(url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        status, state, _ = request(f"{url}/dashboard/state", headers=AUTH)
        assert status == 200, state
        if state["stats"]["num_requests_running"] == 0 and state["counts"]["used"] == 0:
            return state
        assert time.monotonic() < deadline, f"the engine did not go idle: {state['counts']}"
        time.sleep(0.1)


def test_block_counts_add_up_and_metrics_agree_with_the_dashboard(server):
    url, _ = server
    assert _complete(url, prompt=PROMPT)[0] == 200
    counts = _idle_dashboard_state(url)["counts"]
    metrics = _metrics(url)
    by_state = {state: metrics[f"kvbank:num_{state}_blocks"] for state in ("free", "used", "cached", "pinned")}
    assert by_state == counts
    assert sum(by_state.values()) == metrics["kvbank:num_blocks"] == 64
    assert by_state["cached"] >= 4  # the prompt's full blocks: evictable, so not counted as free or in use
    assert metrics["kvbank:kv_cache_usage_perc"] == 0


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (a refusal it wrote before closing counts as closed too)."""
    sock.setblocking(False)
    try:
        while data := sock.recv(4096):
            if b"503" not in data:
                return False
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _stream(url: str, done: dict, started: threading.Event) -> None:
    """A streamed completion; `started` is set once its first event is in (its connection carries a
    request from then on), and `done` gets the status and the whole text."""
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **AUTH}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            first = response.readline()
            started.set()
            done["status"], done["text"] = response.status, (first + response.read()).decode()
    finally:
        started.set()


def test_idle_and_half_open_connections_past_the_cap_leave_health_streams_and_completions_answering(server):
    url, _ = server
    stream: dict = {}
    started = threading.Event()
    streaming = threading.Thread(target=_stream, args=(url, stream, started))
    streaming.start()
    assert started.wait(60)  # the stream's connection carries a request before the flood of connections
    idle = [socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) for _ in range(3 * MAX_CONNECTIONS)]
    for sock in idle[::2]:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers that never end
    try:
        # A new connection closes the one that has waited longest for a request; the stream's is never cut.
        assert request(f"{url}/health", timeout=10)[0] == 200
        assert _complete(url)[0] == 200
        streaming.join(120)
        assert stream["status"] == 200 and stream["text"].rstrip().endswith("data: [DONE]"), stream
        # What the cap left open, the header timeout (1 s here) closes.
        deadline = time.monotonic() + 30
        while not all(_closed_by_server(sock) for sock in idle):
            assert time.monotonic() < deadline, "idle connections outlived the header timeout"
            time.sleep(0.2)
    finally:
        for sock in idle:
            sock.close()


def test_a_new_connection_gets_503_only_when_every_connection_carries_a_request(server):
    url, _ = server
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    busy = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each waits for a body it never gets: a request in progress
            sock = socket.create_connection(address)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n"
            )
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 100"), "the server did not start the request"
            busy.append(sock)
        with socket.create_connection(address) as refused:
            refused.settimeout(30)
            answer = refused.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b'"code":"too_many_connections"' in answer.replace(b" ", b"")
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 30
    while request(f"{url}/health", timeout=10)[0] != 200:
        assert time.monotonic() < deadline, "/health did not come back once the connections closed"
        time.sleep(0.1)


def test_llm_in_python_logs_the_startup_lines_the_commands_print(caplog):
    with caplog.at_level(logging.INFO, logger="kvbank"):
        llm = LLM(num_gpu_blocks=16)
    logged = [record.getMessage() for record in caplog.records if record.name == "kvbank"]
    assert logged == startup_log(llm.engine)
    assert logged[0].startswith(f"model: {NAME}, ") and any(line.startswith("memory: total") for line in logged)
    llm.close()
