"""Starting real `kvbank serve` processes for tests."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

STARTUP_TIMEOUT_S = 120
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_LOW_DEFAULT = 32768  # Linux's default, for a system that does not say
PORT_FLOOR = 10000  # below: well-known and registered services
PORT_TRIES = 1000
_random = random.SystemRandom()


def ephemeral_low() -> int:
    """The lowest port the OS hands to outgoing connections and to `bind(port 0)`."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW_DEFAULT


def free_port(also_free: int = 0) -> int:
    """A loopback port that is free now, as is `port + also_free` (a Redis Cluster node's bus: 10000).

    Not `bind(port 0)`: that draws from the ephemeral range, where any outgoing connection can take
    the port before the server binds it, and may draw one too high for `port + also_free`. Ports drawn
    at random below that range can only be taken by another listener (a parallel test run, rarely),
    which the caller notices when its server fails to start, and then asks again.
    """
    low, high = _candidate_range(also_free)
    for _ in range(PORT_TRIES):
        port = _random.randrange(low, high)
        if all(_bindable(p) for p in {port, port + also_free}):
            return port
    raise RuntimeError(f"no free loopback port (and port + {also_free}) in [{low}, {high})")


def _candidate_range(also_free: int) -> tuple[int, int]:
    high = ephemeral_low() - also_free
    if high <= PORT_FLOOR:  # an ephemeral range reaching this low leaves no room below it: share it
        high = 65536 - also_free
    return PORT_FLOOR, high


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_server(args: list[str], env: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m kvbank serve ARGS` on a free port; returns the process and its base URL."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvbank", "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, url: str, log_path: Path) -> None:
    """Return once /health answers 200; fail with the server's log if it dies or takes too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"kvbank serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(
        f"kvbank serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
    )


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def served(args: list[str], env: dict, log_path: Path) -> Iterator[str]:
    """A healthy `kvbank serve ARGS` for the block: its base URL; stopped afterwards, and a
    traceback anywhere in its log fails the caller (a server error the responses did not show)."""
    process, url = start_server(args, env, log_path)
    try:
        wait_healthy(process, url, log_path)
        yield url
    finally:
        stop_server(process)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def request(
    url: str, body: bytes | dict | None = None, headers: dict | None = None, timeout: float = 60
) -> tuple[int, dict | str, dict]:
    """One HTTP call: (status, JSON body or text, headers); error statuses are returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            status, raw, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), dict(error.headers)
    text = raw.decode()
    try:
        return status, json.loads(text), got
    except ValueError:
        return status, text, got
