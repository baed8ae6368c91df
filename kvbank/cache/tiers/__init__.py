"""Tiers below the KV pool: host RAM, a disk directory, Redis. See base.py for the contract.

A new tier is one module with a `Tier` subclass (its `options` and `from_options`) plus one entry in
`TIERS`; the options it declares are EngineConfig fields, which give the command line its flags.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbank.cache.tiers.base import Buffer, Tier, TierOption, TierStats

if TYPE_CHECKING:
    from kvbank.cache.storage import KVStorage
    from kvbank.cache.tiers.entry import EntryFormat


@dataclass(frozen=True)
class TierEntry:
    """A registered tier: the module and class that implement it, and the option that asks for it (the
    tier is built when that option is set). The module is imported only then, so an unused tier's client
    library (redis-py) is never loaded."""

    module: str
    cls: str
    switch: str

    def load(self) -> type[Tier]:
        """The tier's class."""
        return getattr(importlib.import_module(self.module), self.cls)


#: every tier by name, fastest first: a load asks them in this order
TIERS: dict[str, TierEntry] = {
    "host": TierEntry("kvbank.cache.tiers.host", "HostTier", switch="kv_host_gb"),
    "disk": TierEntry("kvbank.cache.tiers.disk", "DiskTier", switch="kv_disk_dir"),
    "redis": TierEntry("kvbank.cache.tiers.redis", "RedisTier", switch="kv_redis_url"),
}


def requested_tiers(options: Any) -> list[str]:
    """The names of the tiers `options` (an EngineConfig) ask for, fastest first."""
    return [name for name, entry in TIERS.items() if getattr(options, entry.switch)]


def tier_options() -> str:
    """The options that ask for tiers, for messages: "kv_host_gb, kv_disk_dir, kv_redis_url"."""
    return ", ".join(entry.switch for entry in TIERS.values())


def build_tiers(options: Any, namespace: bytes) -> list[Tier]:
    """The tiers `options` (an EngineConfig) ask for, fastest first, for a pool whose cache namespace is
    `namespace`."""
    return [TIERS[name].load().from_options(options, namespace) for name in requested_tiers(options)]


def entry_format_for(
    storage: KVStorage, fingerprint: bytes, namespace: bytes, tier_key: str | None = None
) -> EntryFormat:
    """What this pool's entries (tier chunks, stream frames and session files) must say to be loaded
    into it; with `tier_key` (EngineConfig.kv_tier_key) they are signed with it and must be."""
    from kvbank.cache.tiers import entry

    return entry.EntryFormat(
        model=fingerprint.hex(),
        dtype=entry.dtype_name(storage.dtype),
        kv_format=namespace[len(fingerprint) :].decode(),
        block_size=storage.block_size,
        layout=storage.layout(),
        key=entry.tier_key(tier_key),
        max_blocks=storage.num_blocks,
    )


__all__ = [
    "TIERS",
    "Buffer",
    "Tier",
    "TierEntry",
    "TierOption",
    "TierStats",
    "build_tiers",
    "entry_format_for",
    "requested_tiers",
    "tier_options",
]
