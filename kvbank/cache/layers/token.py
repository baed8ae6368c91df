"""Per-token storage: every token is quantized as it is written (int8, fp8, or a float dtype
other than the model's), and attention reads whole blocks back through the codec."""

from __future__ import annotations

import torch

from kvbank.attention.fast import accumulate_scores, row_starts, row_tables
from kvbank.attention.metadata import AttentionMetadata, additive_mask
from kvbank.attention.quantized import (
    NATIVE_CODECS,
    QuantizedView,
    attend_quantized,
    native_formats,
    native_quant_kernel,
    pad_visibility,
)
from kvbank.attention.rope import apply_rope
from kvbank.cache.layers.base import KVKind, PoolSpec, StackCache, StepSeq, score_jobs, zeroed
from kvbank.cache.limits import TOKEN_EDITS
from kvbank.cache.quant import CodecPair

#: the codecs whose writes are native too (per-token int8 and fp8)
NATIVE_WRITES = ("int8", "fp8_e4m3", "fp8_e5m2")


class CodecLayer:
    """K and V stored through codecs: a dict of tensors per side, each [num_blocks, *component]."""

    def __init__(self, spec: PoolSpec, codecs: CodecPair, kind: str, index: int) -> None:
        #: the name of the kind that owns the layer: its step state is meta.kinds[kind]
        self.kind = kind
        #: the layer's place among the kind's layers (its row in score buffers)
        self.index = index
        self.codecs = codecs
        self.dtype = spec.dtype
        self.block_size = spec.block_size
        self.heads = spec.num_kv_heads
        self.sides = [
            {
                name: zeroed((spec.num_blocks, *shape), cdtype, spec.device)
                for name, (shape, cdtype) in codec.components(*spec.block_shape).items()
            }
            for codec in codecs
        ]
        self.tensors = [t for side in self.sides for t in side.values()]
        #: the native module when it attends this layer's codes in place, and the format's id in it
        self.native, self.native_format = None, None
        name = codecs[0].name
        if name in NATIVE_CODECS and codecs[1].name == name:
            self.native = native_quant_kernel(
                spec.device,
                spec.dtype,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                getattr(codecs[1], "group_size", None),
            )
            if self.native is not None:
                self.native_format = native_formats(self.native)[name]

    @property
    def native_writes(self) -> bool:
        """Whether the native module writes this layer's codes too."""
        return self.native is not None and self.codecs[0].name in NATIVE_WRITES

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


def rotate_block_keys(
    layers: list[CodecLayer], src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Keys of blocks `dst` = keys of blocks `src` rotated, in every layer of `layers`: dequantized,
    rotated in float32, rounded to the model dtype and quantized again, as a key the model computed
    there would be. Layers of one key codec go through it as one batch of blocks: a block is
    quantized on its own, so each layer gets the bits a call of its own would give, without a dozen
    small tensor ops per layer at every eviction."""
    batches: dict[str, list[CodecLayer]] = {}
    for layer in layers:
        batches.setdefault(layer.codecs[0].name, []).append(layer)
    n = len(src)
    for batch in batches.values():
        codec, sides = batch[0].codecs[0], [layer.sides[0] for layer in batch]
        stored = {name: torch.cat([side[name].index_select(0, src) for side in sides]) for name in sides[0]}
        keys = apply_rope(codec.dequantize(stored, torch.float32), cos, sin).to(batch[0].dtype)
        for name, value in codec.quantize(keys).items():
            for i, side in enumerate(sides):
                side[name].index_copy_(0, dst, value[i * n : (i + 1) * n])


class TokenLayer(CodecLayer):
    """A layer whose tokens are quantized one by one at their slots."""

    def _dequantized(self, side: int, slots: torch.Tensor) -> torch.Tensor:
        """Keys (side 0) or values of pool slots `slots` ([n] flat ids) in float32: [n, kv_heads, head_dim]."""
        stored = {name: t.view(-1, *t.shape[2:]).index_select(0, slots) for name, t in self.sides[side].items()}
        return self.codecs[side].dequantize(stored, torch.float32)

    def token_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """The float32 keys of pool slots `slots` ([n] flat ids): [n, kv_heads, head_dim]."""
        return self._dequantized(0, slots)

    def token_values(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool slots `slots` ([n] flat ids), dequantized in float32 and rounded
        once to `dtype`: [n, kv_heads, head_dim] each."""
        return self._dequantized(0, slots).to(dtype), self._dequantized(1, slots).to(dtype)

    def put_tokens(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize K and V [n, kv_heads, head_dim] (model dtype) into pool slots `slots`, as a write would."""
        for codec, side, x in zip(self.codecs, self.sides, (k, v)):
            for name, value in codec.quantize(x.to(self.dtype)).items():
                side[name].view(-1, *side[name].shape[2:]).index_copy_(0, slots, value)

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Codes and scales of slots `src` -> slots `dst` ([n] flat ids), every head; with
        `rotation`, keys are dequantized, rotated, rounded to the model dtype and quantized again
        there (as `rotate_block_keys`), values still moved as stored."""
        sides = self.sides if rotation is None else self.sides[1:]
        for t in (t for side in sides for t in side.values()):
            flat = t.view(t.shape[0] * t.shape[1], -1)
            flat.index_copy_(0, dst, flat.index_select(0, src))
        if rotation is not None:
            cos, sin = (t.to(src.device) for t in rotation)
            keys = apply_rope(self._dequantized(0, src), cos, sin).to(self.dtype)
            side = self.sides[0]
            for name, value in self.codecs[0].quantize(keys).items():
                side[name].view(-1, *side[name].shape[2:]).index_copy_(0, dst, value)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head h, codes and scales of slots `src[h]` -> `dst[h]`."""
        heads = torch.arange(self.heads, device=src.device).unsqueeze(1)
        for t in self.tensors:
            flat = t.view(t.shape[0] * t.shape[1], self.heads, -1)
            flat[dst, heads] = flat[src, heads]

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        if self.native_writes:
            # One native pass per side, bit for bit the codec's quantize (tests/test_quant_attention.py).
            for side, x in zip(self.sides, (k, v)):
                self.native.quant_write_tokens(x, self.native_format, side["codes"], side["scale"], meta.slot_mapping)
            return
        for codec, side, x in zip(self.codecs, self.sides, (k, v)):
            for name, value in codec.quantize(x).items():
                side[name].view(-1, *side[name].shape[2:]).index_copy_(0, meta.slot_mapping, value)

    def row_attention(self, meta: AttentionMetadata) -> dict[str, torch.Tensor] | None:
        """The step's arguments to the fused model step (block tables, context lengths and starts of every
        new token) when this step attends by rows in a format whose writes are native."""
        view = meta.kinds[self.kind]
        if view.row_tables is None or not self.native_writes or self.dtype != torch.bfloat16:
            return None  # the fused step is bfloat16
        if view.score_jobs:
            return None  # scores are taken layer by layer
        return {"block_tables": view.row_tables, "context_lens": view.row_lens, "starts": view.row_starts}

    def stack_caches(self) -> StackCache | None:
        """The layer's codes and scales as the fused model step takes them; None when it cannot."""
        if not self.native_writes:
            return None
        (k, v) = self.sides
        return StackCache(self.native_format, k["codes"], v["codes"], k["scale"], v["scale"])

    def attend(self, q: torch.Tensor, written: None, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        view = meta.kinds[self.kind]
        out = attend_quantized(q, self, TokenKind.name, view, meta, scale)
        for job in view.score_jobs:
            accumulate_scores(q, self.token_keys(job.key_slots), job, self.index, scale)
        return out


class TokenKind(KVKind):
    """The layers stored through a per-token codec."""

    name = "token"
    edits = TOKEN_EDITS

    def __init__(self, spec: PoolSpec, codecs: list[CodecPair]) -> None:
        super().__init__(spec, codecs)
        self.layers = [TokenLayer(spec, pair, self.name, i) for i, pair in enumerate(codecs)]
        #: every token, prefill or decode, is attended by the native kernel (batch invariance)
        self.attend_rows = spec.batch_invariant and all(layer.native is not None for layer in self.layers)

    def prepare(self, steps: list[StepSeq], meta: AttentionMetadata) -> QuantizedView:
        # Every token, new ones included, is read back from the quantized pool.
        bs, device = self.spec.block_size, self.spec.device
        jobs = score_jobs(steps, bs, device)
        if self.attend_rows:
            tables, lens = row_tables([(s.start, s.end, s.block_table) for s in steps], bs, device)
            starts = row_starts(steps, device)
            return QuantizedView([], row_tables=tables, row_lens=lens, row_starts=starts, score_jobs=jobs)
        masks = []
        for s in steps:
            if s.num_tokens > 1:
                width = -(-s.end // bs) * bs
                keys = torch.arange(width).unsqueeze(0)
                visible = (keys <= torch.arange(s.start, s.end).unsqueeze(1)) & (keys >= s.lead)
                masks.append(additive_mask(pad_visibility(visible).to(device), self.spec.dtype))
        return QuantizedView(masks, score_jobs=jobs)

    def rotate_keys(self, src: list[int], dst: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        device = self.spec.device
        src_ids, dst_ids = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        rotate_block_keys(self.layers, src_ids, dst_ids, cos.to(device), sin.to(device))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        device = self.spec.device
        for layer, s, d in zip(self.layers, src.to(device), dst.to(device)):
            layer.move_slots(s, d)

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        src, dst = src.to(self.spec.device), dst.to(self.spec.device)
        for layer in self.layers:
            layer.move_tokens(src, dst, rotation)

    def gather_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool slots `slots` in every layer, dequantized to the model dtype:
        [layers, n, kv_heads, head_dim] each (what a dense pool would hand out for the same tokens,
        within the codec's error)."""
        slots = slots.to(self.spec.device)
        pairs = [layer.token_values(slots, self.spec.dtype) for layer in self.layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def scatter_tokens(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `gather_tokens`-shaped K and V into pool slots `slots`."""
        slots = slots.to(self.spec.device)
        for layer, k, v in zip(self.layers, keys, values):
            layer.put_tokens(slots, k, v)
