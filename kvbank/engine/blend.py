"""Documents computed once and reused at any position of a prompt (CacheBlend, Yao et al., EuroSys '25).

A prompt may mark documents: spans of tokens (retrieved chunks, tool results) whose KV does not
depend on what comes before them, to a good approximation. Each document's KV is computed alone,
at positions 0..n-1, and kept in the pool under a chain of its own (`document_root`: the model, the
tenant's salt and nothing of the prompt around it), so its full blocks are cached, evicted, pinned
and sent to the tiers like any prefix's. A prompt that holds the document anywhere, in any order
with others, reuses them:

1. placement: the document's KV is copied into the prompt's own slots, keys rotated from 0..n-1 to
   the document's offset (one position delta, `KVStorage.move_tokens`);
2. the check layer: layer 0 runs over every token of the blended range (each attends to the whole
   prompt before it) and layer 1 projects their keys and values; a document token whose layer-1 K/V
   deviates most from the placed K/V lost the most context, and the `ratio` share of each
   document's tokens with the largest deviation is recomputed;
3. recompute: layers 1..L-1 run over the selected tokens and every token outside a document (the
   prompt between documents, the question, and a document's last partial block, which is not
   cached), each attending to the placed K/V and the recomputed K/V before it.

A ratio of 0 places the documents and computes only the tokens outside them; a ratio of 1 is the
full prefill (the prompt is computed as if it marked nothing). The blend covers the prompt up to the
end of its last document, in one step whatever the token budget, so the selection never depends on
how the prompt was chunked or what else ran: the same tokens alone or in any batch. What follows
the last document (the question) is computed as any prompt is; prompt logprobs are None for the
tokens the blend computed (it keeps no logits) and given after. Its blocks are approximate, so they are never
indexed in the prefix cache (a plain request for the same tokens recomputes them); the prompt
before its first document is cached as usual.
"""

from __future__ import annotations

import math
import time

import torch

from kvbank.attention import AttentionMetadata, PrefillChunk
from kvbank.attention.metadata import index_tensor, table_tensor
from kvbank.cache.layers import StepSeq
from kvbank.engine.blend_plan import CHECK_LAYER, BlendPlan, Document
from kvbank.engine.streams import PoolFull


class Blender:
    """Runs the blend of a prompt's documents (see the module's docstring) in one step."""

    def __init__(self, model, storage, manager, offload, new_sequence, prepare, rotation, max_chunk: int) -> None:
        self.model = model
        self.storage = storage
        self.manager = manager
        #: (tokens, chain root) -> a sequence of a prompt of its own (a document computed alone)
        self.new_sequence = new_sequence
        #: (sequence, tokens) -> the runner's input ids, positions and metadata for its next chunk
        self.prepare = prepare
        #: (cos, sin) rotating keys by a position delta
        self.rotation = rotation
        self.max_chunk = max_chunk
        self.block_size = storage.block_size
        self.device = storage.device
        #: the tiers' controller (cache/offload.py): documents computed alone go to the tiers, and
        #: the engine asks it for a prompt's missing documents (LLMEngine.add_request); None: no tiers
        self.offload = offload
        #: engine totals: documents reused and computed, tokens reused and recomputed, seconds
        self.totals = {"documents_reused": 0, "documents_computed": 0, "tokens_reused": 0, "tokens_recomputed": 0}
        self.seconds = 0.0

    @torch.inference_mode()
    def run(self, item) -> None:
        """Compute tokens [computed, computed + item.num_tokens) of a blended prompt."""
        started = time.perf_counter()
        seq, plan = item.seq, item.seq.request.blend
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
        placed = torch.zeros(end - start, dtype=torch.bool)
        owner = torch.full((end - start,), -1, dtype=torch.long)  # each row's document, -1: none
        try:
            for d, doc in enumerate(plan.documents):
                lo, hi = max(start, doc.start), min(end, plan.stored_end(doc, self.block_size))
                if lo < hi:
                    self._place(seq, plan, doc, lo, hi)
                    placed[lo - start : hi - start] = True
                    owner[lo - start : hi - start] = d
        finally:  # documents loaded from a tier are placed: their blocks stay cached, held no more
            self.manager.free_document_holds(seq)
        positions = torch.arange(start, end)
        if plan.ratio > 0 and bool(placed.any()):
            qkv, residual, rows = self._check(seq, plan, positions, placed, owner)
            first = CHECK_LAYER
        else:
            rows = positions[~placed]
            qkv, residual, first = None, None, 0
        if len(rows):
            self._layers(seq, rows, first, qkv, residual)
        logprobs = seq.request.prompt_logprobs
        if logprobs is not None:  # the blend's rows have no logits: tokens start + 1 .. end get None
            logprobs.extend([None] * (end + 1 - len(logprobs)))
        self.totals["tokens_reused"] += int(placed.sum())
        self.totals["tokens_recomputed"] += len(rows)
        self.seconds += time.perf_counter() - started

    def precompute(self, tokens: list[int], root: bytes) -> bool:
        """Compute and cache a document's whole blocks (`tokens`) unless the pool holds them all;
        True if it was computed."""
        _, computed = self._stored(tokens, root)
        if computed is not None:
            self.manager.free(computed)  # its full blocks stay cached (indexed)
            self.totals["documents_computed"] += 1
        return computed is not None

    def _stored(self, tokens: list[int], root: bytes):
        """The block ids holding a document's cached chain (`tokens`), computed alone first if the
        pool lacks any; and the sequence that computed them (the caller frees it), or None."""
        blocks = self.manager.cached_blocks(tokens, root)
        if len(blocks) * self.block_size >= len(tokens):
            return [b.block_id for b in blocks], None
        computed = self._compute_alone(tokens, root)
        return computed.block_table, computed

    # --- placement ----------------------------------------------------------------------------

    def _place(self, seq, plan: BlendPlan, doc: Document, lo: int, hi: int) -> None:
        """K/V of document tokens [lo, hi) copied from the document's cached blocks (computed alone
        first if they are not all cached) into `seq`'s slots, keys rotated by the document's offset."""
        blocks, computed = self._stored(plan.stored_tokens(doc, seq.token_ids, self.block_size), plan.root)
        self.totals["documents_reused" if computed is None else "documents_computed"] += 1
        try:
            lead = len(plan.lead)  # chain position of the document's token i: lead + i
            src = _slots(blocks, range(lo - doc.start + lead, hi - doc.start + lead), self.block_size)
            dst = _slots(seq.block_table, range(lo, hi), self.block_size)
            rotation = self.rotation(doc.start - lead) if doc.start != lead else None
            self.storage.move_tokens(index_tensor(src, self.device), index_tensor(dst, self.device), rotation)
        finally:
            if computed is not None:
                self.manager.free(computed)  # its full blocks stay cached (indexed) for the next prompt

    def _compute_alone(self, tokens: list[int], root: bytes):
        """A document's tokens prefilled as a prompt of their own under `root`, its full blocks
        indexed; returns the sequence that holds them (the caller frees it)."""
        doc = self.new_sequence(tokens, root)
        if not self.manager.can_allocate(doc):
            raise PoolFull(
                f"the KV pool has no room to compute a document of {len(tokens)} tokens "
                f"({self.manager.num_free_blocks} blocks free)"
            )
        self.manager.allocate(doc)
        try:
            while doc.num_computed_tokens < len(tokens):
                n = min(self.max_chunk, len(tokens) - doc.num_computed_tokens)
                input_ids, positions, meta = self.prepare(doc, n)
                self.model(input_ids, positions, self.storage.layers, meta)
                doc.num_computed_tokens += n
                self.manager.commit(doc)
                if self.offload is not None:  # write-through sends each whole chunk to the tiers
                    self.offload.on_commit(doc)
        except BaseException:
            self.manager.free(doc)
            raise
        if self.offload is not None:
            self.offload.on_finish(doc)
        return doc

    # --- the check layer and the recompute ------------------------------------------------------

    def _check(self, seq, plan: BlendPlan, positions, placed, owner):
        """Layer 0 over every row, layer 1's K/V compared with the placed K/V; returns layer 1's
        q/k/v and residual stream of the rows to recompute, and their positions."""
        layers, table = self.model.layers, seq.block_table
        x, cos, sin = self._inputs(seq, positions)
        meta = self._chunk_meta(table, int(positions[0]), int(positions[-1]) + 1)
        x, residual = layers[0](x, None, cos, sin, self.storage.layers[0], meta)
        qkv, residual = layers[CHECK_LAYER].attn_in(x, residual, cos, sin)
        attn = layers[CHECK_LAYER].self_attn
        n = len(positions)
        _, k, v = qkv[:n].split(attn.sizes, dim=-1)
        where = torch.nonzero(placed).flatten()
        slots = index_tensor(_slots(table, positions[where].tolist(), self.block_size), self.device)
        keys, values = self.storage.gather_tokens(slots)
        deviation = kv_deviation(k[where], v[where], keys[CHECK_LAYER].flatten(1), values[CHECK_LAYER].flatten(1))
        chosen = ~placed
        for d in range(len(plan.documents)):
            mine = torch.nonzero(owner[where] == d).flatten()
            if len(mine):
                take = math.ceil(plan.ratio * len(mine))
                # the largest deviations; among equal ones the earlier token (a stable order)
                order = torch.sort(deviation[mine], descending=True, stable=True).indices[:take]
                chosen[where[mine[order]]] = True
        rows = torch.nonzero(chosen).flatten()
        return qkv[rows], residual[rows], positions[rows]

    def _layers(self, seq, positions, first: int, qkv, residual) -> None:
        """Layers `first`.. over the rows at `positions`; past layer 0 they start from that layer's
        q/k/v and residual stream (`_check`)."""
        layers, table = self.model.layers, seq.block_table
        x, cos, sin = self._inputs(seq, positions)  # past layer 0 only the padded rotary tables serve
        rows = x.shape[0]
        meta = self._rows_meta(table, positions.tolist())
        for index in range(first, len(layers)):
            layer = layers[index]
            if index == first and first > 0:
                qkv, residual = self._pad(qkv, rows), self._pad(residual, rows)
            else:
                qkv, residual = layer.attn_in(x, None if index == 0 else residual, cos, sin)
            x, residual = layer.attn_out(layer.self_attn.attend(qkv, self.storage.layers[index], meta), residual)

    def _inputs(self, seq, positions):
        ids = index_tensor([seq.token_ids[p] for p in positions.tolist()], self.device)
        x, padded = self.model.embed(ids, positions.to(self.device), None)
        return x, self.model.rope_cos[padded], self.model.rope_sin[padded]

    @staticmethod
    def _pad(rows: torch.Tensor, n: int) -> torch.Tensor:
        return rows if rows.shape[0] == n else torch.nn.functional.pad(rows, (0, 0, 0, n - rows.shape[0]))

    def _chunk_meta(self, table: list[int], start: int, end: int) -> AttentionMetadata:
        """Metadata of tokens [start, end) of one sequence computed as one prefill chunk."""
        bs = self.block_size
        meta = AttentionMetadata(
            slot_mapping=index_tensor(_slots(table, range(start, end), bs), self.device),
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_context_lens=None,
            prefills=[PrefillChunk(0, end - start, start, index_tensor(table[: -(-end // bs)], self.device))],
            block_size=bs,
            dtype=self.storage.dtype,
        )
        self.storage.prepare([StepSeq(start, end, table)], meta)
        return meta

    def _rows_meta(self, table: list[int], positions: list[int]) -> AttentionMetadata:
        """Metadata of single tokens of one sequence at `positions`: each a row that attends to
        every slot up to its own, as a decode does."""
        bs = self.block_size
        meta = AttentionMetadata(
            slot_mapping=index_tensor(_slots(table, positions, bs), self.device),
            num_decode_tokens=len(positions),
            decode_block_tables=table_tensor([table[: p // bs + 1] for p in positions], self.device),
            decode_context_lens=index_tensor([p + 1 for p in positions], self.device),
            prefills=[],
            block_size=bs,
            dtype=self.storage.dtype,
        )
        self.storage.prepare([StepSeq(p, p + 1, table) for p in positions], meta)
        return meta


def kv_deviation(k: torch.Tensor, v: torch.Tensor, placed_k: torch.Tensor, placed_v: torch.Tensor) -> torch.Tensor:
    """Per token, the squared distance of its computed K and V ([tokens, kv_size] each) from the
    placed ones: how much context the placed K/V lack (the selection's score)."""
    return (k.float() - placed_k.float()).square().sum(1) + (v.float() - placed_v.float()).square().sum(1)


def _slots(table: list[int], positions, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]
