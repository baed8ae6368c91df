"""Tests for building the native kernels: what the build needs from the environment."""

import os
import select
import shutil
import stat
import subprocess
import sys
import time

import pytest

from kvbank import kernels
from kvbank.kernels import path_with_ninja


def test_build_path_gains_the_pip_ninja_when_path_has_none(tmp_path):
    bare = str(tmp_path)  # no ninja here, unlike /usr/bin on many machines
    path = path_with_ninja(bare)
    ninja_dir = path.split(os.pathsep)[0]
    assert path.endswith(bare) and ninja_dir != bare
    ninja = os.path.join(ninja_dir, "ninja")
    assert os.stat(ninja).st_mode & stat.S_IXUSR, ninja


def test_build_path_is_unchanged_when_it_has_ninja_already(tmp_path):
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    assert path_with_ninja(str(tmp_path)) == str(tmp_path)


def test_torch_finds_ninja_on_the_build_path_of_a_process_without_one(tmp_path, kvbank_env):
    # What `.venv/bin/python` sees when run directly by make on a machine without ninja-build.
    script = (
        "import os\n"
        "from torch.utils.cpp_extension import is_ninja_available\n"
        "from kvbank.kernels import path_with_ninja\n"
        "assert not is_ninja_available(), os.environ['PATH']\n"
        "os.environ['PATH'] = path_with_ninja(os.environ['PATH'])\n"
        "assert is_ninja_available(), os.environ['PATH']\n"
    )
    env = dict(kvbank_env, PATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "change",
    [
        lambda mp: mp.setattr(sys, "prefix", "/elsewhere/.venv"),
        lambda mp: mp.setattr(sys, "executable", "/elsewhere/.venv/bin/python"),
        lambda mp: mp.setenv("CXX", "/elsewhere/bin/c++"),
        lambda mp: mp.setattr(kernels, "CFLAGS", (*kernels.CFLAGS, "-g")),
    ],
    ids=["prefix", "executable", "compiler", "cflags"],
)
def test_the_build_name_is_stable_and_follows_the_environment_that_builds(monkeypatch, change):
    name = kernels.module_name()
    assert kernels.module_name() == name
    change(monkeypatch)
    assert kernels.module_name() != name


def test_the_build_name_follows_the_sources_bytes_and_their_folder(monkeypatch, tmp_path):
    # build.ninja names the sources by absolute path: a second checkout sharing the build folder
    # would rewrite it and rebuild the first's module, so each checkout's build is named apart
    name = kernels.module_name()
    for source in kernels.SOURCES:
        shutil.copy(kernels._SOURCE_DIR / source, tmp_path / source)
    monkeypatch.setattr(kernels, "_SOURCE_DIR", tmp_path)
    copied = kernels.module_name()
    assert copied != name
    assert kernels.module_name() == copied
    with open(tmp_path / kernels.SOURCES[-1], "a") as source:
        source.write("\n")
    assert kernels.module_name() != copied


_LOAD = (
    "import sys\n"
    "from kvbank.kernels import failure, native\n"
    "assert native() is not None, failure()\n"
    "print('loaded', flush=True)\n"
)


def _held_build_lock():
    """The native kernels' build lock, held by this process (no kvbank process builds meanwhile)."""
    import fcntl

    from kvbank.kernels import build_folder, module_name

    folder = build_folder(module_name())
    handle = open(folder / "kvbank.lock", "a+")  # noqa: SIM115 (closed by the caller)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return folder, handle


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(kvbank_env):
    # torch marks a build in progress with a `lock` file; a process killed mid-build leaves it
    folder, handle = _held_build_lock()
    stale = folder / "lock"
    try:
        stale.touch()
    finally:
        handle.close()  # releases the flock: the `lock` file now belongs to no one
    result = subprocess.run([sys.executable, "-c", _LOAD], env=kvbank_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-2000:]
    assert not stale.exists()


def test_a_second_process_waits_for_a_build_in_progress_and_says_so(kvbank_env):
    folder, handle = _held_build_lock()
    try:
        waiting = subprocess.Popen(
            [sys.executable, "-c", _LOAD], env=kvbank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        said = ""
        while "waiting for another process" not in said and time.monotonic() < deadline:
            ready, _, _ = select.select([waiting.stderr], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(waiting.stderr.fileno(), 4096).decode()
            if not chunk:
                break
            said += chunk
        assert "waiting for another process building the native kernels" in said, said
        assert waiting.poll() is None  # still waiting while the lock is held
    finally:
        handle.close()
    out, err = waiting.communicate(timeout=600)
    assert waiting.returncode == 0 and "loaded" in out, err[-2000:]


def test_a_long_step_in_the_kernels_leaves_other_threads_running(native):
    """The kernels release the GIL: during a long batch-invariant prefill (one native call runs every
    layer) a Python thread beside the engine (a server's event loop answering /health, streaming
    tokens) keeps running, instead of waiting for the whole step."""
    import threading

    from kvbank import LLM, SamplingParams

    llm = LLM(max_model_len=1024)
    assert llm.engine.config.batch_invariant  # the default: every step through the 4-bit stack
    ids = [(i * 7919) % 20000 + 100 for i in range(1000)]
    llm.generate({"prompt_token_ids": ids[:16]}, SamplingParams(max_tokens=1))  # warm
    model = llm.engine.runner.model
    stack = model._stack()
    inside, stop = threading.Event(), threading.Event()
    calls = ticks_inside = 0

    class Watched:
        """The native stack, with `inside` set for exactly the span of each call into it."""

        def forward(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            inside.set()
            try:
                return stack.forward(*args, **kwargs)
            finally:
                inside.clear()

    def tick() -> None:
        nonlocal ticks_inside
        while not stop.is_set():
            ticks_inside += inside.is_set()
            time.sleep(0.002)

    model._native_stack = Watched()
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    finally:
        stop.set()
        thread.join()
        model._native_stack = stack
    # A call that held the GIL would let the ticker in only at its edges, where the caller's bytecode
    # gives the GIL up: once before and once after it at most. Released, the ticker ticks all through.
    assert calls >= 1
    assert ticks_inside > 2 * calls, f"{ticks_inside} ticks inside {calls} calls into the stack"
