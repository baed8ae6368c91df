"""Native CPU kernels, compiled from C++ on first use and cached (torch.utils.cpp_extension).

`native()` returns the compiled module, or None where it cannot be had: no C++ compiler, a
failed build, or KVBANK_NATIVE_KERNELS=0. Callers keep their PyTorch path for None, so a machine
without a compiler runs the same engine, only slower. The first build takes about a minute on two
cores; later processes load the cached library (under $TORCH_EXTENSIONS_DIR or ~/.cache).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

logger = logging.getLogger("kvbank.kernels")

_SOURCE_DIR = Path(__file__).parent
#: bindings.cpp includes the kernels' sources; all of them (and native.h) name the build.
SOURCES = ("bindings.cpp", "native.h", "layers.cpp", "paged_decode.cpp")
_lock = threading.Lock()
_modules: dict[str, object] = {}
_failed: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get("KVBANK_NATIVE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _build(name: str):
    with _lock:
        if name in _modules or name in _failed:
            return _modules.get(name)
        try:
            from torch.utils.cpp_extension import load
            digest = hashlib.sha256(b"".join((_SOURCE_DIR / f).read_bytes() for f in SOURCES)).hexdigest()[:12]
            full_name = f"kvbank_{name}_{digest}"
            if not _cached(full_name):
                print("kvbank: compiling the native CPU kernels (once, about a minute on two cores; "
                      "KVBANK_NATIVE_KERNELS=0 skips them)", file=sys.stderr, flush=True)
            # parallel_for in the kernel is OpenMP: without -fopenmp it would run on one thread.
            module = load(name=full_name, sources=[str(_SOURCE_DIR / SOURCES[0])],
                          extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no ninja, a build error: fall back, say why once
            _failed[name] = f"{type(exc).__name__}: {exc}"
            logger.warning("native CPU kernels unavailable, running on PyTorch alone: %s", _failed[name][:500])
            return None
        _modules[name] = module
        return module


def _cached(full_name: str) -> bool:
    try:  # where torch keeps builds: $TORCH_EXTENSIONS_DIR or its per-version cache folder
        from torch.utils.cpp_extension import _get_build_directory
        return (Path(_get_build_directory(full_name, verbose=False)) / f"{full_name}.so").exists()
    except Exception:
        return False


def native():
    """The native module, or None."""
    if not enabled():
        return None
    return _modules.get("native") or _build("native")


def failure() -> str | None:
    """Why the native module could not be built, if it could not."""
    return _failed.get("native")
