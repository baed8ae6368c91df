"""Native CPU kernels, compiled from C++ on first use and cached (torch.utils.cpp_extension).

`native()` returns the compiled module, or None where it cannot be had: no C++ compiler, a
failed build, or KVBANK_NATIVE_KERNELS=0. Callers keep their PyTorch path for None, so a machine
without a compiler runs the same engine, only slower. The first build takes two to three minutes on
two cores; later processes load the cached library (under $TORCH_EXTENSIONS_DIR or ~/.cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvbank.kernels import isa

logger = logging.getLogger("kvbank.kernels")

_SOURCE_DIR = Path(__file__).parent
#: The translation units, compiled apart (in parallel) and linked into one module.
UNITS = (
    "bindings.cpp",
    "layers.cpp",
    "matmul.cpp",
    "matmul_avx2.cpp",
    "matmul_vnni.cpp",
    "fused.cpp",
    "stack.cpp",
    "dense_attention.cpp",
    "quant_attention.cpp",
    "quant_attention_avx512.cpp",
    "cache_write.cpp",
    "key_blocks.cpp",
    "sampling.cpp",
)
#: Everything that names the build: the units and the headers they share.
SOURCES = (
    *UNITS,
    "native.h",
    "isa.h",
    "simd.h",
    "simd_ops.inc",
    "argmax.inc",
    "layers.h",
    "matmul.h",
    "fused.h",
    "stack.h",
    "partials.h",
    "dense_attention.h",
    "quant_attention.h",
    "quant_kernels.h",
    "cache_write.h",
)
# parallel_for in the kernels is OpenMP: without -fopenmp it would run on one thread. Hidden
# visibility: the units share helpers through headers, and exported from the library each call to
# them would go through the PLT; only the module's entry point needs to be seen.
CFLAGS = ("-O3", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()
_state: dict[str, object] = {}  # after the one attempt: "module", or "failure" (why it failed)


def enabled() -> bool:
    return os.environ.get("KVBANK_NATIVE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def native():
    """The native module, or None; built (or loaded from the cache) once per process."""
    if not enabled():
        return None
    isa.parse_level(os.environ.get(isa.ENV, ""))  # a bad KVBANK_ISA is the caller's error, not a failed build
    with _lock:
        if not _state:
            _state.update(_build())
            if "module" in _state:
                isa.apply_env_cap(_state["module"])
        return _state.get("module")


def failure() -> str | None:
    """Why the native module could not be built, if it could not."""
    return _state.get("failure")


def module_name() -> str:
    """The build's name: a digest of the sources and of everything else that shapes the build command.

    torch keeps one build folder per name, shared by every environment on the machine, and its
    build.ninja names the sources by their absolute paths. Two environments or checkouts with the
    same sources but another torch, Python, compiler or source folder would each rewrite the other's
    build.ninja and rebuild there in turn; named apart, each keeps its own build.
    """
    digest = hashlib.sha256()
    for part in (*(_SOURCE_DIR / f for f in SOURCES), *_build_inputs()):
        digest.update(part.read_bytes() if isinstance(part, Path) else part.encode())
        digest.update(b"\0")  # parts apart: bytes moved from one part to the next change the name
    return f"kvbank_native_{digest.hexdigest()[:12]}"


def _build_inputs() -> list[str]:
    """What besides the sources' bytes goes into the build command: their folder, torch, Python,
    compiler and flags."""
    import torch

    compiler = os.environ.get("CXX", "c++")
    return [
        str(_SOURCE_DIR.resolve()),
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
        sys.prefix,
        os.path.realpath(sys.executable),
        " ".join(CFLAGS),
        " ".join(LDFLAGS),
        os.path.realpath(shutil.which(compiler) or compiler),
    ]


def build_folder(name: str) -> Path:
    """Where torch builds and caches `name`: $TORCH_EXTENSIONS_DIR or its per-version cache folder."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build() -> dict[str, object]:
    try:
        from torch.utils.cpp_extension import load

        name = module_name()
        if not _cached(name):
            print(
                "kvbank: compiling the native CPU kernels (once, two to three minutes on two cores; "
                "KVBANK_NATIVE_KERNELS=0 skips them)",
                file=sys.stderr,
                flush=True,
            )
        with _ninja_on_path(), _build_lock(name):
            module = load(
                name=name,
                sources=[str(_SOURCE_DIR / unit) for unit in UNITS],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
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
    try:
        return (build_folder(name) / f"{name}.so").exists()
    except Exception:
        return False


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold an OS lock on the build folder while torch builds or loads the module there.

    torch marks a build in progress with a `lock` file it deletes when done; a process killed
    mid-build leaves that file behind and every later load waits on it forever, silently. kvbank's
    processes take this flock first (the OS drops it when its holder dies), so a `lock` file found
    while holding it is stale and is removed.
    """
    try:
        import fcntl

        folder = build_folder(name)
    except Exception:  # no flock here (Windows), or torch moved its helper: torch's own baton only
        yield
        return
    with open(folder / "kvbank.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"kvbank: waiting for another process building the native kernels in {folder}", file=sys.stderr)
            started = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            logger.info("waited %.0f s for the native kernels' build lock", time.monotonic() - started)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a process that died while building the native kernels", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
