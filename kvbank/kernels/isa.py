"""The instruction-set registry's Python face (kvbank/kernels/isa.h).

Levels, each holding the features of the ones before it: scalar, avx2 (AVX2, FMA, F16C), avx512
(AVX-512 F/BW/DQ/VL), avx512_vnni (+ VNNI), avx512_bf16 (+ BF16, VBMI), amx (+ AMX-TILE,
AMX-INT8). Every native kernel family runs its best variant at or below the active level: the
CPU's own, capped by `KVBANK_ISA` (or `capped()`), never above what the CPU has. The cap is
process-wide and read by every kernel call, so an engine should be built and run under one cap.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger("kvbank.kernels")

LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
#: the environment variable that caps the level (unset, empty or "auto": no cap)
ENV = "KVBANK_ISA"


def parse_level(name: str) -> str | None:
    """`name` as a level, None for no cap ("auto" or empty); ValueError naming the levels otherwise."""
    name = name.strip().lower()
    if name in ("", "auto", "native"):
        return None
    if name not in LEVELS:
        raise ValueError(f"{ENV}={name!r} is not an instruction-set level; the levels are auto, {', '.join(LEVELS)}")
    return name


def apply_env_cap(module) -> None:
    """Cap `module`'s kernels at KVBANK_ISA (called once when the native module loads)."""
    level = parse_level(os.environ.get(ENV, ""))
    if level is None:
        return
    cpu = module.isa_report()["cpu"]
    if LEVELS.index(level) > LEVELS.index(cpu):
        logger.warning("%s=%s is above this CPU's level %s; running at %s", ENV, level, cpu, cpu)
    module.set_isa_cap(level)


def report(module) -> dict:
    """The CPU's level, the cap, the active level and each family's variant (None: no native
    variant there); without the native module every family runs PyTorch."""
    if module is None:
        return {"cpu": None, "cap": None, "active": None, "families": {}}
    return module.isa_report()


def levels_below_cpu(module) -> list[str]:
    """Every level this CPU runs, lowest first."""
    return list(LEVELS[: LEVELS.index(module.isa_report()["cpu"]) + 1])


@contextlib.contextmanager
def capped(module, level: str) -> Iterator[None]:
    """Run the body with `module`'s kernels capped at `level`, then restore the cap."""
    previous = module.isa_report()["cap"]
    module.set_isa_cap(level)
    try:
        yield
    finally:
        module.set_isa_cap(previous)


def describe(module) -> str:
    """One line for logs: the CPU's level, the active one, and each family's variant."""
    info = report(module)
    if info["cpu"] is None:
        return "native kernels unavailable: PyTorch only"
    families = ", ".join(f"{name} {variant or 'PyTorch'}" for name, variant in info["families"].items())
    capped_note = f" (capped by {ENV})" if info["active"] != info["cpu"] else ""
    return f"CPU level {info['cpu']}, running {info['active']}{capped_note}: {families}"
