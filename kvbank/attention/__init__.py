"""Paged attention: per-step metadata, the reference implementation and the fast path."""

from kvbank.attention.metadata import AttentionMetadata, PrefillChunk, write_kv

__all__ = ["AttentionMetadata", "PrefillChunk", "write_kv"]
