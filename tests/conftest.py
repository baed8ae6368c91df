"""Shared fixtures: kvbank in subprocesses, and the native CPU kernels."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def kvbank_env() -> dict[str, str]:
    """Environment for a `python -m kvbank` subprocess that imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    # On a small shared CPU, torch's thread pool spinning against the test process's own threads
    # makes every matmul dozens of times slower; one thread each is far faster.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def native():
    """kvbank's native kernel module; under CI a machine that cannot build it fails instead of skipping."""
    from kvbank import kernels

    module = kernels.native()
    if module is None and not os.environ.get("CI"):
        pytest.skip(f"native kernels unavailable here: {kernels.failure()}")
    assert module is not None, kernels.failure()
    return module
