"""Chained hashes of full blocks: a block's hash covers its tokens and every token before it."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_hash(namespace: bytes, salt: str | None) -> bytes:
    """The hash every chain starts from: the model's fingerprint and the tenant's salt."""
    h = hashlib.blake2b(namespace, digest_size=16)
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block, chained from its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()
