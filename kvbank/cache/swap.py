"""Preemption by swap: a preempted sequence's computed blocks wait in host RAM instead of being recomputed.

Only full computed blocks are swapped: they are the only ones complete in the pool whatever the
storage kind (KIVI keeps an open block in a residual slot outside it). The open tail, fewer than
`block_size` tokens, is recomputed after swap-in, which costs about as much as one decode step
and keeps this module free of any kind's private state.

Swapped-in blocks are fresh blocks owned by the sequence alone, so siblings of an `n > 1`
request that once shared blocks each swap their own copy and never write into each other's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.cache.manager import KVCacheManager, Sequence
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
        """`seq` has full computed blocks and they fit in the free swap space.

        A sequence a long-context policy has edited (or that carries score buffers) is recomputed
        instead: its blocks no longer map to its token positions.
        """
        if seq.num_evicted or seq.kv_state is not None:
            return False
        num_blocks = self._full_blocks(seq)
        return num_blocks > 0 and self.bytes_used + num_blocks * self.bytes_per_block <= self.space_bytes

    def swap_out(self, seq: Sequence) -> None:
        """Copy `seq`'s full computed blocks to host memory (its pool blocks are still its own)."""
        assert seq not in self.swapped
        num_blocks = self._full_blocks(seq)
        pin = torch.cuda.is_available() and self.storage.device.type == "cuda"
        tensors = [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in self.storage.tensors]
        self.storage.read_blocks(seq.block_table[:num_blocks], tensors)
        nbytes = num_blocks * self.bytes_per_block
        self.swapped[seq] = _Swapped(tensors, num_blocks, nbytes)
        self.bytes_used += nbytes
        self.num_swaps_out += 1

    def is_swapped(self, seq: Sequence) -> bool:
        return seq in self.swapped

    def swap_in(self, seq: Sequence) -> None:
        """Write `seq`'s swapped blocks back into its freshly allocated table and count them computed.

        Leading blocks the allocation found in the prefix cache already hold the same tokens' K/V
        and are kept; only the rest are written.
        """
        entry = self._pop(seq)
        assert len(seq.block_table) >= entry.num_blocks
        first = seq.num_computed_tokens // self.manager.block_size
        if first < entry.num_blocks:
            rows = [t[first:] for t in entry.tensors]
            self.storage.write_blocks(seq.block_table[first : entry.num_blocks], rows)
            seq.num_computed_tokens = entry.num_blocks * self.manager.block_size
        self.num_swaps_in += 1

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
