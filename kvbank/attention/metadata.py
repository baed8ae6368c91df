"""What attention needs to know about one step's batch, built once and shared by every layer.

The batch is flat: T new tokens. The first `num_decode_tokens` belong to sequences that compute a
single token this step (one token each); each prefill chunk after them is a contiguous run.
Storage kinds add their own step state under `kinds` (see kvbank/cache/layers/base.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch


def index_tensor(values: Iterable[int], device: torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of `values` on `device`. A step builds a dozen of these from short lists;
    reading them from an array's buffer takes a third of torch.tensor's time (2 against 6 us)."""
    buffer = array("q", values)
    cpu = torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.empty(0, dtype=torch.long)
    return cpu if device is None or device.type == "cpu" else cpu.to(device, non_blocking=True)


def table_tensor(tables: list[list[int]], device: torch.device | None = None) -> torch.Tensor:
    """Block tables as one int64 [len(tables), longest] tensor, shorter rows padded with block 0."""
    width = max(map(len, tables))
    flat: list[int] = []
    for table in tables:
        flat += table
        if len(table) < width:
            flat += [0] * (width - len(table))
    return index_tensor(flat, device).view(len(tables), width)


@dataclass
class PrefillChunk:
    """A run of new tokens of one sequence that already has `context_start` tokens cached."""

    start: int
    end: int
    context_start: int
    block_table: torch.Tensor

    @property
    def kv_len(self) -> int:
        return self.context_start + self.end - self.start


@dataclass
class SharedPrefix:
    """Decodes `rows` (indices among the decodes) all begin with the blocks of `block_table`."""

    rows: torch.Tensor
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Slot mapping plus the decode and prefill views of the batch.

    Decodes read their blocks through `decode_block_tables` (padded with block 0 to the longest)
    and `decode_context_lens`. `kinds` maps a storage kind's name to the state its `prepare`
    built for this step.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[PrefillChunk]
    block_size: int
    dtype: torch.dtype
    kinds: dict[str, Any] = field(default_factory=dict)
    #: hybrid KV layouts (cache/hybrid.py): each layer's view of the batch, through its own block tables
    layer_metas: list[AttentionMetadata] | None = None
    #: where each decode's keys begin (a stream's sequence after evictions: its first slots hold
    #: no token); None when every decode starts at slot 0
    decode_starts: torch.Tensor | None = None

    @cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """Additive [decodes, 1, 1, blocks * block_size] mask hiding the padding of shorter decodes
        (and the slots before each decode's start).

        Built on first use, once per step: paths that read blocks in place never need it.
        """
        if self.decode_block_tables is None:
            return None
        width = self.decode_block_tables.shape[1] * self.block_size
        keys = torch.arange(width, device=self.slot_mapping.device).unsqueeze(0)
        visible = keys < self.decode_context_lens.unsqueeze(1)
        if self.decode_starts is not None:
            visible &= keys >= self.decode_starts.unsqueeze(1)
        return additive_mask(visible[:, None, None, :], self.dtype)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere: attention would otherwise convert a boolean mask per layer."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V at their slots; caches are [num_blocks, block_size, heads, dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
