"""The tier seam: a store one level below the KV pool, keyed by the prefix chain's block key.

A tier holds *entries*: self-describing, checksummed byte strings (cache/tiers/entry.py), each
the K/V of a run of consecutive blocks, stored under the chain key of the run's last block. The
key already covers the model, the KV format, the salt and every token before it, so a tier never
interprets an entry: it keeps bytes and forgets them under its own budget. Every call takes a
batch so that a remote tier answers many keys in one round trip.

The contract: `put` may drop entries (budget, disk full, outage) and `get` may miss; neither
raises for such conditions, but counts them in `stats`. The caller verifies every entry it gets
and `delete`s the ones that fail, so a tier never has to trust its medium.

A tier is built from engine options: it declares the ones it takes (`options`, EngineConfig fields of
the same name, type and default) and builds itself from them (`from_options`); the registry in
`kvbank.cache.tiers` lists the tiers, fastest first.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

GIB = 2**30

#: What a tier hands back: anything exposing the buffer protocol (bytes, bytearray, a tensor's memoryview).
Buffer = bytes | bytearray | memoryview


@dataclass
class TierStats:
    """Counters of one tier; `bytes_used` and `entries` are gauges."""

    bytes_used: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    stores_dropped: int = 0
    errors: int = 0
    corrupt: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class TierOption:
    """An engine option a tier is built from: the EngineConfig field `name`, its type as annotated there
    and its default (EngineConfig holds the help the command line shows)."""

    name: str
    type: str
    default: Any


class Tier(ABC):
    """One storage level: batch contains / get / put / delete of entries by 16-byte key.

    Implementations are thread-safe: the engine's loader and writer threads call them at once.
    """

    #: short name used in options, metrics and logs ("host", "disk", "redis")
    name: str
    #: the engine options `from_options` reads
    options: ClassVar[tuple[TierOption, ...]]

    def __init__(self) -> None:
        self.stats = TierStats()
        self.lock = threading.Lock()

    @classmethod
    @abstractmethod
    def from_options(cls, options: Any, namespace: bytes) -> Tier:
        """The tier as `options` (an EngineConfig, or any object with the fields `cls.options` names) ask for
        it, for a pool whose entries live under the cache `namespace`."""

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has an entry (a False for every key while the tier is unreachable)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], max_bytes: Sequence[int] | None = None) -> list[Buffer | None]:
        """Each key's entry, or None; counts hits, misses, load bytes and seconds.

        `max_bytes`, one per key, is the largest entry the caller can use: a stored value larger than
        that is never served (None, counted as corrupt), and a tier that reads from a medium others can
        write refuses it before it reads it whole."""

    @abstractmethod
    def put(self, entries: Sequence[tuple[bytes, Buffer]]) -> int:
        """Store entries (key, blob); returns how many were stored, the rest counted as dropped."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget these keys (missing ones are ignored)."""

    @property
    def capacity_bytes(self) -> int | None:
        """The tier's byte budget, or None where the store enforces its own (Redis)."""
        return None

    def close(self) -> None:  # noqa: B027 -- tiers without connections or files have nothing to close
        """Release connections and files; the tier is unusable afterwards."""
