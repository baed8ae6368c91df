"""A headless Chromium for tests that render the dashboard: found on PATH, or the test fails
under CI (where .ci/run installs it) and skips elsewhere."""

import os
import shutil
import subprocess

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER_TIMEOUT_S = 60


def find_browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    message = f"no headless browser found (looked for {', '.join(BROWSERS)})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def dump_dom(browser: str, url: str) -> str:
    """`url` loaded in headless Chromium, its script left to poll for a few virtual seconds: the DOM."""
    command = [
        browser,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=4000",
        "--dump-dom",
        url,
    ]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
