"""Every Python block of README.md runs as written, each in a fresh interpreter in an empty folder.

A block marked `<!-- readme-test: MARK -->` needs something beyond the package: `server` talks to a
real `kvbank serve` (the README's http://127.0.0.1:8000 becomes the test server's address), `redis`
to a real redis-server (the README's redis://cache:6379 becomes it, ~/.cache/kvbank a temporary
folder), `transformers` needs the `hf` extra.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from serving import start_server, stop_server, wait_healthy

pytest_plugins = ["redis_servers"]

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[\w-]+) -->\n)?```python\n(?P<code>.*?)```", re.S)
MARKS = {None, "server", "redis", "transformers"}
BLOCK_TIMEOUT_S = 600


def _blocks() -> list:
    text = README.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))
        blocks.append(pytest.param(match.group("mark"), match.group("code"), id=f"line{line}-{match.group('mark')}"))
    return blocks


BLOCKS = _blocks()


def test_the_readme_has_its_python_blocks_and_knows_their_marks():
    assert len(BLOCKS) >= 9
    assert {block.values[0] for block in BLOCKS} <= MARKS


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    log = tmp_path_factory.mktemp("readme-server") / "server.log"
    process, url = start_server([], kvbank_env, log)
    try:
        wait_healthy(process, url, log)
        yield url
    finally:
        stop_server(process)


@pytest.mark.parametrize("mark, code", BLOCKS)
def test_readme_python_block_runs_as_written(mark, code, kvbank_env, tmp_path, request):
    if mark == "server":
        pytest.importorskip("openai")
        url = request.getfixturevalue("server")
        assert "http://127.0.0.1:8000" in code
        code = code.replace("http://127.0.0.1:8000", url)
    elif mark == "redis":
        redis_url = request.getfixturevalue("redis_server").url
        assert "redis://cache:6379" in code
        code = code.replace("redis://cache:6379", redis_url).replace("~/.cache/kvbank", str(tmp_path / "kv"))
    elif mark == "transformers":
        pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=kvbank_env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.stdout.strip() or "print(" not in code, "the block prints nothing"
