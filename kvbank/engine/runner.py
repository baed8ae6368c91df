"""Turns one step's scheduled sequences into flat tensors, runs the model, returns logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.attention import AttentionMetadata, PrefillChunk
from kvbank.attention.cascade import share_prefixes
from kvbank.attention.fast import cascade_available, chunk_visibility, native_decode_kernel
from kvbank.attention.metadata import QuantizedView, ResidualPlan
from kvbank.cache.storage import KVStorage
from kvbank.engine.scheduler import ScheduledSeq
from kvbank.models.llama import LlamaForCausalLM


@dataclass
class StepLogits:
    """Logits of the rows the engine asked for.

    `sample_rows[i]` is the row holding the next-token logits of scheduled sequence i, or -1 if it
    does not sample this step; `prompt_rows[i]` is the (first, last) row range of prompt positions
    whose logprobs sequence i wants, or None.
    """

    logits: torch.Tensor
    sample_rows: list[int]
    prompt_rows: list[tuple[int, int] | None]


class ModelRunner:
    """Owns the model and the KV storage; executes one batch per call."""

    def __init__(self, model: LlamaForCausalLM, storage: KVStorage, device: torch.device,
                 batch_invariant: bool = False) -> None:
        self.model = model
        self.storage = storage
        self.device = device
        self.block_size = storage.block_size
        self.dtype = model.embed_tokens.weight.dtype
        config = model.config
        #: reads decodes of dense layers in place (attention/fast.py); None keeps the PyTorch path
        self.decode_kernel = None
        if "dense" in storage.kinds:
            self.decode_kernel = native_decode_kernel(device, self.dtype, config.num_heads, config.num_kv_heads,
                                                      config.head_dim, self.block_size)
        #: dense layers attend every token, prefill or decode, with the decode kernel (see _row_tables)
        self.attend_rows = batch_invariant and self.decode_kernel is not None
        # Without the kernel, dense layers read shared prefixes once; quantized ones dequantize per sequence.
        self.cascade = self.decode_kernel is None and cascade_available(device) and "dense" in storage.kinds

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], copies: list[tuple[int, int]]) -> StepLogits:
        if copies:
            self.storage.copy_blocks(copies)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.storage.kv_caches, meta)
        rows, sample_rows, prompt_rows = self._logit_rows(batch)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        return StepLogits(logits, sample_rows, prompt_rows)

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            table = seq.block_table
            offset = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            num_blocks = -(-end // bs)
            if item.num_tokens == 1:
                decode_tables.append(table[:num_blocks])
                decode_lens.append(end)
            else:
                mask = None
                if start:
                    mask = self._additive(chunk_visibility(start, end, bs).to(self.device))
                prefills.append(PrefillChunk(offset, offset + item.num_tokens, start,
                                             self._tensor(table[:num_blocks]), mask))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=None, decode_context_lens=None, decode_mask=None,
            prefills=prefills, decode_kernel=self.decode_kernel)
        if decode_tables:
            width = max(map(len, decode_tables))
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables])
            meta.decode_context_lens = self._tensor(decode_lens)
            if self.decode_kernel is None or self.storage.kinds != {"dense"}:  # the kernel needs no mask
                visible = torch.arange(width * bs, device=self.device).unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)
                meta.decode_mask = self._additive(visible[:, None, None, :])
            if self.cascade:
                share_prefixes(meta, decode_tables, decode_lens, bs, self.dtype)
        if "token" in self.storage.kinds:
            meta.views["token"] = self._token_view(batch, meta)
        if "block" in self.storage.kinds:
            meta.views["block"], meta.residual_plan = self._block_view(batch, meta)
        position_tensor = self._tensor(positions)
        if self.attend_rows:
            meta.row_block_tables, meta.row_context_lens = self._row_tables(batch, position_tensor)
        return self._tensor(input_ids), position_tensor, meta

    def _row_tables(self, batch: list[ScheduledSeq], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each new token's block table and context length (its position + 1), for batch-invariant attention."""
        bs = self.block_size
        tables = [item.seq.block_table[:-(-(item.seq.num_computed_tokens + item.num_tokens) // bs)] for item in batch]
        width = max(map(len, tables))
        per_seq = self._tensor([t + [0] * (width - len(t)) for t in tables])
        owner = torch.repeat_interleave(self._tensor([item.num_tokens for item in batch]))
        return per_seq.index_select(0, owner), positions + 1

    def _token_view(self, batch: list[ScheduledSeq], meta: AttentionMetadata) -> QuantizedView:
        # Every token, new ones included, is read back from the quantized pool.
        masks = []
        for item in batch:
            if item.num_tokens > 1:
                start = item.seq.num_computed_tokens
                width = -(-(start + item.num_tokens) // self.block_size) * self.block_size
                visible = torch.arange(width).unsqueeze(0) <= torch.arange(start, start + item.num_tokens).unsqueeze(1)
                masks.append(self._additive(visible.to(self.device)))
        return QuantizedView(meta.decode_mask, masks)

    def _block_view(self, batch: list[ScheduledSeq], meta: AttentionMetadata) -> tuple[QuantizedView, ResidualPlan]:
        """Masks over [quantized blocks ; scratch blocks] and the residual plan (int4/int2 layers)."""
        bs = self.block_size
        residual = self.storage.residual
        rows = 0
        scratch_slots: list[int] = []
        preload: tuple[list[int], list[int]] = ([], [])
        full: tuple[list[int], list[int]] = ([], [])
        keep: tuple[list[int], list[int]] = ([], [])
        filled: list[int] = []
        own_blocks: list[int] = []
        masks: list[torch.Tensor] = []
        chunk_rows: list[tuple[int, int]] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            first_block, last_block = start // bs, (end - 1) // bs
            first_row = rows
            for j in range(first_block, last_block + 1):
                block_id = seq.block_table[j]
                if start > j * bs:
                    slot = residual.of_block.get(block_id)
                    if slot is None:
                        raise RuntimeError(f"block {block_id} holds {start - j * bs} tokens but has no residual slot")
                    preload[0].append(rows)
                    preload[1].append(slot)
                if min(end, (j + 1) * bs) == (j + 1) * bs:
                    full[0].append(rows)
                    full[1].append(block_id)
                    filled.append(block_id)
                else:
                    keep[0].append(rows)
                    keep[1].append(residual.slot(block_id))
                rows += 1
            scratch_slots.extend((first_row + p // bs - first_block) * bs + p % bs for p in range(start, end))
            if item.num_tokens == 1:
                own_blocks.append(first_block)
                continue
            positions = torch.arange(start, end).unsqueeze(1)
            own_block = positions // bs * bs
            cache = torch.arange((last_block + 1) * bs).unsqueeze(0) < own_block
            scratch_pos = torch.arange(first_block * bs, (last_block + 1) * bs).unsqueeze(0)
            visible = torch.cat((cache, (scratch_pos >= own_block) & (scratch_pos <= positions)), dim=1)
            masks.append(self._additive(visible.to(self.device)))
            chunk_rows.append((first_row, rows))
        for block_id in filled:
            residual.release(block_id)
        plan = ResidualPlan(rows, self._tensor(scratch_slots), *self._pair(preload), *self._pair(full), *self._pair(keep))
        view = QuantizedView(meta.decode_mask, masks, chunk_rows, self._tensor(own_blocks) if own_blocks else None)
        return view, plan

    def _pair(self, lists: tuple[list[int], list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self._tensor(lists[0]), self._tensor(lists[1])) if lists[0] else (None, None)

    def _logit_rows(self, batch: list[ScheduledSeq]):
        rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int] | None] = []
        offset = 0
        for item in batch:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
            wanted = None
            if seq.request.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # Position p predicts token p + 1; only prompt tokens not yet scored need rows.
                first = max(start, len(seq.request.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    wanted = (len(rows), len(rows) + last - first)
                    rows.extend(range(offset + first - start, offset + last - start))
            prompt_rows.append(wanted)
            if end == seq.num_tokens:
                sample_rows.append(len(rows))
                rows.append(offset + item.num_tokens - 1)
            else:
                sample_rows.append(-1)
            offset += item.num_tokens
        return rows, sample_rows, prompt_rows

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        # An additive float mask, built once per step: attention would otherwise convert a
        # boolean mask in every layer.
        return torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
