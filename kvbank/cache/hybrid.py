"""The hybrid KV layout of a model whose layers attend either to everything or to a sliding window.

A windowed layer never reads a key older than its window, so keeping its whole past wastes most of
its memory on a long context. The pool is shared (one free list, one admission decision per
sequence), but a block holds the K/V of `slots` layers at once, where `slots` is the number of
full-attention layers: those layers' K/V for a run of tokens is one block, found through the
sequence's `block_table`. The windowed layers, `slots` at a time, form window tables of their own
(`Sequence.window_tables`); a window table keeps only the blocks its layers can still read, and the
cache manager releases the rest as the window moves. Gemma 3 270M (3 full layers, 15 windowed,
window 512) thus holds 3 layers' K/V for every token and 15 layers' for at most 528 per sequence.

Per window table, the blocks of one step writing positions [start, end) are those from
`first_block(start)` (the block of position start - window + 1) to the block of end - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.cache.blocks import blocks_for


@dataclass(frozen=True, slots=True)
class KVGroups:
    """Where each layer's K/V lives in a hybrid pool."""

    #: positions a windowed layer reads: p - window + 1 .. p
    window: int
    #: per layer, which of a block's `slots` layer places holds it
    layer_slot: tuple[int, ...]
    #: per layer, 0 for the sequence's block table (full attention), t + 1 for window table t
    layer_table: tuple[int, ...]

    @property
    def slots(self) -> int:
        """Layers one block holds: the number of full-attention layers."""
        return max(self.layer_slot) + 1

    @property
    def num_window_tables(self) -> int:
        return max(self.layer_table)

    def first_block(self, position: int, block_size: int) -> int:
        """Index of the first block a token at `position` reads in a windowed layer."""
        return max(0, position - self.window + 1) // block_size

    def window_blocks(self, block_size: int) -> int:
        """Most blocks one window table holds for a decoding sequence (its window, unaligned)."""
        return blocks_for(self.window - 1, block_size) + 1

    def chunk_blocks(self, chunk_tokens: int, block_size: int) -> int:
        """Most blocks one window table holds while a prefill chunk of `chunk_tokens` runs."""
        return blocks_for(self.window - 1 + chunk_tokens, block_size) + 1

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` decoding holds: every token's full-attention block,
        and each window table's latest blocks."""
        full = blocks_for(num_tokens, block_size)
        return full + self.num_window_tables * min(full, self.window_blocks(block_size))

    def describe(self, num_layers: int) -> str:
        windowed = sum(1 for t in self.layer_table if t)
        return (
            f"{num_layers - windowed} full-attention layers keep every token; {windowed} sliding-window "
            f"layers keep their last {self.window} positions ({self.num_window_tables} window tables)"
        )


def kv_groups(layer_windows: tuple[int | None, ...], swa_full: bool = False) -> KVGroups | None:
    """The hybrid layout of a model with these per-layer windows (None: every layer keeps every
    token, because no layer is windowed, `swa_full` asks for it, or no layer attends to everything)."""
    windows = {w for w in layer_windows if w is not None}
    full = [i for i, w in enumerate(layer_windows) if w is None]
    if swa_full or not windows or not full:
        return None
    if len(windows) > 1:
        raise ValueError(
            f"sliding windows of {len(windows)} sizes ({sorted(windows)}) are not supported by the hybrid KV "
            "cache; use swa_full=True (keep every token in every layer)"
        )
    slot, table = [0] * len(layer_windows), [0] * len(layer_windows)
    for j, i in enumerate(full):
        slot[i] = j
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    for m, i in enumerate(windowed):
        slot[i], table[i] = m % len(full), 1 + m // len(full)
    return KVGroups(windows.pop(), tuple(slot), tuple(table))
