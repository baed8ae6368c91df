"""Storage kinds of the KV pool, one module each, and the registry that names them.

A new kind is one module with a `KVKind` subclass (and its layer class) plus one line here; a
codec names the kind that stores it (`Codec.kind`).
"""

from kvbank.cache.layers.base import KVKind, KVLayer, PoolSpec, StepSeq
from kvbank.cache.layers.dense import DenseKind
from kvbank.cache.layers.kivi import KiviKind
from kvbank.cache.layers.token import TokenKind

KINDS: dict[str, type[KVKind]] = {
    DenseKind.name: DenseKind,
    TokenKind.name: TokenKind,
    KiviKind.name: KiviKind,
}

__all__ = ["KINDS", "KVKind", "KVLayer", "PoolSpec", "StepSeq"]
