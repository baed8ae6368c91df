"""What long-context policies do to a sequence's cache: drop blocks, re-rotate keys, compact slots.

A policy (cache/policies/) decides; `KVEditor` carries it out on the block tables (through the
manager) and on the pool's tensors (through the storage), keeping three rules:
- a block another sequence shares, or that the prefix index lists, is never written: it is
  replaced by a private copy first (its content stays valid for whoever else finds it);
- once a sequence has evicted anything its later blocks are not the full computation of its
  tokens, so they are never published to the prefix index (`KVCacheManager.commit` checks);
- keys are rotated from unrotated ("pristine") copies where they would otherwise be rotated again
  and again, so bfloat16 rounding does not pile up.

Slots and positions: slot s of a sequence is `block_table[s // block_size]`, offset
`s % block_size`; its new tokens go to slots `num_computed_tokens - num_evicted + lead` onwards,
at RoPE position slot + `rope_offset` (`lead`: a stream's first slots that hold no token once
frames left, see `remove_tokens`; attention starts each of its rows there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvbank.attention.rope import rotation_tables
from kvbank.cache.frames import token_slots
from kvbank.cache.limits import Limits
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.storage import KVStorage


@dataclass
class ScoreState:
    """Accumulated attention per layer, KV head and slot, for policies that rank tokens.

    `kept[l, h, j]` is the token index held by slot j of layer l, head h for the slots compacted so
    far (`kept.shape[-1]` of them); later slots hold token `slot + num_evicted`.
    """

    scores: torch.Tensor
    kept: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, capacity: int, device: torch.device) -> ScoreState:
        return cls(
            torch.zeros(num_layers, num_kv_heads, capacity, device=device),
            torch.zeros(num_layers, num_kv_heads, 0, dtype=torch.long),  # bookkeeping stays on the CPU
        )

    def cleared(self) -> ScoreState:
        """Empty buffers of the same shape (the sequence is recomputed from its first token)."""
        return ScoreState(torch.zeros_like(self.scores), self.kept[..., :0].clone())

    def clone(self) -> ScoreState:
        return ScoreState(self.scores.clone(), self.kept.clone())


class PolicySeq(Protocol):
    """What the editor and the policies read and write of a sequence."""

    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    block_table: list[int]
    num_evicted: int
    rope_offset: int
    pristine_blocks: list[int]
    kv_state: ScoreState | None
    lead: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def num_pending(self) -> int: ...


class KVEditor:
    """Applies policies' evictions to block tables and pool tensors."""

    def __init__(
        self, manager: KVCacheManager, storage: KVStorage, limits: Limits, inv_freq: torch.Tensor, rope_len: int
    ) -> None:
        self.manager = manager
        self.storage = storage
        self.limits = limits
        self.inv_freq = inv_freq.float().cpu()
        #: positions the model's rotary tables cover
        self.rope_len = rope_len

    # --- shifting -----------------------------------------------------------------------------

    def drop_blocks(self, seq: PolicySeq, first: int, count: int) -> None:
        """Remove blocks first..first+count-1 from the table; later slots move down by count blocks."""
        pool = self.manager.pool
        for block_id in seq.block_table[first : first + count]:
            pool.release(pool.blocks[block_id])
        del seq.block_table[first : first + count]
        seq.num_evicted += count * self.limits.block_size

    def shift_leading(self, seq: PolicySeq, keep: int, delta: int) -> None:
        """Every later key moved down by `delta` slots without being touched: raise the offset of
        new positions by `delta` and rotate the first `keep` blocks' keys forward to match."""
        seq.rope_offset += delta
        if keep:
            self._rotate_leading(seq, keep)

    def needs_rebase(self, seq: PolicySeq, chunk_tokens: int) -> bool:
        """Whether the next chunk's positions could run past the rotary tables."""
        return seq.num_slots + seq.rope_offset + chunk_tokens > self.rope_len

    def rebase(self, seq: PolicySeq, keep: int) -> None:
        """Rotate the kept recent keys back by the offset so that positions start at 0 again."""
        if seq.rope_offset == 0:
            return
        indices = range(keep, len(seq.block_table))
        self._make_private(seq, indices)
        blocks = [seq.block_table[i] for i in indices]
        self.storage.rotate_keys(blocks, blocks, self.rotation(-seq.rope_offset))
        seq.rope_offset = 0
        if keep:
            self._rotate_leading(seq, keep)

    def _rotate_leading(self, seq: PolicySeq, keep: int) -> None:
        self._pristine_leading(seq, keep)
        self.storage.rotate_keys(seq.pristine_blocks, seq.block_table[:keep], self.rotation(seq.rope_offset))

    def _pristine_leading(self, seq: PolicySeq, count: int) -> None:
        """Make the first `count` blocks private, keeping unrotated copies of them aside once."""
        if seq.pristine_blocks:
            self._make_private(seq, range(count))  # a forked sibling may share them
            return
        # Before the first eviction every key sits at its slot: the blocks as computed are the
        # unrotated copies, and the table gets private ones.
        copies = []
        for i in range(count):
            fresh = self.manager.pool.take()
            copies.append((seq.block_table[i], fresh.block_id))
            seq.pristine_blocks.append(seq.block_table[i])
            seq.block_table[i] = fresh.block_id
        self.storage.copy_blocks(copies)

    def rotation(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) that rotate keys by `delta` positions."""
        cos, sin = rotation_tables(torch.tensor([delta]), self.inv_freq)
        return cos[0], sin[0]

    def _make_private(self, seq: PolicySeq, indices) -> None:
        pool, copies = self.manager.pool, []
        for i in indices:
            block = pool.blocks[seq.block_table[i]]
            if block.ref_count > 1 or block.hash is not None:
                fresh = pool.take()
                copies.append((block.block_id, fresh.block_id))
                pool.release(block)
                seq.block_table[i] = fresh.block_id
        if copies:
            self.storage.copy_blocks(copies)

    # --- removing a span of tokens (a stream's frames) ------------------------------------------

    def remove_tokens(self, seq: PolicySeq, first: int, count: int, keep: int) -> None:
        """Tokens [first, first + count) leave the sequence and its cache; `first` is `keep`, the
        tokens kept for good (the system prompt and sinks).

        Nothing after them moves: token i sits at slot `seq.lead + i`, and the lead grows by
        `count` (whole blocks it passes leave the table), so every later token keeps its slot,
        its block and its key, whatever the layout stores per block (KIVI's key ranges). New
        positions rise by as much as the slots fell (positions are slots + rope_offset); the
        kept leading tokens are written again just before the window, rotated from unrotated
        copies to the positions they take there."""
        bs, lead = self.limits.block_size, seq.lead
        assert seq.num_evicted == 0 and keep == first and first + count <= seq.num_computed_tokens
        if keep and not seq.pristine_blocks:
            assert lead == 0  # the first eviction: every key still sits at its slot
            self._pristine_leading(seq, blocks_for(keep, bs))
        drop = (lead + count) // bs
        pool = self.manager.pool
        for block_id in seq.block_table[:drop]:
            pool.release(pool.blocks[block_id])
        del seq.block_table[:drop]
        seq.lead = (lead + count) % bs
        del seq.token_ids[first : first + count]
        seq.num_computed_tokens -= count
        seq.rope_offset += drop * bs
        self._write_kept(seq, keep)
        if self.needs_rebase(seq, self.limits.chunk_tokens):
            self.rebase_tokens(seq, keep)

    def rebase_tokens(self, seq: PolicySeq, keep: int) -> None:
        """`rebase` for a sequence whose kept leading span is `keep` tokens rather than whole blocks."""
        if seq.rope_offset == 0:
            return
        indices = range((seq.lead + keep) // self.limits.block_size, len(seq.block_table))
        self._make_private(seq, indices)
        blocks = [seq.block_table[i] for i in indices]
        self.storage.rotate_keys(blocks, blocks, self.rotation(-seq.rope_offset))
        seq.rope_offset = 0
        self._write_kept(seq, keep)

    def _write_kept(self, seq: PolicySeq, keep: int) -> None:
        """Tokens 0..keep-1 at slots lead.. from their unrotated copies, each rotated on the way to
        its slot's position (pristine token j sits at position j; slot lead + j is position
        lead + j + rope_offset); values move as stored. The slots before the lead, which no row
        reads, get copies of token 0, so that a layout quantizing a block's keys together (KIVI)
        fits its ranges to the tokens it holds rather than to whatever left those slots."""
        if not keep:
            return
        bs, lead = self.limits.block_size, seq.lead
        self._make_private(seq, range(blocks_for(lead + keep, bs)))  # a forked sibling may share them
        src = token_slots(seq.pristine_blocks, 0, keep, bs)
        src = torch.cat((src[:1].expand(lead), src))
        dst = token_slots(seq.block_table, 0, lead + keep, bs)
        self.storage.move_tokens(src, dst, self.rotation(lead + seq.rope_offset))

    # --- compacting ---------------------------------------------------------------------------

    def compact(self, seq: PolicySeq, keep: torch.Tensor) -> int:
        """Keep, in every layer l and KV head h, the slots `keep[l, h]` (ascending, the same count
        everywhere), moved to the first slots; blocks past them are freed. Returns tokens evicted."""
        bs, pool = self.limits.block_size, self.manager.pool
        keep = keep.cpu()
        count, slots = keep.shape[-1], seq.num_slots
        old_table = list(seq.block_table)
        old = torch.tensor(old_table, dtype=torch.long)
        src = old[keep // bs] * bs + keep % bs
        # Destination blocks are private and unindexed: fresh ones replace any that are not.
        needed = blocks_for(count, bs)
        table = []
        for block_id in old_table[:needed]:
            block = pool.blocks[block_id]
            table.append(block_id if block.ref_count == 1 and block.hash is None else pool.take().block_id)
        dst_slots = torch.arange(count)
        dst = torch.tensor(table, dtype=torch.long)[dst_slots // bs] * bs + dst_slots % bs
        self.storage.move_slots(src, dst.expand_as(src))
        for block_id in set(old_table) - set(table):
            pool.release(pool.blocks[block_id])
        seq.block_table = table
        state = seq.kv_state
        if state is not None:
            held = self._held_tokens(seq, state, slots)
            state.kept = held.gather(-1, keep)
            kept_scores = state.scores[..., :slots].gather(-1, keep.to(state.scores.device))
            state.scores.zero_()
            state.scores[..., :count] = kept_scores
        # Kept keys keep their own rotation: new tokens go on at their own positions too.
        seq.num_evicted += slots - count
        seq.rope_offset += slots - count
        return slots - count

    def _held_tokens(self, seq: PolicySeq, state: ScoreState, slots: int) -> torch.Tensor:
        compacted = state.kept.shape[-1]
        later = torch.arange(compacted, slots) + seq.num_evicted
        return torch.cat((state.kept, later.expand(*state.kept.shape[:-1], slots - compacted)), dim=-1)

    def held_tokens(self, seq: PolicySeq, num_layers: int, num_kv_heads: int) -> torch.Tensor:
        """[layers, kv_heads, slots]: the token index each slot of `seq` holds now."""
        if seq.kv_state is not None:
            return self._held_tokens(seq, seq.kv_state, seq.num_slots)
        bs = self.limits.block_size
        keep = bs * len(seq.pristine_blocks)
        tokens = torch.cat((torch.arange(keep), torch.arange(keep + seq.num_evicted, seq.num_computed_tokens)))
        return tokens.expand(num_layers, num_kv_heads, tokens.shape[0])
