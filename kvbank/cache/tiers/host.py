"""Host RAM tier: entries kept in process memory, least recently used first out of a byte budget.

Entries are kept as given (the engine packs them into pinned memory when CUDA is present, so a
load back to the GPU is one DMA copy), never copied.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvbank.cache.tiers.base import GIB, Buffer, Tier, TierOption


class HostTier(Tier):
    """Entries in RAM within `capacity_bytes`, evicted least recently used first."""

    name = "host"
    options = (TierOption("kv_host_gb", "float", 0.0),)

    @classmethod
    def from_options(cls, options: Any, namespace: bytes) -> HostTier:
        return cls(int(options.kv_host_gb * GIB))

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity {capacity_bytes} bytes must be > 0")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[bytes, memoryview] = OrderedDict()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self.lock:
            return [key in self._entries for key in keys]

    def get(self, keys: Sequence[bytes], max_bytes: Sequence[int] | None = None) -> list[Buffer | None]:
        start = time.perf_counter()
        found: list[Buffer | None] = []
        with self.lock:
            for i, key in enumerate(keys):
                blob = self._entries.get(key)
                if blob is not None and max_bytes is not None and blob.nbytes > max_bytes[i]:
                    self.stats.corrupt += 1
                    blob = None
                if blob is not None:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    self.stats.load_bytes += blob.nbytes
                else:
                    self.stats.misses += 1
                found.append(blob)
            self.stats.load_seconds += time.perf_counter() - start
        return found

    def put(self, entries: Sequence[tuple[bytes, Buffer]]) -> int:
        start = time.perf_counter()
        stored = 0
        with self.lock:
            for key, blob in entries:
                view = memoryview(blob).cast("B")
                if view.nbytes > self._capacity:
                    self.stats.stores_dropped += 1
                    continue
                self._remove(key)
                while self.stats.bytes_used + view.nbytes > self._capacity:
                    self._remove(next(iter(self._entries)))
                self._entries[key] = view
                self.stats.bytes_used += view.nbytes
                self.stats.store_bytes += view.nbytes
                stored += 1
            self.stats.entries = len(self._entries)
            self.stats.store_seconds += time.perf_counter() - start
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self._remove(key)
            self.stats.entries = len(self._entries)

    def _remove(self, key: bytes) -> None:
        blob = self._entries.pop(key, None)
        if blob is not None:
            self.stats.bytes_used -= blob.nbytes
