"""Tiers below the KV pool: host RAM, a disk directory, Redis. See base.py for the contract."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvbank.cache.tiers.base import Buffer, Tier, TierStats

if TYPE_CHECKING:
    from kvbank.cache.manager import KVCacheManager
    from kvbank.cache.offload import KVOffload
    from kvbank.cache.storage import KVStorage
    from kvbank.cache.tiers.entry import EntryFormat
    from kvbank.config import EngineConfig

GIB = 2**30


def build_tiers(config: EngineConfig, namespace: bytes) -> list[Tier]:
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


def entry_format_for(storage: KVStorage, fingerprint: bytes, namespace: bytes) -> EntryFormat:
    """What this pool's entries (tier chunks and session files) must say to be loaded into it."""
    from kvbank.cache.tiers.entry import EntryFormat, dtype_name

    return EntryFormat(
        model=fingerprint.hex(),
        dtype=dtype_name(storage.dtype),
        kv_format=namespace[len(fingerprint) :].decode(),
        block_size=storage.block_size,
        layout=storage.layout(),
    )


def build_offload(
    config: EngineConfig, manager: KVCacheManager, storage: KVStorage, fingerprint: bytes, namespace: bytes
) -> KVOffload | None:
    """The controller that keeps the pool's prefixes in the configured tiers (None without tiers)."""
    from kvbank.cache.offload import KVOffload, chunk_blocks_for

    tiers = build_tiers(config, namespace)
    if not tiers:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("KV tiers (kv_host_gb, kv_disk_dir, kv_redis_url) need enable_prefix_caching=True")
    return KVOffload(
        tiers,
        manager,
        storage,
        entry_format_for(storage, fingerprint, namespace),
        chunk_blocks_for(config.kv_tier_chunk_tokens, config.block_size),
        config.kv_tier_write_policy,
        config.kv_offload_min_hits,
    )


__all__ = ["Buffer", "Tier", "TierStats", "build_offload", "build_tiers", "entry_format_for"]
