"""Per-sequence KV bookkeeping on top of the block pool: prefix hits, growth, forks, frees.

Plain Python, no tensors: block contents are moved by the runner. `append_slots` returns the
copy-on-write copies (source -> destination block ids) the next forward pass must make first.

With a hybrid layout (cache/hybrid.py) a sequence also holds window tables: they grow with it, and
`commit` releases the blocks its windows have moved past (indexed ones stay cached). A prefix hit
then needs, beside the full-attention blocks, every window table's blocks of the window before
the first recomputed token: the longest prefix with both is the hit.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from typing import Any, Protocol

from kvbank.cache.blocks import Block, BlockPool, blocks_for
from kvbank.cache.events import CacheEvents
from kvbank.cache.hybrid import KVGroups
from kvbank.cache.prefix import block_hash

log = logging.getLogger("kvbank")

#: What block_states() reports per block.
FREE, IN_USE, CACHED, PINNED = range(4)

#: A window table's entry for a block its window has moved past (released).
GONE = -1


class Sequence(Protocol):
    """What the manager reads and writes of a sequence (kvbank.engine.sequence.Sequence has it)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    chain_serials: list[int | None]
    #: blocks kept for the sequence before it is admitted (loaded from a tier), released on allocate
    held_blocks: list[int]
    #: a blended prompt's documents loaded from a tier, each a sequence holding their blocks until
    #: the blend has placed them (engine/blend.py)
    document_holds: list[Any]
    #: tokens a long-context policy dropped from the cache, and the blocks it keeps aside
    num_evicted: int
    pristine_blocks: list[int]
    #: hybrid layouts: per window table, block ids (GONE below the window); the first index not yet
    #: released, and blocks before `window_committed` are indexed as far as they can be
    window_tables: list[list[int]]
    window_first: int
    window_committed: int

    @property
    def num_slots(self) -> int: ...

    @property
    def num_cacheable_tokens(self) -> int: ...

    @property
    def blend(self) -> Any: ...

    @property
    def max_slots(self) -> int | None: ...

    @property
    def prefix_limit(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def root_hash(self) -> bytes: ...

    @property
    def no_prefix_cache(self) -> bool: ...


def _admitted_tokens(seq: Sequence, num_hits: int, block_size: int) -> int:
    # A sequence whose policy bounds its cache gets blocks for its hits and that bound (its first
    # chunk fits in it); later chunks append after the policy has evicted.
    if seq.max_slots is None:
        return seq.num_tokens
    return min(seq.num_tokens, num_hits * block_size + seq.max_slots)


class KVCacheManager:
    """Gives each sequence a block table and keeps the prefix index up to date."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_pinned_fraction: float,
        on_empty: Callable[[int], None] | None = None,
        events: CacheEvents | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        """`enable_prefix_caching` and `max_pinned_fraction` are `EngineConfig` options, given by the
        builder (no default here, which could drift from the config's). `on_empty(block_id)`: a
        block's content is dropped (storage frees what it keeps beside it); `events` hears of every
        block entering and leaving the prefix index; `groups`: the hybrid layout of a model with
        sliding-window layers (None: every layer keeps every token)."""
        self.events = events
        self.groups = groups
        if events is None:
            self.pool = BlockPool(num_blocks, on_empty)
        else:
            self.pool = BlockPool(num_blocks, on_empty, self._indexed, self._forgotten)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_pinned_blocks = int(max_pinned_fraction * num_blocks)
        self.pins: dict[tuple[bytes, tuple[int, ...]], list[int]] = {}
        self.pinned_blocks: Counter[int] = Counter()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def gauges(self) -> dict[str, float]:
        """The pool's blocks now, by the states `block_states` shows: free (empty), cached (a prefix no
        sequence holds, evicted LRU-first when blocks run out), in use and pinned, which add up to
        `num_blocks`; and the fraction in use or pinned. `num_free_blocks` (the property) is what an
        allocation can take: free and cached together."""
        free, cached, pinned = len(self.pool.empty), len(self.pool.cached), len(self.pinned_blocks)
        return {
            "num_blocks": self.pool.num_blocks,
            "num_free_blocks": free,
            "num_cached_blocks": cached,
            "num_used_blocks": self.pool.num_blocks - free - cached - pinned,
            "num_pinned_blocks": pinned,
            "kv_cache_usage": self.usage,
        }

    def usable_blocks(self, token_ids: Tokens[int], root_hash: bytes) -> int:
        """The most blocks one sequence starting with `token_ids` can ever hold: every block not
        pinned, plus the pinned ones its own prefix would share."""
        if not self.pinned_blocks:
            return self.pool.num_blocks
        shared = sum(1 for block in self._walk(token_ids, root_hash) if block.block_id in self.pinned_blocks)
        return self.pool.num_blocks - len(self.pinned_blocks) + shared

    def held_prefix_blocks(self, token_ids: Tokens[int], root_hash: bytes) -> int:
        """Blocks of the cached prefix of `token_ids` that are held (in use or pinned): a sequence
        starting with it shares them without taking a free block."""
        return sum(1 for b in self._walk(token_ids, root_hash) if b.ref_count or b.block_id in self.pinned_blocks)

    def block_states(self) -> bytes:
        """One byte per block: FREE (empty), IN_USE, CACHED (evictable) or PINNED."""
        states = bytearray(self.pool.num_blocks)
        for block_id in self.pool.cached:
            states[block_id] = CACHED
        for block in self.pool.blocks:
            if block.ref_count:
                states[block.block_id] = IN_USE
        for block_id in self.pinned_blocks:
            states[block_id] = PINNED
        return bytes(states)

    def can_allocate(self, seq: Sequence, budget: int | None = None) -> bool:
        """Whether `allocate(seq, budget)` finds the blocks it needs free."""
        hits, windows = self._prefix_hits(seq)
        revived = sum(1 for block in [*hits, *_flat(windows)] if block.ref_count == 0)
        needed = blocks_for(_admitted_tokens(seq, len(hits), self.block_size), self.block_size) - len(hits)
        return self.pool.num_free - revived >= needed + self._window_growth(seq, len(hits), budget)

    def allocate(self, seq: Sequence, budget: int | None = None) -> None:
        """Block table for all of `seq`'s tokens; cached leading blocks are shared, not recomputed.
        Window tables (hybrid layouts) get blocks for the first `budget` tokens to compute (all)."""
        assert not seq.block_table
        hits, windows = self._prefix_hits(seq)
        for block in [*hits, *_flat(windows)]:
            self.pool.share(block)
            block.hits += 1
        self._release_held(seq)
        seq.block_table = [block.block_id for block in hits]
        seq.chain_serials = [block.serial for block in hits]
        for _ in range(len(hits), blocks_for(_admitted_tokens(seq, len(hits), self.block_size), self.block_size)):
            seq.block_table.append(self.pool.take().block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.groups is not None:
            first = self.groups.first_block(seq.num_computed_tokens, self.block_size)
            seq.window_tables = [[GONE] * first + [block.block_id for block in column] for column in windows]
            seq.window_first, seq.window_committed = first, len(hits)
            grow = self._window_growth(seq, len(hits), budget) // self.groups.num_window_tables
            for table in seq.window_tables:
                table.extend(self.pool.take().block_id for _ in range(grow))

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        needed = self._blocks_to_add(seq, num_new) + self._needs_copy(seq)
        if self.groups is not None:
            index = seq.num_slots // self.block_size
            needed += sum(self._shared(table, index) for table in seq.window_tables)
            needed += self.groups.num_window_tables * self._window_to_add(seq, num_new)
        return self.pool.num_free >= needed

    def append_slots(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        """Make room to write K/V for positions [computed, computed + num_new); returns the block
        copies (source, destination) to make before writing: a shared partial block is split."""
        copies = [self._copy_on_write(seq, seq.num_slots // self.block_size)] if self._needs_copy(seq) else []
        for _ in range(self._blocks_to_add(seq, num_new)):
            seq.block_table.append(self.pool.take().block_id)
        if self.groups is not None:
            index, grow = seq.num_slots // self.block_size, self._window_to_add(seq, num_new)
            for table in seq.window_tables:
                if self._shared(table, index):
                    copies.append(self._split(table, index))
                table.extend(self.pool.take().block_id for _ in range(grow))
        return copies

    def evict_cached(self) -> int:
        """Drop every cached prefix block not in use or pinned; returns blocks dropped."""
        dropped = self.pool.evict_cached()
        self.end_step()  # called between steps: its events are a batch of their own
        return dropped

    def end_step(self) -> None:
        """The cache events since the last call are one step's: publish them as one batch."""
        if self.events is not None:
            self.events.flush()

    def close_events(self) -> None:
        """Publish what is pending and stop publishing."""
        if self.events is not None:
            self.events.close()

    def take_blocks(self, count: int) -> list[int]:
        """`count` fresh private blocks for a table the caller fills itself (a recalled cache)."""
        assert count <= self.num_free_blocks
        return [self.pool.take().block_id for _ in range(count)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`; the first write to a shared block copies it."""
        for block_id in parent.block_table + parent.pristine_blocks + held_window_blocks(parent.window_tables):
            self.pool.share(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.pristine_blocks = list(parent.pristine_blocks)
        child.window_tables = [list(table) for table in parent.window_tables]
        child.window_first, child.window_committed = parent.window_first, parent.window_committed

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first, so the LRU evicts tails before shared heads (pristine
        blocks are the heads as first computed, so they go last)."""
        windows = held_window_blocks(seq.window_tables)
        for block_id in [*reversed(windows), *reversed(seq.block_table), *reversed(seq.pristine_blocks)]:
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table = []
        seq.pristine_blocks = []
        seq.window_tables, seq.window_first, seq.window_committed = [], 0, 0
        self._release_held(seq)
        self.free_document_holds(seq)

    def free_document_holds(self, seq: Sequence) -> None:
        """Release the blocks held for `seq`'s documents (loaded from a tier for its blend)."""
        for held in seq.document_holds:
            self.free(held)
        seq.document_holds = []

    def hold(self, seq: Sequence, blocks: list[Block]) -> None:
        """Keep `blocks` out of eviction until `seq` is allocated or freed (they take a reference each)."""
        for block in blocks:
            self.pool.share(block)
            seq.held_blocks.append(block.block_id)

    def cached_prefix(self, seq: Sequence, num_blocks: int) -> list[Block]:
        """The cached blocks holding the longest prefix of `seq`'s first `num_blocks` whole blocks."""
        self._hash_blocks(seq, num_blocks)
        return self._walk(seq.token_ids[: num_blocks * self.block_size], seq.root_hash, seq.block_hashes)

    def cached_blocks(self, token_ids: Tokens[int], root_hash: bytes) -> list[Block]:
        """The cached blocks holding the longest whole-block prefix of `token_ids` under `root_hash`
        (a document's blocks: engine/blend.py); they stay the pool's, so read them before anything
        else takes blocks."""
        return self._walk(token_ids, root_hash) if self.enable_prefix_caching else []

    def computing(self, seq: Sequence) -> list[bytes]:
        """Hashes of the whole prompt blocks `seq` has yet to compute and will index once it has
        (none when it indexes nothing: no prefix caching, prompt logprobs, evictions, a stream)."""
        if not self.enable_prefix_caching or seq.no_prefix_cache or seq.num_evicted or seq.frames is not None:
            return []
        bs = self.block_size
        done, full = seq.num_computed_tokens // bs, seq.num_prompt_tokens // bs
        if seq.blend is not None:  # blended blocks are never indexed (engine/blend.py)
            full = min(full, seq.blend.documents[0].start // bs)
        if full <= done:
            return []
        self._hash_blocks(seq, full)
        return seq.block_hashes[done:full]

    def commit(self, seq: Sequence) -> None:
        """Index every block of `seq` that is now full and computed; then release the window blocks
        the next token no longer reads (hybrid layouts)."""
        self._index(seq)
        if self.groups is not None:
            first = self.groups.first_block(seq.num_slots, self.block_size)
            for index in range(seq.window_first, first):
                for table in seq.window_tables:
                    if table[index] != GONE:
                        self.pool.release(self.pool.blocks[table[index]])
                        table[index] = GONE
            seq.window_first = max(seq.window_first, first)

    def _index(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching or seq.no_prefix_cache or seq.num_evicted:
            return  # after an eviction, blocks no longer hold the full computation of their tokens
        bs = self.block_size
        full = seq.num_cacheable_tokens // bs
        self._hash_blocks(seq, full)
        while len(seq.chain_serials) < full:
            i = len(seq.chain_serials)
            parent = seq.chain_serials[i - 1] if i else seq.root_hash
            serial = None
            if parent is not None:  # after a collision the rest of the chain stays unindexed
                block = self.pool.blocks[seq.block_table[i]]
                serial = self.pool.register(
                    block, seq.block_hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]), parent, i
                )
            seq.chain_serials.append(serial)
        if self.groups is None:
            return
        # a window block is indexed under its full-attention block's serial: found only through it
        for i in range(seq.window_committed, full):
            serial = seq.chain_serials[i]
            for t, table in enumerate(seq.window_tables):
                if serial is not None and table[i] != GONE:
                    tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    self.pool.register(
                        self.pool.blocks[table[i]], _window_hash(seq.block_hashes[i], t), tokens, serial, i, t + 1
                    )
        seq.window_committed = max(seq.window_committed, full)

    def pin(self, token_ids: Tokens[int], root_hash: bytes, keep_free: int = 0) -> int:
        """Keep the cached full blocks of this prefix out of eviction; returns the tokens pinned.

        Every full block must be cached already (run the prefix once first). At least `keep_free`
        blocks stay unpinned, so that requests already admitted can still finish. Only whole blocks
        are cached: a prefix shorter than one block pins nothing (0, with a warning).
        """
        if len(token_ids) < self.block_size:
            log.warning(
                "pin_prefix: nothing pinned yet: the prefix has %d tokens and only whole blocks of %d tokens "
                "(block_size) are cached",
                len(token_ids),
                self.block_size,
            )
            return 0
        key = (root_hash, tuple(token_ids[: len(token_ids) // self.block_size * self.block_size]))
        if key in self.pins:
            return len(key[1])
        hashes = self._chain(key[1], root_hash)
        blocks, windows = self._window_hits(key[1], hashes, self._walk(key[1], root_hash, hashes))
        if len(blocks) * self.block_size < len(key[1]):
            raise ValueError(
                f"only {len(blocks) * self.block_size} of the prefix's {len(key[1])} tokens are cached"
                f"{' with their windows' if self.groups is not None else ''}; compute the prefix before pinning it"
            )
        blocks = [*blocks, *_flat(windows)]  # a hit needs the window's blocks too
        added = len({b.block_id for b in blocks} - set(self.pinned_blocks))
        if len(self.pinned_blocks) + added > self.max_pinned_blocks:
            raise ValueError(
                f"pinning {added} more blocks would pin {len(self.pinned_blocks) + added} of "
                f"{self.pool.num_blocks}, over the limit of {self.max_pinned_blocks} "
                f"(max_pinned_fraction)"
            )
        if self.pool.num_blocks - len(self.pinned_blocks) - added < keep_free:
            raise ValueError(
                f"pinning {added} more blocks would leave {self.pool.num_blocks - len(self.pinned_blocks) - added}"
                f" unpinned, but a request in flight needs up to {keep_free}; pin before sending it"
            )
        for block in blocks:
            self.pool.share(block)
            self.pinned_blocks[block.block_id] += 1
        self.pins[key] = [block.block_id for block in blocks]
        return len(key[1])

    def unpin(self, token_ids: Tokens[int], root_hash: bytes) -> int:
        """Let a pinned prefix be evicted again; returns the tokens unpinned (0 if it was not pinned)."""
        key = (root_hash, tuple(token_ids[: len(token_ids) // self.block_size * self.block_size]))
        block_ids = self.pins.pop(key, None)
        if block_ids is None:
            return 0
        for block_id in block_ids:
            self.pinned_blocks[block_id] -= 1
            if not self.pinned_blocks[block_id]:
                del self.pinned_blocks[block_id]
            self.pool.release(self.pool.blocks[block_id])
        return len(key[1])

    def _prefix_hits(self, seq: Sequence) -> tuple[list[Block], list[list[Block]]]:
        """The cached blocks a new `seq` starts with, and (hybrid layouts) per window table the
        blocks of the window before its first computed token."""
        # The last token is always recomputed: its logits are needed to sample.
        if not self.enable_prefix_caching or seq.no_prefix_cache:
            return [], [[] for _ in range(self.groups.num_window_tables if self.groups else 0)]
        num_full = min(seq.num_tokens - 1, seq.prefix_limit) // self.block_size
        self._hash_blocks(seq, num_full)
        tokens = seq.token_ids[: num_full * self.block_size]
        return self._window_hits(tokens, seq.block_hashes, self._walk(tokens, seq.root_hash, seq.block_hashes))

    def _window_hits(
        self, token_ids: Tokens[int], hashes: list[bytes], hits: list[Block]
    ) -> tuple[list[Block], list[list[Block]]]:
        """`hits` cut to the longest prefix whose window blocks are all cached, and those blocks."""
        if self.groups is None:
            return hits, []
        bs, n, found = self.block_size, len(hits), {}
        i = n - 1
        while i >= self.groups.first_block(n * bs, bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            row = [
                self.pool.lookup(_window_hash(hashes[i], t), tokens, hits[i].serial)
                for t in range(self.groups.num_window_tables)
            ]
            if None in row:
                n = i  # a hit may end no later than a missing window block
            else:
                found[i] = row
            i -= 1
        first = self.groups.first_block(n * bs, bs)
        return hits[:n], [[found[i][t] for i in range(first, n)] for t in range(self.groups.num_window_tables)]

    def _chain(self, token_ids: Tokens[int], root_hash: bytes) -> list[bytes]:
        hashes, chain, bs = [], root_hash, self.block_size
        for i in range(len(token_ids) // bs):
            chain = block_hash(chain, token_ids[i * bs : (i + 1) * bs])
            hashes.append(chain)
        return hashes

    def _walk(self, token_ids: Tokens[int], root_hash: bytes, hashes: list[bytes] | None = None) -> list[Block]:
        """The cached blocks that hold the longest whole-block prefix of `token_ids`."""
        bs = self.block_size
        hits: list[Block] = []
        parent: bytes | int = root_hash
        chain = root_hash
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            chain = hashes[i] if hashes is not None else block_hash(chain, tokens)
            found = self.pool.lookup(chain, tokens, parent)
            if found is None:
                break
            hits.append(found)
            parent = found.serial
        return hits

    def _indexed(self, block: Block) -> None:
        if block.group:
            return  # window blocks are not prefixes of their own: routers hear of full-attention blocks
        parent = self.pool.parent_block(block)  # indexed: the sequence that registers `block` holds it
        self.events.stored(block.hash, None if parent is None else parent.hash, block.token_ids)

    def _forgotten(self, block: Block) -> None:
        if not block.group:
            self.events.removed(block.hash)

    def _release_held(self, seq: Sequence) -> None:
        for block_id in reversed(seq.held_blocks):
            self.pool.release(self.pool.blocks[block_id])
        seq.held_blocks = []

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else seq.root_hash
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _blocks_to_add(self, seq: Sequence, num_new: int) -> int:
        return max(0, blocks_for(seq.num_slots + num_new, self.block_size) - len(seq.block_table))

    def _needs_copy(self, seq: Sequence) -> bool:
        index = seq.num_slots // self.block_size
        return index < len(seq.block_table) and self.pool.blocks[seq.block_table[index]].ref_count > 1

    def _copy_on_write(self, seq: Sequence, index: int) -> tuple[int, int]:
        return self._split(seq.block_table, index)

    def _split(self, table: list[int], index: int) -> tuple[int, int]:
        old = self.pool.blocks[table[index]]
        new = self.pool.take()
        self.pool.release(old)
        table[index] = new.block_id
        return old.block_id, new.block_id

    def _shared(self, table: list[int], index: int) -> bool:
        return index < len(table) and table[index] != GONE and self.pool.blocks[table[index]].ref_count > 1

    def _window_to_add(self, seq: Sequence, num_new: int) -> int:
        """Blocks each window table adds to hold `num_new` more tokens."""
        have = len(seq.window_tables[0]) if seq.window_tables else 0
        return max(0, blocks_for(seq.num_slots + num_new, self.block_size) - have)

    def _window_growth(self, seq: Sequence, num_hits: int, budget: int | None) -> int:
        """Fresh blocks all window tables of a sequence admitted with `num_hits` cached blocks take
        for its first step of at most `budget` tokens."""
        if self.groups is None:
            return 0
        bs = self.block_size
        end = seq.num_tokens if budget is None else min(seq.num_tokens, num_hits * bs + budget)
        return self.groups.num_window_tables * (blocks_for(end, bs) - num_hits)


def _window_hash(chain_hash: bytes, table: int) -> bytes:
    """Index key of window table `table`'s block after the chain `chain_hash` (no token id is negative)."""
    return block_hash(chain_hash, (-1 - table,))


def _flat(columns: list[list[Block]]) -> list[Block]:
    return [block for column in columns for block in column]


def held_window_blocks(tables: list[list[int]]) -> list[int]:
    """Every block id the window tables hold, table by table."""
    return [block_id for table in tables for block_id in table if block_id != GONE]
