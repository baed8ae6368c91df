"""The KV-layer seam: what every storage kind provides, and what the runner hands it per step.

A storage kind (one module each: dense.py, token.py, kivi.py) owns every layer of the pool that
is stored its way. Per step the runner calls `KVKind.prepare` once per kind; what it returns is
the kind's own step state, handed to its layers in `AttentionMetadata.kinds[name]` and opaque to
everyone else. In the model each layer then does `written = layer.write(k, v, meta)` followed by
`layer.attend(q, written, meta, scale)`; `written` is whatever attend needs of this step's fresh
K/V, so nothing is left on the layer for a later call to pick up.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from kvbank import kernels
from kvbank.attention.fast import ScoreJob
from kvbank.attention.metadata import AttentionMetadata
from kvbank.cache.limits import EDITS
from kvbank.cache.quant import CodecPair


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled pool tensor. On the CPU its memory is an anonymous mapping: the OS hands out
    zero pages as they are first touched, so a pool costs no time at start (torch.zeros writes
    every byte, about a second per GiB here) and resident memory grows with the blocks in use."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # page-aligned; the tensor keeps the mapping alive
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True, slots=True)
class StepSeq:
    """One sequence's part in a step: it writes cache slots [start, end) and holds `block_table`.

    Slots are positions in the cache (they equal token positions until a long-context policy
    evicts). With `scores` set, the attention of the new tokens at slots `score_slots` over the
    sequence's cache is added to that [layers, kv_heads, slots] buffer.
    """

    start: int
    end: int
    block_table: list[int]
    scores: torch.Tensor | None = None
    score_slots: tuple[int, int] = (0, 0)
    #: slots before the sequence's first token (a stream after evictions): no row attends them
    lead: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def score_jobs(steps: list[StepSeq], block_size: int, device: torch.device) -> list[ScoreJob]:
    """The attention each scoring sequence of the step accumulates (rows in batch order)."""
    jobs, offset = [], 0
    for s in steps:
        if s.scores is not None:
            first, last = s.score_slots
            table = torch.tensor(s.block_table, dtype=torch.long)
            keys = torch.arange(last)
            jobs.append(
                ScoreJob(
                    rows=torch.arange(offset + first - s.start, offset + last - s.start, device=device),
                    row_slots=torch.arange(first, last, device=device),
                    key_slots=(table[keys // block_size] * block_size + keys % block_size).to(device),
                    buffer=s.scores,
                )
            )
        offset += s.num_tokens
    return jobs


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The numbers every kind needs to allocate its part of the pool."""

    num_blocks: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    #: sequences the pool expects at once (KIVI reserves a residual block for each)
    reserved_seqs: int
    #: a token's attention may not depend on how its prompt was chunked or what else is batched
    #: (EngineConfig.batch_invariant, which KVStorage passes on)
    batch_invariant: bool

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return self.block_size, self.num_kv_heads, self.head_dim


class StackCache(NamedTuple):
    """One layer's caches as the fused model step (QuantStack.forward) takes them."""

    #: the native kernels' format id (attention.quantized.native_formats)
    format: int
    k: torch.Tensor
    v: torch.Tensor
    #: int8/fp8: per-token scales; int4/int2: the keys' range bytes and the values' scales
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    #: int4/int2: the keys' grids, the values' zero points and the residual slots of open blocks
    k_grid: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None


class KVLayer(Protocol):
    """One layer's keys and values in the pool."""

    #: every tensor the layer allocated, [num_blocks, ...] each: copied whole by copy_blocks
    tensors: list[torch.Tensor]
    #: the name of the kind that owns the layer; its step state is `meta.kinds[kind]`
    kind: str

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> Any:
        """Store this step's new K/V ([T, kv_heads, dim]) at their slots; returns what `attend` needs."""

    def attend(self, q: torch.Tensor, written: Any, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of every new token (q: [T, heads, dim]) over its sequence's cached past."""

    def stack_caches(self) -> StackCache | None:
        """The layer's caches as the fused model step takes them; None when it cannot."""

    def row_attention(self, meta: AttentionMetadata) -> dict[str, torch.Tensor] | None:
        """The step's row attention as StackStep fields (block tables, context lengths, starts and
        the kind's own) when this step attends by rows through the fused model step; else None."""


#: StackStep's per-layer lists and the StackCache field each is made of
STACK_LISTS = (
    ("k_caches", "k"),
    ("v_caches", "v"),
    ("k_scales", "k_scale"),
    ("v_scales", "v_scale"),
    ("k_grids", "k_grid"),
    ("v_zeros", "v_zero"),
    ("residual_ks", "residual_k"),
    ("residual_vs", "residual_v"),
)


def stack_step(layers: list[KVLayer]) -> Any | None:
    """A native StackStep (the argument of kernels' QuantStack.forward) holding every layer's caches,
    the rest for the caller to fill; None when a layer's caches cannot go into the fused step or the
    layers' formats differ."""
    caches = [layer.stack_caches() for layer in layers]
    if None in caches or len({c.format for c in caches}) != 1:
        return None
    step = kernels.native().StackStep()
    step.format = caches[0].format
    for field, name in STACK_LISTS:
        if getattr(caches[0], name) is not None:  # the tensors the format has
            setattr(step, field, [getattr(c, name) for c in caches])
    return step


class KVKind(ABC):
    """Every layer of one storage kind, built from each layer's (key, value) codecs.

    Edits (`EDITS`) work on every layer of the kind: block and slot ids are the pool's.
    """

    name: ClassVar[str]
    #: the edits of `EDITS` this kind carries out
    edits: ClassVar[frozenset[str]] = frozenset()
    #: whether every new token attends alone, through a kernel by rows: its result does not depend
    #: on the other rows of the step (set by kinds that can; batched attention by default)
    attend_rows: bool = False

    def __init__(self, spec: PoolSpec, codecs: list[CodecPair]) -> None:
        self.spec = spec
        self.layers: list[KVLayer] = []

    @classmethod
    def bytes_per_block(cls, spec_shape: tuple[int, int, int], codecs: list[CodecPair]) -> int:
        """Pool bytes one block takes in all of this kind's layers, scales included."""
        return sum(k.bytes_per_block(*spec_shape) + v.bytes_per_block(*spec_shape) for k, v in codecs)

    @classmethod
    def bytes_per_seq(cls, spec_shape: tuple[int, int, int], codecs: list[CodecPair], dtype: torch.dtype) -> int:
        """Memory outside the pool this kind reserves for every running sequence (none by default)."""
        return 0

    @abstractmethod
    def prepare(self, steps: list[StepSeq], meta: AttentionMetadata) -> Any:
        """This step's state for the kind's layers, built once from the batch (`steps` in batch order)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the kind's share of the block pool."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors)

    @property
    def extra_nbytes(self) -> int:
        """Bytes the kind holds outside the block pool."""
        return 0

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (ids `src` -> `dst`; `pairs` the same as a list) in every layer."""
        for layer in self.layers:
            for t in layer.tensors:
                t[dst] = t[src]

    def release_block(self, block_id: int) -> None:  # noqa: B027 -- most kinds keep nothing per block outside the pool
        """A block went back to the free list without being indexed."""

    def save_open(self, block_ids: list[int]) -> Any:
        """What the kind holds of `block_ids` outside the pool (KIVI: open blocks' residual slots),
        for a sequence swapped whole; None when nothing."""
        return None

    def restore_open(self, block_ids: list[int], saved: Any) -> None:  # noqa: B027 -- nothing saved by default
        """Put back what `save_open` returned, for the same blocks now at `block_ids`."""

    def open_block(self, block_id: int) -> None:  # noqa: B027 -- most kinds keep every block in the pool
        """`block_id` becomes a sequence's last, partly filled block after an edit (edit "tokens")."""

    def rotate_keys(self, src: list[int], dst: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Keys of blocks `dst` = keys of blocks `src` rotated by one position delta (edit "rotate")."""
        raise NotImplementedError(f"the {self.name} KV layout cannot {EDITS['rotate']}")

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per layer l of the kind and KV head h, K/V of slots `src[l, h]` -> `dst[l, h]` (edit "slots")."""
        raise NotImplementedError(f"the {self.name} KV layout cannot {EDITS['slots']}")

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Every layer's and head's K/V of slots `src` -> slots `dst` ([n] flat ids; edit "tokens"),
        keys rotated by `rotation` (cos, sin) on the way when given, as `rotate_keys` would."""
        raise NotImplementedError(f"the {self.name} KV layout cannot {EDITS['tokens']}")
