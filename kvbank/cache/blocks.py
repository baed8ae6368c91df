"""Physical KV blocks and the pool that hands them out.

Free blocks live in two places: `empty` (no useful content) and `cached` (content still valid
and findable by hash, kept in LRU order). Allocation drains `empty` first so that cached prefixes
survive as long as the pool allows, and takes the most recently freed empty block first: a pool
whose pages are mapped on first touch (cache/layers/base.py) then stays as resident as the most
blocks ever in use, not the whole pool, however long a sequence keeps freeing and taking blocks.

A cached block is found by its chained hash, but a hit also compares the block's own token ids
and the identity of its parent (the root hash for a chain's first block, else the `serial` of the
indexed parent block). Serials are never reused, so a hit proves the whole prefix is the same
token sequence even if the hash function collides.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

Parent = bytes | int


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Block:
    """One fixed-size slice of the KV pool."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    parent: Parent | None = None
    serial: int = 0
    #: index of the block in its chain (0 for the block after the root)
    position: int = 0
    #: times a new sequence found this block in the prefix index
    hits: int = 0
    #: a tier holds (or is being sent) an entry that covers this block
    offloaded: bool = False
    #: 0 for a block of a sequence's block table, t + 1 for one of its window table t (cache/hybrid.py)
    group: int = 0

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = None
        self.token_ids = ()
        self.parent = None
        self.serial = 0
        self.position = 0
        self.hits = 0
        self.offloaded = False
        self.group = 0


class BlockPool:
    """Owns every block; tracks refcounts, the free lists and the hash -> block index."""

    def __init__(
        self,
        num_blocks: int,
        on_empty: Callable[[int], None] | None = None,
        on_index: Callable[[Block], None] | None = None,
        on_forget: Callable[[Block], None] | None = None,
    ) -> None:
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.index: dict[bytes, int] = {}
        self.by_serial: dict[int, int] = {}
        self._serials = itertools.count(1)
        #: called with the id of a block that goes back to `empty` (its content is dropped)
        self.on_empty = on_empty
        #: called with an indexed block just before eviction reuses it (its content is still there)
        self.on_evict: Callable[[Block], None] | None = None
        #: called with a block just indexed, and with an indexed block as it leaves the index
        self.on_index, self.on_forget = on_index, on_forget

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
            if self.on_evict is not None:
                self.on_evict(block)
            self._forget(block)
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def evict_cached(self) -> int:
        """Evict every cached free block (as if the pool needed them all); returns how many."""
        count = 0
        while self.cached:
            block_id, _ = self.cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.on_evict is not None:
                self.on_evict(block)
            self._forget(block)
            self.empty.append(block_id)
            if self.on_empty is not None:
                self.on_empty(block_id)
            count += 1
        return count

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...], parent: Parent) -> Block | None:
        """The indexed block holding exactly these tokens after exactly this parent, if any."""
        block_id = self.index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids and block.parent == parent else None

    def share(self, block: Block) -> None:
        """Take one more reference; a cached free block leaves the LRU list."""
        if block.ref_count == 0:
            del self.cached[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block becomes free (and stays findable if indexed)."""
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is not None:
            self.cached[block.block_id] = None
        else:
            self.empty.appendleft(block.block_id)
            if self.on_empty is not None:
                self.on_empty(block.block_id)

    def parent_block(self, block: Block) -> Block | None:
        """The indexed block before `block` in its chain (None at the root or once it left the pool)."""
        if not isinstance(block.parent, int):
            return None
        block_id = self.by_serial.get(block.parent)
        return None if block_id is None else self.blocks[block_id]

    def register(
        self,
        block: Block,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent: Parent,
        position: int = 0,
        group: int = 0,
    ) -> int | None:
        """Index a full, computed block.

        Returns the serial that stands for this content from now on: the block's own, or that of
        an identical block indexed earlier; None if another content holds the hash (a collision),
        in which case the block stays unindexed.
        """
        same = self.lookup(block_hash, token_ids, parent)
        if same is not None:
            return same.serial
        if block_hash in self.index:
            return None
        block.hash, block.token_ids, block.parent, block.position = block_hash, token_ids, parent, position
        block.group = group
        block.serial = next(self._serials)
        self.index[block_hash] = block.block_id
        self.by_serial[block.serial] = block.block_id
        if self.on_index is not None:
            self.on_index(block)
        return block.serial

    def _forget(self, block: Block) -> None:
        if block.hash is not None:
            if self.on_forget is not None:
                self.on_forget(block)
            del self.index[block.hash]
            del self.by_serial[block.serial]
        block.reset()
