"""Native CPU kernels, compiled from C++ on first use and cached (torch.utils.cpp_extension).

`native()` returns the compiled module, or None where it cannot be had: no C++ compiler, a
failed build, or KVBANK_NATIVE_KERNELS=0. Callers keep their PyTorch path for None, so a machine
without a compiler runs the same engine, only slower. The first build takes about a minute on two
cores; later processes load the cached library (under $TORCH_EXTENSIONS_DIR or ~/.cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("kvbank.kernels")

_SOURCE_DIR = Path(__file__).parent
#: bindings.cpp includes the kernels' sources; all of them (and native.h) name the build.
SOURCES = ("bindings.cpp", "native.h", "layers.cpp", "paged_decode.cpp", "quant_decode.cpp", "qmatmul.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # after the one attempt: "module", or "failure" (why it failed)


def enabled() -> bool:
    return os.environ.get("KVBANK_NATIVE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def native():
    """The native module, or None; built (or loaded from the cache) once per process."""
    if not enabled():
        return None
    with _lock:
        if not _state:
            _state.update(_build())
        return _state.get("module")


def failure() -> str | None:
    """Why the native module could not be built, if it could not."""
    return _state.get("failure")


def _build() -> dict[str, object]:
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(b"".join((_SOURCE_DIR / f).read_bytes() for f in SOURCES)).hexdigest()[:12]
        name = f"kvbank_native_{digest}"
        if not _cached(name):
            print(
                "kvbank: compiling the native CPU kernels (once, about a minute on two cores; "
                "KVBANK_NATIVE_KERNELS=0 skips them)",
                file=sys.stderr,
                flush=True,
            )
        # parallel_for in the kernels is OpenMP: without -fopenmp it would run on one thread.
        with _ninja_on_path():
            module = load(
                name=name,
                sources=[str(_SOURCE_DIR / SOURCES[0])],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        return {"module": module}
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, say why once
        reason = f"{type(exc).__name__}: {exc}"
        logger.warning("native CPU kernels unavailable, running on PyTorch alone: %s", reason[:500])
        return {"failure": reason}


def path_with_ninja(path: str) -> str:
    """`path` (a PATH value) with a folder holding `ninja` in front, when `path` has none.

    torch runs `ninja` from PATH, but the pip `ninja` package (a dependency) installs it beside the
    environment's python, and `.venv/bin/python` run directly does not put that folder on PATH.
    """
    if shutil.which("ninja", path=path):
        return path
    for folder in _ninja_folders():
        if shutil.which("ninja", path=folder):
            return os.pathsep.join(p for p in (folder, path) if p)
    return path


def _ninja_folders() -> list[str]:
    folders = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja

        folders.insert(0, ninja.BIN_DIR)
    return folders


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = path_with_ninja(old)
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _cached(name: str) -> bool:
    try:  # where torch keeps builds: $TORCH_EXTENSIONS_DIR or its per-version cache folder
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:
        return False
