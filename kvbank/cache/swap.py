"""Preemption by swap: a preempted sequence's computed blocks wait in host RAM instead of being recomputed.

Only full computed blocks are swapped: they are the only ones complete in the pool whatever the
storage kind (KIVI keeps an open block in a residual slot outside it). The open tail, fewer than
`block_size` tokens, is recomputed after swap-in, which costs about as much as one decode step
and keeps this module free of any kind's private state.

Swapped-in blocks are fresh blocks owned by the sequence alone, so siblings of an `n > 1`
request that once shared blocks each swap their own copy and never write into each other's.

A sequence a long-context policy has edited (evicted tokens, moved slots, re-rotated keys, score
buffers) cannot be recomputed exactly from its tokens: it is swapped whole instead — every block of
its table, the open tail included, its unrotated leading copies, and its cache state (computed
tokens, evictions, rotary offset, scores) — and comes back exactly as it left, into fresh blocks.
What a storage kind keeps of those blocks outside the pool (KIVI's open block in its residual
slot) goes with it (`KVStorage.save_open`).

A sequence of a hybrid layout (cache/hybrid.py) is swapped whole too: its window tables hold only
the blocks their window still reads, which a recompute from the prefix cache could not rebuild
block for block; it comes back with the same tables, its windows' blocks included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbank.cache.manager import GONE, KVCacheManager, Sequence, blocks_for, held_window_blocks
from kvbank.cache.storage import KVStorage

#: Computed tokens from which `auto` swaps a victim instead of recomputing it: one block, the
#: least a swap moves, because no measured length favours recomputing. `python bench/preemption.py
#: --dtype bfloat16 --lengths 16,64,256,1024 --repeats 3` (bundled SmolLM2-135M, CPU, 2 cores
#: shared, medians): swap out + in 0.95 / 1.4 / 38 / 9.7 ms against recomputing 510 / 240 / 568 /
#: 1,470 ms at 16 / 64 / 256 / 1,024 tokens, 15x to 540x cheaper (earlier runs: 0.6 against 33 ms
#: at 16 tokens, 10 ms against 4.6 s at 2k; float32 0.7 against 78 ms at 16). A swap copies
#: bytes, a recompute runs the model over them: on a CPU the model costs orders of magnitude more
#: per token at every length, so the crossover is below the first full block.
SWAP_CROSSOVER_TOKENS = 16


@dataclass(slots=True)
class _Swapped:
    tensors: list[torch.Tensor]
    num_blocks: int
    nbytes: int
    #: a whole swap (an edited sequence): how many of the blocks are its table (the rest its
    #: pristine copies), and its cache state (computed, evicted, rope offset, score buffers)
    table_blocks: int | None = None
    state: tuple[int, int, int, Any] | None = None
    #: of a whole swap: unrotated copies after the table, then window tables' blocks: (window_first,
    #: each window table's length)
    pristine_blocks: int = 0
    windows: tuple[int, list[int]] | None = None
    #: of a whole swap: what the storage kinds keep of the blocks outside the pool (KIVI's open block)
    open: list[Any] | None = None


def edited(seq: Sequence) -> bool:
    """Whether a long-context policy has edited `seq`'s cache (or keeps scores for it): its K/V can
    no longer be recomputed from its tokens alone."""
    return bool(seq.num_evicted) or seq.kv_state is not None


class Swapper:
    """Moves preempted sequences' full computed blocks to host memory within `space_bytes` and back.

    `mode` is "swap" (always, when it fits), "recompute" (never) or "auto" (from
    `crossover_tokens` computed tokens on). Host buffers are pinned where the pool is on CUDA.
    """

    def __init__(
        self,
        storage: KVStorage,
        manager: KVCacheManager,
        mode: str,
        space_bytes: int,
        crossover_tokens: int = SWAP_CROSSOVER_TOKENS,
    ) -> None:
        self.storage = storage
        self.manager = manager
        self.mode = mode
        self.space_bytes = space_bytes
        self.crossover_tokens = crossover_tokens
        self.bytes_per_block = sum(t[0].nbytes for t in storage.tensors)
        self.swapped: dict[Sequence, _Swapped] = {}
        self.bytes_used = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0

    def gauges(self) -> dict[str, int]:
        """Swaps out and in so far, and the host bytes swapped sequences hold now."""
        return {
            "num_swaps_out": self.num_swaps_out,
            "num_swaps_in": self.num_swaps_in,
            "swap_bytes_used": self.bytes_used,
        }

    def wants_swap(self, seq: Sequence) -> bool:
        """Whether the mode prefers swapping `seq` over recomputing it."""
        if self.mode == "auto":
            return seq.num_computed_tokens >= self.crossover_tokens
        return self.mode == "swap"

    def can_swap_out(self, seq: Sequence) -> bool:
        """`seq` has computed blocks to swap (full ones; every one if it is edited) and they fit in
        the free swap space."""
        num_blocks = self._blocks_to_swap(seq)
        return num_blocks > 0 and self.bytes_used + num_blocks * self.bytes_per_block <= self.space_bytes

    def swap_out(self, seq: Sequence) -> None:
        """Copy `seq`'s blocks to host memory (its pool blocks are still its own): its full computed
        blocks, or, for an edited sequence, every block and its cache state (restored by `swap_in`)."""
        assert seq not in self.swapped
        whole = self._whole(seq)
        if whole:
            table = seq.block_table + seq.pristine_blocks + held_window_blocks(seq.window_tables)
        else:
            table = seq.block_table[: self._full_blocks(seq)]
        pin = torch.cuda.is_available() and self.storage.device.type == "cuda"
        tensors = [torch.empty((len(table), *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in self.storage.tensors]
        self.storage.read_blocks(table, tensors)
        nbytes = len(table) * self.bytes_per_block
        entry = _Swapped(tensors, len(table), nbytes)
        if whole:
            entry.table_blocks, entry.pristine_blocks = len(seq.block_table), len(seq.pristine_blocks)
            entry.state = (seq.num_computed_tokens, seq.num_evicted, seq.rope_offset, seq.kv_state)
            entry.open = self.storage.save_open(table)
            if seq.window_tables:
                entry.windows = (seq.window_first, [len(table) for table in seq.window_tables])
        self.swapped[seq] = entry
        self.bytes_used += nbytes
        self.num_swaps_out += 1

    def is_swapped(self, seq: Sequence) -> bool:
        return seq in self.swapped

    def is_whole(self, seq: Sequence) -> bool:
        """`seq` is swapped whole: `swap_in` gives it its blocks itself (no allocation first)."""
        entry = self.swapped.get(seq)
        return entry is not None and entry.state is not None

    def blocks_to_resume(self, seq: Sequence, budget: int) -> int:
        """Free blocks a whole-swapped `seq` needs to come back and compute what it can of its
        pending tokens within a step's `budget`."""
        entry = self.swapped[seq]
        computed, evicted = entry.state[0], entry.state[1]
        num_new = min(seq.num_tokens - computed, budget)
        after = blocks_for(computed - evicted + seq.lead + num_new, self.manager.block_size)
        grow = max(0, after - entry.table_blocks)
        if entry.windows is not None:
            grow += sum(max(0, after - length) for length in entry.windows[1])
        return entry.num_blocks + grow

    def swap_in(self, seq: Sequence) -> None:
        """Write `seq`'s swapped blocks back and count them computed.

        A whole swap takes fresh blocks and restores the sequence's table, copies and cache state
        exactly. Otherwise the blocks go into its freshly allocated table: leading blocks the
        allocation found in the prefix cache already hold the same tokens' K/V and are kept; only
        the rest are written.
        """
        entry = self._pop(seq)
        self.num_swaps_in += 1
        if entry.state is not None:
            assert not seq.block_table and not seq.pristine_blocks
            blocks = self.manager.take_blocks(entry.num_blocks)
            self.storage.write_blocks(blocks, entry.tensors)
            self.storage.restore_open(blocks, entry.open)
            table, pristine = entry.table_blocks, entry.table_blocks + entry.pristine_blocks
            seq.block_table, seq.pristine_blocks = blocks[:table], blocks[table:pristine]
            seq.num_computed_tokens, seq.num_evicted, seq.rope_offset, seq.kv_state = entry.state
            if entry.windows is not None:
                first, lengths = entry.windows
                rest = blocks[pristine:]
                for length in lengths:
                    seq.window_tables.append([GONE] * first + rest[: length - first])
                    rest = rest[length - first :]
                # its blocks are indexed again, as far as they can be, from its next commit on
                seq.window_first, seq.window_committed = first, 0
            return
        assert len(seq.block_table) >= entry.num_blocks
        first = seq.num_computed_tokens // self.manager.block_size
        if first < entry.num_blocks:
            rows = [t[first:] for t in entry.tensors]
            self.storage.write_blocks(seq.block_table[first : entry.num_blocks], rows)
            seq.num_computed_tokens = entry.num_blocks * self.manager.block_size

    def discard(self, seq: Sequence) -> None:
        """Free `seq`'s host copy, if it has one (it finished or was aborted while swapped)."""
        if seq in self.swapped:
            self._pop(seq)

    def _pop(self, seq: Sequence) -> _Swapped:
        entry = self.swapped.pop(seq)
        self.bytes_used -= entry.nbytes
        return entry

    def _full_blocks(self, seq: Sequence) -> int:
        return seq.num_computed_tokens // self.manager.block_size

    def _whole(self, seq: Sequence) -> bool:
        return edited(seq) or bool(seq.window_tables)

    def _blocks_to_swap(self, seq: Sequence) -> int:
        if not self._whole(seq):
            return self._full_blocks(seq)
        return len(seq.block_table) + len(seq.pristine_blocks) + len(held_window_blocks(seq.window_tables))
