"""The KV pool: every layer's keys and values, block by block, in the layer's storage format.

A layer is stored one of three ways (its `kind`):
- "dense": the model dtype, one [num_blocks, block_size, heads, dim] tensor each for K and V.
- "token": a per-token codec (int8, fp8, or a float dtype other than the model's); every token
  is quantized as it is written.
- "block": a KIVI codec (int4, int2) that quantizes whole blocks. A block that is not yet full
  keeps its tokens in a full-precision residual slot; it is quantized when it fills. Residual
  slots belong to blocks (not sequences), so forks share them and copy-on-write copies them.

`plan_pool` is the arithmetic that sizes the pool; the engine and `kvbank plan` both use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.cache.quant import DEFAULT_GROUP_SIZE, Codec, FullPrecision, codecs_for
from kvbank.models.loader import ModelConfig


def layer_codecs(config: ModelConfig, model_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 skip_layers: tuple[int, ...] = (), group_size: int = DEFAULT_GROUP_SIZE) -> list[tuple[Codec, Codec]]:
    """(key, value) codec of every layer; `skip_layers` stay in the model dtype."""
    skip = set()
    for index in skip_layers:
        if not -config.num_layers <= index < config.num_layers:
            raise ValueError(f"kv_cache_dtype_skip_layers has layer {index}, but the model has "
                             f"{config.num_layers} layers (0..{config.num_layers - 1}, or negative from the end)")
        skip.add(index % config.num_layers)
    quantized = codecs_for(kv_cache_dtype, model_dtype, group_size)
    full = (FullPrecision(model_dtype), FullPrecision(model_dtype))
    return [full if i in skip else quantized for i in range(config.num_layers)]


def layer_kind(codecs: tuple[Codec, Codec], model_dtype: torch.dtype) -> str:
    key_codec = codecs[0]
    if isinstance(key_codec, FullPrecision) and key_codec.dtype == model_dtype:
        return "dense"
    return "block" if key_codec.per_block else "token"


@dataclass
class PoolPlan:
    """How a memory budget turns into KV blocks for one model and one storage format."""

    block_size: int
    bytes_per_block: int
    residual_bytes_per_seq: int
    reserved_seqs: int
    memory_bytes: int
    num_blocks: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def sequences_that_fit(self, context_len: int) -> int:
        """Full-length sequences that fit together, counting one residual block each."""
        blocks = -(-context_len // self.block_size)
        return int(self.memory_bytes // (blocks * self.bytes_per_block + self.residual_bytes_per_seq))


def plan_pool(config: ModelConfig, model_dtype: torch.dtype, memory_bytes: int, block_size: int = 16,
              kv_cache_dtype: str = "auto", skip_layers: tuple[int, ...] = (),
              group_size: int = DEFAULT_GROUP_SIZE, reserved_seqs: int = 0) -> PoolPlan:
    """Blocks that fit in `memory_bytes` after reserving residual slots for `reserved_seqs`."""
    codecs = layer_codecs(config, model_dtype, kv_cache_dtype, skip_layers, group_size)
    shape = (block_size, config.num_kv_heads, config.head_dim)
    per_block = sum(k.bytes_per_block(*shape) + v.bytes_per_block(*shape) for k, v in codecs)
    residual = sum(2 * FullPrecision(model_dtype).bytes_per_block(*shape)
                   for pair in codecs if layer_kind(pair, model_dtype) == "block")
    reserved = reserved_seqs if residual else 0
    num_blocks = (memory_bytes - reserved * residual) // per_block
    return PoolPlan(block_size, per_block, residual, reserved, memory_bytes, max(0, int(num_blocks)))


class DenseLayer:
    """K and V in the model dtype."""

    kind = "dense"

    def __init__(self, num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.tensors = [self.k, self.v]

    def write(self, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        from kvbank.attention.metadata import write_kv
        write_kv(self.k, self.v, k, v, meta.slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
        from kvbank.attention.fast import paged_attention
        return paged_attention(q, k, v, self.k, self.v, meta, scale)


class QuantizedLayer:
    """K and V stored through codecs: a dict of tensors per side, each [num_blocks, *component]."""

    def __init__(self, codecs: tuple[Codec, Codec], num_blocks: int, block_size: int, heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device, kind: str) -> None:
        self.kind = kind
        self.codecs = codecs
        self.dtype = dtype
        self.block_size = block_size
        self.heads = heads
        self.sides = [{name: torch.zeros(num_blocks, *shape, dtype=cdtype, device=device)
                       for name, (shape, cdtype) in codec.components(block_size, heads, dim).items()}
                      for codec in codecs]
        self.tensors = [t for side in self.sides for t in side.values()]
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        if self.kind == "token":
            for codec, side, x in zip(self.codecs, self.sides, (k, v)):
                for name, value in codec.quantize(x).items():
                    side[name].view(-1, *side[name].shape[2:]).index_copy_(0, meta.slot_mapping, value)
        else:
            self.scratch = meta.residual_plan.write(self, k, v)

    def store_blocks(self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks [n, block_size, heads, dim] into `block_ids`."""
        for codec, side, x in zip(self.codecs, self.sides, (k, v)):
            for name, value in codec.quantize(x).items():
                side[name].index_copy_(0, block_ids, value)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
        from kvbank.attention.fast import quantized_paged_attention
        return quantized_paged_attention(q, self, meta, scale)

    def read(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of whole blocks, [batch, blocks * block_size, heads, dim]."""
        batch = block_tables.shape[0]
        flat = block_tables.reshape(-1)
        out = []
        for codec, side in zip(self.codecs, self.sides):
            gathered = {name: tensor.index_select(0, flat) for name, tensor in side.items()}
            x = codec.dequantize(gathered, self.dtype)
            out.append(x.view(batch, -1, *x.shape[2:]))
        return out[0], out[1]


class ResidualSlots:
    """Full-precision homes of not-yet-full blocks of the "block" layers, keyed by block id.

    `k[layer]` and `v[layer]` are [slots, block_size, heads, dim]. The table grows (doubling) if
    more blocks are open at once than were reserved, e.g. after many forks.
    """

    def __init__(self, num_layers: int, slots: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = (block_size, heads, dim)
        self.dtype, self.device = dtype, device
        self.k = [torch.zeros(slots, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(slots, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(slots - 1, -1, -1))
        self.of_block: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slot(self, block_id: int) -> int:
        """The slot of `block_id`, taking a free one if it has none."""
        slot = self.of_block.get(block_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.of_block[block_id] = self.free.pop()
        return slot

    def release(self, block_id: int) -> None:
        slot = self.of_block.pop(block_id, None)
        if slot is not None:
            self.free.append(slot)

    def copy(self, src_block: int, dst_block: int) -> None:
        if src_block not in self.of_block:
            return
        src, dst = self.of_block[src_block], self.slot(dst_block)
        for tensors in (self.k, self.v):
            for t in tensors:
                t[dst] = t[src]

    def _grow(self) -> None:
        old = self.capacity
        more = max(old, 1)
        for tensors in (self.k, self.v):
            for i, t in enumerate(tensors):
                tensors[i] = torch.cat([t, torch.zeros(more, *self.shape, dtype=self.dtype, device=self.device)])
        self.free.extend(range(old + more - 1, old - 1, -1))


class KVStorage:
    """Every layer's KV blocks; `kv_caches[i]` is layer i's storage object (DenseLayer or QuantizedLayer)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto", skip_layers: tuple[int, ...] = (),
                 group_size: int = DEFAULT_GROUP_SIZE, residual_slots: int = 0) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        heads, dim = config.num_kv_heads, config.head_dim
        self.kv_caches: list[DenseLayer | QuantizedLayer] = []
        block_layers = 0
        for codecs in layer_codecs(config, dtype, kv_cache_dtype, skip_layers, group_size):
            kind = layer_kind(codecs, dtype)
            if kind == "dense":
                self.kv_caches.append(DenseLayer(num_blocks, block_size, heads, dim, dtype, device))
            else:
                self.kv_caches.append(QuantizedLayer(codecs, num_blocks, block_size, heads, dim, dtype, device, kind))
                block_layers += kind == "block"
        self.kinds = {layer.kind for layer in self.kv_caches}
        self.residual = ResidualSlots(block_layers, max(residual_slots, 1) if block_layers else 0,
                                      block_size, heads, dim, dtype, device)
        block_caches = [layer for layer in self.kv_caches if layer.kind == "block"]
        for i, layer in enumerate(block_caches):
            layer.residual, layer.residual_index = self.residual, i

    @property
    def nbytes(self) -> int:
        """Bytes of the block pool itself (residual slots not included)."""
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer.tensors)

    def release(self, block_id: int) -> None:
        """A block went back to the free list without being indexed: drop its residual slot."""
        self.residual.release(block_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V, residual too) from source to destination ids."""
        device = self.kv_caches[0].tensors[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for layer in self.kv_caches:
            for t in layer.tensors:
                t[dst] = t[src]
        for s, d in copies:
            self.residual.copy(s, d)
