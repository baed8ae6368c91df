"""Dense storage: K and V in the model dtype, [num_blocks, block_size, kv_heads, dim] each.

Decodes are read in place by the native kernel where it has a vector variant (bfloat16 on an x86
CPU with AVX2 or above); otherwise blocks are gathered, and leading blocks that several decodes share are read
once (attention/cascade.py).
"""

from __future__ import annotations

import torch

from kvbank import kernels
from kvbank.attention.cascade import share_prefixes
from kvbank.attention.fast import (
    DenseStep,
    accumulate_scores,
    attend_window_rows,
    cascade_available,
    chunk_visibility,
    native_decode_kernel,
    paged_attention,
    row_starts,
    row_tables,
)
from kvbank.attention.metadata import AttentionMetadata, additive_mask, write_kv
from kvbank.attention.quantized import native_formats
from kvbank.attention.rope import apply_rope
from kvbank.cache.layers.base import KVKind, PoolSpec, StackCache, StepSeq, score_jobs, zeroed
from kvbank.cache.limits import EDITS
from kvbank.cache.quant import CodecPair

#: the model dtypes the native key rotation takes
NATIVE_KEY_DTYPES = (torch.bfloat16, torch.float32)


class DenseLayer:
    """One layer's K and V in the model dtype."""

    def __init__(self, spec: PoolSpec, kind: str, index: int) -> None:
        #: the name of the kind that owns the layer: its step state is meta.kinds[kind]
        self.kind = kind
        #: the layer's place among the kind's layers (its row in score buffers)
        self.index = index
        self.k = zeroed((spec.num_blocks, *spec.block_shape), spec.dtype, spec.device)
        self.v = zeroed((spec.num_blocks, *spec.block_shape), spec.dtype, spec.device)
        self.tensors = [self.k, self.v]

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        write_kv(self.k, self.v, k, v, meta.slot_mapping)
        return k, v  # chunks from position 0 attend to their fresh K/V directly

    def row_attention(self, meta: AttentionMetadata) -> dict[str, torch.Tensor] | None:
        """The step's arguments to the fused model step (block tables, context lengths and starts of every
        new token) when this step attends by rows and keeps no attention scores."""
        step = meta.kinds[self.kind]
        if step.row_block_tables is None or step.score_jobs:
            return None
        return {"block_tables": step.row_block_tables, "context_lens": step.row_context_lens, "starts": step.row_starts}

    def stack_caches(self) -> StackCache:
        """The layer's caches as the fused model step takes them: bfloat16, no scales."""
        return StackCache(native_formats(kernels.native())["dense"], self.k, self.v)

    def attend_window(self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor | None:
        """Sliding-window attention of the step's new tokens (their K/V written) by the native kernel,
        each row over its last `window` positions; None when this step does not attend by rows."""
        step = meta.kinds[self.kind]
        if step.row_block_tables is None or step.score_jobs:
            return None
        return attend_window_rows(q, self.k, self.v, step, scale, window)

    def attend(
        self, q: torch.Tensor, written: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        step = meta.kinds[self.kind]
        out = paged_attention(q, *written, self.k, self.v, meta, step, scale)
        for job in step.score_jobs:
            keys = self.k.view(-1, *self.k.shape[2:]).index_select(0, job.key_slots).float()
            accumulate_scores(q, keys, job, self.index, scale)
        return out


class DenseKind(KVKind):
    """The layers kept as the model computes them."""

    name = "dense"
    edits = frozenset(EDITS)

    def __init__(self, spec: PoolSpec, codecs: list[CodecPair]) -> None:
        super().__init__(spec, codecs)
        self.layers = [DenseLayer(spec, self.name, i) for i in range(len(codecs))]
        self.decode_kernel = native_decode_kernel(
            spec.device, spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size
        )
        self.cascade = self.decode_kernel is None and cascade_available(spec.device)
        #: every token, prefill or decode, is attended by the decode kernel (batch invariance)
        self.attend_rows = spec.batch_invariant and self.decode_kernel is not None

    def prepare(self, steps: list[StepSeq], meta: AttentionMetadata) -> DenseStep:
        step = self._row_step(steps) if self.attend_rows else self._batched_step(steps)
        step.score_jobs = score_jobs(steps, self.spec.block_size, self.spec.device)
        return step

    def _batched_step(self, steps: list[StepSeq]) -> DenseStep:
        bs, dtype, device = self.spec.block_size, self.spec.dtype, self.spec.device
        chunk_masks = [
            additive_mask(chunk_visibility(s.start, s.end, bs, s.lead).to(device), dtype) if s.start else None
            for s in steps
            if s.num_tokens > 1
        ]
        step = DenseStep(self.decode_kernel, chunk_masks)
        decodes = [s for s in steps if s.num_tokens == 1]
        if decodes and self.cascade and not any(s.lead for s in decodes):  # shared blocks are read from slot 0
            tables = [s.block_table[: -(-s.end // bs)] for s in decodes]
            share_prefixes(step, tables, [s.end for s in decodes], bs, dtype, device)
        return step

    def rotate_keys(self, src: list[int], dst: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        device = self.spec.device
        src_ids, dst_ids = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        cos, sin = cos.to(device), sin.to(device)
        native = kernels.native() if device.type == "cpu" and self.spec.dtype in NATIVE_KEY_DTYPES else None
        if native is not None and native.has_quant_decode():
            # One native call over every layer, bit for bit the loop below (~1 ms at every
            # eviction of a shifting policy in torch).
            native.rotate_key_blocks(
                [layer.k for layer in self.layers],
                native_formats(native)["dense"],
                [],
                [],
                src_ids,
                dst_ids,
                cos.float().contiguous(),
                sin.float().contiguous(),
                self.spec.dtype == torch.bfloat16,
            )
            return
        for layer in self.layers:
            keys = layer.k.index_select(0, src_ids).float()
            layer.k.index_copy_(0, dst_ids, apply_rope(keys, cos, sin).to(layer.k.dtype))

    def gather_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool slots `slots` ([n] flat ids) in every layer: [layers, n, kv_heads, head_dim] each."""
        slots = slots.to(self.spec.device)
        flat = lambda cache: cache.view(-1, *cache.shape[2:])
        keys = torch.stack([flat(layer.k).index_select(0, slots) for layer in self.layers])
        return keys, torch.stack([flat(layer.v).index_select(0, slots) for layer in self.layers])

    def scatter_tokens(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `gather_tokens`-shaped K and V into pool slots `slots`."""
        slots = slots.to(self.spec.device)
        for layer, k, v in zip(self.layers, keys, values):
            layer.k.view(-1, *layer.k.shape[2:]).index_copy_(0, slots, k.to(layer.k.dtype))
            layer.v.view(-1, *layer.v.shape[2:]).index_copy_(0, slots, v.to(layer.v.dtype))

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Every layer's and head's K/V of slots `src` -> slots `dst` (flat slot ids, [n] each), keys
        rotated by `rotation` on the way when given."""
        device = self.spec.device
        src, dst = src.to(device), dst.to(device)
        flat = lambda cache: cache.view(-1, *cache.shape[2:])
        native = kernels.native() if device.type == "cpu" else None
        if native is not None:
            # values (and unrotated keys) as one native copy over every layer, not 60 index ops
            moved = [flat(layer.v) for layer in self.layers]
            if rotation is None:
                moved += [flat(layer.k) for layer in self.layers]
            native.copy_rows(moved, src, dst)
            if rotation is None:
                return
            keys = torch.stack([flat(layer.k).index_select(0, src) for layer in self.layers])
            keys = apply_rope(keys.float(), *(t.to(device) for t in rotation)).to(self.spec.dtype)
            for layer, k in zip(self.layers, keys):
                flat(layer.k).index_copy_(0, dst, k)
            return
        for layer in self.layers:
            for cache in (layer.k, layer.v):
                moved = flat(cache).index_select(0, src)
                if rotation is not None and cache is layer.k:
                    moved = apply_rope(moved.float(), *(t.to(device) for t in rotation)).to(cache.dtype)
                flat(cache).index_copy_(0, dst, moved)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        device = self.spec.device
        heads = torch.arange(self.spec.num_kv_heads, device=device).unsqueeze(1)
        for layer, s, d in zip(self.layers, src.to(device), dst.to(device)):
            for cache in (layer.k, layer.v):
                flat = cache.view(-1, *cache.shape[2:])
                flat[d, heads] = flat[s, heads]

    def _row_step(self, steps: list[StepSeq]) -> DenseStep:
        """Each new token's block table and context length (its position + 1), in batch order."""
        step = DenseStep(self.decode_kernel, [])
        step.row_block_tables, step.row_context_lens = row_tables(
            [(s.start, s.end, s.block_table) for s in steps], self.spec.block_size, self.spec.device
        )
        step.row_starts = row_starts(steps, self.spec.device)
        return step
