"""Tiers below the KV pool: host RAM, a disk directory, Redis. See base.py for the contract."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol

from kvbank.cache.tiers.base import Buffer, Tier, TierStats

if TYPE_CHECKING:
    from kvbank.cache.storage import KVStorage
    from kvbank.cache.tiers.entry import EntryFormat

GIB = 2**30


class TierOptions(Protocol):
    """The options tiers are built from (EngineConfig's `kv_*` fields)."""

    kv_host_gb: float
    kv_disk_dir: str | None
    kv_disk_gb: float
    kv_redis_url: str | None
    kv_redis_ttl: float | None
    kv_redis_timeout: float


def build_tiers(config: TierOptions, namespace: bytes) -> list[Tier]:
    """The tiers `config` asks for, fastest first: host RAM, disk, Redis."""
    tiers: list[Tier] = []
    if config.kv_host_gb:
        from kvbank.cache.tiers.host import HostTier

        tiers.append(HostTier(int(config.kv_host_gb * GIB)))
    if config.kv_disk_dir:
        from kvbank.cache.tiers.disk import DiskTier

        tiers.append(DiskTier(config.kv_disk_dir, int(config.kv_disk_gb * GIB)))
    if config.kv_redis_url:
        from kvbank.cache.tiers.redis import RedisTier

        tiers.append(
            RedisTier(
                config.kv_redis_url,
                hashlib.blake2b(namespace, digest_size=8).hexdigest(),
                ttl_seconds=config.kv_redis_ttl,
                timeout_seconds=config.kv_redis_timeout,
            )
        )
    return tiers


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


__all__ = ["Buffer", "Tier", "TierStats", "TierOptions", "build_tiers", "entry_format_for"]
