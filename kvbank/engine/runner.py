"""Turns one step's scheduled sequences into flat tensors, runs the model, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.attention import AttentionMetadata, PrefillChunk
from kvbank.attention.metadata import index_tensor, table_tensor
from kvbank.cache.layers import StepSeq
from kvbank.cache.storage import KVStorage
from kvbank.engine.blend import Blender
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

    def __init__(self, model: LlamaForCausalLM, storage: KVStorage, device: torch.device) -> None:
        self.model = model
        self.storage = storage
        self.device = device
        self.block_size = storage.block_size
        self.dtype = storage.dtype
        #: runs blended prompts' documents (engine/blend.py); None where the engine cannot blend
        self.blender: Blender | None = None

    def check(self, item: ScheduledSeq) -> None:
        """RuntimeError naming what is wrong if scheduled sequence `item` would read or write outside
        the rotary tables, its block table or the pool: the engine fails that sequence alone
        rather than the whole step."""
        seq, n, bs = item.seq, item.num_tokens, self.block_size
        first = seq.num_computed_tokens - seq.num_evicted + seq.lead
        lowest, highest = first + seq.rope_offset, first + n - 1 + seq.rope_offset
        rope_len = self.model.rope_cos.shape[0]
        if n < 1 or lowest < 0 or highest >= rope_len:
            raise RuntimeError(
                f"sequence {seq.seq_id}: {n} tokens at positions {lowest}..{highest}, outside the rotary "
                f"tables' 0..{rope_len - 1}"
            )
        table = seq.block_table
        if first < 0 or first + n > len(table) * bs:
            raise RuntimeError(
                f"sequence {seq.seq_id}: slots {first}..{first + n - 1} beyond its {len(table)} blocks of {bs}"
            )
        num_blocks = self.storage.num_blocks
        if any(not 0 <= b < num_blocks for b in table[first // bs : -(-(first + n) // bs)]):
            raise RuntimeError(f"sequence {seq.seq_id}: a block id outside the pool's {num_blocks} blocks")

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> StepLogits:
        """Make the batch's copy-on-write copies, run the model once over it, and return the logits asked for."""
        copies = [copy for item in batch for copy in item.copies]
        if copies:
            self.storage.copy_blocks(copies)
        blended = [item.seq.blending for item in batch]
        for item, blending in zip(batch, blended):
            if blending:  # its own forward passes; it samples nothing and scores no prompt token
                self.blender.run(item)
        rest = [item for item, blending in zip(batch, blended) if not blending]
        if not rest:
            return StepLogits(None, [-1] * len(batch), [None] * len(batch))
        input_ids, positions, meta = self.prepare(rest)
        hidden = self.model(input_ids, positions, self.storage.layers, meta, self._embeds(rest))
        rows, sample_rows, prompt_rows = self._logit_rows(rest)
        logits = self.model.compute_logits(self._rows(hidden, rows)) if rows else None
        if len(rest) < len(batch):
            ran = iter(zip(sample_rows, prompt_rows))
            sample_rows, prompt_rows = map(list, zip(*((-1, None) if blending else next(ran) for blending in blended)))
        return StepLogits(logits, sample_rows, prompt_rows)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's input ids, positions and attention metadata for `batch`."""
        input_ids: list[int] = []
        positions: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            # Slots are places in the cache; they trail token positions once a policy has evicted
            # (and lead them by `lead` in a stream's sequence after its frames left).
            first = start - seq.num_evicted + seq.lead
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(first + seq.rope_offset, first + n + seq.rope_offset))
        meta = self._meta(batch, lambda seq: seq.block_table)
        groups = self.storage.groups
        if groups is not None:
            # one view of the batch per table; each layer attends through its own table's (blocks the
            # window has passed are never read: block 0 stands in for them)
            tables = [meta] + [
                self._meta(batch, lambda seq, t=t: [0] * seq.window_first + seq.window_tables[t][seq.window_first :])
                for t in range(groups.num_window_tables)
            ]
            meta.layer_metas = [tables[t] for t in groups.layer_table]
        return self._tensor(input_ids), self._tensor(positions), meta

    def _meta(self, batch: list[ScheduledSeq], table_of) -> AttentionMetadata:
        """The batch's attention metadata through the block tables `table_of(seq)` gives."""
        bs = self.block_size
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_starts: list[int] = []
        prefills: list[PrefillChunk] = []
        steps: list[StepSeq] = []
        offset = 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            first = seq.num_computed_tokens - seq.num_evicted + seq.lead
            end = first + n
            table = table_of(seq)
            slots.extend(table[c // bs] * bs + c % bs for c in range(first, end))
            steps.append(self._step_seq(seq, first, end, table))
            num_blocks = -(-end // bs)
            if n == 1:
                decode_tables.append(table[:num_blocks])
                decode_lens.append(end)
                decode_starts.append(seq.lead)
            else:
                prefills.append(PrefillChunk(offset, offset + n, first, self._tensor(table[:num_blocks])))
            offset += n
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=prefills,
            block_size=bs,
            dtype=self.dtype,
        )
        if decode_tables:
            meta.decode_block_tables = table_tensor(decode_tables, self.device)
            meta.decode_context_lens = self._tensor(decode_lens)
            if any(decode_starts):
                meta.decode_starts = self._tensor(decode_starts)
        self.storage.prepare(steps, meta)
        return meta

    def _embeds(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, values) of the step's inputs given as embeddings rather than token ids, if any."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        offset = 0
        for item in batch:
            for first, part in item.seq.input_embeds(item.seq.num_computed_tokens, item.num_tokens):
                rows.append(torch.arange(offset + first, offset + first + part.shape[0]))
                values.append(part)
            offset += item.num_tokens
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values).to(self.device, self.dtype)

    @staticmethod
    def _step_seq(seq, first: int, end: int, table: list[int]) -> StepSeq:
        wanted = seq.kv_policy.score_range(seq) if seq.kv_state is not None else None
        if wanted is None:
            return StepSeq(first, end, table, lead=seq.lead)
        lo = max(first, wanted[0] - seq.num_evicted)
        hi = min(end, wanted[1] - seq.num_evicted)
        if lo >= hi:
            return StepSeq(first, end, table, lead=seq.lead)
        return StepSeq(first, end, table, seq.kv_state.scores, (lo, hi), seq.lead)

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
            if end == seq.num_tokens and seq.frames is None:  # a stream's frames are computed, not answered
                sample_rows.append(len(rows))
                rows.append(offset + item.num_tokens - 1)
            else:
                sample_rows.append(-1)
            offset += item.num_tokens
        return rows, sample_rows, prompt_rows

    def _tensor(self, values: list) -> torch.Tensor:
        return index_tensor(values, self.device)

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden[rows]: a view where the rows are consecutive (every decode step's), else a gather."""
        if rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
            return hidden[rows[0] : rows[-1] + 1]
        return hidden[self._tensor(rows)]
