"""Physical KV blocks and the pool that hands them out.

Free blocks live in two places: `empty` (no useful content) and `cached` (content still valid
and findable by hash, kept in LRU order). Allocation drains `empty` first so that cached prefixes
survive as long as the pool allows.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    """One fixed-size slice of the KV pool."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.token_ids = ()


class BlockPool:
    """Owns every block; tracks refcounts, the free lists and the hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.index: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    def take(self) -> Block:
        """A free block with refcount 1; evicts the least recently used cached block if needed."""
        if self.empty:
            block = self.blocks[self.empty.popleft()]
        else:
            block_id, _ = self.cached.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block holding exactly these tokens under this hash, if any."""
        block_id = self.index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def share(self, block: Block) -> None:
        """Take one more reference; a cached free block leaves the LRU list."""
        if block.ref_count == 0:
            del self.cached[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block becomes free (and stays findable if hashed)."""
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is not None:
            self.cached[block.block_id] = None
        else:
            self.empty.append(block.block_id)

    def register(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Make a full, computed block findable by its hash (the first block with a hash keeps it)."""
        if block_hash in self.index:
            return
        block.hash = block_hash
        block.token_ids = token_ids
        self.index[block_hash] = block.block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None:
            del self.index[block.hash]
        block.reset()
