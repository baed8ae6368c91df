"""glibc allocator tuning for the CPU hot loop."""

from __future__ import annotations

import ctypes


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed memory for allocations up to 32 MiB instead of returning it.

    Every layer of a step allocates and frees the same large temporaries (gathered and
    dequantized K/V). By default glibc maps each one afresh, and the kernel zeroes every page on
    first touch, which made int4 KV decoding over 2x slower. Returns whether the setting took.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**30))
    except (OSError, AttributeError):
        return False
