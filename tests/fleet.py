"""A real sglang-router process in front of `kvbank serve` replicas, for tests and benchmarks.

`start_router` launches `python -m sglang_router.launch_router` on free loopback ports (its own
and its Prometheus exporter's, which would otherwise take port 29000) and waits until it sees
every worker healthy. Without the package the caller skips, except under CI, where it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serving import free_port, stop_server

ROUTER_VERSION = "0.3.2"
STARTUP_TIMEOUT_S = 60
#: health checks every second, one failure takes a worker out and one success brings it back,
#: and retries that outlast a health-check interval (0.1 + 0.2 + 0.4 + 0.8 + 1 + 1 s backoff)
FAST_HEALTH = [
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--retry-max-retries",
    "8",
    "--retry-initial-backoff-ms",
    "100",
    "--retry-backoff-multiplier",
    "2",
    "--retry-max-backoff-ms",
    "1000",
]


def require_router() -> None:
    """Skip (or under CI, fail) the calling test when sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is not None:
        return
    message = f"sglang-router is not installed (pip install 'sglang-router=={ROUTER_VERSION}', or kvbank[fleet])"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def start_router(
    urls: list[str], policy: str, log_path: Path, extra_args: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """sglang-router with `policy` in front of the workers at `urls`, once it sees them all healthy;
    returns the process and its base URL."""
    require_router()
    port, metrics_port = free_port(), free_port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    args += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn", *(extra_args or [])]
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_workers_healthy(process, url, log_path, len(urls))
    except BaseException:
        stop_router(process)
        raise
    return process, url


def router_workers(url: str) -> list[dict]:
    """The router's view of its workers (`GET /workers`): url, is_healthy, load..."""
    with urllib.request.urlopen(f"{url}/workers", timeout=5) as response:
        return json.loads(response.read())["workers"]


def wait_workers_healthy(process: subprocess.Popen, url: str, log_path: Path, count: int) -> None:
    """Return once the router lists `count` healthy workers; fail with its log if it exits or takes too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"sglang-router exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if sum(w.get("is_healthy", False) for w in router_workers(url)) >= count:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"sglang-router did not see {count} healthy workers:\n{log_path.read_text()[-3000:]}")


stop_router = stop_server  # the same: SIGTERM, then SIGKILL if it does not end
