"""Tiers below the KV pool: host RAM, a disk directory, Redis. See base.py for the contract."""

from kvbank.cache.tiers.base import Buffer, Tier, TierStats

__all__ = ["Buffer", "Tier", "TierStats"]
