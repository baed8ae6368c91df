"""The KV pool: every layer's keys and values, block by block, in the layer's storage kind.

`KVFormat` (cache/format.py) says how each layer is stored; each storage kind (cache/layers/)
allocates and serves its layers. `plan_pool` is the arithmetic that sizes the pool; the engine
and `kvbank plan` both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvbank.attention.metadata import AttentionMetadata
from kvbank.cache.blocks import blocks_for
from kvbank.cache.format import KVFormat
from kvbank.cache.hybrid import KVGroups
from kvbank.cache.layers import KINDS, KVKind, KVLayer, PoolSpec, StepSeq
from kvbank.cache.quant import CodecPair
from kvbank.cache.tiers.entry import Layout, dtype_name

DEFAULT_FORMAT = KVFormat()


class ModelShape(Protocol):
    """The numbers of a model the pool is sized by (models.config.ModelConfig has them)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class PoolPlan:
    """How a memory budget turns into KV blocks for one model and one storage format."""

    block_size: int
    bytes_per_block: int
    residual_bytes_per_seq: int
    reserved_seqs: int
    memory_bytes: int
    num_blocks: int
    #: the hybrid layout of a model with sliding-window layers (a block holds `groups.slots` layers)
    groups: KVGroups | None = None

    @property
    def bytes_per_token(self) -> float:
        """Bytes one more token of a sequence takes (hybrid: in the full-attention layers only)."""
        return self.bytes_per_block / self.block_size

    def bytes_per_token_at(self, context_len: int) -> float:
        """Bytes per token of one sequence `context_len` tokens long (windows included)."""
        return self.blocks_per_sequence(context_len) * self.bytes_per_block / max(1, context_len)

    def blocks_per_sequence(self, context_len: int) -> int:
        if self.groups is None:
            return blocks_for(context_len, self.block_size)
        return self.groups.blocks_per_sequence(context_len, self.block_size)

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds for one sequence (hybrid: the longest one sequence can grow to)."""
        if self.groups is None:
            return self.num_blocks * self.block_size
        windows = self.groups.num_window_tables * self.groups.window_blocks(self.block_size)
        return max(0, self.num_blocks - windows) * self.block_size

    def sequences_that_fit(self, context_len: int) -> int:
        """Full-length sequences that fit together, counting each one's reserved memory outside the pool."""
        blocks = self.blocks_per_sequence(context_len)
        return int(self.memory_bytes // (blocks * self.bytes_per_block + self.residual_bytes_per_seq))


def _by_kind(model: ModelShape, model_dtype: torch.dtype, kv_format: KVFormat) -> dict[str, list[int]]:
    layers: dict[str, list[int]] = {}
    for i, kind in enumerate(kv_format.kinds(model.num_layers, model_dtype)):
        layers.setdefault(kind, []).append(i)
    return layers


def plan_pool(
    model: ModelShape,
    model_dtype: torch.dtype,
    memory_bytes: int,
    block_size: int,
    kv_format: KVFormat = DEFAULT_FORMAT,
    reserved_seqs: int = 0,
    groups: KVGroups | None = None,
) -> PoolPlan:
    """Blocks that fit in `memory_bytes` after reserving per-sequence memory for `reserved_seqs`."""
    model = _physical(model, groups)
    codecs = kv_format.codecs(model.num_layers, model_dtype)
    shape = (block_size, model.num_kv_heads, model.head_dim)
    per_block = per_seq = 0
    for name, layers in _by_kind(model, model_dtype, kv_format).items():
        pairs = [codecs[i] for i in layers]
        per_block += KINDS[name].bytes_per_block(shape, pairs)
        per_seq += KINDS[name].bytes_per_seq(shape, pairs, model_dtype)
    reserved = reserved_seqs if per_seq else 0
    num_blocks = (memory_bytes - reserved * per_seq) // per_block
    return PoolPlan(block_size, per_block, per_seq, reserved, memory_bytes, max(0, int(num_blocks)), groups)


@dataclass(frozen=True)
class _Places:
    """A model's shape with its layer count replaced by the layer places of one block."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _physical(model: ModelShape, groups: KVGroups | None) -> ModelShape:
    if groups is None:
        return model
    return _Places(groups.slots, model.num_heads, model.num_kv_heads, model.head_dim)


class KVStorage:
    """Every layer's KV blocks: `layers[i]` is layer i's storage, `kinds` the kinds that own them.

    With a hybrid layout (`groups`), a block holds `groups.slots` layer places and `layers[i]` is the
    place of layer i: layers of different tables share a place's tensors, each through its own
    block ids. `batch_invariant` (every kind that can attends by rows) is the `EngineConfig` option,
    named by every caller: a default here could differ from the engine's."""

    def __init__(
        self,
        model: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_format: KVFormat = DEFAULT_FORMAT,
        reserved_seqs: int = 0,
        *,
        batch_invariant: bool,
        groups: KVGroups | None = None,
    ) -> None:
        if groups is not None and set(kv_format.kinds(groups.slots, dtype)) != {"dense"}:
            raise ValueError("the hybrid KV layout keeps K/V in the model dtype only (kv_cache_dtype='auto')")
        self.groups = groups
        num_layers = model.num_layers
        model = _physical(model, groups)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        spec = PoolSpec(
            num_blocks,
            block_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            device,
            reserved_seqs,
            batch_invariant,
        )
        codecs: list[CodecPair] = kv_format.codecs(model.num_layers, dtype)
        places: list[KVLayer] = [None] * model.num_layers  # type: ignore[list-item]
        self.kinds: list[KVKind] = []
        #: the layer places of each kind, in the order of `kinds`
        self._kind_layers: list[torch.Tensor] = []
        for name, indices in _by_kind(model, dtype, kv_format).items():
            kind = KINDS[name](spec, [codecs[i] for i in indices])
            self.kinds.append(kind)
            self._kind_layers.append(torch.tensor(indices, dtype=torch.long))
            for i, layer in zip(indices, kind.layers):
                places[i] = layer
        #: the layer places a block holds, each once
        self.places = places
        self.layers = places if groups is None else [places[groups.layer_slot[i]] for i in range(num_layers)]
        #: each of `layers`' (key, value) codecs: the format its tokens take outside the pool too
        self.codecs = codecs if groups is None else [codecs[groups.layer_slot[i]] for i in range(num_layers)]

    def kind(self, name: str) -> KVKind | None:
        """The kind called `name`, if any layer is stored that way."""
        return next((kind for kind in self.kinds if kind.name == name), None)

    @property
    def nbytes(self) -> int:
        """Bytes of the block pool itself."""
        return sum(kind.nbytes for kind in self.kinds)

    @property
    def extra_nbytes(self) -> int:
        """Bytes held outside the pool (KIVI residual slots)."""
        return sum(kind.extra_nbytes for kind in self.kinds)

    def prepare(self, steps: list[StepSeq], meta: AttentionMetadata) -> None:
        """Let every kind build its state for this step into `meta.kinds`."""
        meta.kinds = {kind.name: kind.prepare(steps, meta) for kind in self.kinds}

    def release(self, block_id: int) -> None:
        """A block went back to the free list without being indexed."""
        for kind in self.kinds:
            kind.release_block(block_id)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor ([num_blocks, ...] each), place by place: the order of `layout` and entries."""
        return [t for layer in self.places for t in layer.tensors]

    def layout(self) -> Layout:
        """(dtype, one block's shape) of every pool tensor: what a tier entry must match to be loaded."""
        return tuple((dtype_name(t.dtype), tuple(t.shape[1:])) for t in self.tensors)

    def read_blocks(self, block_ids: list[int], out: list[torch.Tensor]) -> None:
        """Copy whole blocks into `out` (one [len(block_ids), ...] tensor per pool tensor, any device).

        Only blocks that are full and computed are complete in the pool (KIVI keeps an open block
        in its residual slot), so callers read those alone.
        """
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for t, dst in zip(self.tensors, out, strict=True):
            if dst.device == t.device:
                torch.index_select(t, 0, index, out=dst)
            else:
                dst.copy_(t.index_select(0, index), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def write_blocks(self, block_ids: list[int], src: list[torch.Tensor]) -> None:
        """Overwrite whole blocks with `src` (as `read_blocks` fills it)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for t, rows in zip(self.tensors, src, strict=True):
            t.index_copy_(0, index, rows.to(t.device, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def save_open(self, block_ids: list[int]) -> list[Any]:
        """What the kinds hold of `block_ids` outside the pool (open KIVI blocks), for a whole swap."""
        return [kind.save_open(block_ids) for kind in self.kinds]

    def restore_open(self, block_ids: list[int], saved: list[Any]) -> None:
        """Put back what `save_open` returned, for the same blocks now at `block_ids`."""
        for kind, part in zip(self.kinds, saved):
            kind.restore_open(block_ids, part)

    @property
    def edits(self) -> frozenset[str]:
        """The edits (cache/limits.py EDITS) every layer of the pool can take."""
        return frozenset.intersection(*(kind.edits for kind in self.kinds))

    def _check(self, edit: str) -> None:
        assert edit in self.edits and self.groups is None, f"the pool cannot {edit}"

    def rotate_keys(self, src: list[int], dst: list[int], rotation: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keys of blocks `dst` = keys of blocks `src` rotated by (cos, sin) rows of one position delta."""
        self._check("rotate")
        for kind in self.kinds:
            kind.rotate_keys(src, dst, *rotation)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per layer l and KV head h, K/V of pool slots `src[l, h]` -> slots `dst[l, h]` (flat slot ids)."""
        self._check("slots")
        for kind, layers in zip(self.kinds, self._kind_layers):
            kind.move_slots(src[layers], dst[layers])

    def gather_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, kv_heads, head_dim] of pool slots `slots` ([n] flat ids), in the
        model dtype (a quantized layer's tokens dequantized)."""
        self._check("gather")
        if len(self.kinds) == 1:
            return self.kinds[0].gather_tokens(slots)
        parts = [kind.gather_tokens(slots) for kind in self.kinds]
        keys = torch.empty((len(self.places), *parts[0][0].shape[1:]), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        for (k, v), layers in zip(parts, self._kind_layers):
            index = layers.to(self.device)
            keys[index], values[index] = k, v
        return keys, values

    def scatter_tokens(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write K and V shaped as `gather_tokens` returns them into pool slots `slots`."""
        self._check("gather")
        for kind, layers in zip(self.kinds, self._kind_layers):
            index = layers.to(keys.device)
            kind.scatter_tokens(slots, keys.index_select(0, index), values.index_select(0, index))

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """K/V of pool slots `src` -> slots `dst` ([n] flat slot ids), the same in every layer and
        head; with `rotation` (cos, sin of one position delta) the keys are rotated on the way."""
        self._check("tokens")
        if rotation is not None:
            self._check("rotate")
        for kind in self.kinds:
            kind.move_tokens(src, dst, rotation)

    def open_block(self, block_id: int) -> None:
        """`block_id` is a sequence's last block and only partly filled once an edit is done: a kind
        that keeps such blocks apart (KIVI's residual slots) takes it in before the edit writes it."""
        self._check("tokens")
        for kind in self.kinds:
            kind.open_block(block_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V, anything a kind keeps beside them) from source to destination."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kind in self.kinds:
            kind.copy_blocks(src, dst, copies)
