"""KIVI storage (int4, int2): whole blocks are quantized; a block that is not yet full keeps its
tokens in a full-precision residual slot and is quantized when it fills.

Residual slots belong to blocks (not sequences), so forks share them and copy-on-write copies
them. They are this kind's alone: the pool reserves one per expected sequence, grows the table
when more blocks are open at once (many forks), and gives the extra back once they close.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvbank.attention.fast import row_starts, row_tables
from kvbank.attention.metadata import AttentionMetadata, additive_mask, index_tensor
from kvbank.attention.quantized import QuantizedView, attend_quantized, pad_visibility
from kvbank.attention.rope import apply_rope
from kvbank.cache.layers.base import KVKind, PoolSpec, StackCache, StepSeq
from kvbank.cache.layers.token import CodecLayer, rotate_block_keys
from kvbank.cache.quant import Codec, CodecPair, FullPrecision


class ResidualSlots:
    """Full-precision homes of not-yet-full blocks, keyed by block id.

    `k[layer]` and `v[layer]` are [slots, block_size, heads, dim]. The table doubles when more
    blocks are open at once than it has slots, and shrinks back (never below `reserved`) once at
    most a quarter of it is in use.
    """

    def __init__(
        self, num_layers: int, reserved: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.reserved = max(reserved, 1)
        self.k = [self._zeros(self.reserved) for _ in range(num_layers)]
        self.v = [self._zeros(self.reserved) for _ in range(num_layers)]
        self.free = list(range(self.reserved - 1, -1, -1))
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
                self._resize(2 * self.capacity)
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

    def shrink(self) -> None:
        """Give back slots a burst of open blocks needed, once at most a quarter are in use."""
        target = max(self.reserved, 2 * len(self.of_block))
        if 4 * len(self.of_block) <= self.capacity and target < self.capacity:
            self._resize(target)

    def _resize(self, capacity: int) -> None:
        # Live slots move to the front, in slot order; everything after them is free.
        live = sorted(self.of_block, key=self.of_block.__getitem__)
        assert len(live) <= capacity
        index = torch.tensor([self.of_block[b] for b in live], dtype=torch.long, device=self.device)
        for tensors in (self.k, self.v):
            for i, t in enumerate(tensors):
                resized = self._zeros(capacity)
                resized[: len(live)] = t.index_select(0, index)
                tensors[i] = resized
        self.of_block = {block_id: slot for slot, block_id in enumerate(live)}
        self.free = list(range(capacity - 1, len(live) - 1, -1))

    def _zeros(self, slots: int) -> torch.Tensor:
        return torch.zeros(slots, *self.shape, dtype=self.dtype, device=self.device)


#: columns of a ResidualPlan's table (kPlanFields in kvbank/kernels/quant_attention.h)
PLAN_FIELDS = 5


@dataclass
class ResidualPlan:
    """How this step's new K/V reach the KIVI layers.

    Every block that receives tokens gets a scratch row: its earlier tokens are loaded from its
    residual slot, the new tokens are written in, and then blocks that are now full are quantized
    into the pool while the others go back to their residual slots. `table` says so per row for
    the native writes (kivi_write in kvbank/kernels/cache_write.cpp): block id, residual slot
    (-1: none), tokens the block held before the step, tokens it holds after, and 1 where a later
    row of the same sequence attends the block from the pool (a chunk over several blocks: the
    fused stack quantizes those rows before attention, the others after it); `moves` says the
    same as index pairs for the PyTorch path.
    """

    rows: int
    scratch_slots: torch.Tensor
    table: torch.Tensor
    block_size: int

    @functools.cached_property
    def moves(self) -> ResidualMoves:
        """The table as index pairs (built once per step, and only where a layer writes in torch)."""
        device = self.scratch_slots.device
        rows = torch.arange(self.rows)
        block, slot, held, upto = self.table[:, :4].unbind(1)
        full = upto == self.block_size
        pair = lambda mask, other: (rows[mask].to(device), other[mask].to(device)) if mask.any() else (None, None)
        return ResidualMoves(*pair(held > 0, slot), *pair(full, block), *pair(~full, slot))


@dataclass
class ResidualMoves:
    """Scratch rows loaded from residual slots, quantized into blocks, and kept in residual slots."""

    preload_rows: torch.Tensor | None
    preload_slots: torch.Tensor | None
    full_rows: torch.Tensor | None
    full_blocks: torch.Tensor | None
    keep_rows: torch.Tensor | None
    keep_slots: torch.Tensor | None


@dataclass
class KiviStep:
    """The KIVI kind's state for one step: the attention view and the residual plan."""

    view: QuantizedView
    plan: ResidualPlan


class KiviLayer(CodecLayer):
    """A layer quantized a whole block at a time, its open blocks in residual slots."""

    def __init__(self, spec: PoolSpec, codecs: CodecPair, kind: str, residual: ResidualSlots, index: int) -> None:
        super().__init__(spec, codecs, kind, index)
        self.residual = residual
        self._stack: StackCache | None = None  # stack_caches' answer while the residual slots stay put

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, heads, dim]); returns this step's scratch blocks (K, V)."""
        plan = meta.kinds[self.kind].plan
        stores = (self.residual.k[self.index], self.residual.v[self.index])
        if self.native is not None and k.dtype == self.dtype:
            # One native call, bit for bit the codecs' block quantization (tests/test_quant_attention.py).
            (ks, vs) = self.sides
            scratch_k, scratch_v = self.native.kivi_write(
                k,
                v,
                self.native_format,
                ks["codes"],
                ks["ranges"],
                ks["grid"],
                vs["codes"],
                vs["scale"],
                vs["zero"],
                *stores,
                plan.table,
                plan.scratch_slots,
            )
            return scratch_k, scratch_v
        moves = plan.moves
        scratch = []
        for x, store in zip((k, v), stores):
            rows = x.new_zeros(plan.rows, *store.shape[1:])
            if moves.preload_rows is not None:
                rows.index_copy_(0, moves.preload_rows, store.index_select(0, moves.preload_slots))
            rows.view(-1, *x.shape[1:]).index_copy_(0, plan.scratch_slots, x)
            scratch.append(rows)
        if moves.full_rows is not None:
            full = moves.full_rows
            self._store_blocks(moves.full_blocks, scratch[0].index_select(0, full), scratch[1].index_select(0, full))
        if moves.keep_rows is not None:
            for rows, store in zip(scratch, stores):
                store.index_copy_(0, moves.keep_slots, rows.index_select(0, moves.keep_rows))
        return scratch[0], scratch[1]

    def row_attention(self, meta: AttentionMetadata) -> dict[str, torch.Tensor] | None:
        """The step's arguments to the fused model step when this step attends by rows: every new
        token's block table, context length and own scratch row, and the write plan."""
        step = meta.kinds[self.kind]
        if step.view.row_tables is None or self.native is None or self.dtype != torch.bfloat16:
            return None  # the fused step is bfloat16
        return {
            "block_tables": step.view.row_tables,
            "context_lens": step.view.row_lens,
            "kivi_plan": step.plan.table,
            "scratch_slots": step.plan.scratch_slots,
            "own_rows": step.view.own_rows,
            "starts": step.view.row_starts,
        }

    def stack_caches(self) -> StackCache | None:
        """The layer's codes, ranges, scales and residual slots as the fused model step takes them."""
        if self.native is None:
            return None
        residual_k, residual_v = self.residual.k[self.index], self.residual.v[self.index]
        stack = self._stack
        # Built once per step for every layer; the pool's tensors never move, the residual slots
        # only when their table grows or shrinks.
        if stack is None or stack.residual_k is not residual_k or stack.residual_v is not residual_v:
            (k, v) = self.sides
            stack = self._stack = StackCache(
                self.native_format,
                k["codes"],
                v["codes"],
                k["ranges"],
                v["scale"],
                k["grid"],
                v["zero"],
                residual_k,
                residual_v,
            )
        return stack

    def attend(
        self, q: torch.Tensor, written: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        view = meta.kinds[self.kind].view
        return attend_quantized(q, self, KiviKind.name, view, meta, scale, scratch=written)

    def _store_blocks(self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks [n, block_size, heads, dim] into `block_ids`."""
        for codec, side, x in zip(self.codecs, self.sides, (k, v)):
            for name, value in codec.quantize(x).items():
                side[name].index_copy_(0, block_ids, value)


class KiviKind(KVKind):
    """The layers stored through KIVI codecs, and the residual slots they share.

    Single tokens move, and are read and written, a whole block at a time: keys are quantized per
    channel over a block, so a block that takes tokens is dequantized, changed and quantized
    again (one more rounding of its keys). Values are quantized per token: they move as their
    codes, exactly. An open block (one with a residual slot) is read and written in its slot in
    full precision.
    """

    name = "kivi"
    #: no single slots (per layer and head) and no per-token scores: keys share a range per block
    edits = frozenset({"rotate", "tokens", "gather"})

    def __init__(self, spec: PoolSpec, codecs: list[CodecPair]) -> None:
        super().__init__(spec, codecs)
        self.residual = ResidualSlots(len(codecs), spec.reserved_seqs, spec.block_shape, spec.dtype, spec.device)
        self.layers = [KiviLayer(spec, pair, self.name, self.residual, i) for i, pair in enumerate(codecs)]
        #: every token, prefill or decode, is attended by the native kernel (batch invariance)
        self.attend_rows = spec.batch_invariant and all(layer.native is not None for layer in self.layers)

    @classmethod
    def bytes_per_seq(cls, spec_shape: tuple[int, int, int], codecs: list[CodecPair], dtype: torch.dtype) -> int:
        # one full-precision block of K and V per layer: the sequence's open block
        return len(codecs) * 2 * FullPrecision(dtype).bytes_per_block(*spec_shape)

    @property
    def extra_nbytes(self) -> int:
        return self.residual.nbytes

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(src, dst, pairs)
        for s, d in pairs:
            self.residual.copy(s, d)

    def release_block(self, block_id: int) -> None:
        self.residual.release(block_id)

    def save_open(self, block_ids: list[int]) -> list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        """Each open block's place in `block_ids` and its residual K and V in every layer."""
        r = self.residual
        return [
            (i, [k[r.of_block[b]].clone() for k in r.k], [v[r.of_block[b]].clone() for v in r.v])
            for i, b in enumerate(block_ids)
            if b in r.of_block
        ]

    def restore_open(
        self, block_ids: list[int], saved: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]
    ) -> None:
        r = self.residual
        for i, keys, values in saved:
            slot = r.slot(block_ids[i])  # before reading the lists: taking a slot may grow them
            for store, x in zip(r.k + r.v, keys + values):
                store[slot] = x

    def rotate_keys(self, src: list[int], dst: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Whole blocks are dequantized, rotated and quantized again per channel; an open block's
        keys are rotated in its residual slot, in full precision."""
        device, residual = self.spec.device, self.residual
        cos, sin = cos.to(device), sin.to(device)
        whole = [(s, d) for s, d in zip(src, dst) if s not in residual.of_block]
        opened = [(residual.of_block[s], residual.slot(d)) for s, d in zip(src, dst) if s in residual.of_block]
        src_ids = torch.tensor([s for s, _ in whole], dtype=torch.long, device=device)
        dst_ids = torch.tensor([d for _, d in whole], dtype=torch.long, device=device)
        native = self.layers[0].native
        if whole and native is not None:
            # One native call per key format over its layers, bit for bit the torch version
            # (rotate_block_keys), which took ~2.5 ms at every eviction of a shifting policy.
            for _, batch in self._codec_batches(0):
                native.rotate_key_blocks(
                    *self._key_tensors(batch),
                    src_ids,
                    dst_ids,
                    cos.float().contiguous(),
                    sin.float().contiguous(),
                    self.spec.dtype == torch.bfloat16,
                )
        elif whole:
            rotate_block_keys(self.layers, src_ids, dst_ids, cos, sin)
        for layer in self.layers:
            store = residual.k[layer.index]  # read after residual.slot above, which may grow the table
            for s, d in opened:
                store[d] = apply_rope(store[s].float(), cos, sin).to(store.dtype)

    # --- single tokens: whole blocks read, changed and stored again ------------------------------

    def open_block(self, block_id: int) -> None:
        """`block_id` becomes a sequence's last, partly filled block: its tokens move to a residual
        slot (dequantized) unless it has one, so that the next write finds them there."""
        if block_id in self.residual.of_block:
            return
        ids = torch.tensor([block_id], device=self.spec.device)
        keys, values = self._read_blocks(0, ids), self._read_blocks(1, ids)
        slot = self.residual.slot(block_id)
        for layer in self.layers:
            self.residual.k[layer.index][slot] = keys[layer.index, 0].to(self.spec.dtype)
            self.residual.v[layer.index][slot] = values[layer.index, 0].to(self.spec.dtype)

    def gather_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of pool slots `slots` ([n] flat ids) in every layer, dequantized to the model
        dtype (an open block's from its residual slot): [layers, n, kv_heads, head_dim] each."""
        keys, values = self._token_sides(slots.cpu())
        device, dtype = self.spec.device, self.spec.dtype
        return keys.to(device, dtype), values.to(device, dtype)

    def scatter_tokens(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `gather_tokens`-shaped K and V into pool slots `slots`: values quantized per token
        as a write would, the keys' blocks quantized again whole (open blocks: residual slots)."""
        slots = slots.cpu()
        self._put_values(slots, values.to(self.spec.dtype))
        self._put_keys(slots, keys.float())

    def move_tokens(
        self, src: torch.Tensor, dst: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """K/V of slots `src` -> slots `dst` ([n] flat ids) in every layer and head; with `rotation`
        the keys are rotated on the way (rounded to the model dtype). Values between closed blocks
        move as their codes; the destination blocks' keys are stored again whole, once."""
        src, dst = src.cpu(), dst.cpu()
        bs, open_ = self.spec.block_size, self.residual.of_block
        src_open = torch.tensor([b in open_ for b in (src // bs).tolist()], dtype=torch.bool)
        dst_open = torch.tensor([b in open_ for b in (dst // bs).tolist()], dtype=torch.bool)
        # Everything moved is read before anything is written (the ranges may overlap).
        coded = ~(src_open | dst_open)  # values whose codes move as they are
        loose = (~coded).nonzero().flatten()
        loose_values = self._token_sides(src[loose], keys=False)[1] if len(loose) else None
        keys = self._token_sides(src, values=False)[0]
        if rotation is not None:
            keys = apply_rope(keys, *(t.cpu() for t in rotation)).to(self.spec.dtype).float()
        native = self.layers[0].native
        if coded.any() and native is not None:
            values = [t.view(t.shape[0] * t.shape[1], -1) for layer in self.layers for t in layer.sides[1].values()]
            native.copy_rows(values, src[coded], dst[coded])
        elif coded.any():
            code_src, code_dst = src[coded].to(self.spec.device), dst[coded].to(self.spec.device)
            for layer in self.layers:
                for t in layer.sides[1].values():
                    flat = t.view(t.shape[0] * t.shape[1], *t.shape[2:])
                    flat.index_copy_(0, code_dst, flat.index_select(0, code_src))
        if loose_values is not None:
            self._put_values(dst[loose], loose_values.to(self.spec.dtype))
        self._put_keys(dst, keys)

    def _codec_batches(self, side: int) -> list[tuple[Codec, list[KiviLayer]]]:
        """The kind's layers grouped by their `side` codec, so each group is one codec call."""
        batches: dict[str, list[KiviLayer]] = {}
        for layer in self.layers:
            batches.setdefault(layer.codecs[side].name, []).append(layer)
        return [(batch[0].codecs[side], batch) for batch in batches.values()]

    @staticmethod
    def _key_tensors(batch: list[KiviLayer]) -> tuple[list[torch.Tensor], int, list[torch.Tensor], list[torch.Tensor]]:
        """The key codes, format, ranges and grids of layers of one key codec, as the native
        key-block calls take them."""
        keys = [layer.sides[0] for layer in batch]
        codes, ranges, grids = ([k[name] for k in keys] for name in ("codes", "ranges", "grid"))
        return codes, batch[0].native_format, ranges, grids

    def _read_blocks(self, side: int, ids: torch.Tensor) -> torch.Tensor:
        """Keys (side 0) or values of blocks `ids` in every layer, float32 [layers, n, block, heads,
        dim]; an open block's from its residual slot."""
        n = len(ids)
        out = torch.empty(len(self.layers), n, *self.spec.block_shape, dtype=torch.float32)
        ids = ids.to(self.spec.device)
        native = self.layers[0].native
        for codec, batch in self._codec_batches(side):
            if side == 0 and native is not None:
                x = native.read_key_blocks(*self._key_tensors(batch), ids, self.spec.dtype == torch.bfloat16)
                out[[layer.index for layer in batch]] = x
                continue
            stored = {
                name: torch.cat([layer.sides[side][name].index_select(0, ids) for layer in batch])
                for name in batch[0].sides[side]
            }
            x = codec.dequantize(stored, torch.float32).cpu()
            for i, layer in enumerate(batch):
                out[layer.index] = x[i * n : (i + 1) * n]
        store = self.residual.k if side == 0 else self.residual.v
        for i, block in enumerate(ids.tolist()):
            slot = self.residual.of_block.get(block)
            if slot is not None:
                for layer in self.layers:
                    out[layer.index, i] = store[layer.index][slot].float()
        return out

    def _token_sides(
        self, slots: torch.Tensor, keys: bool = True, values: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Float32 keys and values of `slots` ([n] flat ids) in every layer, [layers, n, heads, dim]."""
        bs = self.spec.block_size
        blocks, where = torch.unique(slots // bs, return_inverse=True)
        index = where * bs + slots % bs
        flat = lambda x: x.view(x.shape[0], -1, *x.shape[3:])[:, index]
        return (
            flat(self._read_blocks(0, blocks)) if keys else None,
            flat(self._read_blocks(1, blocks)) if values else None,
        )

    def _put_values(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Values [layers, n, heads, dim] (model dtype) into `slots`: an open block's into its
        residual slot, the others quantized per token as a write would."""
        bs, open_ = self.spec.block_size, self.residual.of_block
        blocks = slots // bs
        is_open = torch.tensor([b in open_ for b in blocks.tolist()], dtype=torch.bool)
        for block in blocks[is_open].unique().tolist():
            picked = (blocks == block).nonzero().flatten()
            offsets = (slots[picked] % bs).to(self.spec.device)
            for layer in self.layers:
                rows = values[layer.index, picked].to(self.spec.device)
                self.residual.v[layer.index][open_[block]].index_copy_(0, offsets, rows)
        closed = (~is_open).nonzero().flatten()
        if not len(closed):
            return
        flat_ids = slots[closed].to(self.spec.device)
        for layer in self.layers:
            side = layer.sides[1]
            for name, value in layer.codecs[1].quantize(values[layer.index, closed.to(values.device)]).items():
                side[name].view(-1, *side[name].shape[2:]).index_copy_(0, flat_ids, value.to(self.spec.device))

    def _put_keys(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Keys [layers, n, heads, dim] (float32) into `slots`: every block they land in is read,
        changed and quantized again whole (an open block's residual slot written instead)."""
        bs = self.spec.block_size
        blocks, where = torch.unique(slots // bs, return_inverse=True)
        current = self._read_blocks(0, blocks)
        flat = current.view(current.shape[0], -1, *current.shape[3:])
        flat[:, where * bs + slots % bs] = keys.float().cpu()
        open_ = self.residual.of_block
        ids = blocks.tolist()
        for i, block in enumerate(ids):
            if block in open_:
                for layer in self.layers:
                    self.residual.k[layer.index][open_[block]] = current[layer.index, i].to(self.spec.dtype)
        closed = [i for i, block in enumerate(ids) if block not in open_]
        if not closed:
            return
        dst = torch.tensor([ids[i] for i in closed], device=self.spec.device)
        picked = torch.tensor(closed)
        native = self.layers[0].native
        for codec, batch in self._codec_batches(0):
            if native is not None:
                x = current[[layer.index for layer in batch]][:, picked]
                codes, fmt, ranges, grids = self._key_tensors(batch)
                native.store_key_blocks(x.contiguous(), codes, fmt, ranges, grids, dst)
                continue
            x = torch.cat([current[layer.index, picked] for layer in batch])
            n = len(closed)
            for name, value in codec.quantize(x).items():
                value = value.to(self.spec.device)
                for i, layer in enumerate(batch):
                    layer.sides[0][name].index_copy_(0, dst, value[i * n : (i + 1) * n])

    def prepare(self, steps: list[StepSeq], meta: AttentionMetadata) -> KiviStep:
        """Masks over [quantized blocks ; scratch blocks] and the residual plan."""
        self.residual.shrink()
        bs, device = self.spec.block_size, self.spec.device
        residual = self.residual
        rows = 0
        scratch_slots: list[int] = []
        table: list[int] = []  # per row: block id, residual slot, tokens held before, after, early
        filled: list[int] = []
        own_blocks: list[int] = []
        masks: list[torch.Tensor] = []
        chunk_rows: list[tuple[int, int]] = []
        # the native kernel's scratch row for each token it attends (all tokens, or the decodes)
        own_rows: list[int] = []
        for s in steps:
            first_block, last_block = s.start // bs, (s.end - 1) // bs
            first_row = rows
            for j in range(first_block, last_block + 1):
                block_id = s.block_table[j]
                held, upto, slot = max(s.start - j * bs, 0), min(s.end - j * bs, bs), -1
                if held:
                    slot = residual.of_block.get(block_id)
                    if slot is None:
                        raise RuntimeError(f"block {block_id} holds {held} tokens but has no residual slot")
                if upto == bs:
                    filled.append(block_id)
                else:
                    slot = residual.slot(block_id)
                table += (block_id, slot, held, upto, int(j < last_block))
                rows += 1
            # position p's scratch slot: row first_row + p // bs - first_block, offset p % bs
            mine = range((first_row - first_block) * bs + s.start, (first_row - first_block) * bs + s.end)
            scratch_slots += mine
            if self.attend_rows:
                own_rows += [first_row] if len(mine) == 1 else [slot // bs for slot in mine]
                continue
            if s.num_tokens == 1:
                own_blocks.append(first_block)
                own_rows.append(first_row)
                continue
            positions = torch.arange(s.start, s.end).unsqueeze(1)
            own_block = positions // bs * bs
            slots = torch.arange((last_block + 1) * bs).unsqueeze(0)
            cache = (slots < own_block) & (slots >= s.lead)
            scratch_pos = torch.arange(first_block * bs, (last_block + 1) * bs).unsqueeze(0)
            visible = torch.cat((cache, (scratch_pos >= own_block) & (scratch_pos <= positions)), dim=1)
            masks.append(additive_mask(pad_visibility(visible).to(device), self.spec.dtype))
            chunk_rows.append((first_row, rows))
        for block_id in filled:
            residual.release(block_id)
        # one tensor for the plan's table, the scratch slots and the own rows (views into it)
        table_end, scratch_end = len(table), len(table) + len(scratch_slots)
        flat = index_tensor(table + scratch_slots + own_rows, device)
        plan = ResidualPlan(rows, flat[table_end:scratch_end], flat[:table_end].view(rows, PLAN_FIELDS), bs)
        view = QuantizedView(masks, chunk_rows, index_tensor(own_blocks, device) if own_blocks else None)
        if own_rows:
            view.own_rows = flat[scratch_end:]
        if self.attend_rows:
            view.row_tables, view.row_lens = row_tables([(s.start, s.end, s.block_table) for s in steps], bs, device)
            view.row_starts = row_starts(steps, device)
        return KiviStep(view, plan)
