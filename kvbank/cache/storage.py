"""The KV pool: one preallocated tensor holding every layer's keys and values."""
from __future__ import annotations

import torch

from kvbank.models.loader import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


class KVStorage:
    """[layers, 2, num_blocks, block_size, kv_heads, head_dim]; `kv_caches[i]` is layer i's (K, V)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                dtype=dtype, device=device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.pool]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) from source to destination ids."""
        src = torch.tensor([s for s, _ in copies], device=self.pool.device)
        dst = torch.tensor([d for _, d in copies], device=self.pool.device)
        self.pool[:, :, dst] = self.pool[:, :, src]
